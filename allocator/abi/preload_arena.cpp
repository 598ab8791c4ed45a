// The preload library's arenas (Note [Preload arenas]).
//
// Note [Preload arenas]
// Rationale: the CUDA driver's cost of a pause and a resume is per mapping, not per byte
// (docs/BENCHMARKS.md, "Where a VMM pause and resume spend their time": ~46 us to unmap and
// release one mapping, as much to create, map and set access again; one 512 MiB mapping
// costs about what one 16 MiB mapping does).  PyTorch's caching allocator makes one
// cudaMalloc per segment, so a region of 8 GiB of weights in 512 segments, each a
// reservation of its own, costs 512 mappings each way: as slow as torch_memory_saver.
// Approach: the segments allocated while a thread has an arena current (memory_saver's
// region and cuda_graph in hook_mode="preload": one arena per tag and backup kind; the
// preload library serves one device) are placed in that arena: blocks of address space
// (dfa_reserve of 64 GiB, another when one is full), and in them slabs, each backed by one
// chunk mapped whole (dfa_materialize_whole_pieces of the slab's range: the chunk pool's
// classes are powers of two up to 1 GiB, a slab is one class, aligned to it, and smaller
// chunks the pool holds cached do not cut it into many mappings).  A segment takes the
// best-fitting free range of the slabs, else a new slab is opened: its size doubles with
// what the arena holds (the largest power of two not above the slabs' bytes), from the
// granularity up to 512 MiB, never below the segment (rounded up to a power of two; a
// segment above 512 MiB gets a slab of its own size, mapped in a few chunks; so does a
// segment whose slab the device cannot back, as a reservation of its own would).  cudaFree
// gives the range back to its slab; a slab left without segments is released at once (its
// chunk goes to the chunk pool, which keeps at most pool_cache_mb and gives the rest to
// the device), and its address space is reused by later slabs.  Pause is one
// dfa_release_many of the arena's blocks (each slab unmapped); with DFA_KEEP_HOST,
// dfa_release_many_keeping, which copies only the segments' bytes (one pinned copy per run of
// adjacent segments: a slab's free tail and freed ranges hold nothing a caller may read, as
// PyTorch's free blocks in a segment).  Resume is one dfa_materialize_whole_pieces per slab
// at the same address, restoring the segments and leaving the free ranges undefined (or all
// of it undefined after a discard).  So both cost O(slabs), and addresses never change.
// Bound on memory backed but not handed out, per arena: the free tail of the newest slab
// (smaller than the larger of the segment that opened it and min(512 MiB, what the arena
// held before it, at least the granularity)), plus, per older slab, a tail smaller than the
// segment that opened the next one, plus the ranges freed inside slabs that still hold a
// segment.  PyTorch's segments of one size (16 MiB weights in 512 MiB
// slabs) leave no tail but the newest slab's.
// Limits: empty_cache gives memory back by whole slabs: a freed segment whose slab still
// holds another segment stays backed until that one is freed too (the rest of the process,
// outside arenas, keeps one reservation per segment, given back segment by segment).  A
// range freed while the arena is paused keeps its backup (restored for nothing) unless its
// slab empties.  An allocation while
// the arena is paused, or of a segment larger than a block, is served as a reservation of
// its own (the caller's path), paused by the segment as before.  Blocks are kept for the
// process (address space only).
#include "preload_arena.hpp"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <iterator>

namespace deferalloc::preload {

namespace {

constexpr std::size_t k_block_bytes = std::size_t{64} << 30;  // address space of one block
constexpr std::size_t k_slab_cap = std::size_t{512} << 20;    // slab size for everything but huge segments
constexpr std::size_t k_align_cap = std::size_t{1} << 30;     // the chunk pool's largest class

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

}  // namespace

std::size_t arenas::granularity() {
  if (granularity_ == 0) {
    std::size_t g = 0;
    if (dfa_granularity(&g) == DFA_SUCCESS) granularity_ = g;
  }
  return granularity_;
}

std::size_t arenas::slab_size(const arena& a, std::size_t need) const {
  if (need > k_slab_cap) return need;
  const std::size_t grown = std::clamp(std::bit_floor(std::max(a.slab_bytes, granularity_)), granularity_, k_slab_cap);
  return std::max(grown, std::bit_ceil(need));
}

// First fit of `bytes` aligned to `align` in a block's free address space.
bool arenas::take_va(block& b, std::size_t bytes, std::size_t align, std::size_t& offset) {
  for (auto it = b.va_free.begin(); it != b.va_free.end(); ++it) {
    const std::size_t at = it->first, len = it->second, o = round_up(at, align);
    if (o + bytes > at + len) continue;
    b.va_free.erase(it);
    if (o > at) b.va_free.emplace(at, o - at);
    if (o + bytes < at + len) b.va_free.emplace(o + bytes, at + len - o - bytes);
    offset = o;
    return true;
  }
  return false;
}

// Adds [at, at + bytes) to a free list, merged with its neighbours.
void arenas::give_back_range(std::map<std::uintptr_t, std::size_t>& free, std::uintptr_t at, std::size_t bytes) {
  auto it = free.emplace(at, bytes).first;
  if (auto nx = std::next(it); nx != free.end() && it->first + it->second == nx->first) {
    it->second += nx->second;
    free.erase(nx);
  }
  if (it != free.begin()) {
    auto pv = std::prev(it);
    if (pv->first + pv->second == it->first) {
      pv->second += it->second;
      free.erase(it);
    }
  }
}

// The best-fitting free range of the arena's slabs: carves `need` bytes from its start.
bool arenas::place_in_slabs(arena& a, std::size_t need, std::uintptr_t& addr, std::uintptr_t& slab_addr) {
  slab* best = nullptr;
  std::map<std::uintptr_t, std::size_t>::iterator best_it;
  for (auto& [sa, s] : a.slabs)
    for (auto it = s.free.begin(); it != s.free.end(); ++it)
      if (it->second >= need && (best == nullptr || it->second < best_it->second)) {
        best = &s;
        best_it = it;
        slab_addr = sa;
      }
  if (best == nullptr) return false;
  addr = best_it->first;
  const std::size_t left = best_it->second - need;
  best->free.erase(best_it);
  if (left > 0) best->free.emplace(addr + need, left);
  return true;
}

// A new slab of `bytes`, backed by one chunk (one mapping) where `bytes` is a chunk class.
dfa_status arenas::open_slab(arena& a, std::size_t bytes, std::uintptr_t& slab_addr) {
  const std::size_t align = std::clamp(std::bit_floor(bytes), granularity_, k_align_cap);
  std::size_t bi = 0, offset = 0;
  for (; bi < a.blocks.size(); ++bi)
    if (take_va(a.blocks[bi], bytes, align, offset)) break;
  if (bi == a.blocks.size()) {
    block b;
    void* base = nullptr;
    if (const dfa_status st = dfa_reserve(k_block_bytes, &b.id, &base); st != DFA_SUCCESS) return st;
    b.base = reinterpret_cast<std::uintptr_t>(base);
    b.va_free.emplace(0, k_block_bytes);
    take_va(b, bytes, align, offset);
    a.blocks.push_back(std::move(b));
  }
  block& b = a.blocks[bi];
  if (const dfa_status st = dfa_materialize_whole_pieces(b.id, offset, bytes, DFA_FILL_UNDEFINED, nullptr);
      st != DFA_SUCCESS) {
    give_back_range(b.va_free, offset, bytes);
    return st;
  }
  slab s;
  s.block = bi;
  s.offset = offset;
  s.bytes = bytes;
  slab_addr = b.base + offset;
  s.free.emplace(slab_addr, bytes);
  a.slabs.emplace(slab_addr, std::move(s));
  a.slab_bytes += bytes;
  return DFA_SUCCESS;
}

// Releases a slab without segments: unmapped, or (paused) its backup dropped.
dfa_status arenas::close_slab(arena& a, std::uintptr_t slab_addr) {
  auto it = a.slabs.find(slab_addr);
  const slab& s = it->second;
  block& b = a.blocks[s.block];
  if (const dfa_status st = dfa_release(b.id, s.offset, s.bytes, DFA_KEEP_DISCARD, nullptr); st != DFA_SUCCESS)
    return st;  // the slab stays, empty, for later segments
  give_back_range(b.va_free, s.offset, s.bytes);
  a.slab_bytes -= s.bytes;
  a.slabs.erase(it);
  return DFA_SUCCESS;
}

dfa_status arenas::allocate(const std::string& name, std::size_t bytes, void** out) {
  try {
    std::lock_guard lk(mu_);
    if (granularity() == 0) return DFA_ERROR_INVALID_STATE;
    const std::size_t need = round_up(bytes, granularity_);
    if (need > k_block_bytes) return DFA_ERROR_INVALID_STATE;
    auto& slot = arenas_[name];
    if (!slot) slot = std::make_unique<arena>();
    arena& a = *slot;
    if (a.paused) return DFA_ERROR_INVALID_STATE;
    segments_.reserve(segments_.size() + 1);  // nothing below throws
    std::uintptr_t addr = 0, slab_addr = 0;
    if (!place_in_slabs(a, need, addr, slab_addr)) {
      dfa_status st = open_slab(a, slab_size(a, need), slab_addr);
      // Short of memory: a slab of the segment's own size, which a reservation of its own would need too.
      if (st == DFA_ERROR_OUT_OF_MEMORY && slab_size(a, need) > need) st = open_slab(a, need, slab_addr);
      if (st != DFA_SUCCESS) return st;
      place_in_slabs(a, need, addr, slab_addr);
    }
    a.slabs.at(slab_addr).live += need;
    a.live_bytes += need;
    ++a.segments;
    segments_.emplace(addr, segment{&a, slab_addr, need});
    *out = reinterpret_cast<void*>(addr);
    return DFA_SUCCESS;
  } catch (...) {
    return DFA_ERROR_OUT_OF_MEMORY;
  }
}

bool arenas::owns(const void* p) const {
  std::lock_guard lk(mu_);
  return segments_.count(reinterpret_cast<std::uintptr_t>(p)) != 0;
}

dfa_status arenas::free(const void* p) {
  std::lock_guard lk(mu_);
  auto it = segments_.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == segments_.end()) return DFA_ERROR_INVALID_ARGUMENT;
  const segment seg = it->second;
  segments_.erase(it);
  arena& a = *seg.a;
  slab& s = a.slabs.at(seg.slab);
  give_back_range(s.free, reinterpret_cast<std::uintptr_t>(p), seg.bytes);
  s.live -= seg.bytes;
  a.live_bytes -= seg.bytes;
  --a.segments;
  if (s.live == 0 && close_slab(a, seg.slab) != DFA_SUCCESS)  // the segment is free all the same
    std::fprintf(stderr, "[deferalloc preload] an empty slab of %zu bytes stays backed for later segments: %s\n",
                 s.bytes, dfa_last_error());
  return DFA_SUCCESS;
}

// Every slab released, only the segments' bytes copied: the live ranges of each slab (its
// free ranges' complement; adjacent segments make one range, one copy).
dfa_status arenas::release_keeping_live(const arena& a, const std::vector<dfa_reservation>& ids, void* stream) {
  std::vector<dfa_range> live;
  for (const auto& [sa, s] : a.slabs) {
    const block& b = a.blocks[s.block];
    std::uintptr_t pos = sa;
    const auto keep_to = [&](std::uintptr_t end) {
      if (end > pos) live.push_back({b.id, pos - b.base, end - pos});
    };
    for (const auto& [at, bytes] : s.free) {
      keep_to(at);
      pos = at + bytes;
    }
    keep_to(sa + s.bytes);
  }
  return dfa_release_many_keeping(ids.data(), ids.size(), live.data(), live.size(), stream);
}

dfa_status arenas::pause(const std::string& name, dfa_keep keep, void* stream) {
  try {
    std::lock_guard lk(mu_);
    auto& slot = arenas_[name];
    if (!slot) slot = std::make_unique<arena>();
    arena& a = *slot;
    if (a.paused) return DFA_ERROR_INVALID_STATE;
    std::vector<dfa_reservation> ids;
    for (const block& b : a.blocks) ids.push_back(b.id);
    if (!ids.empty()) {
      const dfa_status st = keep == DFA_KEEP_HOST ? release_keeping_live(a, ids, stream)
                                                  : dfa_release_many(ids.data(), ids.size(), keep, stream);
      if (st != DFA_SUCCESS) return st;
    }
    a.paused = true;
    a.keep = keep;
    return DFA_SUCCESS;
  } catch (...) {
    return DFA_ERROR_OUT_OF_MEMORY;
  }
}

dfa_status arenas::resume(const std::string& name, void* stream) {
  std::lock_guard lk(mu_);
  auto found = arenas_.find(name);
  if (found == arenas_.end() || !found->second->paused) return DFA_ERROR_INVALID_STATE;
  arena& a = *found->second;
  const dfa_fill fill = a.keep == DFA_KEEP_HOST ? DFA_FILL_RESTORE : DFA_FILL_UNDEFINED;
  for (auto it = a.slabs.begin(); it != a.slabs.end(); ++it) {
    const slab& s = it->second;
    const dfa_status st = dfa_materialize_whole_pieces(a.blocks[s.block].id, s.offset, s.bytes, fill, stream);
    if (st == DFA_SUCCESS) continue;
    for (auto back = a.slabs.begin(); back != it; ++back)  // all or nothing: paused again as they were
      if (dfa_release(a.blocks[back->second.block].id, back->second.offset, back->second.bytes, a.keep, stream) !=
          DFA_SUCCESS)
        break;
    return st;
  }
  a.paused = false;
  return DFA_SUCCESS;
}

arena_figures arenas::figures(const std::string& name) const {
  std::lock_guard lk(mu_);
  arena_figures f;
  auto it = arenas_.find(name);
  if (it == arenas_.end()) return f;
  const arena& a = *it->second;
  f.slabs = a.slabs.size();
  f.slab_bytes = a.slab_bytes;
  f.live_bytes = a.live_bytes;
  f.segments = a.segments;
  f.paused = a.paused ? 1 : 0;
  f.strays = a.strays;
  return f;
}

void arenas::note_stray(const std::string& name, const void* p) {
  std::lock_guard lk(mu_);
  auto it = arenas_.find(name);
  if (it == arenas_.end()) return;
  try {
    if (strays_.emplace(reinterpret_cast<std::uintptr_t>(p), it->second.get()).second) ++it->second->strays;
  } catch (...) {  // not counted: a pause then finds the segment only by a look over its pools
  }
}

void arenas::forget_stray(const void* p) {
  std::lock_guard lk(mu_);
  auto it = strays_.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == strays_.end()) return;
  --it->second->strays;
  strays_.erase(it);
}

}  // namespace deferalloc::preload
