// The optimizer's C ABI (include/deferalloc/optimizer.h) on the host driver: the
// settings string, groups, skipped shards, state ranges, per-shard steps, checkpoints,
// progress, statistics, and every error reported as a status with a message.
#include <deferalloc/optimizer.h>
#include <gtest/gtest.h>

#include "../optimizer/kernels/adamw_math.hpp"
#include "common.hpp"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace {

namespace d = deferalloc::optim::detail;

constexpr const char* k_settings = "driver:host,host_granularity_kb:64,tier:host,window_mb:1,depth:2";

struct handle {
  dfa_optimizer* o = nullptr;
  explicit handle(const char* s = k_settings) { EXPECT_EQ(dfa_opt_create(s, &o), DFA_SUCCESS) << dfa_opt_last_error(); }
  ~handle() { EXPECT_EQ(dfa_opt_destroy(o), DFA_SUCCESS); }
};

std::vector<std::uint16_t> random_bf16(std::size_t n, unsigned seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = d::to_bf16(nd(rng));
  return v;
}

TEST(optimizer_c_api, groups_skips_and_state_match_the_shared_arithmetic) {
  handle h;
  const std::size_t n0 = 70000, n1 = 333;  // n0 spans several pieces of a 1 MiB window
  auto p0 = random_bf16(n0, 1, 1.0f);
  std::vector<float> p1(n1);
  for (std::size_t i = 0; i < n1; ++i) p1[i] = std::sin(float(i));
  const auto p0_start = p0;
  const auto p1_start = p1;
  std::size_t i0 = 9, i1 = 9;
  ASSERT_EQ(dfa_opt_add_shard(h.o, p0.data(), n0, DFA_DTYPE_BF16, 0, "w", &i0), DFA_SUCCESS) << dfa_opt_last_error();
  ASSERT_EQ(dfa_opt_add_shard(h.o, p1.data(), n1, DFA_DTYPE_FP32, 1, nullptr, &i1), DFA_SUCCESS);
  EXPECT_EQ(i0, 0u);
  EXPECT_EQ(i1, 1u);
  const dfa_adamw_params g0{1e-2, 0.9, 0.95, 1e-8, 0.1}, g1{3e-3, 0.8, 0.99, 1e-6, 0.0};
  ASSERT_EQ(dfa_opt_set_group(h.o, 0, &g0), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_set_group(h.o, 1, &g1), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();

  // Reference state, stepped with the same element arithmetic.
  std::vector<float> m0(n0), v0(n0), w0(n0), m1(n1), v1(n1), w1 = p1_start;
  for (std::size_t i = 0; i < n0; ++i) w0[i] = d::from_bf16(p0_start[i]);
  std::uint64_t t0 = 0, t1 = 0;
  for (int t = 0; t < 4; ++t) {
    auto g0v = random_bf16(n0, 100 + t, 1.0f);
    std::vector<std::uint16_t> g1v = random_bf16(n1, 200 + t, 2.0f);  // BF16 gradient of an FP32 param
    const bool skip1 = t == 1;
    const void* grads[2] = {g0v.data(), skip1 ? nullptr : g1v.data()};
    const int types[2] = {DFA_DTYPE_BF16, DFA_DTYPE_BF16};
    ASSERT_EQ(dfa_opt_step(h.o, grads, 2, types, 1.0f, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
    const auto k0 = d::make_scalars(g0.lr, g0.beta1, g0.beta2, g0.eps, g0.weight_decay, ++t0, 1.0f);
    for (std::size_t i = 0; i < n0; ++i) d::adamw_update(w0[i], m0[i], v0[i], d::from_bf16(g0v[i]), k0);
    if (!skip1) {
      const auto k1 = d::make_scalars(g1.lr, g1.beta1, g1.beta2, g1.eps, g1.weight_decay, ++t1, 1.0f);
      for (std::size_t i = 0; i < n1; ++i) d::adamw_update(w1[i], m1[i], v1[i], d::from_bf16(g1v[i]), k1);
    }
  }
  std::uint64_t s0 = 0, s1 = 0;
  ASSERT_EQ(dfa_opt_get_shard_step(h.o, 0, &s0), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_get_shard_step(h.o, 1, &s1), DFA_SUCCESS);
  EXPECT_EQ(s0, 4u);
  EXPECT_EQ(s1, 3u) << "a skipped shard keeps its step";
  std::vector<float> got(n0);
  ASSERT_EQ(dfa_opt_read_state(h.o, 0, DFA_STATE_EXP_AVG_SQ, 0, n0, got.data()), DFA_SUCCESS);
  EXPECT_EQ(got, v0);
  ASSERT_EQ(dfa_opt_read_state(h.o, 0, DFA_STATE_MAIN, 0, n0, got.data()), DFA_SUCCESS);
  EXPECT_EQ(got, w0);
  for (std::size_t i = 0; i < n0; ++i) ASSERT_EQ(p0[i], d::to_bf16(w0[i])) << i;
  EXPECT_EQ(p1, w1) << "an FP32 parameter equals its main copy";
  std::vector<float> part(10);
  ASSERT_EQ(dfa_opt_read_state(h.o, 1, DFA_STATE_EXP_AVG, 5, 10, part.data()), DFA_SUCCESS);
  EXPECT_EQ(part, std::vector<float>(m1.begin() + 5, m1.begin() + 15));

  dfa_optimizer_stats st{};
  ASSERT_EQ(dfa_opt_get_stats(h.o, &st), DFA_SUCCESS);
  EXPECT_EQ(st.steps, 4u);
  EXPECT_EQ(st.shards, 2u);
  EXPECT_EQ(st.params, n0 + n1);
  EXPECT_EQ(st.bytes_to_device, 12 * n0 + 8 * n1) << "an FP32 parameter is its own main: only its moments move";
  EXPECT_LE(st.peak_backed_bytes, std::size_t{1} << 20);
  EXPECT_GT(st.pieces, 2u);
}

TEST(optimizer_c_api, write_state_then_continue_like_a_fresh_copy) {
  const std::size_t n = 5000;
  auto pa = random_bf16(n, 7, 1.0f), pb = random_bf16(n, 8, 1.0f);
  handle a, b;
  ASSERT_EQ(dfa_opt_add_shard(a.o, pa.data(), n, DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_add_shard(b.o, pb.data(), n, DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_initialize(a.o, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_initialize(b.o, nullptr), DFA_SUCCESS);
  auto g = random_bf16(n, 9, 1.0f);
  const void* grads[1] = {g.data()};
  for (int t = 0; t < 2; ++t) ASSERT_EQ(dfa_opt_step(a.o, grads, 1, nullptr, 0.5f, nullptr), DFA_SUCCESS);
  // b takes a's state in two halves per array, and a's step.
  std::vector<float> buf(n);
  for (int arr = 0; arr < 3; ++arr) {
    ASSERT_EQ(dfa_opt_read_state(a.o, 0, dfa_state_array(arr), 0, n, buf.data()), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_write_state(b.o, 0, dfa_state_array(arr), 0, n / 2, buf.data()), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_write_state(b.o, 0, dfa_state_array(arr), n / 2, n - n / 2, buf.data() + n / 2), DFA_SUCCESS);
  }
  ASSERT_EQ(dfa_opt_set_shard_step(b.o, 0, 2), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_sync_model_params(b.o, nullptr), DFA_SUCCESS);
  EXPECT_EQ(pa, pb);
  ASSERT_EQ(dfa_opt_step(a.o, grads, 1, nullptr, 0.5f, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_step(b.o, grads, 1, nullptr, 0.5f, nullptr), DFA_SUCCESS);
  EXPECT_EQ(pa, pb) << "the third step continues bit-identically";
}

TEST(optimizer_c_api, speculative_step_commit_and_discard) {
  const std::size_t n = 70000;
  auto pa = random_bf16(n, 7, 1.0f), pb = pa;
  handle a, b;
  ASSERT_EQ(dfa_opt_add_shard(a.o, pa.data(), n, DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_add_shard(b.o, pb.data(), n, DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_initialize(a.o, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_initialize(b.o, nullptr), DFA_SUCCESS);
  int can = -1;
  ASSERT_EQ(dfa_opt_can_speculate(b.o, 0, &can), DFA_SUCCESS) << dfa_opt_last_error();
  EXPECT_EQ(can, 1);
  EXPECT_EQ(dfa_opt_can_speculate(b.o, 1, &can), DFA_ERROR_INVALID_ARGUMENT);
  std::size_t pending = 9;
  for (int t = 0; t < 3; ++t) {
    auto g = random_bf16(n, 20 + t, 1.0f);
    const void* grads[1] = {g.data()};
    ASSERT_EQ(dfa_opt_step(a.o, grads, 1, nullptr, 0.5f, nullptr), DFA_SUCCESS);
    // b: a speculation with the wrong scale, discarded; then the right one, committed.
    std::vector<float> before(n), now(n);
    ASSERT_EQ(dfa_opt_read_state(b.o, 0, DFA_STATE_EXP_AVG, 0, n, before.data()), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_step_speculative(b.o, grads, 1, nullptr, 1.0f, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
    ASSERT_EQ(dfa_opt_speculation_pending(b.o, &pending), DFA_SUCCESS);
    EXPECT_EQ(pending, 1u);
    EXPECT_EQ(dfa_opt_step(b.o, grads, 1, nullptr, 0.5f, nullptr), DFA_ERROR_INVALID_STATE);
    EXPECT_NE(std::string(dfa_opt_last_error()).find("pending speculative step"), std::string::npos)
        << dfa_opt_last_error();
    EXPECT_EQ(dfa_opt_write_state(b.o, 0, DFA_STATE_MAIN, 0, 1, before.data()), DFA_ERROR_INVALID_STATE);
    EXPECT_EQ(dfa_opt_set_shard_step(b.o, 0, 5), DFA_ERROR_INVALID_STATE);
    ASSERT_EQ(dfa_opt_discard_speculation(b.o), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_read_state(b.o, 0, DFA_STATE_EXP_AVG, 0, n, now.data()), DFA_SUCCESS);
    EXPECT_EQ(now, before) << "discard keeps the state";
    ASSERT_EQ(dfa_opt_step_speculative(b.o, grads, 1, nullptr, 0.5f, nullptr), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_commit_speculation(b.o), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_speculation_pending(b.o, &pending), DFA_SUCCESS);
    EXPECT_EQ(pending, 0u);
    EXPECT_EQ(pa, pb) << "step " << t;
  }
  std::uint64_t sa = 0, sb = 0;
  ASSERT_EQ(dfa_opt_get_shard_step(a.o, 0, &sa), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_get_shard_step(b.o, 0, &sb), DFA_SUCCESS);
  EXPECT_EQ(sb, sa);
  for (int arr = 0; arr < 3; ++arr) {
    std::vector<float> x(n), y(n);
    ASSERT_EQ(dfa_opt_read_state(a.o, 0, dfa_state_array(arr), 0, n, x.data()), DFA_SUCCESS);
    ASSERT_EQ(dfa_opt_read_state(b.o, 0, dfa_state_array(arr), 0, n, y.data()), DFA_SUCCESS);
    EXPECT_EQ(x, y) << "array " << arr;
  }
  handle dev("driver:host,tier:device");
  ASSERT_EQ(dfa_opt_add_shard(dev.o, pa.data(), n, DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_initialize(dev.o, nullptr), DFA_SUCCESS);
  auto g = random_bf16(n, 40, 1.0f);
  const void* grads[1] = {g.data()};
  EXPECT_EQ(dfa_opt_step_speculative(dev.o, grads, 1, nullptr, 1.0f, nullptr), DFA_ERROR_INVALID_STATE);
  EXPECT_NE(std::string(dfa_opt_last_error()).find("host tier"), std::string::npos) << dfa_opt_last_error();
  EXPECT_EQ(dfa_opt_speculation_pending(dev.o, nullptr), DFA_ERROR_INVALID_ARGUMENT);
}

TEST(optimizer_c_api, checkpoint_and_progress) {
  const std::size_t n = 3000;
  auto p = random_bf16(n, 3, 1.0f);
  handle h;
  ASSERT_EQ(dfa_opt_add_shard(h.o, p.data(), n, DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
  int calls = 0;
  ASSERT_EQ(dfa_opt_set_progress(
                h.o, [](const char*, size_t, size_t, double, void* u) { ++*static_cast<int*>(u); }, &calls),
            DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS);
  EXPECT_GT(calls, 0);
  auto g = random_bf16(n, 4, 1.0f);
  const void* grads[1] = {g.data()};
  ASSERT_EQ(dfa_opt_step(h.o, grads, 1, nullptr, 1.0f, nullptr), DFA_SUCCESS);
  const dfa_test::temp_dir tmp;  // removed also when an assertion returns early
  const auto dir = std::filesystem::path(tmp.path) / "ckpt";
  ASSERT_EQ(dfa_opt_save_checkpoint(h.o, dir.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  const auto saved = p;
  ASSERT_EQ(dfa_opt_step(h.o, grads, 1, nullptr, 1.0f, nullptr), DFA_SUCCESS);
  EXPECT_NE(p, saved);
  ASSERT_EQ(dfa_opt_load_checkpoint(h.o, dir.c_str()), DFA_SUCCESS) << dfa_opt_last_error();
  EXPECT_EQ(p, saved);
}

TEST(optimizer_c_api, errors_are_statuses_with_messages) {
  dfa_optimizer* o = nullptr;
  EXPECT_EQ(dfa_opt_create("driver:host,tier:disk", &o), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dfa_opt_last_error()).find("disk"), std::string::npos) << dfa_opt_last_error();
  EXPECT_EQ(dfa_opt_create("driver:host,colour:blue", &o), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dfa_opt_last_error()).find("window_mb"), std::string::npos) << "lists the optimizer keys";
  EXPECT_EQ(dfa_opt_create("driver:host,tier:file", &o), DFA_ERROR_INVALID_ARGUMENT) << "file tier without directory";
  EXPECT_EQ(dfa_opt_create(k_settings, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(o, nullptr);

  handle h;
  std::vector<std::uint16_t> p(100, 0x3F80);
  EXPECT_EQ(dfa_opt_add_shard(h.o, nullptr, 100, DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_opt_add_shard(h.o, p.data(), 100, dfa_dtype(7), 0, nullptr, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  // The ABI converts the enum and the C++ call checks it (Note [Arguments are checked where they enter]).
  EXPECT_STREQ(dfa_opt_last_error(), "dfa_opt_add_shard: add_shard: unknown parameter type 7");
  EXPECT_EQ(dfa_opt_add_shard(h.o, p.data(), 100, DFA_DTYPE_BF16, -1, nullptr, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  const void* none[1] = {nullptr};
  EXPECT_EQ(dfa_opt_step(h.o, none, 1, nullptr, 1.0f, nullptr), DFA_ERROR_INVALID_ARGUMENT) << "no shard yet";
  EXPECT_STREQ(dfa_opt_last_error(), "dfa_opt_step: step: 1 gradients for 0 shards");
  EXPECT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_ERROR_INVALID_STATE) << "no shard";
  ASSERT_EQ(dfa_opt_add_shard(h.o, p.data(), 100, DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
  EXPECT_EQ(dfa_opt_step(h.o, none, 1, nullptr, 1.0f, nullptr), DFA_ERROR_INVALID_STATE) << "before initialize";
  float out[4];
  EXPECT_EQ(dfa_opt_read_state(h.o, 0, DFA_STATE_MAIN, 0, 4, out), DFA_ERROR_INVALID_STATE);
  for (const dfa_adamw_params bad : {dfa_adamw_params{-1e-3, 0.9, 0.999, 1e-8, 0.0}, dfa_adamw_params{NAN, 0.9, 0.999, 1e-8, 0.0},
                                     dfa_adamw_params{1e-3, 1.0, 0.999, 1e-8, 0.0}, dfa_adamw_params{1e-3, 0.9, -0.5, 1e-8, 0.0},
                                     dfa_adamw_params{1e-3, 0.9, 0.999, -1.0, 0.0}, dfa_adamw_params{1e-3, 0.9, 0.999, 1e-8, -0.1}}) {
    EXPECT_EQ(dfa_opt_set_group(h.o, 0, &bad), DFA_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(dfa_opt_last_error()).find("dfa_opt_set_group: adamw: invalid"), std::string::npos)
        << dfa_opt_last_error();
  }
  EXPECT_EQ(dfa_opt_set_group(h.o, 0, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS);
  EXPECT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_ERROR_INVALID_STATE);
  EXPECT_EQ(dfa_opt_step(h.o, none, 2, nullptr, 1.0f, nullptr), DFA_ERROR_INVALID_ARGUMENT) << "count";
  EXPECT_STREQ(dfa_opt_last_error(), "dfa_opt_step: step: 2 gradients for 1 shards");
  EXPECT_EQ(dfa_opt_step(h.o, nullptr, 1, nullptr, 1.0f, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  const int bad_type[1] = {5};
  EXPECT_EQ(dfa_opt_step(h.o, none, 1, bad_type, 1.0f, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(dfa_opt_last_error(), "dfa_opt_step: step: unknown gradient type 5");
  EXPECT_EQ(dfa_opt_step(h.o, none, 1, nullptr, INFINITY, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_opt_read_state(h.o, 0, DFA_STATE_MAIN, 98, 4, out), DFA_ERROR_INVALID_ARGUMENT) << "past the end";
  EXPECT_EQ(dfa_opt_read_state(h.o, 1, DFA_STATE_MAIN, 0, 4, out), DFA_ERROR_INVALID_ARGUMENT) << "no shard 1";
  EXPECT_EQ(dfa_opt_read_state(h.o, 0, dfa_state_array(3), 0, 4, out), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(dfa_opt_last_error(), "dfa_opt_read_state: read_state_range: unknown state array 3");
  EXPECT_EQ(dfa_opt_get_stats(h.o, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_opt_get_stats(nullptr, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_opt_step(h.o, none, 1, nullptr, 1.0f, nullptr), DFA_SUCCESS) << "every shard skipped";
  EXPECT_STREQ(dfa_opt_last_error(), "");
  EXPECT_EQ(dfa_opt_destroy(nullptr), DFA_SUCCESS);
}

TEST(optimizer_c_api, out_of_memory_is_reported_and_rolled_back) {
  handle h("driver:host,host_granularity_kb:64,host_capacity_mb:1,tier:host,window_mb:8");
  std::vector<std::uint16_t> p(100000, 0x3F80);
  ASSERT_EQ(dfa_opt_add_shard(h.o, p.data(), p.size(), DFA_DTYPE_BF16, 0, nullptr, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_initialize(h.o, nullptr), DFA_SUCCESS) << "one array per piece fits in 1 MiB";
  const auto before = p;
  const void* grads[1] = {p.data()};
  EXPECT_EQ(dfa_opt_step(h.o, grads, 1, nullptr, 1.0f, nullptr), DFA_ERROR_OUT_OF_MEMORY) << "three do not";
  EXPECT_NE(std::string(dfa_opt_last_error()).find("dfa_opt_step: step failed"), std::string::npos) << dfa_opt_last_error();
  EXPECT_EQ(p, before) << "nothing changed";
  std::uint64_t step = 9;
  ASSERT_EQ(dfa_opt_get_shard_step(h.o, 0, &step), DFA_SUCCESS);
  EXPECT_EQ(step, 0u);
}

}  // namespace
