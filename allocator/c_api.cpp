// The C ABI: the only process-wide state of the library.
//
// Every entry point runs its body through guard(), which turns each exception into a
// status code and a thread-local message "dfa_<call>: <cause>", so nothing crosses the
// ABI.  The instance is created once (dfa_init or first use) and torn down by
// dfa_shutdown; a shared mutex lets calls run concurrently while init/shutdown are
// exclusive.
#include <deferalloc/context.hpp>
#include <deferalloc/deferalloc.h>
#include <deferalloc/errors.hpp>

#include <cstdlib>
#include <memory>
#include <new>
#include <shared_mutex>
#include <string>

namespace {

using namespace deferalloc;

thread_local std::string t_last_error;
std::shared_mutex g_mu;
std::unique_ptr<context> g_ctx;

template <typename F>
dfa_status guard(const char* call, F&& body) noexcept {
  try {
    body();
    t_last_error.clear();
    return DFA_SUCCESS;
  } catch (const no_device& e) {
    t_last_error = std::string(call) + ": " + e.what();
    return DFA_ERROR_NO_DEVICE;
  } catch (const cuda_error& e) {
    t_last_error = std::string(call) + ": " + e.what();
    return DFA_ERROR_CUDA;
  } catch (const invalid_argument& e) {
    t_last_error = std::string(call) + ": " + e.what();
    return DFA_ERROR_INVALID_ARGUMENT;
  } catch (const invalid_state& e) {
    t_last_error = std::string(call) + ": " + e.what();
    return DFA_ERROR_INVALID_STATE;
  } catch (const out_of_memory& e) {
    t_last_error = std::string(call) + ": " + e.what();
    return DFA_ERROR_OUT_OF_MEMORY;
  } catch (const io_error& e) {
    t_last_error = std::string(call) + ": " + e.what();
    return DFA_ERROR_IO;
  } catch (const corrupt_data& e) {
    t_last_error = std::string(call) + ": " + e.what();
    return DFA_ERROR_CORRUPT;
  } catch (const std::bad_alloc&) {
    t_last_error = std::string(call) + ": host memory exhausted";
    return DFA_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    t_last_error = std::string(call) + ": internal error: " + e.what();
    return DFA_ERROR_INTERNAL;
  } catch (...) {
    t_last_error = std::string(call) + ": internal error: unknown exception";
    return DFA_ERROR_INTERNAL;
  }
}

settings env_settings() {
  const char* env = std::getenv("DEFERALLOC_CONF");
  return parse_settings(env ? env : "");
}

// The instance, created from DEFERALLOC_CONF on first use.  Returns with `lk` held shared.
context& instance(std::shared_lock<std::shared_mutex>& lk) {
  lk = std::shared_lock(g_mu);
  if (g_ctx) return *g_ctx;
  lk.unlock();
  {
    std::unique_lock ex(g_mu);
    if (!g_ctx) g_ctx = std::make_unique<context>(env_settings());
  }
  lk.lock();
  return *g_ctx;
}

template <typename T>
void need(const T* p, const char* what) {
  if (p == nullptr) throw invalid_argument(std::string(what) + " is null");
}

}  // namespace

extern "C" {

dfa_status dfa_init(const char* conf) {
  return guard("dfa_init", [&] {
    std::unique_lock ex(g_mu);
    if (g_ctx) throw invalid_state("already initialized (call dfa_shutdown first)");
    g_ctx = std::make_unique<context>(conf ? parse_settings(conf) : env_settings());
  });
}

dfa_status dfa_shutdown(void) {
  return guard("dfa_shutdown", [&] {
    std::unique_lock ex(g_mu);
    g_ctx.reset();
  });
}

const char* dfa_last_error(void) { return t_last_error.c_str(); }

dfa_status dfa_driver_name(const char** out) {
  return guard("dfa_driver_name", [&] {
    need(out, "out");
    std::shared_lock<std::shared_mutex> lk;
    static thread_local std::string name;
    name = instance(lk).drv->name();
    *out = name.c_str();
  });
}

dfa_status dfa_granularity(size_t* out) {
  return guard("dfa_granularity", [&] {
    need(out, "out");
    std::shared_lock<std::shared_mutex> lk;
    *out = instance(lk).drv->granularity();
  });
}

dfa_status dfa_reserve(size_t bytes, dfa_reservation* out, void** address) {
  return guard("dfa_reserve", [&] {
    need(out, "out");
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    reservation_id id = m.reserve(bytes);
    *out = id;
    if (address) *address = m.address(id);
  });
}

dfa_status dfa_materialize(dfa_reservation r, size_t offset, size_t length, dfa_fill fill, void* stream) {
  return guard("dfa_materialize", [&] {
    if (fill != DFA_FILL_UNDEFINED && fill != DFA_FILL_ZERO && fill != DFA_FILL_RESTORE)
      throw invalid_argument("fill must be DFA_FILL_UNDEFINED, DFA_FILL_ZERO or DFA_FILL_RESTORE");
    std::shared_lock<std::shared_mutex> lk;
    instance(lk).reservations->materialize(r, offset, length, static_cast<fill_mode>(fill), stream);
  });
}

dfa_status dfa_release(dfa_reservation r, size_t offset, size_t length, dfa_keep keep, void* stream) {
  return guard("dfa_release", [&] {
    if (keep != DFA_KEEP_DISCARD && keep != DFA_KEEP_HOST)
      throw invalid_argument("keep must be DFA_KEEP_DISCARD or DFA_KEEP_HOST");
    std::shared_lock<std::shared_mutex> lk;
    instance(lk).reservations->release(r, offset, length, static_cast<keep_mode>(keep), stream);
  });
}

dfa_status dfa_record_stream(dfa_reservation r, void* stream) {
  return guard("dfa_record_stream", [&] {
    std::shared_lock<std::shared_mutex> lk;
    instance(lk).reservations->record_stream(r, stream);
  });
}

dfa_status dfa_free(dfa_reservation r, void* stream) {
  return guard("dfa_free", [&] {
    std::shared_lock<std::shared_mutex> lk;
    instance(lk).reservations->free(r, stream);
  });
}

dfa_status dfa_is_backed(dfa_reservation r, size_t offset, size_t length, int* out) {
  return guard("dfa_is_backed", [&] {
    need(out, "out");
    std::shared_lock<std::shared_mutex> lk;
    *out = instance(lk).reservations->is_backed(r, offset, length) ? 1 : 0;
  });
}

dfa_status dfa_find(const void* ptr, dfa_reservation* out) {
  return guard("dfa_find", [&] {
    need(out, "out");
    need(ptr, "ptr");
    std::shared_lock<std::shared_mutex> lk;
    auto id = instance(lk).reservations->find(ptr);
    if (!id) throw invalid_argument("pointer is not inside any reservation");
    *out = *id;
  });
}

dfa_status dfa_trim(size_t keep_bytes, size_t* released) {
  return guard("dfa_trim", [&] {
    std::shared_lock<std::shared_mutex> lk;
    size_t n = instance(lk).pool->trim(keep_bytes);
    if (released) *released = n;
  });
}

dfa_status dfa_get_stats(dfa_stats* out) {
  return guard("dfa_get_stats", [&] {
    need(out, "out");
    std::shared_lock<std::shared_mutex> lk;
    reservation_stats s = instance(lk).reservations->stats();
    dfa_stats d{};
    d.reservations = s.reservations;
    d.reserved_bytes = s.reserved_bytes;
    d.backed_bytes = s.backed_bytes;
    d.peak_backed_bytes = s.peak_backed_bytes;
    d.backup_bytes = s.backup_bytes;
    d.pool_alive_bytes = s.pool.alive_bytes;
    d.pool_cached_bytes = s.pool.cached_bytes;
    d.pinned_bytes = s.pinned.in_use_bytes + s.pinned.cached_bytes;
    d.chunks_created = s.pool.chunks_created;
    d.chunks_reused = s.pool.chunks_reused;
    for (int i = 0; i < 8; ++i) d.driver_calls[i] = s.pool.driver_calls.calls[i];
    *out = d;
  });
}

}  // extern "C"
