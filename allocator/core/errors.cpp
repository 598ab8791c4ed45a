// The one mapping between exceptions and dfa_status codes (include/deferalloc/core/errors.hpp).
#include <deferalloc/core/errors.hpp>

#include <new>

namespace deferalloc {

dfa_status status_of(const std::exception_ptr& e) noexcept {
  if (!e) return DFA_SUCCESS;
  try {
    std::rethrow_exception(e);
  } catch (const no_device&) {  // before cuda_error, its base
    return DFA_ERROR_NO_DEVICE;
  } catch (const cuda_error&) {
    return DFA_ERROR_CUDA;
  } catch (const invalid_argument&) {
    return DFA_ERROR_INVALID_ARGUMENT;
  } catch (const invalid_state&) {
    return DFA_ERROR_INVALID_STATE;
  } catch (const out_of_memory&) {
    return DFA_ERROR_OUT_OF_MEMORY;
  } catch (const io_error&) {
    return DFA_ERROR_IO;
  } catch (const corrupt_data&) {
    return DFA_ERROR_CORRUPT;
  } catch (const std::bad_alloc&) {
    return DFA_ERROR_OUT_OF_MEMORY;
  } catch (...) {
    return DFA_ERROR_INTERNAL;
  }
}

namespace {
template <typename E>
[[noreturn]] void raise(const std::string& msg, bool nest) {
  if (nest) std::throw_with_nested(E(msg));  // inside a handler only: nests the one handled
  throw E(msg);
}

[[noreturn]] void throw_as(dfa_status st, const std::string& msg, bool nest) {
  switch (st) {
    case DFA_ERROR_INVALID_ARGUMENT: raise<invalid_argument>(msg, nest);
    case DFA_ERROR_INVALID_STATE: raise<invalid_state>(msg, nest);
    case DFA_ERROR_OUT_OF_MEMORY: raise<out_of_memory>(msg, nest);
    case DFA_ERROR_CUDA: raise<cuda_error>(msg, nest);
    case DFA_ERROR_NO_DEVICE: raise<no_device>(msg, nest);
    case DFA_ERROR_IO: raise<io_error>(msg, nest);
    case DFA_ERROR_CORRUPT: raise<corrupt_data>(msg, nest);
    case DFA_SUCCESS: throw invalid_argument("throw_status: DFA_SUCCESS is not an error (" + msg + ")");
    default: raise<error>(msg, nest);
  }
}
}  // namespace

void throw_status(dfa_status st, const std::string& msg) { throw_as(st, msg, false); }

std::string message_of(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const std::bad_alloc&) {
    return "host memory exhausted";
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

void rethrow_with_context(const std::string& context, const std::exception_ptr& e) {
  if (!e) throw error(context + ": (no exception to rethrow)");
  try {
    std::rethrow_exception(e);
  } catch (...) {  // handling `e`, so that throw_with_nested nests it
    throw_as(status_of(e), context + ": " + message_of(e), true);
  }
}

}  // namespace deferalloc
