// The streamed optimizer's construction, queries, initialize / step / sync and state
// ranges.  The pass is window_pipeline.cpp, the tiers home.cpp (Note [Homes]).
#include <deferalloc/errors.hpp>
#include <deferalloc/optimizer.hpp>
#include <deferalloc/reservations.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>

#include <unistd.h>

#include "log.hpp"
#include "kernels/compute.hpp"
#include "store/file_store.hpp"
#include "store/file_util.hpp"
#include "optimizer_impl.hpp"

namespace deferalloc::optim {

const char* to_string(value_type t) noexcept {
  switch (t) {
    case value_type::bf16: return "bf16";
    case value_type::fp32: return "fp32";
    case value_type::fp16: return "fp16";
  }
  return "unknown";
}

void validate(const adamw_params& p) {
  auto bad = [](const char* what, double v, const char* rule) {
    throw invalid_argument(std::string("adamw: invalid ") + what + " " + std::to_string(v) + " (" + rule + ")");
  };
  if (!std::isfinite(p.lr) || p.lr < 0) bad("learning rate", p.lr, "must be finite and >= 0");
  if (!(p.beta1 >= 0 && p.beta1 < 1)) bad("beta1", p.beta1, "must be in [0, 1)");
  if (!(p.beta2 >= 0 && p.beta2 < 1)) bad("beta2", p.beta2, "must be in [0, 1)");
  if (!std::isfinite(p.eps) || p.eps < 0) bad("eps", p.eps, "must be finite and >= 0");
  if (!std::isfinite(p.weight_decay) || p.weight_decay < 0) bad("weight_decay", p.weight_decay, "must be finite and >= 0");
}

const char* to_string(moment_format f) noexcept {
  switch (f) {
    case moment_format::fp32: return "fp32";
    case moment_format::bf16: return "bf16";
    case moment_format::int8: return "int8";
  }
  return "unknown";
}

moment_format parse_moment_format(const std::string& s) {
  if (s == "fp32") return moment_format::fp32;
  if (s == "bf16") return moment_format::bf16;
  if (s == "int8") return moment_format::int8;
  throw invalid_argument("unknown moment format '" + s + "' (fp32, bf16 or int8)");
}

using clk = std::chrono::steady_clock;
using detail::adamw_scalars;
using detail::file_store;

namespace {
double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }
// What a call that would change a speculated shard's state is refused for.
const std::string k_pending = "a pending speculative step (commit_speculation or discard_speculation first)";
}  // namespace

// ---- construction -------------------------------------------------------------------

streamed_adamw::streamed_adamw(std::shared_ptr<driver> drv, optimizer_config cfg) : impl_(std::make_unique<impl>()) {
  auto& I = *impl_;
  DFA_EXPECTS(drv != nullptr, "streamed_adamw: driver is null");
  DFA_EXPECTS(cfg.depth >= 0, "streamed_adamw: depth must be at least 1 (0: the tier's default)");
  validate(cfg.adamw);
  I.drv = std::move(drv);
  I.cfg = std::move(cfg);
  I.make_homes();  // checks that the configuration fits the tier
  const std::size_t g = I.drv->granularity();
  if (I.tier_home->streamed()) {
    // File tier: pieces are whole checksum blocks (see Note [File tier integrity]).
    I.piece_align = std::max(g, I.tier_home->piece_align()) / 4;
    // depth 0: the tier's depth, or as many slots of one aligned unit as the window holds
    // if fewer (Note [Window slots]).
    if (I.cfg.depth == 0)
      I.cfg.depth = static_cast<int>(std::clamp<std::size_t>(I.cfg.window_bytes / (12 * I.piece_align), 1,
                                                              static_cast<std::size_t>(I.tier_home->default_depth())));
    // The window's piece: a power-of-two number of aligned units, the most that depth
    // slots of three arrays fit in the window, so that it halves down to one unit (Note
    // [Pass pieces]).
    const std::size_t units = I.cfg.window_bytes / (12 * static_cast<std::size_t>(I.cfg.depth)) / I.piece_align;
    // int8 on the file tier: Note [File tier moments] in store/file_store.cpp.
    const bool int8_file = I.cfg.moments == moment_format::int8 && I.cfg.home == tier::file;
    DFA_EXPECTS(units > 0, "streamed_adamw: window_bytes " + std::to_string(I.cfg.window_bytes) + " is too small: depth " +
                               std::to_string(I.cfg.depth) + " needs at least " +
                               std::to_string(12 * I.cfg.depth * I.piece_align) + " bytes" +
                               (int8_file ? " (int8 moments on the file tier move pieces of 2^20 elements, whole "
                                            "segments of the state file, so each slot of depth needs 12 MiB)"
                                          : ""));
    I.piece = std::bit_floor(units) * I.piece_align;  // params
    // One chunk per array per slot (Note [Window slots]).  Budget: the window and the
    // resident shards (Note [Resident shards]); the cache holds the window's chunks only
    // (resident chunks stay taken).
    // Chunk classes: the piece and its halvings down to the granule (a pass's pieces,
    // Note [Pass pieces]).
    std::vector<std::size_t> classes{I.piece * 4};
    while (classes.back() / 2 >= g && (classes.back() / 2) % g == 0) classes.push_back(classes.back() / 2);
    I.pool = std::make_shared<chunk_pool>(
        I.drv, chunk_pool_config{classes, I.cfg.window_bytes + I.cfg.resident_bytes, I.cfg.window_bytes});
  } else {
    I.pool = std::make_shared<chunk_pool>(I.drv);
  }
  I.mgr = std::make_unique<reservation_manager>(I.pool);
  if (I.tier_home->streamed()) {
    I.slots.resize(static_cast<std::size_t>(I.cfg.depth));
    for (auto& sl : I.slots)
      for (state_array a : k_state_arrays) {
        sl.res[a] = I.mgr->reserve(I.piece * 4);
        sl.dev[a] = static_cast<float*>(I.mgr->address(sl.res[a]));
      }
  }
  I.comp = detail::make_compute(*I.drv);
  I.h2d = I.drv->create_stream();
  I.d2h = I.drv->create_stream();
  // The kernels' stream ahead of the model's (a step overlapped with backward: Note
  // [Overlap with backward] in python/deferalloc/overlap.py).
  I.exec = I.drv->create_priority_stream();
}

streamed_adamw::~streamed_adamw() {
  if (!impl_) return;
  auto& I = *impl_;
  try {
    // An open state write is published (implicit) or dropped (explicit, as the header says).
    if (I.writing) I.close_write(I.implicit_write);
  } catch (const std::exception& e) {
    deferalloc::detail::log(log_level::error, std::string("streamed_adamw: state write not published: ") + e.what());
  }
  try {
    I.drv->synchronize_stream(I.h2d);
    I.drv->synchronize_stream(I.exec);
    I.drv->synchronize_stream(I.d2h);
  } catch (const std::exception& e) {
    deferalloc::detail::log(log_level::error, std::string("streamed_adamw: ") + e.what());
  }
  I.tier_home.reset();  // pinned homes, staging buffers
  I.hbm_home.reset();
  for (event_t e : I.events) I.drv->destroy_event(e);
  I.file.reset();
  I.mgr.reset();
  I.drv->destroy_stream(I.h2d);
  I.drv->destroy_stream(I.d2h);
  I.drv->destroy_stream(I.exec);
}

std::size_t streamed_adamw::add_shard(std::uint16_t* param_bf16, std::size_t numel, std::string name) {
  return add_shard(param_bf16, numel, value_type::bf16, 0, std::move(name));
}

std::size_t streamed_adamw::add_shard(void* param, std::size_t numel, value_type t, int group, std::string name) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  DFA_EXPECTS(!I.initialized, "add_shard: shards must be registered before initialize()", invalid_state);
  DFA_EXPECTS(param != nullptr, "add_shard: the parameter pointer is null");
  DFA_EXPECTS(numel > 0, "add_shard: numel is zero");
  DFA_EXPECTS(numel <= (std::size_t{1} << 40), "add_shard: numel " + std::to_string(numel) + " is absurd");
  DFA_EXPECTS(t == value_type::bf16 || t == value_type::fp16 || t == value_type::fp32,
              "add_shard: unknown parameter type " + std::to_string(static_cast<int>(t)));
  DFA_EXPECTS(group >= 0, "add_shard: group " + std::to_string(group) + " is negative");
  impl::shard s;
  s.info.name = name.empty() ? "shard" + std::to_string(I.shards.size()) : std::move(name);
  s.info.numel = numel;
  s.info.param = param;
  s.info.param_type = t;
  s.info.param_bf16 = t == value_type::bf16 ? static_cast<std::uint16_t*>(param) : nullptr;
  s.info.group = group;
  // Streamed shards are stepped in the window's slots (Note [Window slots]); their
  // reservations are backed only for a user, or as resident shards.
  const std::size_t bytes = numel * 4;
  std::size_t made = 0;
  try {
    for (; made < 3; ++made) s.res[k_state_arrays[made]] = I.mgr->reserve(bytes);
    I.tier_home->add_shard(s);
  } catch (...) {
    for (std::size_t a = 0; a < made; ++a) I.mgr->free(s.res[k_state_arrays[a]]);
    throw;
  }
  s.info.main_param = static_cast<float*>(I.mgr->address(s.res[state_array::main]));
  s.info.exp_avg = static_cast<float*>(I.mgr->address(s.res[state_array::exp_avg]));
  s.info.exp_avg_sq = static_cast<float*>(I.mgr->address(s.res[state_array::exp_avg_sq]));
  I.shards.push_back(std::move(s));
  I.infos.push_back(I.shards.back().info);
  return I.shards.size() - 1;
}

// ---- queries ------------------------------------------------------------------------

std::uint64_t streamed_adamw::steps() const { return impl_->step_count; }
bool streamed_adamw::initialized() const { return impl_->initialized; }
bool streamed_adamw::resumed() const {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  if (!I.shards.empty()) I.open_state();  // opens the state file: a damaged one throws here
  return I.file && I.file->resumed();
}
const std::vector<shard_info>& streamed_adamw::shards() const { return impl_->infos; }
const optimizer_config& streamed_adamw::config() const { return impl_->cfg; }
void streamed_adamw::set_hyper(const adamw_params& p) {
  validate(p);
  std::lock_guard lk(impl_->mu);
  impl_->cfg.adamw = p;
  for (auto& [g, h] : impl_->groups) h = p;
}
void streamed_adamw::set_group(int g, const adamw_params& p) {
  DFA_EXPECTS(g >= 0, "set_group: group " + std::to_string(g) + " is negative");
  validate(p);
  std::lock_guard lk(impl_->mu);
  impl_->groups[g] = p;
}
adamw_params streamed_adamw::group(int g) const {
  std::lock_guard lk(impl_->mu);
  auto it = impl_->groups.find(g);
  return it == impl_->groups.end() ? impl_->cfg.adamw : it->second;
}
std::uint64_t streamed_adamw::shard_step(std::size_t s) const {
  std::lock_guard lk(impl_->mu);
  DFA_EXPECTS(s < impl_->shards.size(), "shard_step: no shard " + std::to_string(s));
  return impl_->shards[s].step;
}
void streamed_adamw::set_shard_step(std::size_t s, std::uint64_t step) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  DFA_EXPECTS(s < I.shards.size(), "set_shard_step: no shard " + std::to_string(s));
  // A resumed file's counts are read first (else the resume would overwrite this one);
  // before any state the count would be reset by initialize(): refused, before a fresh
  // file tier creates its state file.
  const std::string no_state = "set_shard_step: no state yet (initialize() first, or a resumed state file)";
  DFA_EXPECTS(I.initialized || I.cfg.resume, no_state, invalid_state);
  I.open_state();
  DFA_EXPECTS(I.initialized, no_state, invalid_state);
  I.refuse_if_speculating("set_shard_step");
  // The file tier publishes it with the state write under way, or with one of its own
  // (Note [State writes] in home.cpp); the others keep it in memory.
  if (!I.writing && !I.tier_home->in_place()) I.open_write(true);
  I.shards[s].step = step;
}

void streamed_adamw::set_shard_param(std::size_t s, void* param) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  DFA_EXPECTS(s < I.shards.size(), "set_shard_param: no shard " + std::to_string(s));
  DFA_EXPECTS(param != nullptr, "set_shard_param: the parameter pointer is null");
  I.refuse_if_speculating("set_shard_param");
  // Both copies of the pointer, and nothing else: infos[s] also carries what place_resident set.
  auto* bf16 = I.shards[s].info.param_type == value_type::bf16 ? static_cast<std::uint16_t*>(param) : nullptr;
  for (shard_info* info : {&I.shards[s].info, &I.infos[s]}) {
    info->param = param;
    info->param_bf16 = bf16;
  }
}

std::vector<std::uint64_t> streamed_adamw::impl::shard_steps() const {
  std::vector<std::uint64_t> v;
  v.reserve(shards.size());
  for (const auto& s : shards) v.push_back(s.step);
  return v;
}

void streamed_adamw::impl::open_write(bool implicit) {
  tier_home->begin_write();
  writing = true;
  implicit_write = implicit;
  moments_before_write = moments_written;
  steps_before_write = shard_steps();
}

void streamed_adamw::impl::close_write(bool publish) {
  if (!writing) return;
  writing = false;
  // A write not published leaves the file tier's committed state, and so its counts;
  // the in-place tiers keep what was written.
  auto keep_old = [&] {
    if (tier_home->in_place()) return;
    moments_written = moments_before_write;
    for (std::size_t s = 0; s < shards.size(); ++s) shards[s].step = steps_before_write[s];
  };
  try {
    tier_home->end_write(publish);
  } catch (...) {
    keep_old();
    throw;
  }
  if (!publish) keep_old();
}

void streamed_adamw::impl::settle_writes(const char* fn) {
  if (!writing) return;
  DFA_EXPECTS(implicit_write, std::string(fn) + ": a state write is open (end_state_write first)", invalid_state);
  close_write(true);
}

void streamed_adamw::begin_state_write() {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  I.open_state();
  DFA_EXPECTS(I.initialized, "begin_state_write: no state yet (initialize() first)", invalid_state);
  I.settle_writes("begin_state_write");
  I.refuse_if_speculating("begin_state_write");
  I.open_write(false);
}

void streamed_adamw::end_state_write(bool publish) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  if (!I.writing || I.implicit_write) return;
  I.close_write(publish);
}

std::size_t streamed_adamw::piece_elements() const { return impl_->piece; }
step_report streamed_adamw::last_report() const { return impl_->report; }
reservation_manager& streamed_adamw::reservations() { return *impl_->mgr; }

// ---- the pipeline -------------------------------------------------------------------

void streamed_adamw::impl::open_state() { tier_home->open(); }

event_t streamed_adamw::impl::event(std::size_t i) {
  while (events.size() <= i) events.push_back(drv->create_event());
  return events[i];
}

void streamed_adamw::impl::after(stream_t waiter, stream_t producer) {
  event_t e = event(0);
  drv->record(e, producer);
  drv->stream_wait(waiter, e);
}

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
// Limits: more than 24 pieces a pass gave no further gain, and the full-state step is
// unchanged by the cut; the figures of each way of cutting are in docs/BENCHMARKS.md
// ("Pass pieces").
namespace {
constexpr std::size_t k_pass_pieces = 24;
constexpr std::size_t k_min_piece = std::size_t{1} << 20;  // elements (12 MiB of state)
}  // namespace

std::vector<streamed_adamw::impl::piece_ref> streamed_adamw::impl::pieces(std::span<const void* const> grads,
                                                                          bool speculative) const {
  // A step that writes a new copy of the state (file tier) carries the shards it does not
  // step into it; a speculative one leaves that to commit_speculation, which carries those
  // not stepped speculatively (Note [Speculative steps]).
  auto selected = [&](std::size_t s) {
    if (shards[s].resident) return false;
    if (grads.empty() || grads[s] != nullptr) return true;
    return !tier_home->in_place() && !speculative && !shards[s].speculative;
  };
  std::size_t total = 0;
  for (std::size_t s = 0; s < shards.size(); ++s)
    if (selected(s)) total += shards[s].info.numel;
  // The window's piece halved while it stays at least `want` and whole granules: a slot
  // is then one chunk of the pool's classes (the piece's halvings), one map per array.
  const std::size_t want = std::max((total + k_pass_pieces - 1) / k_pass_pieces, k_min_piece);
  std::size_t n = piece;
  while (n / 2 >= want && (n / 2) % piece_align == 0) n /= 2;
  std::vector<piece_ref> out;
  for (std::size_t s = 0; s < shards.size(); ++s)
    if (selected(s))
      for (std::size_t e0 = 0; e0 < shards[s].info.numel; e0 += n)
        out.push_back({s, e0, std::min(n, shards[s].info.numel - e0)});
  return out;
}

adamw_scalars streamed_adamw::impl::scalars(std::size_t s, float grad_scale) const {
  auto it = groups.find(shards[s].info.group);
  const adamw_params& h = it == groups.end() ? cfg.adamw : it->second;
  auto k = detail::make_scalars(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, shards[s].step + 1, grad_scale,
                                [this](float base, float e) { return comp->pow(base, e); });
  k.seed = detail::step_seed(shards[s].step + 1, s);
  return k;
}

std::string streamed_adamw::impl::where(const piece_ref& p) const {
  return "shard " + std::to_string(p.shard) + " ('" + shards[p.shard].info.name + "') elements [" + std::to_string(p.e0) +
         ", " + std::to_string(p.e0 + p.n) + ")";
}

// On a terminal one line rewritten in place ('\r', twice a second); in a log (stderr not
// a terminal) whole lines: the first after a second, then one every 10 s, and the last.
// Used by initialize(), step(), sync and checkpoint save/load (checkpoint.cpp).
void streamed_adamw::impl::report_progress(const char* phase, std::size_t done, std::size_t total, clk::time_point t0,
                                           clk::time_point& last_line) {
  const double sec = since(t0);
  if (cfg.on_progress) cfg.on_progress(progress{phase, done, total, sec});
  static const bool tty = ::isatty(STDERR_FILENO) == 1;
  const bool due = last_line == t0 || since(last_line) > (tty ? 0.5 : 10.0) || done == total;
  if (cfg.progress_line && sec > 1.0 && due) {
    last_line = clk::now();
    std::fprintf(stderr, "%s[deferalloc] %s %5.1f%%  %.2f Gparam/s%s", tty ? "\r" : "", phase, 100.0 * done / total,
                 done / sec / 1e9, done == total || !tty ? "\n" : "");
    std::fflush(stderr);
  }
}

// ---- initialize / step ---------------------------------------------------------------

void streamed_adamw::initialize(stream_t stream) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  DFA_EXPECTS(!I.shards.empty(), "initialize: no shard registered", invalid_state);
  I.open_state();
  DFA_EXPECTS(!I.initialized, I.file && I.file->resumed()
                                  ? "initialize: the file tier resumed committed state at step " +
                                        std::to_string(I.step_count) + " (call sync_model_params, not initialize)"
                                  : std::string("initialize: already initialized"),
              invalid_state);
  if (!I.tier_home->streamed()) {
    auto t0 = clk::now();
    I.after(I.exec, stream);
    I.init_device_shards(true);
    I.drv->synchronize_stream(I.exec);
    I.report = step_report{};
    I.report.seconds = std::chrono::duration<double>(clk::now() - t0).count();
    for (auto& s : I.shards) I.report.params += s.info.numel;
  } else {
    I.place_resident();
    I.after(I.exec, stream);
    I.init_device_shards(false);
    I.run_pass(impl::pass::init, {}, {}, 1.0f, stream, 0);
    I.drv->synchronize_stream(I.exec);
    I.tier_home->commit(impl::pass::init, std::vector<std::uint64_t>(I.shards.size(), 0));
  }
  I.step_count = 0;
  for (auto& s : I.shards) s.step = 0;
  I.moments_written = false;
  I.initialized = true;
}

void streamed_adamw::step(std::span<const void* const> grads, grad_type gt, float grad_scale, stream_t stream) {
  std::vector<value_type> gts(impl_->shards.size(), gt);
  step(grads, gts, grad_scale, stream);
}

void streamed_adamw::step(std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale,
                          stream_t stream) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  I.check_step("step", grads, gts, grad_scale);
  I.settle_writes("step");
  for (std::size_t s = 0; s < I.shards.size(); ++s)
    DFA_EXPECTS(grads[s] == nullptr || !I.shards[s].speculative,
                "step: shard " + std::to_string(s) + " ('" + I.shards[s].info.name +
                    "') has " + k_pending,
                invalid_state);
  // File tier: a plain step would write the pending shards' committed state over their
  // speculative one in the new slot.
  if (!I.tier_home->in_place()) I.refuse_if_speculating("step");

  // An in-place step that failed part-way resumes where it stopped (same gradients).
  const std::size_t skip = I.failed_step == I.step_count + 1 ? I.failed_pieces_done : 0;
  try {
    if (!I.tier_home->streamed()) {
      auto t0 = clk::now();
      I.after(I.exec, stream);
      I.step_device_shards(grads, gts, grad_scale, skip, true);
      I.after(stream, I.exec);
      I.report = step_report{};
      I.report.seconds = std::chrono::duration<double>(clk::now() - t0).count();
      for (auto& s : I.shards) I.report.params += s.info.numel;
    } else {
      // Resident shards first (the GPU steps them while the link streams the rest); a
      // retry of a failed step does not step them twice.
      if (!(I.failed_step == I.step_count + 1 && I.resident_stepped)) {
        I.after(I.exec, stream);
        I.step_device_shards(grads, gts, grad_scale, 0, false);
        I.resident_stepped = true;
      }
      I.run_pass(impl::pass::step, grads, gts, grad_scale, stream, skip);
      std::vector<std::uint64_t> after = I.shard_steps();
      for (std::size_t s = 0; s < after.size(); ++s) after[s] += grads[s] != nullptr;
      I.tier_home->commit(impl::pass::step, after);
      I.after(stream, I.exec);
    }
  } catch (...) {
    if (!I.tier_home->in_place()) {
      // The commit record still names the previous step; make the BF16 params match it.
      I.failed_step = 0;
      try {
        I.sync_model(stream);
      } catch (const std::exception& e2) {
        deferalloc::detail::log(log_level::error,
                                std::string("step failed and the BF16 params could not be restored: ") + e2.what());
      }
    } else {
      I.failed_step = I.step_count + 1;
    }
    throw;
  }
  I.failed_step = 0;
  I.failed_pieces_done = 0;
  I.resident_stepped = false;
  I.moments_written = true;
  ++I.step_count;
  for (std::size_t s = 0; s < I.shards.size(); ++s)
    if (grads[s] != nullptr) ++I.shards[s].step;
}

void streamed_adamw::impl::check_step(const char* fn, std::span<const void* const> grads,
                                      std::span<const value_type> gts, float grad_scale) const {
  const std::string f(fn);
  DFA_EXPECTS(initialized, f + ": call initialize() first", invalid_state);
  DFA_EXPECTS(grads.size() == shards.size(),
              f + ": " + std::to_string(grads.size()) + " gradients for " + std::to_string(shards.size()) + " shards");
  DFA_EXPECTS(gts.size() == shards.size(), f + ": " + std::to_string(gts.size()) + " gradient types for " +
                                               std::to_string(shards.size()) + " shards");
  for (value_type t : gts)
    DFA_EXPECTS(t == value_type::bf16 || t == value_type::fp16 || t == value_type::fp32,
                f + ": unknown gradient type " + std::to_string(static_cast<int>(t)));
  DFA_EXPECTS(std::isfinite(grad_scale), f + ": grad_scale is not finite");
}

void streamed_adamw::impl::refuse_if_speculating(const char* fn) const {
  DFA_EXPECTS(speculating == 0,
              std::string(fn) + ": " + std::to_string(speculating) +
                  " shard(s) have " + k_pending,
              invalid_state);
}

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
// forgets the second copy.  A redo is discard, clip, step again; it rewrites the BF16
// parameters from the kept state, so the result is bit-identical to the clipped plain
// step.  Everything else (state ranges, state_dict, save_checkpoint, sync_model_params)
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
// caller keeps their state itself (overlap.py copies it out).  Host tier memory: the second copy doubles the pinned host
// memory of the shards stepped speculatively (12 B/param more with fp32 moments), held
// until the optimizer is destroyed.

void streamed_adamw::step_speculative(std::span<const void* const> grads, std::span<const value_type> gts,
                                      float grad_scale, stream_t stream) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  I.check_step("step_speculative", grads, gts, grad_scale);
  I.settle_writes("step_speculative");
  DFA_EXPECTS(I.tier_home->speculates(),
              std::string("step_speculative: the ") + to_string(I.cfg.home) +
                  " tier keeps one copy of the state (speculative steps need the host tier or the file tier)",
              invalid_state);
  DFA_EXPECTS(I.failed_step == 0, "step_speculative: a failed step awaits its retry (step() with the same gradients)",
              invalid_state);
  for (std::size_t s = 0; s < I.shards.size(); ++s) {
    if (grads[s] == nullptr) continue;
    const std::string which = "step_speculative: shard " + std::to_string(s) + " ('" + I.shards[s].info.name + "') ";
    DFA_EXPECTS(!I.shards[s].resident, which + "is resident in HBM and stepped in place (step it with step())",
                invalid_state);
    DFA_EXPECTS(!I.shards[s].speculative,
                which + "already has " + k_pending,
                invalid_state);
  }
  // The second copies before anything runs: running out of pinned memory changes nothing.
  for (std::size_t s = 0; s < I.shards.size(); ++s)
    if (grads[s] != nullptr) I.tier_home->prepare_speculation(s);
  try {
    I.run_pass(impl::pass::step, grads, gts, grad_scale, stream, 0, true);
    I.after(stream, I.exec);
  } catch (...) {
    I.failed_pieces_done = 0;  // the current copy is intact: nothing to resume
    throw;
  }
  for (std::size_t s = 0; s < I.shards.size(); ++s)
    if (grads[s] != nullptr) I.shards[s].speculative = true, ++I.speculating;
}

void streamed_adamw::commit_speculation() {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  if (I.speculating == 0) return;
  if (!I.tier_home->in_place()) {
    // File tier: the shards not stepped are carried into the new slot, then one commit
    // record publishes it.  A failure leaves the speculation pending (retry or discard).
    const std::vector<const void*> none(I.shards.size(), nullptr);
    const std::vector<value_type> gts(I.shards.size(), value_type::fp32);
    // (The carry touches no parameter or gradient: it is ordered after no user stream.)
    if (!I.pieces(none, false).empty()) I.run_pass(impl::pass::step, none, gts, 1.0f, I.exec, 0);
    I.drv->synchronize_stream(I.exec);
    std::vector<std::uint64_t> after = I.shard_steps();
    for (std::size_t s = 0; s < after.size(); ++s) after[s] += I.shards[s].speculative;
    I.tier_home->commit(impl::pass::step, after);
  }
  for (std::size_t s = 0; s < I.shards.size(); ++s)
    if (I.shards[s].speculative) {
      I.tier_home->commit_speculation(s);
      I.shards[s].speculative = false;
      ++I.shards[s].step;
    }
  I.speculating = 0;
  I.moments_written = true;
  ++I.step_count;
}

void streamed_adamw::discard_speculation() {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  for (auto& s : I.shards) s.speculative = false;
  I.speculating = 0;
}

std::size_t streamed_adamw::speculation_pending() const {
  std::lock_guard lk(impl_->mu);
  return impl_->speculating;
}

bool streamed_adamw::can_speculate(std::size_t s) const {
  std::lock_guard lk(impl_->mu);
  DFA_EXPECTS(s < impl_->shards.size(), "can_speculate: no shard " + std::to_string(s));
  return impl_->tier_home->speculates() && !impl_->shards[s].resident;
}

void streamed_adamw::sync_model_params(stream_t stream) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  I.open_state();
  DFA_EXPECTS(I.initialized, "sync_model_params: no state yet (initialize() or resume first)", invalid_state);
  I.settle_writes("sync_model_params");
  I.sync_model(stream);
}

void streamed_adamw::impl::sync_model(stream_t stream) {
  after(exec, stream);
  sync_device_shards(!tier_home->streamed());
  if (tier_home->streamed()) run_pass(pass::export_bf16, {}, {}, 1.0f, stream, 0);
  after(stream, exec);
}

double streamed_adamw::grad_sq_norm(std::span<const void* const> grads, grad_type gt, stream_t stream) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  DFA_EXPECTS(grads.size() == I.shards.size(), "grad_sq_norm: one gradient per shard expected");
  for (std::size_t s = 0; s < grads.size(); ++s)
    DFA_EXPECTS(grads[s] != nullptr, "grad_sq_norm: gradient of shard " + std::to_string(s) + " is null");
  I.after(I.exec, stream);
  double s = 0;
  for (std::size_t i = 0; i < grads.size(); ++i)
    s += I.comp->sq_norm(grads[i], gt == grad_type::bf16, I.shards[i].info.numel, I.exec);
  return s;
}

// ---- state ranges (PyTorch's state_dict) ---------------------------------------------

namespace {
void check_range(const char* fn, std::size_t shards, std::size_t s, state_array a, std::size_t offset, std::size_t n,
                 std::size_t numel, bool whole_arrays) {
  DFA_EXPECTS(s < shards, std::string(fn) + ": no shard " + std::to_string(s));
  DFA_EXPECTS(static_cast<int>(a) >= 0 && static_cast<int>(a) < 3,
              std::string(fn) + ": unknown state array " + std::to_string(static_cast<int>(a)));
  DFA_EXPECTS(offset <= numel && n <= numel - offset, std::string(fn) + ": range [" + std::to_string(offset) + ", " +
                                                         std::to_string(offset + n) + ") outside shard " +
                                                         std::to_string(s) + " of " + std::to_string(numel) + " elements");
  DFA_EXPECTS(!whole_arrays || (offset == 0 && n == numel),
              std::string(fn) + ": the file tier takes whole arrays only (offset 0, n = numel)");
}
}  // namespace

void streamed_adamw::read_state_range(std::size_t shard, state_array a, std::size_t offset, std::size_t n, float* out) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  I.open_state();
  DFA_EXPECTS(I.initialized, "read_state_range: no state yet (initialize() first)", invalid_state);
  I.settle_writes("read_state_range");
  DFA_EXPECTS(out != nullptr || n == 0, "read_state_range: out is null");
  check_range("read_state_range", I.shards.size(), shard, a, offset, n,
              shard < I.shards.size() ? I.shards[shard].info.numel : 0, I.tier_home->whole_arrays());
  if (n > 0) I.read_home(shard, a, offset, n, out);
}

void streamed_adamw::write_state_range(std::size_t shard, state_array a, std::size_t offset, std::size_t n,
                                       const float* in) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  I.open_state();
  DFA_EXPECTS(I.initialized, "write_state_range: no state yet (initialize() first)", invalid_state);
  DFA_EXPECTS(in != nullptr || n == 0, "write_state_range: in is null");
  I.refuse_if_speculating("write_state_range");
  check_range("write_state_range", I.shards.size(), shard, a, offset, n,
              shard < I.shards.size() ? I.shards[shard].info.numel : 0, I.tier_home->whole_arrays());
  if (n == 0) return;
  // The file tier writes only within a state write: one of its own when none is open,
  // published by the next call that uses the state (Note [State writes] in home.cpp).
  if (!I.writing && !I.tier_home->in_place()) I.open_write(true);
  I.home_of(shard).write_range(shard, a, offset, n, in);
  if (is_moment(a)) I.moments_written = true;
}

void detail::inject_file_fault(streamed_adamw& o, file_fault_op op, file_fault_kind kind, std::uint64_t nth) {
  auto& I = *o.impl_;
  std::lock_guard lk(I.mu);
  I.open_state();
  DFA_EXPECTS(I.file != nullptr, "inject_file_fault: the optimizer has no file tier", invalid_state);
  I.file->inject(op, kind, nth);
}

}  // namespace deferalloc::optim
