// Run under LD_PRELOAD=libdeferalloc_preload.so with DEFERALLOC_CONF=...,pool_cache_mb:0 (ctest
// preload_arena_host on the host driver, preload_arena_cuda on a GPU: exit 77 without one): the
// preload library's arenas (Note [Preload arenas] in allocator/abi/preload_arena.cpp), counted
// by the driver calls of dfa_get_stats.  Segments are 16 granules (1 MiB on the host driver's
// 64 KiB, 32 MiB on a GPU's 2 MiB).
//   (a) N segments in one arena take O(slabs) mappings: created, paused and resumed with one
//       create / map / set_access / unmap / release per slab (a reservation per segment
//       outside the arena, for contrast: one mapping per segment); a pause gives the memory
//       back (the device's free memory, on a GPU);
//   (b) pause / resume with and without backup keep the addresses, and (backup) the contents;
//   (c) freeing every segment gives every slab back;
//   (d) a freed range is reused;
//   (f) a pause with backup copies exactly the segments' bytes (not the slabs' free tails
//       nor freed ranges) and a resume restores them, still one mapping per slab;
//   (e) pause / resume / free / "empty_cache" (freeing) interleaved never release twice, a
//       second pause or resume is refused, an allocation while paused is served outside;
//       and 3000 random steps of them, checked after each against a model (segments
//       disjoint, chunks alive = slabs backed, contents kept, everything back at the end);
//   (g) segments above an eighth of the slab cap take slabs of their own bytes (within 1.1x),
//       and do not make later small segments open slabs of the cap;
//   (h) allocations racing pauses: in the arena or counted as strays, nothing leaked;
//   (i) cudaMalloc / cudaFree racing outside arenas (strays among them): every one succeeds;
//   with the argument "unserved" (a DEFERALLOC_CONF the library cannot serve): an arena
//   cannot be made current; with "race N": (h) alone, N times.
#include <cuda_runtime_api.h>
#include <deferalloc/deferalloc.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <random>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "probe_check.hpp"

namespace {

using push_fn = int (*)(const char*);
using pop_fn = int (*)();
using pause_fn = int (*)(const char*, int, void*);
using resume_fn = int (*)(const char*, void*);
using owns_fn = int (*)(const void*);
using figures_fn = int (*)(const char*, size_t*);

struct arena_api {
  push_fn push = nullptr;
  pop_fn pop = nullptr;
  pause_fn pause = nullptr;
  resume_fn resume = nullptr;
  owns_fn owns = nullptr;
  figures_fn figures = nullptr;
};

enum call { k_reserve, k_free_reservation, k_create, k_release, k_map, k_unmap, k_set_access };

dfa_stats stats() {
  dfa_stats s{};
  if (dfa_get_stats(&s) != DFA_SUCCESS) std::printf("dfa_get_stats failed: %s\n", dfa_last_error());
  return s;
}

std::uint64_t delta(const dfa_stats& a, const dfa_stats& b, call c) { return b.driver_calls[c] - a.driver_calls[c]; }

size_t slabs(const arena_api& api, const char* name) {
  size_t f[7] = {};
  api.figures(name, f);
  return f[0];
}

size_t k_seg = 0;     // 16 granules
bool g_cuda = false;  // the CUDA driver: contents through cudaMemset / cudaMemcpy
constexpr int k_n = 256;

bool fill(void* p, int byte, size_t n) {
  if (!g_cuda) {
    std::memset(p, byte, n);
    return true;
  }
  return cudaMemset(p, byte, n) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
}

int byte_at(const void* p, size_t off) {
  unsigned char b = 0;
  if (!g_cuda) return static_cast<const unsigned char*>(p)[off];
  if (cudaMemcpy(&b, static_cast<const char*>(p) + off, 1, cudaMemcpyDeviceToHost) != cudaSuccess) return -1;
  return b;
}

size_t device_free() {
  size_t free = 0, total = 0;
  if (g_cuda) cudaMemGetInfo(&free, &total);
  return free;
}

// The slabs that n segments of `seg` bytes take by Note [Preload arenas]'s rule (a segment
// above cap / 8 or above the grown size gets a slab of its own bytes; else a slab of the
// grown size, which doubles with what the arena holds, from the granularity g up to the cap
// of 256 granules).  Adds the slabs' bytes to `held_out`.
size_t expected_slabs(int n, size_t seg, size_t g, size_t* held_out = nullptr) {
  const size_t cap = 256 * g, need = (seg + g - 1) / g * g;
  size_t held = 0, total = 0, left = 0, count = 0;
  for (int i = 0; i < n; ++i) {
    if (left >= need) {
      left -= need;
      continue;
    }
    const size_t grown = std::clamp(std::bit_floor(std::max(held, g)), g, cap);
    const size_t slab = need > cap / 8 || need > grown ? need : grown;
    if (need <= cap / 8) held += slab;  // only these slabs count towards the grown size
    total += slab;
    left = slab - need;
    ++count;
  }
  if (held_out != nullptr) *held_out = total;
  return count;
}

// (a), (b) and (c) on one arena, with `keep`.
int cycle(const arena_api& api, const char* name, int keep) {
  const dfa_stats s0 = stats();
  CHECK(api.push(name) == DFA_SUCCESS);
  std::vector<void*> p(k_n);
  for (int i = 0; i < k_n; ++i) CHECK(cudaMalloc(&p[i], k_seg) == cudaSuccess && api.owns(p[i]) == 1);
  CHECK(api.pop() == DFA_SUCCESS);
  const dfa_stats s1 = stats();
  // 256 segments of 16 granules in slabs of 16, 16, 32, ..., 256 granules (the cap) then 14
  // of 256 granules, twenty (GPU: 8 GiB in slabs of 32 MiB up to 512 MiB).  One chunk and
  // one mapping each.
  const size_t n_slabs = slabs(api, name);
  std::printf("%s: %d segments of %zu bytes in %zu slabs: %llu create, %llu map, %llu set_access, %llu reserve\n", name,
              k_n, k_seg, n_slabs, (unsigned long long)delta(s0, s1, k_create), (unsigned long long)delta(s0, s1, k_map),
              (unsigned long long)delta(s0, s1, k_set_access), (unsigned long long)delta(s0, s1, k_reserve));
  CHECK(n_slabs == expected_slabs(k_n, k_seg, k_seg / 16) && n_slabs == 20u);
  CHECK(delta(s0, s1, k_create) == n_slabs && delta(s0, s1, k_map) == n_slabs && delta(s0, s1, k_set_access) == n_slabs);
  CHECK(delta(s0, s1, k_reserve) <= 1);
  for (int i = 0; i < k_n; ++i) CHECK(fill(p[i], 0x11 + i % 200, k_seg));

  const size_t free1 = device_free();
  CHECK(api.pause(name, keep, nullptr) == DFA_SUCCESS);
  const dfa_stats s2 = stats();
  if (g_cuda) {
    std::printf("%s: pause gave back %zu MiB of %zu\n", name, (device_free() - free1) >> 20, (size_t{k_n} * k_seg) >> 20);
    CHECK(device_free() - free1 >= size_t{k_n} * k_seg / 100 * 99);
  }
  CHECK(delta(s1, s2, k_unmap) == n_slabs && delta(s1, s2, k_release) == n_slabs);  // pool_cache_mb:0
  CHECK(s1.backed_bytes - s2.backed_bytes == size_t{k_n} * k_seg);  // the memory given back
  if (keep == DFA_KEEP_HOST) CHECK(s2.backup_bytes - s1.backup_bytes == size_t{k_n} * k_seg);  // (f)
  CHECK(api.pause(name, keep, nullptr) == DFA_ERROR_INVALID_STATE);  // (e) a second pause changes nothing
  CHECK(stats().driver_calls[k_unmap] == s2.driver_calls[k_unmap]);

  CHECK(api.resume(name, nullptr) == DFA_SUCCESS);
  const dfa_stats s3 = stats();
  CHECK(delta(s2, s3, k_create) == n_slabs && delta(s2, s3, k_map) == n_slabs && delta(s2, s3, k_set_access) == n_slabs);
  CHECK(api.resume(name, nullptr) == DFA_ERROR_INVALID_STATE);  // (e)
  CHECK(s3.backed_bytes == s1.backed_bytes);
  for (int i = 0; i < k_n; ++i) {  // (b) same addresses, backed; contents kept with the backup
    dfa_reservation r = 0;
    CHECK(api.owns(p[i]) == 1);
    // The arena's block is hidden from the C ABI: no reservation call acts on it for a segment.
    CHECK(dfa_find(p[i], &r) == DFA_ERROR_INVALID_ARGUMENT && std::strstr(dfa_last_error(), "arena '") != nullptr);
    if (keep == DFA_KEEP_HOST) {
      CHECK(byte_at(p[i], 0) == 0x11 + i % 200 && byte_at(p[i], k_seg - 1) == 0x11 + i % 200);
    }
    CHECK(fill(p[i], 0x5A, k_seg));  // writable
  }
  CHECK(cudaFree(static_cast<char*>(p[3]) + 4096) == cudaErrorInvalidValue);  // interior pointer

  for (void* q : p) CHECK(cudaFree(q) == cudaSuccess);  // (c) every slab given back
  const dfa_stats s4 = stats();
  CHECK(slabs(api, name) == 0);
  CHECK(delta(s3, s4, k_release) == n_slabs && s4.backed_bytes == s0.backed_bytes && s4.backup_bytes == s0.backup_bytes);
  CHECK(s4.pool_alive_bytes == s0.pool_alive_bytes);
  return 0;
}

// (d) a freed range is reused; (e) frees while paused, an allocation while paused.
int interleaved(const arena_api& api) {
  const char* name = "tms.host/interleaved";
  const dfa_stats s0 = stats();
  CHECK(api.push(name) == DFA_SUCCESS);
  void *a = nullptr, *b = nullptr, *c = nullptr, *b2 = nullptr;
  const size_t h = k_seg / 2;
  CHECK(cudaMalloc(&c, 2 * k_seg) == cudaSuccess && cudaMalloc(&a, h) == cudaSuccess &&
        cudaMalloc(&b, h) == cudaSuccess);
  const dfa_stats s1 = stats();
  CHECK(cudaFree(b) == cudaSuccess);
  CHECK(cudaMalloc(&b2, h) == cudaSuccess);
  CHECK(b2 == b && stats().driver_calls[k_create] == s1.driver_calls[k_create]);  // (d) reused, nothing created
  CHECK(fill(a, 0x21, h) && fill(c, 0x23, 2 * k_seg));
  // c in a slab of its 32 granules (an eighth of the cap: it counts towards the grown size),
  // a and b in the next one, of the grown size (32 granules)
  CHECK(slabs(api, name) == 2);

  CHECK(api.pause(name, DFA_KEEP_HOST, nullptr) == DFA_SUCCESS);
  const dfa_stats s2 = stats();
  CHECK(s2.backup_bytes - s0.backup_bytes == 3 * k_seg);  // the segments' bytes, not the slabs' 4
  void* outside = nullptr;  // paused arena: a reservation of its own, paused by the segment
  CHECK(cudaMalloc(&outside, k_seg) == cudaSuccess && api.owns(outside) == 0);
  dfa_reservation r = 0;
  CHECK(dfa_find(outside, &r) == DFA_SUCCESS);
  size_t f[7] = {};
  // paused, one stray; the generation counts the 4 segments placed and the stray
  CHECK(api.figures(name, f) == DFA_SUCCESS && f[4] == 1 && f[5] == 1 && f[6] == 5);
  CHECK(cudaFree(outside) == cudaSuccess);
  CHECK(api.figures(name, f) == DFA_SUCCESS && f[5] == 0);
  CHECK(cudaFree(c) == cudaSuccess);  // its slab closes while paused: the backup dropped, nothing unmapped
  const dfa_stats s3 = stats();
  CHECK(slabs(api, name) == 1 && s2.backup_bytes - s3.backup_bytes == 2 * k_seg);
  CHECK(delta(s2, s3, k_unmap) == 1 && delta(s2, s3, k_release) == 1);  // only `outside`'s chunk

  CHECK(api.resume(name, nullptr) == DFA_SUCCESS);  // one slab back, restored
  const dfa_stats s4 = stats();
  CHECK(delta(s3, s4, k_map) == 1 && s4.backup_bytes == s0.backup_bytes);
  CHECK(byte_at(a, h - 1) == 0x21);
  CHECK(cudaFree(a) == cudaSuccess && cudaFree(b2) == cudaSuccess);
  CHECK(api.pop() == DFA_SUCCESS && api.pop() == DFA_ERROR_INVALID_STATE);
  const dfa_stats s5 = stats();
  CHECK(slabs(api, name) == 0 && s5.backed_bytes == s0.backed_bytes && s5.pool_alive_bytes == s0.pool_alive_bytes);
  CHECK(s5.driver_calls[k_create] - s0.driver_calls[k_create] == s5.driver_calls[k_release] - s0.driver_calls[k_release]);

  CHECK(api.pause(name, DFA_KEEP_DISCARD, nullptr) == DFA_SUCCESS);  // empty: nothing to do, no error
  CHECK(api.resume(name, nullptr) == DFA_SUCCESS);
  return 0;
}

// (f) A newest slab with a free tail, ranges freed between segments (adjacent and not).
int live_bytes_only(const arena_api& api) {
  const char* name = "tms.host/live";
  const dfa_stats s0 = stats();
  CHECK(api.push(name) == DFA_SUCCESS);
  std::vector<void*> p(21);  // slabs of 1, 1, 2, 4, 8 segments, then one of 16 with 5 in it
  for (auto& q : p) CHECK(cudaMalloc(&q, k_seg) == cudaSuccess);
  CHECK(api.pop() == DFA_SUCCESS && slabs(api, name) == 6);
  for (int i : {4, 5, 9, 13, 18}) {  // 4 and 5 together, the others alone; every slab keeps a segment
    CHECK(cudaFree(p[i]) == cudaSuccess);
    p[i] = nullptr;
  }
  size_t live = 0;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] != nullptr) {
      CHECK(fill(p[i], 0x31 + static_cast<int>(i), k_seg));
      live += k_seg;
    }
  size_t f[7] = {};
  CHECK(api.figures(name, f) == DFA_SUCCESS && f[2] == live && f[1] == 32 * k_seg);
  const dfa_stats s1 = stats();
  CHECK(api.pause(name, DFA_KEEP_HOST, nullptr) == DFA_SUCCESS);
  const dfa_stats s2 = stats();
  std::printf("%s: a pause with backup copied %zu bytes: the segments' %zu, of slabs of %zu\n", name,
              s2.backup_bytes - s1.backup_bytes, live, f[1]);
  CHECK(s2.backup_bytes - s1.backup_bytes == live);
  CHECK(delta(s1, s2, k_unmap) == 6 && s1.backed_bytes - s2.backed_bytes == f[1]);
  CHECK(api.resume(name, nullptr) == DFA_SUCCESS);
  const dfa_stats s3 = stats();
  CHECK(delta(s2, s3, k_map) == 6 && s3.backup_bytes == s1.backup_bytes && s3.backed_bytes == s1.backed_bytes);
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] != nullptr) CHECK(byte_at(p[i], 0) == 0x31 + static_cast<int>(i) && byte_at(p[i], k_seg - 1) == 0x31 + static_cast<int>(i));
  void* again = nullptr;  // a freed range, undefined after the resume, is served again and writable
  CHECK(api.push(name) == DFA_SUCCESS && cudaMalloc(&again, k_seg) == cudaSuccess && api.pop() == DFA_SUCCESS);
  CHECK(api.owns(again) == 1 && fill(again, 0x7E, k_seg) && byte_at(again, k_seg - 1) == 0x7E);
  CHECK(cudaFree(again) == cudaSuccess);
  for (void* q : p)
    if (q != nullptr) CHECK(cudaFree(q) == cudaSuccess);
  const dfa_stats s4 = stats();
  CHECK(slabs(api, name) == 0 && s4.backed_bytes == s0.backed_bytes && s4.backup_bytes == s0.backup_bytes);
  CHECK(s4.pool_alive_bytes == s0.pool_alive_bytes);
  return 0;
}

// Random cudaMalloc / cudaFree / pause (with backup) / resume / "empty_cache" (half the
// segments freed), each step checked: segments disjoint and inside the arena, the chunks
// alive equal to the slabs backed (pool_cache_mb:0: nothing cached), contents kept.
int random_interleaving(const arena_api& api) {
  const char* name = "tms.host/random";
  const dfa_stats s0 = stats();
  std::mt19937 rng(12345);
  std::map<std::uintptr_t, std::pair<size_t, int>> live;  // address -> bytes, fill byte
  bool paused = false;
  CHECK(api.push(name) == DFA_SUCCESS);
  for (int step = 0; step < 3000; ++step) {
    const unsigned op = rng() % 16;
    if (op < 7 && !paused) {  // allocate 1 to 40 granules
      const size_t bytes = (1 + rng() % 40) * (k_seg / 16);
      void* p = nullptr;
      CHECK(cudaMalloc(&p, bytes) == cudaSuccess && api.owns(p) == 1);
      const int b = 1 + step % 250;
      CHECK(fill(p, b, bytes));
      live[reinterpret_cast<std::uintptr_t>(p)] = {bytes, b};
    } else if (op < 12 && !live.empty()) {  // free one
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      CHECK(cudaFree(reinterpret_cast<void*>(it->first)) == cudaSuccess);
      live.erase(it);
    } else if (op == 12) {  // "empty_cache": half of them
      for (auto it = live.begin(); it != live.end();)
        if (rng() % 2 == 0) {
          CHECK(cudaFree(reinterpret_cast<void*>(it->first)) == cudaSuccess);
          it = live.erase(it);
        } else {
          ++it;
        }
    } else if (op < 15) {
      const size_t saved = stats().backup_bytes;
      CHECK((paused ? api.resume(name, nullptr) : api.pause(name, DFA_KEEP_HOST, nullptr)) == DFA_SUCCESS);
      paused = !paused;
      size_t live_bytes = 0;
      for (const auto& [a, v] : live) live_bytes += v.first;
      if (paused) CHECK(stats().backup_bytes - saved == live_bytes);  // (f) the segments' bytes only
      if (!paused)
        for (const auto& [a, v] : live)
          CHECK(byte_at(reinterpret_cast<void*>(a), 0) == v.second &&
                byte_at(reinterpret_cast<void*>(a), v.first - 1) == v.second);
    } else {
      CHECK((paused ? api.pause(name, DFA_KEEP_HOST, nullptr) : api.resume(name, nullptr)) == DFA_ERROR_INVALID_STATE);
    }
    size_t f[7] = {};
    CHECK(api.figures(name, f) == DFA_SUCCESS && f[3] == live.size() && f[4] == (paused ? 1u : 0u));
    size_t bytes = 0;
    std::uintptr_t end = 0;
    for (const auto& [a, v] : live) {
      CHECK(a >= end);  // disjoint
      end = a + v.first;
      bytes += v.first;
    }
    CHECK(f[2] == bytes && f[1] >= bytes);
    const dfa_stats st = stats();
    CHECK(st.pool_alive_bytes - s0.pool_alive_bytes == (paused ? 0 : f[1]));
  }
  if (paused) CHECK(api.resume(name, nullptr) == DFA_SUCCESS);
  for (const auto& [a, v] : live) CHECK(cudaFree(reinterpret_cast<void*>(a)) == cudaSuccess);
  CHECK(api.pop() == DFA_SUCCESS);
  const dfa_stats s1 = stats();
  CHECK(slabs(api, name) == 0 && s1.pool_alive_bytes == s0.pool_alive_bytes && s1.backup_bytes == s0.backup_bytes);
  CHECK(s1.driver_calls[k_create] - s0.driver_calls[k_create] == s1.driver_calls[k_release] - s0.driver_calls[k_release]);
  std::printf("%s: 3000 random steps, %llu slabs created and released\n", name,
              (unsigned long long)(s1.driver_calls[k_create] - s0.driver_calls[k_create]));
  return 0;
}

// cudaMalloc's of `runs` (count, bytes) in turn with arena `name` current, appended to `out`.
bool in_arena(const arena_api& api, const char* name, std::initializer_list<std::pair<int, size_t>> runs,
              std::vector<void*>& out) {
  if (api.push(name) != DFA_SUCCESS) return false;
  bool ok = true;
  for (const auto& [n, bytes] : runs)
    for (int i = 0; i < n && ok; ++i) {
      void* q = nullptr;
      ok = cudaMalloc(&q, bytes) == cudaSuccess;
      if (ok) out.push_back(q);
    }
  return api.pop() == DFA_SUCCESS && ok;
}

// (g) Segments above an eighth of the cap (a KV cache of one tensor per layer, 257 to 512
// MiB at a GPU's 2 MiB granularity: 129 to 255 granules here) take slabs of their own bytes:
// within 1.1 x the segments' bytes (a power of two each would take up to 2x), one chunk and
// one mapping each, created, paused and resumed.
int large_segments(const arena_api& api) {
  const size_t g = k_seg / 16;
  for (size_t granules : {129u, 130u, 150u, 200u}) {
    const char* name = "tms.discard/kv";
    const size_t bytes = granules * g - 1000;  // PyTorch's sizes need not be granule multiples
    const dfa_stats s0 = stats();
    std::vector<void*> p(64);
    CHECK(api.push(name) == DFA_SUCCESS);
    for (auto& q : p) CHECK(cudaMalloc(&q, bytes) == cudaSuccess && api.owns(q) == 1);
    CHECK(api.pop() == DFA_SUCCESS);
    const dfa_stats s1 = stats();
    size_t f[7] = {}, model = 0;
    CHECK(api.figures(name, f) == DFA_SUCCESS && f[2] == 64 * granules * g);
    std::printf("%s: 64 segments of %zu granules: %zu slabs of %zu bytes for %zu (%.3fx)\n", name, granules, f[0],
                f[1], f[2], double(f[1]) / double(f[2]));
    CHECK(f[0] == expected_slabs(64, bytes, g, &model) && f[1] == model);
    CHECK(f[0] == 64 && f[1] * 10 <= f[2] * 11);
    CHECK(delta(s0, s1, k_create) == 64 && delta(s0, s1, k_map) == 64);
    CHECK(api.pause(name, DFA_KEEP_DISCARD, nullptr) == DFA_SUCCESS);
    const dfa_stats s2 = stats();
    CHECK(delta(s1, s2, k_unmap) == 64 && s1.backed_bytes - s2.backed_bytes == f[1]);
    CHECK(api.resume(name, nullptr) == DFA_SUCCESS);
    CHECK(delta(s2, stats(), k_map) == 64);
    for (void* q : p) CHECK(fill(q, 0x42, bytes) && cudaFree(q) == cudaSuccess);
    const dfa_stats s3 = stats();
    CHECK(slabs(api, name) == 0 && s3.pool_alive_bytes == s0.pool_alive_bytes);
  }
  // Small segments first, then large ones: the large ones still cost their own bytes.
  const char* name = "tms.discard/mixed";
  std::vector<void*> p;
  CHECK(in_arena(api, name, {{8, 2 * g}, {32, 150 * g}}, p));
  size_t f[7] = {};
  CHECK(api.figures(name, f) == DFA_SUCCESS && f[2] == (8 * 2 + 32 * 150) * g);
  CHECK(f[1] <= f[2] + 16 * g);  // the small segments' slabs: 2, 2, 4, 8 granules
  for (void* q : p) CHECK(cudaFree(q) == cudaSuccess);
  // Large segments first (16 KV layers of 150 granules), then small ones: the small ones'
  // slabs grow from their own bytes, not from the large ones' (which would open a slab of the
  // cap for the first 2-granule segment).
  name = "tms.discard/large_then_small";
  p.clear();
  CHECK(in_arena(api, name, {{16, 150 * g}, {8, 2 * g}}, p));
  CHECK(api.figures(name, f) == DFA_SUCCESS && f[2] == (16 * 150 + 8 * 2) * g && f[6] == 24);  // generation
  std::printf("%s: 16 segments of 150 granules then 8 of 2: %zu slabs of %zu bytes for %zu\n", name, f[0], f[1], f[2]);
  CHECK(f[1] <= f[2] + 16 * g);  // the small segments' slabs: 2, 2, 4, 8 granules, as without the large ones
  for (void* q : p) CHECK(cudaFree(q) == cudaSuccess);
  CHECK(api.figures(name, f) == DFA_SUCCESS && f[0] == 0 && f[6] == 24);  // frees leave the generation
  return 0;
}

// (h) Allocations racing pauses and resumes of their arena (a new slab is backed outside the
// arena's mutex): each segment is in the arena or counted as a stray, the chunks alive are
// the slabs' and the strays' bytes, and everything goes back at the end.
int racing_pauses(const arena_api& api) {
  const char* name = "tms.host/race";
  const size_t g = k_seg / 16;
  const dfa_stats s0 = stats();
  std::vector<void*> p(400);
  std::atomic<bool> done{false}, finished{false};
  std::atomic<size_t> made{0};
  std::thread pauser([&] {  // with and without backup in turn
    for (int i = 0; !done.load(); ++i)
      if (api.pause(name, i % 2 ? DFA_KEEP_HOST : DFA_KEEP_DISCARD, nullptr) == DFA_SUCCESS) api.resume(name, nullptr);
  });
  // A cudaMalloc starved of the arenas' mutex by the pauser (a mutex that the thread unlocking
  // it takes again first) hung here on a 16-core machine: a failure with a line, not a hang.
  std::thread watchdog([&] {
    for (int ms = 0; ms < 120000 && !finished.load(); ms += 10) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (finished.load()) return;
    std::fprintf(stderr, "%s: %zu of %zu allocations in 120 s: starved by the pauser\n", name, made.load(), p.size());
    std::fflush(nullptr);
    std::_Exit(1);
  });
  if (api.push(name) != DFA_SUCCESS) done = true;
  for (size_t i = 0; i < p.size() && !done.load(); ++i, ++made)
    if (cudaMalloc(&p[i], (1 + i % 7) * 3 * g) != cudaSuccess) p[i] = nullptr;
  done = true;
  pauser.join();
  finished = true;
  watchdog.join();
  CHECK(api.pop() == DFA_SUCCESS);
  size_t in = 0, out = 0, out_bytes = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    CHECK(p[i] != nullptr);
    if (api.owns(p[i]) == 1) {
      ++in;
    } else {
      ++out;
      out_bytes += (1 + i % 7) * 3 * g;
    }
  }
  size_t f[7] = {};
  CHECK(api.figures(name, f) == DFA_SUCCESS && f[4] == 0 && f[3] == in && f[5] == out);
  std::printf("%s: %zu segments in the arena, %zu outside (allocated while paused)\n", name, in, out);
  CHECK(stats().pool_alive_bytes - s0.pool_alive_bytes == f[1] + out_bytes);
  for (void* q : p) CHECK(cudaFree(q) == cudaSuccess);
  CHECK(api.figures(name, f) == DFA_SUCCESS && f[0] == 0 && f[5] == 0);
  const dfa_stats s1 = stats();
  CHECK(s1.pool_alive_bytes == s0.pool_alive_bytes && s1.backup_bytes == s0.backup_bytes);
  return 0;
}

// Run with a DEFERALLOC_CONF the library cannot serve (ctest preload_arena_unserved): an
// arena cannot be made current, since no cudaMalloc of it could be paused.
int unserved(const arena_api& api) {
  CHECK(api.push("tms.host/unserved") == DFA_ERROR_INVALID_STATE);
  CHECK(api.push("") == DFA_SUCCESS && api.pop() == DFA_SUCCESS);  // no arena: always
  CHECK(api.pop() == DFA_ERROR_INVALID_STATE);
  std::printf("preload_arena_probe: an arena where the library serves nothing is refused\n");
  return 0;
}

// (i) cudaMalloc / cudaFree racing outside arenas, with strays outstanding (a paused arena's
// segments): an address freed by one thread and handed to another at once is the other's, so
// every cudaFree succeeds and nothing is left over.
int racing_frees(const arena_api& api) {
  const char* name = "tms.host/race_free";
  const dfa_stats s0 = stats();
  CHECK(api.pause(name, DFA_KEEP_DISCARD, nullptr) == DFA_SUCCESS);
  std::vector<std::thread> ts;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&, t] {
      const bool in_arena = t % 2 == 0;  // strays of the paused arena, or plain segments
      if (in_arena && api.push(name) != DFA_SUCCESS) ++failures;
      for (int i = 0; i < 1500; ++i) {
        void* q = nullptr;
        if (cudaMalloc(&q, k_seg) != cudaSuccess || cudaFree(q) != cudaSuccess) ++failures;
      }
      if (in_arena && api.pop() != DFA_SUCCESS) ++failures;
    });
  for (auto& t : ts) t.join();
  size_t f[7] = {};
  CHECK(failures.load() == 0);
  CHECK(api.figures(name, f) == DFA_SUCCESS && f[5] == 0);
  CHECK(api.resume(name, nullptr) == DFA_SUCCESS);
  CHECK(stats().pool_alive_bytes == s0.pool_alive_bytes);
  std::printf("%s: 6000 cudaMalloc / cudaFree racing on 4 threads, every one served and freed\n", name);
  return 0;
}

// For contrast: the same segments outside an arena, one reservation and one mapping each.
int outside_arena() {
  const dfa_stats s0 = stats();
  std::vector<void*> p(k_n);
  for (int i = 0; i < k_n; ++i) CHECK(cudaMalloc(&p[i], k_seg) == cudaSuccess);
  const dfa_stats s1 = stats();
  std::printf("outside an arena: %d segments take %llu mappings\n", k_n, (unsigned long long)delta(s0, s1, k_map));
  CHECK(delta(s0, s1, k_map) >= static_cast<std::uint64_t>(k_n));
  for (void* q : p) CHECK(cudaFree(q) == cudaSuccess);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  arena_api api;
  api.push = reinterpret_cast<push_fn>(::dlsym(RTLD_DEFAULT, "dfa_preload_arena_push"));
  api.pop = reinterpret_cast<pop_fn>(::dlsym(RTLD_DEFAULT, "dfa_preload_arena_pop"));
  api.pause = reinterpret_cast<pause_fn>(::dlsym(RTLD_DEFAULT, "dfa_preload_arena_pause"));
  api.resume = reinterpret_cast<resume_fn>(::dlsym(RTLD_DEFAULT, "dfa_preload_arena_resume"));
  api.owns = reinterpret_cast<owns_fn>(::dlsym(RTLD_DEFAULT, "dfa_preload_arena_owns"));
  api.figures = reinterpret_cast<figures_fn>(::dlsym(RTLD_DEFAULT, "dfa_preload_arena_figures"));
  CHECK(api.push && api.pop && api.pause && api.resume && api.owns && api.figures);  // LD_PRELOAD set
  if (argc > 1 && std::string(argv[1]) == "unserved") return unserved(api);
  const char* driver = nullptr;
  size_t g = 0;
  if (dfa_driver_name(&driver) != DFA_SUCCESS || dfa_granularity(&g) != DFA_SUCCESS) {
    std::printf("SKIPPED: no driver (%s)\n", dfa_last_error());
    return 77;
  }
  g_cuda = std::string(driver) == "cuda";
  k_seg = 16 * g;
  if (argc > 2 && std::string(argv[1]) == "race") {  // (h) alone, N times: a hang's reproduction
    const int n = std::atoi(argv[2]);
    for (int i = 0; i < n; ++i)
      if (racing_pauses(api) != 0) return 1;
    std::printf("preload_arena_probe: (h) %d times, no allocation starved\n", n);
    return 0;
  }
  if (cycle(api, "tms.discard/weights", DFA_KEEP_DISCARD) != 0) return 1;
  if (cycle(api, "tms.host/weights", DFA_KEEP_HOST) != 0) return 1;
  if (interleaved(api) != 0) return 1;
  if (live_bytes_only(api) != 0) return 1;
  if (random_interleaving(api) != 0) return 1;
  if (large_segments(api) != 0) return 1;
  if (racing_pauses(api) != 0) return 1;
  if (racing_frees(api) != 0) return 1;
  if (outside_arena() != 0) return 1;
  std::printf("preload_arena_probe: arenas pass\n");
  return 0;
}
