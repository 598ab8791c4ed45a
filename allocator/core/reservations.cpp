// Note [Deferred reservations]
//
// Rationale: a reservation is an address range whose physical backing comes and goes.
// Users (tensors, optimizer state, paused tags) keep pointers into it, so the address
// must never change, and physical memory must be attached only while it is used.
//
// Approach
//  - reserve: one cuMemAddressReserve, padded to the granularity, aligned to the
//    largest chunk class that fits, so large ranges can be backed by large chunks.
//  - per reservation: the chunks mapped (offset -> chunk; they tile exactly the backed
//    granules), the saved runs (offset -> end and backup segment: unbacked granules
//    whose contents wait in pinned memory) and the streams that used it.  A granule in
//    neither map is unbacked.  So the bookkeeping grows with what is backed or saved,
//    never with what is reserved: reserving 16 TiB at 64 KiB granules costs a few
//    hundred bytes (a test checks < 1 MiB of RSS), where one byte per granule would
//    cost 256 MiB.  Lookups are O(log n + k) in the chunks or runs touched.
//  - materialize: the unbacked runs of each range are cut greedily into the largest
//    classes aligned at their offset (never across the ranges of a batch); chunks come
//    from the pool (cached ones first, also smaller cached ones that cover a whole
//    piece; on out-of-memory a piece falls back to smaller classes, then the cache is
//    trimmed and everything tried once more).  One cuMemMap per chunk, one
//    cuMemSetAccess per run.  Fill is stream-ordered: zeros on the caller's stream,
//    restores on the manager's copy stream with the caller's stream waiting on it.
//  - release: a chunk cut by the range is split (See Note [Splitting chunks];
//    release_whole_chunks never splits: it releases only the chunks inside); the
//    chunks inside are backed up (one pinned buffer per contiguous run, copies on the
//    copy stream after it waited for events recorded on every stream that used the
//    range), the host waits for those events only, then one cuMemUnmap per chunk and
//    the chunks go back to the pool.
//  - every step that can fail comes before the commit, and a failure undoes the steps
//    before it: chunks return to the pool, mappings are removed or restored, backup
//    buffers are given back.  State changes only at the commit.
//
// Limits: one mutex per manager, held during host waits; a release with backups
// waits for its copies (the batched release enqueues all copies before one wait).
// Backup buffers are reused in stream order: every copy touching them runs on the one
// copy stream; a buffer whose last granule is restored or dropped goes back to the
// pinned pool (which may free it: Note [Physical memory policy]) only after an event
// recorded on the copy stream has completed (checked at the next call, waited for by
// trim_backup_cache and the destructor).
#include <deferalloc/errors.hpp>
#include <deferalloc/reservations.hpp>

#include <algorithm>
#include <bit>
#include <unordered_map>

#include "core/mode_checks.hpp"
#include "log.hpp"

namespace deferalloc {

namespace {
constexpr std::size_t k_max_reservation = std::size_t{1} << 48;  // 256 TiB: beyond any device's VA

// The runs of [b, e) that no chunk of `chunks` covers.
std::vector<std::pair<std::size_t, std::size_t>> gaps(const std::map<std::size_t, chunk>& chunks, std::size_t b,
                                                      std::size_t e) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  std::size_t pos = b;
  auto it = chunks.upper_bound(b);
  if (it != chunks.begin()) pos = std::max(pos, std::prev(it)->first + std::prev(it)->second.bytes);
  for (; pos < e && it != chunks.end() && it->first < e; ++it) {
    if (it->first > pos) out.emplace_back(pos, it->first);
    pos = std::max(pos, it->first + it->second.bytes);
  }
  if (pos < e) out.emplace_back(pos, e);
  return out;
}
}  // namespace

struct reservation_manager::backup_segment {
  std::size_t offset = 0;
  std::size_t bytes = 0;
  void* host = nullptr;
  std::size_t live = 0;  // granules still saved in it
};

struct reservation_manager::reservation {
  struct saved_run {
    std::size_t end = 0;
    std::uint64_t segment = 0;
  };
  reservation_id id{};
  std::uintptr_t base{};
  std::size_t size{};
  std::size_t padded{};
  std::map<std::size_t, chunk> chunks;     // offset -> chunk: the backed granules, exactly
  std::map<std::size_t, saved_run> saved;  // begin -> run of saved granules (disjoint, never backed)
  std::unordered_map<std::uint64_t, backup_segment> backups;
  std::uint64_t next_segment = 1;
  std::vector<stream_t> streams;
  std::size_t backed_granules = 0;
  std::size_t saved_granules = 0;

  void use(stream_t s) {
    if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
  }
  // The saved run that contains `at`, else the first one after it.
  std::map<std::size_t, saved_run>::iterator saved_from(std::size_t at) {
    auto it = saved.upper_bound(at);
    if (it != saved.begin() && std::prev(it)->second.end > at) --it;
    return it;
  }
  // Splits the saved run that strictly contains `at` in two.
  void cut_saved(std::size_t at) {
    auto it = saved_from(at);
    if (it == saved.end() || it->first >= at) return;
    const saved_run tail = it->second;
    it->second.end = at;
    saved.emplace_hint(std::next(it), at, tail);
  }
  // The first offset of [b, e) that holds no backup (e when every granule does).
  std::size_t first_unsaved(std::size_t b, std::size_t e) {
    std::size_t pos = b;
    for (auto it = saved_from(b); it != saved.end() && pos < e; ++it) {
      if (it->first > pos) return pos;
      pos = it->second.end;
    }
    return std::min(pos, e);
  }
};

// The manager's state (the header shows only a pointer to it).
struct reservation_manager::impl {
  std::shared_ptr<chunk_pool> pool_;
  std::shared_ptr<driver> drv_;
  std::size_t granularity_;
  std::unique_ptr<pinned_pool> pinned_;
  mutable std::mutex mu_;
  std::unordered_map<reservation_id, std::unique_ptr<reservation>> reservations_;
  std::map<std::uintptr_t, reservation_id> by_address_;
  reservation_id next_id_ = 1;
  stream_t copy_stream_ = nullptr;
  std::vector<event_t> free_events_;
  struct retired {
    event_t done;
    std::vector<std::pair<void*, std::size_t>> buffers;  // pinned buffers still read by restores
  };
  std::vector<retired> retired_;
  std::uintptr_t scratch_ = 0;  // address range for splitting chunks (largest class)
  std::size_t scratch_bytes_ = 0;
  std::size_t reserved_bytes_ = 0, backed_bytes_ = 0, peak_backed_ = 0, backup_bytes_ = 0;
  std::uint64_t splits_ = 0;
};

reservation_manager::reservation_manager(std::shared_ptr<chunk_pool> pool, reservation_manager_config cfg)
    : impl_(std::make_unique<impl>()) {
  impl_->pool_ = std::move(pool);
  DFA_EXPECTS(impl_->pool_ != nullptr, "reservation_manager: pool is null");
  impl_->drv_ = impl_->pool_->driver_ptr();
  impl_->granularity_ = impl_->drv_->granularity();
  impl_->pinned_ = std::make_unique<pinned_pool>(impl_->drv_, cfg.pinned_cache);
  impl_->copy_stream_ = impl_->drv_->create_stream();
}

std::size_t reservation_manager::granularity() const { return impl_->granularity_; }
chunk_pool& reservation_manager::pool() const { return *impl_->pool_; }
driver& reservation_manager::drv() const { return *impl_->drv_; }

reservation_manager::~reservation_manager() {
  std::vector<reservation_id> ids;
  {
    detail::log_after_unlock lk(impl_->mu_);
    for (auto& [id, r] : impl_->reservations_) ids.push_back(id);
  }
  for (auto id : ids) {
    try {
      free(id);
    } catch (const std::exception& e) {
      detail::log(log_level::error, std::string("reservation_manager: freeing reservation at destruction: ") + e.what());
    }
  }
  reap_retired(true);
  try {
    impl_->drv_->synchronize_stream(impl_->copy_stream_);
    if (impl_->scratch_ != 0) impl_->drv_->free_reservation(impl_->scratch_, impl_->scratch_bytes_);
  } catch (const std::exception& e) {
    detail::log(log_level::error, std::string("reservation_manager: ") + e.what());
  }
  for (event_t e : impl_->free_events_) impl_->drv_->destroy_event(e);
  impl_->drv_->destroy_stream(impl_->copy_stream_);
}

reservation_manager::reservation& reservation_manager::get(reservation_id id) {
  auto it = impl_->reservations_.find(id);
  if (it == impl_->reservations_.end())
    throw invalid_argument("unknown reservation " + std::to_string(id) + " (never reserved, or already freed)");
  return *it->second;
}
const reservation_manager::reservation& reservation_manager::get(reservation_id id) const {
  return const_cast<reservation_manager*>(this)->get(id);
}

std::pair<std::size_t, std::size_t> reservation_manager::clamp(const reservation& r, std::size_t offset,
                                                               std::size_t length) const {
  DFA_EXPECTS(offset % impl_->granularity_ == 0, "offset " + std::to_string(offset) + " is not a multiple of the granularity (" +
                                              std::to_string(impl_->granularity_) + ")");
  DFA_EXPECTS(offset < r.padded, "offset " + std::to_string(offset) + " is outside the reservation of " +
                                     std::to_string(r.size) + " bytes");
  std::size_t end = 0;
  if (length == whole) {
    end = r.padded;
  } else {
    DFA_EXPECTS(length > 0, "length is zero");
    DFA_EXPECTS(length <= r.padded - offset, "range [" + std::to_string(offset) + ", +" + std::to_string(length) +
                                                 ") is outside the reservation of " + std::to_string(r.size) + " bytes");
    end = offset + length;
    if (end == r.size) end = r.padded;
    DFA_EXPECTS(end % impl_->granularity_ == 0, "length " + std::to_string(length) +
                                             " does not end on a granule or at the reservation's end");
  }
  return {offset, end};
}

event_t reservation_manager::take_event() {
  if (!impl_->free_events_.empty()) {
    event_t e = impl_->free_events_.back();
    impl_->free_events_.pop_back();
    return e;
  }
  return impl_->drv_->create_event();
}

void reservation_manager::give_events(std::vector<event_t>& es) noexcept {
  for (event_t e : es) {
    try {
      impl_->free_events_.push_back(e);
    } catch (...) {
      impl_->drv_->destroy_event(e);
    }
  }
  es.clear();
}

void reservation_manager::unmap_quietly(std::uintptr_t va, std::size_t bytes) noexcept {
  try {
    impl_->drv_->unmap(va, bytes);
  } catch (const std::exception& e) {
    detail::log(log_level::error, std::string("rollback: unmap failed, a chunk stays mapped: ") + e.what());
  }
}

std::vector<event_t> reservation_manager::record_users(const std::vector<reservation*>& rs, stream_t stream) {
  std::vector<stream_t> streams{stream};
  for (reservation* r : rs)
    for (stream_t s : r->streams)
      if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
  std::vector<event_t> events;
  try {
    for (stream_t s : streams) {
      events.push_back(take_event());
      impl_->drv_->record(events.back(), s);
    }
  } catch (...) {
    give_events(events);
    throw;
  }
  return events;
}

// ---- reserve / free -----------------------------------------------------------------

reservation_id reservation_manager::reserve(std::size_t bytes) {
  DFA_EXPECTS(bytes > 0, "reserve: size is zero");
  DFA_EXPECTS(bytes <= k_max_reservation, "reserve: size " + std::to_string(bytes) + " is absurd (limit 256 TiB)");
  const std::size_t padded = (bytes + impl_->granularity_ - 1) / impl_->granularity_ * impl_->granularity_;
  // A power of two (the driver requires it), up to the largest chunk class.
  const std::size_t align = std::max(impl_->granularity_, std::bit_floor(std::min(impl_->pool_->classes().back(), padded)));
  detail::log_after_unlock lk(impl_->mu_);
  auto r = std::make_unique<reservation>();
  r->base = impl_->drv_->reserve(padded, align);
  r->id = impl_->next_id_++;
  r->size = bytes;
  r->padded = padded;
  try {
    impl_->by_address_[r->base] = r->id;
    reservation_id id = r->id;
    impl_->reservations_[id] = std::move(r);
    impl_->reserved_bytes_ += padded;
    return id;
  } catch (...) {
    impl_->by_address_.erase(r->base);
    impl_->drv_->free_reservation(r->base, padded);
    throw;
  }
}

void* reservation_manager::address(reservation_id id) const {
  detail::log_after_unlock lk(impl_->mu_);
  return reinterpret_cast<void*>(get(id).base);
}

void reservation_manager::free(reservation_id id, stream_t stream) {
  detail::log_after_unlock lk(impl_->mu_);
  reservation& r = get(id);
  // Release everything (also drops backups) through the one release path.
  const range all{id, 0, whole};
  release_locked(std::span<const range>(&all, 1), keep_mode::discard, stream, nullptr);
  impl_->drv_->free_reservation(r.base, r.padded);
  impl_->reserved_bytes_ -= r.padded;
  impl_->by_address_.erase(r.base);
  impl_->reservations_.erase(id);
}

// ---- chunk planning -----------------------------------------------------------------

// The classes that fit at `pos` inside [pos, end), at most `max_class`, largest first
// (the granularity when none does).
std::vector<std::size_t> reservation_manager::classes_at(std::size_t pos, std::size_t end, std::size_t max_class) const {
  std::vector<std::size_t> fit;
  const auto& classes = impl_->pool_->classes();
  for (auto it = classes.rbegin(); it != classes.rend(); ++it)
    if (*it <= max_class && pos % *it == 0 && pos + *it <= end) fit.push_back(*it);
  if (fit.empty()) fit.push_back(impl_->granularity_);
  return fit;
}

// Covers [pos, end) with cached chunks only (at each position the largest cached class
// that fits), all or none: appends to `out` and returns true, or leaves `out` as it
// was.  No driver call.
bool reservation_manager::reuse_cached(std::size_t pos, std::size_t end, std::vector<std::pair<std::size_t, chunk>>& out) {
  const std::size_t mark = out.size();
  while (pos < end) {
    auto ch = impl_->pool_->try_reuse(classes_at(pos, end, end - pos));
    if (!ch) {
      for (std::size_t i = mark; i < out.size(); ++i) impl_->pool_->give_back(out[i].second);
      out.resize(mark);
      return false;
    }
    out.emplace_back(pos, *ch);
    pos += ch->bytes;
  }
  return true;
}

// Acquires chunks for [pos, end) (offsets in one reservation), piece by piece of the
// largest aligned class: a cached chunk of that class, else cached chunks of smaller
// classes that cover the whole piece (memory already held is used before more is
// created: Note [Physical memory policy] in chunk_pool.cpp), else a new chunk; a class
// the pool cannot give is replaced by smaller ones.  Smaller cached chunks are used
// only when they cover a whole piece, so one small cached chunk never breaks a large
// range into many small pieces.  Appends to `out`; returns false when even a granule
// could not be had (what was appended stays there).
bool reservation_manager::acquire_pieces(std::size_t pos, std::size_t end, std::size_t max_class,
                                         std::vector<std::pair<std::size_t, chunk>>& out) {
  const auto& classes = impl_->pool_->classes();
  while (pos < end) {
    const std::size_t c = classes_at(pos, end, max_class).front();
    if (reuse_cached(pos, pos + c, out)) {
      pos += c;
      continue;
    }
    if (auto ch = impl_->pool_->try_acquire(c)) {
      out.emplace_back(pos, *ch);
    } else {
      if (c == impl_->granularity_) return false;
      auto smaller = std::prev(std::lower_bound(classes.begin(), classes.end(), c));
      if (!acquire_pieces(pos, pos + c, *smaller, out)) return false;
    }
    pos += c;
  }
  return true;
}

// Chunks for every run (begin, end): all or none.  @throws out_of_memory
std::vector<std::pair<std::size_t, chunk>> reservation_manager::plan_chunks(
    const std::vector<std::pair<std::size_t, std::size_t>>& runs) {
  std::vector<std::pair<std::size_t, chunk>> out;
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool ok = true;
    try {
      for (const auto& [b, e] : runs)
        if (!(ok = acquire_pieces(b, e, impl_->pool_->classes().back(), out))) break;
    } catch (...) {
      for (auto& [pos, c] : out) impl_->pool_->give_back(c);
      throw;
    }
    if (ok) return out;
    for (auto& [pos, c] : out) impl_->pool_->give_back(c);
    out.clear();
    if (attempt == 0) impl_->pool_->trim();
  }
  std::size_t want = 0;
  for (const auto& [b, e] : runs) want += e - b;
  const pool_stats ps = impl_->pool_->stats();
  std::string dev;
  try {
    auto mi = impl_->drv_->get_memory_info();
    dev = ", device free " + std::to_string(mi.free_bytes) + " of " + std::to_string(mi.total_bytes);
  } catch (...) {
    detail::log_current("out-of-memory report: device memory info", log_level::warn);
  }
  throw out_of_memory("out of memory backing " + std::to_string(want) + " bytes (pool: " +
                      std::to_string(ps.alive_bytes) + " bytes alive, " + std::to_string(ps.taken_bytes) + " mapped" + dev +
                      ")");
}

// ---- materialize --------------------------------------------------------------------

void reservation_manager::materialize(reservation_id id, std::size_t offset, std::size_t length, fill_mode fill,
                                      stream_t stream) {
  range r{id, offset, length};
  materialize(std::span<const range>(&r, 1), fill, stream);
}

struct reservation_manager::work_item {
  reservation* r;
  std::size_t begin, end;
};

// Validates every range of a batch (known reservation, in bounds, aligned, no two
// overlapping) and returns them as byte ranges, sorted.
std::vector<reservation_manager::work_item> reservation_manager::resolve(std::span<const range> ranges) {
  std::vector<work_item> ws;
  for (const range& rg : ranges) {
    reservation& r = get(rg.id);
    auto [b, e] = clamp(r, rg.offset, rg.length);
    ws.push_back({&r, b, e});
  }
  std::sort(ws.begin(), ws.end(), [](const work_item& a, const work_item& b) {
    return a.r != b.r ? std::less<reservation*>()(a.r, b.r) : a.begin < b.begin;
  });
  for (std::size_t i = 1; i < ws.size(); ++i)
    DFA_EXPECTS(ws[i].r != ws[i - 1].r || ws[i].begin >= ws[i - 1].end, "ranges of one batch overlap");
  return ws;
}

void reservation_manager::materialize(std::span<const range> ranges, fill_mode fill, stream_t stream) {
  expect_valid(fill, "materialize");
  detail::log_after_unlock lk(impl_->mu_);
  reap_retired(false);
  const std::size_t g = impl_->granularity_;
  std::vector<work_item> ws = resolve(ranges);

  // Unbacked runs, per reservation; `parts` are the pieces of the ranges asked for.
  // Chunks are planned per part, so that no chunk crosses a boundary of the ranges (a
  // later release of one range then never splits); set_access and fills go per run.
  struct run {
    reservation* r;
    std::size_t begin, end;
    std::vector<std::pair<std::size_t, std::size_t>> parts;
  };
  std::vector<run> runs;
  for (const auto& w : ws) {
    auto& r = *static_cast<reservation*>(w.r);
    for (const auto& [b, e] : gaps(r.chunks, w.begin, w.end)) {
      if (fill == fill_mode::restore) {
        const std::size_t miss = r.first_unsaved(b, e);
        if (miss < e)
          throw invalid_state("materialize(restore): granule at offset " + std::to_string(miss) + " of reservation " +
                              std::to_string(r.id) + " has no backup to restore (it was never released with keep=host)");
      }
      if (runs.empty() || runs.back().r != &r || runs.back().end != b) runs.push_back({&r, b, b, {}});
      runs.back().end = e;
      runs.back().parts.emplace_back(b, e);
    }
  }
  if (runs.empty()) return;  // already backed: a no-op

  // Chunks for all runs (offsets are per reservation, so plan run by run but all-or-nothing).
  std::vector<std::vector<std::pair<std::size_t, chunk>>> pieces(runs.size());
  auto give_back_all = [&] {
    for (auto& ps : pieces)
      for (auto& [pos, c] : ps) impl_->pool_->give_back(c);
  };
  try {
    for (std::size_t i = 0; i < runs.size(); ++i) pieces[i] = plan_chunks(runs[i].parts);
  } catch (...) {
    give_back_all();
    throw;
  }

  // Map, then one set_access per run.
  std::vector<std::pair<std::uintptr_t, std::size_t>> mapped;
  auto unmap_all = [&] {
    for (auto& [va, n] : mapped) unmap_quietly(va, n);
  };
  try {
    for (std::size_t i = 0; i < runs.size(); ++i)
      for (auto& [pos, c] : pieces[i]) {
        impl_->drv_->map(runs[i].r->base + pos, c.bytes, c.handle);
        mapped.emplace_back(runs[i].r->base + pos, c.bytes);
      }
    for (const auto& rn : runs) impl_->drv_->set_access(rn.r->base + rn.begin, rn.end - rn.begin);
    if (fill == fill_mode::zero) {
      for (const auto& rn : runs) impl_->drv_->zero_async(reinterpret_cast<void*>(rn.r->base + rn.begin), rn.end - rn.begin, stream);
    } else if (fill == fill_mode::restore) {
      for (const auto& rn : runs) {
        reservation& r = *rn.r;
        for (auto it = r.saved_from(rn.begin); it != r.saved.end() && it->first < rn.end; ++it) {
          const std::size_t b = std::max(it->first, rn.begin), e = std::min(it->second.end, rn.end);
          const backup_segment& seg = r.backups.at(it->second.segment);
          impl_->drv_->copy_async(reinterpret_cast<void*>(r.base + b), static_cast<const char*>(seg.host) + (b - seg.offset),
                           e - b, impl_->copy_stream_);
        }
      }
      std::vector<event_t> done{take_event()};
      try {
        impl_->drv_->record(done[0], impl_->copy_stream_);
        impl_->drv_->stream_wait(stream, done[0]);
      } catch (...) {
        give_events(done);
        throw;
      }
      give_events(done);
    }
  } catch (...) {
    try {  // copies may be in flight into the ranges we are about to unmap
      impl_->drv_->synchronize_stream(impl_->copy_stream_);
      impl_->drv_->synchronize_stream(stream);
    } catch (...) {
      detail::log_current("materialize rollback: waiting for copies");
    }
    unmap_all();
    give_back_all();
    throw;
  }

  // Commit.  Backups restored (or overwritten) are dropped; their buffers go back to
  // the pinned pool once the copies reading them are done.
  std::vector<std::pair<void*, std::size_t>> unused;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    reservation& r = *runs[i].r;
    for (auto& [pos, c] : pieces[i]) r.chunks.emplace(pos, c);
    drop_backup_granules(r, runs[i].begin, runs[i].end, unused);
    r.backed_granules += (runs[i].end - runs[i].begin) / g;
    impl_->backed_bytes_ += runs[i].end - runs[i].begin;
    r.use(stream);
  }
  impl_->peak_backed_ = std::max(impl_->peak_backed_, impl_->backed_bytes_);
  retire_buffers(unused);
}

// ---- release ------------------------------------------------------------------------

void reservation_manager::release(reservation_id id, std::size_t offset, std::size_t length, keep_mode keep,
                                  stream_t stream) {
  range r{id, offset, length};
  release(std::span<const range>(&r, 1), keep, stream);
}

// Forgets the backups of [begin, end); buffers left with no live granule are appended
// to `unused` (for retire_buffers: a restore may still read them).
void reservation_manager::drop_backup_granules(reservation& r, std::size_t begin, std::size_t end,
                                               std::vector<std::pair<void*, std::size_t>>& unused) {
  if (r.saved.empty()) return;
  r.cut_saved(begin);
  r.cut_saved(end);
  const std::size_t g = impl_->granularity_;
  for (auto it = r.saved.lower_bound(begin); it != r.saved.end() && it->first < end;) {
    const std::size_t n = (it->second.end - it->first) / g;
    auto seg = r.backups.find(it->second.segment);
    r.saved_granules -= n;
    impl_->backup_bytes_ -= n * g;
    seg->second.live -= n;
    if (seg->second.live == 0) {
      unused.emplace_back(seg->second.host, seg->second.bytes);
      r.backups.erase(seg);
    }
    it = r.saved.erase(it);
  }
}

// Hands `buffers` back to the pinned pool after the copies enqueued so far on the copy
// stream (an event; on the host driver at once).  Never throws: when no event can be
// recorded, the copy stream is waited for instead.
void reservation_manager::retire_buffers(std::vector<std::pair<void*, std::size_t>>& buffers) noexcept {
  if (buffers.empty()) return;
  event_t e = nullptr;
  try {
    e = take_event();
    impl_->drv_->record(e, impl_->copy_stream_);
    impl_->retired_.push_back({e, std::move(buffers)});
  } catch (const std::exception& ex) {
    if (e != nullptr) impl_->free_events_.push_back(e);
    try {
      impl_->drv_->synchronize_stream(impl_->copy_stream_);
    } catch (const std::exception& ex2) {
      detail::log(log_level::error, std::string("reservation_manager: waiting for restores: ") + ex2.what());
    }
    for (auto& [p, n] : buffers) impl_->pinned_->give_back(p, n);
  }
  buffers.clear();
  reap_retired(false);
}

void reservation_manager::reap_retired(bool wait) noexcept {
  for (std::size_t i = 0; i < impl_->retired_.size();) {
    bool done = false;
    try {
      if (wait) impl_->drv_->synchronize(impl_->retired_[i].done);
      done = wait || impl_->drv_->query(impl_->retired_[i].done);
    } catch (const std::exception& e) {
      detail::log(log_level::error, std::string("reservation_manager: backup buffers: ") + e.what());
      done = wait;
    }
    if (!done) {
      ++i;
      continue;
    }
    for (auto& [p, n] : impl_->retired_[i].buffers) impl_->pinned_->give_back(p, n);
    try {
      impl_->free_events_.push_back(impl_->retired_[i].done);
    } catch (...) {
      impl_->drv_->destroy_event(impl_->retired_[i].done);
    }
    impl_->retired_[i] = std::move(impl_->retired_.back());
    impl_->retired_.pop_back();
  }
}

// Note [Splitting chunks]
// cuMemUnmap takes whole mappings only, so a release that cuts through a chunk first
// replaces the chunk by smaller ones with the same contents: the new chunks are mapped
// at a scratch range, the old chunk's bytes copied there (after the streams that use
// it), the old chunk unmapped and the new ones mapped in its place.  Rare by design:
// materialize cuts ranges at their own boundaries, so only a release of a sub-range
// of what was materialized splits.
//
// A split moves the bytes of the chunk outside the released range, so it is safe only
// when nothing else touches them meanwhile: the manager's mutex orders it against every
// other call of the manager, and the copy waits for the streams recorded on the
// reservation, but a host thread (or a kernel on a stream not recorded) writing those
// bytes during the split loses its writes or faults.  Hence the rule: only an explicit
// release of a range by the reservation's owner may split, and the owner must not use
// the rest of the cut chunks during that call.  Nothing inside the library splits: the
// caching allocator (empty_cache, the out-of-memory retry, pause) gives memory back with
// release_whole_chunks, which releases only chunks that lie wholly inside its ranges and
// so needs no new chunk (freeing cache works when memory is full) and moves nothing.
void reservation_manager::split_at(reservation& r, std::size_t cut, stream_t stream, event_t after) {
  auto it = r.chunks.upper_bound(cut);
  if (it == r.chunks.begin()) return;
  --it;
  const std::size_t a = it->first;
  const chunk old = it->second;
  if (!(a < cut && cut < a + old.bytes)) return;

  auto pieces = plan_chunks({{a, cut}, {cut, a + old.bytes}});
  std::vector<std::pair<std::uintptr_t, std::size_t>> at_scratch, at_home;
  bool old_unmapped = false;
  std::vector<event_t> users;
  try {
    if (impl_->scratch_ == 0) {
      impl_->scratch_bytes_ = impl_->pool_->classes().back();
      impl_->scratch_ = impl_->drv_->reserve(impl_->scratch_bytes_, impl_->scratch_bytes_);
    }
    for (auto& [pos, c] : pieces) {
      impl_->drv_->map(impl_->scratch_ + (pos - a), c.bytes, c.handle);
      at_scratch.emplace_back(impl_->scratch_ + (pos - a), c.bytes);
    }
    impl_->drv_->set_access(impl_->scratch_, old.bytes);
    std::vector<reservation*> rs{&r};
    if (after == nullptr) users = record_users(rs, stream);
    for (event_t e : users) impl_->drv_->stream_wait(impl_->copy_stream_, e);
    if (after != nullptr) impl_->drv_->stream_wait(impl_->copy_stream_, after);
    impl_->drv_->copy_async(reinterpret_cast<void*>(impl_->scratch_), reinterpret_cast<const void*>(r.base + a), old.bytes, impl_->copy_stream_);
    impl_->drv_->synchronize_stream(impl_->copy_stream_);
    give_events(users);
    while (!at_scratch.empty()) {
      impl_->drv_->unmap(at_scratch.back().first, at_scratch.back().second);
      at_scratch.pop_back();
    }
    impl_->drv_->unmap(r.base + a, old.bytes);
    old_unmapped = true;
    for (auto& [pos, c] : pieces) {
      impl_->drv_->map(r.base + pos, c.bytes, c.handle);
      at_home.emplace_back(r.base + pos, c.bytes);
    }
    impl_->drv_->set_access(r.base + a, old.bytes);
  } catch (...) {
    give_events(users);
    for (auto& [va, n] : at_scratch) unmap_quietly(va, n);
    for (auto& [va, n] : at_home) unmap_quietly(va, n);
    if (old_unmapped) {
      try {
        impl_->drv_->map(r.base + a, old.bytes, old.handle);
        impl_->drv_->set_access(r.base + a, old.bytes);
      } catch (const std::exception& e) {
        detail::log(log_level::error, std::string("split rollback could not remap a chunk: ") + e.what());
      }
    }
    for (auto& [pos, c] : pieces) impl_->pool_->give_back(c);
    throw;
  }
  r.chunks.erase(it);
  for (auto& [pos, c] : pieces) r.chunks.emplace(pos, c);
  impl_->pool_->give_back(old);
  ++impl_->splits_;
}

void reservation_manager::release(std::span<const range> ranges, keep_mode keep, stream_t stream) {
  detail::log_after_unlock lk(impl_->mu_);
  release_locked(ranges, keep, stream, nullptr);
}

void reservation_manager::release_after(std::span<const range> ranges, keep_mode keep, event_t last_use) {
  DFA_EXPECTS(last_use != nullptr, "release_after: last_use is null");
  detail::log_after_unlock lk(impl_->mu_);
  release_locked(ranges, keep, nullptr, last_use);
}

void reservation_manager::release_locked(std::span<const range> ranges, keep_mode keep, stream_t stream, event_t after) {
  expect_valid(keep, "release");
  reap_retired(false);
  const std::size_t g = impl_->granularity_;
  std::vector<work_item> ws = resolve(ranges);

  // Chunks cut by a range are split first; the contents stay as they were, so a
  // failure later leaves the reservation equivalent to before.
  for (const auto& w : ws) {
    auto& r = *w.r;
    split_at(r, w.begin, stream, after);
    split_at(r, w.end, stream, after);
  }

  // The chunks to unmap, in runs of adjacent chunks (one backup buffer per run).
  struct victim {
    reservation* r;
    std::size_t pos;
    chunk c;
  };
  struct run {
    reservation* r;
    std::size_t begin, end;
    void* host = nullptr;
  };
  std::vector<victim> victims;
  std::vector<run> runs;
  std::vector<reservation*> touched;
  for (const auto& w : ws) {
    auto& r = *w.r;
    for (auto it = r.chunks.lower_bound(w.begin); it != r.chunks.end() && it->first < w.end; ++it) {
      victims.push_back({&r, it->first, it->second});
      if (!runs.empty() && runs.back().r == &r && runs.back().end == it->first) runs.back().end += it->second.bytes;
      else runs.push_back({&r, it->first, it->first + it->second.bytes});
    }
    if (std::find(touched.begin(), touched.end(), &r) == touched.end()) touched.push_back(&r);
  }

  std::vector<event_t> users;
  auto give_back_hosts = [&] {
    for (auto& rn : runs) {
      impl_->pinned_->give_back(rn.host, rn.end - rn.begin);
      rn.host = nullptr;
    }
  };
  if (!victims.empty()) {
    try {
      if (keep == keep_mode::host)
        for (auto& rn : runs) rn.host = impl_->pinned_->acquire(rn.end - rn.begin);
      // The events to wait for: the caller's, or ones recorded now on every user stream.
      if (after == nullptr) users = record_users(touched, stream);
      std::vector<event_t> waits = users;
      if (after != nullptr) waits.push_back(after);
      if (keep == keep_mode::host) {
        for (event_t e : waits) impl_->drv_->stream_wait(impl_->copy_stream_, e);
        for (auto& rn : runs)
          impl_->drv_->copy_async(rn.host, reinterpret_cast<const void*>(rn.r->base + rn.begin), rn.end - rn.begin, impl_->copy_stream_);
        impl_->drv_->synchronize_stream(impl_->copy_stream_);
      } else {
        for (event_t e : waits) impl_->drv_->synchronize(e);
      }
      give_events(users);
    } catch (...) {
      give_events(users);
      try {
        impl_->drv_->synchronize_stream(impl_->copy_stream_);
      } catch (...) {
        detail::log_current("release rollback: waiting for backup copies");
      }
      give_back_hosts();
      throw;
    }

    // Unmap; on failure map back what was unmapped.
    std::size_t done = 0;
    try {
      for (; done < victims.size(); ++done) impl_->drv_->unmap(victims[done].r->base + victims[done].pos, victims[done].c.bytes);
    } catch (...) {
      try {
        for (std::size_t i = 0; i < done; ++i) {
          impl_->drv_->map(victims[i].r->base + victims[i].pos, victims[i].c.bytes, victims[i].c.handle);
          impl_->drv_->set_access(victims[i].r->base + victims[i].pos, victims[i].c.bytes);
        }
      } catch (const std::exception& e) {
        detail::log(log_level::error, std::string("release rollback could not remap a chunk: ") + e.what());
      }
      give_back_hosts();
      throw;
    }
  }

  // Commit.
  std::vector<std::pair<void*, std::size_t>> unused;
  for (const auto& w : ws) {
    auto& r = *w.r;
    if (keep == keep_mode::discard) drop_backup_granules(r, w.begin, w.end, unused);
  }
  for (const auto& v : victims) {
    v.r->chunks.erase(v.pos);
    impl_->pool_->give_back(v.c);
  }
  for (const auto& rn : runs) {
    reservation& r = *rn.r;
    std::uint64_t sid = 0;
    if (keep == keep_mode::host) {
      sid = r.next_segment++;
      r.backups.emplace(sid, backup_segment{rn.begin, rn.end - rn.begin, rn.host, (rn.end - rn.begin) / g});
      r.saved.emplace(rn.begin, reservation::saved_run{rn.end, sid});
      r.saved_granules += (rn.end - rn.begin) / g;
      impl_->backup_bytes_ += rn.end - rn.begin;
    }
    r.backed_granules -= (rn.end - rn.begin) / g;
    impl_->backed_bytes_ -= rn.end - rn.begin;
  }
  for (reservation* r : touched)
    if (r->backed_granules == 0) r->streams.clear();
  retire_buffers(unused);
}

std::vector<range> reservation_manager::release_whole_chunks(std::span<const range> ranges, keep_mode keep,
                                                             stream_t stream) {
  expect_valid(keep, "release_whole_chunks");
  detail::log_after_unlock lk(impl_->mu_);
  std::vector<range> inner;
  for (const auto& w : resolve(ranges)) {
    auto& r = *w.r;
    for (auto it = r.chunks.lower_bound(w.begin); it != r.chunks.end() && it->first < w.end; ++it) {
      if (it->first + it->second.bytes > w.end) break;
      if (!inner.empty() && inner.back().id == r.id && inner.back().offset + inner.back().length == it->first)
        inner.back().length += it->second.bytes;
      else inner.push_back({r.id, it->first, it->second.bytes});
    }
  }
  if (!inner.empty()) release_locked(inner, keep, stream, nullptr);
  return inner;
}

// ---- queries ------------------------------------------------------------------------

void reservation_manager::record_stream(reservation_id id, stream_t stream) {
  detail::log_after_unlock lk(impl_->mu_);
  get(id).use(stream);
}

bool reservation_manager::is_backed(reservation_id id, std::size_t offset, std::size_t length) const {
  detail::log_after_unlock lk(impl_->mu_);
  const reservation& r = get(id);
  auto [b, e] = clamp(r, offset, length);
  return gaps(r.chunks, b, e).empty();
}

std::vector<range> reservation_manager::backed_ranges(reservation_id id) const {
  detail::log_after_unlock lk(impl_->mu_);
  const reservation& r = get(id);
  std::vector<range> out;
  for (const auto& [pos, c] : r.chunks) {
    if (!out.empty() && out.back().offset + out.back().length == pos) out.back().length += c.bytes;
    else out.push_back({r.id, pos, c.bytes});
  }
  return out;
}

std::vector<bool> reservation_manager::backed_granules(reservation_id id) const {
  detail::log_after_unlock lk(impl_->mu_);
  const reservation& r = get(id);
  std::vector<bool> out(r.padded / impl_->granularity_, false);
  for (const auto& [pos, c] : r.chunks)
    for (std::size_t i = pos / impl_->granularity_; i < (pos + c.bytes) / impl_->granularity_; ++i) out[i] = true;
  return out;
}

reservation_info reservation_manager::info(reservation_id id) const {
  detail::log_after_unlock lk(impl_->mu_);
  const reservation& r = get(id);
  return {r.id, r.base, r.size, r.padded, r.backed_granules * impl_->granularity_, r.saved_granules * impl_->granularity_};
}

std::optional<reservation_id> reservation_manager::find(const void* ptr) const {
  detail::log_after_unlock lk(impl_->mu_);
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = impl_->by_address_.upper_bound(p);
  if (it == impl_->by_address_.begin()) return std::nullopt;
  --it;
  const reservation& r = get(it->second);
  if (p >= r.base + r.padded) return std::nullopt;
  return r.id;
}

reservation_stats reservation_manager::stats() const {
  detail::log_after_unlock lk(impl_->mu_);
  reservation_stats s;
  s.reservations = impl_->reservations_.size();
  s.reserved_bytes = impl_->reserved_bytes_;
  s.backed_bytes = impl_->backed_bytes_;
  s.peak_backed_bytes = impl_->peak_backed_;
  s.backup_bytes = impl_->backup_bytes_;
  s.splits = impl_->splits_;
  s.pool = impl_->pool_->stats();
  s.pinned = impl_->pinned_->stats();
  return s;
}

void reservation_manager::reset_peak() noexcept {
  detail::log_after_unlock lk(impl_->mu_);
  impl_->peak_backed_ = impl_->backed_bytes_;
}

std::size_t reservation_manager::trim_backup_cache(std::size_t keep_bytes) {
  detail::log_after_unlock lk(impl_->mu_);
  reap_retired(true);
  return impl_->pinned_->trim(keep_bytes);
}

}  // namespace deferalloc
