// The caching allocator's private state (caching_allocator::impl): its fields, the small
// helpers every file uses, and the operations of the files of this folder:
//   caching_allocator.cpp   allocate / free, and block reuse across streams (take, split,
//                           coalesce, pending frees)
//   backing.cpp             segments and their physical backing (growth steps, whole-chunk
//                           release, empty_cache)
//   refusals.cpp            the message of a refused allocation (Note [Refusals])
//   caching_tags.cpp        tags and statistics;  caching_snapshot.cpp  snapshots, history
// See Note [Caching allocator] in caching_allocator.cpp; the records it holds (streams,
// segments, groups, tags, statistics) are records.hpp, blocks and bins blocks.hpp; why the
// state is private to its operations: Note [Allocator state] below.
#pragma once
#include <deferalloc/caching/caching_allocator.hpp>
#include <deferalloc/core/errors.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "caching/records.hpp"
#include "caching/text.hpp"
#include "core/driver/event_pool.hpp"
#include "log.hpp"

namespace deferalloc {
namespace detail {

inline constexpr std::size_t k_max_request = std::size_t{1} << 46;  // 64 TiB

// The tagged regions of a thread (tag_scope, begin_tag/end_tag: the C++ face's
// current tag) live in caching_tags.cpp; the registry of tags is tag_registry below.
/// The innermost region's tag of `owner` on this thread (tag_id::none outside any).
tag_id region_tag(const caching_allocator* owner) noexcept;
/// Leaves every region of `owner` on this thread.
void erase_regions_of(const caching_allocator* owner) noexcept;

}  // namespace detail

using namespace detail;

// Note [Allocator state]
//
// Rationale: the allocator's two stateful objects (caching_allocator here, the reservation
// manager in allocator/core/reservations/state.hpp) were each one struct of public fields
// that every file of its folder reached into from the public class's methods, so nothing
// said which file changed what.
// Approach: the public class holds only `impl_` and forwards each call to it (one line,
// `impl_->`, in the same file as the operation, so the compiler inlines it: no extra
// virtual call, lock or allocation on allocate / free or materialize / release).  The
// state is a class whose fields are private: only its own operations, one file per kind
// of operation, touch them; what has rules of its own is a small type with private state
// and named methods (here the tag registry, the streams, the history ring, the spare
// blocks and the event pool; there the reservation table and the byte counts).
// Limits: the operations of one class still share its private fields across the files of
// its folder (as the optimizer's facade does); a field moves into a small type when it
// gets an invariant of its own.

// The tags by id: a tag's id is 1 + its index (tags are never removed).
class tag_registry {
 public:
  using list = std::vector<std::unique_ptr<tag_state>>;
  tag_state* find(std::string_view name) const {
    for (auto& t : tags_)
      if (t->name == name) return t.get();
    return nullptr;
  }
  tag_id id_of(const tag_state* t) const {
    for (std::size_t i = 0; i < tags_.size(); ++i)
      if (tags_[i].get() == t) return static_cast<tag_id>(i + 1);
    return tag_id::none;
  }
  /// @throws invalid_argument for an id no tag has
  tag_state* tag_of(tag_id id) const {
    const auto i = static_cast<std::size_t>(id);
    if (i == 0 || i > tags_.size()) throw invalid_argument("caching_allocator: unknown tag id " + std::to_string(i));
    return tags_[i - 1].get();
  }
  /// The group index the next tag gets (0 and 1 are the small and large pools).
  int next_group_index() const noexcept { return static_cast<int>(tags_.size()) + 2; }
  tag_id add(std::unique_ptr<tag_state> t) {
    tags_.push_back(std::move(t));
    return static_cast<tag_id>(tags_.size());
  }
  std::size_t size() const noexcept { return tags_.size(); }
  list::const_iterator begin() const noexcept { return tags_.begin(); }
  list::const_iterator end() const noexcept { return tags_.end(); }

 private:
  list tags_;
};

// The streams that allocated or freed, with the last one looked up first (most calls
// come from one stream), and the fresh pseudo-owner of never-used address space.
class stream_table {
 public:
  using list = std::vector<std::unique_ptr<stream_state>>;
  stream_table() { fresh_.fresh = true; }
  stream_state* state_of(stream_t s) {
    if (last_ != nullptr && last_->stream == s) return last_;
    for (auto& p : streams_)
      if (p->stream == s) return last_ = p.get();
    streams_.push_back(std::make_unique<stream_state>());
    streams_.back()->stream = s;
    return last_ = streams_.back().get();
  }
  stream_state* fresh() noexcept { return &fresh_; }
  std::size_t size() const noexcept { return streams_.size(); }
  list::const_iterator begin() const noexcept { return streams_.begin(); }
  list::const_iterator end() const noexcept { return streams_.end(); }

 private:
  list streams_;
  stream_state* last_ = nullptr;
  stream_state fresh_;
};

// Note [Memory snapshots]: the recorded events (record_history), a ring of at most max().
class history_ring {
 public:
  bool on() const noexcept { return max_ != 0; }
  std::size_t max() const noexcept { return max_; }
  /// Keeps at most `n` events from now on (0: none); a new size forgets what was kept.
  void set_max(std::size_t n) {
    if (n == 0 || n != max_) {
      events_.clear();
      events_.shrink_to_fit();
      next_ = 0;
    }
    max_ = n;
  }
  /// Appends `e`, overwriting the oldest when full.  @throws std::bad_alloc
  void push(const trace_event& e) {
    if (events_.size() < max_) {
      events_.push_back(e);
      next_ = events_.size() % max_;
    } else {
      events_[next_] = e;
      next_ = (next_ + 1) % max_;
    }
  }
  std::size_t size() const noexcept { return events_.size(); }
  /// The k-th event, oldest first.
  const trace_event& at(std::size_t k) const {
    const std::size_t n = events_.size(), start = n < max_ ? 0 : next_;
    return events_[(start + k) % n];
  }

 private:
  std::vector<trace_event> events_;
  std::size_t max_ = 0, next_ = 0;
};

// Blocks given back, reused before new ones are allocated.
class spare_blocks {
 public:
  spare_blocks() = default;
  spare_blocks(const spare_blocks&) = delete;
  spare_blocks& operator=(const spare_blocks&) = delete;
  ~spare_blocks() {
    for (block* b : spare_) delete b;
  }
  block* take() {
    if (!spare_.empty()) {
      block* b = spare_.back();
      spare_.pop_back();
      *b = block{};
      return b;
    }
    return new block{};
  }
  void give(block* b) noexcept {
    delete b->users;
    b->users = nullptr;
    try {
      spare_.push_back(b);
    } catch (...) {
      delete b;
    }
  }

 private:
  std::vector<block*> spare_;
};

class caching_allocator::impl {
 public:
  // ---- the public class's operations (it forwards: Note [Allocator state]) ----
  impl(reservation_manager& m, const caching_allocator_config& c);
  ~impl();
  // caching_allocator.cpp
  void* allocate(std::size_t bytes, stream_t stream, tag_id tag);
  void deallocate(void* ptr, std::size_t bytes, stream_t stream);
  void record_stream(void* ptr, stream_t stream);
  std::size_t empty_cache();
  void set_memory_fraction(double fraction);
  caching_allocator_config config() const;
  double memory_fraction() const;
  bool owns(const void* ptr) const;
  void* base_allocation(const void* ptr, std::size_t* size) const;
  std::size_t allocation_size(const void* ptr) const;
  // caching_tags.cpp
  tag_id register_tag(std::string_view tag);
  std::string tag_name(tag_id id) const;
  void pause(std::string_view tag, keep_mode keep, stream_t stream);
  void resume(std::string_view tag, stream_t stream);
  bool is_paused(std::string_view tag) const;
  void set_resident(void* ptr, bool resident);
  std::vector<std::string> tag_names() const;
  std::map<std::string, std::int64_t> stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  // caching_snapshot.cpp
  void record_history(std::size_t max_entries);
  std::string snapshot_text() const;

 private:
  reservation_manager& mgr;
  vmm_ops& vmm;     // the device's memory (the limit, a refusal's numbers)
  stream_ops& ops;  // events and waits: stream order
  caching_allocator_config cfg;
  std::size_t g = 0;
  std::size_t total = 0;
  std::size_t limit = 0;
  std::size_t segment_reserve = 0;

  // Taken as log_after_unlock: lines logged under it are delivered after the unlock
  // (Note [Logging outside locks] in log.hpp).
  mutable std::mutex mu;
  stream_table streams;
  group small_grp, large_grp;
  tag_registry tags;
  ptr_map allocated;
  spare_blocks spare;
  struct pending_free {
    block* b;
    std::vector<event_t> events;
  };
  std::vector<pending_free> pending;
  detail::event_pool free_events;
  stat_set st;
  std::size_t reserved = 0;  // backed bytes of our segments
  segment* added = nullptr;  // the segment the current allocate added (dropped if it fails)
  bool fraction_refused = false;  // the last ensure_backed failed on the memory fraction
  std::int64_t refusals = 0;      // allocations refused (paused tag, fraction, budget, device)
  history_ring history;
  void record(trace_action a, std::uintptr_t addr, std::size_t size, stream_t s, const group* grp,
              std::size_t aux = 0) noexcept;
  void record_runs(trace_action a, const segment& seg, const std::vector<range>& rs) noexcept;

  // ---- small helpers ----
  std::size_t first_granule(const block* b) const { return (b->addr - b->seg->base) / g; }
  std::size_t end_granule(const block* b) const { return (b->addr + b->size - b->seg->base + g - 1) / g; }
  void seg_use(segment* s, stream_t stream) {
    for (stream_t x : s->streams)
      if (x == stream) return;
    mgr.record_stream(s->id, stream);
    s->streams.push_back(stream);
  }

  // ---- block reuse (caching_allocator.cpp) ----
  // Cuts `b` (detached from the bins) to `size`; the rest goes to `home` with b's owner.
  void split(block* b, std::size_t size, owner_bins& home);
  // Refreshes a stream's lazy free event; records one when frees are not yet covered.
  void poll(stream_state* s);
  // A block of `ob` of at least `size` that every stream may take (freed before its
  // stream's last completed event); looks at 256 blocks at most.
  block* find_eligible(owner_bins& ob, std::size_t size);
  // A detached block of at least `size` for stream `s` in `grp`.
  block* take(group& grp, stream_state* s, std::size_t size);
  // Merges the free block after `l` (out of the bins) into `l`; returns `l`.
  block* absorb_next(block* l) noexcept;
  // Puts a detached or freed block into its owner's bins, coalescing.
  void free_block(block* b);
  // A free whose streams are done: its statistics, then free_block.
  void finish_free(block* b);
  // Finishes the pending frees whose events have completed (waiting for them: `wait`).
  void process_pending(bool wait);
  // Waits for every pending free and every stream's lazy event: all free blocks
  // become free for any stream.
  void sync_all();
  // The allocated block that holds `p`, nullptr when none does.
  block* find_containing(std::uintptr_t p) const;

  // ---- segments and their backing (backing.cpp) ----
  // A new segment of at least `min_bytes` (at least segment_reserve) in `grp`: address
  // space only, one free block of the fresh owner.  @throws out_of_memory
  segment& add_segment(group& grp, std::size_t min_bytes);
  // Materializes the unbacked granules under `b`.  @throws out_of_memory
  void ensure_backed(block* b, stream_t stream);
  // The growth step of `grp` (Note [Growth steps]): a power of two number of granules,
  // an eighth of what the group holds backed, at least one granule (small pool) or
  // 16 MiB (large pool and tags, as PyTorch's 20 MiB large segments), at most
  // cfg.grow_bytes; 0 = block by block.
  std::size_t growth_step(const group& grp) const;
  // The largest chunk behind a block: the largest growth step, at least 16 MiB.  A
  // live block keeps at most the chunks it touches backed, so this bounds what one
  // small block can hold beyond itself (whole-chunk release, Note [Splitting chunks]).
  std::size_t max_chunk() const;
  void note_backed(group& grp, std::int64_t bytes) {
    reserved = static_cast<std::size_t>(static_cast<std::int64_t>(reserved) + bytes);
    grp.backed = static_cast<std::size_t>(static_cast<std::int64_t>(grp.backed) + bytes);
    if (bytes > 0) stat_set::add(st.reserved_bytes, grp.small, bytes);
    else stat_set::sub(st.reserved_bytes, grp.small, -bytes);
  }
  // The backed granules of `seg` in runs: free_runs hold no allocated or pending
  // block, used_runs hold some but no resident one.  Releasing them goes through
  // release_whole_chunks, which gives back only the chunks wholly inside a run (Note
  // [Splitting chunks] in allocator/core/reservations/split.cpp): memory under a live
  // block never moves.
  struct granule_plan {
    std::vector<range> free_runs, used_runs;
    std::vector<range> unpinned_runs;  // free or used: every backed granule under no resident block
  };
  granule_plan plan(segment& s) const;
  // Marks the ranges of `rs` that belong to `s` unbacked.
  void mark_unbacked(segment& s, const std::vector<range>& rs);
  // Releases every whole free chunk of the groups that are not paused (a chunk that
  // also holds an allocated or pending block stays).  Never throws: a segment whose
  // release fails keeps its granules (logged).
  std::size_t release_free_granules();
  // Gives every whole free chunk and every cached chunk and pinned buffer back; returns
  // the physical bytes given back to the driver.
  std::size_t free_cached();
  // Removes `seg` when no block in it is allocated or pending and nothing is backed
  // (the segment added for a request that then failed): its address space and
  // bookkeeping go away.  Never throws.
  void drop_segment_if_unused(segment* seg) noexcept;
  // Frees every segment of `grp` and its blocks (the allocator's destructor).
  void free_group(group& grp) noexcept;

  // ---- refusals (refusals.cpp, Note [Refusals]) ----
  std::string refusal_text(std::size_t bytes, const tag_state* t, const std::string& reason,
                           const std::string& fix) const;
  // Counts the refusal, logs its text, and returns the exception to throw.
  template <typename E>
  E refuse(std::size_t bytes, const tag_state* t, const std::string& reason, const std::string& fix) {
    ++refusals;
    std::string msg = refusal_text(bytes, t, reason, fix);
    detail::log(log_level::warn, msg);
    return E(std::move(msg));
  }
  // The out-of-memory refusal after the retry: the memory fraction, the pool's budget or
  // the device, with the numbers.
  out_of_memory refuse_oom(std::size_t bytes, std::size_t size, const tag_state* t, const std::string& cause,
                           stream_t stream);
};

}  // namespace deferalloc
