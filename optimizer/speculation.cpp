// Speculative steps (Note [Speculative steps]): step_speculative, commit_speculation,
// discard_speculation and their queries, on the facade (layer 5.5, Note [Optimizer layers]).
//
// Note [Speculative steps]
//
// Rationale: a step overlapped with backward under gradient clipping (Note [Overlap with
// backward] in python/deferalloc/overlap.py) must step each bucket before the global
// gradient norm is known, and step it again from the previous state when the norm says
// the gradients are clipped.  Keeping that state by copying it out costs 12 B/param of
// host memory bandwidth per iteration (4 s per step for 1.1 G params on the H200), even
// when no redo happens.
// Approach: the host home keeps a second pinned copy of a shard's three arrays (same
// layout, compressed moments included), allocated at the shard's first speculative step.
// step_speculative() runs the ordinary step pass (same pieces, kernels, scalars from the
// committed step count, BF16 parameters written), except that the write-back lands in
// the second copy (pass_plan::speculative; the window's slot logic is unchanged): the
// current copy is the kept state, for free.  commit_speculation() swaps the two copies of
// each pending shard (pointer swaps) and advances their step counts; discard_speculation()
// forgets the second copy (and puts FP32 parameters back).  A redo is discard, clip, step
// again; it rewrites the BF16 parameters from the kept state, so the result is
// bit-identical to the clipped plain step.  Everything else (state ranges, state_dict, save_checkpoint, sync_model_params)
// reads the current copy; writes of the state (write_state_range, set_shard_step,
// load_checkpoint) are refused while a speculation is pending, and so is a step() of a
// pending shard.
// File tier: its step already writes a second copy, the inactive slot of the state file,
// published by the commit record.  A speculative step writes its shards there and commits
// nothing; commit_speculation() carries the shards that were not stepped into that slot
// (a pass that reads and writes them unchanged) and writes one commit record, so several
// bucket passes of a step overlapped with backward cost one commit and move each shard
// once (a plain step per bucket would carry, and fsync, the whole state each time);
// discard_speculation() leaves the active slot as it was.  A plain step() is refused
// while a speculation is pending (it would carry the pending shards' committed state
// over their new one).
// Limits: host and file tiers, streamed shards only (can_speculate): resident shards are
// stepped in place in HBM, where a second copy would take the HBM the budget gave them,
// and the device tier keeps one copy; those are refused with invalid_state and the
// caller keeps their state itself (overlap.py copies it out; on the file tier their plain
// steps join the speculation: Note [Resident steps join a speculation]).  Host tier memory: the second copy doubles the pinned host
// memory of the shards stepped speculatively (12 B/param more with fp32 moments), held
// until the optimizer is destroyed.  An FP32 parameter is its own main and is stepped in
// place: its second copy holds the moments (8 B/param) and the kept parameter values
// (4 B/param, copied D2H by the speculative step: Note [The parameter is the truth]),
// which discard copies back, so a redo starts from the parameter as it was.

#include <deferalloc/core/errors.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "optimizer_impl.hpp"

namespace deferalloc::optim {

void streamed_adamw::impl::refuse_if_speculating(const char* fn) const {
  DFA_EXPECTS(shards.speculating() == 0,
              std::string(fn) + ": " + std::to_string(shards.speculating()) +
                  " shard(s) have " + k_pending,
              invalid_state);
}

void streamed_adamw::step_speculative(std::span<const void* const> grads, std::span<const value_type> gts,
                                      float grad_scale, stream_t stream) {
  auto& self = *impl_;
  impl::entry_guard g(self, impl::keeps_passes);
  self.check_step("step_speculative", grads, gts, grad_scale);
  g.require("step_speculative", entry_needs::settled);
  second_copy* copies = self.tier_home->speculation();
  DFA_EXPECTS(copies != nullptr,
              std::string("step_speculative: the ") + to_string(self.cfg.home) +
                  " tier keeps one copy of the state (speculative steps need the host tier or the file tier)",
              invalid_state);
  DFA_EXPECTS(!self.retry.pending(), "step_speculative: " + std::string(k_retry_pending), invalid_state);
  for (std::size_t s = 0; s < self.shards.size(); ++s) {
    if (grads[s] == nullptr) continue;
    const std::string which = "step_speculative: shard " + std::to_string(s) + " ('" + self.shards[s].info.name + "') ";
    DFA_EXPECTS(!self.shards[s].resident, which + "is resident in HBM and stepped in place (step it with step())",
                invalid_state);
    DFA_EXPECTS(!self.shards[s].speculative,
                which + "already has " + k_pending,
                invalid_state);
  }
  // The second copies (and the room for FP32 parameters' values) before anything runs:
  // running out of pinned memory changes nothing.
  self.saved_params.resize(self.shards.size(), nullptr);
  for (std::size_t s = 0; s < self.shards.size(); ++s)
    if (grads[s] != nullptr) {
      copies->prepare(s);
      if (param_is_main(self.shards[s].info) && !self.saved_params[s])
        self.saved_params[s] = static_cast<float*>(self.drv->host_alloc(self.shards[s].info.numel * 4));
    }
  self.report_edits();
  try {
    self.after(self.exec(), stream);
    self.check_edits(grads);
    self.run_pass(pass_kind::step, grads, gts, grad_scale, stream, 0, true);
    self.after(stream, self.exec());
  } catch (...) {
    self.retry.clear();  // the current copy is intact: nothing to resume
    self.forget_edit_hashes();
    throw;
  }
  // A chained pass's kernels may still run: the next step reports its edits (Note [Chained passes]).
  if (!self.slots || self.slots->chain.unwaited == 0) self.report_edits();
  self.hash_written(grads);
  for (std::size_t s = 0; s < self.shards.size(); ++s)
    if (grads[s] != nullptr) self.shards.mark_speculative(s);
}

void streamed_adamw::commit_speculation() {
  auto& self = *impl_;
  impl::entry_guard g(self);
  if (self.shards.speculating() == 0) return;
  // (A commit adopts the failed step's number: its retry would never run.)
  DFA_EXPECTS(!self.retry.pending(), "commit_speculation: " + std::string(k_retry_pending), invalid_state);
  std::vector<bool> stepped(self.shards.size());
  for (std::size_t s = 0; s < self.shards.size(); ++s) stepped[s] = self.shards[s].speculative;
  const state_counts after = self.counts_after_step(stepped);
  if (committed_store* store = self.tier_home->store()) {
    // File tier: the shards not stepped are carried into the new slot, then one commit
    // record publishes it.  A failure leaves the speculation pending (retry or discard).
    const std::vector<const void*> none(self.shards.size(), nullptr);
    const std::vector<value_type> gts(self.shards.size(), value_type::fp32);
    // (The carry touches no parameter or gradient: it is ordered after no user stream.)
    if (!self.pieces(pass_kind::step, none, false).empty()) self.run_pass(pass_kind::step, none, gts, 1.0f, self.exec(), 0);
    self.drv->synchronize_stream(self.exec());
    self.store_resident(store->load_slot(), true);  // carried too (Note [Resident shards on the file tier])
    store->commit(pass_kind::step, after);
  }
  for (std::size_t s = 0; s < self.shards.size(); ++s)
    if (self.shards[s].speculative) self.tier_home->speculation()->make_current(s);
  self.shards.end_speculation();
  self.joined_steps.clear();  // committed with the rest
  self.adopt(after);
}

void streamed_adamw::discard_speculation() {
  auto& self = *impl_;
  impl::entry_guard g(self);
  std::vector<piece_ref> whole;
  for (std::size_t s = 0; s < self.shards.size(); ++s)
    if (self.shards[s].speculative) whole.push_back({s, 0, self.shards[s].info.numel});
  self.restore_params(whole, whole.size());
  if (!self.joined_steps.empty()) self.drop_joined();
  self.shards.end_speculation();
}

// Note [Resident steps join a speculation]
//
// Rationale: a step overlapped with backward on the file tier steps the shards the engine
// can keep speculatively (one commit per step) and resident shards plainly (Note
// [Overlap with backward] in python/deferalloc/overlap.py); a plain file-tier step is
// refused while a speculation is pending (it would commit the pending shards' old state),
// so with resident shards on the file tier (Note [Resident shards on the file tier]) no
// overlapped step could run.
// Approach: on a committed store, a step() whose every gradient is a resident shard's,
// while a speculation is pending, joins it: the shards step in HBM (their step counts
// advance, the step count does not) and nothing is committed; commit_speculation writes
// every resident shard into its slot with the rest (store_resident), so the step is
// durable with the speculation.  discard_speculation undoes the joined steps: the resident
// shards are loaded from the committed slot (load_resident), their 16-bit parameters
// written from it, and their step counts put back, so every shard stepped since the last
// commit is back at it (what a redo of the iteration needs; the caller's kept copies
// write the same values).
// Limits: file tier only; on the host tier a plain step during a speculation stands alone
// (a discard keeps it; overlap.py writes its kept copies back).  A joined step that fails
// part-way is undone by discard_speculation only.
bool streamed_adamw::impl::joins_speculation(std::span<const void* const> grads) const {
  if (in_place() || shards.speculating() == 0) return false;
  bool any = false;
  for (std::size_t s = 0; s < shards.size(); ++s) {
    if (grads[s] == nullptr) continue;
    if (!shards[s].resident) return false;
    any = true;
  }
  return any;
}

void streamed_adamw::impl::step_joined(std::span<const void* const> grads, std::span<const value_type> gts,
                                       float grad_scale, stream_t stream) {
  if (joined_steps.empty()) joined_steps = shards.steps();
  report_edits();
  try {
    after(exec(), stream);
    check_edits(grads);
    step_device_shards(grads, gts, grad_scale, 0, false);
    after(stream, exec());
    report_edits();  // (waits for the kernels)
  } catch (...) {
    forget_edit_hashes();
    throw;
  }
  hash_written(grads);
  for (std::size_t s = 0; s < shards.size(); ++s)
    if (grads[s] != nullptr) shards[s].step += 1;
}

void streamed_adamw::impl::drop_joined() {
  load_resident();
  sync_device_shards(false);  // their 16-bit parameters from the committed main
  drv->synchronize_stream(exec());
  hash_written();
  for (std::size_t s = 0; s < shards.size(); ++s) shards[s].step = joined_steps[s];
  joined_steps.clear();
}

void streamed_adamw::impl::restore_params(const std::vector<piece_ref>& ps, std::size_t pieces) {
  bool any = false;
  for (std::size_t j = 0; j < std::min(pieces, ps.size()); ++j) {
    const piece_ref& p = ps[j];
    if (!param_is_main(shards[p.shard].info) || p.shard >= saved_params.size() || !saved_params[p.shard]) continue;
    drv->copy_async(static_cast<float*>(shards[p.shard].info.param) + p.e0, saved_params[p.shard] + p.e0, p.n * 4, exec());
    any = true;
  }
  if (any) drv->synchronize_stream(exec());
}

std::size_t streamed_adamw::speculation_pending() const {
  impl::entry_guard g(*impl_);
  return impl_->shards.speculating();
}

bool streamed_adamw::can_speculate(std::size_t s) const {
  impl::entry_guard g(*impl_);
  DFA_EXPECTS(s < impl_->shards.size(), "can_speculate: no shard " + std::to_string(s));
  return impl_->tier_home->speculation() != nullptr && !impl_->shards[s].resident;
}

}  // namespace deferalloc::optim
