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

namespace {

// Our allocations: base address -> reservation.  Never destroyed, like the C ABI's
// instance (Note [Process lifetime] in process_state.cpp): a cudaFree from a static destructor
// that runs after ours would otherwise find the map gone.
std::mutex& g_mu = *new std::mutex;
std::unordered_map<void*, dfa_reservation>& g_ours = *new std::unordered_map<void*, dfa_reservation>;

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
    return real().cuda_malloc(ptr, size);
  }
  if (size == 0) {
    *ptr = nullptr;
    return cudaSuccess;
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
  *ptr = addr;
  return cudaSuccess;
}

__attribute__((visibility("default"))) cudaError_t cudaFree(void* ptr) {
  dfa_reservation r = 0;
  bool ours = false;
  if (ptr != nullptr) {
    std::lock_guard lk(g_mu);
    auto it = g_ours.find(ptr);
    if (it != g_ours.end()) {
      r = it->second;
      ours = true;
    }
  }
  if (!ours) {
    // An interior pointer of one of ours is an error, as it is for the runtime.
    if (ptr != nullptr && state().enabled && dfa_find(ptr, &r) == DFA_SUCCESS) return cudaErrorInvalidValue;
    if (real().cuda_free == nullptr) return ptr == nullptr ? cudaSuccess : cudaErrorInvalidValue;
    return real().cuda_free(ptr);
  }
  if (!state().host && real().device_synchronize != nullptr) {
    const cudaError_t e = real().device_synchronize();
    if (e != cudaSuccess) return e;
  }
  const dfa_status st = dfa_free_reservation(r, nullptr);
  if (st == DFA_SUCCESS) {
    std::lock_guard lk(g_mu);
    g_ours.erase(ptr);
  }
  return to_cuda_error(st);
}

}  // extern "C"
