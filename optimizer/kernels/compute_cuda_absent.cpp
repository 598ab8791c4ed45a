// Built instead of compute_cuda.cu when DEFERALLOC_WITH_CUDA_KERNELS is OFF.
#include <deferalloc/core/errors.hpp>

#include "compute.hpp"

namespace deferalloc::optim::detail {
std::unique_ptr<compute> make_cuda_compute(int) {
  throw no_device("deferalloc was built without its CUDA kernels (DEFERALLOC_WITH_CUDA_KERNELS=OFF)");
}
}  // namespace deferalloc::optim::detail
