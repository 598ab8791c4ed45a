// The preload library's arenas: the segments of one pauseable region placed in one VA range,
// backed by few large slabs (Note [Preload arenas] in preload_arena.cpp).
#pragma once

#include <deferalloc/deferalloc.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace deferalloc::preload {

struct arena_figures {
  std::size_t slabs = 0;        // slabs backed (or waiting, paused, to be backed again)
  std::size_t slab_bytes = 0;   // their bytes
  std::size_t live_bytes = 0;   // bytes of the segments placed in them
  std::size_t segments = 0;
  int paused = 0;               // 1 while paused
  std::size_t strays = 0;       // segments asked of the arena but served outside it (note_stray)
};

// Every arena of the process, by name.  Thread-safe (one mutex); the calls return the C
// ABI's status and leave the thread's dfa_last_error set on failure.
class arenas {
 public:
  // Places a segment of `bytes` in arena `name` (made on first use).  DFA_ERROR_INVALID_STATE
  // when the arena is paused or the segment is larger than a block: the caller serves it
  // another way.  Cost: none when a free range fits, else one dfa_materialize of a new slab
  // (and a dfa_reserve when the arena needs another block).
  dfa_status allocate(const std::string& name, std::size_t bytes, void** out);
  // Whether `p` is the base of a segment of an arena.
  bool owns(const void* p) const;
  // Gives a segment's range back to its arena; a slab left without segments is released
  // (one dfa_release: unmapped, or its backup dropped while paused; where that fails, the
  // slab stays for later segments and a line on stderr says so).  The caller has waited for
  // the device.
  dfa_status free(const void* p);
  // Every slab of the arena released in one call: dfa_release_many_keeping (the segments'
  // bytes kept in pinned host memory, the free ranges not copied) or dfa_release_many
  // (discarded).  Unknown name: an empty arena is made and paused.
  dfa_status pause(const std::string& name, dfa_keep keep, void* stream);
  // Every slab backed again at its address, one dfa_materialize each (its segments restored
  // when paused with DFA_KEEP_HOST); all or nothing.
  dfa_status resume(const std::string& name, void* stream);
  arena_figures figures(const std::string& name) const;
  // A segment that arena `name` refused (allocate's DFA_ERROR_INVALID_STATE) and the caller
  // served as a reservation of its own, until it is freed (forget_stray): the arena's
  // figures count it, so that a pause knows to look for segments outside the arena.
  void note_stray(const std::string& name, const void* p);
  void forget_stray(const void* p);

 private:
  struct block {
    dfa_reservation id = 0;
    std::uintptr_t base = 0;
    std::map<std::uintptr_t, std::size_t> va_free;  // offset -> bytes not used by a slab
  };
  struct slab {
    std::size_t block = 0;  // index in arena::blocks
    std::size_t offset = 0, bytes = 0;
    std::size_t live = 0;   // bytes of segments in it
    std::map<std::uintptr_t, std::size_t> free;  // address -> bytes not used by a segment
  };
  struct arena {
    std::vector<block> blocks;
    std::map<std::uintptr_t, slab> slabs;  // by address
    std::size_t slab_bytes = 0, live_bytes = 0, segments = 0;
    bool paused = false;
    dfa_keep keep = DFA_KEEP_DISCARD;
    std::size_t strays = 0;
  };
  struct segment {
    arena* a = nullptr;
    std::uintptr_t slab = 0;
    std::size_t bytes = 0;
  };

  std::size_t granularity();
  std::size_t slab_size(const arena& a, std::size_t need) const;
  bool place_in_slabs(arena& a, std::size_t need, std::uintptr_t& addr, std::uintptr_t& slab_addr);
  dfa_status open_slab(arena& a, std::size_t bytes, std::uintptr_t& slab_addr);
  static bool take_va(block& b, std::size_t bytes, std::size_t align, std::size_t& offset);
  static void give_back_range(std::map<std::uintptr_t, std::size_t>& free, std::uintptr_t at, std::size_t bytes);
  dfa_status close_slab(arena& a, std::uintptr_t slab_addr);
  static dfa_status release_keeping_live(const arena& a, const std::vector<dfa_reservation>& ids, void* stream);

  mutable std::mutex mu_;
  std::size_t granularity_ = 0;
  std::unordered_map<std::string, std::unique_ptr<arena>> arenas_;
  std::unordered_map<std::uintptr_t, segment> segments_;
  std::unordered_map<std::uintptr_t, arena*> strays_;
};

}  // namespace deferalloc::preload
