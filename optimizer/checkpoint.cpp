// State transfer between the home tiers and host memory, and checkpoints.
//
// A checkpoint is a directory: one data file per shard (main, exp_avg, exp_avg_sq as
// raw little-endian FP32, one after the other) and manifest.txt, written last, that
// names the format version, step, hyper-parameters (hex floats, exact), shapes, dtypes
// and a checksum per array.  Files are written to a temporary name (created 0600,
// O_EXCL, no symlink followed), made durable, then renamed.  Loading checks the layout
// and every checksum before it changes any state, so a flipped byte or a different
// model is refused with the optimizer untouched.
#include <deferalloc/errors.hpp>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "file_util.hpp"
#include "optimizer_impl.hpp"

namespace deferalloc::optim {

using detail::checksum64;
using detail::aligned_buffer;
using detail::file_store;
using detail::write_all;
using detail::write_file_atomically;

namespace {

constexpr const char* k_header = "deferalloc-optimizer-checkpoint";
constexpr int k_version = 1;
const char* const k_arrays[3] = {"main", "exp_avg", "exp_avg_sq"};

void read_all(int fd, void* data, std::size_t n, const std::string& path) {
  char* c = static_cast<char*>(data);
  std::size_t got = 0;
  while (got < n) {
    ssize_t r = ::read(fd, c + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw io_error("checkpoint: reading " + path + " failed: " + std::strerror(errno));
    if (r == 0) throw corrupt_data("checkpoint: " + path + " is shorter than its manifest says (" + std::to_string(got) +
                                   " of " + std::to_string(n) + " bytes)");
    got += static_cast<std::size_t>(r);
  }
}

std::string hexfloat(double f) {
  char b[64];
  std::snprintf(b, sizeof b, "%a", f);
  return b;
}

}  // namespace

// ---- home <-> host ------------------------------------------------------------------

void streamed_adamw::impl::read_home(std::size_t s, int a, std::size_t e0, std::size_t n, float* out) {
  const shard& sh = shards[s];
  if (a > 0 && !moments_written && home_of(s) != tier::device) {
    std::memset(out, 0, n * 4);  // never written: zero by construction
    return;
  }
  switch (home_of(s)) {
    case tier::device: {
      float* dev = a == 0 ? sh.info.main_param : a == 1 ? sh.info.exp_avg : sh.info.exp_avg_sq;
      drv->copy_async(out, dev + e0, n * 4, exec);
      drv->synchronize_stream(exec);
      return;
    }
    case tier::host:
      if (a > 0 && cfg.moments != moment_format::fp32)
        detail::decode_moments(static_cast<int>(cfg.moments), a, sh.home[a], sh.info.numel, e0, n, out);
      else
        std::memcpy(out, sh.home[a] + e0, n * 4);
      return;
    case tier::file: {
      const std::size_t block = std::size_t{64} << 20;
      aligned_buffer buf(block, false, "checkpoint: no host memory for a bounce buffer");
      for (std::size_t done = 0; done < n * 4; done += block) {
        const std::size_t want = std::min(block, n * 4 - done);
        file->read(buf.p, file_store::io_bytes(want / 4),
                   file->offset(file->active_slot(), s, a, e0) + done, std::string(k_arrays[a]) + " of " + sh.info.name)
            ->wait();
        std::memcpy(reinterpret_cast<char*>(out) + done, buf.p, want);
      }
      return;
    }
  }
}

void streamed_adamw::impl::write_home(std::size_t s, int a, const float* in, int slot) {
  const shard& sh = shards[s];
  const std::size_t n = sh.info.numel;
  switch (home_of(s)) {
    case tier::device: {
      float* dev = a == 0 ? sh.info.main_param : a == 1 ? sh.info.exp_avg : sh.info.exp_avg_sq;
      drv->copy_async(dev, in, n * 4, exec);
      drv->synchronize_stream(exec);
      return;
    }
    case tier::host:
      if (a > 0 && cfg.moments != moment_format::fp32)
        detail::encode_moments(static_cast<int>(cfg.moments), a, sh.home[a], n, 0, n, in);
      else
        std::memcpy(sh.home[a], in, n * 4);
      return;
    case tier::file: {
      const std::size_t block = std::size_t{64} << 20;
      aligned_buffer buf(block, false, "checkpoint: no host memory for a bounce buffer");
      for (std::size_t done = 0; done < n * 4; done += block) {
        const std::size_t want = std::min(block, n * 4 - done);
        const std::size_t io = file_store::io_bytes(want / 4);
        std::memset(buf.p + want, 0, io - want);
        std::memcpy(buf.p, reinterpret_cast<const char*>(in) + done, want);
        file->write(buf.p, io, file->offset(slot, s, a, 0) + done, std::string(k_arrays[a]) + " of " + sh.info.name)
            ->wait();
      }
      return;
    }
  }
}

void streamed_adamw::read_state(std::size_t shard, float* main, float* exp_avg, float* exp_avg_sq) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  DFA_EXPECTS(shard < I.shards.size(), "read_state: no shard " + std::to_string(shard));
  DFA_EXPECTS(I.initialized, "read_state: no state yet", invalid_state);
  float* outs[3] = {main, exp_avg, exp_avg_sq};
  for (int a = 0; a < 3; ++a)
    if (outs[a]) I.read_home(shard, a, 0, I.shards[shard].info.numel, outs[a]);
}

// ---- checkpoints --------------------------------------------------------------------

void streamed_adamw::save_checkpoint(const std::string& dir) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  DFA_EXPECTS(!dir.empty(), "save_checkpoint: directory is empty");
  DFA_EXPECTS(I.initialized, "save_checkpoint: no state yet (initialize() first)", invalid_state);
  detail::ensure_dir(dir, "save_checkpoint: cannot create ");
  std::ostringstream m;
  m << k_header << ' ' << k_version << '\n';
  m << "step " << I.step_count << '\n';
  m << "moments_written " << (I.moments_written ? 1 : 0) << '\n';
  // The moments' storage (Note [Moment formats]); the data files hold them decoded to FP32.
  if (I.cfg.moments != moment_format::fp32) m << "moment_format " << to_string(I.cfg.moments) << '\n';
  const adamw_params& h = I.cfg.adamw;
  m << "adamw lr " << hexfloat(h.lr) << " beta1 " << hexfloat(h.beta1) << " beta2 " << hexfloat(h.beta2) << " eps "
    << hexfloat(h.eps) << " weight_decay " << hexfloat(h.weight_decay) << '\n';
  m << "shards " << I.shards.size() << '\n';
  std::vector<float> buf;
  for (std::size_t s = 0; s < I.shards.size(); ++s) {
    const auto& info = I.shards[s].info;
    buf.resize(info.numel);
    const std::string file = "shard-" + std::to_string(s) + ".bin";
    std::uint64_t sums[3] = {};
    write_file_atomically(dir + "/" + file, [&](int fd, const std::string& path) {
      for (int a = 0; a < 3; ++a) {
        I.read_home(s, a, 0, info.numel, buf.data());
        sums[a] = checksum64(buf.data(), info.numel * 4);
        write_all(fd, buf.data(), info.numel * 4, path);
      }
    });
    char line[512];
    std::snprintf(line, sizeof line, "shard %zu numel %zu dtype fp32 file %s main %016" PRIx64 " exp_avg %016" PRIx64
                                     " exp_avg_sq %016" PRIx64 "\n",
                  s, info.numel, file.c_str(), sums[0], sums[1], sums[2]);
    m << line;
  }
  const std::string text = m.str();
  char end[64];
  std::snprintf(end, sizeof end, "end %016" PRIx64 "\n", checksum64(text.data(), text.size()));
  const std::string all = text + end;
  write_file_atomically(dir + "/manifest.txt", [&](int fd, const std::string& path) { write_all(fd, all.data(), all.size(), path); });
}

void streamed_adamw::load_checkpoint(const std::string& dir) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  I.ensure_file();
  const std::string mpath = dir + "/manifest.txt";
  std::ifstream in(mpath);
  if (!in) throw io_error("load_checkpoint: cannot open " + mpath);
  std::stringstream whole;
  whole << in.rdbuf();
  const std::string all = whole.str();
  const auto endpos = all.rfind("end ");
  if (endpos == std::string::npos) throw corrupt_data("load_checkpoint: " + mpath + " is truncated (no end record)");
  if (std::strtoull(all.c_str() + endpos + 4, nullptr, 16) != checksum64(all.data(), endpos))
    throw corrupt_data("load_checkpoint: " + mpath + " fails its checksum");
  std::istringstream m(all.substr(0, endpos));
  std::string word;
  int version = 0;
  std::uint64_t step = 0;
  int moments = 0;
  std::size_t count = 0;
  adamw_params h{};
  std::string lr, b1, b2, eps, wd, k1, k2, k3, k4, k5;
  m >> word >> version;
  if (word != k_header) throw corrupt_data("load_checkpoint: " + mpath + " is not a deferalloc optimizer checkpoint");
  if (version != k_version)
    throw corrupt_data("load_checkpoint: " + mpath + " has format version " + std::to_string(version) + ", this build reads " +
                       std::to_string(k_version));
  m >> word >> step >> word >> moments;
  const auto before_format = m.tellg();
  std::string format = "fp32";  // a record of how the moments were stored; any format loads into any
  if (m >> word && word == "moment_format") m >> format;
  else m.seekg(before_format);
  try {
    parse_moment_format(format);
  } catch (const invalid_argument&) {
    throw corrupt_data("load_checkpoint: " + mpath + " names an unknown moment format '" + format + "'");
  }
  m >> word >> k1 >> lr >> k2 >> b1 >> k3 >> b2 >> k4 >> eps >> k5 >> wd;
  h.lr = std::strtod(lr.c_str(), nullptr);
  h.beta1 = std::strtod(b1.c_str(), nullptr);
  h.beta2 = std::strtod(b2.c_str(), nullptr);
  h.eps = std::strtod(eps.c_str(), nullptr);
  h.weight_decay = std::strtod(wd.c_str(), nullptr);
  m >> word >> count;
  if (!m || count != I.shards.size())
    throw corrupt_data("load_checkpoint: layout mismatch: the checkpoint has " + std::to_string(count) +
                       " shards, this optimizer has " + std::to_string(I.shards.size()));
  struct entry {
    std::size_t numel;
    std::string file;
    std::uint64_t sum[3];
  };
  std::vector<entry> es(count);
  for (std::size_t s = 0; s < count; ++s) {
    std::size_t idx = 0;
    std::string dtype, sums[3];
    m >> word >> idx >> word >> es[s].numel >> word >> dtype >> word >> es[s].file >> word >> sums[0] >> word >> sums[1] >>
        word >> sums[2];
    if (!m || idx != s || dtype != "fp32") throw corrupt_data("load_checkpoint: " + mpath + ": bad shard record " + std::to_string(s));
    if (es[s].numel != I.shards[s].info.numel)
      throw corrupt_data("load_checkpoint: layout mismatch: checkpoint shard " + std::to_string(s) + " has " +
                         std::to_string(es[s].numel) + " elements, this optimizer's shard " + std::to_string(s) + " ('" +
                         I.shards[s].info.name + "') has " + std::to_string(I.shards[s].info.numel));
    if (es[s].file.find('/') != std::string::npos) throw corrupt_data("load_checkpoint: bad file name in " + mpath);
    for (int a = 0; a < 3; ++a) es[s].sum[a] = std::strtoull(sums[a].c_str(), nullptr, 16);
  }
  // Pass 1: verify everything.  Pass 2: write.  Nothing changes unless all is sound.
  std::vector<float> buf;
  const int slot = I.file ? 1 - I.file->active_slot() : 0;
  for (int pass = 0; pass < 2; ++pass)
    for (std::size_t s = 0; s < count; ++s) {
      const std::string path = dir + "/" + es[s].file;
      int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
      if (fd < 0) throw io_error("load_checkpoint: cannot open " + path + ": " + std::strerror(errno));
      try {
        struct stat st {};
        if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != es[s].numel * 12)
          throw corrupt_data("load_checkpoint: " + path + " has " + std::to_string(st.st_size) + " bytes, expected " +
                             std::to_string(es[s].numel * 12));
        buf.resize(es[s].numel);
        for (int a = 0; a < 3; ++a) {
          read_all(fd, buf.data(), es[s].numel * 4, path);
          if (pass == 0 && checksum64(buf.data(), es[s].numel * 4) != es[s].sum[a])
            throw corrupt_data("load_checkpoint: " + std::string(k_arrays[a]) + " of shard " + std::to_string(s) + " in " +
                               path + " fails its checksum (the file is corrupt)");
          if (pass == 1) I.write_home(s, a, buf.data(), slot);
        }
      } catch (...) {
        ::close(fd);
        throw;
      }
      ::close(fd);
    }
  if (I.file) I.file->commit(step, slot, moments != 0);
  I.step_count = step;
  for (auto& sh : I.shards) sh.step = step;  // one count per checkpoint
  I.moments_written = moments != 0;
  I.cfg.adamw = h;
  I.initialized = true;
  I.failed_step = 0;
  I.sync_model(nullptr);
  I.drv->synchronize_stream(nullptr);
}

}  // namespace deferalloc::optim
