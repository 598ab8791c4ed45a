// Compressed Adam moments (Note [Moment formats], optimizer/kernels/moment_format.hpp) on the
// host driver, through the C ABI: the codes against a brute-force reference of the
// documented rounding, state round trips, the step's exactness against a reference that
// quantizes the documented way, bytes moved, checkpoints, and a short convergence run.
#include <deferalloc/optimizer.h>
#include <gtest/gtest.h>

#include "../optimizer/kernels/moment_format.hpp"
#include "common.hpp"

#include <cfenv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sys/wait.h>
#include <unistd.h>
#include <random>
#include <string>
#include <vector>

namespace {

namespace d = deferalloc::optim::detail;

struct handle {
  dfa_optimizer* o = nullptr;
  explicit handle(const std::string& moments, const char* extra = "") {
    const std::string s = std::string("driver:host,host_granularity_kb:64,tier:host,window_mb:1,depth:2,moments:") +
                          moments + extra;
    EXPECT_EQ(dfa_opt_create(s.c_str(), &o), DFA_SUCCESS) << dfa_opt_last_error();
  }
  // The whole settings text (no defaults added).
  struct text {
    std::string s;
  };
  handle() = default;
  explicit handle(const text& t) { EXPECT_EQ(dfa_opt_create(t.s.c_str(), &o), DFA_SUCCESS) << dfa_opt_last_error(); }
  ~handle() {
    if (o) EXPECT_EQ(dfa_opt_destroy(o), DFA_SUCCESS);
  }
};

// ---- the reference: the documented formats, written independently ------------------------

// The small float of code c (E exponent bits, bias 2^E - 1, M fraction bits), by its
// definition.
double small_value(unsigned c, int E, int M) {
  const int bias = (1 << E) - 1;
  const unsigned e = c >> M, f = c & ((1u << M) - 1);
  return e == 0 ? std::ldexp(double(f), 1 - bias - M) : std::ldexp(1.0 + std::ldexp(double(f), -M), int(e) - bias);
}
// The nearest code to r in [0, 1] by search; ties to the even code.
unsigned nearest_code(float r, int E, int M) {
  unsigned best = 0;
  double bd = INFINITY;
  for (unsigned c = 0; c <= (((1u << E) - 1) << M); ++c) {
    const double dd = std::fabs(small_value(c, E, M) - double(r));
    if (dd < bd || (dd == bd && (c & 1u) == 0)) best = c, bd = dd;
  }
  return best;
}
// The stochastic rounding of the step's sqrt(v) (Note [Moment formats]): r between its two
// neighbouring codes lo < hi at the fraction q rounds up iff floor(q * 2^24) + (rnd >> 8) >= 2^24.
unsigned dithered_code(float r, int E, int M, std::uint32_t rnd) {
  const unsigned top = ((1u << E) - 1) << M;
  if (double(r) >= 1.0) return top;
  unsigned lo = 0;
  while (lo < top && small_value(lo + 1, E, M) <= double(r)) ++lo;
  const double q = (double(r) - small_value(lo, E, M)) / (small_value(lo + 1, E, M) - small_value(lo, E, M));
  return std::floor(std::ldexp(q, 24)) + double(rnd >> 8) >= 0x1p24 ? lo + 1 : lo;
}
// BF16 round to nearest even, through the mantissa (not the bit trick of adamw_math.hpp).
float ref_bf16(float x) {
  if (x == 0 || !std::isfinite(x)) return x;
  int e = 0;
  const double m = std::frexp(double(x), &e);  // |m| in [0.5, 1)
  std::fesetround(FE_TONEAREST);
  return float(std::ldexp(std::nearbyint(std::ldexp(m, 8)), e - 8));
}
// BF16 rounded stochastically (Note [Moment formats]), through the mantissa: x between its
// neighbours lo (toward zero) and hi at the fraction q rounds to hi iff floor(q * 2^16) + r16 >= 2^16.
float ref_bf16_sr(float x, std::uint32_t r16) {
  if (x == 0 || !std::isfinite(x)) return x;
  int e = 0;
  const double m = std::frexp(std::fabs(double(x)), &e);  // [0.5, 1)
  const double lo = std::floor(std::ldexp(m, 8)), q = std::ldexp(m, 8) - lo;  // q exact: 24 bits
  const double c = std::floor(std::ldexp(q, 16)) + r16 >= 0x1p16 ? lo + 1 : lo;
  return float(std::copysign(std::ldexp(c, e - 8), double(x)));
}
// An int8 moment array quantized the documented way; `sq` for exp_avg_sq (stored as sqrt),
// with `seed` as a step of that shard encodes it (dithered by d::dither(*seed, i)).
std::vector<float> ref_int8(const std::vector<float>& x, bool sq, const std::uint32_t* seed = nullptr) {
  std::vector<float> out(x.size());
  constexpr std::size_t block = 64;  // Note [Moment formats]
  for (std::size_t b0 = 0; b0 < x.size(); b0 += block) {
    const std::size_t e = std::min(x.size(), b0 + block);
    float amax = 0;
    for (std::size_t i = b0; i < e; ++i) amax = std::max(amax, sq ? std::sqrt(x[i]) : std::fabs(x[i]));
    for (std::size_t i = b0; i < e; ++i) {
      if (amax == 0) { out[i] = 0; continue; }
      const float a = sq ? std::sqrt(x[i]) : std::fabs(x[i]);
      const int E = sq ? d::k_w_exp : d::k_m_exp, M = sq ? d::k_w_frac : d::k_m_frac;
      unsigned c = sq && seed ? dithered_code(a / amax, E, M, d::dither(*seed, i)) : nearest_code(a / amax, E, M);
      if (sq && c == 0 && a > 0) c = 1;  // a positive v never decodes to 0
      const float q = float(small_value(c, E, M)) * amax;
      out[i] = sq ? q * q : std::copysign(q, x[i]);
    }
  }
  return out;
}
std::vector<float> ref_format(const std::string& f, const std::vector<float>& x, bool sq,
                              const std::uint32_t* seed = nullptr) {
  if (f == "int8") return ref_int8(x, sq, seed);
  std::vector<float> out(x.size());  // bf16: v of a step stochastically, dither(seed, i)'s high 16 bits
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = sq && seed ? ref_bf16_sr(x[i], d::dither(*seed, i) >> 16) : ref_bf16(x[i]);
  return out;
}

std::vector<float> randn(std::size_t n, unsigned seed, float scale) {
  std::mt19937 rng(seed);
  std::lognormal_distribution<float> mag(0.0f, 2.0f);  // magnitudes over orders of magnitude
  std::vector<float> v(n);
  for (auto& x : v) x = (rng() & 1 ? 1.0f : -1.0f) * scale * mag(rng);
  return v;
}
std::vector<std::uint16_t> bf16_of(const std::vector<float>& x) {
  std::vector<std::uint16_t> o(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) o[i] = d::to_bf16(x[i]);
  return o;
}
std::vector<float> read(handle& h, std::size_t s, int a, std::size_t n) {
  std::vector<float> out(n);
  EXPECT_EQ(dfa_opt_read_state(h.o, s, dfa_state_array(a), 0, n, out.data()), DFA_SUCCESS) << dfa_opt_last_error();
  return out;
}

// ---- the codes -----------------------------------------------------------------------------

TEST(moments, small_float_codes_round_to_nearest_even) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> rs = {0.0f, 1.0f, 0x1p-14f, 0x1p-17f, 0x1p-18f, 0x1p-19f, 0x1.8p-18f, 0.5f, 0.53125f, 0.96875f};
  for (int i = 0; i < 20000; ++i) rs.push_back(u(rng));
  for (int i = 0; i < 20000; ++i) rs.push_back(std::ldexp(u(rng), -int(rng() % 24)));  // small ones, subnormal codes
  // Every midpoint between two codes (a tie) of both codes.
  const int Em = d::k_m_exp, Mm = d::k_m_frac, Ew = d::k_w_exp, Mw = d::k_w_frac;
  const unsigned top_m = ((1u << Em) - 1) << Mm, top_w = ((1u << Ew) - 1) << Mw;
  for (unsigned c = 0; c < top_w; ++c) rs.push_back(float((small_value(c, Ew, Mw) + small_value(c + 1, Ew, Mw)) / 2));
  for (unsigned c = 0; c < top_m; ++c) rs.push_back(float((small_value(c, Em, Mm) + small_value(c + 1, Em, Mm)) / 2));
  for (float r : rs) {
    ASSERT_EQ((d::encode_small<d::k_m_exp, d::k_m_frac>(r)), nearest_code(r, Em, Mm)) << r;
    ASSERT_EQ((d::encode_small<d::k_w_exp, d::k_w_frac>(r)), nearest_code(r, Ew, Mw)) << r;
  }
  for (unsigned c = 0; c <= top_w; ++c)
    ASSERT_EQ(double(d::decode_small<d::k_w_exp, d::k_w_frac>(c)), small_value(c, Ew, Mw)) << c;
  for (unsigned c = 0; c <= top_m; ++c)
    ASSERT_EQ(double(d::decode_small<d::k_m_exp, d::k_m_frac>(c)), small_value(c, Em, Mm)) << c;
}

TEST(moments, dithered_codes_round_up_with_the_fraction_and_are_unbiased) {
  // The step's sqrt(v) code (encode_small_sr): against the reference rule for random r and
  // random bits, and its mean over evenly spread bits is r within 2^-11 of a code step.
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  const int E = d::k_w_exp, M = d::k_w_frac;
  const unsigned top = ((1u << E) - 1) << M;
  std::vector<float> rs = {0.0f, 1.0f, 0x1p-6f, 0x1p-11f, 0x1p-12f, 0x1p-40f, 0.5f, 0.515625f};
  for (int i = 0; i < 3000; ++i) rs.push_back(u(rng));
  for (int i = 0; i < 3000; ++i) rs.push_back(std::ldexp(u(rng), -int(rng() % 24)));
  for (float r : rs) {
    for (std::uint32_t rnd : {0u, 0xFFFFFFFFu, 0x80000000u, std::uint32_t(rng()), std::uint32_t(rng())})
      ASSERT_EQ((d::encode_small_sr<d::k_w_exp, d::k_w_frac>(r, rnd)), dithered_code(r, E, M, rnd)) << r << " " << rnd;
    unsigned lo = 0;
    while (lo < top && small_value(lo + 1, E, M) <= double(r)) ++lo;
    const double step = lo < top ? small_value(lo + 1, E, M) - small_value(lo, E, M) : 0.0;
    double mean = 0;
    for (std::uint32_t j = 0; j < 4096; ++j)
      mean += small_value(d::encode_small_sr<d::k_w_exp, d::k_w_frac>(r, j << 20), E, M) / 4096;
    ASSERT_LE(std::fabs(mean - double(r)), std::ldexp(step, -11) + std::ldexp(double(r), -24)) << r;
  }
  // The dither: the same bits for the same (seed, element), others elsewhere.
  EXPECT_EQ(d::dither(d::step_seed(7, 1), 12345), d::dither(d::step_seed(7, 1), 12345));
  EXPECT_NE(d::dither(d::step_seed(7, 1), 12345), d::dither(d::step_seed(8, 1), 12345));
  EXPECT_NE(d::dither(d::step_seed(7, 1), 12345), d::dither(d::step_seed(7, 2), 12345));
  EXPECT_NE(d::dither(d::step_seed(7, 1), 12345), d::dither(d::step_seed(7, 1), 12346));
}

TEST(moments, bf16_stochastic_rounding_rounds_up_with_the_fraction_and_is_unbiased) {
  // The step's v (to_bf16_sr): against the mantissa reference for random x and bits, and its
  // mean over evenly spread bits is x (exact up to the 2^-12 of an ulp the spread leaves).
  std::mt19937 rng(3);
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, 0x1p-130f, 0x1.fffffep127f, 3.0e-8f, -2.5e-3f};
  for (int i = 0; i < 4000; ++i) xs.push_back(std::ldexp(1.0f + float(rng() % (1u << 23)) * 0x1p-23f, int(rng() % 80) - 60));
  for (float x : xs) {
    for (std::uint32_t r : {0u, 0xFFFFu, 0x8000u, std::uint32_t(rng() >> 16), std::uint32_t(rng() >> 16)}) {
      const float got = d::from_bf16(d::to_bf16_sr(x, r)), want = ref_bf16_sr(x, r);
      if (std::isfinite(want)) ASSERT_EQ(got, want) << x << " " << r;
    }
    if (std::fabs(x) > 0x1p126f) continue;
    double mean = 0;
    for (std::uint32_t j = 0; j < 4096; ++j) mean += d::from_bf16(d::to_bf16_sr(x, j << 4)) / 4096.0;
    const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(x), 0x1p-126f)) - 7);
    ASSERT_LE(std::fabs(mean - double(x)), std::ldexp(ulp, -12)) << x;
  }
  EXPECT_TRUE(std::isnan(d::from_bf16(d::to_bf16_sr(std::nanf(""), 0xFFFFu))));
  EXPECT_EQ(d::to_bf16_sr(INFINITY, 0xFFFFu), d::to_bf16(INFINITY));
}

TEST(moments, bf16_v_decays_in_expectation_and_is_deterministic) {
  // The step's element (bf16_update, the code the CUDA kernel runs as well): with no gradient
  // v decays by beta2 = 0.999 a step, 0.1%, below half a BF16 ulp; to nearest it would stay
  // where it is, stochastically the mean over elements follows FP32 within 0.5% after 300 steps.
  const std::size_t n = 4096;
  const auto k0 = d::make_scalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1.0f);
  std::vector<std::uint16_t> m(n), v(n), v2(n);
  std::vector<float> p(n, 0.0f);
  double v32 = 0;
  for (std::size_t i = 0; i < n; ++i) v[i] = d::to_bf16(1.0f + float(i) / n), v32 += d::from_bf16(v[i]) / n;
  v2 = v;
  for (int t = 1; t <= 300; ++t) {
    auto k = k0;
    k.seed = d::step_seed(t, 0);
    for (std::size_t i = 0; i < n; ++i) d::bf16_update(p[i], m[i], v[i], 0.0f, k, i);
    v32 *= 0.999;
  }
  double mean = 0;
  for (std::size_t i = 0; i < n; ++i) mean += d::from_bf16(v[i]) / n;
  EXPECT_NEAR(mean / v32, 1.0, 0.005) << "FP32 " << v32 << " BF16 " << mean;
  for (std::size_t i = 0; i < n; ++i) {  // to nearest (the state writes) does not move at all
    const float x = d::from_bf16(v2[i]);
    ASSERT_EQ(d::to_bf16(x * 0.999f), v2[i]) << x;
  }
  // The same seed and element give the same bits; another element or step other bits.
  auto k = k0;
  k.seed = d::step_seed(5, 2);
  int differ = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float pa = 0.1f, pb = 0.1f;
    std::uint16_t ma = 0, va = d::to_bf16(1.0f), mb = 0, vb = va, mc = 0, vc = va;
    d::bf16_update(pa, ma, va, 3e-2f, k, 1000 + i);
    d::bf16_update(pb, mb, vb, 3e-2f, k, 1000 + i);
    ASSERT_EQ(va, vb);
    ASSERT_EQ(pa, pb);
    d::bf16_update(pb, mc, vc, 3e-2f, k, 1000 + i + 1);
    differ += vc != va;
  }
  EXPECT_GT(differ, 0);  // dithered: neighbouring elements do not round alike
}

// ---- state round trips ---------------------------------------------------------------------

class formats : public ::testing::TestWithParam<std::string> {};

TEST_P(formats, written_state_reads_back_quantized_and_is_idempotent) {
  const std::string f = GetParam();
  handle h(f);
  const std::size_t n = 1000;  // not a multiple of 64: a partial last block
  std::vector<float> p(n, 1.0f);
  ASSERT_EQ(dfa_opt_add_shard(h.o, p.data(), n, DFA_DTYPE_FP32, 0, nullptr, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  auto m = randn(n, 2, 1e-3f), v = randn(n, 3, 1e-6f);
  for (auto& x : v) x = std::fabs(x);
  m[17] = 0.0f;
  v[70] = 1e-30f, v[71] = 0.0f;  // far below their block's maximum, and zero
  ASSERT_EQ(dfa_opt_write_state(h.o, 0, DFA_STATE_EXP_AVG, 0, n, m.data()), DFA_SUCCESS) << dfa_opt_last_error();
  ASSERT_EQ(dfa_opt_write_state(h.o, 0, DFA_STATE_EXP_AVG_SQ, 0, n, v.data()), DFA_SUCCESS);
  const auto mq = read(h, 0, 1, n), vq = read(h, 0, 2, n);
  EXPECT_EQ(mq, ref_format(f, m, false));
  EXPECT_EQ(vq, ref_format(f, v, true));
  EXPECT_GT(vq[70], 0.0f) << "a positive v decodes to a positive v";
  EXPECT_EQ(vq[71], 0.0f);
  // Decoded values encode to themselves (a checkpoint or state_dict round trip is exact).
  ASSERT_EQ(dfa_opt_write_state(h.o, 0, DFA_STATE_EXP_AVG, 0, n, mq.data()), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_write_state(h.o, 0, DFA_STATE_EXP_AVG_SQ, 0, n, vq.data()), DFA_SUCCESS);
  EXPECT_EQ(read(h, 0, 1, n), mq);
  EXPECT_EQ(read(h, 0, 2, n), vq);
  // A range over blocks 4..6 ([256, 448)), ending inside block 6: those blocks are
  // re-encoded with the new values, the others keep their codes.
  std::vector<float> part(100, 5e-3f);
  ASSERT_EQ(dfa_opt_write_state(h.o, 0, DFA_STATE_EXP_AVG, 300, 100, part.data()), DFA_SUCCESS);
  auto expect = mq;
  std::copy(part.begin(), part.end(), expect.begin() + 300);
  const auto blockwise = ref_format(f, expect, false);
  const auto got = read(h, 0, 1, n);
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], i >= 256 && i < 448 ? blockwise[i] : mq[i]) << i;
}

// ---- the step ------------------------------------------------------------------------------

TEST_P(formats, step_equals_the_documented_quantization_of_the_fp32_arithmetic) {
  const std::string f = GetParam();
  handle h(f);
  const std::size_t n0 = 70000, n1 = 333;  // n0 spans several pieces of the 1 MiB window
  auto w0 = randn(n0, 4, 0.05f), w1 = randn(n1, 5, 0.05f);
  auto p0 = bf16_of(w0);
  for (std::size_t i = 0; i < n0; ++i) w0[i] = d::from_bf16(p0[i]);
  auto p1 = w1;
  ASSERT_EQ(dfa_opt_add_shard(h.o, p0.data(), n0, DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_add_shard(h.o, p1.data(), n1, DFA_DTYPE_FP32, 1, nullptr, nullptr), DFA_SUCCESS);
  const dfa_adamw_params g0{1e-2, 0.9, 0.95, 1e-8, 0.1}, g1{3e-3, 0.8, 0.99, 1e-6, 0.0};
  ASSERT_EQ(dfa_opt_set_group(h.o, 0, &g0), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_set_group(h.o, 1, &g1), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  std::vector<float> m0(n0), v0(n0), m1(n1), v1(n1);
  for (int t = 1; t <= 4; ++t) {
    auto g0v = bf16_of(randn(n0, 100 + t, 1e-3f));
    auto g1v = randn(n1, 200 + t, 1e-2f);
    const bool skip1 = t == 2;
    const void* grads[2] = {g0v.data(), skip1 ? nullptr : g1v.data()};
    const int types[2] = {DFA_DTYPE_BF16, DFA_DTYPE_FP32};
    ASSERT_EQ(dfa_opt_step(h.o, grads, 2, types, 1.0f, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
    const auto k0 = d::make_scalars(g0.lr, g0.beta1, g0.beta2, g0.eps, g0.weight_decay, t, 1.0f);
    for (std::size_t i = 0; i < n0; ++i) d::adamw_update(w0[i], m0[i], v0[i], d::from_bf16(g0v[i]), k0);
    const std::uint32_t seed0 = d::step_seed(t, 0);
    m0 = ref_format(f, m0, false), v0 = ref_format(f, v0, true, &seed0);
    if (!skip1) {
      const auto k1 = d::make_scalars(g1.lr, g1.beta1, g1.beta2, g1.eps, g1.weight_decay, t > 2 ? t - 1 : t, 1.0f);
      for (std::size_t i = 0; i < n1; ++i) d::adamw_update(w1[i], m1[i], v1[i], g1v[i], k1);
      const std::uint32_t seed1 = d::step_seed(t > 2 ? t - 1 : t, 1);
      m1 = ref_format(f, m1, false), v1 = ref_format(f, v1, true, &seed1);
    }
    dfa_optimizer_stats st{};
    ASSERT_EQ(dfa_opt_get_stats(h.o, &st), DFA_SUCCESS);
    const std::size_t pieces0 = (n0 + st.piece_elements - 1) / st.piece_elements;
    std::size_t want = 4 * n0;  // main of the BF16 shard (the FP32 parameter is its own main)
    if (f == "bf16") want += 4 * n0 + (skip1 ? 0 : 4 * n1);
    else {
      for (std::size_t k = 0; k < pieces0; ++k) {
        const std::size_t len = std::min(st.piece_elements, n0 - k * st.piece_elements);
        want += 2 * (len + 4 * d::q_blocks(len));
      }
      if (!skip1) want += 2 * (n1 + 4 * d::q_blocks(n1));
    }
    if (t > 1) EXPECT_EQ(st.bytes_to_device, want) << "step " << t;
    EXPECT_EQ(st.bytes_from_device, want) << "step " << t;
  }
  EXPECT_EQ(read(h, 0, 0, n0), w0);
  EXPECT_EQ(read(h, 0, 1, n0), m0);
  EXPECT_EQ(read(h, 0, 2, n0), v0);
  EXPECT_EQ(read(h, 1, 0, n1), w1);
  EXPECT_EQ(read(h, 1, 1, n1), m1);
  EXPECT_EQ(read(h, 1, 2, n1), v1);
  for (std::size_t i = 0; i < n0; ++i) ASSERT_EQ(p0[i], d::to_bf16(w0[i])) << i;
  EXPECT_EQ(p1, w1);
}

TEST_P(formats, checkpoint_records_the_format_and_continues_bit_identically) {
  // Through the checkpoint generations (gen-<N>) and their 32 MiB chunks: shard 1 spans two
  // chunks, so its moments are decoded and encoded in sub-ranges starting on a chunk
  // boundary (whole int8 blocks), on several lanes at once.
  const std::string f = GetParam();
  const dfa_test::temp_dir tmp;  // removed also when an assertion returns early
  const auto dir = std::filesystem::path(tmp.path) / "ckpt";
  const std::size_t n[2] = {3000, (std::size_t{8} << 20) + 1000};
  std::vector<std::uint16_t> pa[2], pb[2];
  for (int s = 0; s < 2; ++s) pa[s] = bf16_of(randn(n[s], 9 + s, 0.1f)), pb[s] = pa[s];
  handle a(f), b(f);
  for (int s = 0; s < 2; ++s) {
    ASSERT_EQ(dfa_opt_add_shard(a.o, pa[s].data(), n[s], DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_add_shard(b.o, pb[s].data(), n[s], DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
  }
  ASSERT_EQ(dfa_opt_initialize(a.o, nullptr), DFA_SUCCESS);
  std::vector<std::uint16_t> g[2][5];
  for (int t = 0; t < 5; ++t)
    for (int s = 0; s < 2; ++s) g[s][t] = bf16_of(randn(n[s], 50 + 2 * t + s, 1e-3f));
  auto step = [&](handle& h, int t) {
    const void* grads[2] = {g[0][t].data(), g[1][t].data()};
    ASSERT_EQ(dfa_opt_step(h.o, grads, 2, nullptr, 1.0f, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  };
  auto same = [&](handle& x, handle& y) {
    for (std::size_t s = 0; s < 2; ++s)
      for (int arr = 0; arr < 3; ++arr) EXPECT_TRUE(read(x, s, arr, n[s]) == read(y, s, arr, n[s])) << s << " " << arr;
  };
  for (int t = 0; t < 3; ++t) step(a, t);
  ASSERT_EQ(dfa_opt_save_checkpoint(a.o, dir.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  std::ifstream man(dir / "gen-1" / "manifest.txt");
  std::string text((std::istreambuf_iterator<char>(man)), {});
  EXPECT_NE(text.find("moment_format " + f + "\n"), std::string::npos) << text;
  // The data files hold the decoded moments: FP32, what read_state returns.
  {
    std::ifstream bin(dir / "gen-1" / "shard-1.bin", std::ios::binary);
    const std::size_t array_bytes = (n[1] * 4 + 4095) / 4096 * 4096;
    std::vector<float> m(n[1]);
    bin.seekg(static_cast<std::streamoff>(array_bytes));
    bin.read(reinterpret_cast<char*>(m.data()), static_cast<std::streamsize>(n[1] * 4));
    ASSERT_TRUE(bin.good());
    EXPECT_TRUE(m == read(a, 1, 1, n[1]));
  }
  ASSERT_EQ(dfa_opt_load_checkpoint(b.o, dir.c_str()), DFA_SUCCESS) << dfa_opt_last_error();  // no state yet: one pass
  same(a, b);
  EXPECT_EQ(pa[0], pb[0]);
  EXPECT_EQ(pa[1], pb[1]);
  for (int t = 3; t < 5; ++t) step(a, t), step(b, t);
  same(a, b);
  EXPECT_EQ(pa[0], pb[0]);
  EXPECT_EQ(pa[1], pb[1]);
  // Into an optimizer with state (verified first, then written in place): back to step 3.
  ASSERT_EQ(dfa_opt_load_checkpoint(a.o, dir.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  ASSERT_EQ(dfa_opt_load_checkpoint(b.o, dir.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  step(a, 3), step(b, 3);
  same(a, b);
  EXPECT_EQ(pa[1], pb[1]);
}

INSTANTIATE_TEST_SUITE_P(host, formats, ::testing::Values("bf16", "int8"));

TEST(moments, other_tiers_refuse_compressed_moments_and_bad_names_are_refused) {
  dfa_optimizer* o = nullptr;
  EXPECT_EQ(dfa_opt_create("driver:host,tier:device,moments:bf16", &o), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dfa_opt_last_error()).find("host or file tier"), std::string::npos) << dfa_opt_last_error();
  EXPECT_EQ(dfa_opt_create("driver:host,tier:host,moments:int4", &o), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dfa_opt_last_error()).find("int4"), std::string::npos) << dfa_opt_last_error();
}

// ---- the file tier (Note [File tier moments], optimizer/store/file_store.cpp) ----------------

// A model of three shards: one over two int8 segments (2^20 elements each) and a partial
// third, one of several pieces of the host tier's window, one smaller than an int8 block.
struct file_model {
  std::vector<std::size_t> n{(std::size_t{2} << 20) + 5000, 70000, 333};
  std::vector<std::vector<std::uint16_t>> p;
  explicit file_model() {
    for (std::size_t s = 0; s < n.size(); ++s) p.push_back(bf16_of(randn(n[s], 30 + s, 0.1f)));
  }
  void add(handle& h) {
    for (std::size_t s = 0; s < n.size(); ++s)
      ASSERT_EQ(dfa_opt_add_shard(h.o, p[s].data(), n[s], DFA_DTYPE_BF16, int(s % 2), nullptr, nullptr), DFA_SUCCESS)
          << dfa_opt_last_error();
    const dfa_adamw_params g1{3e-3, 0.8, 0.99, 1e-6, 0.0};
    ASSERT_EQ(dfa_opt_set_group(h.o, 1, &g1), DFA_SUCCESS);
  }
  // Step t (0-based): shard 2 has no gradient at t == 1 (the shards' step counts differ).
  void step(handle& h, int t) {
    std::vector<std::vector<std::uint16_t>> g;
    std::vector<const void*> gp;
    for (std::size_t s = 0; s < n.size(); ++s) {
      g.push_back(bf16_of(randn(n[s], 500 + 10 * t + s, 1e-3f)));
      gp.push_back(s == 2 && t == 1 ? nullptr : g.back().data());
    }
    ASSERT_EQ(dfa_opt_step(h.o, gp.data(), gp.size(), nullptr, t == 2 ? 0.5f : 1.0f, nullptr), DFA_SUCCESS)
        << dfa_opt_last_error();
  }
  // Every state array and step count of `h`, and the model's BF16 params.
  std::vector<std::vector<float>> state(handle& h) const {
    std::vector<std::vector<float>> out;
    for (std::size_t s = 0; s < n.size(); ++s) {
      for (int a = 0; a < 3; ++a) out.push_back(read(h, s, a, n[s]));
      std::uint64_t st = 0;
      EXPECT_EQ(dfa_opt_get_shard_step(h.o, s, &st), DFA_SUCCESS);
      out.push_back({float(st)});
      out.push_back(std::vector<float>(p[s].begin(), p[s].end()));
    }
    return out;
  }
};

handle::text host_text(const std::string& f) {
  return {"driver:host,host_granularity_kb:64,tier:host,window_mb:1,depth:2,moments:" + f};
}
// int8 pieces are whole 2^20-element segments: a window of 2 slots of 2 MiB-element pieces.
handle::text file_text(const std::string& f, const std::string& dir, bool resume = false) {
  return {"driver:host,host_granularity_kb:64,tier:file,window_mb:48,depth:2,io_threads:2,directory:" + dir +
          ",resume:" + (resume ? "1" : "0") + ",moments:" + f};
}

// The host tier's bits after `steps` steps of the model.
std::vector<std::vector<float>> host_reference(const std::string& f, int steps) {
  file_model m;
  handle h(host_text(f));
  m.add(h);
  EXPECT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  for (int t = 0; t < steps; ++t) m.step(h, t);
  return m.state(h);
}

class file_formats : public ::testing::TestWithParam<std::string> {};

TEST_P(file_formats, file_tier_equals_the_host_tier_bit_for_bit) {
  const std::string f = GetParam();
  const auto ref = host_reference(f, 4);
  const dfa_test::temp_dir tmp;
  file_model m;
  handle h(file_text(f, tmp.path));
  m.add(h);
  ASSERT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  for (int t = 0; t < 4; ++t) m.step(h, t);
  const auto got = m.state(h);
  ASSERT_EQ(got.size(), ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(got[i] == ref[i]) << "array " << i;
  // The state file holds the compressed moments: its slots are smaller than FP32's.
  std::uint64_t numel = 0;
  for (auto n : m.n) numel += n;
  EXPECT_LT(std::filesystem::file_size(tmp.path + "/deferalloc-rank0.state"), 2 * numel * (f == "bf16" ? 9 : 7));
}

// The next step of `h` ends the process (exit status 9) once its pass moved a piece: killed
// while the step has written part of the inactive slot, before its commit.
void die_in_next_step(handle& h) {
  dfa_opt_set_progress(h.o, [](const char* phase, size_t done, size_t, double, void*) {
    if (std::string(phase) == "step" && done > 0) ::_exit(9);
  }, nullptr);
}
// Child `pid`'s exit status once it ended (-1: killed by a signal).
int exit_status(pid_t pid) {
  int st = 0;
  if (::waitpid(pid, &st, 0) != pid) return -2;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// Closed (and killed mid-step) after two steps, resumed, two more: the host tier's bits.
TEST_P(file_formats, resume_after_close_and_after_a_kill_mid_step_continues_bit_identically) {
  const std::string f = GetParam();
  const auto ref = host_reference(f, 4);
  for (const bool kill : {false, true}) {
    const dfa_test::temp_dir tmp;
    if (kill) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        file_model m;
        handle h(file_text(f, tmp.path));
        m.add(h);
        if (dfa_opt_initialize(h.o, nullptr) != DFA_SUCCESS) ::_exit(3);
        for (int t = 0; t < 2; ++t) m.step(h, t);
        die_in_next_step(h);
        m.step(h, 2);
        ::_exit(4);
      }
      ASSERT_EQ(exit_status(pid), 9);
    } else {
      file_model m;
      handle h(file_text(f, tmp.path));
      m.add(h);
      ASSERT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
      for (int t = 0; t < 2; ++t) m.step(h, t);
    }
    file_model m;
    handle h(file_text(f, tmp.path, true));
    m.add(h);
    ASSERT_EQ(dfa_opt_sync_model_params(h.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();  // resumed: the file's state
    std::uint64_t st = 0;
    ASSERT_EQ(dfa_opt_get_shard_step(h.o, 0, &st), DFA_SUCCESS);
    ASSERT_EQ(st, 2u) << (kill ? "killed" : "closed");
    for (int t = 2; t < 4; ++t) m.step(h, t);
    const auto got = m.state(h);
    for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(got[i] == ref[i]) << (kill ? "killed" : "closed") << " array " << i;
  }
}

// A temporary directory with two state-file folders (a/, b/) and a checkpoint's path (ck).
struct two_dirs {
  dfa_test::temp_dir tmp;
  std::string a = tmp.path + "/a", b = tmp.path + "/b", ck = tmp.path + "/ck";
  two_dirs() { std::filesystem::create_directory(a), std::filesystem::create_directory(b); }
};

// A file-tier checkpoint loads into a fresh file tier and into the host tier, and both
// continue as the host tier does.
TEST_P(file_formats, checkpoint_round_trips_between_file_tiers_and_to_the_host_tier) {
  const std::string f = GetParam();
  const auto ref = host_reference(f, 4);
  const two_dirs dirs;
  const std::string &a_dir = dirs.a, &b_dir = dirs.b, &ck = dirs.ck;
  file_model ma, mb, mc;
  handle a(file_text(f, a_dir)), b(file_text(f, b_dir)), c(host_text(f));
  ma.add(a), mb.add(b), mc.add(c);
  ASSERT_EQ(dfa_opt_initialize(a.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  for (int t = 0; t < 2; ++t) ma.step(a, t);
  ASSERT_EQ(dfa_opt_save_checkpoint(a.o, ck.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  ASSERT_EQ(dfa_opt_load_checkpoint(b.o, ck.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  ASSERT_EQ(dfa_opt_load_checkpoint(c.o, ck.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  for (int t = 2; t < 4; ++t) ma.step(a, t), mb.step(b, t), mc.step(c, t);
  const auto ga = ma.state(a), gb = mb.state(b), gc = mc.state(c);
  for (std::size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(ga[i] == ref[i]) << "array " << i;
    EXPECT_TRUE(gb[i] == ref[i]) << "array " << i;
    EXPECT_TRUE(gc[i] == ref[i]) << "array " << i;
  }
  // Into a file tier with state (back to step 2, through the inactive slot), then on.
  ASSERT_EQ(dfa_opt_load_checkpoint(a.o, ck.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  for (int t = 2; t < 4; ++t) ma.step(a, t);
  const auto again = ma.state(a);
  for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(again[i] == ref[i]) << "array " << i;
}

// State ranges (whole arrays on the file tier): written moments read back as the host
// tier encodes them; the publish carries the arrays not written unchanged.
TEST_P(file_formats, state_writes_encode_as_the_host_tier_and_carry_the_rest) {
  const std::string f = GetParam();
  const dfa_test::temp_dir tmp;
  file_model mf, mh;
  handle fh(file_text(f, tmp.path)), hh(host_text(f));
  mf.add(fh), mh.add(hh);
  for (handle* h : {&fh, &hh}) ASSERT_EQ(dfa_opt_initialize(h->o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  for (int t = 0; t < 2; ++t) mf.step(fh, t), mh.step(hh, t);
  auto m0 = randn(mf.n[0], 77, 1e-3f);
  for (handle* h : {&fh, &hh})
    ASSERT_EQ(dfa_opt_write_state(h->o, 0, DFA_STATE_EXP_AVG, 0, mf.n[0], m0.data()), DFA_SUCCESS) << dfa_opt_last_error();
  const auto gf = mf.state(fh), gh = mh.state(hh);
  for (std::size_t i = 0; i < gh.size(); ++i) EXPECT_TRUE(gf[i] == gh[i]) << "array " << i;
}

INSTANTIATE_TEST_SUITE_P(file, file_formats, ::testing::Values("bf16", "int8"));

// A state file written with one format is refused by an optimizer with another, naming
// both formats and the file, before anything changes.
// int8 on the file tier moves pieces of 2^20 elements: a window too small for them says
// so, with what it needs.
TEST(moments, int8_file_tier_window_too_small_says_why) {
  const dfa_test::temp_dir tmp;
  dfa_optimizer* o = nullptr;
  const std::string t = "driver:host,host_granularity_kb:64,tier:file,window_mb:8,depth:1,directory:" + tmp.path +
                        ",moments:int8";
  EXPECT_EQ(dfa_opt_create(t.c_str(), &o), DFA_ERROR_INVALID_ARGUMENT);
  const std::string e = dfa_opt_last_error();
  EXPECT_NE(e.find("window_mb 8 is too small: 1 piece in flight needs at least 12 MiB"), std::string::npos) << e;
  EXPECT_NE(e.find("pieces of 2^20 elements"), std::string::npos) << e;
  if (o) dfa_opt_destroy(o);
}

TEST(moments, file_tier_refuses_a_state_file_of_another_format) {
  const dfa_test::temp_dir tmp;
  const std::string file = tmp.path + "/deferalloc-rank0.state";
  for (const std::string written : {"fp32", "bf16", "int8"}) {
    std::filesystem::remove(file);
    file_model m;
    {
      handle h(file_text(written, tmp.path));
      m.add(h);
      ASSERT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
      m.step(h, 0);
    }
    const auto before = std::filesystem::file_size(file);
    for (const std::string other : {"fp32", "bf16", "int8"}) {
      if (other == written) continue;
      handle h(file_text(other, tmp.path, true));
      m.add(h);
      EXPECT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_ERROR_INVALID_ARGUMENT) << written << " -> " << other;
      const std::string e = dfa_opt_last_error();
      EXPECT_NE(e.find("holds moments in " + written), std::string::npos) << e;
      EXPECT_NE(e.find("configured with moment format " + other), std::string::npos) << e;
      EXPECT_NE(e.find(file), std::string::npos) << e;
    }
    EXPECT_EQ(std::filesystem::file_size(file), before);
    handle h(file_text(written, tmp.path, true));  // its own format still resumes
    m.add(h);
    ASSERT_EQ(dfa_opt_sync_model_params(h.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
    std::uint64_t st = 0;
    ASSERT_EQ(dfa_opt_get_shard_step(h.o, 0, &st), DFA_SUCCESS);
    EXPECT_EQ(st, 1u);
  }
}

// ---- convergence -----------------------------------------------------------------------------

// 300 steps of noisy least squares with curvatures over four orders of magnitude in every
// 97 elements (the loss falls from 5.3 to a noise floor near 0.0055): BF16 and int8 moments
// reach FP32 moments' floor within 3% (measured: bf16 -0.04% (-1.5% with v to nearest), int8 +0.6%; int8 with sqrt(v)
// rounded to nearest settled 14% higher: an element's v then cannot decay below its code,
// see Note [Moment formats]).
double train(const std::string& f) {
  handle h(f);
  const std::size_t n = 4096;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> w(n), target(n), curv(n);
  for (std::size_t i = 0; i < n; ++i) target[i] = nd(rng), curv[i] = std::pow(10.0f, -2.0f + 4.0f * float(i % 97) / 96);
  EXPECT_EQ(dfa_opt_add_shard(h.o, w.data(), n, DFA_DTYPE_FP32, 0, nullptr, nullptr), DFA_SUCCESS);
  const dfa_adamw_params hp{3e-2, 0.9, 0.999, 1e-8, 0.0};
  EXPECT_EQ(dfa_opt_set_group(h.o, 0, &hp), DFA_SUCCESS);
  EXPECT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS);
  std::vector<float> g(n);
  double tail = 0;  // the mean loss over the last 50 steps (one step's loss is noisy)
  for (int t = 0; t < 300; ++t) {
    double loss = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const float r = w[i] - target[i];
      loss += 0.5 * curv[i] * r * r / n;
      g[i] = curv[i] * r + 0.1f * curv[i] * nd(rng);
    }
    const void* grads[1] = {g.data()};
    EXPECT_EQ(dfa_opt_step(h.o, grads, 1, nullptr, 1.0f, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
    if (t >= 250) tail += loss / 50;
  }
  return tail;
}

TEST(moments, short_training_converges_like_fp32_moments) {
  const double l32 = train("fp32"), l16 = train("bf16"), l8 = train("int8");
  std::printf("noise floor (mean loss of the last 50 steps): fp32 %.6f bf16 %.6f int8 %.6f\n", l32, l16, l8);
  EXPECT_LT(l32, 0.01) << "the reference run did not converge";
  EXPECT_LT(std::fabs(l16 - l32), 0.03 * l32) << "fp32 " << l32 << " bf16 " << l16;
  EXPECT_LT(std::fabs(l8 - l32), 0.03 * l32) << "fp32 " << l32 << " int8 " << l8;
}

}  // namespace

// ---- resident shards (Note [Resident shards]) ------------------------------------------------

namespace {

struct model3 {
  // Several pieces; 70000 elements fit 1 MiB (3 x 320 KiB), 100000 do not.
  explicit model3(std::size_t n0 = 70000) : p0(bf16_of(randn(n0, 21, 0.05f))) {}
  std::vector<std::uint16_t> p0;
  std::vector<float> p1 = randn(5000, 22, 0.05f);
  std::vector<std::uint16_t> p2 = bf16_of(randn(333, 23, 0.05f));
  void add(handle& h) {
    add_shards(h);
    ASSERT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  }
  // The shards and group 1, no initialize() (a resumed state file).
  void add_shards(handle& h) {
    ASSERT_EQ(dfa_opt_add_shard(h.o, p0.data(), p0.size(), DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_add_shard(h.o, p1.data(), p1.size(), DFA_DTYPE_FP32, 1, nullptr, nullptr), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_add_shard(h.o, p2.data(), p2.size(), DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
    const dfa_adamw_params g1{3e-3, 0.8, 0.99, 1e-6, 0.0};
    ASSERT_EQ(dfa_opt_set_group(h.o, 1, &g1), DFA_SUCCESS);
  }
  void step(handle& h, int t) {
    auto g0 = bf16_of(randn(p0.size(), 300 + t, 1e-3f)), g2 = bf16_of(randn(p2.size(), 500 + t, 1e-3f));
    auto g1 = randn(p1.size(), 400 + t, 1e-3f);
    const void* grads[3] = {g0.data(), t == 1 ? nullptr : g1.data(), g2.data()};
    const int types[3] = {DFA_DTYPE_BF16, DFA_DTYPE_FP32, DFA_DTYPE_BF16};
    ASSERT_EQ(dfa_opt_step(h.o, grads, 3, types, 0.5f, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  }
};

}  // namespace

TEST(resident, a_resident_split_is_bit_identical_to_all_streamed) {
  handle all("fp32"), split("fp32", ",resident_mb:1");
  model3 a, b;
  a.add(all);
  b.add(split);
  for (int t = 0; t < 4; ++t) a.step(all, t), b.step(split, t);
  dfa_optimizer_stats sa{}, sb{};
  ASSERT_EQ(dfa_opt_get_stats(all.o, &sa), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_get_stats(split.o, &sb), DFA_SUCCESS);
  // Shard 1's FP32 parameter is its own main: its moments stream alone (8 B/param).
  EXPECT_EQ(sa.bytes_to_device, 12 * 70000 + 8 * 5000 + 12 * 333);
  // A resident shard costs its three arrays rounded up to the 64 KiB granule: shard 0
  // takes 3 x 320 KiB of the 1 MiB and stays resident; shards 1 and 2 (64 KiB per array) stream.
  EXPECT_EQ(sb.bytes_to_device, 8 * 5000u + 12 * 333u) << "shard 0 fits 1 MiB and stays resident; shards 1 and 2 stream";
  const std::size_t n[3] = {70000, 5000, 333};
  for (std::size_t s = 0; s < 3; ++s)
    for (int arr = 0; arr < 3; ++arr) EXPECT_EQ(read(all, s, arr, n[s]), read(split, s, arr, n[s])) << s << " " << arr;
  EXPECT_EQ(a.p0, b.p0);
  EXPECT_EQ(a.p1, b.p1);
  EXPECT_EQ(a.p2, b.p2);
  // One checkpoint: the split's loads into an all-streamed optimizer and both continue alike.
  const dfa_test::temp_dir tmp;  // removed also when an assertion returns early
  const auto dir = std::filesystem::path(tmp.path) / "ckpt";
  ASSERT_EQ(dfa_opt_save_checkpoint(split.o, dir.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  handle again("fp32");
  model3 c;
  c.add(again);
  ASSERT_EQ(dfa_opt_load_checkpoint(again.o, dir.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  for (std::size_t s = 0; s < 3; ++s)
    for (int arr = 0; arr < 3; ++arr) EXPECT_EQ(read(again, s, arr, n[s]), read(split, s, arr, n[s])) << s;
  for (std::size_t s = 0; s < 3; ++s) {  // the checkpoint keeps one step count; shard 1 skipped one
    std::uint64_t st = 0;
    ASSERT_EQ(dfa_opt_get_shard_step(split.o, s, &st), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_set_shard_step(again.o, s, st), DFA_SUCCESS);
  }
  b.step(split, 9), c.step(again, 9);
  EXPECT_EQ(b.p0, c.p0);
  EXPECT_EQ(b.p1, c.p1);
  EXPECT_EQ(b.p2, c.p2);
}

TEST(resident, the_device_tier_and_compressed_file_moments_refuse_a_resident_budget) {
  dfa_optimizer* o = nullptr;
  EXPECT_EQ(dfa_opt_create("driver:host,tier:device,resident_mb:4", &o), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dfa_opt_last_error()).find("host or file tier"), std::string::npos) << dfa_opt_last_error();
  // The file tier takes a budget (Note [Resident shards on the file tier]), with fp32 moments only.
  const dfa_test::temp_dir tmp;
  for (const char* f : {"bf16", "int8"}) {
    const std::string text = std::string("driver:host,tier:file,window_mb:48,resident_mb:4,directory:") + tmp.path +
                             ",moments:" + f;
    EXPECT_EQ(dfa_opt_create(text.c_str(), &o), DFA_ERROR_INVALID_ARGUMENT) << f;
    EXPECT_NE(std::string(dfa_opt_last_error()).find("needs fp32 moments"), std::string::npos) << dfa_opt_last_error();
  }
}

// ---- resident shards on the file tier (Note [Resident shards on the file tier]) -------------

handle::text resident_file_text(const std::string& dir, const char* resident_mb, bool resume = false) {
  return {std::string("driver:host,host_granularity_kb:64,tier:file,window_mb:1,depth:2,io_threads:2,directory:") +
          dir + ",resume:" + (resume ? "1" : "0") + ",resident_mb:" + resident_mb};
}

// Every state array and step count of `h`, and the model's parameters.
std::vector<std::vector<float>> state3(handle& h, const model3& m) {
  std::vector<std::vector<float>> out;
  const std::size_t n[3] = {m.p0.size(), m.p1.size(), m.p2.size()};
  for (std::size_t s = 0; s < 3; ++s) {
    for (int arr = 0; arr < 3; ++arr) out.push_back(read(h, s, arr, n[s]));
    std::uint64_t st = 0;
    EXPECT_EQ(dfa_opt_get_shard_step(h.o, s, &st), DFA_SUCCESS);
    out.push_back({float(st)});
  }
  out.push_back(std::vector<float>(m.p0.begin(), m.p0.end()));
  out.push_back(m.p1);
  out.push_back(std::vector<float>(m.p2.begin(), m.p2.end()));
  return out;
}

// The host tier, all streamed, after `steps` steps of model3(n0).
std::vector<std::vector<float>> streamed_reference(std::size_t n0, int steps) {
  handle h("fp32");
  model3 m(n0);
  m.add(h);
  for (int t = 0; t < steps; ++t) m.step(h, t);
  return state3(h, m);
}

// Shard 0 resident (70000 elements) or shards 1 (an FP32 parameter) and 2 (100000).
class file_resident : public ::testing::TestWithParam<std::size_t> {};

TEST_P(file_resident, steps_bit_identically_and_streams_only_the_other_shards) {
  const std::size_t n0 = GetParam();
  const auto ref = streamed_reference(n0, 4);
  const dfa_test::temp_dir tmp;
  handle h(resident_file_text(tmp.path, "1"));
  model3 m(n0);
  m.add(h);
  for (int t = 0; t < 4; ++t) m.step(h, t);
  EXPECT_TRUE(state3(h, m) == ref) << "file tier with resident shards vs host tier all streamed";
  dfa_optimizer_stats st{};
  ASSERT_EQ(dfa_opt_get_stats(h.o, &st), DFA_SUCCESS);
  EXPECT_EQ(st.bytes_to_device, n0 == 70000 ? 8 * 5000u + 12 * 333u : 12 * n0) << "the resident shards read no link bytes";
}

// Closed, or killed mid-step (after its resident shards were stepped in HBM, before the
// commit), after two steps; resumed with and without a resident budget: two more steps
// give the host tier's bits.
TEST_P(file_resident, resume_after_close_and_after_a_kill_mid_step_continues_bit_identically) {
  const std::size_t n0 = GetParam();
  const auto ref = streamed_reference(n0, 4);
  for (const bool kill : {false, true})
    for (const char* again : {"1", "0"}) {
      const dfa_test::temp_dir tmp;
      const pid_t pid = ::fork();
      if (pid == 0) {
        handle h(resident_file_text(tmp.path, "1"));
        model3 m(n0);
        m.add(h);
        for (int t = 0; t < 2; ++t) m.step(h, t);
        if (!kill) ::_exit(0);
        die_in_next_step(h);
        m.step(h, 2);
        ::_exit(4);
      }
      ASSERT_EQ(exit_status(pid), kill ? 9 : 0);
      handle h(resident_file_text(tmp.path, again, true));
      model3 m(n0);  // the same values: the FP32 parameter must come from the file
      std::fill(m.p1.begin(), m.p1.end(), 7.0f);
      m.add_shards(h);
      ASSERT_EQ(dfa_opt_sync_model_params(h.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
      std::uint64_t step0 = 0;
      ASSERT_EQ(dfa_opt_get_shard_step(h.o, 0, &step0), DFA_SUCCESS);
      ASSERT_EQ(step0, 2u);
      for (int t = 2; t < 4; ++t) m.step(h, t);
      EXPECT_TRUE(state3(h, m) == ref) << (kill ? "killed" : "closed") << ", resumed with resident_mb " << again;
    }
}

// A checkpoint of a file tier with resident shards loads into the host tier and into
// another file tier with resident shards; all continue alike.
TEST_P(file_resident, checkpoint_round_trips_to_the_host_tier_and_another_file_tier) {
  const std::size_t n0 = GetParam();
  const auto ref = streamed_reference(n0, 4);
  const two_dirs dirs;
  const std::string &a_dir = dirs.a, &b_dir = dirs.b, &ck = dirs.ck;
  handle a(resident_file_text(a_dir, "1")), b(resident_file_text(b_dir, "1")), c("fp32");
  model3 ma(n0), mb(n0), mc(n0);
  ma.add(a), mb.add(b), mc.add(c);
  for (int t = 0; t < 2; ++t) ma.step(a, t);
  mb.step(b, 0);  // state to be replaced
  ASSERT_EQ(dfa_opt_save_checkpoint(a.o, ck.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  ASSERT_EQ(dfa_opt_load_checkpoint(b.o, ck.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  ASSERT_EQ(dfa_opt_load_checkpoint(c.o, ck.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  for (std::size_t s = 0; s < 3; ++s) {  // the checkpoint keeps one step count; shard 1 skipped one
    std::uint64_t st = 0;
    ASSERT_EQ(dfa_opt_get_shard_step(a.o, s, &st), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_set_shard_step(b.o, s, st), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_set_shard_step(c.o, s, st), DFA_SUCCESS);
  }
  for (int t = 2; t < 4; ++t) ma.step(a, t), mb.step(b, t), mc.step(c, t);
  EXPECT_TRUE(state3(a, ma) == ref) << "saved";
  EXPECT_TRUE(state3(b, mb) == ref) << "loaded into a file tier with resident shards";
  EXPECT_TRUE(state3(c, mc) == ref) << "loaded into the host tier";
  // b's state file holds what b's HBM does: a resume of it (b closed: one optimizer per
  // state file) continues alike.
  ASSERT_EQ(dfa_opt_destroy(b.o), DFA_SUCCESS);
  b.o = nullptr;
  handle r(resident_file_text(b_dir, "1", true));
  model3 mr(n0);
  mr.add_shards(r);
  ASSERT_EQ(dfa_opt_sync_model_params(r.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  EXPECT_TRUE(state3(r, mr) == ref) << "resumed from the loaded file tier";
}

// A state write of a resident shard: dropped, HBM keeps the committed values; published,
// the state file holds the new ones.
TEST_P(file_resident, state_writes_reach_the_state_file_and_dropped_ones_leave_hbm) {
  const std::size_t n0 = GetParam();
  const std::size_t s = n0 == 70000 ? 0 : 2;  // a resident shard
  const dfa_test::temp_dir tmp;
  handle h(resident_file_text(tmp.path, "1"));
  model3 m(n0);
  m.add(h);
  m.step(h, 0);
  const std::size_t n = s == 0 ? n0 : m.p2.size();
  const auto before = read(h, s, DFA_STATE_EXP_AVG, n);
  const std::vector<float> mine(n, 0.25f);
  ASSERT_EQ(dfa_opt_begin_state_write(h.o), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_write_state(h.o, s, DFA_STATE_EXP_AVG, 0, n, mine.data()), DFA_SUCCESS) << dfa_opt_last_error();
  ASSERT_EQ(dfa_opt_end_state_write(h.o, 0), DFA_SUCCESS);
  EXPECT_TRUE(read(h, s, DFA_STATE_EXP_AVG, n) == before) << "dropped";
  ASSERT_EQ(dfa_opt_write_state(h.o, s, DFA_STATE_EXP_AVG, 0, n, mine.data()), DFA_SUCCESS) << dfa_opt_last_error();
  EXPECT_TRUE(read(h, s, DFA_STATE_EXP_AVG, n) == mine) << "published by the read";
  ASSERT_EQ(dfa_opt_destroy(h.o), DFA_SUCCESS);
  h.o = nullptr;
  handle r(resident_file_text(tmp.path, "1", true));
  model3 mr(n0);
  mr.add_shards(r);
  EXPECT_TRUE(read(r, s, DFA_STATE_EXP_AVG, n) == mine) << "resumed";
}

INSTANTIATE_TEST_SUITE_P(shards, file_resident, ::testing::Values(std::size_t{70000}, std::size_t{100000}));
