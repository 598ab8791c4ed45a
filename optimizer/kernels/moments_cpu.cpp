// The CPU twin of the compressed-moment step (moments_cuda.cu), and the conversions of
// compressed moment arrays to and from FP32 (state_dict, checkpoints).  See
// Note [Moment formats] in moment_format.hpp.
#include <algorithm>
#include <vector>

#include <deferalloc/optim/optimizer.hpp>

#include "moment_format.hpp"

namespace deferalloc::optim::detail {
namespace {

std::uint8_t* codes(void* a) { return static_cast<std::uint8_t*>(a); }
float* scales(void* a, std::size_t n) { return reinterpret_cast<float*>(static_cast<char*>(a) + q_scales_offset(n)); }

// Encodes one int8 block of `len` FP32 values (m, or w = sqrt(v)) at codes `c`, scale `s`;
// with `k`, w as the step does (encode_w_step, the block's first element i0 of its shard).
void encode_block(int which, const float* x, std::size_t len, std::uint8_t* c, float* s,
                  const adamw_scalars* k = nullptr, std::size_t i0 = 0) {
  float amax = 0.0f;
  for (std::size_t i = 0; i < len; ++i) amax = nan_max(amax, which == 1 ? f_abs(x[i]) : x[i]);
  amax = canonical_scale(amax);
  for (std::size_t i = 0; i < len; ++i)
    c[i] = which == 1 ? encode_m(x[i], amax) : k ? encode_w_step(x[i], amax, *k, i0 + i) : encode_w(x[i], amax);
  *s = amax;
}

}  // namespace

void cpu_adamw_moments(const adamw_qpiece& p, const adamw_scalars& k) {
  if (p.format == moment_format::bf16) {
    auto* M = static_cast<std::uint16_t*>(p.exp_avg);
    auto* V = static_cast<std::uint16_t*>(p.exp_avg_sq);
    for (std::size_t i = 0; i < p.n; ++i) {
      bf16_update(p.param[i], M[i], V[i], load_as_float(p.grad, p.grad_type, i), k, p.e0 + i);
      store_from_float(p.model, p.model_type, i, p.param[i]);
    }
    return;
  }
  std::uint8_t *MC = codes(p.exp_avg), *VC = codes(p.exp_avg_sq);
  float *MS = scales(p.exp_avg, p.n), *VS = scales(p.exp_avg_sq, p.n);
  float m[k_qblock], w[k_qblock];
  for (std::size_t b = 0; b < q_blocks(p.n); ++b) {
    const std::size_t e0 = b * k_qblock, len = std::min(k_qblock, p.n - e0);
    for (std::size_t i = 0; i < len; ++i) {
      const std::size_t j = e0 + i;
      q_update(p.param[j], m[i], w[i], MC[j], VC[j], MS[b], VS[b], load_as_float(p.grad, p.grad_type, j), k);
      store_from_float(p.model, p.model_type, j, p.param[j]);
    }
    encode_block(1, m, len, MC + e0, MS + b);
    encode_block(2, w, len, VC + e0, VS + b, &k, p.e0 + e0);
  }
}

void decode_moments(moment_format f, state_array which, const void* stored, std::size_t numel, std::size_t e0, std::size_t n,
                    float* out) {
  if (f == moment_format::bf16) {
    const auto* h = static_cast<const std::uint16_t*>(stored);
    for (std::size_t i = 0; i < n; ++i) out[i] = from_bf16(h[e0 + i]);
    return;
  }
  void* a = const_cast<void*>(stored);
  const std::uint8_t* c = codes(a);
  const float* s = scales(a, numel);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t j = e0 + i;
    out[i] = which == state_array::exp_avg ? decode_m(c[j], s[j / k_qblock]) : decode_v(c[j], s[j / k_qblock]);
  }
}

void encode_moments(moment_format f, state_array which, void* stored, std::size_t numel, std::size_t e0, std::size_t n,
                    const float* in) {
  if (f == moment_format::bf16) {
    auto* h = static_cast<std::uint16_t*>(stored);
    for (std::size_t i = 0; i < n; ++i) h[e0 + i] = to_bf16(in[i]);
    return;
  }
  std::vector<float> x(k_qblock);
  for (std::size_t b = e0 / k_qblock; b * k_qblock < e0 + n; ++b) {
    const std::size_t b0 = b * k_qblock, len = std::min(k_qblock, numel - b0);
    decode_moments(f, which, stored, numel, b0, len, x.data());  // the block's elements outside [e0, e0+n)
    for (std::size_t i = std::max(b0, e0); i < std::min(b0 + len, e0 + n); ++i) x[i - b0] = in[i - e0];
    if (which == state_array::exp_avg_sq)
      for (std::size_t i = 0; i < len; ++i) x[i] = f_sqrt(x[i]);
    encode_block(which == state_array::exp_avg ? 1 : 2, x.data(), len, codes(stored) + b0, scales(stored, numel) + b);
  }
}

}  // namespace deferalloc::optim::detail
