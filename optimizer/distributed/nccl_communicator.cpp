// nccl_communicator: the distributed optimizer's collectives on NCCL, resolved at run time.
//
// Approach: dlopen("libnccl.so.2") once per process, as cuda_driver opens libcuda: the
// library has no link-time NCCL dependency and loads where NCCL is absent (CI); there
// make_nccl_communicator throws no_device with the reason.  Search order: the file in
// DEFERALLOC_NCCL_LIB, the default search path (in a LibTorch process this finds the
// NCCL that libtorch_cuda already loaded: the same library, one copy), then the
// directory where CMake found NCCL (DFA_NCCL_LIB_DIR, e.g. the nvidia-nccl-cu13 wheel).
// nccl.h is used for types only.
//
// NVLink multicast (NVLS) is never used: NCCL_NVLS_ENABLE=0 is set in the process before
// the first communicator when the user has not set it.
//
// Every NCCL return code is checked; a failure throws cuda_error naming the call, NCCL's
// error string and its last-error text.  Destruction never throws (logged).
#include <deferalloc/core/errors.hpp>
#include <deferalloc/distributed/distributed.hpp>

#include <dlfcn.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "log.hpp"

#ifndef DFA_NCCL_LIB_DIR
#define DFA_NCCL_LIB_DIR ""
#endif

namespace deferalloc::dist {
namespace {

struct nccl_api {
  void* lib = nullptr;
  std::string load_error;
#define DFA_NCCL_FN(name) decltype(&::name) name = nullptr;
  DFA_NCCL_FN(ncclGetVersion)
  DFA_NCCL_FN(ncclGetUniqueId)
  DFA_NCCL_FN(ncclCommInitRank)
  DFA_NCCL_FN(ncclCommDestroy)
  DFA_NCCL_FN(ncclCommGetAsyncError)
  DFA_NCCL_FN(ncclGetErrorString)
  DFA_NCCL_FN(ncclGetLastError)
  DFA_NCCL_FN(ncclReduceScatter)
  DFA_NCCL_FN(ncclAllGather)
  DFA_NCCL_FN(ncclCommRegister)
  DFA_NCCL_FN(ncclCommDeregister)
#undef DFA_NCCL_FN
};

const nccl_api& api() {
  static nccl_api a = [] {
    nccl_api r;
    std::string tried;
    auto try_open = [&](const std::string& path) {
      if (r.lib || path.empty()) return;
      r.lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!r.lib) {
        const char* e = ::dlerror();
        tried += "\n  " + path + ": " + (e ? e : "not found");
      }
    };
    if (const char* env = std::getenv("DEFERALLOC_NCCL_LIB")) try_open(env);
    try_open("libnccl.so.2");
    if (std::strlen(DFA_NCCL_LIB_DIR) > 0) try_open(std::string(DFA_NCCL_LIB_DIR) + "/libnccl.so.2");
    if (!r.lib) {
      r.load_error = "NCCL is not available (set DEFERALLOC_NCCL_LIB to libnccl.so.2); tried:" + tried;
      return r;
    }
    bool ok = true;
    auto get = [&](const char* name, auto& fn) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(r.lib, name));
      if (!fn) {
        ok = false;
        r.load_error += std::string(r.load_error.empty() ? "" : ", ") + name;
      }
    };
    get("ncclGetVersion", r.ncclGetVersion);
    get("ncclGetUniqueId", r.ncclGetUniqueId);
    get("ncclCommInitRank", r.ncclCommInitRank);
    get("ncclCommDestroy", r.ncclCommDestroy);
    get("ncclCommGetAsyncError", r.ncclCommGetAsyncError);
    get("ncclGetErrorString", r.ncclGetErrorString);
    get("ncclGetLastError", r.ncclGetLastError);
    get("ncclReduceScatter", r.ncclReduceScatter);
    get("ncclAllGather", r.ncclAllGather);
    get("ncclCommRegister", r.ncclCommRegister);
    get("ncclCommDeregister", r.ncclCommDeregister);
    if (!ok) {
      r.load_error = "libnccl.so.2 lacks " + r.load_error + " (NCCL 2.19 or newer is needed)";
      ::dlclose(r.lib);
      r.lib = nullptr;
    }
    return r;
  }();
  return a;
}

const nccl_api& loaded() {
  const auto& a = api();
  if (!a.lib) throw no_device(a.load_error);
  return a;
}

void check(ncclResult_t rc, const char* call, ncclComm_t comm = nullptr) {
  if (rc == ncclSuccess) return;
  const auto& a = api();
  std::string msg = std::string(call) + " failed: " + a.ncclGetErrorString(rc);
  if (comm) {
    const char* last = a.ncclGetLastError(comm);
    if (last && *last) msg += std::string(" (") + last + ")";
  }
  throw cuda_error(msg);
}

ncclDataType_t to_nccl(dtype t) {
  switch (t) {
    case dtype::bf16: return ncclBfloat16;
    case dtype::fp32: return ncclFloat32;
    case dtype::fp64: return ncclFloat64;
  }
  throw invalid_argument("nccl: unknown dtype");
}

class nccl_communicator final : public communicator {
 public:
  nccl_communicator(std::shared_ptr<driver> drv, const unique_id& id, int world, int rank)
      : drv_(std::move(drv)), world_(world), rank_(rank) {
    const auto& a = loaded();
    // The driver makes its device's primary context current on this thread, which is
    // the device ncclCommInitRank takes (as cudaSetDevice would).
    drv_->get_memory_info();
    ::setenv("NCCL_NVLS_ENABLE", "0", 0);
    ncclUniqueId nid;
    static_assert(sizeof(nid) == sizeof(unique_id));
    std::memcpy(&nid, id.data(), sizeof(nid));
    check(a.ncclCommInitRank(&comm_, world, nid, rank),
          ("ncclCommInitRank(world " + std::to_string(world) + ", rank " + std::to_string(rank) + ")").c_str());
  }
  ~nccl_communicator() override {
    if (!comm_) return;
    const ncclResult_t rc = api().ncclCommDestroy(comm_);
    if (rc != ncclSuccess)
      deferalloc::detail::log(log_level::error, std::string("ncclCommDestroy failed: ") + api().ncclGetErrorString(rc));
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  void reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, stream_t s) override {
    check(api().ncclReduceScatter(send, recv, count, to_nccl(t), ncclSum, comm_, static_cast<cudaStream_t>(s.get())),
          "ncclReduceScatter", comm_);
  }
  void all_gather(const void* send, void* recv, std::size_t count, dtype t, stream_t s) override {
    check(api().ncclAllGather(send, recv, count, to_nccl(t), comm_, static_cast<cudaStream_t>(s.get())), "ncclAllGather",
          comm_);
  }
  void* register_buffer(void* ptr, std::size_t bytes) override {
    DFA_EXPECTS(ptr != nullptr && bytes > 0, "nccl register_buffer: null or empty buffer");
    void* h = nullptr;
    check(api().ncclCommRegister(comm_, ptr, bytes, &h), "ncclCommRegister", comm_);
    return h;
  }
  void deregister_buffer(void* handle) override {
    if (!handle) return;
    check(api().ncclCommDeregister(comm_, handle), "ncclCommDeregister", comm_);
  }
  std::string name() const override { return "nccl"; }

 private:
  std::shared_ptr<driver> drv_;
  int world_, rank_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

bool nccl_available() noexcept {
  try {
    return api().lib != nullptr;
  } catch (...) {
    return false;
  }
}

int nccl_version() {
  int v = 0;
  check(loaded().ncclGetVersion(&v), "ncclGetVersion");
  return v;
}

unique_id nccl_unique_id() {
  ncclUniqueId nid;
  check(loaded().ncclGetUniqueId(&nid), "ncclGetUniqueId");
  unique_id id{};
  std::memcpy(id.data(), &nid, sizeof(nid));
  return id;
}

std::shared_ptr<communicator> make_nccl_communicator(std::shared_ptr<driver> drv, const unique_id& id, int world,
                                                     int rank) {
  DFA_EXPECTS(drv != nullptr, "make_nccl_communicator: driver is null");
  DFA_EXPECTS(drv->asynchronous(), "make_nccl_communicator: NCCL needs the CUDA driver, not '" + drv->name() + "'");
  DFA_EXPECTS(world >= 1 && rank >= 0 && rank < world,
              "make_nccl_communicator: rank " + std::to_string(rank) + " of world " + std::to_string(world));
  return std::make_shared<nccl_communicator>(std::move(drv), id, world, rank);
}

}  // namespace deferalloc::dist
