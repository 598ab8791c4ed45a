// The C ABI: the instance and its errors.
//
// Every entry point of the C ABI runs its body through guard() (process_state.hpp), which
// turns each exception into a status code and a thread-local message "dfa_<call>: <cause>",
// so nothing crosses the ABI.  The instance is created once (dfa_init or first use) and
// torn down by dfa_shutdown (not by the exit of the process: Note [Process lifetime] in
// process_state.cpp); a shared mutex lets calls run concurrently while init/shutdown are
// exclusive.  The other entry points: c_api_reservations.cpp (the reservation calls and
// DLPack) and c_api_caching.cpp (PyTorch's allocator interface, tags, statistics).
#include <deferalloc/core/errors.hpp>
#include <deferalloc/deferalloc.h>

#include <memory>
#include <mutex>
#include <string>

#include "fault_report.hpp"
#include "log.hpp"
#include "process_state.hpp"

using namespace deferalloc;
using namespace deferalloc::abi;

extern "C" {

dfa_status dfa_init(const char* conf) {
  return guard("dfa_init", [&] {
    std::unique_lock ex(g_mu);
    if (g_ctx) throw invalid_state("already initialized (call dfa_shutdown first)");
    g_ctx = std::make_unique<context>(conf ? parse_settings(conf) : env_settings());
    on_new_instance(*g_ctx);
  });
}

dfa_status dfa_shutdown(void) {
  return guard("dfa_shutdown", [&] {
    std::unique_lock ex(g_mu);
    g_allocs.clear();
    g_ctx.reset();
    {
      std::lock_guard ids(g_ids_mu);
      g_ids.clear();
      g_hidden.clear();
    }
    detail::faults().clear();
    g_report_faults.store(false);
    g_history.store(0);
    g_generation.fetch_add(1);  // drops every thread's tagged regions (thread_tags)
  });
}

const char* dfa_last_error(void) { return t_last_error.c_str(); }

const char* dfa_last_refusal(void) { return t_last_refusal.c_str(); }

void dfa_clear_last_refusal(void) { t_last_refusal.clear(); }

dfa_status dfa_set_log_callback(dfa_log_fn fn, void* user, int level) {
  return guard("dfa_set_log_callback", [&] {
    if (level < 0 || level > static_cast<int>(log_level::debug)) throw invalid_argument("level must be 0 .. 4");
    detail::set_log_sink(fn, user, static_cast<log_level>(level));
  });
}

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

dfa_status dfa_trim(size_t keep_bytes, size_t* released) {
  return guard("dfa_trim", [&] {
    std::shared_lock<std::shared_mutex> lk;
    auto& inst = instance(lk);
    size_t n = inst.pool->trim(keep_bytes);
    inst.reservations->trim_backup_cache(0);  // cached pinned backup buffers too (host memory)
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
