// The caching allocator: stream-ordered malloc/free for a whole process, on top of
// one reservation_manager (and so one chunk pool).  See Note [Caching allocator] in
// allocator/caching/caching_allocator.cpp.
//
// What it gives PyTorch (through the C ABI's dfa_malloc / dfa_free, a MemPool, full
// replacement or LibTorch's install()):
//  - blocks carved from a few large reservations that are materialized on demand
//    (expandable: address space is reserved once, physical memory grows granule by
//    granule), size classes with splitting and coalescing;
//  - stream order: a block freed on stream S is reused at once on S, on another
//    stream only after an event recorded on S after the free has completed;
//  - empty_cache() really returns memory: whole free chunks are released (memory in
//    use never moves) and the chunk pool and pinned cache trimmed;
//  - tags: allocations made inside a tagged region can be paused (physical memory
//    released, addresses kept, contents discarded or kept in a host backup) and
//    resumed at the same addresses, chunks coming back from the pool;
//  - statistics with PyTorch's key names.
#pragma once
#include <deferalloc/core/config.hpp>
#include <deferalloc/core/reservations.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace deferalloc {

// caching_allocator_config is in core/config.hpp: its knobs are settings (DEFERALLOC_CONF).

/// Per-thread tagged region of one allocator: allocations made on this thread while
/// the object lives belong to `tag`.  Regions nest (the innermost wins).
class caching_allocator;

/// A tag's id in one caching allocator's registry (register_tag); `none`: untagged.
enum class tag_id : std::uint32_t { none = 0 };
class DFA_API tag_scope {
 public:
  tag_scope(caching_allocator& a, std::string_view tag);
  ~tag_scope();
  tag_scope(const tag_scope&) = delete;
  tag_scope& operator=(const tag_scope&) = delete;

 private:
  caching_allocator& a_;
};

class DFA_API caching_allocator {
 public:
  /// Builds an allocator on `mgr`, which must outlive it.  No driver call.
  /// @throws invalid_argument for a bad config (fraction outside (0, 1], ...)
  caching_allocator(reservation_manager& mgr, caching_allocator_config cfg = {});
  /// Frees every segment (blocks still allocated are reported at log level warn).
  ~caching_allocator();
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;

  /// A block of at least `bytes` usable on `stream`, aligned to 512 bytes.
  /// Cost: cached block of this stream: no driver call, one mutex; otherwise a block of
  /// another stream whose free event completed (one event query), or new granules
  /// (materialize: chunks from the pool, one cuMemMap per chunk, one cuMemSetAccess).
  /// Under memory pressure: wait for pending frees, release cached granules, retry once.
  /// `stream` must stay alive until this allocator is destroyed or empty_cache() has
  /// run (releasing memory waits for every stream that used it, as PyTorch's
  /// record_stream does; PyTorch's pooled streams are never destroyed).
  /// @throws invalid_argument (0 or absurd size), invalid_state (the current tag is
  ///         paused), out_of_memory (after the retry; counted in num_ooms)
  void* allocate(std::size_t bytes, stream_t stream = nullptr);
  /// The same, in tag `tag` whatever tagged region this thread is in (tag_id::none:
  /// the untagged pools).  The faces that keep their own current tag (the C ABI) use it.
  /// @throws invalid_argument for an id this allocator did not give
  void* allocate(std::size_t bytes, stream_t stream, tag_id tag);
  /// Returns a block.  `bytes` is the size given to allocate (0: not checked); `stream`
  /// is where its last use was ordered (it becomes the block's stream).  No driver call
  /// unless record_stream added streams (then one event per added stream).
  /// @throws invalid_argument for a pointer this allocator did not return (or already
  ///         freed) or a wrong size; nothing changes then.
  void deallocate(void* ptr, std::size_t bytes, stream_t stream = nullptr);
  /// Notes that `stream` uses the block: its free waits for an event on `stream` too.
  /// @throws invalid_argument for a pointer we do not own.
  void record_stream(void* ptr, stream_t stream);

  /// Releases every chunk that holds only free blocks (after the streams that used
  /// them; a chunk under an allocated block is never touched) and trims the chunk pool
  /// and the pinned backup cache, so the memory goes back to the device.  Needs no new
  /// memory.  Returns the physical bytes given back to the driver.  Cost: a batched
  /// release per segment, one cuMemRelease per chunk.
  std::size_t empty_cache();
  /// @throws invalid_argument unless 0 < fraction <= 1.
  void set_memory_fraction(double fraction);
  double memory_fraction() const;

  /// True when `ptr` points into a block this allocator handed out (allocated now).
  bool owns(const void* ptr) const;
  /// The start and size of the allocated block that contains `ptr`.
  /// @throws invalid_argument when none does.
  void* base_allocation(const void* ptr, std::size_t* size) const;
  /// The size of the allocated block that starts at `ptr` (0 when none does).
  std::size_t allocation_size(const void* ptr) const;

  // ---- tags ----
  /// Checks a tag name: 1 to 256 bytes, no control character (bytes 0x00-0x1f, 0x7f: a
  /// newline would split the list of tag names, a NUL would cut the name short in C).
  /// @throws invalid_argument naming `call`, the character and its offset
  static void check_tag_name(std::string_view call, std::string_view tag);
  /// The id of `tag` in this allocator's registry, registering it on first use
  /// (pause/resume know it from then on).  One mutex; no driver call.
  /// @throws invalid_argument for a name check_tag_name refuses
  tag_id register_tag(std::string_view tag);
  /// Enters a tagged region on this thread (prefer tag_scope).  An empty tag is invalid.
  void begin_tag(std::string_view tag);
  /// Leaves the innermost region of this thread.  @throws invalid_state when none.
  void end_tag();
  /// The innermost tag of this thread ("" outside any region).
  std::string current_tag() const;
  /// Releases the physical memory of every allocation of `tag` (addresses stay), after
  /// the streams that used it; keep_mode::host keeps the contents of allocated blocks
  /// in pinned host memory (one batched release: the copies run back to back).
  /// Free granules of the tag are discarded.  Only whole chunks are released: the chunks
  /// under resident allocations (set_resident) stay, with whatever shares them.
  /// @throws invalid_argument (unknown tag), invalid_state (called inside a tagged
  ///         region, tag already paused), out_of_memory (backup), cuda_error
  void pause(std::string_view tag, keep_mode keep = keep_mode::discard, stream_t stream = nullptr);
  /// Backs the tag's allocations again at the same addresses with chunks from the pool;
  /// with the contents restored when it was paused with keep_mode::host (asynchronous,
  /// `stream` waits for the copies), undefined otherwise.
  /// @throws invalid_argument (unknown tag), invalid_state (not paused), out_of_memory
  void resume(std::string_view tag, stream_t stream = nullptr);
  bool is_paused(std::string_view tag) const;
  /// Marks an allocation to stay backed when its tag is paused (e.g. NCCL buffers).
  /// Chunks it shares with other blocks of the tag stay backed too.
  /// @throws invalid_argument for a pointer we do not own, invalid_state when its tag is paused
  void set_resident(void* ptr, bool resident = true);
  /// Known tags, in creation order.
  std::vector<std::string> tags() const;

  // ---- snapshots (Note [Memory snapshots] in caching_snapshot.cpp) ----
  /// Starts (max_entries > 0) or stops (0) recording allocator events; stopping drops
  /// the events recorded.  A ring: the newest max_entries events are kept.
  void record_history(std::size_t max_entries);
  /// The allocator's state as text, one record a line (see Note [Memory snapshots]):
  /// segments (their backed runs), blocks, tags, and the recorded events.  One mutex.
  std::string snapshot_text() const;

  // ---- statistics ----
  /// PyTorch's keys ("allocated_bytes.all.current", "reserved_bytes.large_pool.peak",
  /// "num_alloc_retries", "num_ooms", ...) plus deferalloc's ("deferalloc.*").
  /// One mutex; no driver call.
  std::map<std::string, std::int64_t> stats() const;
  /// One statistic by key.  @throws invalid_argument for an unknown key.
  std::int64_t stat(std::string_view key) const;
  /// Peak values := current values (PyTorch's reset_peak_memory_stats).
  void reset_peak_stats();
  /// allocated/freed counters := 0, num_* := 0 (PyTorch's reset_accumulated_memory_stats).
  void reset_accumulated_stats();

  reservation_manager& reservations() const { return mgr_; }
  /// The configuration now (one copy, in the implementation: set_memory_fraction shows here).
  caching_allocator_config config() const;

 private:
  // The state and the operations: allocator/caching/allocator_state.hpp.
  class impl;
  reservation_manager& mgr_;
  std::unique_ptr<impl> impl_;
};

}  // namespace deferalloc
