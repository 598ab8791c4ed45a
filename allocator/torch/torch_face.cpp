// The LibTorch face: deferred tensors and install().  See include/deferalloc/torch/torch.hpp.
//
// Approach: everything goes through the C ABI, so C++ and Python (ctypes) share the one
// process-wide instance.  A deferred tensor is at::for_blob over the reservation's
// address with a deleter that frees the reservation; install() builds PyTorch's
// CUDAPluggableAllocator on dfa_malloc/dfa_free, sets the hooks and swaps it in after
// checking that the native allocator has not been initialized (PyTorch's own check would
// only say "Can't swap an already initialized allocator").
#include <deferalloc/core/errors.hpp>
#include <deferalloc/deferalloc.h>
#include <deferalloc/torch/torch.hpp>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <atomic>
#include <string>
#include <vector>

namespace deferalloc::torch {
namespace {

std::atomic<bool> g_installed{false};

void check(dfa_status st) {
  if (st == DFA_SUCCESS) return;
  throw_status(st, dfa_last_error());  // the one mapping (errors.hpp)
}

bool host_driver() {
  const char* name = nullptr;
  check(dfa_driver_name(&name));
  return std::string(name) == "host";
}

dfa_reservation reservation_of(const at::Tensor& t) {
  DFA_EXPECTS(t.defined(), "the tensor is undefined");
  dfa_reservation r = 0;
  const void* p = t.storage().data_ptr().get();
  if (p == nullptr || dfa_find(p, &r) != DFA_SUCCESS)
    throw invalid_argument("the tensor's storage is not a deferalloc reservation (make it with deferred_empty)");
  return r;
}

void* stream_of(const at::Tensor& t) {
  if (!t.is_cuda()) return nullptr;
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

}  // namespace

at::Tensor deferred_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const bool host = host_driver();
  c10::Device device = options.device();
  if (host) {
    DFA_EXPECTS(device.is_cpu(), "deferred_empty: the host driver serves CPU tensors, not " + device.str());
  } else {
    DFA_EXPECTS(device.is_cuda(), "deferred_empty: the CUDA driver serves CUDA tensors, not " + device.str() +
                                      " (pass at::TensorOptions().device(at::kCUDA))");
    if (!device.has_index()) device = c10::Device(c10::kCUDA, c10::cuda::current_device());
  }
  std::size_t numel = 1;
  for (auto s : sizes) {
    DFA_EXPECTS(s >= 0, "deferred_empty: negative size in the shape");
    numel *= static_cast<std::size_t>(s);
  }
  const std::size_t bytes = std::max<std::size_t>(1, numel * c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
  dfa_reservation r = 0;
  void* addr = nullptr;
  check(dfa_reserve(bytes, &r, &addr));
  try {
    return at::for_blob(addr, sizes)
        .deleter([r](void* p) {
          dfa_reservation found = 0;
          // Free only if the instance still knows this reservation at this address.
          if (dfa_find(p, &found) == DFA_SUCCESS && found == r) dfa_free_reservation(r, nullptr);
        })
        .options(options.device(device))
        .target_device(device)
        .make_tensor();
  } catch (...) {
    dfa_free_reservation(r, nullptr);
    throw;
  }
}

void materialize(const at::Tensor& t, fill_mode fill) {
  check(dfa_materialize(reservation_of(t), 0, DFA_WHOLE, static_cast<dfa_fill>(fill), stream_of(t)));
}

void release(const at::Tensor& t, keep_mode keep) {
  check(dfa_release(reservation_of(t), 0, DFA_WHOLE, static_cast<dfa_keep>(keep), stream_of(t)));
}

bool is_backed(const at::Tensor& t) {
  int out = 0;
  check(dfa_is_backed(reservation_of(t), 0, DFA_WHOLE, &out));
  return out != 0;
}

void install() {
  if (g_installed.load()) throw invalid_state("deferalloc::torch::install(): deferalloc is already installed");
  auto* current = c10::cuda::CUDACachingAllocator::get();
  if (current != nullptr && current->initialized())
    throw invalid_state("deferalloc::torch::install(): PyTorch's CUDA allocator (" + current->name() +
                        ") is already initialized, so it cannot be replaced: call install() first thing in main(), "
                        "before any CUDA tensor is made (or use the LD_PRELOAD library, which needs no code change)");
  auto alloc = ::torch::cuda::CUDAPluggableAllocator::createCustomAllocator(&dfa_malloc, &dfa_free);
  auto* pluggable = dynamic_cast<::torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator*>(alloc.get());
  if (pluggable == nullptr) throw error("deferalloc::torch::install(): PyTorch returned an unexpected allocator type");
  pluggable->set_init_fn(&dfa_init_hook);
  pluggable->set_reset_fn(&dfa_empty_cache_hook);
  pluggable->set_memory_fraction_fn(&dfa_memory_fraction_hook);
  pluggable->set_base_alloc_fn(&dfa_base_alloc_hook);
  pluggable->set_record_stream_fn([](void* ptr, cudaStream_t s) { dfa_record_stream_hook(ptr, s); });
  try {
    ::torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(alloc);
  } catch (const std::exception& e) {
    throw invalid_state(std::string("deferalloc::torch::install(): PyTorch refused the swap: ") + e.what());
  }
  g_installed.store(true);
}

bool installed() noexcept { return g_installed.load(); }

std::map<std::string, std::int64_t> memory_stats(int device) {
  std::size_t needed = 0;
  check(dfa_memory_stats(device, nullptr, 0, &needed));
  std::string buf(needed + 4096, '\0');
  check(dfa_memory_stats(device, buf.data(), buf.size(), &needed));
  std::map<std::string, std::int64_t> out;
  std::size_t pos = 0;
  while (pos < buf.size() && buf[pos] != '\0') {
    const std::size_t nl = buf.find('\n', pos);
    const std::string line = buf.substr(pos, nl - pos);
    const std::size_t sp = line.rfind(' ');
    out[line.substr(0, sp)] = std::stoll(line.substr(sp + 1));
    pos = nl + 1;
  }
  return out;
}

}  // namespace deferalloc::torch
