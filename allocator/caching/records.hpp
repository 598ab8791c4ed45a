// The records the caching allocator keeps besides its blocks (blocks.hpp): per stream,
// per segment, per group (small, large, a tag's), per tag, trace events and statistics.
#pragma once
#include <deferalloc/caching/caching_allocator.hpp>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "caching/blocks.hpp"

namespace deferalloc::detail {

/// Per stream: the generation counter behind lazy free events.
/// See Note [Cross-stream reuse] in caching_allocator.cpp.
struct stream_state {
  stream_t stream = nullptr;
  bool fresh = false;            // the pseudo-owner of never-used address space
  std::uint64_t gen = 1;         // frees stamp it into block::free_gen
  std::uint64_t safe_gen = 0;    // blocks with free_gen < safe_gen are free for any stream
  bool dirty = false;            // a block was freed since the last event was recorded
  event_t event = nullptr;       // outstanding event, recorded after frees of gen <= event_gen
  std::uint64_t event_gen = 0;
  std::vector<struct owner_bins*> bins;  // by group index: this stream's bins there
};

struct group;

struct segment {
  reservation_id id = 0;
  std::uintptr_t base = 0;
  std::size_t size = 0;
  std::vector<std::uint8_t> backed;  // per granule
  group* grp = nullptr;
  block* first = nullptr;
  std::vector<stream_t> streams;     // recorded with the reservation manager
};

struct owner_bins {
  stream_state* st = nullptr;
  bins b;
};

struct tag_state;

/// Segments whose free blocks are binned together: the small pool, the large pool,
/// or one tag.
struct group {
  int index = 0;  // small 0, large 1, tags 2..
  std::string name;
  bool small = false;
  tag_state* tag = nullptr;
  std::size_t backed = 0;  // bytes of the group's segments backed now
  std::vector<std::unique_ptr<segment>> segments;
  std::vector<std::unique_ptr<owner_bins>> owners;

  owner_bins& bins_of(stream_state* st) {
    if (static_cast<std::size_t>(index) < st->bins.size() && st->bins[index] != nullptr) return *st->bins[index];
    for (auto& o : owners)
      if (o->st == st) return *o;
    owners.push_back(std::make_unique<owner_bins>());
    owners.back()->st = st;
    if (st->bins.size() <= static_cast<std::size_t>(index)) st->bins.resize(index + 1, nullptr);
    st->bins[index] = owners.back().get();
    return *owners.back();
  }
};

struct tag_state {
  std::string name;
  std::unique_ptr<group> grp;
  bool paused = false;
  keep_mode keep = keep_mode::discard;
  std::vector<range> saved;  // released at pause, backed again at resume
};

/// An allocator event kept by record_history (Note [Memory snapshots]); the actions are
/// PyTorch's trace actions.
enum class trace_action : std::uint8_t { alloc, free_requested, free_completed, segment_map, segment_unmap, oom };
struct trace_event {
  trace_action action = trace_action::alloc;
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  stream_t stream = nullptr;
  std::int64_t time_us = 0;
  int group = -1;          // group index (0 small, 1 large, 2.. tags); -1 none
  std::size_t aux = 0;     // oom: the device's free bytes
};

/// One statistic in PyTorch's four flavours.
struct stat {
  std::int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void add(std::int64_t n) {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  void sub(std::int64_t n) {
    current -= n;
    freed += n;
  }
};
enum stat_pool : int { pool_all = 0, pool_small = 1, pool_large = 2 };
using stat_array = std::array<stat, 3>;

struct stat_set {
  stat_array allocation, segment, active, allocated_bytes, reserved_bytes, active_bytes, requested_bytes;
  std::int64_t num_alloc_retries = 0, num_ooms = 0, num_sync_all_streams = 0, num_device_alloc = 0,
               num_device_free = 0;
  std::int64_t cross_stream_reuses = 0;  // blocks taken from another stream's bins
  std::int64_t stream_events = 0;        // lazy free events recorded (Note [Cross-stream reuse])
  static void add(stat_array& s, bool small, std::int64_t n) {
    s[pool_all].add(n);
    s[small ? pool_small : pool_large].add(n);
  }
  static void sub(stat_array& s, bool small, std::int64_t n) {
    s[pool_all].sub(n);
    s[small ? pool_small : pool_large].sub(n);
  }
};

}  // namespace deferalloc::detail
