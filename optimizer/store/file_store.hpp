// The file tier: one state file per rank, two slots of state (FP32 main params, the
// moments in their format) and a commit record.  See Note [File tier] in file_store.cpp.
#pragma once
#include <deferalloc/core/export.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>

#include "durable_files.hpp"

namespace deferalloc::optim::detail {

/// A group of I/O requests that completes together; wait() throws io_error (or
/// corrupt_data, for data that fails its checksum) with the first failure, which names
/// the file, slot, offset and what was being read or written.
class io_batch {
 public:
  void wait();
  bool done() const;

 private:
  friend class file_store;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::size_t pending_ = 0;
  std::string error_;
  bool corrupt_ = false;
};

class file_store {
 public:
  /// Test hooks: fail the nth read/write block or commit.
  using fault_kind = file_fault_kind;  // optimizer.hpp: the public test hook's vocabulary
  using fault_op = file_fault_op;

  static constexpr std::size_t align = 4096;
  /// The checksum unit: every request starts on a block boundary of its slot and covers
  /// whole blocks (the last block of an array ends at io_bytes of the array).
  static constexpr std::size_t block = std::size_t{64} << 10;

  /// Opens (resume) or creates `dir`/deferalloc-rank<rank>.state for shards of the given
  /// sizes, with the moments in `format` (Note [File tier moments]).  A
  /// new file is created under a temporary name (0600, exclusive, no symlink followed),
  /// its space reserved up front (fallocate) so a full disk fails here, and renamed into
  /// place by the first commit.  `dir` must be a directory owned by this
  /// user, not a symlink; an existing state file must be a regular file owned by this
  /// user, checked before anything is written.  Resume reads the newest valid commit
  /// record and its checksum table; a file with no commit is refused (see
  /// Note [File tier integrity]).  Cost: one file open, two header reads, one table read.
  /// @throws io_error (open, ownership, space), corrupt_data (another layout or format,
  ///         truncated, both commit records unreadable, a damaged checksum table),
  ///         invalid_argument (a file whose moments are in another format)
  /// `host` allocates the packed areas' images (Note [Packed arrays]): pinned memory of
  /// the optimizer's driver, so a pass copies them like staging buffers; unset, aligned
  /// heap memory.
  struct host_memory {
    std::function<void*(std::size_t)> alloc;  // aligned to `align`
    std::function<void(void*)> free;
  };
  file_store(const std::string& dir, int rank, const std::vector<std::size_t>& numel, bool resume, int threads,
             std::size_t request_bytes, moment_format format = moment_format::fp32, host_memory host = {});
  ~file_store();

  const std::string& path() const { return path_; }
  bool resumed() const { return resumed_; }
  std::uint64_t committed_step() const { return step_; }
  /// The committed step count of each shard (a format-2 file, which kept one count per
  /// file: committed_step() for every shard).
  const std::vector<std::uint64_t>& shard_steps() const { return shard_steps_; }
  int active_slot() const { return slot_; }
  bool moments_written() const { return moments_written_; }
  bool direct_io() const { return direct_; }

  /// Byte offset of element `elem` of array `a` of shard `s` in slot `slot` (Note
  /// [Packed arrays]: a small array is packed with others at the slot's start, else on
  /// whole blocks of its own).  A moment's `elem` is on a segment boundary (segment()).
  std::uint64_t offset(int slot, std::size_t s, state_array a, std::size_t elem) const;
  /// Bytes of `n` FP32 values rounded up to the I/O alignment.
  static std::size_t io_bytes(std::size_t n) { return (n * 4 + align - 1) / align * align; }
  /// The I/O bytes of elements [e0, e0+n) of array `a` as stored (e0 on a segment
  /// boundary; the range a whole number of segments or up to the array's end).
  std::size_t io_bytes(state_array a, std::size_t e0, std::size_t n) const;
  moment_format format() const { return format_; }
  /// Array `a` of shard `s` as slot `slot` stores it, in the slot's packed area in memory
  /// (Note [Packed arrays]), or null when that array is not packed.  A pass reads and
  /// writes a packed array there directly (no request); the next commit of the slot
  /// writes it.  Not for a forked child (null there).
  unsigned char* packed(int slot, std::size_t s, state_array a) const;
  /// Elements per segment of a moment array in format `f` (Note [File tier moments]): a
  /// request of a moment starts on one.
  static std::size_t segment(moment_format f);
  /// Bytes of the first `n` elements of a moment array in format `f` as the file stores
  /// them (`n` a whole number of segments, or the array's length).
  static std::uint64_t stored_bytes(moment_format f, std::size_t n);

  /// Adds a read (write) of `bytes` at `off` to `batch` (created when null).  `buf` and
  /// `off` must be aligned, `off` on a block boundary of its slot, `bytes` whole blocks
  /// or up to the end of an array; `what` names the data for error messages.  Writes
  /// record each block's checksum for the next commit of that slot; reads verify each
  /// block against the committed table as it arrives (cost: one checksum64 pass over
  /// the bytes, on the I/O threads).  A packed array's `off` is offset()'s, and `bytes`
  /// io_bytes() of it: served here from the slot's packed area in memory, the bytes
  /// past the array's end left out (a write) or zeros (a read).
  std::shared_ptr<io_batch> read(void* buf, std::size_t bytes, std::uint64_t off, const std::string& what,
                                 std::shared_ptr<io_batch> batch = nullptr);
  std::shared_ptr<io_batch> write(const void* buf, std::size_t bytes, std::uint64_t off, const std::string& what,
                                  std::shared_ptr<io_batch> batch = nullptr);
  /// Makes every written byte durable, then writes the commit record (step, slot, the
  /// shards' step counts) in the header copy of the next sequence number's parity (and
  /// the step counts in that copy's area), then makes it durable.  `slot` is the
  /// inactive slot after writes to it, or the active one when only step counts change
  /// (its data and checksum table are then rewritten with the same bytes).
  void commit(std::uint64_t step, int slot, bool moments_written, std::span<const std::uint64_t> shard_steps);
  /// Refuses to go on when the state file's path no longer names the open file (removed
  /// or replaced while this store held it: Note [State file removed]); `what` names the
  /// refused operation.  commit() calls it first.  Cost: one stat and one fstat.
  /// @throws io_error naming the path and the last durable step
  void check_path(const std::string& what) const;

  void inject(fault_op op, fault_kind kind, std::uint64_t nth);

 private:
  struct request {
    void* buf;
    std::size_t bytes;
    std::uint64_t off;
    bool write;
    std::string what;
    std::shared_ptr<io_batch> batch;
  };
  // Where one array of a shard is in a slot (Note [Packed arrays]).
  struct place {
    std::uint64_t off = 0;    // from the slot's start
    std::uint64_t bytes = 0;  // as stored
    bool packed = false;
  };
  /// Lays the slots out for shards of `numel` elements, small arrays packed or (`pack`
  /// false: formats 2 to 4) every array on blocks of its own; sizes the tables.
  void set_layout(bool pack);
  /// Allocates the packed areas' images; `read`: fills the active slot's from the file
  /// and verifies it (both images then hold it).
  void load_images(bool read);
  /// A request inside a packed area, served from its image (with the test faults).
  void run_packed(void* buf, std::size_t bytes, std::uint64_t off, bool write, const std::string& what);
  std::shared_ptr<io_batch> submit(void* buf, std::size_t bytes, std::uint64_t off, bool write, const std::string& what,
                                   std::shared_ptr<io_batch> batch);
  void worker();
  void run(request& r);
  fault_kind take_fault(fault_op op);
  /// Reads header copy `copy`; true when it is valid for `layout`.  Sets `other_layout`
  /// when the copy is ours (magic) but written for another layout.
  enum class header_state { valid, empty, damaged, other_layout, other_version, other_format };
  struct commit_record {
    std::uint64_t step = 0, seq = 0, table_sum = 0, steps_sum = 0;
    std::uint32_t version = 0;
    moment_format format = moment_format::fp32;  // the moments' format (formats 2 and 3: fp32)
    int slot = 0;
    bool moments = false;
  };
  header_state read_header(int copy, commit_record& out);
  /// Stops the I/O threads, closes the state file (removing an unpublished one) and
  /// releases the lock: the destructor, and a constructor that fails part-way.  In a
  /// forked child it touches nothing (Note [One owner per state file]).
  void shut_down() noexcept;
  /// Throws invalid_state in a forked child (no I/O threads there: its I/O would wait
  /// forever, its commits would write the parent's file).
  void refuse_in_child(const std::string& what) const;
  void open_existing();
  void create_new();
  /// Takes the state file's lock or throws invalid_state naming the holder.
  void lock_owner();
  /// Closes the lock fd (unless a fork closed it: Note [One owner per state file]).
  void release_lock() noexcept;
  /// Checksums (write) or verifies (read) the blocks of one request.
  void checksum_blocks(const request& r);
  std::uint64_t table_offset(int slot) const;
  /// Where header copy `copy`'s per-shard step counts are (format 3).
  std::uint64_t steps_offset(int copy) const { return table_offset(2) + static_cast<std::uint64_t>(copy) * steps_bytes_; }

  std::vector<std::size_t> numel_;  // per shard
  std::vector<std::vector<place>> places_;  // per shard, per array (main, exp_avg, exp_avg_sq)
  std::vector<std::pair<std::uint64_t, std::uint64_t>> packed_spans_;  // [begin, end) of each packed array, by begin
  std::uint64_t packed_bytes_ = 0;  // the packed area at the start of each slot, whole blocks
  bool packed_layout_ = true;       // false: a file of format 2 to 4 (every array on blocks of its own)
  unsigned char* image_[2] = {nullptr, nullptr};  // each slot's packed area, as in the file
  host_memory host_;
  void free_images() noexcept;
  std::string tmp_path_;
  std::string dir_;
  bool published_ = true;
  std::uint64_t blocks_per_slot_ = 0;
  std::uint64_t table_bytes_ = 0;
  std::uint64_t steps_bytes_ = 0;  // one copy's step counts, whole pages
  bool extended_ = true;           // the file has room for the step counts (false: a format-2 file)
  int lock_fd_ = -1;
  std::vector<std::uint64_t> shard_steps_;
  std::vector<std::uint64_t> table_[2];  // per block of each slot: checksum64 of its bytes

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  bool resumed_ = false;
  std::uint64_t step_ = 0;
  std::uint64_t seq_ = 0;
  int slot_ = 0;
  bool moments_written_ = false;
  std::uint64_t layout_hash_ = 0;
  moment_format format_ = moment_format::fp32;
  std::uint64_t slot_bytes_ = 0;
  std::size_t request_bytes_;

  // The I/O threads and their queue, on the heap: a forked child leaks them rather than
  // destroy a condition variable its parent's threads wait on (Note [One owner per
  // state file]).
  struct io_pool {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<request> queue;
    bool stop = false;
    std::vector<std::thread> threads;
  };
  std::unique_ptr<io_pool> io_ = std::make_unique<io_pool>();
  pid_t owner_pid_;  // the constructing process: only it stops, closes, removes or unlocks

  std::mutex fault_mu_;
  fault_kind fault_[3] = {fault_kind::none, fault_kind::none, fault_kind::none};
  std::uint64_t countdown_[3] = {0, 0, 0};
};

/// The checksum of the library's files (durable_files.hpp; exported from libdeferalloc).
using deferalloc::detail::checksum64;

}  // namespace deferalloc::optim::detail
