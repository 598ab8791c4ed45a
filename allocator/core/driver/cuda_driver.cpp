// cuda_driver: the VMM primitives on a CUDA device, with libcuda resolved at run time.
//
// Approach: dlopen("libcuda.so.1") once per process and resolve every entry point
// through cuGetProcAddress (the versioned lookup the runtime uses), so the library
// has no link-time dependency on libcuda and loads on machines without a driver;
// there the first cuda_driver construction throws no_device with the reason.
// Every thread that calls in makes the device's primary context current (the one
// the CUDA runtime and PyTorch use), so pointers and streams are shared with them.
//
// Chunks are pinned device memory (CU_MEM_ALLOCATION_TYPE_PINNED) on this device;
// access is read/write for this device only.
//
// Chunks carry a POSIX fd handle type where the device supports it (Note [Shareable
// chunks], setting shareable_handles), so NCCL can register them for other processes.
//
// Limits: one device per driver object; peer access not set (a chunk is mapped by
// this device only; peers import it through NCCL).
#include <deferalloc/core/driver.hpp>
#include <deferalloc/core/errors.hpp>

#include "log.hpp"

#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <string>

namespace deferalloc {
namespace {

// Note [CUDA entry points]
// Every libcuda function the driver calls, listed once: the X-macro declares the
// members of cu_api and resolves each through cuGetProcAddress.
#define DFA_CU_ENTRY_POINTS(X) \
  X(cuInit) \
  X(cuGetErrorName) \
  X(cuGetErrorString) \
  X(cuDeviceGet) \
  X(cuDeviceGetCount) \
  X(cuDeviceGetAttribute) \
  X(cuDevicePrimaryCtxRetain) \
  X(cuDevicePrimaryCtxRelease) \
  X(cuCtxSetCurrent) \
  X(cuCtxGetCurrent) \
  X(cuMemAddressReserve) \
  X(cuMemAddressFree) \
  X(cuMemCreate) \
  X(cuMemRelease) \
  X(cuMemMap) \
  X(cuMemUnmap) \
  X(cuMemSetAccess) \
  X(cuMemGetAllocationGranularity) \
  X(cuMemGetInfo) \
  X(cuMemHostAlloc) \
  X(cuMemFreeHost) \
  X(cuStreamCreate) \
  X(cuStreamCreateWithPriority) \
  X(cuCtxGetStreamPriorityRange) \
  X(cuStreamDestroy) \
  X(cuStreamSynchronize) \
  X(cuStreamWaitEvent) \
  X(cuEventCreate) \
  X(cuEventDestroy) \
  X(cuEventRecord) \
  X(cuEventSynchronize) \
  X(cuEventQuery) \
  X(cuMemcpyAsync) \
  X(cuMemsetD8Async)

struct cu_api {
  void* lib = nullptr;
  std::string load_error;
#define DFA_CU_DECLARE(name) decltype(&::name) name = nullptr;
  DFA_CU_ENTRY_POINTS(DFA_CU_DECLARE)
#undef DFA_CU_DECLARE
};

using get_proc_fn = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

const cu_api& api() {
  static const cu_api a = [] {
    cu_api r;
    r.lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (r.lib == nullptr) {
      const char* e = ::dlerror();
      r.load_error = std::string("libcuda.so.1 could not be loaded (no NVIDIA driver on this machine?): ") + (e ? e : "");
      return r;
    }
    auto gpa = reinterpret_cast<get_proc_fn>(::dlsym(r.lib, "cuGetProcAddress_v2"));
    if (gpa == nullptr) {
      r.load_error = "libcuda.so.1 has no cuGetProcAddress_v2: the driver is older than CUDA 12.5";
      return r;
    }
    auto get = [&](const char* name, auto& fn) {
      void* p = nullptr;
      CUdriverProcAddressQueryResult status{};
      if (gpa(name, &p, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS || p == nullptr) {
        if (r.load_error.empty()) r.load_error = std::string("libcuda.so.1 lacks ") + name;
        return;
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
#define DFA_CU_LOAD(name) get(#name, r.name);
    DFA_CU_ENTRY_POINTS(DFA_CU_LOAD)
#undef DFA_CU_LOAD
    if (r.load_error.empty()) {
      CUresult rc = r.cuInit(0);
      if (rc != CUDA_SUCCESS) {
        const char* n = nullptr;
        r.cuGetErrorName(rc, &n);
        r.load_error = std::string("cuInit failed: ") + (n ? n : "unknown error") + " (no usable CUDA device?)";
      }
    }
    return r;
  }();
  return a;
}

std::string describe(CUresult rc) {
  const char* n = nullptr;
  const char* s = nullptr;
  if (api().cuGetErrorName) api().cuGetErrorName(rc, &n);
  if (api().cuGetErrorString) api().cuGetErrorString(rc, &s);
  return std::string(n ? n : "CUDA_ERROR") + " (" + (s ? s : "unknown") + ")";
}

// DFA_CU_TRY: a failed driver call throws cuda_error naming the call and the cause.
// DFA_CU_TRY_ALLOC: the same, but CUDA_ERROR_OUT_OF_MEMORY becomes out_of_memory.
#define DFA_CU_TRY(call)                                                              \
  do {                                                                                \
    CUresult dfa_rc_ = (call);                                                        \
    if (dfa_rc_ != CUDA_SUCCESS) throw cuda_error(std::string(#call) + ": " + describe(dfa_rc_)); \
  } while (0)
#define DFA_CU_TRY_ALLOC(call)                                                        \
  do {                                                                                \
    CUresult dfa_rc_ = (call);                                                        \
    if (dfa_rc_ == CUDA_ERROR_OUT_OF_MEMORY) throw out_of_memory(std::string(#call) + ": " + describe(dfa_rc_)); \
    if (dfa_rc_ != CUDA_SUCCESS) throw cuda_error(std::string(#call) + ": " + describe(dfa_rc_)); \
  } while (0)

class cuda_driver final : public driver {
 public:
  cuda_driver(int ordinal, shareable_handle share) : ordinal_(ordinal) {
    const cu_api& a = api();
    if (!a.load_error.empty()) throw no_device("cuda_driver: " + a.load_error);
    int n = 0;
    DFA_CU_TRY(a.cuDeviceGetCount(&n));
    if (ordinal < 0 || ordinal >= n)
      throw no_device("cuda_driver: device " + std::to_string(ordinal) + " does not exist (" + std::to_string(n) + " present)");
    DFA_CU_TRY(a.cuDeviceGet(&dev_, ordinal));
    DFA_CU_TRY(a.cuDevicePrimaryCtxRetain(&ctx_, dev_));
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = ordinal;
    // Note [Shareable chunks]: NCCL registers a cuMem buffer for peers of other processes
    // by exporting its allocation handle (cuMemExportToShareableHandle, a POSIX file
    // descriptor); a chunk created without that handle type cannot be exported and NCCL
    // runs the collective unregistered (copies through its own buffers).  So chunks ask for
    // POSIX fd handles where the device supports them (as PyTorch's expandable segments
    // do); creation and mapping cost the same.  shareable_handles:none turns it off.
    int fd_ok = 0;
    if (share != shareable_handle::none &&
        a.cuDeviceGetAttribute(&fd_ok, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev_) != CUDA_SUCCESS)
      fd_ok = 0;
    if (share == shareable_handle::posix_fd && fd_ok == 0)
      throw invalid_argument("cuda_driver: shareable_handles:posix_fd, but device " + std::to_string(ordinal) +
                             " does not support POSIX file-descriptor handles");
    if (share != shareable_handle::none && fd_ok != 0) handle_type_ = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    share_ = share;
    CUmemAllocationProp with_handle = prop_;
    with_handle.requestedHandleTypes = handle_type_.load();
    DFA_CU_TRY(a.cuMemGetAllocationGranularity(&granularity_, &with_handle, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  ~cuda_driver() override {
    if (ctx_ != nullptr) api().cuDevicePrimaryCtxRelease(dev_);
  }

  std::string name() const override { return "cuda"; }
  driver_kind kind() const override { return driver_kind::cuda; }
  bool shareable() const override { return handle_type_.load() != CU_MEM_HANDLE_TYPE_NONE; }
  std::size_t granularity() const override { return granularity_; }
  int device() const override { return ordinal_; }
  memory_info get_memory_info() override {
    bind();
    memory_info m;
    DFA_CU_TRY(api().cuMemGetInfo(&m.free_bytes, &m.total_bytes));
    return m;
  }

  stream_t create_stream() override {
    bind();
    CUstream s = nullptr;
    DFA_CU_TRY(api().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    return stream_t{s};
  }
  stream_t create_priority_stream() override {
    bind();
    int least = 0, greatest = 0;
    DFA_CU_TRY(api().cuCtxGetStreamPriorityRange(&least, &greatest));
    CUstream s = nullptr;
    DFA_CU_TRY(api().cuStreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, greatest));
    return stream_t{s};
  }
  void destroy_stream(stream_t s) noexcept override {
    if (s != nullptr) api().cuStreamDestroy(static_cast<CUstream>(s.get()));
  }
  event_t create_event() override {
    bind();
    CUevent e = nullptr;
    DFA_CU_TRY(api().cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
    return event_t{e};
  }
  void destroy_event(event_t e) noexcept override {
    if (e != nullptr) api().cuEventDestroy(static_cast<CUevent>(e.get()));
  }
  void record(event_t e, stream_t s) override {
    bind();
    DFA_CU_TRY(api().cuEventRecord(static_cast<CUevent>(e.get()), static_cast<CUstream>(s.get())));
  }
  void stream_wait(stream_t s, event_t e) override {
    bind();
    DFA_CU_TRY(api().cuStreamWaitEvent(static_cast<CUstream>(s.get()), static_cast<CUevent>(e.get()), 0));
  }
  void synchronize(event_t e) override {
    bind();
    DFA_CU_TRY(api().cuEventSynchronize(static_cast<CUevent>(e.get())));
  }
  bool query(event_t e) override {
    bind();
    CUresult rc = api().cuEventQuery(static_cast<CUevent>(e.get()));
    if (rc == CUDA_ERROR_NOT_READY) return false;
    DFA_CU_TRY(rc);
    return true;
  }
  void synchronize_stream(stream_t s) override {
    bind();
    DFA_CU_TRY(api().cuStreamSynchronize(static_cast<CUstream>(s.get())));
  }
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_t s) override {
    bind();
    DFA_CU_TRY(api().cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), bytes,
                                   static_cast<CUstream>(s.get())));
  }
  void zero_async(void* dst, std::size_t bytes, stream_t s) override {
    bind();
    DFA_CU_TRY(api().cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(dst), 0, bytes, static_cast<CUstream>(s.get())));
  }
  bool asynchronous() const override { return true; }

 private:
  // Makes the device's primary context current on the calling thread when another
  // (or none) is: one cuCtxGetCurrent per call, a set only when it differs.
  void bind() {
    CUcontext current = nullptr;
    DFA_CU_TRY(api().cuCtxGetCurrent(&current));
    if (current != ctx_) DFA_CU_TRY(api().cuCtxSetCurrent(ctx_));
  }

  std::uintptr_t do_reserve(std::size_t bytes, std::size_t alignment) override {
    bind();
    CUdeviceptr p = 0;
    DFA_CU_TRY_ALLOC(api().cuMemAddressReserve(&p, bytes, alignment, 0, 0));
    return static_cast<std::uintptr_t>(p);
  }
  void do_free_reservation(std::uintptr_t va, std::size_t bytes) override {
    bind();
    DFA_CU_TRY(api().cuMemAddressFree(static_cast<CUdeviceptr>(va), bytes));
  }
  chunk_handle do_create(std::size_t bytes) override {
    bind();
    CUmemGenericAllocationHandle h = 0;
    // Pools on several threads create chunks through one driver: the handle type is the
    // one piece of the properties that can change (the fallback below), so it is atomic
    // and each call works on its own copy.
    CUmemAllocationProp prop = prop_;
    prop.requestedHandleTypes = handle_type_.load();
    CUresult rc = api().cuMemCreate(&h, bytes, &prop, 0);
    if (share_ == shareable_handle::automatic && prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE &&
        (rc == CUDA_ERROR_NOT_SUPPORTED || rc == CUDA_ERROR_NOT_PERMITTED || rc == CUDA_ERROR_INVALID_VALUE)) {
      // The attribute said yes but this environment refuses the handle type: plain chunks.
      detail::log(log_level::warn, "cuda_driver: cuMemCreate with POSIX fd handles failed (" + describe(rc) +
                                       "); chunks are created without a shareable handle (NCCL cannot register them)");
      handle_type_.store(CU_MEM_HANDLE_TYPE_NONE);
      prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
      rc = api().cuMemCreate(&h, bytes, &prop, 0);
    }
    DFA_CU_TRY_ALLOC(rc);
    return static_cast<chunk_handle>(h);
  }
  void do_release(chunk_handle h) override {
    bind();
    DFA_CU_TRY(api().cuMemRelease(static_cast<CUmemGenericAllocationHandle>(h)));
  }
  void do_map(std::uintptr_t va, std::size_t bytes, chunk_handle h) override {
    bind();
    DFA_CU_TRY_ALLOC(api().cuMemMap(static_cast<CUdeviceptr>(va), bytes, 0, static_cast<CUmemGenericAllocationHandle>(h), 0));
  }
  void do_unmap(std::uintptr_t va, std::size_t bytes) override {
    bind();
    DFA_CU_TRY(api().cuMemUnmap(static_cast<CUdeviceptr>(va), bytes));
  }
  void do_set_access(std::uintptr_t va, std::size_t bytes) override {
    bind();
    DFA_CU_TRY_ALLOC(api().cuMemSetAccess(static_cast<CUdeviceptr>(va), bytes, &access_, 1));
  }
  void* do_host_alloc(std::size_t bytes) override {
    bind();
    void* p = nullptr;
    DFA_CU_TRY_ALLOC(api().cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE));
    return p;
  }
  void do_host_free(void* p) noexcept override {
    if (p != nullptr) api().cuMemFreeHost(p);
  }

  int ordinal_;
  CUdevice dev_{};
  CUcontext ctx_ = nullptr;
  CUmemAllocationProp prop_{};
  shareable_handle share_ = shareable_handle::automatic;
  std::atomic<CUmemAllocationHandleType> handle_type_{CU_MEM_HANDLE_TYPE_NONE};  // Note [Shareable chunks]
  CUmemAccessDesc access_{};
  std::size_t granularity_ = 0;
};

}  // namespace

std::shared_ptr<driver> make_cuda_driver(int device, shareable_handle share) {
  return std::make_shared<cuda_driver>(device, share);
}

bool cuda_device_available() noexcept {
  try {
    const cu_api& a = api();
    if (!a.load_error.empty()) return false;
    int n = 0;
    return a.cuDeviceGetCount(&n) == CUDA_SUCCESS && n > 0;
  } catch (...) {
    return false;
  }
}

}  // namespace deferalloc
