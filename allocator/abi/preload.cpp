// libdeferalloc_preload.so: cudaMalloc / cudaFree of a whole process served from
// deferalloc's VMM pool, with no code change:
//   LD_PRELOAD=/path/libdeferalloc_preload.so DEFERALLOC_CONF=... python train.py
//
// Rationale: PyTorch's PyPI wheel links libcudart dynamically (libc10_cuda.so NEEDs
// libcudart.so.13 and calls cudaMalloc@libcudart.so.13 through its PLT), so a library
// preloaded ahead of it that defines cudaMalloc/cudaFree is what the dynamic linker binds
// those calls to (an unversioned definition satisfies a versioned reference).  PyTorch's
// native caching allocator stays on top: its statistics, snapshots and empty_cache keep
// working; only its segments (cudaMalloc) now come from reservations backed by pooled
// chunks, in the same pool as deferred tensors and tags.
//
// Approach: cudaMalloc = dfa_reserve + dfa_materialize of the whole range (chunks from
// the pool: no cuMemCreate when cached, large chunks for large segments); cudaFree of one
// of ours = the real cudaDeviceSynchronize (cudaFree's own implicit synchronisation) +
// dfa_free_reservation (the chunks go back to the pool; dfa_trim or the pool budget give
// them back to the device); any other pointer goes to the real cudaFree.  The real
// functions are found with dlsym(RTLD_NEXT).  Settings: DEFERALLOC_CONF (one process-wide
// instance, the C ABI's).  Allocations on a device other than the instance's go to the
// real cudaMalloc.
//
// Segments allocated while the thread has an arena current (dfa_preload_arena_push, what
// deferalloc.memory_saver's regions do) are placed in that arena's large slabs instead, so
// that a pause and a resume cost O(slabs) driver calls (Note [Preload arenas] in
// preload_arena.cpp); the arena entry points below are found by ctypes or dlsym.
//
// Limits: cudaMallocAsync / cudaFreeAsync are not interposed: their memory belongs to
// CUDA's stream-ordered pools, which PyTorch's cudaMallocAsync backend configures and
// measures through pool attributes (cudaMemPoolSetAttribute, cudaMemPoolTrimTo); serving
// them from our pool would break both.  So backend:cudaMallocAsync and
// expandable_segments:True in PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF (cuMemCreate/cuMemMap directly) bypass this library, and
// it says so at start.  Programs that link cudart statically are not interposed.
#include <deferalloc/core/config.hpp>
#include <deferalloc/core/errors.hpp>
#include <deferalloc/deferalloc.h>

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "preload_arena.hpp"

namespace {

// Our allocations: base address -> reservation.  Never destroyed, like the C ABI's
// instance (Note [Process lifetime] in process_state.cpp): a cudaFree from a static destructor
// that runs after ours would otherwise find the map gone.
std::mutex& g_mu = *new std::mutex;
std::unordered_map<void*, dfa_reservation>& g_ours = *new std::unordered_map<void*, dfa_reservation>;

// The arenas, and this thread's current one (empty: none; the top of a stack).
deferalloc::preload::arenas& g_arenas = *new deferalloc::preload::arenas;
thread_local std::vector<std::string> t_arena;

using malloc_fn = cudaError_t (*)(void**, size_t);
using free_fn = cudaError_t (*)(void*);
using sync_fn = cudaError_t (*)();
using get_device_fn = cudaError_t (*)(int*);

struct real_api {
  malloc_fn cuda_malloc = nullptr;
  free_fn cuda_free = nullptr;
  sync_fn device_synchronize = nullptr;
  get_device_fn get_device = nullptr;
};

const real_api& real() {
  static const real_api r = [] {
    real_api a;
    a.cuda_malloc = reinterpret_cast<malloc_fn>(::dlsym(RTLD_NEXT, "cudaMalloc"));
    a.cuda_free = reinterpret_cast<free_fn>(::dlsym(RTLD_NEXT, "cudaFree"));
    a.device_synchronize = reinterpret_cast<sync_fn>(::dlsym(RTLD_NEXT, "cudaDeviceSynchronize"));
    a.get_device = reinterpret_cast<get_device_fn>(::dlsym(RTLD_NEXT, "cudaGetDevice"));
    return a;
  }();
  return r;
}

struct preload_state {
  bool enabled = false;
  bool host = false;  // driver:host (tests): no device synchronisation
  int device = 0;
  std::string reason;  // why disabled
};

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// Says at start which PyTorch settings bypass cudaMalloc.  PyTorch reads its allocator
// settings from PYTORCH_ALLOC_CONF (the newer name) and PYTORCH_CUDA_ALLOC_CONF: both are
// looked at, and the message names the variable that holds the setting.
void warn_about_pytorch_conf() {
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    const char* env = std::getenv(name);
    if (env == nullptr) continue;
    std::string conf = lower(env);
    conf.erase(std::remove_if(conf.begin(), conf.end(), [](unsigned char c) { return std::isspace(c); }), conf.end());
    if (conf.find("expandable_segments:true") != std::string::npos)
      std::fprintf(stderr,
                   "[deferalloc preload] %s has expandable_segments:True: PyTorch then maps its "
                   "memory with cuMemCreate/cuMemMap itself and bypasses cudaMalloc, so deferalloc serves none of it. "
                   "Remove that setting to let deferalloc serve PyTorch's segments.\n", name);
    if (conf.find("backend:cudamallocasync") != std::string::npos)
      std::fprintf(stderr,
                   "[deferalloc preload] %s has backend:cudaMallocAsync: PyTorch then allocates "
                   "with cudaMallocAsync from CUDA's stream-ordered pools, which bypass cudaMalloc, so deferalloc "
                   "serves none of it. Remove that setting to let deferalloc serve PyTorch's segments.\n", name);
  }
}

// DEFERALLOC_CONF, parsed once (at load, or at a cudaMalloc that comes first); empty
// when invalid, which is said once.  (The instance parses it again when it is created.)
const std::optional<deferalloc::settings>& conf_settings() {
  static const std::optional<deferalloc::settings> s = []() -> std::optional<deferalloc::settings> {
    const char* conf = std::getenv("DEFERALLOC_CONF");
    try {
      return deferalloc::parse_settings(conf ? conf : "");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[deferalloc preload] DEFERALLOC_CONF is invalid, cudaMalloc is NOT interposed: %s\n",
                   e.what());
      return std::nullopt;
    }
  }();
  return s;
}

__attribute__((constructor)) void preload_start() {
  warn_about_pytorch_conf();
  conf_settings();
}

// The instance, created on the first cudaMalloc (from DEFERALLOC_CONF).
const preload_state& state() {
  static const preload_state s = [] {
    preload_state p;
    const char* name = nullptr;
    if (dfa_driver_name(&name) != DFA_SUCCESS) {
      p.reason = dfa_last_error();
      std::fprintf(stderr, "[deferalloc preload] disabled, cudaMalloc goes to the CUDA runtime: %s\n", p.reason.c_str());
      return p;
    }
    p.host = std::string(name) == "host";
    if (conf_settings()) p.device = conf_settings()->device;
    p.enabled = true;
    if (deferalloc::get_log_level() >= deferalloc::log_level::info)
      std::fprintf(stderr, "[deferalloc preload] serving cudaMalloc/cudaFree of device %d from the %s driver\n", p.device,
                   name);
    return p;
  }();
  return s;
}

cudaError_t to_cuda_error(dfa_status st) {
  switch (st) {
    case DFA_SUCCESS: return cudaSuccess;
    case DFA_ERROR_OUT_OF_MEMORY: return cudaErrorMemoryAllocation;
    case DFA_ERROR_INVALID_ARGUMENT: return cudaErrorInvalidValue;
    default: return cudaErrorUnknown;
  }
}

bool same_device(const preload_state& s) {
  if (s.host) return true;
  int dev = 0;
  if (real().get_device == nullptr || real().get_device(&dev) != cudaSuccess) return false;
  return dev == s.device;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  const preload_state& s = state();
  if (!s.enabled || !same_device(s)) {
    if (real().cuda_malloc == nullptr) return cudaErrorInitializationError;
    const cudaError_t e = real().cuda_malloc(ptr, size);
    // Not ours to pause: counted, so that a pause of the arena looks for it and refuses.
    if (e == cudaSuccess && !t_arena.empty() && !t_arena.back().empty()) g_arenas.note_stray(t_arena.back(), *ptr);
    return e;
  }
  if (size == 0) {
    *ptr = nullptr;
    return cudaSuccess;
  }
  const bool arena_current = !t_arena.empty() && !t_arena.back().empty();
  if (arena_current) {
    // A paused arena (or one paused while its new slab was backed), or a segment larger than a
    // block, falls through to a reservation of its own, counted as a stray below.
    const dfa_status st = g_arenas.allocate(t_arena.back(), size, ptr);
    if (st != DFA_ERROR_INVALID_STATE) return to_cuda_error(st);
  }
  dfa_reservation r = 0;
  void* addr = nullptr;
  dfa_status st = dfa_reserve(size, &r, &addr);
  if (st != DFA_SUCCESS) return to_cuda_error(st);
  st = dfa_materialize(r, 0, DFA_WHOLE, DFA_FILL_UNDEFINED, nullptr);
  if (st != DFA_SUCCESS) {
    dfa_free_reservation(r, nullptr);
    return to_cuda_error(st);
  }
  try {
    std::lock_guard lk(g_mu);
    g_ours.emplace(addr, r);
  } catch (...) {
    dfa_free_reservation(r, nullptr);
    return cudaErrorMemoryAllocation;
  }
  if (arena_current) g_arenas.note_stray(t_arena.back(), addr);  // the arena refused it (not under g_mu)
  *ptr = addr;
  return cudaSuccess;
}

__attribute__((visibility("default"))) cudaError_t cudaFree(void* ptr) {
  if (ptr != nullptr && g_arenas.owns(ptr)) {
    if (!state().host && real().device_synchronize != nullptr) {
      const cudaError_t e = real().device_synchronize();
      if (e != cudaSuccess) return e;
    }
    return to_cuda_error(g_arenas.free(ptr));
  }
  // The entries go before the memory does, and come back if it stays: once the memory is
  // freed, a concurrent cudaMalloc may get the same address and add its own entries.
  dfa_reservation r = 0;
  bool ours = false;
  if (ptr != nullptr) {
    std::lock_guard lk(g_mu);
    auto it = g_ours.find(ptr);
    if (it != g_ours.end()) {
      r = it->second;
      g_ours.erase(it);
      ours = true;
    }
  }
  if (!ours) {
    // An interior pointer of one of ours (or of an arena's block, which dfa_find refuses) is an
    // error, as it is for the runtime.
    if (ptr != nullptr && state().enabled && (g_arenas.contains(ptr) || dfa_find(ptr, &r) == DFA_SUCCESS))
      return cudaErrorInvalidValue;
    if (real().cuda_free == nullptr) return ptr == nullptr ? cudaSuccess : cudaErrorInvalidValue;
    const std::string stray = ptr != nullptr ? g_arenas.forget_stray(ptr) : std::string();  // one not served
    const cudaError_t e = real().cuda_free(ptr);
    if (e != cudaSuccess && !stray.empty()) g_arenas.note_stray(stray, ptr);
    return e;
  }
  const std::string stray = g_arenas.forget_stray(ptr);
  cudaError_t e = cudaSuccess;
  if (!state().host && real().device_synchronize != nullptr) e = real().device_synchronize();
  const dfa_status st = e == cudaSuccess ? dfa_free_reservation(r, nullptr) : DFA_SUCCESS;
  if (e != cudaSuccess || st != DFA_SUCCESS) {  // still allocated: its entries back
    if (!stray.empty()) g_arenas.note_stray(stray, ptr);
    try {
      std::lock_guard lk(g_mu);
      g_ours.emplace(ptr, r);
    } catch (...) {
      std::fprintf(stderr, "[deferalloc preload] out of memory: a segment at %p that cudaFree could not free is "
                   "no longer known as one of ours\n", ptr);
    }
  }
  return e != cudaSuccess ? e : to_cuda_error(st);
}

// The arenas (Note [Preload arenas]), for deferalloc.memory_saver and the tests.  They return
// a dfa_status; the C ABI's calls they make leave dfa_last_error set.

// Makes `name` this thread's current arena (NULL or "": none, until the matching pop).
// DFA_ERROR_INVALID_STATE, nothing pushed, for an arena where the library does not serve
// this thread's cudaMallocs (disabled, or the current device is not DEFERALLOC_CONF's): its
// segments would be the CUDA runtime's, which nothing can pause.  Cost: none (a
// cudaGetDevice).
__attribute__((visibility("default"))) int dfa_preload_arena_push(const char* name) {
  if (name != nullptr && name[0] != '\0' && (!state().enabled || !same_device(state())))
    return DFA_ERROR_INVALID_STATE;
  try {
    t_arena.emplace_back(name ? name : "");
    return DFA_SUCCESS;
  } catch (...) {
    return DFA_ERROR_OUT_OF_MEMORY;
  }
}

__attribute__((visibility("default"))) int dfa_preload_arena_pop(void) {
  if (t_arena.empty()) return DFA_ERROR_INVALID_STATE;
  t_arena.pop_back();
  return DFA_SUCCESS;
}

// Releases every slab of the arena (keep: dfa_keep) after `stream`'s work.  Cost: one
// dfa_release_many (dfa_release_many_keeping with DFA_KEEP_HOST): an unmap and a chunk
// release per slab; with DFA_KEEP_HOST one pinned copy per run of adjacent segments, the
// slabs' free ranges not copied.
__attribute__((visibility("default"))) int dfa_preload_arena_pause(const char* name, int keep, void* stream) {
  if (name == nullptr || (keep != DFA_KEEP_DISCARD && keep != DFA_KEEP_HOST)) return DFA_ERROR_INVALID_ARGUMENT;
  return g_arenas.pause(name, static_cast<dfa_keep>(keep), stream);
}

// Backs every slab of a paused arena again at its address, restored when paused with
// DFA_KEEP_HOST.  Cost: one dfa_materialize_whole_pieces per slab (one chunk of the slab's size where
// the device gives one, one map, one set_access).
__attribute__((visibility("default"))) int dfa_preload_arena_resume(const char* name, void* stream) {
  if (name == nullptr) return DFA_ERROR_INVALID_ARGUMENT;
  return g_arenas.resume(name, stream);
}

// 1 when `ptr` is a segment placed in an arena, else 0.
__attribute__((visibility("default"))) int dfa_preload_arena_owns(const void* ptr) {
  return ptr != nullptr && g_arenas.owns(ptr) ? 1 : 0;
}

// 1 when `ptr` lies in an arena's address space (inside a segment or not), else 0 (the C
// ABI's dfa_find refuses such a pointer: the blocks are hidden from it).  Cost: no lock while
// the process has at most 64 arena blocks (4 TiB of address space), else the arenas' mutex.
__attribute__((visibility("default"))) int dfa_preload_arena_contains(const void* ptr) {
  return ptr != nullptr && g_arenas.contains(ptr) ? 1 : 0;
}

// out[i] for each of the n pointers: 2 when it is a segment of arena `name`, 1 of another
// arena, 0 of none (memory_saver's check that an arena holds only its tag's pools' segments).
// Cost: one lock, n hash look-ups.
__attribute__((visibility("default"))) int dfa_preload_arena_classify(const char* name, const void* const* ptrs,
                                                                      size_t n, unsigned char* out) {
  if (name == nullptr || (n > 0 && (ptrs == nullptr || out == nullptr))) return DFA_ERROR_INVALID_ARGUMENT;
  g_arenas.classify(name, ptrs, n, out);
  return DFA_SUCCESS;
}

// The segments placed in arena `name`, by address: *n is set to their count, and ptrs[i],
// sizes[i] (the bytes placed, at least the cudaMalloc's) filled for i < min(*n, cap) (cap 0
// asks the count only).  memory_saver's disk kind writes these ranges to its file before the
// arena's pause and reads them back after its resume.  Cost: one lock, a pass over every
// arena's segments.
__attribute__((visibility("default"))) int dfa_preload_arena_segments(const char* name, void** ptrs, size_t* sizes,
                                                                      size_t cap, size_t* n) {
  if (name == nullptr || n == nullptr || (cap > 0 && (ptrs == nullptr || sizes == nullptr)))
    return DFA_ERROR_INVALID_ARGUMENT;
  try {
    const auto segs = g_arenas.segments(name);
    *n = segs.size();
    for (size_t i = 0; i < segs.size() && i < cap; ++i) {
      ptrs[i] = reinterpret_cast<void*>(segs[i].first);
      sizes[i] = segs[i].second;
    }
    return DFA_SUCCESS;
  } catch (...) {
    return DFA_ERROR_OUT_OF_MEMORY;
  }
}

// out[0..6]: slabs, their bytes, bytes of segments in them, segments, paused (0 / 1), strays:
// segments cudaMalloc'ed with the arena current but served outside it, not freed yet (the
// arena paused, a segment larger than a block, or a call the library does not serve), and the
// generation: segments placed in the arena and strays noted so far (memory_saver reads
// PyTorch's snapshot for the arena again only when it changed).  `out` holds 7 values.
__attribute__((visibility("default"))) int dfa_preload_arena_figures(const char* name, size_t* out) {
  if (name == nullptr || out == nullptr) return DFA_ERROR_INVALID_ARGUMENT;
  const deferalloc::preload::arena_figures f = g_arenas.figures(name);
  out[0] = f.slabs;
  out[1] = f.slab_bytes;
  out[2] = f.live_bytes;
  out[3] = f.segments;
  out[4] = static_cast<size_t>(f.paused);
  out[5] = f.strays;
  out[6] = static_cast<size_t>(f.generation);
  return DFA_SUCCESS;
}

}  // extern "C"
