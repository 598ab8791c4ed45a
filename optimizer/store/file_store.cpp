// Note [File tier]
//
// Rationale: the file tier holds a rank's FP32 state on NVMe.  A step must never
// leave it half-updated: a failed or killed step has to leave the previous step
// loadable, and state that cannot be read back exactly must be refused, never used.
//
// Approach
//  - layout: two 4 KiB header copies, then two slots, then one checksum table per slot,
//    then one area of per-shard step counts per header copy (format 3).
//    A slot holds, per shard, the main params, exp_avg and exp_avg_sq (the moments in
//    their format: Note [File tier moments]): those smaller than a 64 KiB block packed
//    together at the slot's start (format 5: Note [Packed arrays]), the others each on
//    whole blocks of their own (formats 2 to 4: every array).  Step k reads
//    the active slot and writes the other; commit() makes the data durable, writes the
//    slot's checksum table and makes it durable, then writes the step counts into the
//    area of the commit's parity and the header copy of that parity (sequence number,
//    step, slot, layout hash, moment format, the table's and the step counts' checksums,
//    and a checksum of the header) and makes that durable.
//  - every write of state goes to the inactive slot, whatever writes it: a step, a
//    checkpoint load, write_state_range and load_state_dict (Note [State writes] in
//    file_home.cpp), so one commit publishes it and a kill leaves the old state or the new.
//    A commit that changes step counts only names the active slot again: its data and
//    table are rewritten with the bytes they hold, and the step counts live with the
//    header copy, so the other copy's commit stays intact.
//  - step counts: PyTorch keeps one per parameter (a parameter without a gradient is
//    not stepped); the file keeps one per shard, with each commit.  A format-2 file
//    (one count per file) still resumes, every shard at the file's step; its first
//    commit extends it by the step-count areas and writes a format-3 header (the other
//    copy, format 2, stays valid until it is overwritten).  Format 3 has no moment
//    format field (FP32 moments); format 4 added it, and is written for compressed
//    moments only: FP32 moments keep writing format 3, so a build that reads 2 and 3
//    still resumes the newest commit (a format-4 header would look damaged to it).
//    Format 5 (new files, any moments) packs small arrays; formats 2 to 4 keep their
//    layout and their format for their whole life.
//  - a new file is created as <name>.new and renamed into place (and the directory
//    fsynced) by its first commit, so a file at the final name always holds a commit.
//  - the whole file is fallocate'd at creation: a full disk fails before any step.
//  - I/O: O_DIRECT (when the file system allows it) from aligned pinned buffers, cut
//    into request_bytes blocks served by a pool of threads, so several requests are in
//    flight.  Every failure (EIO, ENOSPC, a short read) is kept with the file, offset
//    and what was being moved, and thrown by io_batch::wait().
//
// Note [File tier integrity]
//  - Every 64 KiB block of slot data has a checksum64 in its slot's table, computed by
//    the I/O thread that writes it (from the staging buffer, before the write) and
//    verified by the thread that reads it, so verification streams with the data.  A
//    mismatch is corrupt_data naming the file, slot, offset and data.
//  - Which slot a resume reads.  Commits alternate slots and header copies: commit n
//    writes slot X and copy n%2; copy (n-1)%2 still names slot 1-X and step n-1, whose
//    data stays intact until step n+1 starts writing slot 1-X.  Resume takes the valid
//    copy with the highest sequence.  The other slot is used only when it holds the
//    newest commit that can be proven: when the copy naming the newer step is damaged
//    (its checksum fails; a torn header write of a killed commit looks exactly like
//    that, and that commit never completed).  It is never used because the newest valid
//    copy's data is corrupt: that slot's step is the last committed one, the other slot
//    is a step older (or half overwritten by a killed step), so falling back would
//    silently drop a committed step; the read throws corrupt_data instead.  Whatever is
//    resumed is still verified block by block as it is read.
//  - Refused loudly, never a fresh start: both header copies unreadable, a file shorter
//    than its layout (a truncation that fallocate would have re-extended with zeros), a
//    checksum table that fails the header's checksum, another layout or format version.
//    A missing file is the one case that resumes nothing (resumed() false).
//  - Before anything is written: the directory must be a directory owned by this user
//    (not a symlink), and an existing state file a regular file owned by this user;
//    files are opened with O_NOFOLLOW and never with O_TRUNC.
//
// Note [File tier moments]
//
// Rationale: compressed moments (Note [Moment formats] in kernels/moment_format.hpp) cut
// the file tier's bytes per step as they cut the host tier's PCIe bytes (12 B/param each
// way FP32, 8 bf16, 6.125 int8), and a run must be able to move between the host and
// file tiers with the same numbers: the file tier with a format gives the host tier's
// bits for the same steps and gradients.
// Approach: the window holds a piece's moments in the host tier's layout and the same
// kernel steps them; the file stores each moment array so that a piece's bytes are one
// request starting on a checksum block whatever the piece size:
//  - fp32: 4 B per element; bf16: 2 B per element, contiguous (a segment of 32768
//    elements is one 64 KiB block).
//  - int8: segments of k_int8_segment = 2^20 elements, each its codes (1 MiB) then its
//    blocks' scales (64 KiB), 17 checksum blocks; the last segment of an array holds
//    its r elements in the host tier's layout of an r-element array (codes, padded to
//    16 bytes, then scales), so an array of up to 2^20 elements is stored exactly as the
//    host tier holds it.  The pieces of an int8 file tier are whole segments
//    (piece_align); the home copies a piece's segments' codes and scales to the
//    window's two runs.  The int8 blocks (64 elements) are aligned to the shard's start
//    in both tiers, so the cut changes no bit.
//  - state ranges and checkpoints decode and encode segment by segment with the host
//    tier's decode_moments / encode_moments; a publish copies the arrays not written as
//    stored bytes (never decoded and encoded again).
//  - the header (format 4) records the format; a file written with another format is
//    refused at open (invalid_argument naming both formats and the file).  Formats 2
//    and 3 hold FP32 moments, and FP32 moments are still written as format 3 (Note
//    [File tier]).  Checkpoints hold decoded FP32 moments and load into any
//    format (Note [Checkpoint generations]): they are the way to convert a state file.
// Limits: int8 pieces are 2^20 elements (4 MiB of FP32 per array of a window slot), so
// its window_bytes must be at least 12 MiB per slot (depth); bf16's are 2^15.
//
// Limits: one file per rank; the two slots cost 24 B per parameter (FP32 moments),
// the tables 16 B per 64 KiB (on disk and in memory), the step counts 16 B per shard.  A block damaged in the inactive
// slot is not noticed until that slot is read (it is rewritten by the next step first).
// A header copy rotted after its commit completed cannot be told from a torn write: the
// resume then takes the step before it (intact, verified) and logs a warning.
#include "file_store.hpp"
#include "file_util.hpp"
#include "kernels/moment_format.hpp"

#include <deferalloc/core/errors.hpp>
#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "log.hpp"

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
  std::uint32_t block_bytes;
  std::uint64_t seq;        // commit sequence: the valid copy with the highest wins
  std::uint64_t table_sum;  // checksum64 of the slot's checksum table
  std::uint64_t steps_sum;  // checksum64 of the shards' step counts (format 2: the header checksum)
  std::uint32_t moments;    // the moments' format, a moment_format (format 3: the header checksum, with pad)
  std::uint32_t pad;
  std::uint64_t checksum;   // of the bytes before it
};
constexpr std::uint32_t k_version = 5;           // small arrays packed (Note [Packed arrays])
constexpr std::uint32_t k_version_moments = 4;   // every array on blocks of its own; still resumed
constexpr std::uint32_t k_version_fp32 = 3;      // FP32 moments, no format field; still resumed
constexpr std::uint32_t k_version_one_step = 2;  // one step count per file; still resumed
constexpr std::size_t k_int8_segment = std::size_t{1} << 20;  // elements (Note [File tier moments])
constexpr std::uint64_t k_packed_max = std::uint64_t{64} << 20;  // bytes of a slot's packed area (Note [Packed arrays])

std::string format_name(moment_format f) { return to_string(f); }

std::string errtext(int e) { return std::strerror(e); }

// One zeroed aligned page, for O_DIRECT header I/O.
struct page : aligned_buffer {
  page() : aligned_buffer(file_store::align, true, "file tier: no memory for a header page") {}
};

// This process's pid without a system call per request (a step of many small arrays
// makes tens of thousands): cached, and forgotten in a forked child (pthread_atfork,
// registered before the first use).
std::atomic<pid_t> g_pid{0};
pid_t this_pid() {
  static const int registered = ::pthread_atfork(nullptr, nullptr, [] { g_pid.store(0, std::memory_order_relaxed); });
  (void)registered;
  pid_t p = g_pid.load(std::memory_order_relaxed);
  if (p == 0) g_pid.store(p = ::getpid(), std::memory_order_relaxed);
  return p;
}

}  // namespace

void io_batch::wait() {
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return pending_ == 0; });
  if (error_.empty()) return;
  if (corrupt_) throw corrupt_data(error_);
  throw io_error(error_);
}
bool io_batch::done() const {
  std::lock_guard lk(mu_);
  return pending_ == 0;
}

file_store::file_store(const std::string& dir, int rank, const std::vector<std::size_t>& numel, bool resume, int threads,
                       std::size_t request_bytes, moment_format format, host_memory host)
    : host_(std::move(host)), dir_(dir), format_(format), request_bytes_(std::max<std::size_t>(block, (request_bytes + block - 1) / block * block)),
      owner_pid_(::getpid()) {
  if (dir.empty()) throw invalid_argument("file tier: no directory given (optimizer_config::directory)");
  if (threads < 1) throw invalid_argument("file tier: io_threads must be at least 1");
  if (format_ != moment_format::fp32 && format_ != moment_format::bf16 && format_ != moment_format::int8)
    throw invalid_argument("file tier: unknown moment format " + std::to_string(static_cast<int>(format_)));
  check_dir(dir, "file tier", false);
  path_ = dir + "/deferalloc-rank" + std::to_string(rank) + ".state";
  tmp_path_ = path_ + ".new";
  try {
    lock_owner();  // before anything looks at the state file; released by shut_down()
    // Layout (a resumed file of format 2 to 4 lays itself out again: open_existing).
    std::uint64_t h = 0;
    for (std::size_t n : numel) h = checksum64(&n, sizeof n, h);
    layout_hash_ = h;
    numel_ = numel;
    // Test hook: new files of the layout before packing (formats 3 and 4), as an older
    // build wrote them.
    set_layout(std::getenv("DEFERALLOC_TEST_UNPACKED_STATE") == nullptr);
    steps_bytes_ = (numel.size() * 8 + align - 1) / align * align;
    shard_steps_.assign(numel.size(), 0);

    struct stat st {};
    const bool exists = ::lstat(path_.c_str(), &st) == 0;
    if (exists) check_owned_file(path_, st, "file tier");
    if (resume && exists) open_existing();
    else create_new();
    for (int i = 0; i < threads; ++i) io_->threads.emplace_back([this] { worker(); });
  } catch (...) {
    shut_down();  // the threads started, the state file (an unpublished one removed), the lock
    throw;
  }
}

// Note [Packed arrays]
//
// Rationale: every array on whole 64 KiB blocks of its own (the checksum unit, and
// O_DIRECT's alignment) made 10,000 parameters of 20 elements a 3.9 GB state file for
// 2.4 MB of state, and a step of 60,000 small requests (1.6 s against the host tier's
// 30 ms).
// Approach: an array of a shard smaller than a block (as stored: its moment format's
// bytes) is packed, 8-byte aligned, into the packed area at the start of each slot, up
// to k_packed_max bytes of it; every other array follows on whole blocks, as before.
// Placement is per array (main, exp_avg, exp_avg_sq, ...), so another kind of array is
// one more entry per shard.  The store keeps each slot's packed area in memory (an
// image, in the driver's pinned memory when the home passes it): a pass copies a packed
// array between the device and the image directly (packed(): no request, no staging),
// other reads and writes of one (state ranges, checkpoints, state writes) are copies in
// submit() (the test faults apply as to any request).  A commit writes the committed
// slot's whole image, block-aligned, with the slot's other data and records its blocks'
// checksums in the slot's table; so the two-slot protocol is unchanged (a kill before
// the commit record leaves the old slot and its image on disk).  A resume reads the active slot's image once and verifies every block of it
// before anything is used (a damaged one is corrupt_data at the open, not at the
// read).  An array that small is always one piece of a pass, one chunk of a checkpoint.
// Format 5 has this layout; files of formats 2 to 4 resume in their own layout (every
// array on blocks) and keep writing their format, so a file is never half one and half
// the other; a build that reads up to format 4 refuses a format-5 file (another format
// version).
// Limits: the images cost 2 x the packed area of host memory (at most 2 x 64 MiB), and
// each commit writes the packed area whole (at most 64 MiB; 2.4 MB for 10,000 params
// of 20 elements); arrays past k_packed_max are laid out on blocks as before.
void file_store::set_layout(bool pack) {
  packed_layout_ = pack;
  places_.assign(numel_.size(), {});
  packed_spans_.clear();
  auto blocks = [](std::uint64_t bytes) { return (bytes + block - 1) / block * block; };
  std::uint64_t at = 0;  // the packed area's end
  for (std::size_t s = 0; s < numel_.size(); ++s) {
    const std::uint64_t moment = stored_bytes(format_, numel_[s]);
    for (std::uint64_t bytes : {std::uint64_t{numel_[s]} * 4, moment, moment}) {
      place p{0, bytes, false};
      const std::uint64_t start = (at + 7) / 8 * 8;
      if (pack && bytes > 0 && bytes < block && start + bytes <= k_packed_max) {
        p.off = start;
        p.packed = true;
        at = start + bytes;
        packed_spans_.emplace_back(start, at);
      }
      places_[s].push_back(p);
    }
  }
  packed_bytes_ = blocks(at);
  slot_bytes_ = packed_bytes_;
  for (auto& shard : places_)
    for (auto& p : shard)
      if (!p.packed) p.off = slot_bytes_, slot_bytes_ += blocks(p.bytes);
  blocks_per_slot_ = slot_bytes_ / block;
  table_bytes_ = (blocks_per_slot_ * 8 + align - 1) / align * align;
  for (auto& t : table_) t.assign(blocks_per_slot_, 0);
}

void file_store::free_images() noexcept {
  for (auto& img : image_) {
    if (img && host_.free) host_.free(img);
    else std::free(img);
    img = nullptr;
  }
}

void file_store::load_images(bool read) {
  free_images();
  for (auto& img : image_) {
    if (packed_bytes_ == 0) continue;
    img = static_cast<unsigned char*>(host_.alloc ? host_.alloc(packed_bytes_) : std::aligned_alloc(align, packed_bytes_));
    if (!img) throw out_of_memory("file tier: no host memory for the packed arrays (" + std::to_string(packed_bytes_) + " bytes)");
    std::memset(img, 0, packed_bytes_);
  }
  if (!read || packed_bytes_ == 0) return;
  unsigned char* img = image_[slot_];
  const std::uint64_t base = 2 * align + static_cast<std::uint64_t>(slot_) * slot_bytes_;
  for (std::uint64_t done = 0; done < packed_bytes_;) {
    const ssize_t n = ::pread(fd_, img + done, packed_bytes_ - done, static_cast<off_t>(base + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw io_error("file tier: reading the packed arrays of slot " + std::to_string(slot_) + " at offset " +
                     std::to_string(base + done) + " of " + path_ + " failed: " + (n < 0 ? errtext(errno) : "end of file"));
    done += static_cast<std::uint64_t>(n);
  }
  for (std::uint64_t k = 0; k < packed_bytes_ / block; ++k)
    if (checksum64(img + k * block, block, slot_ * blocks_per_slot_ + k) != table_[slot_][k])
      throw corrupt_data("file tier: " + path_ + ": slot " + std::to_string(slot_) + ", the packed small arrays, block at "
                         "offset " + std::to_string(base + k * block) + " fails its checksum (the state file is corrupt)");
  std::memcpy(image_[1 - slot_], img, packed_bytes_);
}

// Note [One owner per state file]
//
// Rationale: two optimizers on one state file (one process or two) each commit their
// own steps into it; the second one's create_new() even replaces the first's file.  One
// of them loses its steps without an error.
// Approach: before looking at the state file, file_store takes an exclusive flock() on
// <state>.lock (created 0600 beside it, never followed through a symlink, never
// removed: removing a lock file lets two openers lock two different files) and keeps
// it until it is destroyed.  flock() locks belong to the open file description, so a
// second opener in the same process conflicts too (a POSIX fcntl lock would not), and
// the kernel drops the lock when the holder dies (a kill leaves no stale lock).  The
// holder writes its pid into the file, which the refused opener names.
// A forked child (a DataLoader worker forked after the optimizer was built) shares the
// lock's open file description, so the lock would live until the child exits too and a
// new optimizer of the parent would be refused: every lock fd is registered, and a
// pthread_atfork child handler closes the child's copies (closing, never LOCK_UN, which
// would release the parent's lock).  The fd is opened and registered under the
// registry's mutex, which the fork holds (prepare handler), and locked after the mutex
// is released, so no fork sees an fd locked and not yet registered.  A registry entry is
// the fd and its file_store: a child that builds its own optimizer may get the closed
// fd's number again.
// A file_store remembers the process that built it; destroyed in another one (a forked
// child exiting, or deleting the inherited optimizer) it touches nothing: no join of I/O
// threads that exist only in the parent, no unlink of the parent's unpublished .new
// file, no close of a lock fd.  Its reads, writes and commits there throw invalid_state.
// Limits: advisory (only deferalloc honours it); the pid is what the holder wrote (a
// holder that has not written it yet is named as unknown); on NFS flock() is emulated
// with fcntl locks, which conflict between processes only; a process made by clone()
// without fork's handlers (vfork, posix_spawn) keeps its copy until it execs (the fd is
// O_CLOEXEC); a child closes its copy when it first runs, so the parent's fork() can
// return, and a lock attempt of the parent fail, before that.  A file_store destroyed in
// a forked child leaks, by design, its I/O pool's memory and its copy of the state
// file's fd (the child's exit or exec frees both).
namespace {
struct lock_registry {
  struct entry {
    int fd;
    const void* owner;  // the file_store: an fd number alone is reused once closed
  };
  std::mutex mu;
  std::vector<entry> fds;  // the lock fds of this process's file stores
};
lock_registry& locks() {
  static auto* r = new lock_registry;  // never destroyed: a fork at exit still finds it
  static std::once_flag once;
  std::call_once(once, [] {
    ::pthread_atfork([] { locks().mu.lock(); }, [] { locks().mu.unlock(); },
                     [] {
                       auto& l = locks();
                       for (const auto& e : l.fds) ::close(e.fd);
                       l.fds.clear();
                       l.mu.unlock();
                     });
  });
  return *r;
}
}  // namespace

void file_store::release_lock() noexcept {
  if (lock_fd_ < 0) return;
  auto& l = locks();
  std::lock_guard lk(l.mu);
  const auto it = std::find_if(l.fds.begin(), l.fds.end(), [&](const auto& e) { return e.fd == lock_fd_ && e.owner == this; });
  if (it != l.fds.end()) {  // else a forked child's copy, closed by the fork
    l.fds.erase(it);
    ::close(lock_fd_);
  }
  lock_fd_ = -1;
}

void file_store::lock_owner() {
  const std::string lock_path = path_ + ".lock";
  struct stat st {};
  if (::lstat(lock_path.c_str(), &st) == 0) check_owned_file(lock_path, st, "file tier");
  auto& l = locks();
  std::unique_lock reg(l.mu);
  lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (lock_fd_ < 0) {
    const int e = errno;
    if (::lstat(lock_path.c_str(), &st) == 0) throw io_error("file tier: cannot open " + lock_path + ": " + errtext(e));
    // The first file made in the directory: say that the state file cannot be made.
    throw io_error("file tier: cannot create the state file in " + dir_ + ": " + errtext(e) + " (creating " + lock_path + ")");
  }
  l.fds.push_back({lock_fd_, this});
  reg.unlock();
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    char pid[32] = {};
    const ssize_t n = ::pread(lock_fd_, pid, sizeof pid - 1, 0);
    release_lock();
    std::string holder = n > 0 ? std::string(pid, static_cast<std::size_t>(n)) : std::string();
    holder.resize(std::min(holder.size(), holder.find_first_not_of("0123456789")));
    if (e != EWOULDBLOCK) throw io_error("file tier: cannot lock " + lock_path + ": " + errtext(e));
    const std::string who = holder.empty() ? std::string("a process whose pid is not recorded")
                                           : "process " + holder + (holder == std::to_string(::getpid()) ? " (this one)" : "");
    throw invalid_state("file tier: " + path_ + " is in use by another optimizer, held by " + who + " (lock " + lock_path +
                        "); one optimizer per state file");
  }
  const std::string me = std::to_string(::getpid()) + "\n";
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size()))
    deferalloc::detail::log(log_level::warn, "file tier: cannot write this process's pid into " + lock_path);
}

// Opens fd_ on `path` with `flags` (O_DIRECT when the file system has it); the file
// must be a regular file owned by this user.
static int open_checked(const std::string& path, int flags, bool& direct, const std::string& dir) {
  int fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
  direct = fd >= 0;
  if (fd < 0 && errno == EINVAL) {
    fd = ::open(path.c_str(), flags, 0600);
    deferalloc::detail::log(log_level::info, "file tier: " + dir + " does not support O_DIRECT; using buffered I/O");
  }
  if (fd < 0 && (flags & O_CREAT))
    throw io_error("file tier: cannot create the state file in " + dir + ": " + std::strerror(errno) + " (" + path + ")");
  if (fd < 0) throw io_error("file tier: cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
    ::close(fd);
    throw io_error("file tier: " + path + " is not a regular file owned by this user; refusing to use it");
  }
  return fd;
}

void file_store::create_new() {
  struct stat st {};
  if (::lstat(tmp_path_.c_str(), &st) == 0) {
    check_owned_file(tmp_path_, st, "file tier");
    ::unlink(tmp_path_.c_str());  // a killed run's unpublished file
  }
  fd_ = open_checked(tmp_path_, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, direct_, dir_);
  published_ = false;  // from here a failure closes and removes it (shut_down)
  const std::uint64_t total = steps_offset(2);
  if (::fallocate(fd_, 0, 0, static_cast<off_t>(total)) != 0) {
    const int e = errno;
    if (e != EOPNOTSUPP)
      throw io_error("file tier: cannot reserve " + std::to_string(total) + " bytes for " + tmp_path_ + ": " + errtext(e));
    if (::ftruncate(fd_, static_cast<off_t>(total)) != 0)
      throw io_error("file tier: cannot size " + tmp_path_ + ": " + errtext(errno));
  }
  load_images(false);
}

void file_store::open_existing() {
  fd_ = open_checked(path_, O_RDWR | O_NOFOLLOW | O_CLOEXEC, direct_, dir_);
  try {
    struct stat st {};
    auto truncated = [&](std::uint64_t need) {
      return corrupt_data("file tier: " + path_ + " is " + std::to_string(st.st_size) + " bytes, its layout needs " +
                          std::to_string(need) + " (truncated); refusing to resume");
    };
    if (::fstat(fd_, &st) != 0 || static_cast<std::uint64_t>(st.st_size) < 2 * align) throw truncated(table_offset(2));
    commit_record best, rec;
    bool found = false;
    header_state states[2];
    std::uint32_t versions[2] = {0, 0};
    for (int c = 0; c < 2; ++c) {
      states[c] = read_header(c, rec);
      versions[c] = rec.version;
      if (states[c] == header_state::valid && (!found || rec.seq > best.seq)) {
        found = true;
        best = rec;
      }
      // Before the size: a file of another format has another size.
      if (states[c] == header_state::other_format)
        throw invalid_argument("file tier: " + path_ + " holds moments in " + format_name(rec.format) +
                               ", this optimizer is configured with moment format " + format_name(format_) +
                               "; refusing to resume (resume with moments " + format_name(rec.format) +
                               ", or convert through a checkpoint: docs/DURABILITY.md)");
    }
    // A file of format 2 to 4 keeps its layout (Note [Packed arrays]).
    if (found && best.version != k_version) set_layout(false);
    const std::uint64_t total = table_offset(2);
    if (static_cast<std::uint64_t>(st.st_size) < total) throw truncated(total);
    if (!found) {
      for (int c = 0; c < 2; ++c) {
        if (states[c] == header_state::other_layout)
          throw corrupt_data("file tier: " + path_ + " holds state of another layout (different shards); refusing to resume");
        if (states[c] == header_state::other_version)
          throw corrupt_data("file tier: " + path_ + " has format version " + std::to_string(versions[c]) +
                             "; this build reads formats " + std::to_string(k_version_one_step) + " to " +
                             std::to_string(k_version) + "; refusing to resume");
      }
      throw corrupt_data("file tier: both commit records of " + path_ +
                         " (offsets 0 and 4096) are unreadable; refusing to resume (this would restart from step 0)");
    }
    // An empty copy is a record never written (a file with one commit so far).
    for (int c = 0; c < 2; ++c)
      if (states[c] != header_state::valid && states[c] != header_state::empty)
        deferalloc::detail::log(log_level::warn, "file tier: commit record " + std::to_string(c) + " of " + path_ +
                                                     " is damaged; resuming from the other one, step " +
                                                     std::to_string(best.step));
    extended_ = static_cast<std::uint64_t>(st.st_size) >= steps_offset(2);
    if (best.version != k_version_one_step) {
      if (!extended_) throw truncated(steps_offset(2));
      aligned_buffer sb(steps_bytes_, false, "file tier: no memory for the step counts");
      const std::uint64_t soff = steps_offset(static_cast<int>(best.seq % 2));
      if (::pread(fd_, sb.p, steps_bytes_, static_cast<off_t>(soff)) != static_cast<ssize_t>(steps_bytes_))
        throw io_error("file tier: reading the step counts at offset " + std::to_string(soff) + " of " + path_ + " failed");
      std::memcpy(shard_steps_.data(), sb.p, shard_steps_.size() * 8);
      if (checksum64(shard_steps_.data(), shard_steps_.size() * 8) != best.steps_sum)
        throw corrupt_data("file tier: the step counts at offset " + std::to_string(soff) + " of " + path_ +
                           " are corrupt; refusing to resume");
    } else {
      shard_steps_.assign(shard_steps_.size(), best.step);  // format 2: one count per file
      deferalloc::detail::log(log_level::info, "file tier: " + path_ + " has format 2 (one step count per file): every "
                                                   "shard resumes at step " + std::to_string(best.step));
    }
    auto& t = table_[best.slot];
    aligned_buffer buf(table_bytes_, false, "file tier: no memory for the checksum table");
    const std::uint64_t toff = table_offset(best.slot);
    if (::pread(fd_, buf.p, table_bytes_, static_cast<off_t>(toff)) != static_cast<ssize_t>(table_bytes_))
      throw io_error("file tier: reading the checksum table of slot " + std::to_string(best.slot) + " at offset " +
                     std::to_string(toff) + " of " + path_ + " failed");
    std::memcpy(t.data(), buf.p, t.size() * 8);
    if (checksum64(t.data(), t.size() * 8) != best.table_sum)
      throw corrupt_data("file tier: the checksum table of slot " + std::to_string(best.slot) + " at offset " +
                         std::to_string(toff) + " of " + path_ + " is corrupt; refusing to resume");
    seq_ = best.seq;
    step_ = best.step;
    slot_ = best.slot;
    moments_written_ = best.moments;
    load_images(true);
    resumed_ = true;
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

file_store::~file_store() { shut_down(); }

// Note [State file removed]
//
// Rationale: the state file open, an `rm` of it (or `rm -rf` of its directory) leaves the
// optimizer writing into an unlinked inode: its steps and commits succeed, and a resume
// finds no file and starts fresh, every step since lost without an error.
// Approach: every commit (so every step, init, state write and checkpoint load) first
// checks that the path (the final name, or <name>.new before the first commit) still
// names the open file: stat(path) and fstat(fd) agree on st_dev and st_ino.  Otherwise
// io_error naming the path, the last durable step and why, before anything is written.
// save_checkpoint is not refused: it reads the held file, whose data is intact, so a
// checkpoint is the way to keep the steps.
// Limits: a removal between the check and the commit's last fdatasync is noticed by the
// next commit; a file renamed away and back is not noticed.  Cost: one stat and one
// fstat per commit.
void file_store::check_path(const std::string& what) const {
  const std::string& p = published_ ? path_ : tmp_path_;
  struct stat named {}, held {};
  const bool gone = ::stat(p.c_str(), &named) != 0;
  const int e = errno;
  if (::fstat(fd_, &held) != 0) throw io_error("file tier: cannot fstat " + p + ": " + errtext(errno));
  if (!gone && named.st_dev == held.st_dev && named.st_ino == held.st_ino) return;
  throw io_error("file tier: the state file " + p + " was removed or replaced while this optimizer held it (" +
                 (gone ? "stat: " + errtext(e) : std::string("another file is at its path now")) + "); " + what +
                 " is refused: the steps since the last commit are not durable, and a resume would not find that "
                 "commit (step " + std::to_string(step_) + ") there; save_checkpoint still reads the held state, so a "
                 "checkpoint keeps it");
}

void file_store::refuse_in_child(const std::string& what) const {
  if (this_pid() != owner_pid_)
    throw invalid_state("file tier: " + path_ + " belongs to process " + std::to_string(owner_pid_) +
                        "; a forked child cannot move its data (" + what + ")");
}

void file_store::shut_down() noexcept {
  if (::getpid() != owner_pid_) {  // a forked child: Note [One owner per state file]
    (void)io_.release();           // its threads are the parent's; its cv has their waits
    fd_ = -1;
    lock_fd_ = -1;
    published_ = true;
    return;
  }
  {
    std::lock_guard lk(io_->mu);
    io_->stop = true;
  }
  io_->cv.notify_all();
  for (auto& t : io_->threads) t.join();
  io_->threads.clear();
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!published_) ::unlink(tmp_path_.c_str());  // never committed: nothing to resume
  published_ = true;
  free_images();
  release_lock();  // Note [One owner per state file]: after the last write
}

file_store::header_state file_store::read_header(int copy, commit_record& out) {
  page buf;
  if (::pread(fd_, buf.p, align, copy * align) != static_cast<ssize_t>(align)) return header_state::damaged;
  header h{};
  std::memcpy(&h, buf.p, sizeof h);
  bool empty = true;
  for (std::size_t i = 0; i < align && empty; ++i) empty = buf.p[i] == 0;
  if (empty) return header_state::empty;
  // Format 2 had no steps_sum: its header checksum is where steps_sum is now; format 3
  // had no moment format: its header checksum is where moments and pad are now.
  std::uint64_t at_moments;
  std::memcpy(&at_moments, &h.moments, 8);
  const bool v4 = h.checksum == checksum64(&h, offsetof(header, checksum));
  const bool v3 = at_moments == checksum64(&h, offsetof(header, moments));
  const bool v2 = h.steps_sum == checksum64(&h, offsetof(header, steps_sum));
  if (!(v4 || v3 || v2) || std::memcmp(h.magic, k_magic, 8) != 0) return header_state::damaged;
  const bool known = v4 ? h.version == k_version || h.version == k_version_moments
                        : h.version == (v3 ? k_version_fp32 : k_version_one_step);
  out.version = h.version;
  if (!known || h.block_bytes != block) return header_state::other_version;
  if (h.slot > 1 || (v4 && h.moments > static_cast<std::uint32_t>(moment_format::int8))) return header_state::damaged;
  out.format = v4 ? static_cast<moment_format>(h.moments) : moment_format::fp32;
  if (out.format != format_) return header_state::other_format;
  if (h.layout != layout_hash_) return header_state::other_layout;
  out.step = h.step;
  out.seq = h.seq;
  out.slot = static_cast<int>(h.slot);
  out.moments = h.moments_written != 0;
  out.table_sum = h.table_sum;
  out.steps_sum = v2 && !v3 && !v4 ? 0 : h.steps_sum;
  out.version = h.version;
  return header_state::valid;
}

std::uint64_t file_store::table_offset(int slot) const { return 2 * align + 2 * slot_bytes_ + slot * table_bytes_; }

std::size_t file_store::segment(moment_format f) {
  return f == moment_format::int8 ? k_int8_segment : f == moment_format::bf16 ? block / 2 : 1;
}

std::uint64_t file_store::stored_bytes(moment_format f, std::size_t n) {
  if (f != moment_format::int8) return moment_bytes(f, n);
  const std::size_t whole = n / k_int8_segment, rest = n % k_int8_segment;
  return whole * moment_bytes(f, k_int8_segment) + (rest ? moment_bytes(f, rest) : 0);
}

std::uint64_t file_store::offset(int slot, std::size_t s, state_array a, std::size_t elem) const {
  const std::uint64_t base = 2 * align + static_cast<std::uint64_t>(slot) * slot_bytes_ + places_[s][static_cast<std::size_t>(a)].off;
  if (a == state_array::main) return base + elem * 4;
  DFA_EXPECTS(elem % segment(format_) == 0, "file tier: a moment range starts at element " + std::to_string(elem) +
                                                ", not on a segment of " + std::to_string(segment(format_)), invalid_state);
  return base + stored_bytes(format_, elem);
}

unsigned char* file_store::packed(int slot, std::size_t s, state_array a) const {
  const place& p = places_[s][static_cast<std::size_t>(a)];
  if (!p.packed || this_pid() != owner_pid_) return nullptr;  // a child: the requests refuse it
  return image_[slot] + p.off;
}

std::size_t file_store::io_bytes(state_array a, std::size_t e0, std::size_t n) const {
  if (a == state_array::main) return io_bytes(n);
  const std::uint64_t bytes = stored_bytes(format_, e0 + n) - stored_bytes(format_, e0);
  return static_cast<std::size_t>((bytes + align - 1) / align * align);
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
  refuse_in_child(what);
  if (!batch) batch = std::make_shared<io_batch>();
  if (off >= 2 * align && off < table_offset(0) && (off - 2 * align) % slot_bytes_ < packed_bytes_) {
    try {
      run_packed(buf, bytes, off, write, what);
    } catch (const std::exception& e) {
      std::lock_guard bl(batch->mu_);
      if (batch->error_.empty()) batch->error_ = e.what();
    }
    return batch;
  }
  if (bytes % align != 0 || off < 2 * align || off + bytes > table_offset(0) ||
      (off - 2 * align) % slot_bytes_ % block != 0 || reinterpret_cast<std::uintptr_t>(buf) % align != 0)
    throw invalid_argument("file tier: unaligned request for " + what);
  std::lock_guard lk(io_->mu);
  for (std::size_t done = 0; done < bytes; done += request_bytes_) {
    const std::size_t n = std::min(request_bytes_, bytes - done);
    io_->queue.push_back({static_cast<char*>(buf) + done, n, off + done, write, what, batch});
    std::lock_guard bl(batch->mu_);
    ++batch->pending_;
  }
  io_->cv.notify_all();
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

void file_store::run_packed(void* buf, std::size_t bytes, std::uint64_t off, bool write, const std::string& what) {
  const std::uint64_t rel = (off - 2 * align) % slot_bytes_;
  const int slot = static_cast<int>((off - 2 * align) / slot_bytes_);
  const auto it = std::upper_bound(packed_spans_.begin(), packed_spans_.end(), std::make_pair(rel, ~std::uint64_t{0}));
  if (it == packed_spans_.begin() || std::prev(it)->second <= rel)
    throw invalid_argument("file tier: a request for " + what + " at offset " + std::to_string(off) +
                           " is in no packed array");
  const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(bytes, std::prev(it)->second - rel));
  const fault_kind f = take_fault(write ? fault_op::write : fault_op::read);
  if (f == fault_kind::crash) ::_exit(86);  // test hook: a process killed mid-step
  const std::string where = f == fault_kind::none ? std::string() : what + " at offset " + std::to_string(off) + " of " + path_;
  if (f == fault_kind::eio || f == fault_kind::enospc)
    throw io_error(std::string(write ? "write" : "read") + " of " + where + " failed: " +
                   errtext(f == fault_kind::eio ? EIO : ENOSPC));
  if (f == fault_kind::short_read)
    throw io_error("short " + std::string(write ? "write" : "read") + " of " + where + ": 0 of " + std::to_string(n) + " bytes");
  unsigned char* img = image_[slot] + rel;
  if (write) std::memcpy(img, buf, n);
  else std::memcpy(buf, img, n);  // the bytes past the array: the caller's (zeros nowhere needed)
}

void file_store::run(request& r) {
  const std::string where = r.what + " at offset " + std::to_string(r.off) + " of " + path_;
  const fault_kind f = take_fault(r.write ? fault_op::write : fault_op::read);
  if (f == fault_kind::crash) ::_exit(86);  // test hook: a process killed mid-step
  if (r.write) checksum_blocks(r);
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
  if (!r.write) checksum_blocks(r);
}

void file_store::checksum_blocks(const request& r) {
  const std::uint64_t rel = r.off - 2 * align;
  const int slot = static_cast<int>(rel / slot_bytes_);
  const std::uint64_t first = rel % slot_bytes_ / block;
  for (std::size_t done = 0, k = first; done < r.bytes; done += block, ++k) {
    const std::size_t n = std::min(block, r.bytes - done);
    // Seeded with the block's place, so a block written at the wrong offset fails too.
    const std::uint64_t sum = checksum64(static_cast<const char*>(r.buf) + done, n, slot * blocks_per_slot_ + k);
    if (r.write) {
      table_[slot][k] = sum;
    } else if (table_[slot][k] != sum) {
      throw corrupt_data("file tier: " + path_ + ": slot " + std::to_string(slot) + ", " + r.what + ", block at offset " +
                         std::to_string(r.off + done) + " fails its checksum (the state file is corrupt)");
    }
  }
}

void file_store::worker() {
  for (;;) {
    request r;
    {
      std::unique_lock lk(io_->mu);
      io_->cv.wait(lk, [&] { return io_->stop || !io_->queue.empty(); });
      if (io_->queue.empty()) return;
      r = std::move(io_->queue.front());
      io_->queue.pop_front();
    }
    std::string err;
    bool corrupt = false;
    try {
      run(r);
    } catch (const corrupt_data& e) {
      err = e.what();
      corrupt = true;
    } catch (const std::exception& e) {
      err = e.what();
    }
    std::lock_guard bl(r.batch->mu_);
    if (!err.empty() && r.batch->error_.empty()) {
      r.batch->error_ = err;
      r.batch->corrupt_ = corrupt;
    }
    if (--r.batch->pending_ == 0) r.batch->cv_.notify_all();
  }
}

void file_store::commit(std::uint64_t step, int slot, bool moments_written, std::span<const std::uint64_t> shard_steps) {
  DFA_EXPECTS(shard_steps.size() == shard_steps_.size(), "file tier: commit with " + std::to_string(shard_steps.size()) +
                                                             " step counts for " + std::to_string(shard_steps_.size()) +
                                                             " shards", invalid_state);
  refuse_in_child("the commit of step " + std::to_string(step));
  check_path("the commit of step " + std::to_string(step));
  const fault_kind f = take_fault(fault_op::commit);
  if (f == fault_kind::crash) ::_exit(86);
  if (f != fault_kind::none) throw io_error("commit of step " + std::to_string(step) + " to " + path_ + " failed: " + errtext(EIO));
  const auto& t = table_[slot];
  const std::uint64_t seq = seq_ + 1;
  if (!extended_) {  // a format-2 file: room for the step counts first
    if (::fallocate(fd_, 0, 0, static_cast<off_t>(steps_offset(2))) != 0 &&
        (errno != EOPNOTSUPP || ::ftruncate(fd_, static_cast<off_t>(steps_offset(2))) != 0))
      throw io_error("file tier: cannot extend " + path_ + " by its step counts: " + errtext(errno));
    extended_ = true;
  }
  if (packed_bytes_ > 0) {  // the slot's packed arrays, whole (Note [Packed arrays])
    const unsigned char* img = image_[slot];
    const std::uint64_t base = 2 * align + static_cast<std::uint64_t>(slot) * slot_bytes_;
    for (std::uint64_t k = 0; k < packed_bytes_ / block; ++k)
      table_[slot][k] = checksum64(img + k * block, block, slot * blocks_per_slot_ + k);
    for (std::uint64_t done = 0; done < packed_bytes_;) {
      const ssize_t n = ::pwrite(fd_, img + done, packed_bytes_ - done, static_cast<off_t>(base + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        throw io_error("packed arrays of step " + std::to_string(step) + " to " + path_ + " failed: " +
                       errtext(n < 0 ? errno : EIO));
      done += static_cast<std::uint64_t>(n);
    }
  }
  {
    aligned_buffer sb(steps_bytes_, true, "file tier: no memory for the step counts");
    std::memcpy(sb.p, shard_steps.data(), shard_steps.size() * 8);
    const off_t soff = static_cast<off_t>(steps_offset(static_cast<int>(seq % 2)));
    if (::pwrite(fd_, sb.p, steps_bytes_, soff) != static_cast<ssize_t>(steps_bytes_))
      throw io_error("step counts of step " + std::to_string(step) + " to " + path_ + " failed: " + errtext(errno));
  }
  {
    aligned_buffer tb(table_bytes_, true, "file tier: no memory for the checksum table");
    std::memcpy(tb.p, t.data(), t.size() * 8);
    const off_t toff = static_cast<off_t>(table_offset(slot));
    if (::pwrite(fd_, tb.p, table_bytes_, toff) != static_cast<ssize_t>(table_bytes_))
      throw io_error("checksum table of step " + std::to_string(step) + " to " + path_ + " failed: " + errtext(errno));
  }
  if (::fdatasync(fd_) != 0) throw io_error("fdatasync of " + path_ + " failed: " + errtext(errno));
  page buf;
  header h{};
  std::memcpy(h.magic, k_magic, 8);
  // A file of the layout before packing keeps its format: FP32 moments format 3, which a
  // build before format 4 reads (a format-4 header looks damaged to it, and it would
  // resume one commit back without an error), compressed ones format 4.  A packed
  // layout is format 5, whatever the moments.
  const bool v3 = !packed_layout_ && format_ == moment_format::fp32;
  h.version = v3 ? k_version_fp32 : packed_layout_ ? k_version : k_version_moments;
  h.slot = static_cast<std::uint32_t>(slot);
  h.layout = layout_hash_;
  h.step = step;
  h.moments_written = moments_written ? 1 : 0;
  h.block_bytes = block;
  h.moments = static_cast<std::uint32_t>(format_);
  h.seq = seq;
  h.table_sum = checksum64(t.data(), t.size() * 8);
  h.steps_sum = checksum64(shard_steps.data(), shard_steps.size() * 8);
  if (v3) {  // format 3's checksum is where the moment format and pad are now
    const std::uint64_t sum = checksum64(&h, offsetof(header, moments));
    std::memcpy(&h.moments, &sum, 8);
  } else {
    h.checksum = checksum64(&h, offsetof(header, checksum));
  }
  std::memcpy(buf.p, &h, sizeof h);
  const off_t where = static_cast<off_t>((h.seq % 2) * align);
  if (::pwrite(fd_, buf.p, align, where) != static_cast<ssize_t>(align))
    throw io_error("commit record of step " + std::to_string(step) + " to " + path_ + " failed: " + errtext(errno));
  if (::fdatasync(fd_) != 0) throw io_error("fdatasync of " + path_ + " failed: " + errtext(errno));
  if (!published_) {
    if (::rename(tmp_path_.c_str(), path_.c_str()) != 0)
      throw io_error("file tier: cannot rename " + tmp_path_ + " to " + path_ + ": " + errtext(errno));
    published_ = true;
    fsync_dir(dir_, "file tier");
  }
  seq_ = h.seq;
  step_ = step;
  slot_ = slot;
  moments_written_ = moments_written;
  shard_steps_.assign(shard_steps.begin(), shard_steps.end());
}

}  // namespace deferalloc::optim::detail
