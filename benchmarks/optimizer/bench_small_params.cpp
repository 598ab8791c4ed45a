// Many small parameters on the file tier against the host tier, host driver: the step
// time of each (median of --steps after two warm-up steps), their ratio, and the state
// file's size against two slots of state.  Small arrays are packed in the state file
// (Note [Packed arrays] in optimizer/store/file_store.cpp); without that each array took
// a 64 KiB block of its own.
//   bench_small_params [--params 10000] [--numel 20] [--steps 5] [--dir /tmp] [--check]
// Prints one table and two marked checks: "[perf]" (the file tier's step within 2x the
// host tier's: a performance target, failed only with --check) and "[size]" (the file
// no larger than 1.1x two slots of state plus the fixed header: always asserted).
#include <deferalloc/core/chunk_pool.hpp>
#include <deferalloc/core/reservations.hpp>
#include <deferalloc/optim/optimizer.hpp>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

using namespace deferalloc;
using namespace deferalloc::optim;
namespace fs = std::filesystem;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct run {
  double step_s = 0;      // median step
  std::uint64_t file = 0;  // the state file's bytes (file tier)
};

run measure(tier t, const std::string& dir, std::size_t params, std::size_t numel, int steps) {
  const std::size_t stride = (numel * 2 + 255) / 256 * 256;  // each param on its own 256 bytes
  auto drv = make_host_driver({std::size_t{64} << 10, std::size_t{1} << 30});
  auto pool = std::make_shared<chunk_pool>(drv);
  reservation_manager mgr(pool, drv);
  auto buffer = [&](std::size_t bytes) {
    auto id = mgr.reserve(bytes);
    mgr.materialize(id, 0, whole, fill_mode::zero);
    return static_cast<char*>(mgr.address(id));
  };
  char* p = buffer(params * stride);
  char* g = buffer(params * stride);
  std::vector<std::uint16_t> ones(numel, 0x3f80), small(numel, 0x3c23);  // bf16 1.0, 0.01
  optimizer_config cfg;
  cfg.home = t;
  cfg.directory = dir;
  streamed_adamw opt(drv, cfg);
  std::vector<const void*> grads;
  for (std::size_t i = 0; i < params; ++i) {
    drv->copy_async(p + i * stride, ones.data(), numel * 2, nullptr);
    drv->copy_async(g + i * stride, small.data(), numel * 2, nullptr);
    opt.add_shard(reinterpret_cast<std::uint16_t*>(p + i * stride), numel, "p" + std::to_string(i));
    grads.push_back(g + i * stride);
  }
  drv->synchronize_stream(nullptr);
  opt.initialize();
  std::vector<double> ts;
  for (int s = 0; s < steps + 2; ++s) {
    const double t0 = now();
    opt.step(grads, grad_type::bf16);
    drv->synchronize_stream(nullptr);
    if (s >= 2) ts.push_back(now() - t0);
    if (std::getenv("DFA_BENCH_VERBOSE")) {
      const auto r = opt.last_report();
      std::printf("  %s step %d: %.2f ms (report %.2f ms: map %.2f, retire %.2f, I/O wait %.2f)\n", to_string(t), s,
                  (now() - t0) * 1e3, r.seconds * 1e3, r.map_seconds * 1e3, r.retire_seconds * 1e3, r.io_wait_seconds * 1e3);
    }
  }
  std::sort(ts.begin(), ts.end());
  run r;
  r.step_s = ts[ts.size() / 2];
  if (t == tier::file) r.file = fs::file_size(dir + "/deferalloc-rank0.state");
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t params = 10000, numel = 20;
  int steps = 5;
  std::string dir = "/tmp";
  bool check = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--check") {
      check = true;
      continue;
    }
    if (i + 1 >= argc) return std::fprintf(stderr, "option %s needs a value\n", k.c_str()), 2;
    const std::string v = argv[++i];
    if (k == "--params") params = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--numel") numel = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--steps") steps = std::max(1, std::atoi(v.c_str()));
    else if (k == "--dir") dir = v;
    else return std::fprintf(stderr, "unknown option %s\n", k.c_str()), 2;
  }
  std::string tmpl = dir + "/dfa-bench-small-XXXXXX";
  if (!::mkdtemp(tmpl.data())) return std::perror("mkdtemp"), 1;
  const run host = measure(tier::host, {}, params, numel, steps);
  const run file = measure(tier::file, tmpl, params, numel, steps);
  fs::remove_all(tmpl);
  const double state = 2.0 * static_cast<double>(params * numel * 12);  // two slots of FP32 state
  const double header = 2 * 4096.0;  // the two header copies
  const double ratio = file.step_s / host.step_s, size_ratio = file.file / (state + header);
  std::printf("bench_small_params: %zu params x %zu elements, host driver, median of %d steps\n", params, numel, steps);
  std::printf("  host tier step   %10.2f ms\n", host.step_s * 1e3);
  std::printf("  file tier step   %10.2f ms\n", file.step_s * 1e3);
  std::printf("  file / host      %10.2fx\n", ratio);
  std::printf("  state file       %10llu bytes (two slots of state: %.0f bytes; %.3fx with the header)\n",
              static_cast<unsigned long long>(file.file), state, size_ratio);
  const bool perf_ok = ratio <= 2.0, size_ok = size_ratio <= 1.1;
  std::printf("[perf] file tier step <= 2x the host tier's: %.2fx %s\n", ratio, perf_ok ? "PASS" : "FAIL");
  std::printf("[size] state file <= 1.1x two slots of state + header: %.3fx %s\n", size_ratio, size_ok ? "PASS" : "FAIL");
  return size_ok && (perf_ok || !check) ? 0 : 1;
}
