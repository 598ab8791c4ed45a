// Shared test helpers: the driver under test (from DFA_TEST_DRIVER), literals, data.
#pragma once
#include <deferalloc/deferalloc.hpp>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <unistd.h>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <algorithm>
#include <atomic>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace dfa_test {

constexpr std::size_t operator""_KiB(unsigned long long v) { return static_cast<std::size_t>(v) << 10; }
constexpr std::size_t operator""_MiB(unsigned long long v) { return static_cast<std::size_t>(v) << 20; }
constexpr std::size_t operator""_GiB(unsigned long long v) { return static_cast<std::size_t>(v) << 30; }

/// "host" (default) or "cuda", from DFA_TEST_DRIVER; ctest runs the suites once per driver.
inline std::string driver_name() {
  const char* e = std::getenv("DFA_TEST_DRIVER");
  return e && *e ? e : "host";
}

/// The driver under test.  The host driver uses 64 KiB granules and 1 GiB capacity
/// so the suites run fast; the CUDA driver uses the device's real granularity.
inline std::shared_ptr<deferalloc::driver> make_driver() {
  if (driver_name() == "cuda") return deferalloc::make_cuda_driver(0);
  return deferalloc::make_host_driver({64_KiB, 1_GiB});
}

inline std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint8_t> v(n);
  std::mt19937_64 rng(seed);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<std::uint8_t>(rng());
  return v;
}

/// Copies host bytes to `dev` (any driver) and waits.
inline void upload(deferalloc::driver& d, void* dev, const std::vector<std::uint8_t>& src) {
  d.copy_async(dev, src.data(), src.size(), nullptr);
  d.synchronize_stream(nullptr);
}
inline std::vector<std::uint8_t> download(deferalloc::driver& d, const void* dev, std::size_t n) {
  std::vector<std::uint8_t> out(n, 0xCD);  // poisoned
  d.copy_async(out.data(), dev, n, nullptr);
  d.synchronize_stream(nullptr);
  return out;
}

/// A fresh directory under /tmp (mkdtemp: 0700, unpredictable name), removed at the end.
struct temp_dir {
  temp_dir() {
    char tmpl[] = "/tmp/dfa-test-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  std::string path;
};

/// Builds a pool and a manager on `drv`.
struct stack {
  explicit stack(std::shared_ptr<deferalloc::driver> drv, deferalloc::chunk_pool_config pc = {})
      : drv(std::move(drv)), pool(std::make_shared<deferalloc::chunk_pool>(this->drv, std::move(pc))),
        mgr(std::make_unique<deferalloc::reservation_manager>(pool, this->drv)) {}
  std::shared_ptr<deferalloc::driver> drv;
  std::shared_ptr<deferalloc::chunk_pool> pool;
  std::unique_ptr<deferalloc::reservation_manager> mgr;
};

}  // namespace dfa_test
