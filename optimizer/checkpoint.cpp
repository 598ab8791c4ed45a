// Reading a shard's state from its home (Note [Homes]), and checkpoints.
//
// Note [Checkpoint generations]
//
// Rationale: a checkpoint is overwritten many times in a run; a save that is killed or
// fails (full disk, one shard's write) must leave the previous checkpoint loadable, and
// a save of a multi-GB state should run at the disk's speed in bounded memory.
//
// Approach
//  - save_checkpoint(dir) writes a new generation dir/gen-<N>.tmp (N above every
//    generation present): one data file per shard (main, exp_avg, exp_avg_sq as raw
//    little-endian FP32, one after the other) and manifest.txt (format version, step,
//    hyper-parameters as exact hex floats, shapes, dtypes, a checksum per array), each
//    created 0600 exclusive without following symlinks and fsynced; then the generation's
//    directory is fsynced, renamed to gen-<N> (the one atomic publish) and dir fsynced.
//    Only then are older generations (and unfinished ones of killed saves) removed, on
//    a thread of its own (detail::background_prune): freeing a written multi-GB file is
//    not free (measured 0.14 s per GB on ext4 mounted with `discard`), and the save's
//    caller waits only for the publish.  The next save (and the optimizer's destructor)
//    first waits for it, so one prune runs at a time; a kill during it leaves old
//    generations half-removed, never loaded (a newer complete one exists) and removed
//    by the next save.
//    load_checkpoint(dir) takes the newest gen-<N>: a complete generation is never
//    passed over for an older one, so a damaged newest checkpoint is an error, not a
//    silent step back.
//  - Streaming: every array is cut into 32 MiB chunks, processed by 6 lanes (threads),
//    each with its own aligned buffer (192 MiB in all, whatever the shard size), so six
//    writes or reads are in flight (a file-tier save or load reads and writes the same
//    disk, so about half of them are reads, half writes).  A data file's space is
//    reserved (fallocate) before its first write.  Each chunk's checksum64 is computed by its lane;
//    an array's checksum is checksum64 of its chunks' checksums, so verification streams
//    too.  Host tier: the lanes write straight from the pinned home (no copy); file tier:
//    they read the active slot (verified by the file tier's block checksums) into their
//    buffer.  Written files are dropped from the page cache after their fsync.
//  - Load reads each file once, verifying as it streams, into a place that changes
//    nothing until all is verified: the file tier's inactive slot, committed at the end.
//    The host and device tiers update in place, so when they already hold state they
//    verify in a first pass and copy in a second (each file read twice then, through
//    the page cache, so the second pass is served from memory where the checkpoint fits;
//    it reads straight into a pinned FP32 home, as a fresh load does, and checks the
//    bytes again).  A load
//    ends with BF16(main) into the model's params (the file tier reads main, a third of
//    the bytes, from the new slot again): done from the chunks as they stream, it would
//    change the params before the whole checkpoint is verified.
//  - Not used: reflinks (FICLONERANGE) and copy_file_range between the state file and a
//    checkpoint.  A reflinked slot shares its blocks, so a later step's write needs new
//    space and could fail with ENOSPC mid-run (the state file's space is reserved at
//    creation for that reason), and either way the bytes must still pass through this
//    process to be verified and checksummed; copy_file_range without reflink is a
//    buffered copy, slower than direct I/O where measured.
//  - The distributed optimizer publishes every rank's files in one generation (see
//    distributed_adamw.cpp) with write_checkpoint_files / read_checkpoint_files.
//
// Limits: the checkpoint directory must be owned by this user; generations are kept one
// at a time (plus the one being written, and the previous one until its background
// removal ends); no compression.
#include <deferalloc/core/errors.hpp>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <sstream>
#include <system_error>
#include <thread>

#include "store/file_util.hpp"
#include "kernels/moment_format.hpp"
#include "optimizer_impl.hpp"
#include "progress.hpp"
#include "store/file_store.hpp"

namespace deferalloc::optim {

using detail::aligned_buffer;
using detail::checksum64;
using detail::file_store;
using detail::write_all;
using detail::write_new_file;

namespace {

constexpr const char* k_header = "deferalloc-optimizer-checkpoint";
constexpr int k_version = 3;            // 3: each shard line ends with the shard's step count
constexpr int k_version_one_step = 2;   // one step count per checkpoint: still loaded, every shard at it
constexpr std::size_t k_chunk = std::size_t{32} << 20;  // bytes per chunk: a multiple of file_store::block
constexpr int k_lanes = 6;                              // chunks in flight (192 MiB of buffers)
// A chunk is whole int8 moment blocks, so the lanes encode disjoint blocks (host_home::write_chunk).
static_assert((k_chunk / 4) % detail::k_qblock == 0);

void pwrite_all(int fd, const void* data, std::size_t n, std::uint64_t off, const std::string& path) {
  const char* c = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, c, n, static_cast<off_t>(off));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw io_error("checkpoint: writing " + path + " failed: " + std::strerror(errno));
    c += w;
    off += static_cast<std::uint64_t>(w);
    n -= static_cast<std::size_t>(w);
  }
}

std::string hexfloat(double f) {
  char b[64];
  std::snprintf(b, sizeof b, "%a", f);
  return b;
}

// One chunk of one array of a shard file.
struct chunk {
  state_array a;
  std::size_t e0, n;  // elements
  std::size_t index;  // within the array
};

std::vector<chunk> chunks_of(std::size_t numel) {
  std::vector<chunk> out;
  const std::size_t per = k_chunk / 4;
  for (state_array a : k_state_arrays)
    for (std::size_t e0 = 0, i = 0; e0 < numel; e0 += per, ++i) out.push_back({a, e0, std::min(per, numel - e0), i});
  return out;
}

// Runs fn(chunk, buffer) for every chunk on up to k_lanes threads, each with its own
// aligned buffer of the largest chunk's I/O size (<= k_chunk).  The first failure stops
// the lanes and is rethrown.
template <typename F>
void for_each_chunk(const std::vector<chunk>& cs, F&& fn) {
  std::size_t largest = 0;
  for (const auto& c : cs) largest = std::max(largest, file_store::io_bytes(c.n));
  std::atomic<std::size_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::exception_ptr first;
  auto lane = [&] {
    try {
      aligned_buffer buf(largest, false, "checkpoint: no host memory for an I/O buffer");
      for (std::size_t i; !stop && (i = next++) < cs.size();) fn(cs[i], buf.p);
    } catch (...) {
      std::lock_guard lk(mu);
      if (!first) first = std::current_exception();
      stop = true;
    }
  };
  const std::size_t lanes = std::min<std::size_t>(k_lanes, cs.size());
  std::vector<std::thread> ts;
  try {
    while (ts.size() + 1 < lanes) ts.emplace_back(lane);
  } catch (const std::system_error&) {
    // No more threads: the lanes started (and this one) do all the chunks.
  }
  lane();
  for (auto& t : ts) t.join();
  if (first) std::rethrow_exception(first);
}

// An array's checksum: checksum64 of its chunks' checksums.
std::uint64_t fold(const std::vector<std::uint64_t>& sums) { return checksum64(sums.data(), sums.size() * 8); }

}  // namespace

// ---- home <-> host ------------------------------------------------------------------

bool streamed_adamw::impl::never_written(std::size_t s, state_array a) const {
  return is_moment(a) && !moments_written && home_of(s).traits().streamed;
}

void streamed_adamw::impl::read_home(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out) {
  if (a == state_array::main && param_is_main(shards[s].info)) {
    // While a speculative step is pending, the committed values: those it kept.
    if (shards[s].speculative && s < saved_params.size() && saved_params[s]) std::memcpy(out, saved_params[s] + e0, n * 4);
    else read_param(s, e0, n, out);
  } else if (never_written(s, a)) std::memset(out, 0, n * 4);  // zero by construction
  else home_of(s).read(s, a, e0, n, out);
}

void streamed_adamw::impl::read_param(std::size_t s, std::size_t e0, std::size_t n, float* out) {
  std::lock_guard lk(param_copy_mu);
  drv->copy_async(out, static_cast<const float*>(shards[s].info.param) + e0, n * 4, exec());
  drv->synchronize_stream(exec());
}

void streamed_adamw::impl::write_param(std::size_t s, std::size_t e0, std::size_t n, const float* in) {
  std::lock_guard lk(param_copy_mu);
  drv->copy_async(static_cast<float*>(shards[s].info.param) + e0, in, n * 4, exec());
  drv->synchronize_stream(exec());
}

void streamed_adamw::read_state(std::size_t shard, float* main, float* exp_avg, float* exp_avg_sq) {
  auto& self = *impl_;
  impl::entry_guard g(self);
  DFA_EXPECTS(shard < self.shards.size(), "read_state: no shard " + std::to_string(shard));
  g.require("read_state", entry_needs::initialized | entry_needs::settled, "read_state: no state yet");
  const per_array<float*> outs{{main, exp_avg, exp_avg_sq}};
  for (state_array a : k_state_arrays)
    if (outs[a]) self.read_home(shard, a, 0, self.shards[shard].info.numel, outs[a]);
}

// ---- checkpoint files ----------------------------------------------------------------

void detail::write_checkpoint_files(streamed_adamw& o, const std::string& dir) {
  auto& self = *o.impl_;
  streamed_adamw::impl::entry_guard g(self, "save_checkpoint", entry_needs::initialized | entry_needs::settled);
  std::ostringstream m;
  m << k_header << ' ' << k_version << '\n';
  m << "step " << self.step_count << '\n';
  m << "moments_written " << (self.moments_written ? 1 : 0) << '\n';
  // The moments' storage (Note [Moment formats]); the data files hold them decoded to FP32.
  if (self.cfg.moments != moment_format::fp32) m << "moment_format " << to_string(self.cfg.moments) << '\n';
  const adamw_params& h = self.cfg.adamw;
  m << "adamw lr " << hexfloat(h.lr) << " beta1 " << hexfloat(h.beta1) << " beta2 " << hexfloat(h.beta2) << " eps "
    << hexfloat(h.eps) << " weight_decay " << hexfloat(h.weight_decay) << '\n';
  m << "chunk_bytes " << k_chunk << '\n';
  m << "shards " << self.shards.size() << '\n';
  std::size_t done = 0, total = 0;
  for (const auto& sh : self.shards) total += sh.info.numel;
  progress_meter progress(self.cfg, "checkpoint save", total);
  for (std::size_t s = 0; s < self.shards.size(); ++s) {
    const auto& sh = self.shards[s];
    const std::size_t numel = sh.info.numel;
    const std::string file = "shard-" + std::to_string(s) + ".bin";
    const auto cs = chunks_of(numel);
    per_array<std::vector<std::uint64_t>> sums;
    for (const auto& c : cs) sums[c.a].resize(c.index + 1);
    const std::uint64_t array_bytes = file_store::io_bytes(numel);  // arrays start 4 KiB-aligned (O_DIRECT)
    write_new_file(dir + "/" + file, [&](int fd, const std::string& path) {
      for_each_chunk(cs, [&](const chunk& c, unsigned char* buf) {
        const std::size_t io = file_store::io_bytes(c.n);
        const unsigned char* src = buf;
        auto& h = self.home_of(s);  // a resident shard lives on the device tier
        const bool param = c.a == state_array::main && param_is_main(sh.info);  // the parameter is main
        const float* host = param ? nullptr : h.host_array(s, c.a);
        if (param) {
          self.read_home(s, c.a, c.e0, c.n, reinterpret_cast<float*>(buf));
        } else if (self.never_written(s, c.a)) {
          std::memset(buf, 0, c.n * 4);  // never written: zero by construction
        } else if (host) {
          host += c.e0;
          if (io == c.n * 4 && reinterpret_cast<std::uintptr_t>(host) % file_store::align == 0)
            src = reinterpret_cast<const unsigned char*>(host);  // straight from the pinned home, no copy
          else
            std::memcpy(buf, host, c.n * 4);
        } else {
          // The file tier's active slot; HBM; compressed host moments (Note [Moment
          // formats]), decoded to FP32 into the buffer.
          h.read_chunk(s, c.a, c.e0, c.n, buf);
        }
        if (src == buf) std::memset(buf + c.n * 4, 0, io - c.n * 4);
        sums[c.a][c.index] = checksum64(src, io);
        pwrite_all(fd, src, io, array_index(c.a) * array_bytes + c.e0 * 4, path);
      });
    }, true, 3 * array_bytes);
    char line[512];
    std::snprintf(line, sizeof line,
                  "shard %zu numel %zu dtype fp32 file %s main %016" PRIx64 " exp_avg %016" PRIx64 " exp_avg_sq %016" PRIx64
                  " step %" PRIu64 "\n",
                  s, numel, file.c_str(), fold(sums[state_array::main]), fold(sums[state_array::exp_avg]),
                  fold(sums[state_array::exp_avg_sq]), sh.step);
    m << line;
    progress.report(done += numel);
  }
  const std::string text = m.str();
  char end[64];
  std::snprintf(end, sizeof end, "end %016" PRIx64 "\n", checksum64(text.data(), text.size()));
  const std::string all = text + end;
  write_new_file(dir + "/manifest.txt", [&](int fd, const std::string& path) { write_all(fd, all.data(), all.size(), path); });
}

namespace {

// One shard's line of a manifest.
struct manifest_entry {
  std::size_t numel = 0;
  std::string file;
  per_array<std::uint64_t> sum;
  std::uint64_t step = 0;  // the shard's step count (format 2: the checkpoint's)
};

// A checkpoint's manifest, parsed and checked against the optimizer's shards.
struct manifest {
  std::uint64_t step = 0;
  bool moments_written = false;
  adamw_params adamw{};
  std::vector<manifest_entry> shards;
};

// The text of `mpath` without its end record, after checking the record's checksum.
std::string verified_manifest_text(const std::string& mpath) {
  const std::string all = detail::read_text_file(mpath, "load_checkpoint");
  const auto endpos = all.rfind("end ");
  if (endpos == std::string::npos) throw corrupt_data("load_checkpoint: " + mpath + " is truncated (no end record)");
  char expect_end[64];
  std::snprintf(expect_end, sizeof expect_end, "end %016" PRIx64 "\n", checksum64(all.data(), endpos));
  if (all.compare(endpos, std::string::npos, expect_end) != 0)
    throw corrupt_data("load_checkpoint: " + mpath + " fails its checksum");
  return all.substr(0, endpos);
}

// The shard lines of a manifest of format `version` (whose checkpoint step is `step`).
std::vector<manifest_entry> parse_shard_lines(std::istream& m, int version, std::uint64_t step, const shard_table& shards,
                                              const std::string& mpath) {
  std::string word;
  std::size_t count = 0;
  m >> word >> count;
  if (!m || count != shards.size())
    throw corrupt_data("load_checkpoint: layout mismatch: the checkpoint has " + std::to_string(count) +
                       " shards, this optimizer has " + std::to_string(shards.size()));
  std::vector<manifest_entry> es(count);
  for (std::size_t s = 0; s < count; ++s) {
    std::size_t idx = 0;
    std::string dtype, sums[3];
    m >> word >> idx >> word >> es[s].numel >> word >> dtype >> word >> es[s].file >> word >> sums[0] >> word >> sums[1] >>
        word >> sums[2];
    es[s].step = step;
    if (version == k_version) m >> word >> es[s].step;
    if (!m || idx != s || dtype != "fp32" || (version == k_version && word != "step")) throw corrupt_data("load_checkpoint: " + mpath + ": bad shard record " + std::to_string(s));
    if (es[s].numel != shards[s].info.numel)
      throw corrupt_data("load_checkpoint: layout mismatch: checkpoint shard " + std::to_string(s) + " has " +
                         std::to_string(es[s].numel) + " elements, this optimizer's shard " + std::to_string(s) + " ('" +
                         shards[s].info.name + "') has " + std::to_string(shards[s].info.numel));
    if (es[s].file.find('/') != std::string::npos) throw corrupt_data("load_checkpoint: bad file name in " + mpath);
    for (state_array a : k_state_arrays) es[s].sum[a] = std::strtoull(sums[array_index(a)].c_str(), nullptr, 16);
  }
  return es;
}

// Parse step: dir/manifest.txt, its checksum verified, its layout checked against `shards`.
manifest parse_manifest(const std::string& dir, const shard_table& shards) {
  const std::string mpath = dir + "/manifest.txt";
  std::istringstream m(verified_manifest_text(mpath));
  std::string word;
  int version = 0;
  int moments = 0;
  std::size_t chunk_bytes = 0;
  manifest out;
  std::string lr, b1, b2, eps, wd, k1, k2, k3, k4, k5;
  m >> word >> version;
  if (word != k_header) throw corrupt_data("load_checkpoint: " + mpath + " is not a deferalloc optimizer checkpoint");
  if (version != k_version && version != k_version_one_step)
    throw corrupt_data("load_checkpoint: " + mpath + " has format version " + std::to_string(version) + ", this build reads " +
                       std::to_string(k_version_one_step) + " and " + std::to_string(k_version));
  m >> word >> out.step >> word >> moments;
  out.moments_written = moments != 0;
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
  out.adamw.lr = std::strtod(lr.c_str(), nullptr);
  out.adamw.beta1 = std::strtod(b1.c_str(), nullptr);
  out.adamw.beta2 = std::strtod(b2.c_str(), nullptr);
  out.adamw.eps = std::strtod(eps.c_str(), nullptr);
  out.adamw.weight_decay = std::strtod(wd.c_str(), nullptr);
  m >> word >> chunk_bytes;
  if (!m || word != "chunk_bytes" || chunk_bytes != k_chunk)
    throw corrupt_data("load_checkpoint: " + mpath + ": bad chunk_bytes record");
  out.shards = parse_shard_lines(m, version, out.step, shards, mpath);
  return out;
}

}  // namespace

void streamed_adamw::impl::read_shard_file(std::size_t s, const std::string& path, const per_array<std::uint64_t>& expect,
                                           bool copy, bool cached, int slot) {
  committed_store* store = tier_home->store();
  const std::size_t numel = shards[s].info.numel;
  // Two passes read through the page cache, so the second is served from memory
  // where it fits; one pass reads direct.
  const int flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC;
  int fd = cached ? ::open(path.c_str(), flags) : detail::open_direct(path, flags);
  if (fd < 0) throw io_error("load_checkpoint: cannot open " + path + ": " + std::strerror(errno));
  try {
    const std::uint64_t array_bytes = file_store::io_bytes(numel);
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<std::uint64_t>(st.st_size) != 3 * array_bytes)
      throw corrupt_data("load_checkpoint: " + path + " has " + std::to_string(st.st_size) + " bytes, expected " +
                         std::to_string(3 * array_bytes));
    const auto cs = chunks_of(numel);
    per_array<std::vector<std::uint64_t>> sums;
    for (const auto& c : cs) sums[c.a].resize(c.index + 1);
    for_each_chunk(cs, [&](const chunk& c, unsigned char* buf) {
      const std::size_t io = file_store::io_bytes(c.n);
      // The pinned home takes the file's bytes as they are only when it holds FP32
      // (compressed moments are encoded by write_chunk(); a resident shard is on the device,
      // or on a committed store in its slot, loaded into HBM after the commit: Note
      // [Resident shards on the file tier]).
      auto& h = store ? *tier_home : home_of(s);
      // Main of an FP32 parameter goes into the parameter (a committed store: into its
      // durable copy, which the export at the end writes into the parameter).
      const bool param = c.a == state_array::main && param_is_main(shards[s].info);
      float* pinned = param ? nullptr : h.host_array(s, c.a);
      if (pinned) pinned += c.e0;
      if (copy && pinned && io == c.n * 4 && reinterpret_cast<std::uintptr_t>(pinned) % file_store::align == 0) {
        // Nothing to keep (a fresh home, or all verified by the first pass): straight
        // into the pinned home, no bounce and no copy.  A second pass reads from the
        // page cache and checks the bytes again (a page dropped in between is read
        // from the disk again, which must not return other bytes unnoticed).
        detail::pread_all(fd, pinned, io, array_index(c.a) * array_bytes + c.e0 * 4, path);
        sums[c.a][c.index] = checksum64(pinned, io);
        return;
      }
      detail::pread_all(fd, buf, io, array_index(c.a) * array_bytes + c.e0 * 4, path);
      sums[c.a][c.index] = checksum64(buf, io);
      if (!copy) return;
      if (param && !store) write_param(s, c.e0, c.n, reinterpret_cast<const float*>(buf));
      else h.write_chunk(s, c.a, c.e0, c.n, buf, slot);
    });
    if (cached && copy) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    for (state_array a : k_state_arrays)
      if (fold(sums[a]) != expect[a])
        throw corrupt_data("load_checkpoint: " + std::string(array_name(a)) + " of shard " + std::to_string(s) + " in " +
                           path + " fails its checksum (the file is corrupt)");
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

void detail::read_checkpoint_files(streamed_adamw& o, const std::string& dir) {
  auto& self = *o.impl_;
  streamed_adamw::impl::entry_guard g(self, "load_checkpoint", entry_needs::not_speculating | entry_needs::in_parent);
  g.require("load_checkpoint", entry_needs::settled);
  g.require("load_checkpoint", entry_needs::opened);
  const manifest man = parse_manifest(dir, self.shards);
  const auto& es = man.shards;
  // One pass when nothing changes until the end (file tier: the inactive slot, committed
  // last; or no state yet); else a verify pass, then a copy pass.  See Note [Checkpoint generations].
  committed_store* store = self.tier_home->store();
  // FP32 parameters are main and are written in place too: verified first.
  bool params = false;
  for (std::size_t s = 0; s < es.size(); ++s) params = params || param_is_main(self.shards[s].info);
  const bool in_place = !store && (self.initialized || params);
  const int slot = store ? store->load_slot() : 0;
  std::size_t done = 0, total = 0;
  for (const auto& e : es) total += (in_place ? 2 : 1) * e.numel;  // verified, then written
  progress_meter progress(self.cfg, "checkpoint load", total);
  for (int pass = in_place ? 0 : 1; pass < 2; ++pass)
    for (std::size_t s = 0; s < es.size(); ++s) {
      self.read_shard_file(s, dir + "/" + es[s].file, es[s].sum, /*copy=*/pass == 1, /*cached=*/in_place, slot);
      progress.report(done += es[s].numel);
    }
  state_counts loaded{man.step, man.moments_written, {}};
  for (const auto& e : es) loaded.shard_steps.push_back(e.step);
  if (store) store->commit_load(slot, loaded);
  self.adopt(loaded);
  if (store) self.load_resident();
  self.cfg.adamw = man.adamw;
  self.retry.clear();
  self.sync_model(nullptr);
  self.drv->synchronize_stream(nullptr);
}

// ---- checkpoints --------------------------------------------------------------------

void streamed_adamw::save_checkpoint(const std::string& dir) {
  DFA_EXPECTS(!dir.empty(), "save_checkpoint: directory is empty");
  DFA_EXPECTS(initialized(), "save_checkpoint: no state yet (initialize() first)", invalid_state);
  detail::check_dir(dir, "save_checkpoint");
  {
    impl::entry_guard g(*impl_);
    impl_->pruner.wait();  // the previous save's (one prune at a time)
  }
  const std::uint64_t n = detail::next_generation(dir, "save_checkpoint");
  const std::string tmp = detail::generation_path(dir, n, true);
  {
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);  // a killed save's (Note [Generation names])
  }
  detail::check_dir(tmp, "save_checkpoint");
  try {
    detail::write_checkpoint_files(*this, tmp);
    detail::publish_generation(dir, n, "save_checkpoint");
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove_all(tmp, ec);
    throw;
  }
  impl::entry_guard g(*impl_);
  impl_->pruner.start(dir, n);
}

void detail::wait_checkpoint_prune(streamed_adamw& o) {
  streamed_adamw::impl::entry_guard g(*o.impl_);
  o.impl_->pruner.wait();
}

void streamed_adamw::load_checkpoint(const std::string& dir) {
  DFA_EXPECTS(!dir.empty(), "load_checkpoint: directory is empty");
  {
    impl::entry_guard g(*impl_, "load_checkpoint", entry_needs::not_speculating);  // before looking for a generation
  }
  detail::read_checkpoint_files(*this, detail::newest_generation(dir, "load_checkpoint"));
}

}  // namespace deferalloc::optim
