// The streamed AdamW optimizer: FP32 main parameters and Adam moments of each
// parameter shard live in deferred reservations (stable device addresses, zero HBM)
// and are backed only while the initializer or the step touches them, window by
// window, with their contents streamed from their home tier.  See
// Note [Window pipeline] in optimizer/window_pipeline.cpp.
#pragma once
#include <deferalloc/core/driver.hpp>
#include <deferalloc/core/export.hpp>
#include <deferalloc/optim/optimizer_types.hpp>

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

DFA_API const char* to_string(value_type t) noexcept;

/// AdamW hyper-parameters (PyTorch's AdamW: decoupled weight decay, bias correction),
/// in double as PyTorch passes them to its fused kernel.
struct adamw_params {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};
/// PyTorch's checks: finite lr >= 0, 0 <= betas < 1, finite eps >= 0, finite weight
/// decay >= 0.  @throws invalid_argument naming the hyper-parameter and its value.
DFA_API void validate(const adamw_params& p);

/// powf(base, e) as the optimizer's kernels on driver `d` take it for the bias corrections
/// 1 - beta^t: the device's powf on CUDA (as torch's fused AdamW; it is not glibc's:
/// powf(0.95f, 6) differs in the last bit), the host's on the host driver.  For tests and
/// references that must reproduce a step bit for bit.
DFA_API float backend_pow(driver& d, float base, float e);

DFA_API const char* to_string(moment_format f) noexcept;
/// "fp32" | "bf16" | "int8".  @throws invalid_argument
DFA_API moment_format parse_moment_format(const std::string& s);

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
  /// Pieces in flight (fetch i+1, step i and write-back i-1 overlap from 3 on; deeper
  /// lets the fetches run ahead over shards of mixed sizes).  0: 8 on the host tier, 3 on
  /// the file tier, or as many as the window holds if fewer (Note [Window slots]).
  int depth = 0;
  adamw_params adamw;
  /// Storage of the moments at home (host and file tiers; the device tier takes fp32 only;
  /// a state file keeps the format it was created with: Note [File tier moments]).
  moment_format moments = moment_format::fp32;
  /// Host tier: HBM for shards kept resident (FP32 state in HBM, stepped in place like
  /// the device tier, never streamed), taken in registration order at initialize() while
  /// their three FP32 arrays, each rounded up to the granule, fit; the rest stream.  See
  /// Note [Resident shards].
  std::size_t resident_bytes = 0;
  /// Streamed tiers: keep the window's slots backed between passes instead of returning
  /// their chunks (the window's HBM stays taken between steps, and back-to-back passes, as
  /// the buckets of a step overlapped with backward, map nothing).  Note [Window slots].
  bool keep_window = false;
  /// Streamed tiers: cut each pass's first and last pieces smaller (a quarter of the
  /// pass's piece, then a half), so that the pass fills and drains its pipeline sooner.
  /// Note [Pass pieces].
  bool pass_taper = false;
  /// Host tier, with keep_window: a step's pass returns once its last pieces are enqueued,
  /// and the next pass waits for their write-backs on the device, not the host, so that
  /// back-to-back passes (the buckets of a step across the next forward) neither drain the
  /// link between them nor leave it idle while the caller prepares the next.  Every other
  /// call waits for them first.  Off by default until it is timed on a GPU.  Note [Chained passes].
  bool pass_chain = false;
  /// Streamed tiers: at most this many bytes of write-backs (plus one piece's; two pieces'
  /// whatever the bound) are issued
  /// and not yet waited for, so that a D2H copy of the caller's (an .item() while a step
  /// runs) queues behind little on the copy engine; the stepped pieces wait in their slots
  /// meanwhile.  0: no bound (each piece's write-back is issued after its kernels).  Off by
  /// default until it is timed on a GPU.  Note [The write-back queue].
  std::size_t writeback_queue_bytes = 0;
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
  double map_seconds = 0;    ///< host time in materialize (map + access) of the pieces
  double retire_seconds = 0; ///< host time retiring pieces (waiting for write-backs, unmap)
  double io_wait_seconds = 0;  ///< file tier: host time waiting for reads and writes
  double gparams_per_second() const { return seconds > 0 ? params / seconds / 1e9 : 0; }
};

/// One shard's registration.
struct shard_info {
  std::string name;
  std::size_t numel = 0;
  std::uint16_t* param_bf16 = nullptr;  ///< the model's parameters when they are BF16, else null
  void* param = nullptr;                ///< the model's parameters (device), of type param_type
  value_type param_type = value_type::bf16;
  int group = 0;                        ///< its hyper-parameter group (set_group)
  float* main_param = nullptr;          ///< stable device addresses of the FP32 state (an FP32 parameter's main: the parameter)
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  bool resident = false;                ///< kept in HBM (optimizer_config::resident_bytes)
};

class streamed_adamw;
namespace detail {
/// Test hook vocabulary (inject_file_fault): which file-tier request fails, and how.
enum class file_fault_op { read, write, commit };
enum class file_fault_kind {
  none,
  eio,         ///< the request fails with EIO
  enospc,      ///< the request fails with ENOSPC
  short_read,  ///< a read returns fewer bytes
  crash,       ///< the process exits at once, as if killed
};
void inject_file_fault(streamed_adamw& o, file_fault_op op, file_fault_kind kind, std::uint64_t nth);
void write_checkpoint_files(streamed_adamw& o, const std::string& dir);
void read_checkpoint_files(streamed_adamw& o, const std::string& dir);
void wait_checkpoint_prune(streamed_adamw& o);
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
  /// The same for parameters of type `t` (BF16, FP16 or FP32) in hyper-parameter group
  /// `group` (>= 0).  An FP32 parameter is its own main (Note [The parameter is the truth]
  /// in optimizer/streamed_adamw.cpp): a step reads it and writes the update into it, so
  /// an edit between steps (w.zero_(), load_state_dict, an EMA swap) is what the next step
  /// reads; the home keeps only its moments (host tier: 8 B/param each way per step), the
  /// file tier also a durable copy (written by each step, read by a resume).  A BF16 or
  /// FP16 parameter edited outside the optimizer is taken into its main by its next step
  /// where it differs from main's rounding, with a warning (Note [Edits of 16-bit
  /// parameters] in optimizer/streamed_adamw.cpp).
  std::size_t add_shard(void* param, std::size_t numel, value_type t, int group, std::string name = {});

  /// The hyper-parameters of group `g` (before or between steps).  Shards of a group
  /// that was never set use config().adamw.  @throws invalid_argument (validate).
  void set_group(int g, const adamw_params& p);
  adamw_params group(int g) const;

  /// Direct-final initialization: main = float(param_bf16), written straight to the
  /// home tier window by window; the moments are zero by construction and never
  /// copied.  An FP32 parameter is its own main: nothing is copied (the file tier writes
  /// its durable copy).  Waits for `stream` first.  Synchronous.  File tier: commits step 0.
  void initialize(stream_t stream = nullptr);

  /// One AdamW step over every shard.  `grads[i]` is shard i's gradient (device memory,
  /// `numel` elements of `gt`), read after the work already on `stream`; each gradient
  /// is multiplied by `grad_scale` (loss-scale inverse times clip coefficient).  Writes
  /// the updated BF16 parameters; `stream` waits for them.  Streamed tiers: returns when
  /// the state is back home (file tier: committed).  A failure throws naming the shard,
  /// file and offset; the file tier keeps the previous step intact; the host and device
  /// tiers update in place, and a step retried with the same gradients completes the
  /// pieces the failed one did not (bit-identical to an uninterrupted step).
  /// A null `grads[i]` skips shard i: its state, parameter and step count stay as they
  /// are (PyTorch's AdamW skips a parameter whose .grad is None).  Each shard's bias
  /// correction uses its own step count (shard_step).
  void step(std::span<const void* const> grads, grad_type gt, float grad_scale = 1.0f, stream_t stream = nullptr);
  /// The same with one gradient type per shard (`gts.size() == shards().size()`).
  void step(std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale = 1.0f,
            stream_t stream = nullptr);

  /// A speculative step (host and file tiers; Note [Speculative steps] in
  /// optimizer/speculation.cpp): steps the shards with a gradient as step() does
  /// (same arithmetic, same BF16 parameters written), but writes their new state into a
  /// second pinned copy (file tier: the state file's inactive slot; commit carries the
  /// shards not stepped into it and writes one commit record; a plain step() is refused
  /// while one is pending) and leaves their state and step counts as they were until
  /// commit_speculation() makes the new copy current, or discard_speculation() drops it.
  /// Keeping the previous state costs no copy; the second copy (2x the shard's pinned
  /// host memory) is allocated at a shard's first speculative step and kept.  Several
  /// speculative steps over disjoint shards may be pending at once.  Discard does not
  /// restore BF16/FP16 model parameters: step the shards again (the redo of a clipped
  /// step) or call sync_model_params().  FP32 parameters (their own main) are restored by
  /// discard, and by a failed speculative step, from the values the speculative step kept
  /// (4 B/param of host memory per shard, and 4 B/param more D2H per speculative step);
  /// while pending, reads of their main return those kept values.  A failed speculative
  /// step leaves the state unchanged (its shards are not pending; their BF16/FP16
  /// parameters may be partly written: step again).
  /// @throws invalid_state: the device tier, a shard with a gradient that is resident
  /// (can_speculate) or already pending, a failed step() awaiting its retry.
  void step_speculative(std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale = 1.0f,
                        stream_t stream = nullptr);
  /// Makes the pending speculative state current and advances those shards' step counts
  /// (and steps() by one).  Nothing pending: does nothing.  Host memcpy-free (swaps copies).
  void commit_speculation();
  /// Drops the pending speculative state: state and step counts stay the last committed.
  void discard_speculation();
  /// Shards stepped speculatively and neither committed nor discarded.
  std::size_t speculation_pending() const;
  /// Shard `s` can be stepped speculatively: a streamed shard of the host or file tier
  /// (after initialize(), which picks the resident shards; resident and device-tier
  /// shards cannot: step them with step() and keep their state yourself).
  bool can_speculate(std::size_t s) const;

  /// Writes BF16(main) into every shard's model parameters (after a resume or a
  /// checkpoint load: the model then matches the optimizer's state).  `stream` waits.
  /// FP32 parameters are their own main: unchanged, except on the file tier, which writes
  /// its durable copy (the last committed step's values) into them.
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

  /// Copies a shard's state to host memory (any tier).  Null outputs are skipped.  Main
  /// of an FP32 parameter is the parameter's current values (read and write_state_range too).
  void read_state(std::size_t shard, float* main, float* exp_avg, float* exp_avg_sq);
  /// Copies elements [offset, offset + n) of one state array of a shard to host memory
  /// `out`.  Synchronous; cost: a memcpy (host tier), a D2H copy (device tier), aligned
  /// reads (file tier: offset must be 0).  @throws invalid_argument for a bad range.
  void read_state_range(std::size_t shard, state_array a, std::size_t offset, std::size_t n, float* out);
  /// Writes host memory into elements [offset, offset + n) of one state array.  The file
  /// tier takes whole arrays only (offset 0, n = numel), written to its inactive slot and
  /// published by one commit (a kill leaves the old state or the new): between
  /// begin_state_write and end_state_write, by end_state_write; else with the writes that
  /// follow, by the next call that uses the state (a step, a read, a checkpoint save or
  /// load, sync_model_params, begin_state_write, the destructor); a kill before that
  /// resumes the old state (Note [State writes] in optimizer/file_home.cpp).  Does not touch
  /// BF16/FP16 model parameters (sync_model_params does); main of an FP32 parameter is
  /// written into the parameter at once (file tier: and into the durable copy published
  /// with the write; a write dropped leaves the parameter written).  @throws invalid_argument for a bad range, invalid_state
  /// while a speculative step is pending (commit or discard it first).
  void write_state_range(std::size_t shard, state_array a, std::size_t offset, std::size_t n, const float* in);
  /// Steps taken by shard `s` (PyTorch's per-parameter `step`; the committed count while
  /// a speculative step is pending), and setting it (state loading; invalid_state while
  /// a speculative step is pending, and before the state exists: initialize() first, or
  /// a file tier that resumed, whose file set_shard_step opens before it sets the count).
  /// The file tier commits the counts with its state (set_shard_step is published as
  /// write_state_range is); checkpoints keep them too.
  std::uint64_t shard_step(std::size_t s) const;
  void set_shard_step(std::size_t s, std::uint64_t step);
  /// Groups write_state_range and set_shard_step calls into one publish (loading a state
  /// dict): the file tier writes them to its inactive slot and end_state_write(true)
  /// commits them once, the arrays not written copied from the current state;
  /// end_state_write(false) drops them (file tier: state and step counts stay the last
  /// committed; the in-place host and device tiers keep what was written).  While a
  /// write is open, steps, reads, checkpoints and sync_model_params are refused
  /// (invalid_state); destroying the optimizer drops it.  end_state_write without an
  /// open write does nothing.
  /// @throws invalid_state (no state yet, a write already open, a pending speculative step)
  void begin_state_write();
  void end_state_write(bool publish = true);
  /// Points shard `s` at new parameter memory of the same size and type (the model's
  /// storage was replaced, as `p.data = p.data.clone()` does); the state is unchanged.
  /// @throws invalid_argument (null), invalid_state (a pending speculative step)
  void set_shard_param(std::size_t s, void* param);
  /// Saves the whole state as a new generation `dir`/gen-<N>: one data file per shard and
  /// manifest.txt (version, dtypes, shapes, step, hyper-parameters, checksums), all
  /// fsynced, published by one rename; older generations are then removed on a thread
  /// of their own (the next save, or the destructor, waits for that).  A killed or failed
  /// save leaves the previous generation loadable.  Streamed in bounded chunks (192 MiB
  /// of buffers), several writes in flight.  See Note [Checkpoint generations].
  /// While a speculative step is pending it saves the committed state (the current copy).
  /// @throws io_error (the directory is a symlink or another user's, a write fails)
  void save_checkpoint(const std::string& dir);
  /// Loads the newest complete generation in `dir` into the registered shards and writes
  /// BF16(main) into their model params (done when it returns; an FP32 parameter takes
  /// the saved main itself).  Reads each file once (twice on the host and device tiers
  /// when they already hold state or have FP32 parameters: verify, then copy).
  /// @throws io_error (no checkpoint), corrupt_data on a checksum failure or a mismatched
  /// layout (the message says which file, array and why); the optimizer's state is
  /// unchanged then; invalid_state while a speculative step is pending.
  void load_checkpoint(const std::string& dir);

  reservation_manager& reservations();

 private:
  friend void detail::inject_file_fault(streamed_adamw&, detail::file_fault_op, detail::file_fault_kind, std::uint64_t);
  friend void detail::write_checkpoint_files(streamed_adamw&, const std::string&);
  friend void detail::read_checkpoint_files(streamed_adamw&, const std::string&);
  friend void detail::wait_checkpoint_prune(streamed_adamw&);
  struct impl;
  std::unique_ptr<impl> impl_;
};

namespace detail {
/// Test hook: the `nth` next file-tier I/O request of `op` fails with `kind`.
/// @throws invalid_state when the optimizer has no file tier.
DFA_API void inject_file_fault(streamed_adamw& o, file_fault_op op, file_fault_kind kind, std::uint64_t nth);
/// One generation's files (shard-N.bin, manifest.txt) written into the existing `dir`
/// and made durable, or read from it (for the distributed optimizer, which publishes
/// all ranks' files in one generation).  See Note [Checkpoint generations].
DFA_API void write_checkpoint_files(streamed_adamw& o, const std::string& dir);
DFA_API void read_checkpoint_files(streamed_adamw& o, const std::string& dir);
/// Test hook: returns once the older generations a save_checkpoint left to remove in the
/// background are removed.
DFA_API void wait_checkpoint_prune(streamed_adamw& o);
}  // namespace detail

}  // namespace deferalloc::optim
