// CUDA kernels of the compressed-moment step: AdamW with BF16 or block-scaled 8-bit
// moments, decoded to FP32 in registers and encoded again before the write-back (no
// FP32 moment in HBM).  The element arithmetic is moment_format.hpp's and
// adamw_math.hpp's, so the results equal the CPU twin (moments_cpu.cpp) bit for bit.
// See Note [Moment formats].
//
// The step is bound by PCIe, not HBM (6-8 B/param over the link against ~20 B/param
// of HBM traffic here), so the kernels use plain coalesced scalar accesses: one thread
// per element (BF16), one warp per k_qblock-element block (int8: lane l takes elements
// l, l+32, ..., and the block's new scales are warp-shuffle maxima, exact and
// independent of order).
#include <cuda_runtime.h>
#include <deferalloc/core/errors.hpp>

#include <algorithm>
#include <string>

#include "moment_format.hpp"

namespace deferalloc::optim::detail {
namespace {

constexpr int k_threads = 256;
constexpr int k_warps = k_threads / 32;
constexpr int k_per_lane = static_cast<int>(k_qblock) / 32;

__global__ void adamw_bf16_moments(adamw_qpiece p, adamw_scalars k) {
  auto* M = static_cast<std::uint16_t*>(p.exp_avg);
  auto* V = static_cast<std::uint16_t*>(p.exp_avg_sq);
  for (std::size_t j = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; j < p.n; j += std::size_t(gridDim.x) * blockDim.x) {
    float x = p.param[j];
    std::uint16_t mb = M[j], vb = V[j];
    bf16_update(x, mb, vb, load_as_float(p.grad, p.grad_type, j), k, p.e0 + j);
    p.param[j] = x;
    M[j] = mb;
    V[j] = vb;
    store_from_float(p.model, p.model_type, j, x);
  }
}

__device__ __forceinline__ float warp_nan_max(float x) {
  for (int o = 16; o > 0; o /= 2) x = nan_max(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  return x;
}

__global__ void adamw_int8_moments(adamw_qpiece p, adamw_scalars k) {
  auto* MC = static_cast<std::uint8_t*>(p.exp_avg);
  auto* VC = static_cast<std::uint8_t*>(p.exp_avg_sq);
  auto* MS = reinterpret_cast<float*>(MC + q_scales_offset(p.n));
  auto* VS = reinterpret_cast<float*>(VC + q_scales_offset(p.n));
  const int lane = threadIdx.x % 32;
  const std::size_t nb = q_blocks(p.n);
  for (std::size_t b = blockIdx.x * std::size_t(k_warps) + threadIdx.x / 32; b < nb; b += std::size_t(gridDim.x) * k_warps) {
    const float sm = MS[b], sv = VS[b];
    float m[k_per_lane], w[k_per_lane];
    float am = 0.0f, aw = 0.0f;
#pragma unroll
    for (int t = 0; t < k_per_lane; ++t) {
      const std::size_t j = b * k_qblock + lane + 32 * t;
      m[t] = 0.0f, w[t] = 0.0f;
      if (j < p.n) {
        float x = p.param[j];
        q_update(x, m[t], w[t], MC[j], VC[j], sm, sv, load_as_float(p.grad, p.grad_type, j), k);
        p.param[j] = x;
        store_from_float(p.model, p.model_type, j, x);
      }
      am = nan_max(am, f_abs(m[t]));
      aw = nan_max(aw, w[t]);
    }
    am = canonical_scale(warp_nan_max(am));
    aw = canonical_scale(warp_nan_max(aw));
    __syncwarp();  // every lane has read the old scales
#pragma unroll
    for (int t = 0; t < k_per_lane; ++t) {
      const std::size_t j = b * k_qblock + lane + 32 * t;
      if (j < p.n) {
        MC[j] = encode_m(m[t], am);
        VC[j] = encode_w_step(w[t], aw, k, p.e0 + j);
      }
    }
    if (lane == 0) MS[b] = am, VS[b] = aw;
  }
}

}  // namespace

void cuda_adamw_moments(const adamw_qpiece& p, const adamw_scalars& k, void* stream, int device, int sms) {
  if (p.n == 0) return;
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) throw cuda_error(std::string("cudaSetDevice: ") + cudaGetErrorString(e));
  auto st = static_cast<cudaStream_t>(stream);
  const std::size_t work = p.format == moment_format::bf16 ? (p.n + k_threads - 1) / k_threads : (q_blocks(p.n) + k_warps - 1) / k_warps;
  const int blocks = static_cast<int>(std::min<std::size_t>(work, std::size_t(sms) * 16));
  if (p.format == moment_format::bf16) adamw_bf16_moments<<<blocks, k_threads, 0, st>>>(p, k);
  else adamw_int8_moments<<<blocks, k_threads, 0, st>>>(p, k);
  e = cudaGetLastError();
  if (e != cudaSuccess) throw cuda_error(std::string("adamw (compressed moments) launch: ") + cudaGetErrorString(e));
}

}  // namespace deferalloc::optim::detail
