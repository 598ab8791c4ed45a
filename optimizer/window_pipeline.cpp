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
//  - A piece is n elements of one shard, all three arrays (an FP32 parameter is its own
//    main: its moments only, Note [The parameter is the truth]); n is at most the largest
//    multiple of the granule (in floats) with depth * 12 * n <= window_bytes, and about a
//    12th to 24th of the pass (Note [Pass pieces] below).  Piece i is moved and
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
// construction (class window, window.hpp) and backed at the start of a pass: 3 * depth chunks of one
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
#include <deferalloc/core/errors.hpp>

#include <algorithm>
#include <chrono>

#include "log.hpp"
#include "window_pipeline.hpp"

namespace deferalloc::optim {

namespace {
using clk = std::chrono::steady_clock;
double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }
constexpr std::size_t k_pass_pieces = 24;
constexpr std::size_t k_min_piece = std::size_t{1} << 20;  // elements (12 MiB of state)

// A slot's three events in the stream set's ring (its event 0 is stream_set::after's).
enum slot_stage : int { slot_fetched = 0, slot_computed = 1, slot_written = 2 };
event_t slot_event(stream_set& streams, std::size_t slot, int which) {
  return streams.event(1 + slot * 3 + static_cast<std::size_t>(which));
}
}  // namespace

// Note [Pass pieces]
// Rationale: a pass fills its pipeline (the first piece's fetch runs alone) and drains it
// (the last write-back runs alone), about two pieces' transfers.  A pass over the whole
// state has dozens of window-sized pieces and does not notice; a pass over one bucket
// of a BackwardOverlap (256 MiB of parameters, 2-3 pieces of a 1 GiB window) spent as
// long filling and draining as streaming: such passes ran at ~0.6x the link on the H200.
// Approach: a pass's pieces are the window's piece halved while they stay at least
// 1/k_pass_pieces of the pass's elements (so 12 to 24 pieces) and k_min_piece elements;
// the window's piece is a power of two of granules (file tier: of checksum blocks), so it
// halves down to one; the chunk pool's classes are those halvings, so a slot is still
// one chunk (one map) per array.  The
// arithmetic is elementwise and int8 blocks and the dither are indexed from the shard's
// start, so the results do not depend on the cut (tests check it bit for bit); a retry
// of a failed step selects the same shards, so it cuts the same pieces.
// Taper (pass_taper): the fill is the first piece's fetch alone and the drain the last
// piece's write-back alone, each a piece's transfer in one direction; Megatron's bucket
// passes (about 20 pieces each, ten an iteration) left about 1 ms of each pass so on an
// H100.  With the taper the pass's first piece is cut into n/4, n/4, n/2 and its last into
// n/2, n/4, n/4 (never below `align`; n the pass's piece), so both take a quarter as long
// while the pieces between keep their size (no more per-piece cost than two more pieces
// at each end).  The cut is on multiples of `align` from the shard's start, as every cut.
// Limits: more than 24 pieces a pass gave no further gain, and the full-state step is
// unchanged by the cut; the figures of each way of cutting are in docs/BENCHMARKS.md
// ("Pass pieces").  The taper is off by default until it is timed on a GPU.
namespace {
// [e0, e0 + n) of shard s cut at e0 + t, e0 + 2t, ... (sizes t, t, 2t, ...) while a cut
// leaves something after it; `small_last`: at end - t, end - 2t, ... rounded down to `align`
// from the shard's start instead (sizes ..., 2t, t at the end).
void cut_tapered(std::vector<piece_ref>& out, std::size_t s, std::size_t e0, std::size_t n, std::size_t t,
                 std::size_t align, bool small_last) {
  std::vector<std::size_t> cuts;  // offsets from e0, increasing
  for (std::size_t k = t; k < n; k *= 2) {
    const std::size_t at = small_last ? (n - k) / align * align : k;
    if (at > 0 && at < n) cuts.push_back(at);
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::size_t from = 0;
  for (std::size_t at : cuts) {
    out.push_back({s, e0 + from, at - from});
    from = at;
  }
  out.push_back({s, e0 + from, n - from});
}
}  // namespace

std::vector<piece_ref> cut_pieces(const shard_table& shards, const std::vector<bool>& selected,
                                  std::size_t window_piece, std::size_t align, bool taper) {
  std::size_t total = 0;
  for (std::size_t s = 0; s < shards.size(); ++s)
    if (selected[s]) total += shards.numel(s);
  // The window's piece halved while it stays at least `want` and whole granules: a slot
  // is then one chunk of the pool's classes (the piece's halvings), one map per array.
  const std::size_t want = std::max((total + k_pass_pieces - 1) / k_pass_pieces, k_min_piece);
  std::size_t n = window_piece;
  while (n / 2 >= want && (n / 2) % align == 0) n /= 2;
  std::vector<piece_ref> out;
  for (std::size_t s = 0; s < shards.size(); ++s)
    if (selected[s])
      for (std::size_t e0 = 0; e0 < shards.numel(s); e0 += n) out.push_back({s, e0, std::min(n, shards.numel(s) - e0)});
  const std::size_t t = std::max(n / 4, align);
  if (!taper || t >= n || out.empty()) return out;
  // The first piece cut from its start, the last from its end (one piece: the last of the
  // first's cuts).
  std::vector<piece_ref> tapered;
  cut_tapered(tapered, out.front().shard, out.front().e0, out.front().n, t, align, false);
  piece_ref end = out.back();
  if (out.size() == 1) {
    end = tapered.back();
    tapered.pop_back();
  } else {
    tapered.insert(tapered.end(), out.begin() + 1, out.end() - 1);
  }
  cut_tapered(tapered, end.shard, end.e0, end.n, t, align, true);
  return tapered;
}

window_pipeline::window_pipeline(const pipeline_parts& parts, pass_plan plan, step_inputs step)
    : parts_(parts), plan_(std::move(plan)), step_(std::move(step)) {
  for (std::size_t j = plan_.skip; j < pieces(); ++j) params_ += plan_.pieces[j].n;
  computed_ = issued_ = retired_ = plan_.skip;
  wb_bytes_.assign(pieces(), 0);
}

// Note [Chained passes]
// Rationale: a pass ends by waiting on the host for its last write-backs (the drain, a
// piece's D2H alone on the link), and the caller then prepares the next pass (Megatron's
// bucket passes across the next forward: its worker thread, about 1 ms of Python between
// two passes on an H100) while the link idles.  Ten or more such passes an iteration left
// 10-20 ms of each iteration's transfer unused.  On the host tier nothing but that wait
// happens when a piece retires (host_home::retire is empty): the host need not wait at all.
// Approach: a chained pass (pass_plan::chain: a step on a tier whose traits chain, with
// keep_window and pass_chain) returns once its last pieces are enqueued.  The window's ring
// (window::chain) keeps where it stopped: the next pass's pieces take the slots after it
// (the oldest pieces' slots first, most already written back), its H2D copies wait on the
// device for the previous pass's kernels (its last piece's computed event: not for the
// new pass's own gradients, so a pass queued before backward computed them fills the
// window meanwhile), or for its last write-back where the two passes share a shard (the
// fetch reads what that write-back writes: the forward's last bucket, stepped last in one
// iteration, is backward's first in the next), a fetch into a slot still being written
// back waits on the device for that write-back, and its kernels wait for the previous
// pass's last write-back: the new pass fills while the old one drains, and the host does
// not wait for the write-backs (a plain step with 16-bit parameters waits for the pass's
// kernels, to read the edit marks: Note [Edits of 16-bit parameters]; with
// writeback_queue_mb, for those over the bound: Note [The write-back queue]).  A speculative
// pass that keeps FP32 parameters' values (fetch), chained or not, copies them after the
// user's stream: an edit queued there before the step is what a discarded speculation
// must restore (unchained passes copied them without that wait).
// The kernels of a chained pass are done when the user's stream has waited for exec (what
// the BF16 params and the next forward need); its write-backs (the state at home) are
// waited for by the next pass that is not chained and by every entry of the optimizer that
// is not a step (impl::settle_passes: a checkpoint, a commit or discard of speculation, a
// state read, the destructor), so no caller sees a state still in flight.
// Inside a pass the host still waits for each piece's write-back before queuing the piece
// that reuses its slot: those waits bound what is queued on the copy engines, and any D2H
// copy of the user's (an .item() on the compute stream) queues behind every write-back
// already queued (a pass queued without them made Megatron's rows slower on an H100:
// docs/BENCHMARKS.md); writeback_queue_mb bounds that queue further (Note [The write-back
// queue]).
// Limits: off by default (pass_chain:1 turns it on).  The fetch ahead of the gradients
// (the computed event, the shared-shard rule) ran on a GPU (test_optimizer on the CUDA
// driver) and, timed once across Megatron's next forward with int8 moments, was level with
// unchained passes; the CPU tests check the bits and, through a driver keeping a clock per
// stream, what each fetch waits for (test_optimizer).  Until the
// step's read of the edit marks stopped queuing behind the write-backs (Note [Edits of 16-bit parameters]) the
// host still waited for each chained pass's drain: timed so inside Megatron's backward its
// gain or loss was within the iterations' spread; since, bench_overlap's batch 4 (the link
// the bottleneck) gained 4% on an H100 (docs/BENCHMARKS.md), and inside Megatron's
// backward across the next forward the FP32 moments gained 4% while BF16 and int8 stayed
// within the rounds' spread.
// Host tier only (the file tier persists a piece when it retires: its passes end as
// before).  A CUDA error of a chained tail is reported by the call that waits for it, one
// call later.  A pass's report (seconds, retire_seconds) ends when its last piece is
// enqueued, not written back.
namespace {
// The write-back event of the last piece the previous chained pass left in the ring (the
// slot before the ring's next one): every earlier write-back was issued before it.
event_t last_write_back(stream_set& streams, const window& slots) {
  const std::size_t depth = slots.depth();
  return slot_event(streams, (slots.chain.next + depth - 1) % depth, slot_written);
}

// The previous chained pass's last kernels (its last piece's slot).
event_t last_computed(stream_set& streams, const window& slots) {
  const std::size_t depth = slots.depth();
  return slot_event(streams, (slots.chain.next + depth - 1) % depth, slot_computed);
}

// The shards of pieces [skip, end), once per run of pieces (a shard's pieces are cut in a row).
std::vector<std::size_t> shards_of(const std::vector<piece_ref>& pieces, std::size_t skip) {
  std::vector<std::size_t> out;
  for (std::size_t j = skip; j < pieces.size(); ++j)
    if (out.empty() || out.back() != pieces[j].shard) out.push_back(pieces[j].shard);
  return out;
}
}  // namespace

void settle_chain(stream_ops& ops, stream_set& streams, window& slots) {
  if (slots.chain.unwaited == 0) return;
  slots.chain.unwaited = 0;
  ops.synchronize(last_write_back(streams, slots));
}

void window_pipeline::run(stream_t user, step_report& report) {
  const auto t0 = clk::now();
  const std::size_t skip = plan_.skip, depth = plan_.depth;
  report_ = &report;
  report = step_report{};
  progress_.emplace(parts_.cfg, phase(), params_);
  parts_.pool.reset_peak();
  window::ring& ring = parts_.slots.chain;
  try {
    if (!plan_.chain) settle_chain(parts_.ops, parts_.streams, parts_.slots);
  } catch (...) {
    fail();
  }
  // Note [Chained passes]: the slots after the previous pass's, ordered on the device.
  inherited_ = ring.unwaited;
  inherited_bytes_ = inherited_ > 0 ? ring.queued_bytes : 0;
  inherited_queued_ = inherited_ > 0 ? ring.queued : 0;
  base_ = inherited_ > 0 ? ring.next : 0;
  const std::vector<std::size_t> shards = shards_of(plan_.pieces, skip);
  if (inherited_ > 0) {
    const bool shared = std::ranges::find_first_of(ring.shards, shards) != ring.shards.end();
    parts_.ops.stream_wait(parts_.streams.h2d(), shared ? last_write_back(parts_.streams, parts_.slots)
                                                        : last_computed(parts_.streams, parts_.slots));
    parts_.ops.stream_wait(parts_.streams.exec(), last_write_back(parts_.streams, parts_.slots));
  }
  if (keeps_params()) parts_.streams.after(parts_.streams.h2d(), user);
  parts_.mover.begin_pass(plan_, report);
  // The kernels read what the user's stream produced (gradients, BF16 params).
  parts_.streams.after(parts_.streams.exec(), user);
  current_ = computed_ = issued_ = retired_ = skip;
  try {
    for (std::size_t j = skip; j < std::min(pieces(), skip + 2 * depth); ++j) prefetch(j);
    // The window's memory before any piece moves: OOM here changes nothing.
    back_slots();
    for (; current_ < pieces(); ++current_) {
      const std::size_t i = current_;
      if (i >= skip + depth) {
        // The slot's previous piece: its write-back issued (fetch waits for its event) and
        // waited for on the host.
        issue_write_backs(i - depth + 1, true);
        issue_write_backs(computed_, false);  // what the bound allows before the host waits
        while (retired_ <= i - depth) retire_next();
        prefetch(i + depth);
      }
      fetch(i);
      compute(i);
      computed_ = i + 1;
      issue_write_backs(computed_, false);  // Note [The write-back queue]
    }
    issue_write_backs(pieces(), true);
    if (plan_.chain) {  // Note [Chained passes]: the next pass or entry waits for the tail
      for (std::size_t j = retired_; j < pieces(); ++j) done_params_ += piece(j).n;
      progress_->report(done_params_);
      const std::size_t n = pieces() - skip;
      // (This pass's kernels waited for the previous pass's last write-back: the next pass
      // shares a write-back in flight only with this one, unless this one had no piece.)
      ring = {(base_ + n) % depth, std::min(depth, n + (n < depth ? inherited_ : 0)),
              n > 0 ? shards : std::move(ring.shards), issued_ - retired_ + inherited_queued_,
              queued_bytes_ + inherited_bytes_};
    } else {
      while (retired_ < pieces()) retire_next();
      ring = {};
    }
    parts_.mover.end_pass();
  } catch (...) {
    fail();
  }
  report.seconds = since(t0);
  report.params = params_;
  report.pieces = pieces() - skip;
  report.peak_backed_bytes = parts_.pool.stats().peak_alive_bytes;
  // Between passes the state holds no HBM: the window's chunks go back to the driver
  // (3 * depth cuMemRelease here and as many cuMemCreate in the next pass, microseconds
  // against a pass of milliseconds).  keep_window keeps the slots backed for
  // back-to-back passes (Note [Window slots]).
  if (!parts_.cfg.keep_window) {
    release_slots(parts_.streams.d2h());
    parts_.pool.trim();
  }
}

// (Write-backs are issued in order, and issued_ counts one only once its event is recorded.)
std::size_t window_pipeline::written() const { return issued_; }

// Piece i's slot of the window: after the previous pass's when it chained (Note [Chained
// passes]), else from slot 0.
std::size_t window_pipeline::slot_index(std::size_t i) const { return (base_ + i - plan_.skip) % plan_.depth; }

// Piece i's slot's event `which` (slot_stage).
event_t window_pipeline::event(std::size_t i, int which) { return slot_event(parts_.streams, slot_index(i), which); }

// Piece i's slot of the window (Note [Window slots]): its arrays' device addresses.
const per_array<float*>& window_pipeline::slot_of(std::size_t i) const { return parts_.slots.slot(slot_index(i)); }

const char* window_pipeline::phase() const {
  return plan_.kind == pass_kind::init ? "init" : plan_.kind == pass_kind::step ? "step" : "sync";
}

void window_pipeline::prefetch(std::size_t j) {
  if (j < pieces() && j >= plan_.skip) parts_.mover.prefetch(j, piece(j));
}

// Backs the slots the pass uses, for the arrays it moves and its largest piece (a pass
// over tiny shards backs a granule per array, not a piece), where not backed yet.
void window_pipeline::back_slots() {
  std::size_t longest = 0;
  for (std::size_t j = plan_.skip; j < pieces(); ++j) longest = std::max(longest, piece(j).n);
  const std::size_t g = parts_.pool.granularity();
  const std::size_t need = (longest * 4 + g - 1) / g * g;
  const auto t = clk::now();
  // (A pass after a chained one starts at any slot: it backs them all.)
  const std::size_t count = base_ == 0 ? std::min(pieces() - plan_.skip, plan_.depth) : plan_.depth;
  if (parts_.slots.back(count, first_arrays(plan_.arrays), need,
                        parts_.streams.h2d()))
    report_->map_seconds += since(t);
}

// Whether fetch() copies a parameter's values out before the step (a speculative step's
// FP32 parameters, Note [Speculative steps] in speculation.cpp).
bool window_pipeline::keeps_params() const {
  for (std::size_t j = plan_.skip; j < pieces(); ++j)
    if (steps_param(piece(j)) && kept(piece(j))) return true;
  return false;
}

// Where a speculative step keeps piece p's FP32 parameter's values (its shard's), or null.
float* window_pipeline::kept(const piece_ref& p) const {
  float* keep = p.shard < step_.saved_params.size() ? step_.saved_params[p.shard] : nullptr;
  return keep && step_.grads[p.shard] != nullptr ? keep : nullptr;
}

// Gives the window's chunks back to the pool (after the work on `s`).
void window_pipeline::release_slots(stream_t s) { parts_.slots.release(s); }

// Whether piece p's step reads and writes its FP32 parameter as main (Note [The
// parameter is the truth] in streamed_adamw.cpp).
bool window_pipeline::steps_param(const piece_ref& p) const {
  return plan_.kind == pass_kind::step && param_is_main(parts_.shards[p.shard].info);
}

// Piece p's model parameter on the device.
char* window_pipeline::model_of(const piece_ref& p) const {
  const auto& sh = parts_.shards[p.shard].info;
  return static_cast<char*>(sh.param) + p.e0 * detail::value_bytes(sh.param_type);
}

// H2D: main (all but init; not of an FP32 parameter in a step), the moments (step; zeros
// before they were ever written).  A speculative step keeps the FP32 parameter's values first.
void window_pipeline::fetch(std::size_t i) {
  const auto& p = piece(i);
  const auto& dev = slot_of(i);
  auto& ops = parts_.ops;
  const stream_t h2d = parts_.streams.h2d();
  // The slot's previous piece is written back (retire() waited for it on the host; the
  // wait keeps the order on the device too); of a chained previous pass's, on the device
  // only (Note [Chained passes]).
  const std::size_t j = i - plan_.skip;
  if (j >= plan_.depth || j + inherited_ >= plan_.depth) ops.stream_wait(h2d, event(i, slot_written));
  if (steps_param(p)) {
    if (float* keep = kept(p)) {
      ops.copy_async(keep + p.e0, model_of(p), p.n * 4, h2d);
      report_->bytes_from_device += p.n * 4;
    }
  } else if (plan_.fetch_main) {
    report_->bytes_to_device += parts_.mover.to_device(i, p, state_array::main, dev[state_array::main], h2d);
  }
  fetched_ = i + 1;
  if (plan_.kind == pass_kind::step)
    for (state_array a : {state_array::exp_avg, state_array::exp_avg_sq}) {
      if (plan_.moments_stored) report_->bytes_to_device += parts_.mover.to_device(i, p, a, dev[a], h2d);
      else ops.zero_async(dev[a], p.n * 4, h2d);  // never written: zero by construction
    }
  ops.record(event(i, slot_fetched), h2d);
}

void window_pipeline::compute(std::size_t i) {
  const auto& p = piece(i);
  const auto& sh = parts_.shards[p.shard].info;
  const auto& dev = slot_of(i);
  const stream_t exec = parts_.streams.exec();
  auto& comp = parts_.comp;
  parts_.ops.stream_wait(exec, event(i, slot_fetched));
  char* model = model_of(p);
  // An FP32 parameter is its own main: the kernel reads and writes it in place.
  float* main = steps_param(p) ? reinterpret_cast<float*>(model) : dev[state_array::main];
  if (plan_.kind == pass_kind::init) {
    comp.upcast(model, sh.param_type, dev[state_array::main], p.n, exec);
  } else if (plan_.kind == pass_kind::export_bf16) {
    comp.downcast(dev[state_array::main], model, sh.param_type, p.n, exec);
  } else if (step_.grads[p.shard] != nullptr) {  // (file tier: a skipped shard's piece is carried over unchanged)
    const value_type gt = step_.grad_types[p.shard];
    const char* grad = static_cast<const char*>(step_.grads[p.shard]) + p.e0 * detail::value_bytes(gt);
    // A 16-bit parameter edited outside the optimizer is taken into main first.
    if (p.shard < step_.edit_checks.size() && step_.edit_checks[p.shard])
      comp.adopt_if_edited(p.shard, model, sh.param_type, main, p.n, exec);
    const moment_format moments = parts_.cfg.moments;
    if (moments != moment_format::fp32)  // (host and file tiers: the optimizer checks)
      comp.adamw_moments({main, dev[state_array::exp_avg], dev[state_array::exp_avg_sq], model, grad, sh.param_type, gt,
                          moments, p.n, p.e0},
                         step_.scalars[p.shard], exec);
    else
      comp.adamw({main, dev[state_array::exp_avg], dev[state_array::exp_avg_sq], model, grad, sh.param_type, gt, p.n},
                 step_.scalars[p.shard], exec);
  }
  parts_.ops.record(event(i, slot_computed), exec);
}

// D2H of the arrays the pass changed (none for an export).
void window_pipeline::write_back(std::size_t i) {
  const auto& p = piece(i);
  const auto& dev = slot_of(i);
  const stream_t d2h = parts_.streams.d2h();
  parts_.ops.stream_wait(d2h, event(i, slot_computed));
  std::size_t bytes = 0;
  if (plan_.write_back)
    for (state_array a : first_arrays(plan_.arrays)) {
      float* from = dev[a];
      if (a == state_array::main && steps_param(p)) {
        if (!plan_.durable_params) continue;  // the parameter is the state
        from = reinterpret_cast<float*>(model_of(p));  // the durable copy
      }
      bytes += parts_.mover.from_device(i, p, a, from, d2h);
      partly_written_ = i;  // (until the event is recorded: a failure leaves it part-way)
    }
  parts_.ops.record(event(i, slot_written), d2h);
  partly_written_ = k_none;
  report_->bytes_from_device += bytes;
  wb_bytes_[i] = bytes;
  queued_bytes_ += bytes;
}

// Note [The write-back queue]
// Rationale: a D2H copy of the user's (an .item() on the compute stream: Megatron's grad norm
// and loss) queues on the copy engine behind every write-back already queued there
// (Note [Chained passes]).  A pass issued each piece's write-back as soon as its kernels were
// queued, so up to `depth` pieces' write-backs stood ahead of such a read (8 on the host tier:
// in bench_megatron's 0.54 G model, whose 512 MiB window cuts pieces of 4 M elements, 194 MiB
// with int8 moments and 384 MiB with FP32, 4-9 ms of an H100's link; chained passes add the next
// pass's), and a training thread that reads the norm while the step runs across the next
// forward waits for them at each read (docs/BENCHMARKS.md, "Where an iteration across the next
// forward goes").  The fetches need no
// such bound: a user's D2H copy does not queue behind H2D copies.
// Approach: writeback_queue_mb bounds the write-back bytes issued and not yet waited for on the
// host.  A stepped piece's write-back is issued when the bytes queued are under the bound or
// fewer than two pieces are queued (so at most the bound plus one piece's, or two pieces', are
// queued: with one, the link would idle each time the host wakes to queue the next); until then
// it waits in its slot, and the pass issues it once the host has waited for older ones: where a
// slot is needed for the next fetch (whose H2D copy waits for its slot's write-back event, so
// that write-back is issued first), and at the pass's end, so that a chained pass returns with
// at most the bound (plus a piece, or two pieces) in flight.  Waiting for the oldest write-back is the wait the pass made
// anyway before reusing a slot, made earlier.  0 (the default) is no bound: each write-back is
// issued right after its kernels, as before.
// A failed plain step on a home that updates in place (host tier: pass_plan::resumable) issues
// the write-backs of the pieces it stepped and had not issued, as it drains, so that written()
// counts every stepped piece and the retry, which skips those, never steps a piece twice (the
// file tier's failed step is discarded whole: Note [File tier]).  Where one of them cannot be
// issued either (a copy that fails again), and the piece cannot be redone from home (an FP32
// parameter, stepped in place, or a write-back that copied some of its arrays), the pass is
// torn: the retry is refused (write the state or load a checkpoint) rather than run.
// Limits: off by default: timed across Megatron's next forward it gained nothing
// (docs/BENCHMARKS.md: with the grad norm on the device the reads wait about 12 ms an
// iteration, and the iteration's excess is the link idling through the forward).  It shortens
// only the copy engine's part of a read's wait, not the compute stream's own waits (for the
// bucket steps).  The bound trades the host's wake-ups (one a piece, as before) against a D2H
// direction that idles if the host wakes later than the queued bytes take to drain (one piece at
// least stays queued meanwhile).  A
// chained pass returns only once its last write-backs fit the bound, later than without one, so
// the next pass starts its fetches later (bench_megatron's fwdchq rows).
void window_pipeline::issue_write_backs(std::size_t end, bool wait) {
  const std::size_t bound = parts_.cfg.writeback_queue_bytes;
  for (; issued_ < std::min(end, computed_); ++issued_) {
    while (bound != 0 && issued_ - retired_ + inherited_queued_ >= 2 && queued_bytes_ + inherited_bytes_ >= bound) {
      if (!wait) return;
      if (retired_ < issued_) {
        retire_next();
      } else {
        // Only a chained previous pass's are queued (this pass issued none yet, so its
        // last slot's event is still that pass's last write-back).
        const auto t = clk::now();
        parts_.ops.synchronize(last_write_back(parts_.streams, parts_.slots));
        report_->retire_seconds += since(t);
        inherited_bytes_ = inherited_queued_ = 0;
      }
    }
    write_back(issued_);
  }
}

// The oldest issued write-back is done (its slot is free again); its home persists it.
void window_pipeline::retire_next() {
  const std::size_t i = retired_;
  const auto& p = piece(i);
  const auto t = clk::now();
  parts_.ops.synchronize(event(i, slot_written));
  report_->retire_seconds += since(t);
  parts_.mover.retire(i, p);
  ++retired_;
  queued_bytes_ -= wb_bytes_[i];
  inherited_bytes_ = inherited_queued_ = 0;  // (issued before this pass's: done before it)
  done_params_ += p.n;
  progress_->report(done_params_);
}

// Drain: every stream and every I/O request, then give the window back; rethrows.
void window_pipeline::fail() {
  parts_.slots.chain = {};  // (the streams' synchronisation below covers a chained tail)
  try {  // Note [The write-back queue]: the stepped pieces' state reaches its home
    if (plan_.resumable)
      for (; issued_ < computed_; ++issued_) write_back(issued_);
  } catch (...) {
    deferalloc::detail::log_current("streamed_adamw: writing back the pieces a failed pass stepped");
  }
  try {
    parts_.streams.synchronize();
  } catch (...) {
    deferalloc::detail::log_current("streamed_adamw: draining the streams after a failed pass");
  }
  parts_.mover.drain();
  try {
    release_slots(parts_.streams.d2h());
  } catch (...) {
    deferalloc::detail::log_current("streamed_adamw: releasing the window after a failed pass");
  }
  parts_.pool.trim();
  // A stepped piece whose state the retry cannot redo from home: an FP32 parameter stepped
  // in place, or a write-back that copied some arrays (a 16-bit parameter's piece none of
  // whose arrays reached home is redone exactly from its main).
  if (plan_.resumable)
    for (std::size_t j = issued_; j < computed_ && torn_.empty(); ++j)
      if (steps_param(piece(j)) || j == partly_written_) torn_ = parts_.shards.where(piece(j));
  const std::string at = current_ < pieces() ? " at " + parts_.shards.where(piece(current_)) : "";
  // The same class as the cause (no_device stays no_device), the cause nested in it.
  rethrow_with_context(std::string(plan_.kind == pass_kind::init   ? "initialize"
                                   : plan_.kind == pass_kind::step ? "step"
                                                                   : "sync") +
                       " failed" + at);
}

}  // namespace deferalloc::optim
