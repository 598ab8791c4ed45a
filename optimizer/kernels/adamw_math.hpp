// The AdamW arithmetic of one element, shared word for word by the CUDA kernel and
// its CPU twin.  Every operation is an explicitly rounded IEEE operation (__fmul_rn,
// __fma_rn & co. on the device; plain operators and std::fma on the host, where the
// build does not contract to FMA), so the GPU and the CPU give bit-identical results.
//
// Note [Torch's fused AdamW, bit for bit]
// The formula and its roundings are those of torch._fused_adamw_ on CUDA in torch 2.11
// (aten/src/ATen/native/cuda/fused_adam_utils.cuh, FusedAdamMathFunctor + adam_math):
// every hyper-parameter is cast to float (opmath) first, and the whole update is float:
//   lr, beta1, beta2, wd, eps = f32(...)
//   bc1 = 1 - powf(beta1, t), bc2_sqrt = sqrtf(1 - powf(beta2, t))   (t: float step)
//   p  = fmaf(-(lr*wd), p, p)                          (only when wd != 0; nvcc contracts
//                                                        p -= lr*wd*p into one FFMA)
//   m  = fmaf(beta1, m, fmaf(-beta1, g, g))            (explicit std::fma in torch)
//   v  = fmaf(beta2, v, fmaf(-beta2, g*g, g*g))
//   step_size = lr / bc1
//   denom = sqrtf(v) / bc2_sqrt + eps
//   p  = p - (step_size * m) / denom
// Earlier torch releases kept the hyper-parameters in double (mixed double/float
// expressions): measured on the H200 against torch 2.11, that formula differed from the
// kernel in every moment (1-4 ulp in exp_avg, up to 218 in exp_avg_sq at step 1), which is
// the float rounding of beta1 and beta2.  grad_scale multiplies the gradient (1 is exact
// and skipped; torch divides by its scale).
//
// powf is not correctly rounded on the device: CUDA's powf(0.95f, 6) differs from glibc's
// in the last bit (measured on the H200 with tests/torch/diag_fused_adamw.py: t = 6, 17, 32
// of t <= 40 for beta 0.95; none for 0.9 and 0.999), and every element of the step takes
// that bit, so the losses of a run part from torch's at step 6.  make_scalars therefore
// takes the power from the compute backend: the CUDA backend evaluates powf on the device
// (a table per beta, filled by one small kernel per 4096 steps), the CPU twin the host's.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <deferalloc/optim/optimizer_types.hpp>

#if defined(__CUDACC__)
#define DFA_HD __host__ __device__ __forceinline__
#else
#define DFA_HD inline
#endif

namespace deferalloc::optim::detail {

/// Scalars of one step of one shard (its group's hyper-parameters, its step count),
/// computed once on the host by make_scalars (with the backend's powf).
struct adamw_scalars {
  float lr_wd;  // f32(lr) * f32(weight_decay); 0: no decay
  float beta1, beta2;
  float step_size;  // f32(lr) / (1 - powf(beta1, t))
  float bc2_sqrt;   // sqrtf(1 - powf(beta2, t))
  float eps;
  float grad_scale;
  std::uint32_t seed = 0;  // int8 moments: the dither's seed of this step and shard (step_seed)
};

/// powf on the host (the CPU twin's bias corrections).
struct host_pow {
  float operator()(float base, float e) const { return std::pow(base, e); }
};

/// The scalars of step `t` (1-based) with hyper-parameters lr, beta1, beta2, eps, wd;
/// `pow` computes the bias corrections' powers (the backend's powf).
template <typename Pow = host_pow>
adamw_scalars make_scalars(double lr, double beta1, double beta2, double eps, double wd, std::uint64_t t,
                           float grad_scale, Pow pow = {}) {
  adamw_scalars k{};
  const float lr_f = static_cast<float>(lr), wd_f = static_cast<float>(wd);
  k.lr_wd = wd_f != 0.0f ? lr_f * wd_f : 0.0f;
  k.beta1 = static_cast<float>(beta1);
  k.beta2 = static_cast<float>(beta2);
  const float tf = static_cast<float>(t);  // torch keeps `step` in a float tensor
  const float bc1 = 1.0f - pow(k.beta1, tf);
  k.step_size = lr_f / bc1;
  k.bc2_sqrt = std::sqrt(1.0f - pow(k.beta2, tf));
  k.eps = static_cast<float>(eps);
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
DFA_HD float f_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
DFA_HD float f_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DFA_HD float f_sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
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

/// Bytes of one element of type `t`.
DFA_HD constexpr std::size_t value_bytes(value_type t) { return t == value_type::fp32 ? 4 : 2; }

/// Element i of an array of type `t`, as float (exact).
DFA_HD float load_as_float(const void* a, value_type t, std::size_t i) {
  if (t == value_type::bf16) return from_bf16(static_cast<const std::uint16_t*>(a)[i]);
  if (t == value_type::fp16) return from_fp16(static_cast<const std::uint16_t*>(a)[i]);
  return static_cast<const float*>(a)[i];
}
/// Stores x into element i of an array of type `t` (round to nearest even).
DFA_HD void store_from_float(void* a, value_type t, std::size_t i, float x) {
  if (t == value_type::bf16) static_cast<std::uint16_t*>(a)[i] = to_bf16(x);
  else if (t == value_type::fp16) static_cast<std::uint16_t*>(a)[i] = to_fp16(x);
  else static_cast<float*>(a)[i] = x;
}
/// Element i's term of a 16-bit parameter's edit hash (Note [Edits of 16-bit parameters]
/// in optimizer/streamed_adamw.cpp): the hash is the wrapping sum of the terms, so it does
/// not depend on the order of the additions.  A term is a 32-bit mix of the value (an odd
/// multiplier then an xorshift: distinct values, distinct mixes) times an odd weight of its
/// index, exact in 64 bits: a changed value changes the sum by a nonzero product smaller
/// than 2^64, so always; two values swapped change it by (mix difference) x 2 x (index
/// distance), so always unless the indices are a multiple of 2^31 apart (the weights wrap).
/// Cost: one 32 x 32 -> 64-bit multiply and a 32-bit one (a GPU's integer units, not the
/// emulated 64-bit multiplies of a 64-bit mixer).
DFA_HD std::uint64_t edit_term(std::uint16_t bits, std::size_t i) {
  std::uint32_t m = (static_cast<std::uint32_t>(bits) + 1u) * 0x9E3779B1u;
  m ^= m >> 15;
  const std::uint32_t w = static_cast<std::uint32_t>(i) * 2u + 1u;
  return static_cast<std::uint64_t>(m) * w;
}
/// Whether element i of a 16-bit parameter of type `t` holds main's rounding (what a
/// step writes into it).
DFA_HD bool is_rounding_of(float main, const void* param, value_type t, std::size_t i) {
  const std::uint16_t p = static_cast<const std::uint16_t*>(param)[i];
  return (t == value_type::fp16 ? to_fp16(main) : to_bf16(main)) == p;
}
/// Element i of a gradient array, BF16 or FP32 (the kernels' fast paths).
DFA_HD float load_grad(const void* g, bool bf16, std::size_t i) { return load_as_float(g, bf16 ? value_type::bf16 : value_type::fp32, i); }

/// One element: updates p, m, v in place.  See Note [Torch's fused AdamW, bit for bit].
DFA_HD void adamw_update(float& p, float& m, float& v, float grad, const adamw_scalars& s) {
  const float g = s.grad_scale == 1.0f ? grad : f_mul(grad, s.grad_scale);
  float pp = p;
  if (s.lr_wd != 0.0f) pp = f_fma(-s.lr_wd, pp, pp);
  const float mm = f_fma(s.beta1, m, f_fma(-s.beta1, g, g));
  const float gg = f_mul(g, g);
  const float vv = f_fma(s.beta2, v, f_fma(-s.beta2, gg, gg));
  const float denom = f_add(f_div(f_sqrt(vv), s.bc2_sqrt), s.eps);
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
  value_type model_type;
  value_type grad_type;
  std::size_t n;
};

}  // namespace deferalloc::optim::detail
