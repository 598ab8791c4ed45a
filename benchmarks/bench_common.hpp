// Shared benchmark helpers: the driver to measure (CUDA when present, else host),
// sizes, and checks on CUDA runtime calls of the baselines.
#pragma once
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>
#include <deferalloc/deferalloc.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

namespace dfa_bench {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

inline bool on_gpu() {
  static const bool g = deferalloc::cuda_device_available();
  return g;
}

/// Total bytes per scenario: 4 GiB on the GPU, DFA_BENCH_BYTES_MB (default 512) on the host driver.
inline std::size_t total_bytes() {
  if (const char* e = std::getenv("DFA_BENCH_BYTES_MB")) return std::strtoull(e, nullptr, 10) * MiB;
  return on_gpu() ? 4 * GiB : 512 * MiB;
}

inline std::shared_ptr<deferalloc::driver> make_bench_driver() {
  if (on_gpu()) return deferalloc::make_cuda_driver(0);
  return deferalloc::make_host_driver({64 << 10, 2 * total_bytes() + 64 * MiB});
}

#define DFA_BENCH_CUDA(call)                                                                   \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(e_)); \
  } while (0)

using clock = std::chrono::steady_clock;
inline double seconds_since(clock::time_point t0) {
  return std::chrono::duration<double>(clock::now() - t0).count();
}

}  // namespace dfa_bench
