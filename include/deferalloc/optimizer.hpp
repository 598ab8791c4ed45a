// The streamed AdamW optimizer: FP32 main parameters and Adam moments of each
// parameter shard live in deferred reservations (stable device addresses, zero HBM)
// and are backed only while the initializer or the step touches them, window by
// window, with their contents streamed from their home tier.  See
// Note [Window pipeline] in optimizer/streamed_adamw.cpp.
#pragma once
#include <deferalloc/driver.hpp>
#include <deferalloc/export.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace deferalloc {
class chunk_pool;
class reservation_manager;
}  // namespace deferalloc

namespace deferalloc::optim {

/// Where the FP32 state lives between steps.
enum class tier {
  device,  ///< resident in HBM (for comparison, or when memory is plentiful)
  host,    ///< pinned host memory, streamed over PCIe
  file,    ///< one file per rank, aligned direct I/O, two slots + a commit record
};
DFA_API const char* to_string(tier t) noexcept;
/// "device" | "host" | "file".  @throws invalid_argument
DFA_API tier parse_tier(const std::string& s);

enum class grad_type { bf16, fp32 };

/// AdamW hyper-parameters (PyTorch's AdamW: decoupled weight decay, bias correction).
struct adamw_params {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

/// Reported during initialize() and step().
struct progress {
  const char* phase;        ///< "init" or "step"
  std::size_t done_params;
  std::size_t total_params;
  double seconds;
};

struct optimizer_config {
  tier home = tier::host;
  /// File tier: the directory that holds this rank's state file (created 0700 if absent).
  std::string directory;
  int rank = 0;
  /// File tier: reopen an existing state file and continue from its last committed step
  /// (after a crash).  When false an existing file is replaced.
  bool resume = false;
  /// HBM budget for streamed state (host and file tiers): the physical memory mapped
  /// behind the reservations never exceeds it.
  std::size_t window_bytes = std::size_t{512} << 20;
  /// Pieces in flight (fetch i+1, step i and write-back i-1 overlap from 3 on).
  int depth = 3;
  adamw_params adamw;
  /// Called after each piece of initialize() and step() (from the calling thread).
  std::function<void(const progress&)> on_progress;
  /// Prints a progress line on stderr during initialize() when it takes over a second.
  bool progress_line = false;
  /// File tier: I/O threads and the size of one request.
  int io_threads = 8;
  std::size_t io_request_bytes = std::size_t{8} << 20;
};

/// What the last initialize() or step() did.
struct step_report {
  double seconds = 0;
  std::size_t params = 0;
  std::size_t pieces = 0;
  std::size_t bytes_to_device = 0;
  std::size_t bytes_from_device = 0;
  std::size_t peak_backed_bytes = 0;  ///< physical memory behind the state, at most
  double gparams_per_second() const { return seconds > 0 ? params / seconds / 1e9 : 0; }
};

/// One shard's registration.
struct shard_info {
  std::string name;
  std::size_t numel = 0;
  std::uint16_t* param_bf16 = nullptr;  ///< the model's BF16 parameters (device)
  float* main_param = nullptr;          ///< stable device addresses of the FP32 state
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
};

class streamed_adamw;
namespace detail {
void inject_file_fault(streamed_adamw& o, int op, int kind, std::uint64_t nth);
void write_checkpoint_files(streamed_adamw& o, const std::string& dir);
void read_checkpoint_files(streamed_adamw& o, const std::string& dir);
}

class DFA_API streamed_adamw {
 public:
  /// Builds its own chunk pool (budget = window_bytes for streamed tiers) and
  /// reservation manager on `drv`.  The CUDA driver runs the CUDA kernels; the host
  /// driver runs the CPU twin of the same arithmetic.
  /// @throws invalid_argument for a bad config (file tier without directory, depth < 1, ...)
  streamed_adamw(std::shared_ptr<driver> drv, optimizer_config cfg);
  ~streamed_adamw();
  streamed_adamw(const streamed_adamw&) = delete;
  streamed_adamw& operator=(const streamed_adamw&) = delete;

  /// Registers a shard of `numel` BF16 parameters at `param_bf16` (device memory of the
  /// driver's device).  Creates three reservations (main, exp_avg, exp_avg_sq): stable
  /// addresses, no physical memory on the host and file tiers.  Must come before
  /// initialize().  Cost: three cuMemAddressReserve; device tier: 12 B/param of HBM.
  std::size_t add_shard(std::uint16_t* param_bf16, std::size_t numel, std::string name = {});

  /// Direct-final initialization: main = float(param_bf16), written straight to the
  /// home tier window by window; the moments are zero by construction and never
  /// copied.  Waits for `stream` first.  Synchronous.  File tier: commits step 0.
  void initialize(stream_t stream = nullptr);

  /// One AdamW step over every shard.  `grads[i]` is shard i's gradient (device memory,
  /// `numel` elements of `gt`), read after the work already on `stream`; each gradient
  /// is multiplied by `grad_scale` (loss-scale inverse times clip coefficient).  Writes
  /// the updated BF16 parameters; `stream` waits for them.  Streamed tiers: returns when
  /// the state is back home (file tier: committed).  A failure throws naming the shard,
  /// file and offset; the file tier keeps the previous step intact; the host and device
  /// tiers update in place, and a step retried with the same gradients completes the
  /// pieces the failed one did not (bit-identical to an uninterrupted step).
  void step(std::span<const void* const> grads, grad_type gt, float grad_scale = 1.0f, stream_t stream = nullptr);

  /// Writes BF16(main) into every shard's model parameters (after a resume or a
  /// checkpoint load: the model then matches the optimizer's state).  `stream` waits.
  void sync_model_params(stream_t stream = nullptr);

  /// Sum of squares of the gradients (for clipping), in double.  Synchronous.
  double grad_sq_norm(std::span<const void* const> grads, grad_type gt, stream_t stream = nullptr);

  /// Completed steps.
  std::uint64_t steps() const;
  bool initialized() const;
  /// File tier with resume: true when the state came from an existing file.  Opens the
  /// state file when shards are registered and it is not open yet (so that
  /// `if (opt.resumed()) opt.sync_model_params(); else opt.initialize();` works).
  /// @throws corrupt_data, io_error: a state file that exists but cannot be resumed
  bool resumed() const;
  const std::vector<shard_info>& shards() const;
  const optimizer_config& config() const;
  void set_hyper(const adamw_params& p);
  std::size_t piece_elements() const;
  step_report last_report() const;

  /// Copies a shard's state to host memory (any tier).  Null outputs are skipped.
  void read_state(std::size_t shard, float* main, float* exp_avg, float* exp_avg_sq);
  /// Saves the whole state as a new generation `dir`/gen-<N>: one data file per shard and
  /// manifest.txt (version, dtypes, shapes, step, hyper-parameters, checksums), all
  /// fsynced, published by one rename; older generations are pruned after.  A killed or
  /// failed save leaves the previous generation loadable.  Streamed in bounded chunks
  /// (<= 128 MiB of buffers), several writes in flight.  See Note [Checkpoint generations].
  /// @throws io_error (the directory is a symlink or another user's, a write fails)
  void save_checkpoint(const std::string& dir);
  /// Loads the newest complete generation in `dir` into the registered shards and writes
  /// BF16(main) into their model params (done when it returns).  Reads each file once
  /// (twice on the host and device tiers when they already hold state: verify, then copy).
  /// @throws io_error (no checkpoint), corrupt_data on a checksum failure or a mismatched
  /// layout (the message says which file, array and why); the optimizer's state is
  /// unchanged then.
  void load_checkpoint(const std::string& dir);

  reservation_manager& reservations();

 private:
  friend void detail::inject_file_fault(streamed_adamw&, int, int, std::uint64_t);
  friend void detail::write_checkpoint_files(streamed_adamw&, const std::string&);
  friend void detail::read_checkpoint_files(streamed_adamw&, const std::string&);
  struct impl;
  std::unique_ptr<impl> impl_;
};

namespace detail {
/// Test hook: the `nth` next file-tier I/O request of `op` (0 read, 1 write, 2 commit)
/// fails with `kind` (1 EIO, 2 ENOSPC, 3 short read, 4 the process exits at once, as if
/// killed).  @throws invalid_state when the optimizer has no file tier.
DFA_API void inject_file_fault(streamed_adamw& o, int op, int kind, std::uint64_t nth);
/// One generation's files (shard-N.bin, manifest.txt) written into the existing `dir`
/// and made durable, or read from it (for the distributed optimizer, which publishes
/// all ranks' files in one generation).  See Note [Checkpoint generations].
DFA_API void write_checkpoint_files(streamed_adamw& o, const std::string& dir);
DFA_API void read_checkpoint_files(streamed_adamw& o, const std::string& dir);
}  // namespace detail

}  // namespace deferalloc::optim
