// Checkpoint save and load of a few GB of optimizer state against `dd` on the same
// disk, in the same run.  The baseline `dd` does what a user would do to move
// the same bytes without us (Note [Checkpoint baselines]):
//   host, device tiers: the state is in memory, so
//     save  vs dd if=/dev/zero of=FILE bs=32M conv=fsync [oflag=direct]     ("dd write")
//     load  vs dd if=SHARD of=/dev/null bs=32M iflag=direct                 ("dd read")
//   file tier: the state is a file on the disk, so a checkpoint is a copy on that disk:
//     save  vs dd if=STATE of=FILE bs=32M skip=<active slot> count=<bytes> conv=fsync
//     load  vs dd if=SHARD of=FILE bs=32M conv=fsync                        ("dd copy")
//   (each the faster of buffered and direct I/O, the source dropped from the page cache
//   first, so the baseline is the disk's, not the page cache's).  Before each run, ours
//   or dd's, the file system is committed (syncfs), so that none pays for what the one
//   before left (dirty pages, the discard of a removed file's blocks).  The file tier also
//   prints the write/read ratios, for reference; the 0.8x target is against "dd copy".
// save (replace) is the call's time: the previous generation is removed after it returns,
// on a thread of its own (Note [Checkpoint generations]); that removal's time is printed
// apart.  Also the peak extra host memory of each (VmHWM after minus VmRSS before, the peak reset
// through /proc/self/clear_refs).  Load is measured into a fresh optimizer (one pass,
// each file read once) and into one that already holds state (host/device tiers:
// verify, then copy).
//   bench_checkpoint [--gb 1.5] [--dir /tmp] [--tier host|file|device] [--driver host|cuda]
//                    [--reps 1] [--json PATH]
// Prints one table (each figure the best of --reps runs); ratios are dd time / our time
// (>= 0.8 is the target).  With --json, also writes the figures (schema 1: benchmark,
// schema, device, command, results[name, value, unit, baseline], extra).
#include <deferalloc/core/chunk_pool.hpp>
#include <deferalloc/core/reservations.hpp>
#include <deferalloc/optim/optimizer.hpp>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
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

// Drops a file, or every file under a directory, from the page cache.
void drop_cache(const std::string& path) {
  auto drop = [](const fs::path& f) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), ::close(fd);
  };
  if (!fs::is_directory(path)) return drop(path);
  for (const auto& e : fs::recursive_directory_iterator(path))
    if (e.is_regular_file()) drop(e.path());
}

// Commits the file system of `path` (syncfs), so that what an earlier run left to do
// (dirty pages; with `discard`, the freed blocks of a removed file) is not charged to
// the next measured one.
void settle(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) ::syncfs(fd), ::close(fd);
}

// The faster of `cmd` with buffered and with direct I/O, the source `src` dropped from
// the page cache before each run.  `out` (removed after each run) empty: a read to
// /dev/null (no fsync); `src` /dev/zero: a write (direct output only).
double best_dd(const std::string& src, const std::string& cmd, const std::string& out) {
  const bool zero = src == "/dev/zero";
  const char* buffered = out.empty() ? "" : " conv=fsync";
  const char* direct = out.empty() ? " iflag=direct" : zero ? " conv=fsync oflag=direct" : " conv=fsync iflag=direct oflag=direct";
  double best = 1e30;
  for (const char* flags : {buffered, direct}) {
    if (!zero) drop_cache(src);
    settle(fs::path(out.empty() ? src : out).parent_path());
    best = std::min(best, run_dd(cmd + flags));
    if (!out.empty()) fs::remove(out);
  }
  return best;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += c;
    else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else o += c;
  }
  return o;
}

// The GPU's name (nvidia-smi) on the CUDA driver, "host" on the host driver.
std::string device_name(const std::string& driver) {
  if (driver != "cuda") return "host";
  std::string name;
  if (FILE* p = ::popen("nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null", "r")) {
    char b[256];
    if (std::fgets(b, sizeof b, p)) name = b;
    ::pclose(p);
  }
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return name.empty() ? "cuda device 0" : name;
}

// The file system type of `dir` and its mount options (from /proc/self/mounts: the
// longest mount point above it; `discard` makes unlinking large files dear).
std::string fs_type(const std::string& dir, bool options = false) {
  std::ifstream f("/proc/self/mounts");
  std::string dev, mnt, type, opts, rest, best_type = "unknown", best_opts;
  std::size_t best = 0;
  const std::string abs = fs::weakly_canonical(dir).string() + "/";
  while (f >> dev >> mnt >> type >> opts && std::getline(f, rest)) {
    const std::string m = mnt == "/" ? "/" : mnt + "/";
    if (abs.rfind(m, 0) == 0 && m.size() >= best) best = m.size(), best_type = type, best_opts = opts;
  }
  return options ? best_opts : best_type;
}

// Model buffers (BF16 params and gradients) and an optimizer over shards of <= 256 M.
struct setup {
  setup(std::shared_ptr<driver> d, std::size_t numel, optimizer_config cfg) : drv(d) {
    pool = std::make_shared<chunk_pool>(d);
    mgr = std::make_unique<reservation_manager>(pool, d);
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
  std::string dir = "/tmp", tier_name = "host", driver_name = "host", json_path;
  int reps = 1;
  std::string command = argv[0];
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i], v = i + 1 < argc ? argv[i + 1] : "";
    if (i + 1 >= argc) return std::fprintf(stderr, "option %s needs a value\n", k.c_str()), 2;
    if (k == "--gb") gb = std::atof(v.c_str());
    else if (k == "--dir") dir = v;
    else if (k == "--tier") tier_name = v;
    else if (k == "--driver") driver_name = v;
    else if (k == "--json") json_path = v;
    else if (k == "--reps") reps = std::max(1, std::atoi(v.c_str()));
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
  fs::create_directories(cfg.directory);  // the file tier refuses a missing directory
  cfg.window_bytes = std::size_t{384} << 20;
  const bool file_tier = cfg.home == tier::file;

  setup a(drv, numel, cfg);
  std::printf("state: %.2f GB (%zu M params, tier %s, driver %s) in %s (%s %s)\n", bytes / 1e9, numel >> 20,
              tier_name.c_str(), driver_name.c_str(), root.c_str(), fs_type(root).c_str(), fs_type(root, true).c_str());
  a.opt->initialize();
  a.opt->step(a.grads, grad_type::bf16);  // moments written: all three arrays are real data
  drv->synchronize_stream(nullptr);

  // Note [Checkpoint baselines]: the file tier's state lives in its state file, so the
  // user's alternative to our save is a copy of the active slot's bytes (slot 1 after
  // initialize() wrote slot 0 and one step slot 1) into a new file on the same disk,
  // and to our load a copy of each checkpoint file; the host and device tiers' state is
  // in memory, so theirs is a write of the bytes (save) or a read (load).
  const std::string state_file = cfg.directory + "/deferalloc-rank0.state";
  std::uint64_t slot_bytes = 0, ckpt_bytes = 0;  // the file tier's slot; the checkpoint's data files
  using store = optim::detail::file_store;  // optim::detail: deferalloc::detail is visible too
  for (std::size_t done = 0; done < numel; done += std::size_t{256} << 20) {
    const std::size_t n = std::min(std::size_t{256} << 20, numel - done), io = store::io_bytes(n);
    slot_bytes += 3 * ((io + store::block - 1) / store::block * store::block);
    ckpt_bytes += 3 * io;
  }
  const std::uint64_t slot1 = 2 * store::align + slot_bytes;

  struct row {
    std::string op, key;
    double ours = 0;
    std::size_t extra = 0;
    double dd_write_or_read = 0, dd_copy = 0;  // dd_copy: file tier only
  };
  // Each figure is the best of --reps runs (ours and dd's alike, interleaved), the peak
  // memory the largest.
  std::vector<row> rows = {{"save (new)", "save_new"}, {"save (replace)", "save_replace"},
                           {"load (fresh)", "load_fresh"}, {"load (holding state)", "load_holding"}};
  for (auto& r : rows) r.ours = r.dd_write_or_read = r.dd_copy = 1e30, r.extra = 0;
  auto keep = [](row& r, double ours, std::size_t extra, double dd_wr, double dd_c) {
    r.ours = std::min(r.ours, ours);
    r.extra = std::max(r.extra, extra);
    r.dd_write_or_read = std::min(r.dd_write_or_read, dd_wr);
    r.dd_copy = std::min(r.dd_copy, dd_c);
  };
  double t_sync = 1e30, t_prune = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    std::error_code ec;
    fs::remove_all(ck, ec);
    // Save twice: the second replaces a generation, as in training.
    for (int k = 0; k < 2; ++k) {
      if (file_tier) drop_cache(state_file);  // our save reads the state file O_DIRECT, as dd's copy reads it cold
      settle(root);
      const std::size_t rss = reset_peak();
      const double t0 = now();
      a.opt->save_checkpoint(ck);
      const double ours = now() - t0;
      const std::size_t extra = peak_extra(rss);
      // The previous generation is removed on a thread after the publish: waited for
      // here, outside our time and before the baselines, so that they do not share the
      // disk with it; its time is shown apart.
      const double t_prune0 = now();
      optim::detail::wait_checkpoint_prune(*a.opt);
      if (k == 1) t_prune = std::min(t_prune, now() - t_prune0);
      const std::string out = root + "/dd.bin";
      const double dd_w = best_dd("/dev/zero", "dd if=/dev/zero of=" + out + " bs=32M count=" + std::to_string(bytes >> 25), out);
      double dd_c = 0;
      if (file_tier)
        dd_c = best_dd(state_file,
                       "dd if=" + state_file + " of=" + out + " bs=32M iflag=skip_bytes,count_bytes skip=" +
                           std::to_string(slot1) + " count=" + std::to_string(ckpt_bytes),
                       out);
      keep(rows[k], ours, extra, dd_w, dd_c);
    }
    // Load into a fresh optimizer (one pass), then into one holding state.
    std::vector<std::string> shards;
    for (const auto& e : fs::directory_iterator(ck))
      for (const auto& f : fs::directory_iterator(e.path()))
        if (f.path().extension() == ".bin") shards.push_back(f.path().string());
    optimizer_config cfg_b = cfg;
    cfg_b.directory = root + "/state-b";
    fs::remove_all(cfg_b.directory, ec);
    fs::create_directories(cfg_b.directory);
    setup b(drv, numel, cfg_b);
    for (int holding = 0; holding < 2; ++holding) {
      drop_cache(ck);
      settle(root);
      const std::size_t rss = reset_peak();
      const double t0 = now();
      b.opt->load_checkpoint(ck);
      const double ours = now() - t0;
      const std::size_t extra = peak_extra(rss);
      double dd_r = 0, dd_c = 0;
      for (const auto& f : shards) {
        dd_r += best_dd(f, "dd if=" + f + " of=/dev/null bs=32M", "");
        if (file_tier) dd_c += best_dd(f, "dd if=" + f + " of=" + root + "/dd.bin bs=32M", root + "/dd.bin");
      }
      keep(rows[2 + holding], ours, extra, dd_r, dd_c);
    }
    // The part of a load that is not I/O: BF16(main) into the model params.
    const double t_sync0 = now();
    b.opt->sync_model_params();
    drv->synchronize_stream(nullptr);
    t_sync = std::min(t_sync, now() - t_sync0);
  }

  const char* base_wr[2] = {"dd write", "dd read"};
  std::printf("%-22s %7s %8s %9s %9s %7s %9s %7s %14s\n", "operation", "GB", "ours s", "ours GB/s", "dd w/r GB/s",
              "ratio", file_tier ? "copy GB/s" : "", file_tier ? "ratio" : "", "peak extra MiB");
  for (const auto& r : rows) {
    std::printf("%-22s %7.2f %8.2f %9.2f %11.2f %6.2fx", r.op.c_str(), bytes / 1e9, r.ours, bytes / 1e9 / r.ours,
                bytes / 1e9 / r.dd_write_or_read, r.dd_write_or_read / r.ours);
    if (file_tier) std::printf(" %9.2f %6.2fx", bytes / 1e9 / r.dd_copy, r.dd_copy / r.ours);
    else std::printf(" %9s %7s", "", "");
    std::printf(" %14.1f\n", r.extra / 1048576.0);
  }
  std::printf("target: ratio >= 0.80 against %s (dd %s)\n",
              file_tier ? "dd copy of the same bytes on the same disk (the file tier's state is a file)"
                        : "dd write (save, conv=fsync) / dd read (load) of the same bytes",
              "the faster of buffered and direct");
  // A load ends with sync_model_params (BF16 params from main): on the host driver that
  // is the CPU twin, not I/O; shown apart so the I/O ratio can be read too.
  const double base_load = file_tier ? rows[2].dd_copy : rows[2].dd_write_or_read;
  std::printf("each load includes sync_model_params: %.2f s; load (fresh) without it: %.2fx %s\n", t_sync,
              base_load / std::max(1e-9, rows[2].ours - t_sync), file_tier ? "dd copy" : "dd read");
  std::printf("save (replace) then removes the previous generation in the background: %.2f s more\n", t_prune);
  // The cost of the checksums (file-tier blocks and checkpoint chunks), one core.
  double checksum_gbps = 0;
  {
    std::vector<std::uint64_t> buf((std::size_t{256} << 20) / 8, 0x9E3779B97F4A7C15ull);
    std::uint64_t sink = 0;
    const double t0 = now();
    for (int i = 0; i < 4; ++i) sink += optim::detail::checksum64(buf.data(), buf.size() * 8, sink);
    const double s = now() - t0;
    checksum_gbps = 4 * (buf.size() * 8) / 1e9 / s;
    std::printf("checksum64: %.1f GB/s on one core (%016llx)\n", checksum_gbps, static_cast<unsigned long long>(sink));
  }
  if (!json_path.empty()) {
    std::ostringstream j;
    j << "{\"benchmark\": \"bench_checkpoint\", \"schema\": 1, \"device\": \"" << json_escape(device_name(driver_name))
      << "\", \"command\": \"" << json_escape(command) << "\", \"results\": [";
    bool first = true;
    auto result = [&](const std::string& name, double value, const char* unit, const std::string& baseline) {
      j << (first ? "" : ",") << "\n  {\"name\": \"" << json_escape(name) << "\", \"value\": " << value << ", \"unit\": \""
        << unit << "\", \"baseline\": " << (baseline.empty() ? "null" : "\"" + json_escape(baseline) + "\"") << "}";
      first = false;
    };
    j.precision(6);
    for (const auto& r : rows) {
      const bool save = r.key.rfind("save", 0) == 0;
      // The criterion's baseline first: dd copy for the file tier, else dd write / read.
      const std::string wr = r.key + ": " + base_wr[save ? 0 : 1], cp = r.key + ": dd copy";
      const std::string crit = file_tier ? cp : wr;
      result(r.key, bytes / 1e9 / r.ours, "GB/s", crit);
      result(r.key + " seconds", r.ours, "s", "");
      result(r.key + " / " + (file_tier ? "dd copy" : base_wr[save ? 0 : 1]), (file_tier ? r.dd_copy : r.dd_write_or_read) / r.ours,
             "x", crit);
      if (file_tier) {
        result(cp, bytes / 1e9 / r.dd_copy, "GB/s", "");
        result(r.key + " / " + base_wr[save ? 0 : 1], r.dd_write_or_read / r.ours, "x", wr);
      }
      result(wr, bytes / 1e9 / r.dd_write_or_read, "GB/s", "");
      result(r.key + " peak extra memory", r.extra / 1048576.0, "MiB", "");
    }
    result("sync_model_params", t_sync, "s", "");
    result("save_replace background prune", t_prune, "s", "");
    result("checksum64", checksum_gbps, "GB/s", "");
    j << "\n], \"extra\": {\"tier\": \"" << tier_name << "\", \"driver\": \"" << driver_name << "\", \"bytes\": " << bytes
      << ", \"dir\": \"" << json_escape(dir) << "\", \"filesystem\": \"" << json_escape(fs_type(root))
      << "\", \"mount_options\": \"" << json_escape(fs_type(root, true))
      << "\", \"criterion\": \"ratio >= 0.8 against "
      << (file_tier ? "dd copy (conv=fsync) of the same bytes on the same disk" : "dd write (conv=fsync) / dd read")
      << "\", \"reps\": " << reps << ", \"peak_extra_limit_mib\": 256}}\n";
    std::ofstream(json_path) << j.str();
    std::printf("wrote %s\n", json_path.c_str());
  }
  std::error_code ec;
  fs::remove_all(root, ec);
  return 0;
}
