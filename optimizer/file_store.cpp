// Note [File tier]
//
// Rationale: the file tier holds a rank's FP32 state on NVMe.  A step must never
// leave it half-updated: a failed or killed step has to leave the previous step
// loadable.
//
// Approach
//  - layout: two 4 KiB header copies, then two slots; a slot holds, per shard, the
//    main params, exp_avg and exp_avg_sq, each padded to 4 KiB.  Step k reads the
//    active slot and writes the other; commit() makes the data durable (fdatasync),
//    then writes the header copy of the commit's parity (sequence number, step, slot, a
//    layout hash and a checksum) and makes that durable.  Opening picks the valid header
//    copy with the highest sequence, so a torn header write falls back to the previous
//    commit.
//  - the whole file is fallocate'd at creation: a full disk fails before any step.
//  - I/O: O_DIRECT (when the file system allows it) from aligned pinned buffers, cut
//    into request_bytes blocks served by a pool of threads, so several requests are in
//    flight.  Every failure (EIO, ENOSPC, a short read) is kept with the file, offset
//    and what was being moved, and thrown by io_batch::wait().
//
// Limits: one file per rank, no compression; the two slots cost 24 B per parameter.
#include "file_store.hpp"
#include "file_util.hpp"

#include <deferalloc/errors.hpp>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "../allocator/log.hpp"

namespace deferalloc::optim::detail {

namespace {

constexpr char k_magic[8] = {'D', 'F', 'A', 'S', 'T', 'A', 'T', '1'};

struct header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t slot;
  std::uint64_t layout;
  std::uint64_t step;
  std::uint32_t moments_written;
  std::uint32_t pad;
  std::uint64_t seq;       // commit sequence: the valid copy with the highest wins
  std::uint64_t checksum;  // of the bytes before it
};

std::string errtext(int e) { return std::strerror(e); }

// One zeroed aligned page, for O_DIRECT header I/O.
struct page : aligned_buffer {
  page() : aligned_buffer(file_store::align, true, "file tier: no memory for a header page") {}
};

std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

}  // namespace

std::uint64_t checksum64(const void* data, std::size_t bytes, std::uint64_t seed) {
  // Four independent lanes of multiply-rotate over 8-byte words, then a final mix.
  constexpr std::uint64_t p1 = 0x9E3779B185EBCA87ull, p2 = 0xC2B2AE3D27D4EB4Full;
  std::uint64_t h[4] = {seed + p1 + p2, seed + p2, seed, seed - p1};
  const auto* b = static_cast<const unsigned char*>(data);
  std::size_t i = 0;
  for (; i + 32 <= bytes; i += 32)
    for (int l = 0; l < 4; ++l) {
      std::uint64_t w;
      std::memcpy(&w, b + i + 8 * l, 8);
      h[l] = rotl(h[l] + w * p2, 31) * p1;
    }
  std::uint64_t r = rotl(h[0], 1) + rotl(h[1], 7) + rotl(h[2], 12) + rotl(h[3], 18) + bytes;
  for (; i < bytes; ++i) r = rotl(r ^ (b[i] * p1), 11) * p2;
  r ^= r >> 33;
  r *= p2;
  r ^= r >> 29;
  return r;
}

void io_batch::wait() {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return pending_ == 0; });
  if (!error_.empty()) throw io_error(error_);
}
bool io_batch::done() const {
  std::lock_guard lk(mu_);
  return pending_ == 0;
}

file_store::file_store(const std::string& dir, int rank, const std::vector<std::size_t>& numel, bool resume, int threads,
                       std::size_t request_bytes)
    : request_bytes_(std::max<std::size_t>(align, request_bytes / align * align)) {
  if (dir.empty()) throw invalid_argument("file tier: no directory given (optimizer_config::directory)");
  if (threads < 1) throw invalid_argument("file tier: io_threads must be at least 1");
  ensure_dir(dir, "file tier: cannot create directory ");
  path_ = dir + "/deferalloc-rank" + std::to_string(rank) + ".state";

  // Layout.
  std::uint64_t h = 0;
  for (std::size_t n : numel) {
    shard_base_.push_back(slot_bytes_);
    array_bytes_.push_back(io_bytes(n));
    slot_bytes_ += 3 * io_bytes(n);
    h = checksum64(&n, sizeof n, h);
  }
  layout_hash_ = h;
  const std::uint64_t total = 2 * align + 2 * slot_bytes_;

  int flags = O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC;
  if (!resume) flags |= O_TRUNC;
  fd_ = ::open(path_.c_str(), flags | O_DIRECT, 0600);
  if (fd_ >= 0) {
    direct_ = true;
  } else if (errno == EINVAL) {
    fd_ = ::open(path_.c_str(), flags, 0600);
    deferalloc::detail::log(log_level::info, "file tier: " + dir + " does not support O_DIRECT; using buffered I/O");
  }
  if (fd_ < 0) throw io_error("file tier: cannot open " + path_ + ": " + errtext(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
    ::close(fd_);
    throw io_error("file tier: " + path_ + " is not a regular file owned by this user");
  }

  if (resume) {
    std::uint64_t best = 0;
    bool found = false, mismatch = false;
    for (int c = 0; c < 2; ++c) {
      std::uint64_t s = 0, q = 0;
      int sl = 0;
      bool mw = false;
      if (read_header(c, layout_hash_, s, sl, mw, q, mismatch) && (!found || q > best)) {
        found = true;
        best = q;
        seq_ = q;
        step_ = s;
        slot_ = sl;
        moments_written_ = mw;
      }
    }
    if (!found && mismatch) {
      ::close(fd_);
      throw corrupt_data("file tier: " + path_ + " holds state of another layout (different shards); refusing to resume");
    }
    resumed_ = found;
  }
  if (::fallocate(fd_, 0, 0, static_cast<off_t>(total)) != 0) {
    const int e = errno;
    if (e != EOPNOTSUPP) {
      ::close(fd_);
      throw io_error("file tier: cannot reserve " + std::to_string(total) + " bytes for " + path_ + ": " + errtext(e));
    }
  }
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { worker(); });
}

file_store::~file_store() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  if (fd_ >= 0) ::close(fd_);
}

bool file_store::read_header(int copy, std::uint64_t layout, std::uint64_t& step, int& slot, bool& moments,
                             std::uint64_t& seq, bool& other_layout) {
  page buf;
  if (::pread(fd_, buf.p, align, copy * align) != static_cast<ssize_t>(align)) return false;
  header h{};
  std::memcpy(&h, buf.p, sizeof h);
  if (std::memcmp(h.magic, k_magic, 8) != 0) return false;
  if (h.layout != layout) other_layout = true;
  if (h.version != 1 || h.layout != layout) return false;
  if (h.checksum != checksum64(&h, offsetof(header, checksum))) return false;
  step = h.step;
  seq = h.seq;
  slot = static_cast<int>(h.slot);
  moments = h.moments_written != 0;
  return slot == 0 || slot == 1;
}

std::uint64_t file_store::offset(int slot, std::size_t s, int a, std::size_t elem) const {
  return 2 * align + static_cast<std::uint64_t>(slot) * slot_bytes_ + shard_base_[s] + a * array_bytes_[s] + elem * 4;
}

std::shared_ptr<io_batch> file_store::read(void* buf, std::size_t bytes, std::uint64_t off, const std::string& what,
                                           std::shared_ptr<io_batch> batch) {
  return submit(buf, bytes, off, false, what, std::move(batch));
}
std::shared_ptr<io_batch> file_store::write(const void* buf, std::size_t bytes, std::uint64_t off,
                                            const std::string& what, std::shared_ptr<io_batch> batch) {
  return submit(const_cast<void*>(buf), bytes, off, true, what, std::move(batch));
}

std::shared_ptr<io_batch> file_store::submit(void* buf, std::size_t bytes, std::uint64_t off, bool write,
                                             const std::string& what, std::shared_ptr<io_batch> batch) {
  if (!batch) batch = std::make_shared<io_batch>();
  if (bytes % align != 0 || off % align != 0 || reinterpret_cast<std::uintptr_t>(buf) % align != 0)
    throw invalid_argument("file tier: unaligned request for " + what);
  std::lock_guard lk(mu_);
  for (std::size_t done = 0; done < bytes; done += request_bytes_) {
    const std::size_t n = std::min(request_bytes_, bytes - done);
    queue_.push_back({static_cast<char*>(buf) + done, n, off + done, write, what, batch});
    std::lock_guard bl(batch->mu_);
    ++batch->pending_;
  }
  cv_.notify_all();
  return batch;
}

file_store::fault_kind file_store::take_fault(fault_op op) {
  std::lock_guard lk(fault_mu_);
  const int i = static_cast<int>(op);
  if (fault_[i] == fault_kind::none || countdown_[i] == 0) return fault_kind::none;
  if (--countdown_[i] != 0) return fault_kind::none;
  const fault_kind k = fault_[i];
  fault_[i] = fault_kind::none;
  return k;
}

void file_store::inject(fault_op op, fault_kind kind, std::uint64_t nth) {
  std::lock_guard lk(fault_mu_);
  fault_[static_cast<int>(op)] = kind;
  countdown_[static_cast<int>(op)] = nth;
}

void file_store::run(request& r) {
  const std::string where = r.what + " at offset " + std::to_string(r.off) + " of " + path_;
  const fault_kind f = take_fault(r.write ? fault_op::write : fault_op::read);
  if (f == fault_kind::crash) ::_exit(86);  // test hook: a process killed mid-step
  std::size_t done = 0;
  while (done < r.bytes) {
    ssize_t n;
    if (f == fault_kind::eio) {
      n = -1;
      errno = EIO;
    } else if (f == fault_kind::enospc) {
      n = -1;
      errno = ENOSPC;
    } else if (f == fault_kind::short_read) {
      n = 0;
    } else {
      n = r.write ? ::pwrite(fd_, static_cast<char*>(r.buf) + done, r.bytes - done, static_cast<off_t>(r.off + done))
                  : ::pread(fd_, static_cast<char*>(r.buf) + done, r.bytes - done, static_cast<off_t>(r.off + done));
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw io_error(std::string(r.write ? "write" : "read") + " of " + where + " failed: " + errtext(errno));
    if (n == 0)
      throw io_error("short " + std::string(r.write ? "write" : "read") + " of " + where + ": " + std::to_string(done) +
                     " of " + std::to_string(r.bytes) + " bytes");
    done += static_cast<std::size_t>(n);
  }
}

void file_store::worker() {
  for (;;) {
    request r;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      r = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string err;
    try {
      run(r);
    } catch (const std::exception& e) {
      err = e.what();
    }
    std::lock_guard bl(r.batch->mu_);
    if (!err.empty() && r.batch->error_.empty()) r.batch->error_ = err;
    if (--r.batch->pending_ == 0) r.batch->cv_.notify_all();
  }
}

void file_store::commit(std::uint64_t step, int slot, bool moments_written) {
  const fault_kind f = take_fault(fault_op::commit);
  if (f == fault_kind::crash) ::_exit(86);
  if (f != fault_kind::none) throw io_error("commit of step " + std::to_string(step) + " to " + path_ + " failed: " + errtext(EIO));
  if (::fdatasync(fd_) != 0) throw io_error("fdatasync of " + path_ + " failed: " + errtext(errno));
  page buf;
  header h{};
  std::memcpy(h.magic, k_magic, 8);
  h.version = 1;
  h.slot = static_cast<std::uint32_t>(slot);
  h.layout = layout_hash_;
  h.step = step;
  h.moments_written = moments_written ? 1 : 0;
  h.seq = seq_ + 1;
  h.checksum = checksum64(&h, offsetof(header, checksum));
  std::memcpy(buf.p, &h, sizeof h);
  const off_t where = static_cast<off_t>((h.seq % 2) * align);
  if (::pwrite(fd_, buf.p, align, where) != static_cast<ssize_t>(align))
    throw io_error("commit record of step " + std::to_string(step) + " to " + path_ + " failed: " + errtext(errno));
  if (::fdatasync(fd_) != 0) throw io_error("fdatasync of " + path_ + " failed: " + errtext(errno));
  seq_ = h.seq;
  step_ = step;
  slot_ = slot;
  moments_written_ = moments_written;
}

}  // namespace deferalloc::optim::detail
