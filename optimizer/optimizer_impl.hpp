// The optimizer's private state, shared by streamed_adamw.cpp (the API), home.cpp (the
// tiers), window_pipeline.cpp (a pass), resident.cpp and checkpoint.cpp.
#pragma once
#include <deferalloc/chunk_pool.hpp>
#include <deferalloc/optimizer.hpp>
#include <deferalloc/reservations.hpp>

#include <array>
#include <chrono>
#include <map>
#include <mutex>
#include <span>

#include "kernels/compute.hpp"
#include "store/file_store.hpp"
#include "store/file_util.hpp"

namespace deferalloc::optim {

/// The three state arrays in storage order (main, exp_avg, exp_avg_sq): reservations,
/// pinned homes, file slots and checkpoint files all keep them in this order.
inline constexpr std::array<state_array, 3> k_state_arrays{state_array::main, state_array::exp_avg,
                                                           state_array::exp_avg_sq};
/// The first `n` of them: main alone (init and export passes) or all three (a step).
inline std::span<const state_array> first_arrays(int n) { return std::span(k_state_arrays).first(n); }
inline bool is_moment(state_array a) { return a != state_array::main; }
/// Its position in that order (offsets in files and buffers).
constexpr std::size_t array_index(state_array a) { return static_cast<std::size_t>(a); }
inline const char* array_name(state_array a) {
  return a == state_array::main ? "main" : a == state_array::exp_avg ? "exp_avg" : "exp_avg_sq";
}
/// One T per state array, indexed by it (and only by it).
template <typename T>
struct per_array : std::array<T, 3> {
  T& operator[](state_array a) { return std::array<T, 3>::operator[](array_index(a)); }
  const T& operator[](state_array a) const { return std::array<T, 3>::operator[](array_index(a)); }
};

struct streamed_adamw::impl {
  enum class pass { init, step, export_bf16 };
  struct shard {
    shard_info info;
    per_array<reservation_id> res{};
    std::uint64_t step = 0;  // PyTorch's per-parameter step
    bool resident = false;   // Note [Resident shards]
    bool speculative = false;  // stepped speculatively, not committed (Note [Speculative steps])
    /// The device address of array `a` (its reservation).
    float* device(state_array a) const {
      return a == state_array::main ? info.main_param : a == state_array::exp_avg ? info.exp_avg : info.exp_avg_sq;
    }
  };
  struct piece_ref {
    std::size_t shard, e0, n;
  };
  /// What one pass does (Note [Window pipeline]).
  struct pass_plan {
    pass kind;
    std::vector<piece_ref> pieces;
    std::size_t skip = 0;     // pieces a failed try of this step already wrote back
    int arrays = 1;           // arrays mapped and written back: all three (step) or main
    bool fetch_main = false;  // all but init
    bool write_back = false;  // all but export
    bool speculative = false; // a step writing into the shards' second copy (Note [Speculative steps])
  };
  class home;  // Note [Homes] (below)
  class device_home;  // its tiers (home.cpp)
  class host_home;
  class file_home;
  class window_pipeline;  // Note [Window pipeline] (window_pipeline.cpp)

  std::mutex mu;
  std::shared_ptr<driver> drv;
  optimizer_config cfg;
  std::shared_ptr<chunk_pool> pool;
  std::unique_ptr<reservation_manager> mgr;
  std::unique_ptr<detail::compute> comp;
  std::unique_ptr<detail::file_store> file;  // the file tier's state file (opened by its home)
  std::unique_ptr<home> tier_home;           // where cfg.home keeps the shards' state
  std::unique_ptr<home> hbm_home;            // the resident shards' (Note [Resident shards])
  std::vector<shard> shards;
  std::vector<shard_info> infos;
  detail::background_prune pruner;  // older checkpoint generations (Note [Checkpoint generations])
  std::map<int, adamw_params> groups;  // set_group; others use cfg.adamw
  std::size_t piece = 0;  // elements per piece (streamed tiers)
  std::size_t piece_align = 1;  // a piece's alignment in elements: the granule or the home's (streamed tiers)
  /// The window: depth slots of one piece per array (streamed tiers), reserved once;
  /// backed while a pass runs (and between passes with keep_window).  Note [Window slots].
  struct slot {
    per_array<reservation_id> res{};
    per_array<float*> dev{};          // their addresses
    per_array<std::size_t> backed{};  // bytes backed from the start (granules)
  };
  std::vector<slot> slots;
  stream_t h2d = nullptr, d2h = nullptr, exec = nullptr;
  std::vector<event_t> events;
  std::uint64_t step_count = 0;
  bool initialized = false;
  bool moments_written = false;
  std::uint64_t failed_step = 0;       // the step number that failed part-way (in place tiers), 0 = none
  std::size_t failed_pieces_done = 0;  // its pieces (device tier: shards) already written back
  step_report report;
  bool resident_stepped = false;  // this step's resident shards are enqueued (a retry skips them)
  std::size_t speculating = 0;    // shards with shard::speculative set
  bool writing = false;           // a state write is open (Note [State writes] in home.cpp)
  bool implicit_write = false;    // opened by write_state_range itself, published by the next use
  bool moments_before_write = false;  // moments_written at begin_state_write (restored by an abort)
  std::vector<std::uint64_t> steps_before_write;  // the shards' step counts then

  /// Every shard's step count, in shard order.
  std::vector<std::uint64_t> shard_steps() const;
  /// Opens a state write (implicit: by write_state_range, published by settle_writes).
  void open_write(bool implicit);
  /// Ends the open state write: published, or dropped (the file tier's counts restored).
  void close_write(bool publish);
  /// Before a call that reads, steps or saves the state: publishes an implicit write,
  /// refuses (invalid_state) while an explicit one is open.
  void settle_writes(const char* fn);

  /// The checks step() and step_speculative() share.
  void check_step(const char* fn, std::span<const void* const> grads, std::span<const value_type> gts,
                  float grad_scale) const;
  /// Refuses (invalid_state) a write of the state while a speculative step is pending.
  void refuse_if_speculating(const char* fn) const;

  /// The homes of cfg.home (and of resident shards); checks that the configuration fits
  /// the tier.  Defined in home.cpp, the one place that names the tiers.
  void make_homes();
  /// Opens the state the home keeps outside this process (file tier: the state file,
  /// resumed when it holds a commit); nothing for the others.
  void open_state();
  event_t event(std::size_t i);
  /// Work enqueued on `waiter` from now on runs after all that is enqueued on `producer` so
  /// far (one record of event 0 + one wait; no host synchronisation).
  void after(stream_t waiter, stream_t producer);
  /// Every piece; with `grads` (a step), only those of shards with a gradient, unless
  /// the step writes a new copy of the state (file tier), which must carry the others
  /// (a speculative step does not: commit_speculation carries them).
  std::vector<piece_ref> pieces(std::span<const void* const> grads = {}, bool speculative = false) const;
  /// Shard s's scalars for its next step.
  detail::adamw_scalars scalars(std::size_t s, float grad_scale) const;
  std::string where(const piece_ref& p) const;
  void report_progress(const char* phase, std::size_t done, std::size_t total,
                       std::chrono::steady_clock::time_point t0, std::chrono::steady_clock::time_point& last_line);
  /// One pass of the window pipeline over every piece (window_pipeline.cpp).
  void run_pass(pass kind, std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale,
                stream_t user, std::size_t skip, bool speculative = false);
  /// Shard `s`'s home.
  home& home_of(std::size_t s) const { return shards[s].resident ? *hbm_home : *tier_home; }
  /// A moment of a streamed home before the first step: zeros by construction, never
  /// stored (the pass zeroes it on the device; reads return zeros).
  bool never_written(std::size_t s, state_array a) const;
  /// Copies shard `s`'s array `a` (elements [e0, e0+n)) from its home to host memory `out`.
  void read_home(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out);
  /// Note [Resident shards] (resident.cpp): picks and backs them at initialize(); the
  /// device-tier operations over resident shards (on exec; `all` also takes the shards
  /// of a device-tier optimizer).
  void place_resident();
  void init_device_shards(bool all);
  void step_device_shards(std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale,
                          std::size_t first, bool all);
  void sync_device_shards(bool all);
  /// BF16(main) into the model parameters; `stream` waits for it.
  void sync_model(stream_t stream);
  /// Bytes of one array of a shard kept in HBM (device tier, resident shards): its
  /// elements rounded up to the granule.
  std::size_t resident_bytes(const shard& s) const { return granules(s.info.numel * 4); }
  /// `bytes` rounded up to the granule.
  std::size_t granules(std::size_t bytes) const {
    const std::size_t g = drv->granularity();
    return (bytes + g - 1) / g * g;
  }
};

// Note [Homes]
//
// Rationale: the three tiers differ in where a shard's state lives between passes, and in
// nothing else: the pipeline, the kernels, state ranges and checkpoints are the same.
// Approach: one home per tier (device_home, host_home, file_home in home.cpp, chosen by
// make_homes() from cfg.home; resident shards of a host-tier optimizer have a device
// home of their own).  A home backs a shard's state, moves a piece of it between its
// storage and the piece's window on the pipeline's streams (with the tier's own waits:
// the file tier's reads ahead and its ring of staging buffers), commits a pass, and
// reads / writes ranges of it for state_dict and checkpoints.  The pipeline and the
// checkpoint code call these and never ask which tier they hold; a new tier (or a
// compressed format) is one new class.
class streamed_adamw::impl::home {
 public:
  explicit home(impl& owner) : I(owner) {}
  virtual ~home() = default;
  home(const home&) = delete;
  home& operator=(const home&) = delete;

  // -- what the tier is
  /// The state streams through the window (host, file); false: it stays in HBM (device).
  virtual bool streamed() const { return true; }
  /// A step updates the state in place (host, device): a step that failed part-way is
  /// retried from where it stopped, a checkpoint load into live state verifies first.
  /// false: a step writes a new copy, published by a commit (file).
  virtual bool in_place() const { return true; }
  /// Pieces start on multiples of these bytes (file: its checksum blocks).
  virtual std::size_t piece_align() const { return 1; }
  /// Pieces in flight when the configuration leaves depth at 0 (Note [Window slots]).
  virtual int default_depth() const { return 8; }
  /// State ranges are whole arrays only (file).
  virtual bool whole_arrays() const { return false; }

  // -- shards
  /// Opens the state kept outside the process (open_state()); idempotent.
  virtual void open() {}
  /// Backs the state of a new shard (its reservations are made; shards[] does not hold
  /// it yet) or of a shard moving here (place_resident).  All or nothing.
  virtual void add_shard(shard& s) = 0;
  /// Frees what add_shard took for shard `s` (a resident shard leaving the host tier).
  virtual void drop_shard(std::size_t) noexcept {}

  // -- a pass (streamed homes; Note [Window pipeline]).  Piece i is plan.pieces[i];
  // to/from_device enqueue its array `a` on `s` and return the bytes moved.
  virtual void begin_pass(const pass_plan&) {}
  /// Starts reading piece i ahead of its fetch (file).
  virtual void prefetch(std::size_t, const piece_ref&) {}
  /// Waits until piece i's host copy can be fetched (file: its reads).
  virtual void await_fetch(std::size_t) {}
  virtual std::size_t to_device(std::size_t i, const piece_ref& p, state_array a, float* dev, stream_t s);
  /// Waits until piece i's write-back may be enqueued (file: its staging buffer drained).
  virtual void await_write_back(std::size_t) {}
  virtual std::size_t from_device(std::size_t i, const piece_ref& p, state_array a, float* dev, stream_t s);
  /// Piece i's write-back is done: persist it (file: the writes).
  virtual void retire(std::size_t, const piece_ref&) {}
  /// Every piece retired: waits for what retire() started.
  virtual void end_pass() {}
  /// After a failed pass: waits for all it started (never throws; logs).
  virtual void drain() noexcept {}
  /// Publishes a finished init or step pass with the shards' step counts after it (file:
  /// the commit record).
  virtual void commit(pass, std::span<const std::uint64_t> /*shard_steps*/) {}
  /// A checkpoint load writes into this slot, which changes nothing until commit_load
  /// (file: the inactive slot); in-place homes ignore it.
  virtual int load_slot() const { return 0; }
  virtual void commit_load(std::uint64_t /*step*/, int /*slot*/, bool /*moments_written*/,
                           std::span<const std::uint64_t> /*shard_steps*/) {}
  /// Note [State writes] (home.cpp): write_range calls between begin_write and
  /// end_write(true) are published together (file: into the inactive slot, one commit
  /// with the shards' step counts then); end_write(false) drops them (file) or keeps
  /// what was written (in-place homes).  Outside them, each write_range is published by
  /// itself.
  virtual void begin_write() {}
  virtual void end_write(bool /*publish*/) {}

  // -- state ranges and checkpoints (host memory on the other side; never-written
  // moments are the caller's: never_written())
  virtual void read(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out) = 0;
  /// read() into `buf`, which is aligned to file_store::align with room for io_bytes(n).
  virtual void read_io(std::size_t s, state_array a, std::size_t e0, std::size_t n, unsigned char* buf) {
    read(s, a, e0, n, reinterpret_cast<float*>(buf));
  }
  /// Writes a checkpoint chunk: `in` as read_io's buffer (the file tier pads it with
  /// zeros), `e0` on a chunk boundary; file tier: into `slot`.
  virtual void write(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* in, int slot) = 0;
  /// write_state_range: any range (file tier: whole arrays, committed).
  virtual void write_range(std::size_t s, state_array a, std::size_t e0, std::size_t n, const float* in) = 0;
  /// The array as plain FP32 in host memory (host tier, uncompressed), else null: the
  /// checkpoint code reads and writes it there without a copy.
  virtual float* host_array(std::size_t, state_array) const { return nullptr; }

  // -- speculative steps (Note [Speculative steps] in streamed_adamw.cpp).  Every other
  // method reads and writes the current copy.
  /// The tier can step a shard into a second copy of its state (host).
  virtual bool speculates() const { return false; }
  /// Gives shard `s` its second copy if it has none yet (all or nothing).
  virtual void prepare_speculation(std::size_t) {}
  /// Shard `s`'s second copy, written by a speculative pass, becomes its state.
  virtual void commit_speculation(std::size_t) {}

 protected:
  /// The moments' format (k_mom_*, Note [Moment formats]); compressed: not fp32.
  int format() const { return static_cast<int>(I.cfg.moments); }
  bool compressed() const { return I.cfg.moments != moment_format::fp32; }
  /// Copies `bytes` between `dev` and host memory `host` on `s` (to the device when
  /// `to_device`); returns `bytes`.
  std::size_t copy_run(char* dev, char* host, std::size_t bytes, bool to_device, stream_t s) {
    if (to_device) I.drv->copy_async(dev, host, bytes, s);
    else I.drv->copy_async(host, dev, bytes, s);
    return bytes;
  }

  impl& I;
};

}  // namespace deferalloc::optim
