// The reservation manager's private state: the reservations, their chunks, saved runs and
// backup segments, and the manager's own (the header shows only a pointer to it).  Shared by
// the files of this folder, one per operation (Note [Deferred reservations] in
// reservations.cpp).
#pragma once
#include <deferalloc/core/reservations.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

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

// One range of a batch as byte offsets into its reservation (resolve()).
struct reservation_manager::work_item {
  reservation* r;
  std::size_t begin, end;
};

}  // namespace deferalloc
