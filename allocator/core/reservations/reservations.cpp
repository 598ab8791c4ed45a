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
//  - release: a chunk cut by the range is split (See Note [Splitting chunks] in split.cpp;
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
//
// The manager's operations live in this folder, one file each: reservations.cpp (life,
// reserve / free, validation, queries), materialize.cpp, release.cpp, split.cpp, backups.cpp;
// its state is state.hpp.
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/reservations.hpp>

#include <bit>

#include "core/reservations/state.hpp"
#include "log.hpp"

namespace deferalloc {

using detail::gaps;

namespace {
constexpr std::size_t k_max_reservation = std::size_t{1} << 48;  // 256 TiB: beyond any device's VA
}  // namespace

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

}  // namespace deferalloc
