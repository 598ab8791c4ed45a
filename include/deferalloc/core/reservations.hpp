// Deferred reservations: device addresses that never change, backed by physical
// chunks only between materialize and release.  See Note [Deferred reservations]
// in allocator/core/reservations/reservations.cpp.
#pragma once
#include <deferalloc/core/chunk_pool.hpp>
#include <deferalloc/core/pinned_pool.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace deferalloc {

/// How a materialize fills the granules it backs.
enum class fill_mode {
  undefined,  ///< whatever the chunk held
  zero,       ///< zeros, written on the caller's stream
  restore,    ///< the contents kept by an earlier release(keep_mode::host); every granule must have one
              ///< (granules a release_keeping left outside its kept ranges come back undefined)
};
/// What a release does with the contents.
enum class keep_mode {
  discard,  ///< contents are lost (and any older backup of the range is dropped)
  host,     ///< copied to pinned host memory first, restored bit-exactly by fill_mode::restore
};

using reservation_id = std::uint64_t;

/// `length` meaning "up to the end of the reservation".
inline constexpr std::size_t whole = std::numeric_limits<std::size_t>::max();

/// A range of one reservation, for the batched calls.
struct range {
  reservation_id id{};
  std::size_t offset = 0;
  std::size_t length = whole;
};

struct reservation_info {
  reservation_id id{};
  std::uintptr_t address{};
  std::size_t size{};           ///< bytes asked for
  std::size_t reserved_bytes{}; ///< padded to the granularity
  std::size_t backed_bytes{};
  std::size_t backup_bytes{};   ///< granules whose contents wait in host backups
};

struct reservation_stats {
  std::size_t reservations = 0;
  std::size_t reserved_bytes = 0;
  std::size_t backed_bytes = 0;
  std::size_t peak_backed_bytes = 0;
  std::size_t backup_bytes = 0;
  std::uint64_t splits = 0;  ///< chunks split because an explicit release cut through them
  pool_stats pool;
  pinned_pool_stats pinned;
};

struct reservation_manager_config {
  /// Pinned host bytes kept cached for backups after they are restored; beyond it the
  /// buffers are freed.  0 = nothing cached, SIZE_MAX = no limit.
  std::size_t pinned_cache = pinned_pool::default_cache_limit;
};

/// Owns reservations on one driver, backed from one chunk pool: the VMM primitives are the
/// pool's vmm_ops, the fills, backup copies and waits go through a stream_ops of the same
/// device (the same driver, where both are halves of one).  Thread-safe: every
/// call takes one mutex.  Offsets and lengths are multiples of the granularity,
/// except that a range may end at the reservation's size.  Host memory for the
/// bookkeeping grows with the chunks mapped and the backup runs, not with the bytes
/// reserved (reserving 16 TiB costs a few hundred bytes).
class DFA_API reservation_manager {
 public:
  /// @throws invalid_argument for a null pool or stream_ops, or halves of two drivers
  reservation_manager(std::shared_ptr<chunk_pool> pool, std::shared_ptr<stream_ops> streams,
                      reservation_manager_config cfg = {});
  /// Frees every reservation still alive (waiting for their streams), never throws.
  ~reservation_manager();
  reservation_manager(const reservation_manager&) = delete;
  reservation_manager& operator=(const reservation_manager&) = delete;

  /// Reserves `bytes` of address space; nothing is backed.  Cost: one cuMemAddressReserve
  /// (23 us for 256 GiB), 0 bytes of device memory.
  /// @throws invalid_argument (0 or absurd size), out_of_memory (address space)
  reservation_id reserve(std::size_t bytes);
  /// The reservation's device address; it never changes.  No driver call.
  void* address(reservation_id id) const;

  /// Backs the unbacked granules of the range (backed ones are left alone).
  /// Cost: chunks from the pool (cuMemCreate only when none is cached), one cuMemMap per
  /// chunk, one cuMemSetAccess per contiguous unbacked run; the fill is enqueued on
  /// `stream` (zero) or on the copy stream with `stream` waiting for it (restore).
  /// No host synchronisation.  All-or-nothing.
  /// @throws invalid_argument, invalid_state (restore without backup), out_of_memory, cuda_error
  void materialize(reservation_id id, std::size_t offset, std::size_t length, fill_mode fill, stream_t stream = nullptr);
  /// The same for many ranges at once.
  void materialize(std::span<const range> ranges, fill_mode fill, stream_t stream = nullptr);
  /// As materialize(), but each unbacked run is one chunk of its exact size where one can be
  /// had (cached or new), else each piece of the largest chunk class that fits is one chunk
  /// (a cached one of its class, else a new one) before smaller cached chunks are used: one
  /// mapping for a range paused and resumed often, where smaller cached chunks would map it
  /// in many.  Cost: as materialize(); may create a chunk while smaller ones stay cached
  /// (bounded by the pool's cache).
  void materialize_whole_pieces(std::span<const range> ranges, fill_mode fill, stream_t stream = nullptr);

  /// Unbacks the backed granules of the range (unbacked ones are left alone, except that
  /// keep_mode::discard drops their backups).  Waits on the host for events recorded on
  /// `stream` and on every stream given to record_stream (never the whole device), and for
  /// the backup copies; then one cuMemUnmap per chunk.  A chunk that the range cuts
  /// through is split first: its kept part is copied into new, smaller chunks (so this
  /// needs free memory), and the bytes of the chunk outside the range must not be
  /// touched by anyone during the call (Note [Splitting chunks]).  All-or-nothing.
  /// @throws invalid_argument, out_of_memory (backup memory), cuda_error
  void release(reservation_id id, std::size_t offset, std::size_t length, keep_mode keep, stream_t stream = nullptr);
  /// The same for many ranges: every backup copy is enqueued before the one host wait,
  /// so the copies run back to back at the link's speed.
  void release(std::span<const range> ranges, keep_mode keep, stream_t stream = nullptr);

  /// As the batched release(), but only the chunks that lie wholly inside a range are
  /// released: a chunk is never split, so the call needs no new memory (it works when
  /// memory is full) and never copies, unmaps or remaps a byte outside the ranges.
  /// Backups of unbacked granules are left alone.  What a caching allocator uses to give
  /// free space back (See Note [Splitting chunks] in allocator/core/reservations/split.cpp).
  /// Returns the ranges released (chunk boundaries, sorted), empty when none.
  /// Cost: as release() for the chunks released; no driver call when none.
  /// @throws invalid_argument, out_of_memory (backup memory), cuda_error
  std::vector<range> release_whole_chunks(std::span<const range> ranges, keep_mode keep, stream_t stream = nullptr);

  /// As the batched release() with keep_mode::host, but only the parts of the released
  /// chunks inside `kept` (ranges of the same reservations, granule-aligned) are copied to
  /// pinned memory, adjacent ones in one copy; the other granules released keep nothing.  A
  /// later materialize(fill_mode::restore) of the ranges restores the kept parts and leaves
  /// the rest undefined (as fill_mode::undefined would).  For a caller that places its own
  /// blocks in large chunks and knows which of their bytes are live.  Cost: as release(),
  /// with the bytes of `kept` copied instead of the chunks'.
  /// @throws invalid_argument, out_of_memory (backup memory), cuda_error
  void release_keeping(std::span<const range> ranges, std::span<const range> kept, stream_t stream = nullptr);

  /// As the batched release(), for a caller that knows exactly when its last use of the
  /// ranges completes: waits for `last_use` (an event of this driver) and for no stream.
  /// Recording an event on a user stream at release time also waits for everything
  /// enqueued on it since; a pipeline that keeps later work queued on the same streams
  /// uses this to wait for its own piece only.
  void release_after(std::span<const range> ranges, keep_mode keep, event_t last_use);

  /// Notes that `stream` uses the reservation: releases wait for it.  No driver call.
  void record_stream(reservation_id id, stream_t stream);
  /// Releases everything (discarding), drops backups and frees the address range.
  /// @throws invalid_argument for an unknown id (double free)
  void free(reservation_id id, stream_t stream = nullptr);

  /// True when every granule of the range is backed.  No driver call.
  bool is_backed(reservation_id id, std::size_t offset = 0, std::size_t length = whole) const;
  /// The backed parts of the reservation, in order, adjacent chunks merged (what a
  /// snapshot lists).  Cost: one pass over its chunks, one lock; no driver call.
  std::vector<range> backed_ranges(reservation_id id) const;
  /// Per-granule backed flags.  Cost: one bit per granule of the reservation (a test
  /// and debugging aid; is_backed answers for a range from the chunks alone).
  std::vector<bool> backed_granules(reservation_id id) const;
  reservation_info info(reservation_id id) const;
  /// The reservation that contains `ptr`, if any.
  std::optional<reservation_id> find(const void* ptr) const;
  reservation_stats stats() const;
  void reset_peak() noexcept;
  /// Frees cached pinned backup buffers until at most `keep_bytes` stay cached (after
  /// the restore copies that read them).  Returns the bytes freed.
  /// Cost: one wait for the copy stream when restores are in flight, one cuMemFreeHost
  /// per buffer.
  std::size_t trim_backup_cache(std::size_t keep_bytes = 0);

  std::size_t granularity() const;
  chunk_pool& pool() const;
  /// The pool's VMM half (the device's memory figures).
  vmm_ops& vmm() const;
  /// The stream half the manager was built with (events, waits).
  stream_ops& streams() const;

 private:
  // The state and the operations (the reservations, their chunks and backups, the pool,
  // the driver, events, statistics): allocator/core/reservations/state.hpp.
  struct backup_segment;
  struct reservation;
  struct work_item;
  class reservation_table;
  class byte_counts;
  class impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace deferalloc
