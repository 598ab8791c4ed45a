// The optimizer's value enums, shared by its C++ API (optimizer.hpp) and its kernels
// (optimizer/kernels, which the CUDA compiler builds as C++17): the element types of
// parameters and gradients, the moments' storage formats and the state arrays.
#pragma once

namespace deferalloc::optim {

/// Element type of model parameters and gradients.
enum class value_type : int { bf16 = 0, fp32 = 1, fp16 = 2 };
using grad_type = value_type;

/// How the Adam moments are stored at home and moved (host and file tiers).  The
/// arithmetic stays FP32 inside the window; main params are always FP32.  See
/// Note [Moment formats] in optimizer/kernels/moment_format.hpp.
enum class moment_format : int {
  fp32 = 0,  ///< 4 B per moment (12 B/param with the main param), exact torch AdamW
  bf16 = 1,  ///< 2 B per moment (8 B/param), round to nearest even after each step
  int8 = 2,  ///< 1 B per moment + an FP32 scale per 64 (6.125 B/param), block-scaled 8-bit floats
};

/// Which state array of a shard.
enum class state_array : int { main = 0, exp_avg = 1, exp_avg_sq = 2 };

}  // namespace deferalloc::optim
