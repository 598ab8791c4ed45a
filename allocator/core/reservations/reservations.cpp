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
//    the chunks go back to the pool.  release_keeping copies only the ranges its caller
//    names (the rest of the chunks holds nothing worth keeping): the other granules
//    released get saved runs without a backup segment (segment 0), which a restore
//    leaves undefined and which count as saved for the restore's check only.
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

std::shared_ptr<chunk_pool> not_null(std::shared_ptr<chunk_pool> pool) {
  DFA_EXPECTS(pool != nullptr, "reservation_manager: pool is null");
  return pool;
}

// The streams serve the pool's device: where both halves belong to whole drivers, the
// same driver.
std::shared_ptr<stream_ops> streams_of(const chunk_pool& pool, std::shared_ptr<stream_ops> streams) {
  DFA_EXPECTS(streams != nullptr, "reservation_manager: stream_ops is null");
  const auto* a = dynamic_cast<const driver*>(&pool.vmm());
  const auto* b = dynamic_cast<const driver*>(streams.get());
  DFA_EXPECTS(a == nullptr || b == nullptr || a == b,
              "reservation_manager: the pool's driver (" + (a ? a->name() : std::string()) +
                  ") and the stream_ops' driver (" + (b ? b->name() : std::string()) + ") are two drivers, not one");
  return streams;
}
}  // namespace

// ---- the public class: it forwards to the state (Note [Allocator state]) ----------------

reservation_manager::reservation_manager(std::shared_ptr<chunk_pool> pool, std::shared_ptr<stream_ops> streams,
                                         reservation_manager_config cfg)
    : impl_(std::make_unique<impl>(std::move(pool), std::move(streams), cfg)) {}
reservation_manager::~reservation_manager() = default;

reservation_id reservation_manager::reserve(std::size_t bytes) { return impl_->reserve(bytes); }
void* reservation_manager::address(reservation_id id) const { return impl_->address(id); }
void reservation_manager::materialize(reservation_id id, std::size_t offset, std::size_t length, fill_mode fill,
                                      stream_t stream) {
  const range r{id, offset, length};
  impl_->materialize(std::span<const range>(&r, 1), fill, stream);
}
void reservation_manager::materialize(std::span<const range> ranges, fill_mode fill, stream_t stream) {
  impl_->materialize(ranges, fill, stream);
}
void reservation_manager::materialize_whole_pieces(std::span<const range> ranges, fill_mode fill, stream_t stream) {
  impl_->materialize(ranges, fill, stream, true);
}
void reservation_manager::release(reservation_id id, std::size_t offset, std::size_t length, keep_mode keep,
                                  stream_t stream) {
  const range r{id, offset, length};
  impl_->release(std::span<const range>(&r, 1), keep, stream, nullptr);
}
void reservation_manager::release(std::span<const range> ranges, keep_mode keep, stream_t stream) {
  impl_->release(ranges, keep, stream, nullptr);
}
std::vector<range> reservation_manager::release_whole_chunks(std::span<const range> ranges, keep_mode keep,
                                                             stream_t stream) {
  return impl_->release_whole_chunks(ranges, keep, stream);
}
void reservation_manager::release_keeping(std::span<const range> ranges, std::span<const range> kept,
                                          stream_t stream) {
  impl_->release(ranges, keep_mode::host, stream, nullptr, &kept);
}
void reservation_manager::release_after(std::span<const range> ranges, keep_mode keep, event_t last_use) {
  DFA_EXPECTS(last_use != nullptr, "release_after: last_use is null");
  impl_->release(ranges, keep, nullptr, last_use);
}
void reservation_manager::record_stream(reservation_id id, stream_t stream) { impl_->record_stream(id, stream); }
void reservation_manager::free(reservation_id id, stream_t stream) { impl_->free(id, stream); }
bool reservation_manager::is_backed(reservation_id id, std::size_t offset, std::size_t length) const {
  return impl_->is_backed(id, offset, length);
}
std::vector<range> reservation_manager::backed_ranges(reservation_id id) const { return impl_->backed_ranges(id); }
std::vector<bool> reservation_manager::backed_granules(reservation_id id) const { return impl_->backed_granules(id); }
reservation_info reservation_manager::info(reservation_id id) const { return impl_->info(id); }
std::optional<reservation_id> reservation_manager::find(const void* ptr) const { return impl_->find(ptr); }
reservation_stats reservation_manager::stats() const { return impl_->stats(); }
void reservation_manager::reset_peak() noexcept { impl_->reset_peak(); }
std::size_t reservation_manager::trim_backup_cache(std::size_t keep_bytes) { return impl_->trim_backup_cache(keep_bytes); }
std::size_t reservation_manager::granularity() const { return impl_->granularity(); }
chunk_pool& reservation_manager::pool() const { return impl_->pool(); }
vmm_ops& reservation_manager::vmm() const { return impl_->vmm(); }
stream_ops& reservation_manager::streams() const { return impl_->streams(); }

// ---- life -----------------------------------------------------------------------------

reservation_manager::impl::impl(std::shared_ptr<chunk_pool> pool, std::shared_ptr<stream_ops> streams,
                                const reservation_manager_config& cfg)
    : pool_(not_null(std::move(pool))),
      streams_ptr_(streams_of(*pool_, std::move(streams))),
      vmm_(pool_->vmm()),
      streams_(*streams_ptr_),
      granularity_(vmm_.granularity()),
      pinned_(std::make_unique<pinned_pool>(pool_->vmm_ptr(), cfg.pinned_cache)),
      events_(streams_) {
  copy_stream_ = streams_.create_stream();
}

reservation_manager::impl::~impl() {
  std::vector<reservation_id> ids;
  {
    detail::log_after_unlock lk(mu_);
    ids = table_.ids();
  }
  for (auto id : ids) {
    try {
      free(id, nullptr);
    } catch (const std::exception& e) {
      detail::log(log_level::error, std::string("reservation_manager: freeing reservation at destruction: ") + e.what());
    }
  }
  reap_retired(true);
  try {
    streams_.synchronize_stream(copy_stream_);
    if (scratch_ != 0) vmm_.free_reservation(scratch_, scratch_bytes_);
  } catch (const std::exception& e) {
    detail::log(log_level::error, std::string("reservation_manager: ") + e.what());
  }
  streams_.destroy_stream(copy_stream_);
}

std::pair<std::size_t, std::size_t> reservation_manager::impl::clamp(const reservation& r, std::size_t offset,
                                                                     std::size_t length) const {
  DFA_EXPECTS(offset % granularity_ == 0, "offset " + std::to_string(offset) + " is not a multiple of the granularity (" +
                                              std::to_string(granularity_) + ")");
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
    DFA_EXPECTS(end % granularity_ == 0, "length " + std::to_string(length) +
                                             " does not end on a granule or at the reservation's end");
  }
  return {offset, end};
}

void reservation_manager::impl::unmap_quietly(std::uintptr_t va, std::size_t bytes) noexcept {
  try {
    vmm_.unmap(va, bytes);
  } catch (const std::exception& e) {
    detail::log(log_level::error, std::string("rollback: unmap failed, a chunk stays mapped: ") + e.what());
  }
}

std::vector<event_t> reservation_manager::impl::record_users(const std::vector<reservation*>& rs, stream_t stream) {
  std::vector<stream_t> streams{stream};
  for (reservation* r : rs)
    for (stream_t s : r->streams)
      if (std::find(streams.begin(), streams.end(), s) == streams.end()) streams.push_back(s);
  std::vector<event_t> events;
  try {
    for (stream_t s : streams) {
      events.push_back(events_.take());
      streams_.record(events.back(), s);
    }
  } catch (...) {
    events_.give(events);
    throw;
  }
  return events;
}

// ---- reserve / free -----------------------------------------------------------------

reservation_id reservation_manager::impl::reserve(std::size_t bytes) {
  DFA_EXPECTS(bytes > 0, "reserve: size is zero");
  DFA_EXPECTS(bytes <= k_max_reservation, "reserve: size " + std::to_string(bytes) + " is absurd (limit 256 TiB)");
  const std::size_t padded = (bytes + granularity_ - 1) / granularity_ * granularity_;
  // A power of two (the driver requires it), up to the largest chunk class.
  const std::size_t align = std::max(granularity_, std::bit_floor(std::min(pool_->classes().back(), padded)));
  detail::log_after_unlock lk(mu_);
  auto r = std::make_unique<reservation>();
  r->base = vmm_.reserve(padded, align);
  r->size = bytes;
  r->padded = padded;
  const std::uintptr_t base = r->base;
  try {
    const reservation_id id = table_.add(std::move(r));
    counts_.reserved(padded);
    return id;
  } catch (...) {
    vmm_.free_reservation(base, padded);
    throw;
  }
}

void* reservation_manager::impl::address(reservation_id id) const {
  detail::log_after_unlock lk(mu_);
  return reinterpret_cast<void*>(table_.get(id).base);
}

void reservation_manager::impl::free(reservation_id id, stream_t stream) {
  detail::log_after_unlock lk(mu_);
  reservation& r = table_.get(id);
  // Release everything (also drops backups) through the one release path.
  const range all{id, 0, whole};
  release_locked(std::span<const range>(&all, 1), keep_mode::discard, stream, nullptr);
  vmm_.free_reservation(r.base, r.padded);
  counts_.unreserved(r.padded);
  table_.erase(r);
}

// Validates every range of a batch (known reservation, in bounds, aligned, no two
// overlapping) and returns them as byte ranges, sorted.
std::vector<reservation_manager::work_item> reservation_manager::impl::resolve(std::span<const range> ranges) {
  std::vector<work_item> ws;
  for (const range& rg : ranges) {
    reservation& r = table_.get(rg.id);
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

void reservation_manager::impl::record_stream(reservation_id id, stream_t stream) {
  detail::log_after_unlock lk(mu_);
  table_.get(id).use(stream);
}

bool reservation_manager::impl::is_backed(reservation_id id, std::size_t offset, std::size_t length) const {
  detail::log_after_unlock lk(mu_);
  const reservation& r = table_.get(id);
  auto [b, e] = clamp(r, offset, length);
  return gaps(r.chunks, b, e).empty();
}

std::vector<range> reservation_manager::impl::backed_ranges(reservation_id id) const {
  detail::log_after_unlock lk(mu_);
  const reservation& r = table_.get(id);
  std::vector<range> out;
  for (const auto& [pos, c] : r.chunks) {
    if (!out.empty() && out.back().offset + out.back().length == pos) out.back().length += c.bytes;
    else out.push_back({r.id, pos, c.bytes});
  }
  return out;
}

std::vector<bool> reservation_manager::impl::backed_granules(reservation_id id) const {
  detail::log_after_unlock lk(mu_);
  const reservation& r = table_.get(id);
  std::vector<bool> out(r.padded / granularity_, false);
  for (const auto& [pos, c] : r.chunks)
    for (std::size_t i = pos / granularity_; i < (pos + c.bytes) / granularity_; ++i) out[i] = true;
  return out;
}

reservation_info reservation_manager::impl::info(reservation_id id) const {
  detail::log_after_unlock lk(mu_);
  const reservation& r = table_.get(id);
  return {r.id, r.base, r.size, r.padded, r.backed_granules * granularity_, r.saved_granules * granularity_};
}

std::optional<reservation_id> reservation_manager::impl::find(const void* ptr) const {
  detail::log_after_unlock lk(mu_);
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  const reservation* r = table_.holding(p);
  if (r == nullptr) return std::nullopt;
  return r->id;
}

reservation_stats reservation_manager::impl::stats() const {
  detail::log_after_unlock lk(mu_);
  reservation_stats s;
  s.reservations = table_.size();
  counts_.fill(s);
  s.pool = pool_->stats();
  s.pinned = pinned_->stats();
  return s;
}

void reservation_manager::impl::reset_peak() noexcept {
  detail::log_after_unlock lk(mu_);
  counts_.reset_peak();
}

}  // namespace deferalloc
