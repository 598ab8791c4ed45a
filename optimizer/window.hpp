// The window and the pipeline's streams, the optimizer's second layer (Note [Optimizer
// layers] in optimizer_impl.hpp): `depth` slots of one piece per state array, reserved
// once and backed while a pass runs (Note [Window slots] in window_pipeline.cpp), and the
// three streams a pass runs on with the events that order them.
#pragma once
#include <deferalloc/core/driver.hpp>
#include <deferalloc/core/reservations.hpp>

#include <cstddef>
#include <span>
#include <vector>

#include "shard_table.hpp"

namespace deferalloc::optim {

/// The streams of the optimizer's work: H2D copies, the kernels (ahead of the model's
/// streams: Note [Overlap with backward] in python/deferalloc/overlap.py), D2H copies;
/// and a ring of events over them.
class stream_set {
 public:
  explicit stream_set(stream_ops& drv);
  ~stream_set();
  stream_set(const stream_set&) = delete;
  stream_set& operator=(const stream_set&) = delete;

  stream_t h2d() const { return h2d_; }
  stream_t exec() const { return exec_; }
  stream_t d2h() const { return d2h_; }
  /// Event `i` of the ring (made on first use).
  event_t event(std::size_t i);
  /// Work enqueued on `waiter` from now on runs after all that is enqueued on `producer`
  /// so far (one record of event 0 + one wait; no host synchronisation).
  void after(stream_t waiter, stream_t producer);
  /// Waits for the three streams (h2d, exec, d2h).
  void synchronize();

 private:
  stream_ops& drv_;
  stream_t h2d_ = nullptr, d2h_ = nullptr, exec_ = nullptr;
  std::vector<event_t> events_;
};

/// The window's slots: slot k holds one piece of each state array at stable device
/// addresses, backed from the start for the bytes the passes so far needed.
class window {
 public:
  /// `depth` slots of `piece_bytes` per array, reserved (not backed) in `mgr`, which
  /// outlives the window and frees the reservations with it.
  window(reservation_manager& mgr, std::size_t depth, std::size_t piece_bytes);

  std::size_t depth() const { return slots_.size(); }
  /// Slot k's device address of each array.
  const per_array<float*>& slot(std::size_t k) const { return slots_[k].dev; }
  /// Backs arrays `arrays` of the first `count` slots for `bytes` from their start where
  /// they are not yet (on `s`); false when all were.  All or nothing.
  bool back(std::size_t count, std::span<const state_array> arrays, std::size_t bytes, stream_t s);
  /// Gives every slot's chunks back to the pool after the work on `s`.
  void release(stream_t s);

  /// The slots across passes (Note [Chained passes] in window_pipeline.cpp): the slot the
  /// next pass's first piece takes, and how many slots before it hold a piece whose
  /// write-back no host wait has covered (the last of them written back last), the
  /// shards of the pass that left them, and how many write-backs (and their bytes) the
  /// passes left in flight that no host wait covered (read only under writeback_queue_mb).
  struct ring {
    std::size_t next = 0;
    std::size_t unwaited = 0;
    std::vector<std::size_t> shards;
    std::size_t queued = 0, queued_bytes = 0;  // Note [The write-back queue]
  };
  ring chain;

 private:
  struct slot_arrays {
    per_array<reservation_id> res{};
    per_array<float*> dev{};          // their addresses
    per_array<std::size_t> backed{};  // bytes backed from the start (granules)
  };
  reservation_manager& mgr_;
  std::vector<slot_arrays> slots_;
};

}  // namespace deferalloc::optim
