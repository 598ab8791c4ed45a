// The streamed_adamw facade's private state (streamed_adamw.cpp: construction, initialize
// / step / sync, state ranges; resident.cpp; checkpoint.cpp), on top of the layers below.
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
//  3. the homes (home.hpp, home.cpp; Note [Homes]): where the state lives between
//     passes, a narrow interface and optional capabilities;
//  4. the window pipeline (window_pipeline.hpp/.cpp; Note [Window pipeline]): one pass,
//     given its plan (pieces, what to move), its step's inputs (gradients, scalars) and
//     the parts it runs on as data; its figures go into a step_report;
//  5. the facade (streamed_adamw::impl, here): the API's checks and counts (steps,
//     moments written, a failed step's progress, state writes, speculation), the
//     choice of pieces and scalars, commits, resident shards and checkpoints.
// Nothing below the facade calls it: what a lower layer learns (a resumed state file's
// counts, a failed pass's progress) is a return value or a query.  progress.hpp reports
// a long operation's progress to the user's callback and stderr.
// Limits: the facade's state is one struct, private to streamed_adamw (its files read
// and write it directly); resident.cpp and checkpoint.cpp are the facade's too.
#pragma once
#include <deferalloc/core/chunk_pool.hpp>
#include <deferalloc/core/reservations.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <map>
#include <mutex>
#include <span>

#include "home.hpp"
#include "kernels/compute.hpp"
#include "shard_table.hpp"
#include "store/file_util.hpp"
#include "window.hpp"

namespace deferalloc::optim {

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
  std::size_t piece = 0;               // elements per window slot (streamed tiers)
  std::size_t piece_align = 1;  // a piece's alignment in elements: the granule or the home's (streamed tiers)
  std::uint64_t step_count = 0;
  bool initialized = false;
  bool moments_written = false;
  /// A step that failed part-way (in place tiers), retried with the same gradients.
  struct failed_step {
    std::uint64_t step = 0;        // its step number, 0 = none
    std::size_t pieces_done = 0;   // its pieces (device tier: shards) already written back
    bool resident_stepped = false;  // its resident shards are enqueued (the retry skips them)
  } retry;
  step_report report;
  std::size_t speculating = 0;  // shards with shard::speculative set
  /// The open state write (Note [State writes] in home.cpp).
  struct open_write_state {
    bool open = false;
    bool implicit = false;        // opened by write_state_range itself, published by the next use
    bool moments_before = false;  // moments_written when it opened (restored by an abort)
    std::vector<std::uint64_t> steps_before;  // the shards' step counts then
  } state_write;

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

  /// The homes of cfg.home (and of resident shards), over the layers below.
  void make_homes();
  /// Opens the state the home keeps outside this process (file tier: the state file,
  /// resumed when it holds a commit: its counts become the optimizer's).
  void open_state();
  /// Every piece; with `grads` (a step), only those of shards with a gradient, unless
  /// the step writes a new copy of the state (file tier), which must carry the others
  /// (a speculative step does not: commit_speculation carries them).
  std::vector<piece_ref> pieces(std::span<const void* const> grads = {}, bool speculative = false) const;
  /// Shard s's scalars for its next step.
  detail::adamw_scalars scalars(std::size_t s, float grad_scale) const;
  /// One pass of the window pipeline over every piece (window_pipeline.cpp); a failed one
  /// leaves retry.pieces_done at the pieces it wrote back.
  void run_pass(pass_kind kind, std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale,
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
};

}  // namespace deferalloc::optim
