// The C ABI: the only process-wide state of the library.
//
// Every entry point runs its body through guard(), which turns each exception into a
// status code and a thread-local message "dfa_<call>: <cause>", so nothing crosses the
// ABI.  The instance is created once (dfa_init or first use) and torn down by
// dfa_shutdown (not by the exit of the process: Note [Process lifetime]); a shared
// mutex lets calls run concurrently while init/shutdown are exclusive.  The reservation
// calls act only on the reservations the ABI handed out (Note [Reservations of the ABI]);
// on the host driver a touch of released memory is reported by name (Note
// [Released-memory faults] in fault_report.hpp).
#include <deferalloc/caching_allocator.hpp>
#include <deferalloc/context.hpp>
#include <deferalloc/deferalloc.h>
#include <deferalloc/errors.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "abi_guard.hpp"
#include "core/mode_checks.hpp"
#include "dlpack_abi.hpp"
#include "fault_report.hpp"
#include "log.hpp"

namespace {

using namespace deferalloc;

thread_local std::string t_last_error;
// Why this thread's last dfa_malloc returned NULL, "" when it returned a block (Note
// [Refusals] in caching/refusals.cpp).  Per thread, so that another thread's refusal is never
// reported for this one's failure; cleared by this thread's next successful dfa_malloc,
// so that an old refusal is never reported for a later error.  Other calls keep it,
// unlike t_last_error: PyTorch frees (dfa_free, the hooks) between its retries and
// raising its error, and a retry that fails sets it again.
thread_local std::string t_last_refusal;

// Note [Process lifetime]: the instance is torn down by dfa_shutdown, never by the exit
// of the process.  At exit, the CUDA runtime destroys the primary context from its own
// atexit handler, which runs before the destructors of statics constructed earlier; a
// destructor of ours would then meet a deinitialized driver (every call fails, and each
// failure was logged), and a free from another library's static destructor could reach
// a map already destroyed.  So the state below is allocated once and never destroyed, as
// PyTorch does with its caching allocator; the driver takes back the memory with the
// context, and an exit leaves nothing behind.
std::shared_mutex& g_mu = *new std::shared_mutex;
std::unique_ptr<context>& g_ctx = *new std::unique_ptr<context>;

// One caching allocator per device, on g_ctx (its device) or on a context of its own.
struct device_allocator {
  std::unique_ptr<context> own;
  std::unique_ptr<caching_allocator> alloc;
};
std::map<int, std::unique_ptr<device_allocator>>& g_allocs =
    *new std::map<int, std::unique_ptr<device_allocator>>;  // guarded by g_mu
std::atomic<std::uint64_t> g_generation{1};                 // bumped by dfa_shutdown
std::atomic<bool> g_report_faults{false};                   // the instance runs on the host driver
std::atomic<std::size_t> g_history{0};                      // dfa_record_memory_history's max_entries

// The tagged regions of the calling thread (dfa_tag_begin/end).  They belong to one
// instance: a thread that left a region open across dfa_shutdown finds it closed (the
// list is dropped when its generation is not the current one).
thread_local std::vector<std::string> t_tags;
thread_local std::uint64_t t_tags_generation = 0;

std::vector<std::string>& thread_tags() {
  const std::uint64_t now = g_generation.load();
  if (t_tags_generation != now) {
    t_tags.clear();
    t_tags_generation = now;
  }
  return t_tags;
}

// Note [Reservations of the ABI]: the reservation calls (dfa_find, dfa_materialize,
// dfa_release, dfa_record_stream, dfa_free_reservation, dfa_is_backed,
// dfa_export_dlpack) act only on reservations that dfa_reserve handed out, deferred
// tensors of the Python and LibTorch faces included.  The caching allocator's segments
// are reservations of the same manager, but they are its own: a release or free behind
// its back would let the next dfa_malloc return an unmapped block.  So the ABI remembers
// the ids it handed out; dfa_find does not name a segment, and the other calls refuse a
// segment's id with INVALID_ARGUMENT saying why.  Cost: one mutex and a hash lookup.
std::mutex& g_ids_mu = *new std::mutex;
std::unordered_set<dfa_reservation>& g_ids = *new std::unordered_set<dfa_reservation>;  // guarded by g_ids_mu

bool handed_out(dfa_reservation r) {
  std::lock_guard lk(g_ids_mu);
  return g_ids.count(r) != 0;
}

// Throws invalid_argument unless dfa_reserve handed `r` out: the manager's message for an
// unknown id, the reason for a segment of the caching allocator.
void expect_handed_out(const reservation_manager& m, dfa_reservation r) {
  if (handed_out(r)) return;
  (void)m.info(r);  // throws for an unknown (or freed) id
  throw invalid_argument("reservation " + std::to_string(r) +
                         " is a segment of deferalloc's caching allocator (it holds dfa_malloc blocks), not a "
                         "reservation of dfa_reserve: the reservation calls refuse it");
}

// Called with g_mu held exclusively once an instance exists.
void on_new_instance(const context& c) {
  const bool host = c.drv->kind() == driver_kind::host;
  if (host) detail::install_fault_reporter();
  g_report_faults.store(host);
}

// Lists the caching allocator's segment holding `block` for the fault report (host driver).
void note_segment(caching_allocator& a, const void* block) {
  if (!g_report_faults.load(std::memory_order_relaxed)) return;
  if (detail::faults().contains(reinterpret_cast<std::uintptr_t>(block))) return;
  if (auto id = a.reservations().find(block)) {
    const reservation_info info = a.reservations().info(*id);
    detail::faults().add(*id, info.address, info.reserved_bytes);
  }
}

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
    if (!g_ctx) {
      g_ctx = std::make_unique<context>(env_settings());
      on_new_instance(*g_ctx);
    }
  }
  lk.lock();
  return *g_ctx;
}

using detail::need;

// The caching allocator of `device` (-1: the instance's), created on first use.
// Returns with `lk` held shared.  The host driver has one device: every ordinal maps to it.
caching_allocator& allocator_for(int device, std::shared_lock<std::shared_mutex>& lk) {
  context& ctx = instance(lk);
  const int key = (device < 0 || ctx.drv->kind() == driver_kind::host) ? ctx.config.device : device;
  auto it = g_allocs.find(key);
  if (it != g_allocs.end()) return *it->second->alloc;
  lk.unlock();
  {
    std::unique_lock ex(g_mu);
    if (!g_ctx) throw invalid_state("the instance was shut down concurrently");
    if (g_allocs.find(key) == g_allocs.end()) {
      auto d = std::make_unique<device_allocator>();
      reservation_manager* m = g_ctx->reservations.get();
      if (key != g_ctx->config.device) {
        settings s = g_ctx->config;
        s.device = key;
        d->own = std::make_unique<context>(s);
        m = d->own->reservations.get();
      }
      d->alloc = std::make_unique<caching_allocator>(*m, g_ctx->config.caching);
      if (const std::size_t h = g_history.load()) d->alloc->record_history(h);
      g_allocs.emplace(key, std::move(d));
    }
  }
  lk.lock();
  if (!g_ctx) throw invalid_state("the instance was shut down concurrently");
  return *g_allocs.at(key)->alloc;
}

// Every caching allocator created so far (g_mu held shared by the caller).
std::vector<caching_allocator*> all_allocators() {
  std::vector<caching_allocator*> out;
  for (auto& [dev, d] : g_allocs) out.push_back(d->alloc.get());
  return out;
}

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

// The "size it first" convention of dfa_memory_stats and dfa_tag_names: `needed` gets
// the bytes buf needs (NUL included); a null buf only asks; a too small one is refused.
void copy_text(const std::string& text, char* buf, size_t cap, size_t* needed) {
  if (needed) *needed = text.size() + 1;
  if (buf == nullptr) {
    if (needed == nullptr) throw invalid_argument("buf and needed are both null");
    return;
  }
  if (cap < text.size() + 1)
    throw invalid_argument("buffer of " + std::to_string(cap) + " bytes is too small (" +
                           std::to_string(text.size() + 1) + " needed)");
  std::memcpy(buf, text.c_str(), text.size() + 1);
}

void log_hook_error(const char* call) {
  detail::log(log_level::error, t_last_error.empty() ? std::string(call) + " failed" : t_last_error);
}

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

struct dlpack_holder {
  DLManagedTensor tensor{};
  std::vector<std::int64_t> shape;
  dfa_reservation id = 0;
  std::uint64_t generation = 0;
};

extern "C" void dfa_dlpack_deleter(DLManagedTensor* t) {
  auto* h = static_cast<dlpack_holder*>(t->manager_ctx);
  if (h->generation == g_generation.load()) {
    // The instance that made the reservation still exists: free it.
    if (dfa_free_reservation(h->id, nullptr) != DFA_SUCCESS) log_hook_error("DLPack deleter");
  }
  delete h;
}

}  // namespace

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

dfa_status dfa_reserve(size_t bytes, dfa_reservation* out, void** address) {
  return guard("dfa_reserve", [&] {
    need(out, "out");
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    reservation_id id = m.reserve(bytes);
    try {
      std::lock_guard ids(g_ids_mu);
      g_ids.insert(id);
    } catch (...) {
      m.free(id);
      throw;
    }
    if (g_report_faults.load()) {
      const reservation_info info = m.info(id);
      detail::faults().add(id, info.address, info.reserved_bytes);
    }
    *out = id;
    if (address) *address = m.address(id);
  });
}

dfa_status dfa_materialize(dfa_reservation r, size_t offset, size_t length, dfa_fill fill, void* stream) {
  return guard("dfa_materialize", [&] {
    const fill_mode f = fill_from_int(raw_enum_value(fill));  // Note [Enum values from callers]
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    expect_handed_out(m, r);
    m.materialize(r, offset, length, f, stream_t{stream});
  });
}

dfa_status dfa_release(dfa_reservation r, size_t offset, size_t length, dfa_keep keep, void* stream) {
  return guard("dfa_release", [&] {
    const keep_mode k = keep_from_int(raw_enum_value(keep));
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    expect_handed_out(m, r);
    m.release(r, offset, length, k, stream_t{stream});
  });
}

dfa_status dfa_record_stream(dfa_reservation r, void* stream) {
  return guard("dfa_record_stream", [&] {
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    expect_handed_out(m, r);
    m.record_stream(r, stream_t{stream});
  });
}

dfa_status dfa_free_reservation(dfa_reservation r, void* stream) {
  return guard("dfa_free_reservation", [&] {
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    expect_handed_out(m, r);
    m.free(r, stream_t{stream});
    detail::faults().remove(r);
    std::lock_guard ids(g_ids_mu);
    g_ids.erase(r);
  });
}

dfa_status dfa_is_backed(dfa_reservation r, size_t offset, size_t length, int* out) {
  return guard("dfa_is_backed", [&] {
    need(out, "out");
    std::shared_lock<std::shared_mutex> lk;
    auto& m = *instance(lk).reservations;
    expect_handed_out(m, r);
    *out = m.is_backed(r, offset, length) ? 1 : 0;
  });
}

dfa_status dfa_find(const void* ptr, dfa_reservation* out) {
  return guard("dfa_find", [&] {
    need(out, "out");
    need(ptr, "ptr");
    std::shared_lock<std::shared_mutex> lk;
    auto id = instance(lk).reservations->find(ptr);
    if (!id) throw invalid_argument("pointer is not inside any reservation");
    if (!handed_out(*id))
      throw invalid_argument("pointer lies in a segment of deferalloc's caching allocator (a dfa_malloc block), "
                             "not in a reservation of dfa_reserve");
    *out = *id;
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

// ---- PyTorch faces: caching allocator, hooks, tags, statistics, DLPack ------------------

void* dfa_malloc(size_t size, int device, void* stream) {
  void* out = nullptr;
  if (size == 0) {  // PyTorch asks for 0 bytes for empty tensors: a null pointer, no error
    t_last_error.clear();
    t_last_refusal.clear();
    return nullptr;
  }
  if (guard("dfa_malloc", [&] {
    std::shared_lock<std::shared_mutex> lk;
    caching_allocator& a = allocator_for(device, lk);
    const std::vector<std::string>& tags = thread_tags();
    // The C ABI's current tag is this thread's (thread_tags); the allocator takes its id.
    if (tags.empty()) out = a.allocate(size, stream_t{stream});
    else out = a.allocate(size, stream_t{stream}, a.register_tag(tags.back()));
    try {
      note_segment(a, out);
    } catch (...) {  // the block is the caller's: a failure here must not report it failed
      detail::log_current("dfa_malloc: listing the segment for fault reports", log_level::warn);
    }
  }) == DFA_SUCCESS) {
    t_last_refusal.clear();
  } else {
    // The refusal's own text (the warn line), without guard's "dfa_malloc: ".
    constexpr std::string_view prefix = "dfa_malloc: ";
    t_last_refusal = t_last_error.starts_with(prefix) ? t_last_error.substr(prefix.size()) : t_last_error;
  }
  return out;
}

void dfa_free(void* ptr, size_t size, int device, void* stream) {
  if (ptr == nullptr) return;
  if (guard("dfa_free", [&] {
        std::shared_lock<std::shared_mutex> lk;
        allocator_for(device, lk).deallocate(ptr, size, stream_t{stream});
      }) != DFA_SUCCESS)
    log_hook_error("dfa_free");
}

void dfa_init_hook(int device_count) {
  if (guard("dfa_init_hook", [&] {
        if (device_count < 0) throw invalid_argument("device_count is negative");
        std::shared_lock<std::shared_mutex> lk;
        allocator_for(-1, lk);
      }) != DFA_SUCCESS)
    log_hook_error("dfa_init_hook");
}

void dfa_empty_cache_hook(void) {
  if (guard("dfa_empty_cache_hook", [&] {
        std::shared_lock<std::shared_mutex> lk;
        allocator_for(-1, lk);
        for (caching_allocator* a : all_allocators()) a->empty_cache();
      }) != DFA_SUCCESS)
    log_hook_error("dfa_empty_cache_hook");
}

void dfa_memory_fraction_hook(double fraction, int device) {
  if (dfa_set_memory_fraction(fraction, device) != DFA_SUCCESS) log_hook_error("dfa_memory_fraction_hook");
}

void* dfa_base_alloc_hook(void* ptr, size_t* size) {
  void* out = nullptr;
  if (guard("dfa_base_alloc_hook", [&] {
        for_owner(ptr, [&](caching_allocator& a) { out = a.base_allocation(ptr, size); });
      }) != DFA_SUCCESS)
    log_hook_error("dfa_base_alloc_hook");
  return out;
}

void dfa_record_stream_hook(void* ptr, void* stream) {
  if (guard("dfa_record_stream_hook", [&] {
        for_owner(ptr, [&](caching_allocator& a) { a.record_stream(ptr, stream_t{stream}); });
      }) != DFA_SUCCESS)
    log_hook_error("dfa_record_stream_hook");
}

dfa_status dfa_empty_cache(int device, size_t* released) {
  return guard("dfa_empty_cache", [&] {
    std::shared_lock<std::shared_mutex> lk;
    size_t n = allocator_for(device, lk).empty_cache();
    if (released) *released = n;
  });
}

dfa_status dfa_set_memory_fraction(double fraction, int device) {
  return guard("dfa_set_memory_fraction", [&] {
    std::shared_lock<std::shared_mutex> lk;
    allocator_for(device, lk).set_memory_fraction(fraction);
  });
}

dfa_status dfa_set_resident(void* ptr, int resident) {
  return guard("dfa_set_resident", [&] {
    for_owner(ptr, [&](caching_allocator& a) { a.set_resident(ptr, resident != 0); });
  });
}

dfa_status dfa_tag_begin(const char* tag) {
  return guard("dfa_tag_begin", [&] {
    need(tag, "tag");
    if (*tag == '\0') throw invalid_argument("the tag is empty");
    std::shared_lock<std::shared_mutex> lk;
    caching_allocator& a = allocator_for(-1, lk);
    a.register_tag(tag);  // pause/resume know it from now on
    thread_tags().emplace_back(tag);
  });
}

dfa_status dfa_tag_end(void) {
  return guard("dfa_tag_end", [&] {
    std::vector<std::string>& tags = thread_tags();
    if (tags.empty()) throw invalid_state("no tagged region is open on this thread");
    tags.pop_back();
  });
}


dfa_status dfa_tag_pause(const char* tag, dfa_keep keep, void* stream) {
  return guard("dfa_tag_pause", [&] {
    const keep_mode k = keep_from_int(raw_enum_value(keep));
    const std::vector<std::string>& tags = thread_tags();
    if (!tags.empty())
      throw invalid_state("called inside the tagged region '" + tags.back() + "' (dfa_tag_end first)");
    for_tag("pause", tag, [&](caching_allocator& a) { a.pause(tag, k, stream_t{stream}); });
  });
}

dfa_status dfa_tag_resume(const char* tag, void* stream) {
  return guard("dfa_tag_resume", [&] { for_tag("resume", tag, [&](caching_allocator& a) { a.resume(tag, stream_t{stream}); }); });
}

dfa_status dfa_tag_is_paused(const char* tag, int* out) {
  return guard("dfa_tag_is_paused", [&] {
    need(out, "out");
    int paused = 0;
    for_tag("is_paused", tag, [&](caching_allocator& a) { paused |= a.is_paused(tag) ? 1 : 0; });
    *out = paused;
  });
}

dfa_status dfa_tag_names(char* buf, size_t cap, size_t* needed) {
  return guard("dfa_tag_names", [&] {
    std::shared_lock<std::shared_mutex> lk;
    allocator_for(-1, lk);
    std::vector<std::string> names;
    for (caching_allocator* a : all_allocators())
      for (std::string& t : a->tags())
        if (std::find(names.begin(), names.end(), t) == names.end()) names.push_back(std::move(t));
    std::string text;
    for (const std::string& t : names) text += t + "\n";
    copy_text(text, buf, cap, needed);
  });
}

dfa_status dfa_memory_stats(int device, char* buf, size_t cap, size_t* needed) {
  return guard("dfa_memory_stats", [&] {
    std::shared_lock<std::shared_mutex> lk;
    std::string text;
    for (auto& [k, v] : allocator_for(device, lk).stats()) text += k + " " + std::to_string(v) + "\n";
    copy_text(text, buf, cap, needed);
  });
}

dfa_status dfa_memory_snapshot(char* buf, size_t cap, size_t* needed) {
  return guard("dfa_memory_snapshot", [&] {
    std::shared_lock<std::shared_mutex> lk;
    allocator_for(-1, lk);
    std::string text;
    for (auto& [dev, d] : g_allocs) text += "D " + std::to_string(dev) + "\n" + d->alloc->snapshot_text();
    // The reservations of dfa_reserve (deferred tensors): "Q <id> <address> <reserved>
    // <backed> <backup>", then their backed runs as "R <offset> <length>".
    reservation_manager& m = *g_ctx->reservations;
    std::vector<dfa_reservation> ids;
    {
      std::lock_guard idl(g_ids_mu);
      ids.assign(g_ids.begin(), g_ids.end());
    }
    std::sort(ids.begin(), ids.end());
    for (dfa_reservation r : ids) {
      reservation_info info;
      try {
        info = m.info(r);
      } catch (const invalid_argument&) {
        continue;  // freed since the list was taken
      }
      text += "Q " + std::to_string(r) + " " + std::to_string(info.address) + " " + std::to_string(info.reserved_bytes) +
              " " + std::to_string(info.backed_bytes) + " " + std::to_string(info.backup_bytes) + "\n";
      if (info.backed_bytes == 0) continue;
      try {  // one pass over the chunks (a 16 GiB reservation has 8192 granules of 2 MiB)
        for (const range& run : m.backed_ranges(r))
          text += "R " + std::to_string(run.offset) + " " + std::to_string(run.length) + "\n";
      } catch (const invalid_argument&) {  // freed meanwhile: its runs are left out
      }
    }
    copy_text(text, buf, cap, needed);
  });
}

dfa_status dfa_record_memory_history(size_t max_entries) {
  return guard("dfa_record_memory_history", [&] {
    std::shared_lock<std::shared_mutex> lk;
    allocator_for(-1, lk);
    g_history.store(max_entries);
    for (caching_allocator* a : all_allocators()) a->record_history(max_entries);
  });
}

dfa_status dfa_memory_stat(int device, const char* key, int64_t* out) {
  return guard("dfa_memory_stat", [&] {
    need(key, "key");
    need(out, "out");
    std::shared_lock<std::shared_mutex> lk;
    *out = allocator_for(device, lk).stat(key);
  });
}

dfa_status dfa_reset_peak_stats(int device) {
  return guard("dfa_reset_peak_stats", [&] {
    std::shared_lock<std::shared_mutex> lk;
    allocator_for(device, lk).reset_peak_stats();
  });
}

dfa_status dfa_export_dlpack(dfa_reservation r, const int64_t* shape, int ndim, uint8_t code, uint8_t bits,
                             uint16_t lanes, struct DLManagedTensor** out) {
  return guard("dfa_export_dlpack", [&] {
    need(out, "out");
    if (ndim < 0 || ndim > 64) throw invalid_argument("ndim " + std::to_string(ndim) + " is outside [0, 64]");
    if (ndim > 0) need(shape, "shape");
    if (bits == 0 || lanes == 0) throw invalid_argument("dtype bits and lanes must be positive");
    if (code > 17) throw invalid_argument("dtype code " + std::to_string(code) + " is not a DLPack type code");
    std::shared_lock<std::shared_mutex> lk;
    context& ctx = instance(lk);
    expect_handed_out(*ctx.reservations, r);
    const reservation_info info = ctx.reservations->info(r);
    unsigned __int128 bytes = (static_cast<unsigned>(bits) * lanes + 7) / 8;
    for (int i = 0; i < ndim; ++i) {
      if (shape[i] < 0) throw invalid_argument("shape[" + std::to_string(i) + "] is negative");
      bytes *= static_cast<std::uint64_t>(shape[i]);
      if (bytes > info.size) break;
    }
    if (bytes > info.size)
      throw invalid_argument("the shape needs more than the reservation's " + std::to_string(info.size) + " bytes");
    auto h = std::make_unique<dlpack_holder>();
    h->shape.assign(shape, shape + ndim);
    h->id = r;
    h->generation = g_generation.load();
    DLTensor& t = h->tensor.dl_tensor;
    t.data = reinterpret_cast<void*>(info.address);
    const bool host = ctx.drv->kind() == driver_kind::host;
    t.device = {host ? detail::k_dl_cpu : detail::k_dl_cuda, host ? 0 : ctx.drv->device()};
    t.ndim = ndim;
    t.dtype = {code, bits, lanes};
    t.shape = h->shape.data();
    t.strides = nullptr;
    t.byte_offset = 0;
    h->tensor.manager_ctx = h.get();
    h->tensor.deleter = &dfa_dlpack_deleter;
    *out = &h.release()->tensor;
  });
}

}  // extern "C"
