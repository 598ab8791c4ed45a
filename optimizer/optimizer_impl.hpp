// The streamed_adamw facade's private state (streamed_adamw.cpp: construction, initialize
// / step / sync, state ranges; speculation.cpp; state_writes.cpp; resident.cpp;
// checkpoint.cpp), on top of the layers below.
//
// Note [Optimizer layers]
//
// Rationale: the optimizer is a pipeline over a home, stepped shard by shard; kept as one
// struct that every file reached into, each part called back into the others (a pass
// asked the API for its pieces, its scalars and its progress; a home changed the API's
// counts), so no part could be read, changed or tested alone.
// Approach: five layers, each using only those below it, each with private state:
//  1. the shard table (shard_table.hpp): the shards, their reservations, step counts
//     and flags, and the state arrays' order;
//  2. the window and the streams (window.hpp): the slots a pass moves pieces through and
//     their physical backing; the three streams and their events;
//  3. the homes (home.hpp, home.cpp, file_home.hpp/.cpp; Note [Homes]): where the state
//     lives between passes, a narrow interface and optional capabilities;
//  4. the window pipeline (window_pipeline.hpp/.cpp; Note [Window pipeline]): one pass,
//     given its plan (pieces, what to move), its step's inputs (gradients, scalars) and
//     the parts it runs on as data; its figures go into a step_report;
//  5. the facade (streamed_adamw::impl, here): the API's checks and counts (steps,
//     moments written, a failed step's progress, state writes, speculation), the
//     choice of pieces and scalars, commits, resident shards and checkpoints.
// Nothing below the facade calls it: what a lower layer learns (a resumed state file's
// counts, a failed pass's progress) is a return value or a query.  progress.hpp reports
// a long operation's progress to the user's callback and stderr.
// The facade's own state is grouped by what it holds: the window's shape (window_shape),
// a failed step's retry (step_retry), the open state write (open_state_write), the
// counts (set together by adopt(); the shards' step counts and speculation flags are the
// shard table's).
// Limits: the facade's state is one struct, private to streamed_adamw and shared by its
// files (streamed_adamw.cpp, speculation.cpp, state_writes.cpp, resident.cpp,
// checkpoint.cpp); the layers it holds and its counts are plain members that those
// files read.
#pragma once
#include <deferalloc/core/chunk_pool.hpp>
#include <deferalloc/core/reservations.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <map>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <sys/types.h>
#include <unistd.h>

#include "home.hpp"
#include "kernels/compute.hpp"
#include "shard_table.hpp"
#include "store/file_util.hpp"
#include "window.hpp"

namespace deferalloc::optim {

/// What a call that cannot run while a failed step awaits its retry says.
inline constexpr const char* k_retry_pending =
    "a failed step awaits its retry (step() with the same gradients; or write the state, or load a checkpoint)";

/// A step that failed part-way on an in-place tier (host, device), retried by a step()
/// with the same gradients: what the retry skips.  A state write or a checkpoint load
/// replaces what the failed try wrote, and ends the retry (the next step runs whole; a
/// write of only some shards leaves the others as the failed try left them, and the next
/// step steps them again).  Private so that a retry is only ever
/// asked for by the number of the step it retries.
class step_retry {
 public:
  /// Pieces (device tier: shards) that step number `next` skips: those its failed try
  /// wrote back; 0 when `next` is not the failed step.
  std::size_t skip(std::uint64_t next) const { return step_ == next ? pieces_done_ : 0; }
  /// Step number `next`'s resident shards were enqueued by its failed try.
  bool resident_stepped(std::uint64_t next) const { return step_ == next && resident_stepped_; }
  /// `changed`: some resident shard had a gradient.
  void resident_enqueued(bool changed) {
    resident_stepped_ = true;
    resident_changed_ = changed;
  }
  /// A pass (device tier: the loop over the shards) wrote back its first `pieces`.
  void progressed(std::size_t pieces) { pieces_done_ = pieces; }
  /// The failed pass stepped the piece `where` and could not write it back (empty: none):
  /// step number `next` cannot resume it (Note [The write-back queue]).
  void tore(std::string where) { torn_ = std::move(where); }
  const std::string& torn(std::uint64_t next) const { return step_ == next ? torn_ : none_; }
  /// Step number `next`, over the shards `stepped`, failed part-way: the next step() retries it.
  void failed(std::uint64_t next, std::vector<bool> stepped) {
    step_ = next;
    stepped_ = std::move(stepped);
  }
  /// Step number `next` over the shards `stepped` is not the retry of the failed step of that
  /// number (another set of shards: the next bucket of a BackwardOverlap, say), which
  /// changed some state (a failure before any piece reached home leaves nothing to redo).
  bool mismatched(std::uint64_t next, const std::vector<bool>& stepped) const {
    return step_ == next && stepped != stepped_ && (pieces_done_ > 0 || resident_changed_ || !torn_.empty());
  }
  bool pending() const { return step_ != 0; }
  /// Nothing to retry (a step done, a committed store's failed step, new state).
  void clear() { *this = step_retry{}; }

 private:
  std::uint64_t step_ = 0;         // the failed step's number, 0 = none
  std::size_t pieces_done_ = 0;    // its pieces (device tier: shards) already written back
  bool resident_stepped_ = false;  // its resident shards are enqueued
  bool resident_changed_ = false;  // and one of them had a gradient
  std::string torn_;               // a piece it stepped and did not write back
  std::vector<bool> stepped_;      // its shards with gradients
  inline static const std::string none_;
};

/// The state write open on the facade (Note [State writes] in file_home.cpp): whether one is
/// open, who opened it and the counts it changes, restored if it is dropped.
class open_state_write {
 public:
  bool open() const { return open_; }
  /// Opened by write_state_range or set_shard_step itself, published by the next use.
  bool implicit() const { return implicit_; }
  void begin(bool implicit, state_counts before) {
    open_ = true;
    implicit_ = implicit;
    before_ = std::move(before);
  }
  /// Closes it; returns the counts when it opened.
  const state_counts& end() {
    open_ = false;
    return before_;
  }

 private:
  bool open_ = false;
  bool implicit_ = false;
  state_counts before_;  // moments_written and the shards' step counts when it opened
};

/// The window's pieces (streamed tiers; Note [Window slots], Note [Pass pieces]).
struct window_shape {
  std::size_t align = 1;  // a piece's alignment in elements: the granule or the home's
  std::size_t piece = 0;  // elements per window slot: a power of two of `align`s
  /// The chunk pool's classes: the slot's bytes and their halvings down to the granule.
  std::vector<std::size_t> chunk_classes(std::size_t granule) const;
};
/// The window's shape for a tier of `traits`; a depth of 0 in `cfg` becomes the tier's (or
/// what the window holds).  Throws invalid_argument when the window holds no piece.
window_shape shape_window(optimizer_config& cfg, const home_traits& traits, std::size_t granule);

/// What a call that would change a speculated shard's state is refused for.
inline constexpr char k_pending[] = "a pending speculative step (commit_speculation or discard_speculation first)";

/// What an entry of the facade needs checked on entry (impl::entry_guard, Note [Entry guard]),
/// in the order the checks run.
struct entry_needs {
  enum : unsigned {
    opened = 1u,           // open_state(): a resumed state file's counts are read
    initialized = 2u,      // state exists (else invalid_state, "<fn>: no state yet (initialize() first)")
    settled = 4u,          // settle_writes(fn)
    not_speculating = 8u,  // refuse_if_speculating(fn)
    in_parent = 16u,       // refuse_in_child(fn)
  };
};

struct streamed_adamw::impl {
  std::mutex mu;
  std::shared_ptr<driver> drv;
  optimizer_config cfg;
  std::shared_ptr<chunk_pool> pool;
  std::unique_ptr<reservation_manager> mgr;
  std::unique_ptr<detail::compute> comp;
  std::unique_ptr<stream_set> streams;
  shard_table shards;
  std::unique_ptr<window> slots;       // the window (streamed tiers; Note [Window slots])
  std::unique_ptr<home> tier_home;     // where cfg.home keeps the shards' state
  std::unique_ptr<home> hbm_home;      // the resident shards' (Note [Resident shards])
  detail::background_prune pruner;     // older checkpoint generations (Note [Checkpoint generations])
  std::map<int, adamw_params> groups;  // set_group; others use cfg.adamw
  window_shape shape;                  // its pieces (streamed tiers)
  // The counts (with the shards' step counts in the shard table); set together by adopt().
  std::uint64_t step_count = 0;
  bool initialized = false;
  bool moments_written = false;
  step_retry retry;
  step_report report;
  open_state_write state_write;
  // Per shard: pinned host memory holding its FP32 parameter's values before a speculative
  // step (null until its first; Note [The parameter is the truth]).
  std::vector<float*> saved_params;
  // The shards' step counts before the first resident step that joined the pending
  // speculation (empty: none; Note [Resident steps join a speculation]).
  std::vector<std::uint64_t> joined_steps;
  std::mutex param_copy_mu;  // read_param / write_param share exec (the checkpoint's lanes)
  pid_t owner_pid = ::getpid();  // the process that built it (Note [A forked child and device memory])
  // Note [Edits of 16-bit parameters]: per shard, whether the backend's k_written slot
  // holds the hash of its 16-bit parameter as the engine last wrote it; and the shards the
  // last step checked, whose report is pending.
  std::vector<char> edit_hashed, edit_checked;

  /// The tier's state is published by commits (file); else a step updates it in place:
  /// a step that failed part-way is retried from where it stopped, a checkpoint load
  /// into live state verifies first.
  bool in_place() const { return tier_home->store() == nullptr; }
  /// The tier's state streams through the window (host, file); else it stays in HBM.
  bool streamed() const { return tier_home->traits().streamed; }
  stream_t exec() const { return streams->exec(); }
  /// Work enqueued on `waiter` from now on runs after all that is enqueued on `producer`.
  void after(stream_t waiter, stream_t producer) { streams->after(waiter, producer); }
  /// The counts a commit publishes.
  state_counts counts() const { return {step_count, moments_written, shards.steps()}; }
  /// The counts after a step of the shards `stepped` (one flag per shard).
  state_counts counts_after_step(const std::vector<bool>& stepped) const;
  /// The state is at `c` from now on (initialize(), a resumed state file, a loaded
  /// checkpoint, a step done): the counts and the shards' step counts.
  void adopt(const state_counts& c);

  /// Opens a state write (implicit: by write_state_range, published by settle_writes).
  void open_write(bool implicit);
  /// Before a write of the state (a range, a shard's step): the file tier writes only
  /// within a state write, one of its own (implicit) when none is open, published by the
  /// next call that uses the state (Note [State writes] in file_home.cpp); in-place tiers need none.
  void ensure_state_write();
  /// Ends the open state write: published, or dropped (the file tier's counts restored).
  void close_write(bool publish);
  /// Before a call that reads, steps or saves the state: publishes an implicit write,
  /// refuses (invalid_state) while an explicit one is open.
  void settle_writes(const char* fn);
  /// Waits on the host for the write-backs a chained pass left in flight (Note [Chained
  /// passes] in window_pipeline.cpp); nothing when none.
  void settle_passes();

  /// The checks step() and step_speculative() share.
  void check_step(const char* fn, std::span<const void* const> grads, std::span<const value_type> gts,
                  float grad_scale) const;
  /// Refuses (invalid_state) a write of the state while a speculative step is pending.
  void refuse_if_speculating(const char* fn) const;
  /// Refuses (invalid_state) a change of state kept in device memory (device tier,
  /// resident shards) in a process forked from the one that built the optimizer.
  void refuse_in_child(const char* fn) const;

  /// The homes of cfg.home (and of resident shards), over the layers below.
  void make_homes();
  /// Opens the state the home keeps outside this process (file tier: the state file,
  /// resumed when it holds a commit: its counts become the optimizer's).
  void open_state();
  /// Every piece; with `grads` (a step), only those of shards with a gradient, unless
  /// the step writes a new copy of the state (file tier), which must carry the others
  /// (a speculative step does not: commit_speculation carries them).
  /// Init and export passes leave out the shards whose FP32 parameter is their main
  /// unless the home keeps a durable copy of it (Note [The parameter is the truth]).
  std::vector<piece_ref> pieces(pass_kind kind, std::span<const void* const> grads = {}, bool speculative = false) const;
  /// Group g's hyper-parameters: set_group's, else cfg.adamw.
  const adamw_params& hyper_of(int g) const {
    auto it = groups.find(g);
    return it == groups.end() ? cfg.adamw : it->second;
  }
  /// Shard s's scalars for its next step.
  detail::adamw_scalars scalars(std::size_t s, float grad_scale) const;
  /// One pass of the window pipeline over every piece (window_pipeline.cpp); a failed plain
  /// step pass records the pieces it wrote back in `retry` (step_retry::progressed).
  void run_pass(pass_kind kind, std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale,
                stream_t user, std::size_t skip, bool speculative = false);
  /// Shard `s`'s home.
  home& home_of(std::size_t s) const { return shards[s].resident ? *hbm_home : *tier_home; }
  /// A moment of a streamed home before the first step: zeros by construction, never
  /// stored (the pass zeroes it on the device; reads return zeros).
  bool never_written(std::size_t s, state_array a) const;
  /// Copies shard `s`'s array `a` (elements [e0, e0+n)) from its home to host memory `out`
  /// (main of an FP32 parameter: the parameter).
  void read_home(std::size_t s, state_array a, std::size_t e0, std::size_t n, float* out);
  /// Elements [e0, e0+n) of shard `s`'s FP32 parameter from / into host memory
  /// (synchronous, after the work on exec; Note [The parameter is the truth]).
  void read_param(std::size_t s, std::size_t e0, std::size_t n, float* out);
  void write_param(std::size_t s, std::size_t e0, std::size_t n, const float* in);
  /// A checkpoint load's step over shard `s`'s file at `path` (checkpoint.cpp): reads it,
  /// verifies each array against `expect`, and with `copy` writes it into the home (in
  /// `slot` for a committed store); `cached` reads through the page cache, else direct.
  void read_shard_file(std::size_t s, const std::string& path, const per_array<std::uint64_t>& expect, bool copy,
                       bool cached, int slot);
  /// A speculative step's FP32 parameters back to their values before it, for the first
  /// `pieces` of `ps` (all: discard_speculation; a failed pass: those it kept).
  void restore_params(const std::vector<piece_ref>& ps, std::size_t pieces);
  /// Note [Resident shards] (resident.cpp): picks and backs them at initialize(); the
  /// device-tier operations over resident shards (on exec; `all` also takes the shards
  /// of a device-tier optimizer).
  void place_resident();
  bool any_resident() const;
  /// Note [Resident shards on the file tier] (resident.cpp): the resident shards' arrays
  /// (moments only with `moments`) from HBM into the state file's `slot`, before a
  /// commit of it; and from the committed slot into HBM (FP32 parameters: into the
  /// parameter), where HBM must follow the file.
  void store_resident(int slot, bool moments);
  void load_resident();
  /// Note [Resident steps join a speculation] (speculation.cpp): a file-tier step() of
  /// resident shards only while a speculation is pending; undone by drop_joined().
  bool joins_speculation(std::span<const void* const> grads) const;
  void step_joined(std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale,
                   stream_t stream);
  void drop_joined();
  void init_device_shards(bool all);
  void step_device_shards(std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale,
                          std::size_t first, bool all);
  void sync_device_shards(bool all);
  /// BF16(main) into the model parameters; `stream` waits for it.
  void sync_model(stream_t stream);
  /// Note [Edits of 16-bit parameters] (streamed_adamw.cpp): hashes, on exec, the 16-bit
  /// parameters of the shards in `which` (empty: all) as the engine left them.
  void hash_written(std::span<const void* const> which = {});
  /// Before a step of the shards with a gradient: hashes those with a hash of their last
  /// write (after the work on exec) into edit_checked, whose kernels take an edited
  /// parameter into main.
  void check_edits(std::span<const void* const> grads);
  /// Logs the shards whose parameter the last checked step found edited (reads the slots:
  /// waits for exec).
  void report_edits();
  /// No hash is trusted (a step that failed part-way wrote some pieces).
  void forget_edit_hashes() {
    edit_hashed.assign(shards.size(), 0);
    edit_checked.clear();
  }

  /// Note [Entry guard]
  /// Rationale: every public entry of the facade takes the lock and checks the state it
  /// needs (opened, initialized, no explicit state write open, no speculation pending, not a
  /// forked child); written out in each, the preamble and its messages drifted.
  /// Approach: an entry holds an entry_guard for its whole body (the lock), and asks it for
  /// what it needs with require(fn, needs), which runs the checks of entry_needs in one
  /// fixed order: open_state, initialized, settle_writes, refuse_if_speculating,
  /// refuse_in_child.  An entry whose checks run in another order (or between its own
  /// argument checks) calls require() more than once.  The messages are fn's, as the
  /// checks themselves write them.  Every entry first waits for the write-backs a chained
  /// pass left in flight (settle_passes, Note [Chained passes] in window_pipeline.cpp) but
  /// those that take `keeps_passes`: the steps (whose passes order themselves after them on
  /// the device) and the hyper-parameter setters (the passes took their scalars already).
  /// Limits: not on any hot path (once per call); checks that only one entry makes stay in it.
  struct keeps_passes_t {};
  static constexpr keeps_passes_t keeps_passes{};
  class entry_guard {
   public:
    explicit entry_guard(impl& self) : self_(self), lk_(self.mu) { self_.settle_passes(); }
    entry_guard(impl& self, keeps_passes_t) : self_(self), lk_(self.mu) {}
    entry_guard(impl& self, const char* fn, unsigned needs) : entry_guard(self) { require(fn, needs); }
    entry_guard(const entry_guard&) = delete;
    entry_guard& operator=(const entry_guard&) = delete;

    /// The checks of `needs` (entry_needs) for entry `fn`, in their order; `no_state`
    /// replaces the message of entry_needs::initialized.
    void require(const char* fn, unsigned needs, std::string_view no_state = {}) const {
      if (needs & entry_needs::opened) self_.open_state();
      if (needs & entry_needs::initialized)
        DFA_EXPECTS(self_.initialized,
                    no_state.empty() ? std::string(fn) + ": no state yet (initialize() first)" : std::string(no_state),
                    invalid_state);
      if (needs & entry_needs::settled) self_.settle_writes(fn);
      if (needs & entry_needs::not_speculating) self_.refuse_if_speculating(fn);
      if (needs & entry_needs::in_parent) self_.refuse_in_child(fn);
    }

   private:
    impl& self_;
    std::lock_guard<std::mutex> lk_;
  };
};

}  // namespace deferalloc::optim
