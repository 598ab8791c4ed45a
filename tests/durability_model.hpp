// A small deterministic model for the durability tests and their child process: shard
// sizes, initial BF16 params and per-step gradients derived from seeds, an optimizer on
// it, and its full state (FP32 main and moments, BF16 params) for bit-exact comparison.
#pragma once
#include <deferalloc/optim/optimizer.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../optimizer/kernels/adamw_math.hpp"
#include "common.hpp"

namespace dfa_test::durability {

inline std::vector<std::uint16_t> bf16_values(std::size_t n, std::uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = deferalloc::optim::detail::to_bf16(nd(rng));
  return v;
}

/// Three shards, one spanning several 64 KiB pieces, odd tails.
inline std::vector<std::size_t> shard_sizes() { return {3 * 16384 + 7, 16384 + 5001, 5001}; }

/// The file tier's directory is created here (the optimizer refuses a missing one).
inline deferalloc::optim::optimizer_config config(deferalloc::optim::tier t, const std::string& dir, bool resume) {
  if (t == deferalloc::optim::tier::file && !dir.empty()) std::filesystem::create_directories(dir);
  deferalloc::optim::optimizer_config c;
  c.home = t;
  c.directory = dir;
  c.resume = resume;
  c.window_bytes = 3 * 12 * (64 << 10);  // depth 3, one 64 KiB granule of each array per piece
  c.io_threads = 3;
  c.io_request_bytes = 64 << 10;
  c.adamw = {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
  return c;
}

/// Everything that must be identical between two runs at the same step.
struct state {
  std::vector<std::vector<std::uint8_t>> bytes;  // per shard: main, exp_avg, exp_avg_sq, bf16, its step count (u64)
  bool operator==(const state&) const = default;
};

/// The model (BF16 params and gradients in driver memory) and its optimizer.
struct model {
  model(std::shared_ptr<deferalloc::driver> d, const deferalloc::optim::optimizer_config& cfg) : s(d) {
    opt = std::make_unique<deferalloc::optim::streamed_adamw>(d, cfg);
    const auto sizes = shard_sizes();
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      params.push_back(static_cast<std::uint16_t*>(alloc(sizes[i] * 2)));
      grads.push_back(alloc(sizes[i] * 2));
      put(params.back(), bf16_values(sizes[i], 10 + i, 1.0f));
      opt->add_shard(params.back(), sizes[i], "layer" + std::to_string(i));
    }
  }
  void* alloc(std::size_t bytes) {
    auto id = s.mgr->reserve(bytes);
    s.mgr->materialize(id, 0, deferalloc::whole, deferalloc::fill_mode::zero);
    return s.mgr->address(id);
  }
  void put(void* dev, const std::vector<std::uint16_t>& v) {
    s.drv->copy_async(dev, v.data(), v.size() * 2, nullptr);
    s.drv->synchronize_stream(nullptr);
  }
  /// Step `t` (0-based) with its gradients.  The last shard has no gradient at every
  /// fourth step (from step 1), so the shards' step counts differ (PyTorch's
  /// per-parameter `step`).
  void step(std::uint64_t t) {
    const auto sizes = shard_sizes();
    for (std::size_t i = 0; i < sizes.size(); ++i)
      put(const_cast<void*>(grads[i]), bf16_values(sizes[i], 1000 * t + i, 0.1f));
    std::vector<const void*> g = grads;
    if (t % 4 == 1) g.back() = nullptr;
    opt->step(g, deferalloc::optim::grad_type::bf16, t % 3 == 1 ? 0.5f : 1.0f);
    s.drv->synchronize_stream(nullptr);
  }
  state snapshot() {
    state out;
    const auto sizes = shard_sizes();
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const std::size_t n = sizes[i];
      std::vector<std::uint8_t> b(n * 14 + 8);
      float* f = reinterpret_cast<float*>(b.data());
      opt->read_state(i, f, f + n, f + 2 * n);
      s.drv->copy_async(b.data() + n * 12, params[i], n * 2, nullptr);
      s.drv->synchronize_stream(nullptr);
      const std::uint64_t step = opt->shard_step(i);
      std::memcpy(b.data() + n * 14, &step, 8);
      out.bytes.push_back(std::move(b));
    }
    return out;
  }
  dfa_test::stack s;
  std::unique_ptr<deferalloc::optim::streamed_adamw> opt;
  std::vector<std::uint16_t*> params;
  std::vector<const void*> grads;
};

/// The host driver the tests run on.
inline std::shared_ptr<deferalloc::driver> host() { return deferalloc::make_host_driver({64 << 10, std::size_t{1} << 30}); }

/// An uninterrupted host-tier run's state after every step (r[t]: after t steps).
inline std::vector<state> reference_run(std::uint64_t steps) {
  std::vector<state> r;
  model m(host(), config(deferalloc::optim::tier::host, {}, false));
  m.opt->initialize();
  r.push_back(m.snapshot());
  for (std::uint64_t t = 0; t < steps; ++t) {
    m.step(t);
    r.push_back(m.snapshot());
  }
  return r;
}

/// reference_run(Steps), computed once per test program.
template <std::uint64_t Steps>
const std::vector<state>& reference() {
  static const std::vector<state> r = reference_run(Steps);
  return r;
}

/// A file's bytes, and a file written with `b`.
inline std::vector<char> slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
inline void spit(const std::string& path, const std::vector<char>& b) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(b.data(), static_cast<std::streamsize>(b.size()));
}

inline bool write_state(const std::string& path, const state& st) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return false;
  for (const auto& b : st.bytes) std::fwrite(b.data(), 1, b.size(), f);
  return std::fclose(f) == 0;
}

inline bool read_state(const std::string& path, state& st) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  st.bytes.clear();
  bool ok = true;
  for (std::size_t n : shard_sizes()) {
    std::vector<std::uint8_t> b(n * 14 + 8);
    ok = ok && std::fread(b.data(), 1, b.size(), f) == b.size();
    st.bytes.push_back(std::move(b));
  }
  std::fclose(f);
  return ok;
}

}  // namespace dfa_test::durability
