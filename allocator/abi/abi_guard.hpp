// The C ABIs' boundary (include/deferalloc/deferalloc.h and optimizer.h): every entry
// point runs its body through abi_guard(), which maps each exception to a dfa_status and
// sets the library's thread-local message "<call>: <cause>".  Nothing throws past it.
// Internal header, shared by allocator/c_api.cpp and optimizer/c_api_optimizer.cpp.
#pragma once
#include <deferalloc/deferalloc.h>
#include <deferalloc/errors.hpp>

#include <new>
#include <string>

namespace deferalloc::detail {

/// Runs `body`; returns DFA_SUCCESS and clears `last_error`, or the status of the
/// exception it threw with `last_error` = "<call>: <what>".  Never throws.
template <typename F>
dfa_status abi_guard(const char* call, std::string& last_error, F&& body) noexcept {
  auto fail = [&](dfa_status st, const char* prefix, const char* what) noexcept {
    try {
      last_error = std::string(call) + ": " + prefix + what;
    } catch (...) {  // no memory for the message: the status still says what happened
    }
    return st;
  };
  try {
    body();
    last_error.clear();
    return DFA_SUCCESS;
  } catch (const no_device& e) {
    return fail(DFA_ERROR_NO_DEVICE, "", e.what());
  } catch (const cuda_error& e) {
    return fail(DFA_ERROR_CUDA, "", e.what());
  } catch (const invalid_argument& e) {
    return fail(DFA_ERROR_INVALID_ARGUMENT, "", e.what());
  } catch (const invalid_state& e) {
    return fail(DFA_ERROR_INVALID_STATE, "", e.what());
  } catch (const out_of_memory& e) {
    return fail(DFA_ERROR_OUT_OF_MEMORY, "", e.what());
  } catch (const io_error& e) {
    return fail(DFA_ERROR_IO, "", e.what());
  } catch (const corrupt_data& e) {
    return fail(DFA_ERROR_CORRUPT, "", e.what());
  } catch (const std::bad_alloc&) {
    return fail(DFA_ERROR_OUT_OF_MEMORY, "", "host memory exhausted");
  } catch (const std::exception& e) {
    return fail(DFA_ERROR_INTERNAL, "internal error: ", e.what());
  } catch (...) {
    return fail(DFA_ERROR_INTERNAL, "internal error: ", "unknown exception");
  }
}

/// @throws invalid_argument "<what> is null" for a null pointer argument.
inline void need(const void* p, const char* what) {
  if (p == nullptr) throw invalid_argument(std::string(what) + " is null");
}

}  // namespace deferalloc::detail
