// Built instead of compute_cuda.cu when DEFERALLOC_WITH_CUDA_KERNELS is OFF (no nvcc: a
// build without the CUDA toolkit, Note [Driver API without the toolkit]).
//
// An optimizer on a CUDA driver asks for the kernels when it is made: the log says once
// (a warning, for a process that goes on without the optimizer) that a GPU is there but
// the kernels are not, and the call fails naming the cause and the remedy.
#include <deferalloc/core/errors.hpp>

#include "compute.hpp"
#include "log.hpp"

#include <mutex>
#include <string>

namespace deferalloc::optim::detail {
std::unique_ptr<compute> make_cuda_compute(int device) {
  const std::string why =
      "deferalloc's optimizer was built without its CUDA kernels (no CUDA toolkit / nvcc at build time, "
      "DEFERALLOC_WITH_CUDA_KERNELS=OFF), so it cannot step on CUDA device " + std::to_string(device) +
      ": rebuild with the CUDA toolkit (nvcc on PATH), install the prebuilt wheel, or use driver:host for CPU tensors";
  static std::once_flag warned;
  std::call_once(warned, [&] { deferalloc::detail::log(log_level::warn, why); });
  throw no_device(why);
}
}  // namespace deferalloc::optim::detail
