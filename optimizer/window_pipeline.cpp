// Note [Window pipeline]
//
// Rationale: the FP32 main params and Adam moments (12 B/param) are touched once per
// step, so they need HBM only while the step passes over them.  Each shard gets three
// deferred reservations (main, exp_avg, exp_avg_sq): stable device addresses, backed only
// where the state must stay in HBM (device tier, resident shards) or where a user backs
// them; a streamed shard is stepped piece by piece in the window, whose size bounds the
// physical memory the state takes.
//
// Approach
//  - A piece is n elements of one shard, all three arrays; n is at most the largest
//    multiple of the granule (in floats) with depth * 12 * n <= window_bytes, and about a
//    12th to 24th of the pass (Note [Pass pieces] in streamed_adamw.cpp).  Piece i is moved and
//    stepped in slot (i - skip) mod depth of the window (Note [Window slots]).
//  - Per piece, on three streams, one method of window_pipeline each: fetch (H2D from
//    the piece's home into its slot, Note [Homes], after the slot's previous piece was
//    written back; never-written moments are zeroed on the device instead of copied) ->
//    compute (the kernel) -> write_back (D2H) -> retire (the host waits for that piece's
//    write-back event; the home persists the piece).  With depth 3, fetch(i+1), step(i)
//    and write-back(i-1) overlap, and H2D and D2H run at once (the link is duplex).
//  - File tier: its home reads `depth` pieces ahead into a ring of 2*depth pinned staging
//    buffers, writes drain from another ring; see Note [File tier] for the two slots
//    and the commit record that make a step atomic.
//  - The slots are backed before any piece moves, so running out of memory at the start
//    of a pass fails before any state changed.
//  - Failure: the pass drains every stream and I/O, releases the window and throws with
//    the shard, element offset (and file offset for I/O).  File tier: the previous step
//    is intact (the commit record still points to it) and the BF16 params are re-derived
//    from it.  Host/device tiers update in place: the pieces whose write-back was issued
//    are counted, and a step retried with the same gradients skips them.
//
// Limits: one pass at a time per optimizer (calls are serialized by a mutex); a pass
// over tiny shards moves one piece per shard, each a few copies and a kernel launch.
//
// Note [Window slots]
// Rationale: models have many small shards (a 1.1 G-param Llama has 201, most of them
// under a piece: norms of a few kilobytes, k/v projections of 2 MiB).  Backing each
// piece at its shard's own addresses costs a map, an access grant and an unmap per array
// and piece (about 0.7 ms of host time per piece, measured on the H200 in a pass of 125
// pieces), during which the copy engines starve: a pass of many small pieces runs at the
// speed of the driver's VMM calls, not of the link.
// Approach: the window is `depth` slots, each one piece per array, reserved once at
// construction (impl::slots) and backed at the start of a pass: 3 * depth chunks of one
// piece, from the chunk pool (whose cache keeps them between passes).  Every piece of the
// pass moves through its slot, so a pass maps and unmaps 3 * depth chunks whatever the
// number of pieces, and a piece costs its copies, its kernel and one event.  At the end of
// the pass the slots are released and the cache is trimmed: between steps the state
// holds no HBM.  keep_window keeps the slots backed between passes instead (back-to-back
// passes, as the buckets of a step overlapped with backward, map nothing).  The shards'
// own reservations stay unbacked through a streamed pass: nothing reads them then.  A
// slot is backed for the pass's largest piece only (rounded to the granule): a model of
// tiny shards backs a granule per array and slot, not a whole piece.
// Depth: piece i's fetch waits for the write-back of piece i - depth (its slot), so a
// fetch runs at most depth pieces ahead of the write-backs.  With pieces of one size
// depth 3 keeps both directions of the link busy (fetch i+1 beside write-back i-1); with
// a model's shards of mixed sizes it does not: after a large MLP piece and two small
// norms, the next fetch waits for the MLP piece's whole write-back while the H2D
// direction idles.  So depth 0 (the default) is 8 on the host tier (the window's piece
// shrinks with it: window / (12 * depth), a power of two of granules); the file tier,
// whose reads ahead and staging ring are depth pieces deep, keeps 3; both take fewer
// slots when the window holds fewer.
// Limits: a deeper window than 8 gave no further gain on the host tier, and the file
// tier was not measured deeper than 3.  benchmarks/optimizer/pass_shapes.py measures a
// model's shapes against the duplex copy bound at each depth; its figures and those of
// bench_overlap per depth are in docs/BENCHMARKS.md ("Why depth").
#include <deferalloc/errors.hpp>

#include <algorithm>
#include <chrono>

#include "log.hpp"
#include "optimizer_impl.hpp"

namespace deferalloc::optim {

using clk = std::chrono::steady_clock;

namespace {
double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }
}  // namespace

// One pass over every piece: the state the stages share, one method per stage.
class streamed_adamw::impl::window_pipeline {
 public:
  window_pipeline(impl& owner, pass kind, std::span<const void* const> grads, std::span<const value_type> gts,
                  float grad_scale, std::size_t skip, bool speculative)
      : I(owner), home_(*owner.tier_home), grads_(grads), gts_(gts), K(owner.cfg.depth) {
    plan_.kind = kind;
    plan_.pieces = I.pieces(grads, speculative);
    plan_.skip = skip;
    plan_.arrays = kind == pass::step ? 3 : 1;
    plan_.fetch_main = kind != pass::init;
    plan_.write_back = kind != pass::export_bf16;
    plan_.speculative = speculative;  // the home writes back into the second copy
    P = plan_.pieces.size();
    if (kind == pass::step)
      for (std::size_t s = 0; s < I.shards.size(); ++s) ks_.push_back(I.scalars(s, grad_scale));
    home_.begin_pass(plan_);
    for (std::size_t j = skip; j < P; ++j) params_ += plan_.pieces[j].n;
    wb_issued_.assign(P, false);
  }

  void run(stream_t user) {
    const std::size_t skip = plan_.skip;
    t0_ = last_line_ = clk::now();
    I.report = step_report{};
    I.pool->reset_peak();
    // The kernels read what the user's stream produced (gradients, BF16 params).
    I.after(I.exec, user);
    i_ = skip;
    try {
      for (std::size_t j = skip; j < std::min(P, skip + 2 * static_cast<std::size_t>(K)); ++j) prefetch(j);
      // The window's memory before any piece moves: OOM here changes nothing.
      back_slots();
      for (; i_ < P; ++i_) {
        if (i_ >= skip + K) {
          retire(i_ - K);
          prefetch(i_ + K);
        }
        fetch(i_);
        compute(i_);
        write_back(i_);
      }
      for (std::size_t j = P > static_cast<std::size_t>(K) ? std::max(skip, P - K) : skip; j < P; ++j) retire(j);
      home_.end_pass();
    } catch (...) {
      fail();
    }
    I.report.seconds = since(t0_);
    I.report.params = params_;
    I.report.pieces = P - skip;
    I.report.peak_backed_bytes = I.pool->stats().peak_alive_bytes;
    // Between passes the state holds no HBM: the window's chunks go back to the driver
    // (3 * depth cuMemRelease here and as many cuMemCreate in the next pass, microseconds
    // against a pass of milliseconds).  keep_window keeps the slots backed for
    // back-to-back passes (Note [Window slots]).
    if (!I.cfg.keep_window) {
      release_slots(I.d2h);
      I.pool->trim();
    }
  }

 private:
  const piece_ref& piece(std::size_t i) const { return plan_.pieces[i]; }
  // Piece i's slot of the event ring: 0 fetched, 1 computed, 2 written back.
  event_t ev(std::size_t i, int which) { return I.event(1 + (i % K) * 3 + which); }
  // Piece i's slot of the window (Note [Window slots]).
  impl::slot& slot_of(std::size_t i) const { return I.slots[(i - plan_.skip) % static_cast<std::size_t>(K)]; }
  // The piece's window: its slot's arrays.
  const per_array<float*>& window(std::size_t i) const { return slot_of(i).dev; }
  const char* phase() const { return plan_.kind == pass::init ? "init" : plan_.kind == pass::step ? "step" : "sync"; }

  void prefetch(std::size_t j) {
    if (j < P && j >= plan_.skip) home_.prefetch(j, piece(j));
  }

  // Backs the slots the pass uses, for the arrays it moves and its largest piece (a pass
  // over tiny shards backs a granule per array, not a piece), where not backed yet.
  void back_slots() {
    std::size_t longest = 0;
    for (std::size_t j = plan_.skip; j < P; ++j) longest = std::max(longest, piece(j).n);
    const std::size_t need = I.granules(longest * 4);
    std::vector<range> rs;
    const std::size_t n = std::min(P - plan_.skip, static_cast<std::size_t>(K));
    for (std::size_t k = 0; k < n; ++k)
      for (state_array a : first_arrays(plan_.arrays))
        if (I.slots[k].backed[a] < need) rs.push_back({I.slots[k].res[a], I.slots[k].backed[a], need - I.slots[k].backed[a]});
    if (rs.empty()) return;
    const auto t = clk::now();
    I.mgr->materialize(rs, fill_mode::undefined, I.h2d);
    I.report.map_seconds += since(t);
    for (std::size_t k = 0; k < n; ++k)
      for (state_array a : first_arrays(plan_.arrays)) I.slots[k].backed[a] = std::max(I.slots[k].backed[a], need);
  }

  // Gives the window's chunks back to the pool (after the work on `s`).
  void release_slots(stream_t s) {
    std::vector<range> rs;
    for (auto& sl : I.slots)
      for (state_array a : k_state_arrays)
        if (sl.backed[a] > 0) rs.push_back({sl.res[a], 0, sl.backed[a]});
    if (!rs.empty()) I.mgr->release(rs, keep_mode::discard, s);
    for (auto& sl : I.slots) sl.backed = {};
  }

  // H2D: main (all but init), the moments (step; zeros before they were ever written).
  void fetch(std::size_t i) {
    const auto& p = piece(i);
    const auto& dev = window(i);
    // The slot's previous piece is written back (retire() waited for it on the host; the
    // wait keeps the order on the device too).
    if (i >= plan_.skip + K) I.drv->stream_wait(I.h2d, ev(i - K, 2));
    if (plan_.fetch_main) {
      home_.await_fetch(i);
      I.report.bytes_to_device += home_.to_device(i, p, state_array::main, dev[state_array::main], I.h2d);
    }
    if (plan_.kind == pass::step)
      for (state_array a : {state_array::exp_avg, state_array::exp_avg_sq}) {
        if (I.moments_written) I.report.bytes_to_device += home_.to_device(i, p, a, dev[a], I.h2d);
        else I.drv->zero_async(dev[a], p.n * 4, I.h2d);  // never written: zero by construction
      }
    I.drv->record(ev(i, 0), I.h2d);
  }

  void compute(std::size_t i) {
    const auto& p = piece(i);
    const auto& sh = I.shards[p.shard];
    const auto& dev = window(i);
    I.drv->stream_wait(I.exec, ev(i, 0));
    const int mt = static_cast<int>(sh.info.param_type);
    char* model = static_cast<char*>(sh.info.param) + p.e0 * (mt == detail::k_fp32 ? 4 : 2);
    if (plan_.kind == pass::init) {
      I.comp->upcast(model, mt, dev[state_array::main], p.n, I.exec);
    } else if (plan_.kind == pass::export_bf16) {
      I.comp->downcast(dev[state_array::main], model, mt, p.n, I.exec);
    } else if (grads_[p.shard] != nullptr) {  // (file tier: a skipped shard's piece is carried over unchanged)
      const int gt = static_cast<int>(gts_[p.shard]);
      const char* grad = static_cast<const char*>(grads_[p.shard]) + p.e0 * (gt == detail::k_fp32 ? 4 : 2);
      if (I.cfg.moments != moment_format::fp32)  // (host and file tiers: make_homes() checks)
        I.comp->adamw_moments({dev[state_array::main], dev[state_array::exp_avg], dev[state_array::exp_avg_sq], model,
                               grad, mt, gt, static_cast<int>(I.cfg.moments), p.n, p.e0},
                              ks_[p.shard], I.exec);
      else
        I.comp->adamw({dev[state_array::main], dev[state_array::exp_avg], dev[state_array::exp_avg_sq], model, grad, mt,
                       gt, p.n},
                      ks_[p.shard], I.exec);
    }
    I.drv->record(ev(i, 1), I.exec);
  }

  // D2H of the arrays the pass changed (none for an export).
  void write_back(std::size_t i) {
    const auto& p = piece(i);
    const auto& dev = window(i);
    I.drv->stream_wait(I.d2h, ev(i, 1));
    if (plan_.write_back) {
      home_.await_write_back(i);
      for (state_array a : first_arrays(plan_.arrays))
        I.report.bytes_from_device += home_.from_device(i, p, a, dev[a], I.d2h);
    }
    I.drv->record(ev(i, 2), I.d2h);
    wb_issued_[i] = true;
  }

  // The piece's write-back is done (its slot is free again); its home persists it.
  void retire(std::size_t i) {
    const auto& p = piece(i);
    const auto t = clk::now();
    I.drv->synchronize(ev(i, 2));
    I.report.retire_seconds += since(t);
    home_.retire(i, p);
    done_params_ += p.n;
    I.report_progress(phase(), done_params_, params_, t0_, last_line_);
  }

  // Drain: every stream and every I/O request, then give the window back; rethrows.
  [[noreturn]] void fail() {
    try {
      I.drv->synchronize_stream(I.h2d);
      I.drv->synchronize_stream(I.exec);
      I.drv->synchronize_stream(I.d2h);
    } catch (...) {
      deferalloc::detail::log_current("streamed_adamw: draining the streams after a failed pass");
    }
    home_.drain();
    try {
      release_slots(I.d2h);
    } catch (...) {
      deferalloc::detail::log_current("streamed_adamw: releasing the window after a failed pass");
    }
    I.pool->trim();
    std::size_t written = plan_.skip;
    while (written < P && wb_issued_[written]) ++written;
    I.failed_pieces_done = written;
    const std::string at = i_ < P ? " at " + I.where(piece(i_)) : "";
    // The same class as the cause (no_device stays no_device), the cause nested in it.
    rethrow_with_context(std::string(plan_.kind == pass::init   ? "initialize"
                                     : plan_.kind == pass::step ? "step"
                                                                : "sync") +
                         " failed" + at);
  }

  impl& I;
  home& home_;
  std::span<const void* const> grads_;
  std::span<const value_type> gts_;
  const int K;  // depth: pieces in flight
  pass_plan plan_;
  std::size_t P = 0;  // pieces
  std::vector<detail::adamw_scalars> ks_;  // per shard (a step)
  clk::time_point t0_, last_line_;
  std::size_t params_ = 0, done_params_ = 0;
  std::size_t i_ = 0;  // the piece being enqueued (for a failure's message)
  std::vector<bool> wb_issued_;
};

void streamed_adamw::impl::run_pass(pass kind, std::span<const void* const> grads, std::span<const value_type> gts,
                                    float grad_scale, stream_t user, std::size_t skip, bool speculative) {
  window_pipeline(*this, kind, grads, gts, grad_scale, skip, speculative).run(user);
}

}  // namespace deferalloc::optim
