// Compressed Adam moments: their encodings, shared word for word by the CUDA kernels
// (moments_cuda.cu) and the CPU twin (moments_cpu.cpp), and their byte layout.
//
// Note [Moment formats]
// Rationale: the host tier moves 12 B/param each way per step (FP32 main, exp_avg,
// exp_avg_sq) and runs at the PCIe bound, so fewer bytes is the only way to a faster
// step.  The main params stay FP32 (they carry the small updates); the moments are
// statistics that tolerate a few bits of error (bitsandbytes, torchao).
// Approach: the moments are decoded to FP32 in registers inside the fused kernel, the
// AdamW arithmetic is adamw_update (FP32, torch's roundings), and the new moments are
// encoded again before the write-back.  No FP32 moment ever touches HBM.
//  - bf16: m and v each rounded to BF16.  8 B/param.  m to nearest even (to_bf16); the
//    step's v stochastically (to_bf16_sr: v's bits plus the high 16 bits of dither(seed,
//    i), truncated; bf16_update, the one element function of both kernels); state writes
//    (encode_moments) to nearest.  Why v: v moves by 1 - beta2 = 0.1% of itself a step
//    (and by about 1/t early, bias-correction regime), below half a BF16 ulp (0.2-0.4%),
//    so to nearest a decaying v never decays (and a growing one stalls) - a bias in every
//    step's denominator.  On the CPU (`moment_convergence.py --setting bf16-params
//    --noise-floor`) v to nearest ends outside 0.5% of FP32 moments' loss and v
//    stochastic within the noise floor; m stochastic as well is no better (m moves 10% a
//    step and is not stuck).  The figures, and the H200's loss curves, are in
//    docs/BENCHMARKS.md.
//  - int8: blocks of k_qblock = 64 elements (aligned to the shard's start), one FP32
//    scale per block and moment, one byte per element:
//      m: scale = max |m| over the block; code = sign bit + an unsigned 7-bit float
//         (3 exponent bits, 4 mantissa bits) of |m| / scale;
//      v: stored as w = sqrt(v) (halves its dynamic range in log, as a gradient's);
//         scale = max w; code = an unsigned 8-bit float (3 exponent bits, 5 mantissa
//         bits, codes 0..224) of w / scale; decoded v = (r * scale)^2 in FP32.
//    The small float of r in [0, 1]: exponent field e, fraction f of M bits, bias 7;
//    e > 0: r = 2^(e-7) * (1 + f/2^M); e = 0: r = 2^-6 * f/2^M (subnormal, linear).  So
//    r in [2^-6, 1] keeps M bits (relative error <= 2^-5 for m, 2^-6 for w) and below
//    2^-6 the code is linear with step 2^-10 (m) / 2^-11 (w) of the block's maximum;
//    r = 1 (the block's absmax) is exact.  A positive w never gets the code of zero
//    (the smallest nonzero code instead, so v is overestimated there): a decoded v of 0
//    beside a nonzero m would make that element's update m / eps.
//    Rounding: m to nearest, ties to even.  w: the step (encode_w_step) rounds
//    stochastically: r between its neighbouring codes at the fraction q (truncated to 24
//    bits) rounds up iff q * 2^24 + (rnd >> 8) >= 2^24, rnd = dither(seed, i) a 32-bit
//    integer hash of the shard element i and adamw_scalars::seed = step_seed(step,
//    shard); state writes (encode_moments: state_dict, checkpoints) round to nearest.
//    Why w only: v moves by (1 - beta2) = 0.1% of itself a step, far below half a code
//    step (0.8%), so to nearest an element whose gradient shrinks against its block's
//    maximum never decays (its v ratchets up and its steps shrink), while an unbiased
//    rounding decays it in expectation; m moves by 10% a step and is not stuck.  Measured
//    (emulated in Python, the memorization stress test below, 4 seeds): int8 to nearest
//    +2.0% of FP32 on average, with v stochastic +1.0%, lower on every seed; m
//    stochastic as well does not help (its noise is not averaged away by beta1).
//    Deterministic all the same: the same run gives the same bits, and the GPU equals
//    the CPU twin bit for bit: r = x / scale is one correctly rounded FP32 division, the
//    codes come from integer operations on its bits or one exactly rounded add (one
//    exact multiplication by a power of two and a truncating conversion for w's
//    subnormal codes), the scales are exact maxima, the hash is integer arithmetic.
//    Bytes: 4 (FP32 main) + 2 x (1 + 4/64) = 6.125 B/param each way (a piece of n
//    elements moves 4n + 2 (n + 4 ceil(n/64)) bytes); BF16 moments 8, FP32 12.
//    Why this code (measured on CPU, emulated): on the optimizer state of a small Llama
//    at step 120, the relative RMS error that quantizing m and v causes in the update
//    m / (sqrt(v) + eps) is 2.9% with the previous code (E4M3 / E4M4 of sqrt(v),
//    256-element blocks), 1.2% with bitsandbytes' dynamic-tree maps (v direct, 256),
//    1.4% with this code (0.82% with E2M5 / E2M6, whose range of 2^-8 loses Adam's
//    scale invariance: the noisy least-squares test of test_moments settles 43% above
//    FP32 with it, 14% with this code rounded to nearest, 0.6% with w stochastic, 15-20%
//    with the previous code); BF16: 0.19%.
//    Old checkpoints: the data files hold the moments decoded to FP32 (any format loads
//    into any), so a checkpoint written with the previous int8 code reads and is
//    re-encoded in this one.
//    A non-finite moment makes its block's scale NaN (canonical 0x7FC00000), so the
//    whole block decodes to NaN: the step had diverged anyway.
// Limits: w's stochastic rounding is noise that v's long average (beta2) accumulates:
// simulated for a steady gradient, an element's w wanders around FP32's with a relative
// standard deviation of about 7% (unbiased, mean within 0.3%); measured, it trains closer
// to FP32 than rounding to nearest's bias.  The effect on training, 300
// steps of a small Llama on the CPU (benchmarks/optimizer/moment_convergence.py, mean
// loss of the last 20 steps, 2 seeds): one distinct batch per step (pretraining): see
// docs/BENCHMARKS.md; 32 batches cycled (the model memorizes them, a stress test): bf16
// -0.27%, int8 +0.66% (+2.06% with w rounded to nearest).  Where the rest comes from
// (emulated): m and v each about half; 1% of independent noise on m alone costs 1.7% on
// seed 1, so m's 4 bits are near their limit in this regime (6 bits: +0.7%), and v
// needs its 8 bits (E3M3 of w: +5%); m as E2M5 (more bits, less range) is worse.
// The device tier keeps FP32 moments; the file tier stores these formats as Note [File tier
// moments] (store/file_store.cpp) says, with the host tier's bits.
#pragma once
#include <cstddef>
#include <cstdint>

#include "adamw_math.hpp"

namespace deferalloc::optim::detail {

constexpr std::size_t k_qblock = 64;

/// Byte offset of the scales in an int8 moment array of n elements (codes first).
DFA_HD constexpr std::size_t q_scales_offset(std::size_t n) { return (n + 15) / 16 * 16; }
DFA_HD constexpr std::size_t q_blocks(std::size_t n) { return (n + k_qblock - 1) / k_qblock; }
/// Bytes of one moment array of n elements in format `f`.
DFA_HD constexpr std::size_t moment_bytes(moment_format f, std::size_t n) {
  return f == moment_format::fp32 ? 4 * n : f == moment_format::bf16 ? 2 * n : q_scales_offset(n) + 4 * q_blocks(n);
}


/// r in [0, 1] -> the small float with E exponent bits (bias 2^E - 1, so that 1 is the
/// largest exponent with a zero fraction) and M fraction bits, round to nearest even.
/// Anything not <= 1 (NaN) gives the code of 1.
template <int E, int M>
DFA_HD std::uint32_t encode_small(float r) {
  constexpr std::uint32_t bias = (1u << E) - 1u;
  if (!(r <= 1.0f)) return bias << M;
  const std::uint32_t u = f_bits(r);
  if (u < ((128u - bias) << 23)) {  // below the smallest normal 2^(1-bias): subnormal codes
    const std::uint32_t magic = (151u - bias - M) << 23;  // its ulp is the subnormal step 2^(1-bias-M)
    return f_bits(f_add(r, f_from_bits(magic))) - magic;  // one exactly rounded add
  }
  constexpr int shift = 23 - M;
  const std::uint32_t odd = (u >> shift) & 1u;
  return (u - ((127u - bias) << 23) + ((1u << (shift - 1)) - 1u) + odd) >> shift;
}
/// The same code rounded stochastically: r's position between its two neighbouring codes,
/// as a fraction q in [0, 1) truncated to 24 bits, rounds up iff q * 2^24 + (rnd >> 8) >= 2^24
/// (so up with probability q for a uniform rnd).  Exact integer operations on r's bits (and
/// one multiplication by a power of two below the normals), as encode_small.
template <int E, int M>
DFA_HD std::uint32_t encode_small_sr(float r, std::uint32_t rnd) {
  constexpr std::uint32_t bias = (1u << E) - 1u;
  static_assert(E + M <= 8, "8-bit codes: (code + 1) << 24 fits 32 bits");
  if (!(r <= 1.0f)) return bias << M;
  const std::uint32_t u = f_bits(r);
  std::uint32_t pos;  // the code position r / step, fixed point with 24 fraction bits
  if (u < ((128u - bias) << 23))  // subnormal codes: r * 2^(bias - 1 + M + 24) < 2^(M + 24), exact
    pos = static_cast<std::uint32_t>(f_mul(r, f_from_bits((127u + bias - 1u + M + 24u) << 23)));
  else
    pos = (u - ((127u - bias) << 23)) << (M + 1);
  return (pos + (rnd >> 8)) >> 24;
}
template <int E, int M>
DFA_HD float decode_small(std::uint32_t c) {
  constexpr std::uint32_t bias = (1u << E) - 1u;
  const std::uint32_t e = c >> M, f = c & ((1u << M) - 1u);
  if (e == 0) return f_mul(static_cast<float>(f), f_from_bits((128u - bias - M) << 23));  // exact
  return f_from_bits(((e + 127u - bias) << 23) | (f << (23 - M)));
}
/// The codes: m (with a sign bit) and w = sqrt(v).
constexpr int k_m_exp = 3, k_m_frac = 4, k_w_exp = 3, k_w_frac = 5;

/// max that keeps a NaN (from either side).
DFA_HD float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }
/// A block scale as stored: NaN canonical, so GPU and CPU store the same bits.
DFA_HD float canonical_scale(float s) { return s != s ? f_from_bits(0x7FC00000u) : s; }
DFA_HD float f_abs(float x) { return f_from_bits(f_bits(x) & 0x7FFFFFFFu); }

DFA_HD std::uint8_t encode_m(float m, float scale) {
  if (scale == 0.0f) return 0;
  const std::uint32_t sign = (f_bits(m) >> 24) & 0x80u;
  return static_cast<std::uint8_t>(encode_small<k_m_exp, k_m_frac>(f_div(f_abs(m), scale)) | sign);
}
DFA_HD float decode_m(std::uint8_t c, float scale) {
  const float x = f_mul(decode_small<k_m_exp, k_m_frac>(c & 0x7Fu), scale);
  return (c & 0x80u) ? f_from_bits(f_bits(x) ^ 0x80000000u) : x;
}
/// w = sqrt(v) (>= 0), rounded to nearest (state writes: encode_moments).  A positive w
/// never gets the code of zero (see Note [Moment formats]).
DFA_HD std::uint8_t encode_w(float w, float scale) {
  if (scale == 0.0f) return 0;
  const std::uint32_t c = encode_small<k_w_exp, k_w_frac>(f_div(w, scale));
  return static_cast<std::uint8_t>(c == 0 && w > 0.0f ? 1u : c);
}
/// The same rounded stochastically with the random bits `rnd` (the step's encoding).
DFA_HD std::uint8_t encode_w_sr(float w, float scale, std::uint32_t rnd) {
  if (scale == 0.0f) return 0;
  const std::uint32_t c = encode_small_sr<k_w_exp, k_w_frac>(f_div(w, scale), rnd);
  return static_cast<std::uint8_t>(c == 0 && w > 0.0f ? 1u : c);
}
/// The random bits of element `i` of a shard in the step with seed `seed`
/// (adamw_scalars::seed): a 32-bit integer hash, the same on the GPU and the CPU.
DFA_HD std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}
/// The seed of shard `shard`'s step `t` (1-based).
inline std::uint32_t step_seed(std::uint64_t t, std::size_t shard) {
  return mix32(mix32(static_cast<std::uint32_t>(t) ^ static_cast<std::uint32_t>(t >> 32) * 0x85EBCA77u) ^
               static_cast<std::uint32_t>(shard) * 0xC2B2AE3Du);
}
DFA_HD std::uint32_t dither(std::uint32_t seed, std::uint64_t i) {
  return mix32(seed ^ mix32(static_cast<std::uint32_t>(i) * 0x9E3779B1u ^ static_cast<std::uint32_t>(i >> 32)));
}
/// x -> BF16 rounded stochastically with the 16 random bits `r16` (< 2^16): x's bits plus
/// r16, truncated, so up (in magnitude) with the probability of the dropped fraction; NaN as
/// to_bf16.  Exact integer operations.
DFA_HD std::uint16_t to_bf16_sr(float x, std::uint32_t r16) {
  const std::uint32_t u = f_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  return static_cast<std::uint16_t>((u + r16) >> 16);
}
DFA_HD float decode_v(std::uint8_t c, float scale) {
  const float w = f_mul(decode_small<k_w_exp, k_w_frac>(c), scale);
  return f_mul(w, w);
}

/// The step's encoding of w = sqrt(v) of shard element `i`: stochastic rounding dithered by
/// the step's seed (Note [Moment formats]).
DFA_HD std::uint8_t encode_w_step(float w, float scale, const adamw_scalars& k, std::uint64_t i) {
  return encode_w_sr(w, scale, dither(k.seed, i));
}

/// One element with BF16 moments (shard element `i`): decodes m and v, steps p, encodes
/// them again, m to nearest, v stochastically dithered by the step's seed (the high 16 bits
/// of dither(seed, i); Note [Moment formats]).
DFA_HD void bf16_update(float& p, std::uint16_t& mb, std::uint16_t& vb, float g, const adamw_scalars& k, std::uint64_t i) {
  float m = from_bf16(mb), v = from_bf16(vb);
  adamw_update(p, m, v, g, k);
  mb = to_bf16(m);
  vb = to_bf16_sr(v, dither(k.seed, i) >> 16);
}

/// One element of an int8 block: decodes m and v with the block's old scales, steps p,
/// and leaves the new m and w = sqrt(v) for the block's encoding (which needs the new
/// scales, the maxima over the block).
DFA_HD void q_update(float& p, float& m, float& w, std::uint8_t mc, std::uint8_t vc, float sm, float sv, float g,
                     const adamw_scalars& k) {
  m = decode_m(mc, sm);
  float v = decode_v(vc, sv);
  adamw_update(p, m, v, g, k);
  w = f_sqrt(v);
}

/// One piece with compressed moments: the FP32 main params, the moments in their
/// format's layout (int8: n codes, then the scales at q_scales_offset(n)).
struct adamw_qpiece {
  float* param;
  void* exp_avg;
  void* exp_avg_sq;
  void* model;
  const void* grad;
  value_type model_type;
  value_type grad_type;
  moment_format format;  // bf16 or int8
  std::size_t n;
  std::size_t e0;  // the piece's first element in its shard (int8: the dither's index)
};

/// The CPU twin of the compressed-moment step.
void cpu_adamw_moments(const adamw_qpiece& p, const adamw_scalars& k);
/// The CUDA kernels of the same (moments_cuda.cu), on `stream` of `device`.
void cuda_adamw_moments(const adamw_qpiece& p, const adamw_scalars& k, void* stream, int device, int sms);
/// Elements [e0, e0+n) of a moment array (`which`: exp_avg or exp_avg_sq) of `numel`
/// elements in format `f` at `stored`, decoded to FP32.
void decode_moments(moment_format f, state_array which, const void* stored, std::size_t numel, std::size_t e0, std::size_t n, float* out);
/// Encodes `in` into elements [e0, e0+n) of such an array; an int8 block only partly
/// covered is decoded first and re-encoded with the new values (its scale may change).
void encode_moments(moment_format f, state_array which, void* stored, std::size_t numel, std::size_t e0, std::size_t n, const float* in);

}  // namespace deferalloc::optim::detail
