// Checkpoint save and load of a few GB of optimizer state against `dd` on the same
// disk, in the same run (issue 11):
//   save  vs dd if=/dev/zero of=FILE bs=32M conv=fsync [oflag=direct] (same bytes; the
//         faster of the two)
//   load  vs dd if=SHARD of=/dev/null bs=32M iflag=direct         (the saved files)
// and the peak extra host memory of each (VmHWM after minus VmRSS before, the peak reset
// through /proc/self/clear_refs).  Load is measured into a fresh optimizer (one pass,
// each file read once) and into one that already holds state (host/device tiers:
// verify, then copy).
//   bench_checkpoint [--gb 1.5] [--dir /tmp] [--tier host|file|device] [--driver host|cuda]
// Prints one table; ratios are dd time / our time (>= 0.8 is the target).
#include <deferalloc/chunk_pool.hpp>
#include <deferalloc/optimizer.hpp>
#include <deferalloc/reservations.hpp>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "../../optimizer/store/file_store.hpp"

using namespace deferalloc;
using namespace deferalloc::optim;
namespace fs = std::filesystem;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::size_t status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::strtoull(line.c_str() + std::strlen(key), nullptr, 10);
  return 0;
}

// Resets VmHWM to the current RSS (Linux >= 4.0); returns the RSS in bytes.
std::size_t reset_peak() {
  std::ofstream("/proc/self/clear_refs") << "5";
  return status_kb("VmRSS:") << 10;
}
// The transient peak above both the RSS before and after (memory the operation keeps,
// e.g. home pages a load touches first, is state, not extra).
std::size_t peak_extra(std::size_t rss_before) {
  const std::size_t hwm = status_kb("VmHWM:") << 10, after = status_kb("VmRSS:") << 10;
  const std::size_t base = std::max(rss_before, after);
  return hwm > base ? hwm - base : 0;
}

double run_dd(const std::string& cmd) {
  const double t0 = now();
  if (std::system((cmd + " status=none").c_str()) != 0) {
    std::fprintf(stderr, "failed: %s\n", cmd.c_str());
    std::exit(1);
  }
  return now() - t0;
}

void drop_cache(const std::string& dir) {
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) {
      int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), ::close(fd);
    }
}

// Model buffers (BF16 params and gradients) and an optimizer over shards of <= 256 M.
struct setup {
  setup(std::shared_ptr<driver> d, std::size_t numel, optimizer_config cfg) : drv(d) {
    pool = std::make_shared<chunk_pool>(d);
    mgr = std::make_unique<reservation_manager>(pool);
    opt = std::make_unique<streamed_adamw>(d, cfg);
    const std::size_t shard = std::size_t{256} << 20;
    for (std::size_t done = 0; done < numel; done += shard) {
      const std::size_t n = std::min(shard, numel - done);
      auto p = mgr->reserve(n * 2), g = mgr->reserve(n * 2);
      mgr->materialize(p, 0, whole, fill_mode::zero);
      mgr->materialize(g, 0, whole, fill_mode::zero);
      std::vector<std::uint16_t> v(n);
      for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint16_t>(0x3C00 + (i * 2654435761u >> 20) % 0x300);
      d->copy_async(mgr->address(p), v.data(), n * 2, nullptr);
      for (auto& x : v) x ^= 0x0800;  // gradients: smaller values
      d->copy_async(mgr->address(g), v.data(), n * 2, nullptr);
      d->synchronize_stream(nullptr);
      opt->add_shard(static_cast<std::uint16_t*>(mgr->address(p)), n);
      grads.push_back(mgr->address(g));
    }
  }
  std::shared_ptr<driver> drv;
  std::shared_ptr<chunk_pool> pool;
  std::unique_ptr<reservation_manager> mgr;
  std::unique_ptr<streamed_adamw> opt;
  std::vector<const void*> grads;
};

}  // namespace

int main(int argc, char** argv) {
  double gb = 1.5;
  std::string dir = "/tmp", tier_name = "host", driver_name = "host";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--gb") gb = std::atof(v.c_str());
    else if (k == "--dir") dir = v;
    else if (k == "--tier") tier_name = v;
    else if (k == "--driver") driver_name = v;
    else return std::fprintf(stderr, "unknown option %s\n", k.c_str()), 2;
  }
  const std::size_t numel = static_cast<std::size_t>(gb * 1e9 / 12) / 4096 * 4096;
  const std::size_t bytes = numel * 12;
  auto drv = driver_name == "cuda" ? make_cuda_driver(0)
                                   : make_host_driver({std::size_t{2} << 20, numel * 8 + (std::size_t{1} << 30)});  // two models
  char tmpl[512];
  std::snprintf(tmpl, sizeof tmpl, "%s/dfa-bench-ckpt-XXXXXX", dir.c_str());
  if (!::mkdtemp(tmpl)) return std::perror("mkdtemp"), 1;
  const std::string root = tmpl, ck = root + "/ck";
  optimizer_config cfg;
  cfg.home = parse_tier(tier_name);
  cfg.directory = root + "/state";
  cfg.window_bytes = std::size_t{384} << 20;

  setup a(drv, numel, cfg);
  std::printf("state: %.2f GB (%zu M params, tier %s, driver %s) in %s\n", bytes / 1e9, numel >> 20, tier_name.c_str(),
              driver_name.c_str(), root.c_str());
  a.opt->initialize();
  a.opt->step(a.grads, grad_type::bf16);  // moments written: all three arrays are real data
  drv->synchronize_stream(nullptr);

  struct row {
    const char* op;
    double ours, dd;
    std::size_t extra;
  };
  std::vector<row> rows;
  // Save (twice: the second replaces a generation, as in training), against dd conv=fsync.
  for (int rep = 0; rep < 2; ++rep) {
    const std::size_t rss = reset_peak();
    const double t0 = now();
    a.opt->save_checkpoint(ck);
    const double ours = now() - t0;
    const std::size_t extra = peak_extra(rss);
    // The faster of buffered and direct dd, so the baseline is the disk's, not the page cache's.
    double dd = 1e30;
    for (const char* flags : {" conv=fsync", " conv=fsync oflag=direct"}) {
      dd = std::min(dd, run_dd("dd if=/dev/zero of=" + root + "/dd.bin bs=32M count=" + std::to_string(bytes >> 25) + flags));
      fs::remove(root + "/dd.bin");
    }
    rows.push_back({rep == 0 ? "save (new)" : "save (replace)", ours, dd, extra});
  }
  // Load into a fresh optimizer (one pass), then into one holding state.
  std::string shards;
  for (const auto& e : fs::directory_iterator(ck))
    for (const auto& f : fs::directory_iterator(e.path()))
      if (f.path().extension() == ".bin") shards += " " + f.path().string();
  optimizer_config cfg_b = cfg;
  cfg_b.directory = root + "/state-b";
  setup b(drv, numel, cfg_b);
  for (int holding = 0; holding < 2; ++holding) {
    drop_cache(ck);
    const std::size_t rss = reset_peak();
    const double t0 = now();
    b.opt->load_checkpoint(ck);
    const double ours = now() - t0;
    const std::size_t extra = peak_extra(rss);
    double dd = 0;
    for (std::size_t p = 0, q; p < shards.size(); p = q) {
      q = shards.find(' ', p + 1);
      if (q == std::string::npos) q = shards.size();
      dd += run_dd("dd if=" + shards.substr(p + 1, q - p - 1) + " of=/dev/null bs=32M iflag=direct");
    }
    rows.push_back({holding ? "load (holding state)" : "load (fresh)", ours, dd, extra});
  }
  // The part of a load that is not I/O: BF16(main) into the model params.
  const double t_sync0 = now();
  b.opt->sync_model_params();
  drv->synchronize_stream(nullptr);
  const double t_sync = now() - t_sync0;
  std::printf("%-22s %9s %9s %9s %9s %7s %14s\n", "operation", "GB", "ours s", "ours GB/s", "dd GB/s", "ratio",
              "peak extra MiB");
  for (const auto& r : rows)
    std::printf("%-22s %9.2f %9.2f %9.2f %9.2f %6.2fx %14.1f\n", r.op, bytes / 1e9, r.ours, bytes / 1e9 / r.ours,
                bytes / 1e9 / r.dd, r.dd / r.ours, r.extra / 1048576.0);
  // A load ends with sync_model_params (BF16 params from main): on the host driver that
  // is the CPU twin, not I/O; shown apart so the I/O ratio can be read too.
  std::printf("each load includes sync_model_params: %.2f s; load (fresh) without it: %.2fx dd\n", t_sync,
              rows[2].dd / std::max(1e-9, rows[2].ours - t_sync));
  // The cost of the checksums (file-tier blocks and checkpoint chunks), one core.
  {
    std::vector<std::uint64_t> buf((std::size_t{256} << 20) / 8, 0x9E3779B97F4A7C15ull);
    std::uint64_t sink = 0;
    const double t0 = now();
    for (int i = 0; i < 4; ++i) sink += optim::detail::checksum64(buf.data(), buf.size() * 8, sink);
    const double s = now() - t0;
    std::printf("checksum64: %.1f GB/s on one core (%016llx)\n", 4 * (buf.size() * 8) / 1e9 / s,
                static_cast<unsigned long long>(sink));
  }
  std::error_code ec;
  fs::remove_all(root, ec);
  return 0;
}
