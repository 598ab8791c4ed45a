// The AdamW arithmetic of one element, shared word for word by the CUDA kernel and
// its CPU twin.  Every operation is an explicitly rounded IEEE operation (__fmul_rn,
// __fma_rn & co. on the device; plain operators and std::fma on the host, where the
// build does not contract to FMA), so the GPU and the CPU give bit-identical results.
//
// Note [Torch's fused AdamW, bit for bit]
// The formula and its roundings are those of torch._fused_adamw_ on CUDA
// (aten/src/ATen/native/cuda/fused_adam_utils.cuh, adam_math): the state is float,
// the hyper-parameters double, so the mixed expressions run in double and are rounded
// to float when assigned.  nvcc contracts them (checked in the PTX / SASS of the same
// source, nvcc 13, sm_90): the weight decay is one DFMA, each moment one DFMA whose
// addend is the rounded product of the old moment:
//   p  = f32(fma(-(lr*wd), p, p))                      (only when wd != 0)
//   m  = f32(fma(1-beta1, g, beta1*m))
//   v  = f32(fma((1-beta2)*g, g, beta2*v))
//   bc1 = f32(1 - pow(beta1, t)), step_size = f32(lr / bc1)
//   bc2_sqrt = f32(sqrt(1 - pow(beta2, t)))            (double, as FusedAdamMathFunctor
//                                                       computes both corrections since
//                                                       the lr-tensor version; older torch
//                                                       took sqrtf of a float)
//   denom = f32((sqrtf(v) / bc2_sqrt) + eps)           (float div, then a double add)
//   p  = p - (step_size * m) / denom                   (float)
// grad_scale multiplies the gradient first (1 is exact and skipped).  Torch evaluates
// pow on the device, we on the host (glibc): both are within an ulp of the double
// result, which is then rounded to float, so the scalars agree except in the rare case
// where that ulp straddles a float rounding boundary.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DFA_HD __host__ __device__ __forceinline__
#else
#define DFA_HD inline
#endif

namespace deferalloc::optim::detail {

/// Scalars of one step of one shard (its group's hyper-parameters, its step count),
/// computed once on the host by make_scalars.
struct adamw_scalars {
  double lr_wd;  // lr * weight_decay; 0: no decay
  double beta1, one_minus_beta1;
  double beta2, one_minus_beta2;
  float step_size;  // f32(lr / f32(1 - beta1^t))
  float bc2_sqrt;   // f32(sqrt(1 - beta2^t)), the root in double
  double eps;
  float grad_scale;
};

/// The scalars of step `t` (1-based) with hyper-parameters lr, beta1, beta2, eps, wd.
inline adamw_scalars make_scalars(double lr, double beta1, double beta2, double eps, double wd, std::uint64_t t,
                                  float grad_scale) {
  adamw_scalars k{};
  k.lr_wd = lr * wd;
  k.beta1 = beta1;
  k.one_minus_beta1 = 1 - beta1;
  k.beta2 = beta2;
  k.one_minus_beta2 = 1 - beta2;
  const double tf = static_cast<float>(t);  // torch keeps `step` in a float tensor
  const float bc1 = static_cast<float>(1 - std::pow(beta1, tf));
  k.step_size = static_cast<float>(lr / static_cast<double>(bc1));
  k.bc2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(beta2, tf)));
  k.eps = eps;
  k.grad_scale = grad_scale;
  return k;
}

DFA_HD float f_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
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
DFA_HD double d_mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
DFA_HD double d_add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
DFA_HD double d_fma(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
DFA_HD std::uint32_t f_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
DFA_HD float f_from_bits(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

/// float -> bfloat16, round to nearest even (NaN stays NaN).
DFA_HD std::uint16_t to_bf16(float f) {
  std::uint32_t u = f_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
DFA_HD float from_bf16(std::uint16_t h) { return f_from_bits(static_cast<std::uint32_t>(h) << 16); }

/// float -> IEEE half, round to nearest even; overflow gives inf, NaN gives 0x7E00 (as
/// c10::Half).  Subnormals through one exactly rounded float add.
DFA_HD std::uint16_t to_fp16(float f) {
  std::uint32_t u = f_bits(f);
  const std::uint32_t sign = u & 0x80000000u;
  u ^= sign;
  std::uint32_t o;
  if (u >= (127u + 16u) << 23) {
    o = u > 0x7F800000u ? 0x7E00u : 0x7C00u;
  } else if (u < (113u << 23)) {  // below 2^-14: a half subnormal (or zero)
    const std::uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
#if defined(__CUDA_ARCH__)
    o = f_bits(__fadd_rn(f_from_bits(u), f_from_bits(magic))) - magic;
#else
    o = f_bits(f_from_bits(u) + f_from_bits(magic)) - magic;
#endif
  } else {
    const std::uint32_t odd = (u >> 13) & 1u;
    u += (static_cast<std::uint32_t>(15 - 127) << 23) + 0xFFFu + odd;
    o = u >> 13;
  }
  return static_cast<std::uint16_t>(o | (sign >> 16));
}
DFA_HD float from_fp16(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (e == 0x1F) return f_from_bits(sign | 0x7F800000u | (mant << 13));
  if (e == 0) return f_from_bits(sign | f_bits(f_mul(static_cast<float>(mant), 5.9604644775390625e-8f)));  // exact
  return f_from_bits(sign | ((e + 112u) << 23) | (mant << 13));
}

/// Element types of parameters and gradients (values of optim::dtype).
enum : int { k_bf16 = 0, k_fp32 = 1, k_fp16 = 2 };

/// Element i of an array of type `t`, as float (exact).
DFA_HD float load_as_float(const void* a, int t, std::size_t i) {
  if (t == k_bf16) return from_bf16(static_cast<const std::uint16_t*>(a)[i]);
  if (t == k_fp16) return from_fp16(static_cast<const std::uint16_t*>(a)[i]);
  return static_cast<const float*>(a)[i];
}
/// Stores x into element i of an array of type `t` (round to nearest even).
DFA_HD void store_from_float(void* a, int t, std::size_t i, float x) {
  if (t == k_bf16) static_cast<std::uint16_t*>(a)[i] = to_bf16(x);
  else if (t == k_fp16) static_cast<std::uint16_t*>(a)[i] = to_fp16(x);
  else static_cast<float*>(a)[i] = x;
}
/// Element i of a gradient array, BF16 or FP32 (the kernels' fast paths).
DFA_HD float load_grad(const void* g, bool bf16, std::size_t i) { return load_as_float(g, bf16 ? k_bf16 : k_fp32, i); }

/// One element: updates p, m, v in place.  See Note [Torch's fused AdamW, bit for bit].
DFA_HD void adamw_update(float& p, float& m, float& v, float grad, const adamw_scalars& s) {
  const float g = s.grad_scale == 1.0f ? grad : f_mul(grad, s.grad_scale);
  const double gd = g;
  float pp = p;
  if (s.lr_wd != 0) pp = static_cast<float>(d_fma(-s.lr_wd, static_cast<double>(pp), static_cast<double>(pp)));
  const float mm = static_cast<float>(d_fma(s.one_minus_beta1, gd, d_mul(s.beta1, static_cast<double>(m))));
  const float vv = static_cast<float>(d_fma(d_mul(s.one_minus_beta2, gd), gd, d_mul(s.beta2, static_cast<double>(v))));
  const float denom = static_cast<float>(d_add(static_cast<double>(f_div(f_sqrt(vv), s.bc2_sqrt)), s.eps));
  p = f_sub(pp, f_div(f_mul(s.step_size, mm), denom));
  m = mm;
  v = vv;
}

/// One element with a BF16 model parameter: returns the new BF16 value.
DFA_HD std::uint16_t adamw_element(float& p, float& m, float& v, float grad, const adamw_scalars& s) {
  adamw_update(p, m, v, grad, s);
  return to_bf16(p);
}

/// Arguments of one piece: n elements of FP32 state, the gradient and the model output.
struct adamw_piece {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  void* model;     // the model's parameters, of type model_type
  const void* grad;  // of type grad_type
  int model_type;  // k_bf16, k_fp32, k_fp16
  int grad_type;
  std::size_t n;
};

}  // namespace deferalloc::optim::detail
