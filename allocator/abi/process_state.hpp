// The C ABI's process-wide state and the helpers its entry points share (internal; defined
// in process_state.cpp, Note [Process lifetime] and Note [Reservations of the ABI] there).
#pragma once
#include <deferalloc/caching/caching_allocator.hpp>
#include <deferalloc/core/context.hpp>
#include <deferalloc/core/errors.hpp>
#include <deferalloc/deferalloc.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "abi_guard.hpp"
#include "log.hpp"

namespace deferalloc::abi {

using detail::need;

/// This thread's last error message (dfa_last_error).
extern thread_local std::string t_last_error;
/// Why this thread's last dfa_malloc returned NULL (dfa_last_refusal).
extern thread_local std::string t_last_refusal;

/// Init and shutdown hold it exclusively, every other call shared.
extern std::shared_mutex& g_mu;
/// The instance (dfa_init, or DEFERALLOC_CONF on first use).
extern std::unique_ptr<context>& g_ctx;

/// One caching allocator per device, on g_ctx (its device) or on a context of its own.
struct device_allocator {
  std::unique_ptr<context> own;
  std::unique_ptr<caching_allocator> alloc;
};
extern std::map<int, std::unique_ptr<device_allocator>>& g_allocs;  // guarded by g_mu
extern std::atomic<std::uint64_t> g_generation;                      // bumped by dfa_shutdown
extern std::atomic<bool> g_report_faults;                            // the instance runs on the host driver
extern std::atomic<std::size_t> g_history;                           // dfa_record_memory_history's max_entries

/// The tagged regions of the calling thread (dfa_tag_begin/end) in the current instance.
std::vector<std::string>& thread_tags();

/// The ids dfa_reserve handed out (Note [Reservations of the ABI]).
extern std::mutex& g_ids_mu;
extern std::unordered_set<dfa_reservation>& g_ids;  // guarded by g_ids_mu
/// Reservations their owner hid from dfa_find (dfa_hide_reservation), with the owner's words.
extern std::unordered_map<dfa_reservation, std::string>& g_hidden;  // guarded by g_ids_mu
bool handed_out(dfa_reservation r);
/// Throws invalid_argument unless dfa_reserve handed `r` out.
void expect_handed_out(const reservation_manager& m, dfa_reservation r);

/// Called with g_mu held exclusively once an instance exists.
void on_new_instance(const context& c);
/// Lists the caching allocator's segment holding `block` for the fault report (host driver).
void note_segment(caching_allocator& a, const void* block);

// The body's log lines are delivered when it has returned or thrown, its locks (g_mu, the
// allocators', the manager's) released: Note [Logging outside locks] in log.hpp.  The hold
// closes inside abi_guard, before the call's error message is stored: a callback that
// calls the library (dfa_free succeeds and clears dfa_last_error) cannot wipe it.
template <typename F>
dfa_status guard(const char* call, F&& body) noexcept {
  return detail::abi_guard(call, t_last_error, [&] {
    detail::log_hold hold;
    body();
  });
}

/// The settings DEFERALLOC_CONF gives (defaults where it is unset).
settings env_settings();
/// The instance, created from DEFERALLOC_CONF on first use.  Returns with `lk` held shared.
context& instance(std::shared_lock<std::shared_mutex>& lk);
/// The caching allocator of `device` (-1: the instance's), created on first use.
/// Returns with `lk` held shared.
caching_allocator& allocator_for(int device, std::shared_lock<std::shared_mutex>& lk);
/// Every caching allocator created so far (g_mu held shared by the caller).
std::vector<caching_allocator*> all_allocators();

// Applies `f` to the allocator that holds `ptr`; none: invalid_argument.
template <typename F>
void for_owner(const void* ptr, F&& f) {
  need(ptr, "ptr");
  std::shared_lock<std::shared_mutex> lk;
  allocator_for(-1, lk);
  for (caching_allocator* a : all_allocators())
    if (a->owns(ptr)) return f(*a);
  throw invalid_argument("pointer is not inside an allocation of deferalloc");
}

/// The "size it first" convention of dfa_memory_stats and dfa_tag_names.
void copy_text(const std::string& text, char* buf, size_t cap, size_t* needed);
/// Logs this thread's last error for a call that returns none (the hooks, the DLPack deleter).
void log_hook_error(const char* call);

// Applies `f` to every allocator that knows `tag`; unknown everywhere: invalid_argument.
template <typename F>
void for_tag(const char* call, const char* tag, F&& f) {
  need(tag, "tag");
  caching_allocator::check_tag_name(call, tag);
  std::shared_lock<std::shared_mutex> lk;
  allocator_for(-1, lk);
  bool known = false;
  for (caching_allocator* a : all_allocators()) {
    auto ts = a->tags();
    if (std::find(ts.begin(), ts.end(), tag) == ts.end()) continue;
    known = true;
    f(*a);
  }
  if (!known) throw invalid_argument(std::string(call) + ": unknown tag '" + tag + "'");
}

}  // namespace deferalloc::abi
