// The AdamW arithmetic of one element, shared word for word by the CUDA kernel and
// its CPU twin.  Every operation is an explicitly rounded IEEE single-precision
// operation (__fmul_rn & co. on the device; plain operators on the host, where the
// build does not contract to FMA), so the GPU and the CPU give bit-identical results.
// The formula is PyTorch's fused AdamW (decoupled weight decay, bias correction):
//   g = grad * grad_scale
//   p = p - (lr * wd) * p
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DFA_HD __host__ __device__ __forceinline__
#else
#define DFA_HD inline
#endif

namespace deferalloc::optim::detail {

/// Scalars of one step, computed once on the host.
struct adamw_scalars {
  float lr_wd;            // lr * weight_decay
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;        // lr / (1 - beta1^t)
  float bc2_sqrt;         // sqrt(1 - beta2^t)
  float eps;
  float grad_scale;
};

DFA_HD float f_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DFA_HD float f_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DFA_HD float f_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
DFA_HD float f_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
DFA_HD float f_sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

/// float -> bfloat16, round to nearest even (NaN stays NaN).
DFA_HD std::uint16_t to_bf16(float f) {
  std::uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(f);
#else
  std::memcpy(&u, &f, 4);
#endif
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
DFA_HD float from_bf16(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

/// Element i of a gradient array, BF16 or FP32.
DFA_HD float load_grad(const void* g, bool bf16, std::size_t i) {
  return bf16 ? from_bf16(static_cast<const std::uint16_t*>(g)[i]) : static_cast<const float*>(g)[i];
}

/// One element: updates p, m, v in place and returns the new BF16 parameter.
DFA_HD std::uint16_t adamw_element(float& p, float& m, float& v, float grad, const adamw_scalars& s) {
  const float g = f_mul(grad, s.grad_scale);
  float pp = f_sub(p, f_mul(s.lr_wd, p));
  const float mm = f_add(f_mul(s.beta1, m), f_mul(s.one_minus_beta1, g));
  const float vv = f_add(f_mul(s.beta2, v), f_mul(f_mul(s.one_minus_beta2, g), g));
  const float denom = f_add(f_div(f_sqrt(vv), s.bc2_sqrt), s.eps);
  pp = f_sub(pp, f_div(f_mul(s.step_size, mm), denom));
  p = pp;
  m = mm;
  v = vv;
  return to_bf16(pp);
}

/// Arguments of one piece: n elements of FP32 state, the gradient and the BF16 output.
struct adamw_piece {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  std::uint16_t* model_bf16;
  const void* grad;
  bool grad_is_bf16;
  std::size_t n;
};

}  // namespace deferalloc::optim::detail
