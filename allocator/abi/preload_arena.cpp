// The preload library's arenas (Note [Preload arenas]).
//
// Note [Preload arenas]
// Rationale: the CUDA driver's cost of a pause and a resume is per mapping, not per byte
// (docs/BENCHMARKS.md, "Where a VMM pause and resume spend their time": ~46 us to unmap and
// release one mapping, as much to create, map and set access again; one 512 MiB mapping
// costs about what one 16 MiB mapping does).  PyTorch's caching allocator makes one
// cudaMalloc per segment, so a region of 8 GiB of weights in 512 segments, each a
// reservation of its own, costs 512 mappings each way: as slow as torch_memory_saver.
// Approach: the segments allocated while a thread has an arena current (memory_saver's region
// and cuda_graph in hook_mode="preload": one arena per tag and backup kind; the preload
// library serves one device) are placed in that arena: blocks of address space (dfa_reserve of
// 64 GiB, another when one is full), and in them slabs, each backed by one chunk mapped whole
// (dfa_materialize_whole_pieces of the slab's range: one chunk of the range's exact size,
// cached or new, so smaller chunks the pool holds cached do not cut it into many mappings;
// where the device cannot give one, pieces of the pool's classes).  A segment takes the
// best-fitting free range of the slabs, else a new slab is opened.  Its size: the cap is 256
// granules (512 MiB at the 2 MiB granularity of current GPUs); a segment above an eighth of
// the cap, or above the grown size (the largest power of two not above the bytes of the slabs
// opened for segments of at most an eighth of the cap, from the granularity up to the cap),
// gets a slab of exactly its own bytes (rounded up to the granularity); any other segment
// opens a slab of the grown size, which doubles with what the arena holds in such slabs (so
// large segments first, a KV cache's layers, do not make a small one open a slab of the
// cap).  (A region of one tensor per layer, 257 to 512 MiB each, takes as many slabs as
// segments and no more memory than they do; 256 segments of 16 MiB take 13 slabs, 512 take
// 21.)  cudaFree gives the range back to its slab; a slab left without segments is released at
// once (its chunk goes to the chunk pool, which keeps at most pool_cache_mb and gives the rest
// to the device), and its address space is reused by later slabs.  Pause is one
// dfa_release_many of the arena's blocks (each slab unmapped); with DFA_KEEP_HOST,
// dfa_release_many_keeping, which copies only the segments' bytes (one pinned copy per run of
// adjacent segments: a slab's free tail and freed ranges hold nothing a caller may read, as
// PyTorch's free blocks in a segment).  Resume is one dfa_materialize_whole_pieces per slab at
// the same address, restoring the segments and leaving the free ranges undefined (or all of it
// undefined after a discard).  So both cost O(slabs), and addresses never change.
// Bound on memory backed but not handed out, per arena (cap C): a slab of a segment's own
// bytes wastes less than a granule.  A slab of the grown size (at most C) leaves a tail
// smaller than every segment placed outside it after it was opened (best fit takes the tail
// wherever it fits): where those are segments of at most C/8, an older slab of size C is at
// least 7/8 full, so once an arena of such segments holds C its waste is at most live / 7,
// plus the slabs opened before it held C (under 2 C in all) and the newest slab's tail
// (below min(C, what the arena held before it)).  A tail left before a segment above C/8
// stays (below C) until smaller segments fill it.  Plus the ranges freed inside slabs that
// still hold a segment.  So segments above C/8 (a KV cache of one tensor per layer) cost
// their own bytes, within a granule each.
// Limits: empty_cache gives memory back by whole slabs: a freed segment whose slab still holds
// another segment stays backed until that one is freed too (the rest of the process, outside
// arenas, keeps one reservation per segment, given back segment by segment).  A range freed
// while the arena is paused keeps its backup (restored for nothing) unless its slab
// empties.  An allocation while the arena is paused, of a segment larger than a block, or that
// the library does not serve (another device), is served outside the arena and counted as a
// stray in its figures (memory_saver's pause finds such segments in PyTorch's snapshot of the
// tag's pools, and refuses those that are no reservation of the library).  A stray that is no
// PyTorch segment (a library's own cudaMalloc on the region's thread while the arena is
// paused, or on a device the library does not serve) is in no PyTorch pool: it is counted but
// never found nor paused, and stays backed.  The figures' generation counts the segments
// placed and the strays noted, so that memory_saver reads PyTorch's snapshot again only when
// an arena changed.  The arenas' blocks are hidden from the C ABI's dfa_find (Note [Hidden
// reservations] in process_state.cpp): a reservation call would act on a whole block.  One
// mutex guards the arenas, handed over in the order it was asked for (fifo_mutex: a thread
// that pauses and resumes in a loop cannot starve a cudaMalloc or cudaFree waiting for it): a new slab is backed outside it (address space taken under it, the
// slab added under it after, and given up if a pause came in between: the segment is then
// served outside the arena), but a pause, a resume and a cudaFree that empties a slab make
// their driver calls under it, so a cudaFree of an arena segment waits for a pause in progress
// (a cudaFree of any other pointer does not take it while the process has at most 64 arena
// blocks and no stray is outstanding; otherwise it takes it to look); log lines of the calls
// made under it are delivered after it is released (Note [Logging outside locks] in log.hpp).
// Blocks are kept for the process (address space only).
#include "preload_arena.hpp"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <iterator>

#include "log.hpp"

namespace deferalloc::preload {

namespace {

constexpr std::size_t k_block_bytes = std::size_t{64} << 30;  // address space of one block
constexpr std::size_t k_cap_granules = 256;                   // the slab cap, in granules
constexpr std::size_t k_align_cap = std::size_t{1} << 30;     // the chunk pool's largest class

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

using locked = detail::log_after_unlock<fifo_mutex>;

}  // namespace

std::size_t arenas::granularity() {
  if (granularity_ == 0) {
    std::size_t g = 0;
    if (dfa_granularity(&g) == DFA_SUCCESS) granularity_ = g;
  }
  return granularity_;
}

std::size_t arenas::slab_cap() const { return k_cap_granules * granularity_; }

// `need` is a multiple of the granularity.
std::size_t arenas::slab_size(const arena& a, std::size_t need, bool& grows) const {
  const std::size_t cap = slab_cap();
  // Only the slabs opened for segments of at most cap / 8 count: a region of large segments
  // (each a slab of its own bytes) does not make the next small segment open a slab of the cap.
  const std::size_t grown = std::clamp(std::bit_floor(std::max(a.grown_bytes, granularity_)), granularity_, cap);
  grows = need <= cap / 8;
  return grows && need <= grown ? grown : need;  // else a slab of its own bytes
}

bool arenas::in_blocks(std::uintptr_t p) const noexcept {
  const std::size_t n = published_.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uintptr_t b = block_bases_[i].load(std::memory_order_relaxed);
    if (p >= b && p - b < k_block_bytes) return true;
  }
  return unpublished_.load(std::memory_order_acquire);
}

// Under mu_.
void arenas::publish_block(std::uintptr_t base) noexcept {
  const std::size_t n = published_.load(std::memory_order_relaxed);
  if (n == k_max_published) {
    unpublished_.store(true, std::memory_order_release);
    return;
  }
  block_bases_[n].store(base, std::memory_order_relaxed);
  published_.store(n + 1, std::memory_order_release);
}

// First fit of `bytes` aligned to `align` in a block's free address space.
bool arenas::take_va(block& b, std::size_t bytes, std::size_t align, std::size_t& offset) {
  for (auto it = b.va_free.begin(); it != b.va_free.end(); ++it) {
    const std::size_t at = it->first, len = it->second, o = round_up(at, align);
    if (o + bytes > at + len) continue;
    // The range's node is reused for the part after the slab: at most one allocation (the
    // part before it), undone if it throws.
    auto node = b.va_free.extract(it);
    if (o > at) {
      try {
        b.va_free.emplace(at, o - at);
      } catch (...) {
        b.va_free.insert(std::move(node));
        throw;
      }
    }
    if (o + bytes < at + len) {
      node.key() = o + bytes;
      node.mapped() = at + len - o - bytes;
      b.va_free.insert(std::move(node));
    }
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

// The best-fitting free range of the arena's slabs for `need` bytes; changes nothing.
bool arenas::best_fit(arena& a, std::size_t need, std::uintptr_t& slab_addr,
                      std::map<std::uintptr_t, std::size_t>::iterator& at) {
  bool found = false;
  for (auto& [sa, s] : a.slabs)
    for (auto it = s.free.begin(); it != s.free.end(); ++it)
      if (it->second >= need && (!found || it->second < at->second)) {
        found = true;
        at = it;
        slab_addr = sa;
      }
  return found;
}

// Takes `need` bytes from the start of a free range of `s` (its node reused: no allocation).
void arenas::carve(slab& s, std::map<std::uintptr_t, std::size_t>::iterator at, std::size_t need) noexcept {
  const std::size_t left = at->second - need;
  auto node = s.free.extract(at);
  if (left > 0) {
    node.key() += need;
    node.mapped() = left;
    s.free.insert(std::move(node));
  }
}

// Address space for a new slab of `bytes` (a new block where none has room).  Under mu_.
dfa_status arenas::take_slab_va(const std::string& name, arena& a, std::size_t bytes, pending_slab& out) {
  const std::size_t align = std::clamp(std::bit_floor(bytes), granularity_, k_align_cap);
  std::size_t bi = 0;
  for (; bi < a.blocks.size(); ++bi)
    if (take_va(a.blocks[bi], bytes, align, out.offset)) break;
  if (bi == a.blocks.size()) {
    a.blocks.reserve(a.blocks.size() + 1);  // may throw: before the block exists
    block b;
    b.va_free.emplace(0, k_block_bytes);
    void* base = nullptr;
    if (const dfa_status st = dfa_reserve(k_block_bytes, &b.id, &base); st != DFA_SUCCESS) return st;
    // Hidden from dfa_find (Note [Hidden reservations] in process_state.cpp): the block holds
    // many segments, and a reservation call on it would act on all of them.
    const std::string owner = "arena '" + name +
                              "' of the preload library (PyTorch segments of a deferalloc.memory_saver region: "
                              "memory_saver's pause and resume act on them)";
    if (const dfa_status st = dfa_hide_reservation(b.id, owner.c_str()); st != DFA_SUCCESS) {
      dfa_free_reservation(b.id, nullptr);
      return st;
    }
    b.base = reinterpret_cast<std::uintptr_t>(base);
    take_va(b, bytes, align, out.offset);  // the first range of a fresh block: no allocation
    a.blocks.push_back(std::move(b));
    publish_block(a.blocks.back().base);
  }
  out.block = bi;
  out.bytes = bytes;
  out.id = a.blocks[bi].id;
  out.pauses = a.pauses;
  return DFA_SUCCESS;
}

// Releases a slab without segments: unmapped, or (paused) its backup dropped.
dfa_status arenas::close_slab(arena& a, std::uintptr_t slab_addr) {
  auto it = a.slabs.find(slab_addr);
  const slab& s = it->second;
  block& b = a.blocks[s.block];
  if (const dfa_status st = dfa_release(b.id, s.offset, s.bytes, DFA_KEEP_DISCARD, nullptr); st != DFA_SUCCESS)
    return st;  // the slab stays, empty, for later segments
  a.slab_bytes -= s.bytes;
  if (s.grows) a.grown_bytes -= s.bytes;
  try {
    give_back_range(b.va_free, s.offset, s.bytes);
  } catch (...) {  // the address space is lost for later slabs, nothing else
  }
  a.slabs.erase(it);
  return DFA_SUCCESS;
}

// A segment goes in a free range of the slabs (under the mutex), else in a new slab, whose
// address space is taken under the mutex, backed outside it (a chunk of up to the cap, or
// the segment's own bytes: the driver's cuMemCreate may take milliseconds) and added under
// it after.  A pause in between unmapped the block (the new slab with it, or the slab is
// backed after it): the slab is given up and the caller serves the segment outside.
dfa_status arenas::allocate(const std::string& name, std::size_t bytes, void** out) {
  try {
    arena* a = nullptr;
    pending_slab p;
    std::size_t need = 0;
    {
      locked lk(mu_);
      if (granularity() == 0) return DFA_ERROR_INVALID_STATE;
      need = round_up(bytes, granularity_);
      auto& slot = arenas_[name];
      if (!slot) slot = std::make_unique<arena>();
      a = slot.get();
      if (need > k_block_bytes || a->paused) return DFA_ERROR_INVALID_STATE;
      std::uintptr_t slab_addr = 0;
      std::map<std::uintptr_t, std::size_t>::iterator at;
      if (best_fit(*a, need, slab_addr, at)) {
        const std::uintptr_t addr = at->first;
        segments_.emplace(addr, segment{a, slab_addr, need});  // may throw: before anything changed
        slab& s = a->slabs.at(slab_addr);
        carve(s, at, need);
        s.live += need;
        a->live_bytes += need;
        ++a->segments;
        ++a->generation;
        *out = reinterpret_cast<void*>(addr);
        return DFA_SUCCESS;
      }
      bool grows = false;
      const std::size_t size = slab_size(*a, need, grows);
      if (const dfa_status st = take_slab_va(name, *a, size, p); st != DFA_SUCCESS) return st;
      p.grows = grows;
    }
    dfa_status st = dfa_materialize_whole_pieces(p.id, p.offset, p.bytes, DFA_FILL_UNDEFINED, nullptr);
    std::size_t spare = 0;  // address space taken but not backed
    if (st == DFA_ERROR_OUT_OF_MEMORY && p.bytes > need) {
      // Short of memory: a slab of the segment's own size, which a reservation of its own would need too.
      st = dfa_materialize_whole_pieces(p.id, p.offset, need, DFA_FILL_UNDEFINED, nullptr);
      spare = p.bytes - need;
      p.bytes = need;
    }
    locked lk(mu_);
    block& b = a->blocks[p.block];
    const auto give_up = [&](dfa_status why) {
      if (st == DFA_SUCCESS) dfa_release(p.id, p.offset, p.bytes, DFA_KEEP_DISCARD, nullptr);
      try {
        give_back_range(b.va_free, p.offset, p.bytes + spare);
      } catch (...) {  // the address space is lost for later slabs, nothing else
      }
      return why;
    };
    if (st != DFA_SUCCESS) return give_up(st);
    if (a->paused || a->pauses != p.pauses) return give_up(DFA_ERROR_INVALID_STATE);
    const std::uintptr_t addr = b.base + p.offset;
    try {
      if (spare > 0) give_back_range(b.va_free, p.offset + p.bytes, spare);
      spare = 0;
      slab s;
      s.block = p.block;
      s.offset = p.offset;
      s.bytes = p.bytes;
      s.live = need;
      s.grows = p.grows;
      if (p.bytes > need) s.free.emplace(addr + need, p.bytes - need);
      auto it = a->slabs.emplace(addr, std::move(s)).first;
      try {
        segments_.emplace(addr, segment{a, addr, need});
      } catch (...) {
        a->slabs.erase(it);
        throw;
      }
    } catch (...) {
      return give_up(DFA_ERROR_OUT_OF_MEMORY);
    }
    a->slab_bytes += p.bytes;
    if (p.grows) a->grown_bytes += p.bytes;
    a->live_bytes += need;
    ++a->segments;
    ++a->generation;
    *out = reinterpret_cast<void*>(addr);
    return DFA_SUCCESS;
  } catch (...) {
    return DFA_ERROR_OUT_OF_MEMORY;
  }
}

bool arenas::owns(const void* p) const {
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  if (!in_blocks(at)) return false;
  std::lock_guard lk(mu_);
  return segments_.count(at) != 0;
}

bool arenas::contains(const void* p) const {
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  if (!unpublished_.load(std::memory_order_acquire)) return in_blocks(at);
  std::lock_guard lk(mu_);
  for (const auto& [name, a] : arenas_)
    for (const block& b : a->blocks)
      if (at >= b.base && at - b.base < k_block_bytes) return true;
  return false;
}

dfa_status arenas::free(const void* p) {
  locked lk(mu_);
  auto it = segments_.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == segments_.end()) return DFA_ERROR_INVALID_ARGUMENT;
  const segment seg = it->second;
  arena& a = *seg.a;
  slab& s = a.slabs.at(seg.slab);
  try {
    give_back_range(s.free, reinterpret_cast<std::uintptr_t>(p), seg.bytes);
  } catch (...) {  // the range stays taken (lost to the slab until it closes); the segment is freed
  }
  segments_.erase(it);
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
    locked lk(mu_);
    auto& slot = arenas_[name];
    if (!slot) slot = std::make_unique<arena>();
    arena& a = *slot;
    if (a.paused) return DFA_ERROR_INVALID_STATE;
    std::vector<dfa_reservation> ids;
    for (const block& b : a.blocks) ids.push_back(b.id);
    ++a.pauses;  // a slab being backed now is given up (allocate)
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
  locked lk(mu_);
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
  f.generation = a.generation;
  return f;
}

void arenas::classify(const std::string& name, const void* const* ptrs, std::size_t n, unsigned char* out) const {
  std::lock_guard lk(mu_);
  auto found = arenas_.find(name);
  const arena* mine = found == arenas_.end() ? nullptr : found->second.get();
  for (std::size_t i = 0; i < n; ++i) {
    auto it = segments_.find(reinterpret_cast<std::uintptr_t>(ptrs[i]));
    out[i] = it == segments_.end() ? 0 : it->second.a == mine ? 2 : 1;
  }
}

std::vector<std::pair<std::uintptr_t, std::size_t>> arenas::segments(const std::string& name) const {
  std::vector<std::pair<std::uintptr_t, std::size_t>> out;
  std::lock_guard lk(mu_);
  auto found = arenas_.find(name);
  if (found == arenas_.end()) return out;
  const arena* mine = found->second.get();
  out.reserve(mine->segments);
  for (const auto& [addr, seg] : segments_)
    if (seg.a == mine) out.emplace_back(addr, seg.bytes);
  std::sort(out.begin(), out.end());
  return out;
}

void arenas::note_stray(const std::string& name, const void* p) {
  std::lock_guard lk(mu_);
  try {
    auto& slot = arenas_[name];
    if (!slot) slot = std::make_unique<arena>();
    ++slot->generation;  // first: a stray that cannot be counted still makes the next pause look
    if (strays_.emplace(reinterpret_cast<std::uintptr_t>(p), slot.get()).second) {
      ++slot->strays;
      stray_count_.fetch_add(1, std::memory_order_relaxed);
    }
  } catch (...) {  // not counted: a pause then finds the segment only by a look over its pools
  }
}

std::string arenas::forget_stray(const void* p) {
  if (stray_count_.load(std::memory_order_relaxed) == 0) return {};  // every cudaFree of the process comes here
  std::lock_guard lk(mu_);
  auto it = strays_.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == strays_.end()) return {};
  arena* a = it->second;
  --a->strays;
  strays_.erase(it);
  stray_count_.fetch_sub(1, std::memory_order_relaxed);
  try {
    for (const auto& [name, slot] : arenas_)
      if (slot.get() == a) return name;
  } catch (...) {  // the name is for a rare note_stray again only
  }
  return {};
}

}  // namespace deferalloc::preload
