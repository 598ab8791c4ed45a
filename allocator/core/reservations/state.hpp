// The reservation manager's private state: the reservations, their chunks, saved runs and
// backup segments, and the manager's own (the header shows only a pointer to it).  Shared by
// the files of this folder, one per operation (Note [Deferred reservations] in
// reservations.cpp).
#pragma once
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/reservations.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/driver/event_pool.hpp"

namespace deferalloc {

namespace detail {
// The runs of [b, e) that no chunk of `chunks` covers.
inline std::vector<std::pair<std::size_t, std::size_t>> gaps(const std::map<std::size_t, chunk>& chunks,
                                                             std::size_t b, std::size_t e) {
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
}  // namespace detail

struct reservation_manager::backup_segment {
  std::size_t offset = 0;
  std::size_t bytes = 0;
  void* host = nullptr;
  std::size_t live = 0;  // granules still saved in it
};

struct reservation_manager::reservation {
  struct saved_run {
    std::size_t end = 0;
    std::uint64_t segment = 0;  // 0: released by release_keeping outside its kept ranges, no backup
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

// One range of a batch as byte offsets into its reservation (resolve()).
struct reservation_manager::work_item {
  reservation* r;
  std::size_t begin, end;
};

// The live reservations by id and by base address, and the next id.
class reservation_manager::reservation_table {
 public:
  /// The reservation `id`.  @throws invalid_argument (never reserved, or already freed)
  reservation& get(reservation_id id) const {
    auto it = by_id_.find(id);
    if (it == by_id_.end())
      throw invalid_argument("unknown reservation " + std::to_string(id) + " (never reserved, or already freed)");
    return *it->second;
  }
  /// Gives `r` the next id and keeps it; all or nothing.
  reservation_id add(std::unique_ptr<reservation> r) {
    const reservation_id id = next_id_;
    const std::uintptr_t base = r->base;
    r->id = id;
    by_address_[base] = id;
    try {
      by_id_[id] = std::move(r);
    } catch (...) {
      by_address_.erase(base);
      throw;
    }
    ++next_id_;
    return id;
  }
  void erase(const reservation& r) {
    by_address_.erase(r.base);
    by_id_.erase(r.id);  // last: `r` dies here
  }
  /// The reservation whose address range holds `p`, nullptr when none does.
  const reservation* holding(std::uintptr_t p) const {
    auto it = by_address_.upper_bound(p);
    if (it == by_address_.begin()) return nullptr;
    const reservation& r = get(std::prev(it)->second);
    return p < r.base + r.padded ? &r : nullptr;
  }
  std::vector<reservation_id> ids() const {
    std::vector<reservation_id> out;
    for (const auto& [id, r] : by_id_) out.push_back(id);
    return out;
  }
  std::size_t size() const noexcept { return by_id_.size(); }

 private:
  std::unordered_map<reservation_id, std::unique_ptr<reservation>> by_id_;
  std::map<std::uintptr_t, reservation_id> by_address_;
  reservation_id next_id_ = 1;
};

// The manager's byte counts (reservation_stats without the pools').
class reservation_manager::byte_counts {
 public:
  void reserved(std::size_t n) noexcept { reserved_ += n; }
  void unreserved(std::size_t n) noexcept { reserved_ -= n; }
  void backed(std::size_t n) noexcept {
    backed_ += n;
    peak_backed_ = std::max(peak_backed_, backed_);
  }
  void unbacked(std::size_t n) noexcept { backed_ -= n; }
  void saved(std::size_t n) noexcept { backup_ += n; }
  void unsaved(std::size_t n) noexcept { backup_ -= n; }
  void split() noexcept { ++splits_; }
  void reset_peak() noexcept { peak_backed_ = backed_; }
  void fill(reservation_stats& s) const noexcept {
    s.reserved_bytes = reserved_;
    s.backed_bytes = backed_;
    s.peak_backed_bytes = peak_backed_;
    s.backup_bytes = backup_;
    s.splits = splits_;
  }

 private:
  std::size_t reserved_ = 0, backed_ = 0, peak_backed_ = 0, backup_ = 0;
  std::uint64_t splits_ = 0;
};

// The manager's state and its operations, one file each in this folder (the public class
// holds only a pointer to it and forwards: Note [Allocator state] in
// allocator/caching/allocator_state.hpp).
// Every operation takes the mutex; the private helpers run under it.
class reservation_manager::impl {
 public:
  impl(std::shared_ptr<chunk_pool> pool, std::shared_ptr<stream_ops> streams, const reservation_manager_config& cfg);
  ~impl();

  // ---- reservations.cpp ----
  reservation_id reserve(std::size_t bytes);
  void* address(reservation_id id) const;
  void free(reservation_id id, stream_t stream);
  void record_stream(reservation_id id, stream_t stream);
  reservation_info info(reservation_id id) const;
  std::optional<reservation_id> find(const void* ptr) const;
  bool is_backed(reservation_id id, std::size_t offset, std::size_t length) const;
  std::vector<range> backed_ranges(reservation_id id) const;
  std::vector<bool> backed_granules(reservation_id id) const;
  reservation_stats stats() const;
  void reset_peak() noexcept;
  // ---- materialize.cpp ----
  /// `whole_pieces`: each piece of the largest class one chunk (materialize_whole_pieces).
  void materialize(std::span<const range> ranges, fill_mode fill, stream_t stream, bool whole_pieces = false);
  // ---- release.cpp ----
  /// Waits for `after` when given, else for every stream that used the ranges and `stream`.
  /// `kept` (keep_mode::host only): the parts to back up, else all (release_keeping).
  void release(std::span<const range> ranges, keep_mode keep, stream_t stream, event_t after,
               const std::span<const range>* kept = nullptr);
  std::vector<range> release_whole_chunks(std::span<const range> ranges, keep_mode keep, stream_t stream);
  // ---- backups.cpp ----
  std::size_t trim_backup_cache(std::size_t keep_bytes);

  std::size_t granularity() const noexcept { return granularity_; }
  chunk_pool& pool() const noexcept { return *pool_; }
  vmm_ops& vmm() const noexcept { return vmm_; }
  stream_ops& streams() const noexcept { return streams_; }

 private:
  // A run of unbacked (materialize) or backed (release) granules of one reservation.
  struct run;
  struct release_plan;
  using placed_chunks = std::vector<std::pair<std::size_t, chunk>>;  // offset -> chunk
  using buffers = std::vector<std::pair<void*, std::size_t>>;        // pinned buffers and their sizes

  // reservations.cpp
  std::vector<work_item> resolve(std::span<const range> ranges);
  std::pair<std::size_t, std::size_t> clamp(const reservation& r, std::size_t offset, std::size_t length) const;
  std::vector<event_t> record_users(const std::vector<reservation*>& rs, stream_t stream);
  void unmap_quietly(std::uintptr_t va, std::size_t bytes) noexcept;
  // materialize.cpp
  std::vector<std::size_t> classes_at(std::size_t pos, std::size_t end, std::size_t max_class) const;
  bool reuse_cached(std::size_t pos, std::size_t end, placed_chunks& out);
  bool acquire_pieces(std::size_t pos, std::size_t end, std::size_t max_class, placed_chunks& out,
                      bool whole_pieces = false);
  placed_chunks plan_chunks(const std::vector<std::pair<std::size_t, std::size_t>>& runs, bool whole_pieces = false);
  std::vector<run> unbacked_runs(const std::vector<work_item>& ws, fill_mode fill) const;
  std::vector<placed_chunks> chunks_for(const std::vector<run>& runs, bool whole_pieces);
  void map_and_fill(const std::vector<run>& runs, const std::vector<placed_chunks>& pieces, fill_mode fill,
                    stream_t stream);
  void restore_into(const std::vector<run>& runs, stream_t stream);
  void commit_backed(const std::vector<run>& runs, std::vector<placed_chunks>& pieces, stream_t stream);
  // release.cpp
  void release_locked(std::span<const range> ranges, keep_mode keep, stream_t stream, event_t after,
                      const std::span<const range>* kept = nullptr);
  release_plan plan_release(const std::vector<work_item>& ws) const;
  void plan_copies(release_plan& plan, std::span<const range> kept);
  void back_up_and_wait(release_plan& plan, keep_mode keep, stream_t stream, event_t after);
  void unmap_chunks(release_plan& plan);
  void give_back_hosts(release_plan& plan) noexcept;
  void commit_released(const std::vector<work_item>& ws, const release_plan& plan, keep_mode keep);
  // split.cpp
  void split_at(reservation& r, std::size_t cut, stream_t stream, event_t after);
  // backups.cpp
  void drop_backup_granules(reservation& r, std::size_t begin, std::size_t end, buffers& unused);
  void retire_buffers(buffers& bufs) noexcept;
  void reap_retired(bool wait) noexcept;

  std::shared_ptr<chunk_pool> pool_;
  std::shared_ptr<stream_ops> streams_ptr_;
  vmm_ops& vmm_;          // the pool's: the VMM primitives, pinned memory for backups
  stream_ops& streams_;   // fills, backup copies, events and waits
  std::size_t granularity_;
  std::unique_ptr<pinned_pool> pinned_;
  // Taken as log_after_unlock (Note [Logging outside locks] in log.hpp).
  mutable std::mutex mu_;
  reservation_table table_;
  stream_t copy_stream_ = nullptr;
  detail::event_pool events_;
  // Pinned buffers that restores enqueued on the copy stream may still read: back to the
  // pinned pool once `done` has completed.
  struct retired {
    event_t done;
    buffers bufs;
  };
  std::vector<retired> retired_;
  std::uintptr_t scratch_ = 0;  // address range for splitting chunks (the largest chunk split so far)
  std::size_t scratch_bytes_ = 0;
  byte_counts counts_;
};

}  // namespace deferalloc
