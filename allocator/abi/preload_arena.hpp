// The preload library's arenas: the segments of one pauseable region placed in one VA range,
// backed by few large slabs (Note [Preload arenas] in preload_arena.cpp).
#pragma once

#include <deferalloc/deferalloc.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace deferalloc::preload {

struct arena_figures {
  std::size_t slabs = 0;        // slabs backed (or waiting, paused, to be backed again)
  std::size_t slab_bytes = 0;   // their bytes
  std::size_t live_bytes = 0;   // bytes of the segments placed in them
  std::size_t segments = 0;
  int paused = 0;               // 1 while paused
  // Segments cudaMalloc'ed with the arena current but not placed in it, not freed yet
  // (note_stray): the arena was paused, the segment was larger than a block, or the library
  // does not serve the call (another device, disabled).  Memory the arena's pause leaves
  // backed (memory_saver's pause finds PyTorch's among them in its snapshot).
  std::size_t strays = 0;
  // Segments placed in the arena, and strays noted, so far (never decreases): memory_saver's
  // pause reads PyTorch's snapshot for the arena again only when it changed.
  std::uint64_t generation = 0;
};

// A mutex handed over in the order it was asked for (a ticket lock).  The arenas' mutex is
// one: a pause and a resume hold it for their driver calls (and, with DFA_KEEP_HOST, the
// copies), and a std::mutex lets the thread that unlocks take it again at once, before a
// waiter woken by the unlock runs: a thread that pauses and resumes in a loop then starved a
// cudaMalloc waiting to add its new slab, for good on a machine of many cores
// (preload_arena_probe (h) hung there).  Here each waiter gets it in its turn.  Cost: a
// std::mutex and a notify per lock; waiters sleep on a condition variable.
class fifo_mutex {
 public:
  void lock() {
    std::unique_lock lk(mu_);
    const std::uint64_t ticket = next_++;
    turn_.wait(lk, [&] { return serving_ == ticket; });
  }
  void unlock() {
    bool waiters = false;
    {
      std::lock_guard lk(mu_);
      ++serving_;
      waiters = next_ != serving_;
    }
    if (waiters) turn_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable turn_;
  std::uint64_t next_ = 0, serving_ = 0;  // guarded by mu_
};

// Every arena of the process, by name.  Thread-safe (one fifo_mutex, Note [Preload arenas]'s
// Limits say what runs under it); the calls return the C ABI's status and leave the
// thread's dfa_last_error set on failure.
class arenas {
 public:
  // Places a segment of `bytes` in arena `name` (made on first use).  DFA_ERROR_INVALID_STATE
  // when the arena is paused or the segment is larger than a block: the caller serves it
  // another way.  Cost: none when a free range fits, else one dfa_materialize_whole_pieces of a new slab
  // (and a dfa_reserve when the arena needs another block).
  dfa_status allocate(const std::string& name, std::size_t bytes, void** out);
  // Whether `p` is the base of a segment of an arena.  A pointer outside every arena's
  // blocks is answered without the mutex (every cudaFree of the process asks) while the
  // process has at most 64 arena blocks; past that, every pointer takes the mutex.
  bool owns(const void* p) const;
  // Whether `p` lies in the address space of an arena (a segment or not).
  bool contains(const void* p) const;
  // Gives a segment's range back to its arena; a slab left without segments is released
  // (one dfa_release: unmapped, or its backup dropped while paused; where that fails, the
  // slab stays for later segments and a line on stderr says so).  The caller has waited for
  // the device.
  dfa_status free(const void* p);
  // Every slab of the arena released in one call: dfa_release_many_keeping (the segments'
  // bytes kept in pinned host memory, the free ranges not copied) or dfa_release_many
  // (discarded).  Unknown name: an empty arena is made and paused.
  dfa_status pause(const std::string& name, dfa_keep keep, void* stream);
  // Every slab backed again at its address, one dfa_materialize_whole_pieces each (its segments restored
  // when paused with DFA_KEEP_HOST); all or nothing.
  dfa_status resume(const std::string& name, void* stream);
  arena_figures figures(const std::string& name) const;
  // out[i] for each of the n pointers: 2 when it is the base of a segment of arena `name`, 1
  // of another arena, 0 of none.
  void classify(const std::string& name, const void* const* ptrs, std::size_t n, unsigned char* out) const;
  // (base, bytes placed) of every segment placed in arena `name`, by address (none for an
  // unknown name): what memory_saver's disk kind writes to its file before the arena's pause
  // and reads back after its resume.  Cost: one lock, a pass over every arena's segments.
  std::vector<std::pair<std::uintptr_t, std::size_t>> segments(const std::string& name) const;
  // A segment that arena `name` refused (allocate's DFA_ERROR_INVALID_STATE) and the caller
  // served as a reservation of its own, until it is freed (forget_stray): the arena's
  // figures count it (memory its pause leaves backed).  Also for a cudaMalloc the library
  // does not serve while the arena is current (the arena made if new).
  void note_stray(const std::string& name, const void* p);
  // Forgets a stray; returns its arena's name ("" when `p` is none), for a note_stray again
  // where the memory turns out not to be freed.
  std::string forget_stray(const void* p);

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
    bool grows = false;     // counted in arena::grown_bytes
    std::map<std::uintptr_t, std::size_t> free;  // address -> bytes not used by a segment
  };
  struct arena {
    std::vector<block> blocks;
    std::map<std::uintptr_t, slab> slabs;  // by address
    std::size_t slab_bytes = 0, live_bytes = 0, segments = 0;
    std::size_t grown_bytes = 0;  // bytes of the slabs opened for segments of at most cap / 8 (slab_size)
    std::uint64_t generation = 0;  // segments placed and strays noted so far
    bool paused = false;
    dfa_keep keep = DFA_KEEP_DISCARD;
    std::size_t strays = 0;
    std::uint64_t pauses = 0;  // pauses so far: a slab backed outside the mutex checks it
  };
  struct segment {
    arena* a = nullptr;
    std::uintptr_t slab = 0;
    std::size_t bytes = 0;
  };

  // A slab's address space taken under the mutex, backed outside it (allocate).
  struct pending_slab {
    std::size_t block = 0, offset = 0, bytes = 0;
    dfa_reservation id = 0;
    std::uint64_t pauses = 0;
    bool grows = false;  // slab_size's: counted in arena::grown_bytes
  };

  std::size_t granularity();
  std::size_t slab_cap() const;
  // A new slab's size for a segment of `need` bytes; `grows`: the slab counts towards the
  // grown size (opened for a segment of at most cap / 8).
  std::size_t slab_size(const arena& a, std::size_t need, bool& grows) const;
  bool best_fit(arena& a, std::size_t need, std::uintptr_t& slab_addr,
                std::map<std::uintptr_t, std::size_t>::iterator& at);
  static void carve(slab& s, std::map<std::uintptr_t, std::size_t>::iterator at, std::size_t need) noexcept;
  dfa_status take_slab_va(const std::string& name, arena& a, std::size_t bytes, pending_slab& out);
  static bool take_va(block& b, std::size_t bytes, std::size_t align, std::size_t& offset);
  static void give_back_range(std::map<std::uintptr_t, std::size_t>& free, std::uintptr_t at, std::size_t bytes);
  dfa_status close_slab(arena& a, std::uintptr_t slab_addr);
  static dfa_status release_keeping_live(const arena& a, const std::vector<dfa_reservation>& ids, void* stream);

  bool in_blocks(std::uintptr_t p) const noexcept;
  void publish_block(std::uintptr_t base) noexcept;

  mutable fifo_mutex mu_;
  // The blocks' bases, written under mu_ and read without it (owns); blocks are never freed.
  // Past k_max_published blocks, owns takes the mutex for every pointer.
  static constexpr std::size_t k_max_published = 64;
  std::array<std::atomic<std::uintptr_t>, k_max_published> block_bases_{};
  std::atomic<std::size_t> published_{0};
  std::atomic<bool> unpublished_{false};
  std::atomic<std::size_t> stray_count_{0};  // strays_.size(), read without the mutex
  std::size_t granularity_ = 0;
  std::unordered_map<std::string, std::unique_ptr<arena>> arenas_;
  std::unordered_map<std::uintptr_t, segment> segments_;
  std::unordered_map<std::uintptr_t, arena*> strays_;
};

}  // namespace deferalloc::preload
