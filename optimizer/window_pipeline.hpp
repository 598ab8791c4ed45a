// The window pipeline, the optimizer's fourth layer (Note [Optimizer layers] in
// optimizer_impl.hpp): one pass drives its pieces through fetch -> compute -> write back
// over a home's piece_mover (Note [Window pipeline] in window_pipeline.cpp).
#pragma once
#include <deferalloc/core/chunk_pool.hpp>
#include <deferalloc/core/driver.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "home.hpp"
#include "kernels/compute.hpp"
#include "progress.hpp"
#include "shard_table.hpp"
#include "window.hpp"

namespace deferalloc::optim {

/// What a pass runs on: the layers below it, which outlive it.
struct pipeline_parts {
  stream_ops& ops;  // copies, events and waits
  detail::compute& comp;
  chunk_pool& pool;  // the window's chunks
  stream_set& streams;
  window& slots;
  piece_mover& mover;  // the tier's home moves the pieces
  const shard_table& shards;
  const optimizer_config& cfg;  // the moments' format, keep_window, progress reports
};

/// A step pass's inputs, per shard: the gradients (null: not stepped), their types and
/// the step's scalars.
struct step_inputs {
  std::span<const void* const> grads;
  std::span<const value_type> grad_types;
  std::vector<detail::adamw_scalars> scalars;
  /// A speculative step: per shard, host memory that takes its FP32 parameter's values
  /// before the step (null: none; Note [The parameter is the truth]).
  std::span<float* const> saved_params;
  /// Per shard: its 16-bit parameter is checked for edits (Note [Edits of 16-bit parameters]).
  std::span<const char> edit_checks;
};

/// The pieces of a pass over the shards `selected` (Note [Pass pieces]): the window's
/// piece of `window_piece` elements halved while the pass keeps 12 to 24 pieces, on
/// multiples of `align` elements; `taper`: the pass's first and last pieces cut smaller.
std::vector<piece_ref> cut_pieces(const shard_table& shards, const std::vector<bool>& selected,
                                  std::size_t window_piece, std::size_t align, bool taper = false);

/// Waits on the host for the write-backs a chained pass left in flight (Note [Chained
/// passes]); nothing when none.
void settle_chain(stream_ops& ops, stream_set& streams, window& slots);

/// One pass over plan.pieces (Note [Window pipeline]).
class window_pipeline {
 public:
  window_pipeline(const pipeline_parts& parts, pass_plan plan, step_inputs step = {});

  /// Runs the pass after the work enqueued on `user`, its figures into `report`.  On
  /// failure it drains every stream and I/O, gives the window back and throws the
  /// cause's class with the piece it failed at.
  void run(stream_t user, step_report& report);
  /// After a failed run: plan.skip plus the pieces after it whose write-back was issued,
  /// in order (a step retried with the same gradients skips them).
  std::size_t written() const;
  /// After a failed run: the pieces whose fetch was issued (a speculative step kept their
  /// FP32 parameters' values: step_inputs::saved_params).
  std::size_t fetched() const { return fetched_; }
  /// After a failed run of a resumable pass: where the first piece it stepped and could
  /// not write back is (empty: none; Note [The write-back queue]).
  const std::string& torn() const { return torn_; }

 private:
  std::size_t pieces() const { return plan_.pieces.size(); }
  const piece_ref& piece(std::size_t i) const { return plan_.pieces[i]; }
  std::size_t slot_index(std::size_t i) const;
  event_t event(std::size_t i, int which);
  const per_array<float*>& slot_of(std::size_t i) const;
  const char* phase() const;
  void prefetch(std::size_t j);
  void back_slots();
  void release_slots(stream_t s);
  bool steps_param(const piece_ref& p) const;
  bool keeps_params() const;
  float* kept(const piece_ref& p) const;
  char* model_of(const piece_ref& p) const;
  void fetch(std::size_t i);
  void compute(std::size_t i);
  void write_back(std::size_t i);
  void issue_write_backs(std::size_t end, bool wait);
  void retire_next();
  [[noreturn]] void fail();

  pipeline_parts parts_;
  pass_plan plan_;
  step_inputs step_;
  step_report* report_ = nullptr;        // run()'s
  std::optional<progress_meter> progress_;  // run()'s
  std::size_t params_ = 0, done_params_ = 0;  // the pass's parameters, and those retired
  std::size_t current_ = 0;                    // the piece being enqueued (for a failure's message)
  // Note [The write-back queue]: pieces [issued_, computed_) are stepped and wait for their
  // write-back to be issued; [retired_, issued_) are issued and not yet waited for, their
  // bytes queued_bytes_ (wb_bytes_: each piece's).
  std::size_t computed_ = 0, issued_ = 0, retired_ = 0;
  std::size_t queued_bytes_ = 0;
  std::size_t inherited_bytes_ = 0, inherited_queued_ = 0;  // a chained previous pass's not waited for
  static constexpr std::size_t k_none = ~std::size_t{0};
  std::size_t partly_written_ = k_none;  // a piece whose write-back copied some arrays, not recorded
  std::string torn_;                     // torn()
  std::vector<std::size_t> wb_bytes_;
  std::size_t fetched_ = 0;  // pieces whose fetch was issued
  std::size_t base_ = 0;       // the slot of the first piece (Note [Chained passes])
  std::size_t inherited_ = 0;  // slots the previous, chained pass left unwaited
};

}  // namespace deferalloc::optim
