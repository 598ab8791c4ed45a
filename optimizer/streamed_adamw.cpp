// The streamed optimizer's facade: construction, queries, initialize / step / sync and
// state ranges, over the layers of Note [Optimizer layers] (optimizer_impl.hpp); speculative
// steps are in speculation.cpp, state writes in state_writes.cpp.
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/reservations.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>

#include "log.hpp"
#include "kernels/compute.hpp"
#include "optimizer_impl.hpp"
#include "store/file_store.hpp"
#include "window_pipeline.hpp"

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

// ---- construction -------------------------------------------------------------------

std::vector<std::size_t> window_shape::chunk_classes(std::size_t granule) const {
  // The piece and its halvings down to the granule (a pass's pieces, Note [Pass pieces]).
  std::vector<std::size_t> classes{piece * 4};
  while (classes.back() / 2 >= granule && (classes.back() / 2) % granule == 0) classes.push_back(classes.back() / 2);
  return classes;
}

window_shape shape_window(optimizer_config& cfg, const home_traits& traits, std::size_t granule) {
  window_shape w;
  const bool default_depth = cfg.depth == 0;
  // File tier: pieces are whole checksum blocks (see Note [File tier integrity]).
  w.align = std::max(granule, traits.piece_align) / 4;
  // depth 0: the tier's depth, or as many slots of one aligned unit as the window holds
  // if fewer (Note [Window slots]).
  if (cfg.depth == 0)
    cfg.depth = static_cast<int>(
        std::clamp<std::size_t>(cfg.window_bytes / (12 * w.align), 1, static_cast<std::size_t>(traits.default_depth)));
  // The window's piece: a power-of-two number of aligned units, the most that depth
  // slots of three arrays fit in the window, so that it halves down to one unit (Note
  // [Pass pieces]).
  const std::size_t units = cfg.window_bytes / (12 * static_cast<std::size_t>(cfg.depth)) / w.align;
  // int8 on the file tier: Note [File tier moments] in store/file_store.cpp.
  const bool int8_file = cfg.moments == moment_format::int8 && cfg.home == tier::file;
  if (units == 0) {
    // Named as the user set it (window_mb, in MiB rounded up: what it must be at least;
    // window_bytes, a C++ field, in bytes), depth only when set, else as the tier's default.
    constexpr std::size_t mib = std::size_t{1} << 20;
    const std::size_t depth = static_cast<std::size_t>(cfg.depth), need = 12 * depth * w.align;
    const bool in_mb = cfg.window_bytes % mib == 0;
    const std::string knob = in_mb ? "window_mb" : "window_bytes";
    const std::string flight = depth == 1 ? "1 piece in flight needs" : std::to_string(depth) + " pieces in flight need";
    const std::string hint = default_depth ? "raise " + knob + "; depth " + std::to_string(traits.default_depth) +
                                                 ", the " + to_string(cfg.home) +
                                                 " tier's default, takes as many pieces as it holds"
                             : depth > 1 ? "raise " + knob + ", or lower depth"
                                         : "raise " + knob;
    throw invalid_argument("streamed_adamw: " + knob + " " + std::to_string(in_mb ? cfg.window_bytes / mib : cfg.window_bytes) +
                           " is too small: " + flight + " at least " +
                           (in_mb ? std::to_string((need + mib - 1) / mib) + " MiB" : std::to_string(need) + " bytes") +
                           " (" + hint + ")" +
                           (int8_file ? "; int8 moments on the file tier move pieces of 2^20 elements, whole "
                                        "segments of the state file, so each piece in flight needs 12 MiB"
                                      : ""));
  }
  w.piece = std::bit_floor(units) * w.align;  // params
  return w;
}

streamed_adamw::streamed_adamw(std::shared_ptr<driver> drv, optimizer_config cfg) : impl_(std::make_unique<impl>()) {
  auto& self = *impl_;
  DFA_EXPECTS(drv != nullptr, "streamed_adamw: driver is null");
  DFA_EXPECTS(cfg.depth >= 0, "streamed_adamw: depth must be at least 1 (0: the tier's default)");
  validate(cfg.adamw);
  self.drv = std::move(drv);
  self.cfg = std::move(cfg);
  DFA_EXPECTS(self.cfg.moments == moment_format::fp32 || self.cfg.home != tier::device,
              std::string("streamed_adamw: ") + to_string(self.cfg.moments) + " moments need the host or file tier (the " +
                  to_string(self.cfg.home) + " tier keeps fp32 moments)");
  DFA_EXPECTS(self.cfg.resident_bytes == 0 || self.cfg.home != tier::device,
              "streamed_adamw: resident_mb (resident_bytes) needs the host or file tier: the device tier keeps all its "
              "state in HBM");
  // Note [Resident shards on the file tier] (resident.cpp).
  DFA_EXPECTS(self.cfg.resident_bytes == 0 || self.cfg.home != tier::file || self.cfg.moments == moment_format::fp32,
              std::string("streamed_adamw: resident_mb (resident_bytes) on the file tier needs fp32 moments, not ") +
                  to_string(self.cfg.moments) +
                  " (the state file stores every shard's moments in one format; a resident shard keeps FP32 moments)");
  // Every check of the config comes before anything is built (a refused config costs no
  // streams, window or file).
  DFA_EXPECTS(self.cfg.home != tier::file || !self.cfg.directory.empty(),
              "streamed_adamw: the file tier needs a directory");
  const home_traits traits = traits_of(self.cfg.home, self.cfg.moments);
  if (traits.streamed) {
    self.shape = shape_window(self.cfg, traits, self.drv->granularity());
    // One chunk per array per slot (Note [Window slots]).  Budget: the window and the
    // resident shards (Note [Resident shards]); the cache holds the window's chunks only
    // (resident chunks stay taken).
    self.pool = std::make_shared<chunk_pool>(
        self.drv, chunk_pool_config{self.shape.chunk_classes(self.drv->granularity()),
                                    self.cfg.window_bytes + self.cfg.resident_bytes, self.cfg.window_bytes});
  } else {
    self.pool = std::make_shared<chunk_pool>(self.drv);
  }
  self.mgr = std::make_unique<reservation_manager>(self.pool, self.drv);
  if (traits.streamed)
    self.slots = std::make_unique<window>(*self.mgr, static_cast<std::size_t>(self.cfg.depth), self.shape.piece * 4);
  self.comp = detail::make_compute(*self.drv);
  self.streams = std::make_unique<stream_set>(*self.drv);
  self.make_homes();
}

streamed_adamw::~streamed_adamw() {
  if (!impl_) return;
  auto& self = *impl_;
  try {
    // An open state write is published (implicit) or dropped (explicit, as the header says).
    if (self.state_write.open()) self.close_write(self.state_write.implicit());
  } catch (const std::exception& e) {
    deferalloc::detail::log(log_level::error, std::string("streamed_adamw: state write not published: ") + e.what());
  }
  try {
    self.streams->synchronize();
  } catch (const std::exception& e) {
    deferalloc::detail::log(log_level::error, std::string("streamed_adamw: ") + e.what());
  }
  for (float* p : self.saved_params) self.drv->host_free(p);
  self.tier_home.reset();  // pinned homes, staging buffers, the state file
  self.hbm_home.reset();
  self.slots.reset();
  self.mgr.reset();
  self.streams.reset();  // the streams and their events
}

std::size_t streamed_adamw::add_shard(std::uint16_t* param_bf16, std::size_t numel, std::string name) {
  return add_shard(param_bf16, numel, value_type::bf16, 0, std::move(name));
}

std::size_t streamed_adamw::add_shard(void* param, std::size_t numel, value_type t, int group, std::string name) {
  auto& self = *impl_;
  impl::entry_guard g(self);
  DFA_EXPECTS(!self.initialized, "add_shard: shards must be registered before initialize()", invalid_state);
  DFA_EXPECTS(param != nullptr, "add_shard: the parameter pointer is null");
  DFA_EXPECTS(numel > 0, "add_shard: numel is zero");
  DFA_EXPECTS(numel <= (std::size_t{1} << 40), "add_shard: numel " + std::to_string(numel) + " is absurd");
  DFA_EXPECTS(t == value_type::bf16 || t == value_type::fp16 || t == value_type::fp32,
              "add_shard: unknown parameter type " + std::to_string(static_cast<int>(t)));
  DFA_EXPECTS(group >= 0, "add_shard: group " + std::to_string(group) + " is negative");
  shard s;
  s.info.name = name.empty() ? "shard" + std::to_string(self.shards.size()) : std::move(name);
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
    for (; made < 3; ++made) s.res[k_state_arrays[made]] = self.mgr->reserve(bytes);
    self.tier_home->add_shard(s);
  } catch (...) {
    for (std::size_t a = 0; a < made; ++a) self.mgr->free(s.res[k_state_arrays[a]]);
    throw;
  }
  // An FP32 parameter is its own main (Note [The parameter is the truth]).
  s.info.main_param = param_is_main(s.info) ? static_cast<float*>(param)
                                            : static_cast<float*>(self.mgr->address(s.res[state_array::main]));
  s.info.exp_avg = static_cast<float*>(self.mgr->address(s.res[state_array::exp_avg]));
  s.info.exp_avg_sq = static_cast<float*>(self.mgr->address(s.res[state_array::exp_avg_sq]));
  return self.shards.add(std::move(s));
}

// ---- queries ------------------------------------------------------------------------

std::uint64_t streamed_adamw::steps() const { return impl_->step_count; }
bool streamed_adamw::initialized() const { return impl_->initialized; }
bool streamed_adamw::resumed() const {
  auto& self = *impl_;
  impl::entry_guard g(self);
  if (!self.shards.empty()) g.require("resumed", entry_needs::opened);  // opens the state file: a damaged one throws here
  committed_store* store = self.tier_home->store();
  return store && store->resumed();
}
const std::vector<shard_info>& streamed_adamw::shards() const { return impl_->shards.infos(); }
const optimizer_config& streamed_adamw::config() const { return impl_->cfg; }
void streamed_adamw::set_hyper(const adamw_params& p) {
  validate(p);
  impl::entry_guard guard(*impl_, impl::keeps_passes);
  impl_->cfg.adamw = p;
  for (auto& [g, h] : impl_->groups) h = p;
}
void streamed_adamw::set_group(int g, const adamw_params& p) {
  DFA_EXPECTS(g >= 0, "set_group: group " + std::to_string(g) + " is negative");
  validate(p);
  impl::entry_guard guard(*impl_, impl::keeps_passes);
  impl_->groups[g] = p;
}
adamw_params streamed_adamw::group(int g) const {
  impl::entry_guard guard(*impl_);
  return impl_->hyper_of(g);
}
std::uint64_t streamed_adamw::shard_step(std::size_t s) const {
  impl::entry_guard g(*impl_);
  DFA_EXPECTS(s < impl_->shards.size(), "shard_step: no shard " + std::to_string(s));
  return impl_->shards[s].step;
}
void streamed_adamw::set_shard_step(std::size_t s, std::uint64_t step) {
  auto& self = *impl_;
  impl::entry_guard g(self);
  DFA_EXPECTS(s < self.shards.size(), "set_shard_step: no shard " + std::to_string(s));
  // A resumed file's counts are read first (else the resume would overwrite this one);
  // before any state the count would be reset by initialize(): refused, before a fresh
  // file tier creates its state file.
  const std::string no_state = "set_shard_step: no state yet (initialize() first, or a resumed state file)";
  DFA_EXPECTS(self.initialized || self.cfg.resume, no_state, invalid_state);
  g.require("set_shard_step", entry_needs::opened | entry_needs::initialized | entry_needs::not_speculating, no_state);
  // The file tier publishes it with the state write under way, or with one of its own;
  // the others keep it in memory.
  self.ensure_state_write();
  self.retry.clear();  // (as write_state_range)
  self.shards[s].step = step;
}

void streamed_adamw::set_shard_param(std::size_t s, void* param) {
  auto& self = *impl_;
  impl::entry_guard g(self);
  DFA_EXPECTS(s < self.shards.size(), "set_shard_param: no shard " + std::to_string(s));
  DFA_EXPECTS(param != nullptr, "set_shard_param: the parameter pointer is null");
  g.require("set_shard_param", entry_needs::not_speculating);
  self.shards.set_param(s, param);
}

std::size_t streamed_adamw::piece_elements() const { return impl_->shape.piece; }
step_report streamed_adamw::last_report() const { return impl_->report; }
reservation_manager& streamed_adamw::reservations() { return *impl_->mgr; }

// ---- the pipeline -------------------------------------------------------------------

void streamed_adamw::impl::make_homes() {
  const home_context ctx{*drv, *drv, *mgr, shards, cfg, exec()};
  tier_home = make_home(cfg.home, ctx);
  hbm_home = make_home(tier::device, ctx);
}

void streamed_adamw::impl::open_state() {
  committed_store* store = tier_home->store();
  if (!store) return;
  if (auto resumed = store->open()) {
    adopt(*resumed);
    // Note [Resident shards on the file tier]: chosen as initialize() would, their state
    // from the file.
    place_resident();
    load_resident();
  }
}

state_counts streamed_adamw::impl::counts_after_step(const std::vector<bool>& stepped) const {
  state_counts after{step_count + 1, true, shards.steps()};
  for (std::size_t s = 0; s < shards.size(); ++s) after.shard_steps[s] += stepped[s];
  return after;
}

void streamed_adamw::impl::adopt(const state_counts& c) {
  step_count = c.step;
  for (std::size_t s = 0; s < shards.size(); ++s) shards[s].step = c.shard_steps[s];
  moments_written = c.moments_written;
  initialized = true;
}

std::vector<piece_ref> streamed_adamw::impl::pieces(pass_kind kind, std::span<const void* const> grads,
                                                    bool speculative) const {
  // A step that writes a new copy of the state (file tier) carries the shards it does not
  // step into it; a speculative one leaves that to commit_speculation, which carries those
  // not stepped speculatively (Note [Speculative steps]).
  // An init or export pass has nothing to move for an FP32 parameter but its durable copy.
  const bool durable = tier_home->traits().durable_params;
  std::vector<bool> selected(shards.size());
  for (std::size_t s = 0; s < shards.size(); ++s)
    selected[s] = !shards[s].resident && (kind == pass_kind::step || durable || !param_is_main(shards[s].info)) &&
                  (grads.empty() || grads[s] != nullptr || (!in_place() && !speculative && !shards[s].speculative));
  return cut_pieces(shards, selected, shape.piece, shape.align, cfg.pass_taper);
}

adamw_scalars streamed_adamw::impl::scalars(std::size_t s, float grad_scale) const {
  const adamw_params& h = hyper_of(shards[s].info.group);
  auto k = detail::make_scalars(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, shards[s].step + 1, grad_scale,
                                [this](float base, float e) { return comp->pow(base, e); });
  k.seed = detail::step_seed(shards[s].step + 1, s);
  return k;
}

void streamed_adamw::impl::settle_passes() {
  if (slots) settle_chain(*drv, *streams, *slots);
}

void streamed_adamw::impl::run_pass(pass_kind kind, std::span<const void* const> grads, std::span<const value_type> gts,
                                    float grad_scale, stream_t user, std::size_t skip, bool speculative) {
  pass_plan plan;
  plan.kind = kind;
  plan.pieces = pieces(kind, grads, speculative);
  if (plan.pieces.empty()) {  // (every shard resident, or FP32 parameters with nothing to move)
    report = step_report{};
    return;
  }
  plan.skip = skip;
  plan.arrays = kind == pass_kind::step ? 3 : 1;
  plan.fetch_main = kind != pass_kind::init;
  plan.write_back = kind != pass_kind::export_bf16;
  plan.speculative = speculative;  // the home writes back into the second copy
  plan.moments_stored = moments_written;
  plan.depth = static_cast<std::size_t>(cfg.depth);
  plan.window_piece = shape.piece;
  plan.durable_params = tier_home->traits().durable_params;
  plan.resumable = kind == pass_kind::step && !speculative && tier_home->store() == nullptr;
  plan.chain = kind == pass_kind::step && cfg.keep_window && cfg.pass_chain && tier_home->traits().chains_passes;
  step_inputs step{grads, gts, {}, {}, {}};
  if (speculative) step.saved_params = saved_params;
  if (kind == pass_kind::step) step.edit_checks = edit_checked;
  if (kind == pass_kind::step)
    for (std::size_t s = 0; s < shards.size(); ++s) step.scalars.push_back(scalars(s, grad_scale));
  const std::vector<piece_ref> ps = speculative ? plan.pieces : std::vector<piece_ref>{};
  window_pipeline pass({*drv, *comp, *pool, *streams, *slots, *tier_home->mover(), shards, cfg}, std::move(plan),
                       std::move(step));
  try {
    pass.run(user, report);
  } catch (...) {
    // Only a plain step's pass is what a retry resumes; an export or init pass writes no
    // state back, and a speculative one writes the second copy (and FP32 parameters in
    // place: those it kept go back).
    if (kind == pass_kind::step && !speculative) {
      retry.progressed(pass.written());
      retry.tore(pass.torn());
    }
    if (speculative) {
      try {
        restore_params(ps, pass.fetched());
      } catch (const std::exception& e) {
        deferalloc::detail::log(log_level::error,
                                std::string("step_speculative failed and FP32 parameters could not be restored: ") + e.what());
      }
    }
    throw;
  }
}

// ---- initialize / step ---------------------------------------------------------------

void streamed_adamw::initialize(stream_t stream) {
  auto& self = *impl_;
  impl::entry_guard g(self);
  DFA_EXPECTS(!self.shards.empty(), "initialize: no shard registered", invalid_state);
  g.require("initialize", entry_needs::in_parent);
  g.require("initialize", entry_needs::opened);
  DFA_EXPECTS(!self.initialized, self.tier_home->store() && self.tier_home->store()->resumed()
                                  ? "initialize: the file tier resumed committed state at step " +
                                        std::to_string(self.step_count) + " (call sync_model_params, not initialize)"
                                  : std::string("initialize: already initialized"),
              invalid_state);
  const state_counts fresh{0, false, std::vector<std::uint64_t>(self.shards.size(), 0)};
  if (!self.streamed()) {
    auto t0 = clk::now();
    self.after(self.exec(), stream);
    self.init_device_shards(true);
    self.drv->synchronize_stream(self.exec());
    self.report = step_report{};
    self.report.seconds = std::chrono::duration<double>(clk::now() - t0).count();
    for (auto& s : self.shards) self.report.params += s.info.numel;
  } else {
    self.place_resident();
    self.after(self.exec(), stream);
    self.init_device_shards(false);
    self.run_pass(pass_kind::init, {}, {}, 1.0f, stream, 0);
    self.drv->synchronize_stream(self.exec());
    if (committed_store* store = self.tier_home->store()) {
      self.store_resident(store->active_slot(), false);  // Note [Resident shards on the file tier]
      store->commit(pass_kind::init, fresh);
    }
  }
  self.hash_written();
  self.adopt(fresh);
}

void streamed_adamw::step(std::span<const void* const> grads, grad_type gt, float grad_scale, stream_t stream) {
  std::vector<value_type> gts(impl_->shards.size(), gt);
  step(grads, gts, grad_scale, stream);
}

void streamed_adamw::step(std::span<const void* const> grads, std::span<const value_type> gts, float grad_scale,
                          stream_t stream) {
  auto& self = *impl_;
  impl::entry_guard g(self, impl::keeps_passes);
  self.check_step("step", grads, gts, grad_scale);
  g.require("step", entry_needs::settled);
  for (std::size_t s = 0; s < self.shards.size(); ++s)
    DFA_EXPECTS(grads[s] == nullptr || !self.shards[s].speculative,
                "step: shard " + std::to_string(s) + " ('" + self.shards[s].info.name +
                    "') has " + k_pending,
                invalid_state);
  // File tier: a plain step would write the pending shards' committed state over their
  // speculative one in the new slot; one of resident shards only joins the speculation.
  if (self.joins_speculation(grads)) return self.step_joined(grads, gts, grad_scale, stream);
  if (!self.in_place()) self.refuse_if_speculating("step");

  self.report_edits();  // the last step's (device tier: read now, not after its kernels)
  // An in-place step that failed part-way resumes where it stopped (same gradients).
  const std::uint64_t next = self.step_count + 1;
  std::vector<bool> stepped(self.shards.size());
  for (std::size_t s = 0; s < self.shards.size(); ++s) stepped[s] = grads[s] != nullptr;
  DFA_EXPECTS(!self.retry.mismatched(next, stepped),
              "step: " + std::string(k_retry_pending) + "; this step's gradients are for other shards than the failed step's",
              invalid_state);
  DFA_EXPECTS(self.retry.torn(next).empty(),
              "step: the failed step " + std::to_string(next) + " stepped " + self.retry.torn(next) +
                  " but could not write it back, so its state is neither step's: write the state "
                  "(write_state_range, load_state_dict) or load a checkpoint first",
              invalid_state);
  const std::size_t skip = self.retry.skip(next);
  const state_counts after = self.counts_after_step(stepped);
  try {
    self.after(self.exec(), stream);
    self.check_edits(grads);
    if (!self.streamed()) {
      auto t0 = clk::now();
      self.step_device_shards(grads, gts, grad_scale, skip, true);
      self.after(stream, self.exec());
      self.report = step_report{};
      self.report.seconds = std::chrono::duration<double>(clk::now() - t0).count();
      for (auto& s : self.shards) self.report.params += s.info.numel;
    } else {
      // Resident shards first (the GPU steps them while the link streams the rest); a
      // retry of a failed step does not step them twice.
      if (!self.retry.resident_stepped(next)) {
        self.after(self.exec(), stream);
        self.step_device_shards(grads, gts, grad_scale, 0, false);
        bool changed = false;
        for (std::size_t s = 0; s < self.shards.size(); ++s) changed = changed || (self.shards[s].resident && stepped[s]);
        self.retry.resident_enqueued(changed);
      }
      self.run_pass(pass_kind::step, grads, gts, grad_scale, stream, skip);
      if (committed_store* store = self.tier_home->store()) {
        self.store_resident(store->load_slot(), true);  // Note [Resident shards on the file tier]
        store->commit(pass_kind::step, after);
      }
      self.after(stream, self.exec());
    }
  } catch (...) {
    self.forget_edit_hashes();  // some pieces may be written (sync_model hashes them again)
    if (!self.in_place()) {
      // The commit record still names the previous step; make the resident shards (stepped
      // in place) and the BF16 params match it.
      self.retry.clear();
      try {
        self.load_resident();
        self.sync_model(stream);
      } catch (const std::exception& e2) {
        deferalloc::detail::log(log_level::error,
                                std::string("step failed and the BF16 params could not be restored: ") + e2.what());
      }
    } else {
      self.retry.failed(next, stepped);
    }
    throw;
  }
  self.retry.clear();
  if (self.streamed()) self.report_edits();  // (waits for the pass's kernels, if it has not)
  self.hash_written(grads);
  self.adopt(after);
}

void streamed_adamw::impl::check_step(const char* fn, std::span<const void* const> grads,
                                      std::span<const value_type> gts, float grad_scale) const {
  const std::string f(fn);
  // The count first: a wrong one is the caller's argument whatever the state (the C ABI
  // relies on it, Note [Arguments are checked where they enter] in docs/DESIGN.md).
  DFA_EXPECTS(grads.size() == shards.size(),
              f + ": " + std::to_string(grads.size()) + " gradients for " + std::to_string(shards.size()) + " shards");
  DFA_EXPECTS(initialized, f + ": call initialize() first", invalid_state);
  refuse_in_child(fn);
  DFA_EXPECTS(gts.size() == shards.size(), f + ": " + std::to_string(gts.size()) + " gradient types for " +
                                               std::to_string(shards.size()) + " shards");
  for (value_type t : gts)
    DFA_EXPECTS(t == value_type::bf16 || t == value_type::fp16 || t == value_type::fp32,
                f + ": unknown gradient type " + std::to_string(static_cast<int>(t)));
  DFA_EXPECTS(std::isfinite(grad_scale), f + ": grad_scale is not finite");
}

// Note [A forked child and device memory]
// Rationale: the host driver's device memory is shared memory (memfd, MAP_SHARED), so a
// process forked after the optimizer was built (a DataLoader worker) that steps a
// device-tier optimizer, or the resident shards of a host-tier one, writes the parent's
// state; the file tier already refuses a child (file_store::refuse_in_child).
// Approach: the optimizer remembers the process that built it; initialize, a step, a
// state write and a checkpoint load in another process are refused (invalid_state) when
// any state lives in device memory.  On the CUDA driver a child cannot use the parent's
// context anyway; the check costs a getpid.
// Limits: reads are not refused (they change nothing); the host tier's pinned homes are
// the child's own copy (copy-on-write) and stay usable there.
void streamed_adamw::impl::refuse_in_child(const char* fn) const {
  if (::getpid() == owner_pid) return;
  bool resident = false;
  for (const auto& s : shards) resident = resident || s.resident;
  if (streamed() && !resident) return;
  throw invalid_state(std::string(to_string(cfg.home)) + " tier: " +
                      (streamed() ? "the resident shards' state" : "the state") + " in device memory belongs to process " +
                      std::to_string(owner_pid) + "; a forked child cannot change it (" + fn + ")");
}

// Note [The parameter is the truth]
//
// Rationale: torch.optim.AdamW steps the parameter itself, so a user's edit of an FP32
// weight between steps (`with torch.no_grad(): w.zero_()`, `load_state_dict`, an EMA
// swap) is what the next step reads.  A separate FP32 main copy of an FP32 parameter
// made the next step overwrite such an edit (the step read main and wrote it into the
// parameter): silently different from AdamW, and 4 B/param each way for a copy equal to
// the parameter.
// Approach: a shard whose parameter is FP32 has no main of its own (param_is_main in
// home.hpp): its main_param is the parameter.  A step pass fetches only its moments, runs
// the same kernel with main pointing at the parameter (the kernel reads and writes each
// element in place; the model output it writes is the same value) and writes back only
// the moments: host tier 8 B/param in and 8 out; the device tier and resident shards
// back no HBM for its main; initialize copies nothing and init / export passes leave it
// out.  State ranges, read_state and checkpoints read and write the parameter as main.
// The file tier keeps a durable copy (home_traits::durable_params): each committed step
// (and the carry of a shard not stepped) writes the parameter as main into the new slot
// (8 B in, 12 out per param; never read by a step), and a resume's sync_model_params
// (an export pass, as for BF16) writes it back into the parameter.  A speculative step
// writes the parameter in place, so it first keeps the old values: each piece's fetch
// copies the parameter's piece (D2H on the H2D stream, before the kernel) into pinned
// host memory of the shard's (impl::saved_params, allocated at its first speculative
// step); discard_speculation and a failed speculative pass copy them back, and reads of
// main while pending return them.  Cost: 4 B/param of pinned memory per shard ever
// stepped speculatively and 4 B/param more D2H per speculative step.
// Limits: a plain step on an in-place tier that fails between a piece's kernel and its
// write-back issues that write-back as it drains; where it cannot, the piece's FP32
// parameter is stepped and its moments not, and the retry is refused (Note [The write-back
// queue] in window_pipeline.cpp); a failed file-tier step restores FP32 parameters from the durable copy
// of the last commit (an edit made since is lost); a file-tier state write that is
// dropped leaves a written FP32 main in the parameter.

void streamed_adamw::sync_model_params(stream_t stream) {
  auto& self = *impl_;
  impl::entry_guard g(self);
  g.require("sync_model_params", entry_needs::opened | entry_needs::initialized | entry_needs::settled,
            "sync_model_params: no state yet (initialize() or resume first)");
  self.sync_model(stream);
}

void streamed_adamw::impl::sync_model(stream_t stream) {
  after(exec(), stream);
  sync_device_shards(!streamed());
  if (streamed()) run_pass(pass_kind::export_bf16, {}, {}, 1.0f, stream, 0);
  hash_written();  // the engine wrote every parameter
  after(stream, exec());
}

// Note [Edits of 16-bit parameters]
//
// Rationale: a BF16 or FP16 parameter keeps an FP32 main (the parameter is its rounding),
// so an edit of the parameter outside the optimizer (w.zero_(), load_state_dict of the
// model, an EMA swap) would be overwritten by the next step's BF16(main): silently
// different from torch.optim.AdamW, which steps the parameter.
// Approach: after the engine writes a 16-bit parameter (initialize, a step of its shard,
// sync_model), a kernel hashes its bits into a 64-bit slot on the device (the wrapping
// sum of a mix of each value times a weight of its index: edit_term in
// kernels/adamw_math.hpp; about 2 B/param of HBM reads in 16-byte loads and two integer
// multiplies per element, far under 1% of a PCIe-bound step; on the HBM-bound device tier
// bench_optimizer's device-tier step is the measure).  A step (plain or
// speculative) of that shard hashes it again first, after the user's stream, and the
// piece's kernel is preceded by one that, when the two differ, takes the parameter into
// main element by element where it is not main's rounding (main = float(param)), and
// marks the shard edited when it took one; all on the device, no wait.  An element the
// edit left at main's rounding keeps main's bits, so loading a model's parameters saved
// with the optimizer (param = round(main)) after its state changes nothing.  The host
// reads the marks after a streamed pass (an unchained pass has waited for its kernels; a
// chained one, Note [Chained passes], waits there for its kernels, not its write-backs),
// the device tier's at its next step, and logs one warning line per edited shard.  A kernel writes
// the marks into mapped pinned memory for that read, not a D2H copy: the copy queued on
// the copy engine behind the pass's write-backs, so a chained pass (Note [Chained passes])
// waited for its whole drain there (seen in a torch.profiler trace of bench_overlap on an
// H100: about 2 ms of the link idle at each bucket pass's end).  The CPU twin
// keeps the slots in host memory with the same arithmetic.
// Limits: an element edited to main's rounding keeps main (the edit and main agree to the
// parameter's precision).  A step that failed part-way forgets every hash (no check until
// the shard is written again).  An edit made before a speculative step that is then
// discarded is taken into the discarded copy only: the redo does not see it.  The sum can
// miss an edit of several elements only by a collision, never one element's, and two
// values swapped only at indices a multiple of 2^31 apart (edit_term).
void streamed_adamw::impl::hash_written(std::span<const void* const> which) {
  if (edit_hashed.size() != shards.size()) {
    comp->edit_slots(shards.size());
    edit_hashed.assign(shards.size(), 0);
  }
  for (std::size_t s = 0; s < shards.size(); ++s)
    if (!param_is_main(shards[s].info) && (which.empty() || which[s] != nullptr)) {
      comp->hash_param(s, detail::compute::k_written, shards[s].info.param, shards[s].info.numel, exec());
      edit_hashed[s] = 1;
    }
}

void streamed_adamw::impl::check_edits(std::span<const void* const> grads) {
  edit_checked.assign(shards.size(), 0);
  if (edit_hashed.size() != shards.size()) return;
  for (std::size_t s = 0; s < shards.size(); ++s)
    if (grads[s] != nullptr && edit_hashed[s] && !param_is_main(shards[s].info)) {
      comp->hash_param(s, detail::compute::k_now, shards[s].info.param, shards[s].info.numel, exec());
      edit_checked[s] = 1;
    }
}

void streamed_adamw::impl::report_edits() {
  if (std::find(edit_checked.begin(), edit_checked.end(), 1) == edit_checked.end()) {
    edit_checked.clear();
    return;
  }
  const std::vector<std::uint64_t> slots = comp->read_edit_slots(exec());
  for (std::size_t s = 0; s < edit_checked.size(); ++s)
    if (edit_checked[s] && slots[s * detail::compute::k_edit_slots + detail::compute::k_edited] != 0)
      deferalloc::detail::log(
          log_level::warn, "step: shard " + std::to_string(s) + " ('" + shards[s].info.name + "'): its " +
                               to_string(shards[s].info.param_type) +
                               " parameter was changed outside the optimizer since the optimizer last wrote it; its "
                               "FP32 main was taken from it (main = float(param) where they differ) before the step");
  edit_checked.clear();
}

double streamed_adamw::grad_sq_norm(std::span<const void* const> grads, grad_type gt, stream_t stream) {
  auto& self = *impl_;
  impl::entry_guard g(self);
  DFA_EXPECTS(grads.size() == self.shards.size(), "grad_sq_norm: one gradient per shard expected");
  for (std::size_t s = 0; s < grads.size(); ++s)
    DFA_EXPECTS(grads[s] != nullptr, "grad_sq_norm: gradient of shard " + std::to_string(s) + " is null");
  self.after(self.exec(), stream);
  double s = 0;
  for (std::size_t i = 0; i < grads.size(); ++i)
    s += self.comp->sq_norm(grads[i], gt == grad_type::bf16, self.shards[i].info.numel, self.exec());
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
  auto& self = *impl_;
  impl::entry_guard g(self, "read_state_range", entry_needs::opened | entry_needs::initialized | entry_needs::settled);
  DFA_EXPECTS(out != nullptr || n == 0, "read_state_range: out is null");
  check_range("read_state_range", self.shards.size(), shard, a, offset, n,
              shard < self.shards.size() ? self.shards[shard].info.numel : 0, self.tier_home->traits().whole_arrays);
  if (n > 0) self.read_home(shard, a, offset, n, out);
}

void streamed_adamw::write_state_range(std::size_t shard, state_array a, std::size_t offset, std::size_t n,
                                       const float* in) {
  auto& self = *impl_;
  impl::entry_guard g(self, "write_state_range", entry_needs::opened | entry_needs::initialized);
  DFA_EXPECTS(in != nullptr || n == 0, "write_state_range: in is null");
  g.require("write_state_range", entry_needs::not_speculating | entry_needs::in_parent);
  check_range("write_state_range", self.shards.size(), shard, a, offset, n,
              shard < self.shards.size() ? self.shards[shard].info.numel : 0, self.tier_home->traits().whole_arrays);
  if (n == 0) return;
  self.ensure_state_write();
  self.retry.clear();  // the written state is the state: a failed step's retry runs whole
  // Main of an FP32 parameter is the parameter; the file tier also publishes its durable
  // copy, and a resident shard's arrays (Note [Resident shards on the file tier]).
  const bool param = a == state_array::main && param_is_main(self.shards[shard].info);
  const bool resident = self.shards[shard].resident;
  if (param) self.write_param(shard, offset, n, in);
  if (resident && !param) self.hbm_home->write(shard, a, offset, n, in);
  if (self.tier_home->traits().durable_params || (!resident && !param)) self.tier_home->write(shard, a, offset, n, in);
  if (is_moment(a)) self.moments_written = true;
}

void detail::inject_file_fault(streamed_adamw& o, file_fault_op op, file_fault_kind kind, std::uint64_t nth) {
  auto& self = *o.impl_;
  streamed_adamw::impl::entry_guard g(self, "inject_file_fault", entry_needs::opened);
  committed_store* store = self.tier_home->store();
  DFA_EXPECTS(store != nullptr, "inject_file_fault: the optimizer has no file tier", invalid_state);
  store->file().inject(op, kind, nth);
}

}  // namespace deferalloc::optim
