// The C ABI's process-wide state, the only global state of the library, and the helpers
// every entry point shares: the instance, the per-device caching allocators, the ids
// handed out (Note [Reservations of the ABI]), the thread-local messages.  Created once
// and never destroyed (Note [Process lifetime]).  The entry points are c_api_instance.cpp,
// c_api_reservations.cpp and c_api_caching.cpp.
#include <deferalloc/core/errors.hpp>

#include <cstdlib>
#include <cstring>

#include "fault_report.hpp"
#include "log.hpp"
#include "process_state.hpp"

namespace deferalloc::abi {

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

std::map<int, std::unique_ptr<device_allocator>>& g_allocs =
    *new std::map<int, std::unique_ptr<device_allocator>>;  // guarded by g_mu
std::atomic<std::uint64_t> g_generation{1};                 // bumped by dfa_shutdown
std::atomic<bool> g_report_faults{false};                   // the instance runs on the host driver
std::atomic<std::size_t> g_history{0};                      // dfa_record_memory_history's max_entries

// The tagged regions of the calling thread (dfa_tag_begin/end).  They belong to one
// instance: a thread that left a region open across dfa_shutdown finds it closed (the
// list is dropped when its generation is not the current one).
static thread_local std::vector<std::string> t_tags;
static thread_local std::uint64_t t_tags_generation = 0;

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
// Note [Hidden reservations]: a reservation its owner parcels out to others (the preload
// library's arena blocks, each holding many PyTorch segments) is hidden from dfa_find: a
// pointer inside it gets INVALID_ARGUMENT with the owner's words, not the id of the whole
// block, so that no face (deferalloc.release, the LibTorch face's release / materialize /
// is_backed) acts on a whole block for one tensor.  The owner keeps using the id it holds.
std::unordered_map<dfa_reservation, std::string>& g_hidden =
    *new std::unordered_map<dfa_reservation, std::string>;  // guarded by g_ids_mu

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

}  // namespace deferalloc::abi
