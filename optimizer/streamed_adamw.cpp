// Note [Window pipeline]
//
// Rationale: the FP32 main params and Adam moments (12 B/param) are touched once per
// step, so they need HBM only while the step passes over them.  Each shard gets three
// deferred reservations (main, exp_avg, exp_avg_sq): stable device addresses that are
// backed piece by piece, while a fixed window budget bounds the physical memory.
//
// Approach
//  - A piece is n elements of one shard, all three arrays; n is the largest multiple of
//    the granule (in floats) with depth * 12 * n <= window_bytes.  The reservations are
//    padded to a multiple of n, so every piece maps the same chunk shapes: after the
//    first `depth` pieces the chunk pool (budget = window) serves every piece of the pass
//    from its cache; at the end of a pass the cache is trimmed, so that between steps
//    the state holds no HBM at all (3 * depth cuMemCreate per pass).
//  - Per piece, on three streams: materialize -> fetch (H2D from pinned home or
//    staging; never-written moments are zeroed on the device instead of copied) ->
//    kernel -> write-back (D2H) -> retire (host waits for that piece's write-back
//    event, then release).  With depth 3, fetch(i+1), step(i) and write-back(i-1)
//    overlap, and H2D and D2H run at once (the link is duplex).
//  - File tier: reads run `depth` pieces ahead into a ring of 2*depth pinned staging
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
// Limits: one pass at a time per optimizer (calls are serialized by a mutex); shards
// much smaller than a piece still map a whole piece.
#include <deferalloc/errors.hpp>
#include <deferalloc/optimizer.hpp>
#include <deferalloc/reservations.hpp>

#include <algorithm>
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

const char* to_string(tier t) noexcept {
  switch (t) {
    case tier::device: return "device";
    case tier::host: return "host";
    case tier::file: return "file";
  }
  return "unknown";
}

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

tier parse_tier(const std::string& s) {
  if (s == "device") return tier::device;
  if (s == "host") return tier::host;
  if (s == "file") return tier::file;
  throw invalid_argument("unknown state tier '" + s + "' (device, host or file)");
}

using clk = std::chrono::steady_clock;
using detail::adamw_scalars;
using detail::file_store;

namespace {
double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }
}  // namespace

// ---- construction -------------------------------------------------------------------

streamed_adamw::streamed_adamw(std::shared_ptr<driver> drv, optimizer_config cfg) : impl_(std::make_unique<impl>()) {
  auto& I = *impl_;
  DFA_EXPECTS(drv != nullptr, "streamed_adamw: driver is null");
  DFA_EXPECTS(cfg.depth >= 1, "streamed_adamw: depth must be at least 1");
  DFA_EXPECTS(cfg.home != tier::file || !cfg.directory.empty(), "streamed_adamw: the file tier needs a directory");
  validate(cfg.adamw);
  DFA_EXPECTS(cfg.moments == moment_format::fp32 || cfg.home == tier::host,
              std::string("streamed_adamw: ") + to_string(cfg.moments) + " moments need the host tier (the " +
                  to_string(cfg.home) + " tier keeps fp32 moments)");
  DFA_EXPECTS(cfg.resident_bytes == 0 || cfg.home == tier::host,
              std::string("streamed_adamw: resident_bytes needs the host tier (the ") + to_string(cfg.home) +
                  " tier keeps all or none of its state in HBM)");
  I.drv = std::move(drv);
  I.cfg = std::move(cfg);
  const std::size_t g = I.drv->granularity();
  if (I.cfg.home != tier::device) {
    // File tier: pieces are whole checksum blocks (see Note [File tier integrity]).
    const std::size_t gran_elems = std::max(g, I.cfg.home == tier::file ? file_store::block : std::size_t{1}) / 4;
    const std::size_t per_piece = I.cfg.window_bytes / (12 * static_cast<std::size_t>(I.cfg.depth));  // params
    I.piece = per_piece / gran_elems * gran_elems;
    DFA_EXPECTS(I.piece > 0, "streamed_adamw: window_bytes " + std::to_string(I.cfg.window_bytes) + " is too small: depth " +
                                 std::to_string(I.cfg.depth) + " needs at least " +
                                 std::to_string(12 * I.cfg.depth * gran_elems * 4) + " bytes");
    // One chunk per array per piece: the fewest map/unmap calls (each may stall the GPU's
    // copy engines briefly); every piece has that shape (reservations padded to pieces).
    // Budget: the window and the resident shards (Note [Resident shards]); the cache
    // holds the window's chunks only (resident chunks stay taken).
    I.pool = std::make_shared<chunk_pool>(
        I.drv, chunk_pool_config{{I.piece * 4}, I.cfg.window_bytes + I.cfg.resident_bytes, I.cfg.window_bytes});
  } else {
    I.pool = std::make_shared<chunk_pool>(I.drv);
  }
  I.mgr = std::make_unique<reservation_manager>(I.pool);
  I.comp = detail::make_compute(*I.drv);
  I.h2d = I.drv->create_stream();
  I.d2h = I.drv->create_stream();
  I.exec = I.drv->create_stream();
}

streamed_adamw::~streamed_adamw() {
  if (!impl_) return;
  auto& I = *impl_;
  try {
    I.drv->synchronize_stream(I.h2d);
    I.drv->synchronize_stream(I.exec);
    I.drv->synchronize_stream(I.d2h);
  } catch (const std::exception& e) {
    deferalloc::detail::log(log_level::error, std::string("streamed_adamw: ") + e.what());
  }
  I.free_staging();
  for (auto& s : I.shards)
    for (float* h : s.home) I.drv->host_free(h);
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
  const std::size_t bytes =
      I.cfg.home == tier::device ? numel * 4 : (numel + I.piece - 1) / I.piece * I.piece * 4;
  std::size_t made = 0;
  try {
    for (; made < 3; ++made) s.res[k_state_arrays[made]] = I.mgr->reserve(bytes);
    if (I.cfg.home == tier::device) {
      std::vector<range> rs{{s.res[state_array::exp_avg], 0, whole}, {s.res[state_array::exp_avg_sq], 0, whole}};
      I.mgr->materialize(rs, fill_mode::zero, I.exec);
      I.mgr->materialize(s.res[state_array::main], 0, whole, fill_mode::undefined, I.exec);
    } else if (I.cfg.home == tier::host) {
      const std::size_t mb = detail::moment_bytes(static_cast<int>(I.cfg.moments), numel);
      for (state_array a : k_state_arrays) s.home[a] = static_cast<float*>(I.drv->host_alloc(is_moment(a) ? mb : numel * 4));
      // Zero moments at home: a shard skipped by the first steps, or state loaded into
      // some shards only, reads zeros (PyTorch's initial moments), never garbage.
      // (Compressed: zero codes and zero scales decode to zero.)
      std::memset(s.home[state_array::exp_avg], 0, mb);
      std::memset(s.home[state_array::exp_avg_sq], 0, mb);
    }
  } catch (...) {
    for (float*& h : s.home)
      if (h) I.drv->host_free(h), h = nullptr;
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
  if (!I.shards.empty()) I.ensure_file();  // opens the state file: a damaged one throws here
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
  std::lock_guard lk(impl_->mu);
  DFA_EXPECTS(s < impl_->shards.size(), "set_shard_step: no shard " + std::to_string(s));
  impl_->shards[s].step = step;
}
std::size_t streamed_adamw::piece_elements() const { return impl_->piece; }
step_report streamed_adamw::last_report() const { return impl_->report; }
reservation_manager& streamed_adamw::reservations() { return *impl_->mgr; }

// ---- the pipeline -------------------------------------------------------------------

void streamed_adamw::impl::ensure_file() {
  if (file || cfg.home != tier::file) return;
  std::vector<std::size_t> numel;
  for (auto& s : shards) numel.push_back(s.info.numel);
  file = std::make_unique<file_store>(cfg.directory, cfg.rank, numel, cfg.resume, cfg.io_threads, cfg.io_request_bytes);
  if (file->resumed()) {
    step_count = file->committed_step();
    for (auto& s : shards) s.step = step_count;  // one count per file (see the header)
    moments_written = file->moments_written();
    initialized = true;
  }
}

void streamed_adamw::impl::ensure_staging() {
  if (!stage_in.empty()) return;
  stage_bytes = 3 * file_store::io_bytes(piece);
  try {
    for (int i = 0; i < 2 * cfg.depth; ++i) stage_in.push_back(drv->host_alloc(stage_bytes));
    for (int i = 0; i < 2 * cfg.depth; ++i) stage_out.push_back(drv->host_alloc(stage_bytes));
  } catch (...) {
    free_staging();
    throw;
  }
}

void streamed_adamw::impl::free_staging() noexcept {
  for (void* p : stage_in) drv->host_free(p);
  for (void* p : stage_out) drv->host_free(p);
  stage_in.clear();
  stage_out.clear();
}

event_t streamed_adamw::impl::event(std::size_t i) {
  while (events.size() <= i) events.push_back(drv->create_event());
  return events[i];
}

void streamed_adamw::impl::after(stream_t waiter, stream_t producer) {
  event_t e = event(0);
  drv->record(e, producer);
  drv->stream_wait(waiter, e);
}

std::vector<streamed_adamw::impl::piece_ref> streamed_adamw::impl::pieces(std::span<const void* const> grads) const {
  std::vector<piece_ref> out;
  for (std::size_t s = 0; s < shards.size(); ++s)
    if (!shards[s].resident && (grads.empty() || grads[s] != nullptr || cfg.home == tier::file))
      for (std::size_t e0 = 0; e0 < shards[s].info.numel; e0 += piece)
      out.push_back({s, e0, std::min(piece, shards[s].info.numel - e0)});
  return out;
}

adamw_scalars streamed_adamw::impl::scalars(std::size_t s, float grad_scale) const {
  auto it = groups.find(shards[s].info.group);
  const adamw_params& h = it == groups.end() ? cfg.adamw : it->second;
  return detail::make_scalars(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, shards[s].step + 1, grad_scale,
                              [this](float base, float e) { return comp->pow(base, e); });
}

std::size_t streamed_adamw::impl::move_moment(const piece_ref& p, state_array a, float* dev, bool to_device, stream_t s) {
  const int f = static_cast<int>(cfg.moments);
  char* home = reinterpret_cast<char*>(shards[p.shard].home[a]);
  auto copy = [&](char* d, char* h, std::size_t bytes) {
    if (to_device) drv->copy_async(d, h, bytes, s);
    else drv->copy_async(h, d, bytes, s);
    return bytes;
  };
  char* d = reinterpret_cast<char*>(dev);
  if (f == detail::k_mom_bf16) return copy(d, home + 2 * p.e0, 2 * p.n);
  // int8: the piece's codes, then its blocks' scales (pieces start on a block: the
  // piece size is a multiple of the granule, itself of 256 elements).
  const std::size_t numel = shards[p.shard].info.numel;
  return copy(d, home + p.e0, p.n) +
         copy(d + detail::q_scales_offset(p.n), home + detail::q_scales_offset(numel) + 4 * (p.e0 / detail::k_qblock),
              4 * detail::q_blocks(p.n));
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

// One pass over every piece.  See Note [Window pipeline].
void streamed_adamw::impl::run_pass(pass kind, std::span<const void* const> grads, std::span<const value_type> gts,
                                    float grad_scale, stream_t user, std::size_t skip) {
  const auto ps = pieces(grads);
  const std::size_t P = ps.size();
  const int K = cfg.depth;
  const bool to_file = cfg.home == tier::file;
  const int arrays = kind == pass::step ? 3 : 1;
  const bool fetch_main = kind != pass::init;
  const bool write_back = kind != pass::export_bf16;
  const bool compressed = cfg.moments != moment_format::fp32;  // host tier only (constructor)
  const int read_slot = to_file ? file->active_slot() : 0;
  const int write_slot = kind == pass::step ? 1 - read_slot : read_slot;
  std::vector<adamw_scalars> ks;
  if (kind == pass::step)
    for (std::size_t s = 0; s < shards.size(); ++s) ks.push_back(scalars(s, grad_scale));
  if (to_file) ensure_staging();

  auto t0 = clk::now(), last_line = t0;
  report = step_report{};
  pool->reset_peak();
  std::size_t params = 0, done_params = 0;
  for (std::size_t j = skip; j < P; ++j) params += ps[j].n;

  // The kernels read what the user's stream produced (gradients, BF16 params).
  after(exec, user);

  std::vector<bool> mapped(P, false), wb_issued(P, false);
  std::vector<std::shared_ptr<detail::io_batch>> reads(P), writes(P);
  const std::size_t pbytes = piece * 4;
  auto ranges_of = [&](const piece_ref& p) {
    std::vector<range> rs;
    for (state_array a : first_arrays(arrays)) rs.push_back({shards[p.shard].res[a], p.e0 * 4, pbytes});
    return rs;
  };
  auto ev = [&](std::size_t i, int which) { return event(1 + (i % K) * 3 + which); };
  auto host_ptr = [&](std::size_t i, state_array a, bool out) -> char* {
    const auto& p = ps[i];
    if (!to_file) return reinterpret_cast<char*>(shards[p.shard].home[a] + p.e0);
    auto& ring = out ? stage_out : stage_in;
    return static_cast<char*>(ring[i % (2 * K)]) + array_index(a) * file_store::io_bytes(piece);
  };
  auto issue_read = [&](std::size_t j) {
    if (!to_file || !fetch_main || j >= P || j < skip) return;
    const auto& p = ps[j];
    const int n_arr = kind == pass::step && moments_written ? 3 : 1;
    for (state_array a : first_arrays(n_arr))
      reads[j] = file->read(host_ptr(j, a, false), file_store::io_bytes(p.n), file->offset(read_slot, p.shard, a, p.e0),
                            "state of " + where(p), reads[j]);
  };
  auto materialize = [&](std::size_t i) {
    auto rs = ranges_of(ps[i]);
    const auto t = clk::now();
    mgr->materialize(rs, fill_mode::undefined, h2d);
    report.map_seconds += since(t);
    mapped[i] = true;
  };
  auto retire = [&](std::size_t i) {
    const auto& p = ps[i];
    auto rs = ranges_of(p);
    const auto t = clk::now();
    mgr->release_after(rs, keep_mode::discard, ev(i, 2));  // this piece only, not later queued work
    report.retire_seconds += since(t);
    mapped[i] = false;
    if (to_file && write_back)
      for (state_array a : first_arrays(arrays))
        writes[i] = file->write(host_ptr(i, a, true), file_store::io_bytes(p.n), file->offset(write_slot, p.shard, a, p.e0),
                                "state of " + where(p), writes[i]);
    done_params += p.n;
    report_progress(kind == pass::init ? "init" : kind == pass::step ? "step" : "sync", done_params, params, t0, last_line);
  };

  std::size_t i = skip;
  try {
    for (std::size_t j = skip; j < std::min(P, skip + 2 * static_cast<std::size_t>(K)); ++j) issue_read(j);
    // The first K pieces' memory before any write-back: OOM here changes nothing.
    for (std::size_t j = skip; j < std::min(P, skip + static_cast<std::size_t>(K)); ++j) materialize(j);
    for (; i < P; ++i) {
      const auto& p = ps[i];
      const auto& sh = shards[p.shard];
      if (i >= skip + K) {
        retire(i - K);
        issue_read(i + K);
        materialize(i);
      }
      per_array<float*> dev;
      for (state_array a : k_state_arrays) dev[a] = sh.device(a) + p.e0;
      // Fetch.
      if (fetch_main) {
        if (to_file) {
          const auto t = clk::now();
          reads[i]->wait();
          report.io_wait_seconds += since(t);
        }
        drv->copy_async(dev[state_array::main], host_ptr(i, state_array::main, false), p.n * 4, h2d);
        report.bytes_to_device += p.n * 4;
      }
      if (kind == pass::step)
        for (state_array a : {state_array::exp_avg, state_array::exp_avg_sq}) {
          if (moments_written && compressed) {
            report.bytes_to_device += move_moment(p, a, dev[a], true, h2d);
          } else if (moments_written) {
            drv->copy_async(dev[a], host_ptr(i, a, false), p.n * 4, h2d);
            report.bytes_to_device += p.n * 4;
          } else {
            drv->zero_async(dev[a], p.n * 4, h2d);  // never written: zero by construction
          }
        }
      drv->record(ev(i, 0), h2d);
      // Compute.
      drv->stream_wait(exec, ev(i, 0));
      const int mt = static_cast<int>(sh.info.param_type);
      char* model = static_cast<char*>(sh.info.param) + p.e0 * (mt == detail::k_fp32 ? 4 : 2);
      if (kind == pass::init) {
        comp->upcast(model, mt, dev[state_array::main], p.n, exec);
      } else if (kind == pass::export_bf16) {
        comp->downcast(dev[state_array::main], model, mt, p.n, exec);
      } else if (grads[p.shard] != nullptr && compressed) {
        const int gt = static_cast<int>(gts[p.shard]);
        comp->adamw_moments({dev[state_array::main], dev[state_array::exp_avg], dev[state_array::exp_avg_sq], model,
                             static_cast<const char*>(grads[p.shard]) + p.e0 * (gt == detail::k_fp32 ? 4 : 2), mt, gt,
                             static_cast<int>(cfg.moments), p.n},
                            ks[p.shard], exec);
      } else if (grads[p.shard] != nullptr) {  // (file tier: a skipped shard's piece is carried over unchanged)
        const int gt = static_cast<int>(gts[p.shard]);
        comp->adamw({dev[state_array::main], dev[state_array::exp_avg], dev[state_array::exp_avg_sq], model,
                     static_cast<const char*>(grads[p.shard]) + p.e0 * (gt == detail::k_fp32 ? 4 : 2), mt, gt, p.n},
                    ks[p.shard], exec);
      }
      drv->record(ev(i, 1), exec);
      // Write back.
      drv->stream_wait(d2h, ev(i, 1));
      if (write_back) {
        if (to_file && i >= skip + 2 * static_cast<std::size_t>(K) && writes[i - 2 * K]) {
          const auto t = clk::now();
          writes[i - 2 * K]->wait();
          report.io_wait_seconds += since(t);
        }
        for (state_array a : first_arrays(arrays)) {
          if (is_moment(a) && compressed) {
            report.bytes_from_device += move_moment(p, a, dev[a], false, d2h);
            continue;
          }
          drv->copy_async(host_ptr(i, a, true), dev[a], p.n * 4, d2h);
          report.bytes_from_device += p.n * 4;
        }
      }
      drv->record(ev(i, 2), d2h);
      wb_issued[i] = true;
    }
    for (std::size_t j = P > static_cast<std::size_t>(K) ? std::max(skip, P - K) : skip; j < P; ++j) retire(j);
    if (to_file)
      for (auto& w : writes)
        if (w) w->wait();
  } catch (...) {
    // Drain: every stream and every I/O request, then give the window back.
    try {
      drv->synchronize_stream(h2d);
      drv->synchronize_stream(exec);
      drv->synchronize_stream(d2h);
    } catch (...) {
      deferalloc::detail::log_current("streamed_adamw: draining the streams after a failed pass");
    }
    for (auto* v : {&reads, &writes})
      for (auto& b : *v)
        if (b) try {
            b->wait();
          } catch (...) {
            deferalloc::detail::log_current("streamed_adamw: waiting for I/O after a failed pass");
          }
    for (std::size_t j = 0; j < P; ++j)
      if (mapped[j]) try {
          auto rs = ranges_of(ps[j]);
          mgr->release(rs, keep_mode::discard, d2h);
        } catch (...) {
          deferalloc::detail::log_current("streamed_adamw: releasing the window after a failed pass");
        }
    pool->trim();
    std::size_t written = skip;
    while (written < P && wb_issued[written]) ++written;
    failed_pieces_done = written;
    const std::string at = i < P ? " at " + where(ps[i]) : "";
    // The same class as the cause (no_device stays no_device), the cause nested in it.
    rethrow_with_context(std::string(kind == pass::init ? "initialize" : kind == pass::step ? "step" : "sync") +
                         " failed" + at);
  }
  report.seconds = since(t0);
  report.params = params;
  report.pieces = P - skip;
  report.peak_backed_bytes = pool->stats().peak_alive_bytes;
  // Between passes the state holds no HBM: the window's chunks go back to the driver
  // (3 * depth cuMemRelease here and as many cuMemCreate in the next pass, microseconds
  // against a pass of milliseconds).  keep_window keeps them for back-to-back passes.
  if (!cfg.keep_window) pool->trim();
}

// ---- initialize / step ---------------------------------------------------------------

void streamed_adamw::initialize(stream_t stream) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  DFA_EXPECTS(!I.shards.empty(), "initialize: no shard registered", invalid_state);
  I.ensure_file();
  DFA_EXPECTS(!I.initialized, I.file && I.file->resumed()
                                  ? "initialize: the file tier resumed committed state at step " +
                                        std::to_string(I.step_count) + " (call sync_model_params, not initialize)"
                                  : std::string("initialize: already initialized"),
              invalid_state);
  if (I.cfg.home == tier::device) {
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
    if (I.file) I.file->commit(0, I.file->active_slot(), false);
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
  DFA_EXPECTS(I.initialized, "step: call initialize() first", invalid_state);
  DFA_EXPECTS(grads.size() == I.shards.size(), "step: " + std::to_string(grads.size()) + " gradients for " +
                                                   std::to_string(I.shards.size()) + " shards");
  DFA_EXPECTS(gts.size() == I.shards.size(), "step: " + std::to_string(gts.size()) + " gradient types for " +
                                                 std::to_string(I.shards.size()) + " shards");
  for (value_type t : gts)
    DFA_EXPECTS(t == value_type::bf16 || t == value_type::fp16 || t == value_type::fp32,
                "step: unknown gradient type " + std::to_string(static_cast<int>(t)));
  DFA_EXPECTS(std::isfinite(grad_scale), "step: grad_scale is not finite");

  // An in-place step that failed part-way resumes where it stopped (same gradients).
  const std::size_t skip = I.failed_step == I.step_count + 1 ? I.failed_pieces_done : 0;
  try {
    if (I.cfg.home == tier::device) {
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
      if (I.file) I.file->commit(I.step_count + 1, 1 - I.file->active_slot(), true);
      I.after(stream, I.exec);
    }
  } catch (...) {
    if (I.cfg.home == tier::file) {
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

void streamed_adamw::sync_model_params(stream_t stream) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  I.ensure_file();
  DFA_EXPECTS(I.initialized, "sync_model_params: no state yet (initialize() or resume first)", invalid_state);
  I.sync_model(stream);
}

void streamed_adamw::impl::sync_model(stream_t stream) {
  after(exec, stream);
  sync_device_shards(cfg.home == tier::device);
  if (cfg.home != tier::device) run_pass(pass::export_bf16, {}, {}, 1.0f, stream, 0);
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
                 std::size_t numel, bool file) {
  DFA_EXPECTS(s < shards, std::string(fn) + ": no shard " + std::to_string(s));
  DFA_EXPECTS(static_cast<int>(a) >= 0 && static_cast<int>(a) < 3,
              std::string(fn) + ": unknown state array " + std::to_string(static_cast<int>(a)));
  DFA_EXPECTS(offset <= numel && n <= numel - offset, std::string(fn) + ": range [" + std::to_string(offset) + ", " +
                                                         std::to_string(offset + n) + ") outside shard " +
                                                         std::to_string(s) + " of " + std::to_string(numel) + " elements");
  DFA_EXPECTS(!file || (offset == 0 && n == numel),
              std::string(fn) + ": the file tier takes whole arrays only (offset 0, n = numel)");
}
}  // namespace

void streamed_adamw::read_state_range(std::size_t shard, state_array a, std::size_t offset, std::size_t n, float* out) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  I.ensure_file();
  DFA_EXPECTS(I.initialized, "read_state_range: no state yet (initialize() first)", invalid_state);
  DFA_EXPECTS(out != nullptr || n == 0, "read_state_range: out is null");
  check_range("read_state_range", I.shards.size(), shard, a, offset, n,
              shard < I.shards.size() ? I.shards[shard].info.numel : 0, I.cfg.home == tier::file);
  if (n > 0) I.read_home(shard, a, offset, n, out);
}

void streamed_adamw::write_state_range(std::size_t shard, state_array a, std::size_t offset, std::size_t n,
                                       const float* in) {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  I.ensure_file();
  DFA_EXPECTS(I.initialized, "write_state_range: no state yet (initialize() first)", invalid_state);
  DFA_EXPECTS(in != nullptr || n == 0, "write_state_range: in is null");
  check_range("write_state_range", I.shards.size(), shard, a, offset, n,
              shard < I.shards.size() ? I.shards[shard].info.numel : 0, I.cfg.home == tier::file);
  if (n == 0) return;
  auto& sh = I.shards[shard];
  switch (I.home_of(shard)) {
    case tier::device: {
      I.drv->copy_async(sh.device(a) + offset, in, n * 4, I.exec);
      I.drv->synchronize_stream(I.exec);
      break;
    }
    case tier::host:
      if (is_moment(a) && I.cfg.moments != moment_format::fp32)
        detail::encode_moments(static_cast<int>(I.cfg.moments), a, sh.home[a], sh.info.numel, offset, n, in);
      else
        std::memcpy(sh.home[a] + offset, in, n * 4);
      break;
    case tier::file: {
      const int slot = I.file->active_slot();
      // Whole arrays through an aligned bounce buffer, in pieces on checksum-block
      // boundaries (write_home's file case pads each piece to whole blocks).
      constexpr std::size_t piece = std::size_t{8} << 20;  // elements: 32 MiB
      detail::aligned_buffer buf(file_store::io_bytes(piece), false, "write_state_range: no host memory for a bounce buffer");
      auto write_array = [&](std::size_t s, state_array m, const float* src) {
        const std::size_t numel = I.shards[s].info.numel;
        for (std::size_t e0 = 0; e0 < numel; e0 += piece) {
          const std::size_t k = std::min(piece, numel - e0);
          if (src) std::memcpy(buf.p, src + e0, k * 4);
          else std::memset(buf.p, 0, k * 4);
          I.write_home(s, m, e0, k, reinterpret_cast<float*>(buf.p), slot);
        }
      };
      if (is_moment(a) && !I.moments_written) {
        // The file holds no moments yet: zeros everywhere first, so that the shards not
        // loaded read PyTorch's initial moments.
        for (std::size_t s = 0; s < I.shards.size(); ++s)
          for (state_array m : {state_array::exp_avg, state_array::exp_avg_sq}) write_array(s, m, nullptr);
        I.file->commit(I.step_count, slot, true);
      }
      write_array(shard, a, in);
      // The slot's checksum table now covers the new bytes: publish it (same step).
      I.file->commit(I.step_count, slot, I.moments_written || is_moment(a));
      break;
    }
  }
  if (is_moment(a)) I.moments_written = true;
}

void detail::inject_file_fault(streamed_adamw& o, file_fault_op op, file_fault_kind kind, std::uint64_t nth) {
  auto& I = *o.impl_;
  std::lock_guard lk(I.mu);
  I.ensure_file();
  DFA_EXPECTS(I.file != nullptr, "inject_file_fault: the optimizer has no file tier", invalid_state);
  I.file->inject(op, kind, nth);
}

}  // namespace deferalloc::optim
