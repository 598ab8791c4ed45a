// Note [Window pipeline]
//
// Rationale: the FP32 main params and Adam moments (12 B/param) are touched once per
// step, so they need HBM only while the step passes over them.  Each shard gets three
// deferred reservations (main, exp_avg, exp_avg_sq): stable device addresses that are
// backed piece by piece, while a fixed window budget bounds the physical memory.
//
// Approach
//  - A piece is n elements of one shard, all three arrays; n is the largest multiple of
//    the granule (in floats) with depth * 12 * n <= window_bytes (less the room of the
//    small pieces, Note [Small pieces]).  The reservations are padded to a multiple of n,
//    so every piece maps the same chunk shapes (a small piece one granule per array):
//    after the first `depth` pieces the chunk pool (budget = window) serves every piece
//    of the pass from its cache; at the end of a pass the cache is trimmed, so that between steps
//    the state holds no HBM at all (3 * depth cuMemCreate per pass).
//  - Per piece, on three streams, one method of window_pipeline each: materialize ->
//    fetch (H2D from the piece's home, Note [Homes]; never-written moments are zeroed on
//    the device instead of copied) -> compute (the kernel) -> write_back (D2H) -> retire
//    (host waits for that piece's write-back event, then release; the home persists the
//    piece).  With depth 3, fetch(i+1), step(i) and write-back(i-1) overlap, and H2D and
//    D2H run at once (the link is duplex).
//  - File tier: its home reads `depth` pieces ahead into a ring of 2*depth pinned staging
//    buffers, writes drain from another ring; see Note [File tier] for the two slots
//    and the commit record that make a step atomic.
//  - The first `depth` pieces are materialized before any write-back, so running out of
//    memory at the start of a pass fails before any state changed.
//  - Failure: the pass drains every stream and I/O, releases its pieces and throws with
//    the shard, element offset (and file offset for I/O).  File tier: the previous step
//    is intact (the commit record still points to it) and the BF16 params are re-derived
//    from it.  Host/device tiers update in place: the pieces whose write-back was issued
//    are counted, and a step retried with the same gradients skips them.
//
// Limits: one pass at a time per optimizer (calls are serialized by a mutex); a shard
// larger than a granule but much smaller than a piece still maps a whole piece.
//
// Note [Small pieces]
// Rationale: models have many tiny shards (norm weights, biases: a GPTModel of 0.54 G
// params had about 90 of its 125 pieces under a megabyte).  Mapping, giving access to
// and unmapping three whole piece-sized chunks for a few kilobytes costs far more than
// moving them, and it is paid per piece.
// Approach: a piece of at most one granule of FP32 (small_piece_bytes, 2 MiB on H200)
// maps one granule per array instead (the pool's smallest class).  The full pieces are
// made smaller by 3 * depth granules of the window, so depth full pieces and depth small
// ones fit the budget (= the window) at once: every chunk shape the pass uses stays
// cached through the pass and none is ever trimmed to make room for another (the pool
// holds at most, per class, what depth pieces of each shape take), and the peak stays
// within the window.  A big range never takes small cached chunks unless they cover it
// whole (reservation_manager::acquire_pieces).  Off where that room would cost more
// than an eighth of the window (small windows: small_piece_bytes = 0).
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
                  float grad_scale, std::size_t skip)
      : I(owner), home_(*owner.tier_home), grads_(grads), gts_(gts), K(owner.cfg.depth) {
    plan_.kind = kind;
    plan_.pieces = I.pieces(grads);
    plan_.skip = skip;
    plan_.arrays = kind == pass::step ? 3 : 1;
    plan_.fetch_main = kind != pass::init;
    plan_.write_back = kind != pass::export_bf16;
    P = plan_.pieces.size();
    if (kind == pass::step)
      for (std::size_t s = 0; s < I.shards.size(); ++s) ks_.push_back(I.scalars(s, grad_scale));
    home_.begin_pass(plan_);
    for (std::size_t j = skip; j < P; ++j) params_ += plan_.pieces[j].n;
    mapped_.assign(P, false);
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
      // The first K pieces' memory before any write-back: OOM here changes nothing.
      for (std::size_t j = skip; j < std::min(P, skip + static_cast<std::size_t>(K)); ++j) materialize(j);
      for (; i_ < P; ++i_) {
        if (i_ >= skip + K) {
          retire(i_ - K);
          prefetch(i_ + K);
          materialize(i_);
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
    // against a pass of milliseconds).  keep_window keeps them for back-to-back passes.
    if (!I.cfg.keep_window) I.pool->trim();
  }

 private:
  const piece_ref& piece(std::size_t i) const { return plan_.pieces[i]; }
  // Piece i's slot of the event ring: 0 fetched, 1 computed, 2 written back.
  event_t ev(std::size_t i, int which) { return I.event(1 + (i % K) * 3 + which); }
  std::vector<range> ranges_of(const piece_ref& p) const {
    std::vector<range> rs;
    const std::size_t bytes = p.n * 4 <= I.small_piece_bytes ? I.small_piece_bytes : I.piece * 4;  // Note [Small pieces]
    for (state_array a : first_arrays(plan_.arrays)) rs.push_back({I.shards[p.shard].res[a], p.e0 * 4, bytes});
    return rs;
  }
  // The piece's window: its elements in each array's reservation.
  per_array<float*> window(const piece_ref& p) const {
    per_array<float*> dev;
    for (state_array a : k_state_arrays) dev[a] = I.shards[p.shard].device(a) + p.e0;
    return dev;
  }
  const char* phase() const { return plan_.kind == pass::init ? "init" : plan_.kind == pass::step ? "step" : "sync"; }

  void prefetch(std::size_t j) {
    if (j < P && j >= plan_.skip) home_.prefetch(j, piece(j));
  }

  void materialize(std::size_t i) {
    auto rs = ranges_of(piece(i));
    const auto t = clk::now();
    I.mgr->materialize(rs, fill_mode::undefined, I.h2d);
    I.report.map_seconds += since(t);
    mapped_[i] = true;
  }

  // H2D: main (all but init), the moments (step; zeros before they were ever written).
  void fetch(std::size_t i) {
    const auto& p = piece(i);
    const auto dev = window(p);
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
    const auto dev = window(p);
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
      if (I.cfg.moments != moment_format::fp32)  // (host tier only: the constructor checks)
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
    const auto dev = window(p);
    I.drv->stream_wait(I.d2h, ev(i, 1));
    if (plan_.write_back) {
      home_.await_write_back(i);
      for (state_array a : first_arrays(plan_.arrays))
        I.report.bytes_from_device += home_.from_device(i, p, a, dev[a], I.d2h);
    }
    I.drv->record(ev(i, 2), I.d2h);
    wb_issued_[i] = true;
  }

  // The window's chunks go back once the piece's write-back is done; its home persists it.
  void retire(std::size_t i) {
    const auto& p = piece(i);
    auto rs = ranges_of(p);
    const auto t = clk::now();
    I.mgr->release_after(rs, keep_mode::discard, ev(i, 2));  // this piece only, not later queued work
    I.report.retire_seconds += since(t);
    mapped_[i] = false;
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
    for (std::size_t j = 0; j < P; ++j)
      if (mapped_[j]) try {
          auto rs = ranges_of(piece(j));
          I.mgr->release(rs, keep_mode::discard, I.d2h);
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
  std::vector<bool> mapped_, wb_issued_;
};

void streamed_adamw::impl::run_pass(pass kind, std::span<const void* const> grads, std::span<const value_type> gts,
                                    float grad_scale, stream_t user, std::size_t skip) {
  window_pipeline(*this, kind, grads, gts, grad_scale, skip).run(user);
}

}  // namespace deferalloc::optim
