// The optimizer's C ABI (include/deferalloc/optimizer.h): streamed_adamw behind an
// opaque handle, for ctypes and other foreign callers.
//
// Each entry point runs through guard(), which maps every exception to a dfa_status and
// a thread-local message "dfa_opt_<call>: <cause>" (this library's own, beside the
// allocator's dfa_last_error()).  No global state besides that message: each handle
// owns its driver, pool and streams, built from the settings string, so any number can
// live in one process (the host driver's tests build several).
#include <deferalloc/context.hpp>
#include <deferalloc/errors.hpp>
#include <deferalloc/optimizer.h>
#include <deferalloc/optimizer.hpp>

#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "abi_guard.hpp"

struct dfa_optimizer {
  std::unique_ptr<deferalloc::optim::streamed_adamw> opt;
  dfa_progress_fn progress = nullptr;
  void* progress_user = nullptr;
};

namespace {

using namespace deferalloc;
using namespace deferalloc::optim;

thread_local std::string t_last_error;

template <typename F>
dfa_status guard(const char* call, F&& body) noexcept {
  return deferalloc::detail::abi_guard(call, t_last_error, std::forward<F>(body));
}

using deferalloc::detail::need;

streamed_adamw& opt_of(dfa_optimizer* o) {
  need(o, "the optimizer");
  return *o->opt;
}

// The optimizer's keys are rows of the one settings table (Note [Settings table] in
// allocator/core/config.cpp); unset ones keep optimizer_config's defaults.
std::pair<optimizer_config, settings> parse(const char* text) {
  settings s = parse_settings(text ? text : "");
  const optimizer_settings& o = s.optimizer;
  optimizer_config oc;
  if (o.tier) oc.home = parse_tier(*o.tier);
  if (o.directory) oc.directory = *o.directory;
  if (o.window_bytes) oc.window_bytes = *o.window_bytes;
  if (o.depth) oc.depth = *o.depth;
  if (o.resume) oc.resume = *o.resume;
  if (o.rank) oc.rank = *o.rank;
  if (o.io_threads) oc.io_threads = *o.io_threads;
  if (o.io_request_bytes) oc.io_request_bytes = *o.io_request_bytes;
  if (o.keep_window) oc.keep_window = *o.keep_window;
  if (o.resident_bytes) oc.resident_bytes = *o.resident_bytes;
  if (o.moments) oc.moments = parse_moment_format(*o.moments);
  if (o.progress_line) oc.progress_line = *o.progress_line;
  return {std::move(oc), std::move(s)};
}

value_type dtype_of(int t, const char* what) {
  if (t < 0 || t > 2) throw invalid_argument(std::string(what) + ": unknown dtype " + std::to_string(t));
  return static_cast<value_type>(t);
}

// The gradients' types of a step call (grad_dtypes null: each shard's parameter type),
// after checking its arguments.
std::vector<value_type> grad_types(const streamed_adamw& opt, const void* const* grads, std::size_t n,
                                   const int* grad_dtypes, const char* call) {
  need(grads, "grads");
  const auto& shards = opt.shards();
  if (n != shards.size())
    throw invalid_argument(std::to_string(n) + " gradients for " + std::to_string(shards.size()) + " shards");
  std::vector<value_type> gts(n);
  for (std::size_t i = 0; i < n; ++i) gts[i] = grad_dtypes ? dtype_of(grad_dtypes[i], call) : shards[i].param_type;
  return gts;
}

}  // namespace

extern "C" {

dfa_status dfa_opt_create(const char* text, dfa_optimizer** out) {
  return guard("dfa_opt_create", [&] {
    need(out, "out");
    *out = nullptr;
    auto [oc, s] = parse(text);
    auto h = std::make_unique<dfa_optimizer>();
    dfa_optimizer* raw = h.get();
    oc.on_progress = [raw](const progress& p) {
      if (raw->progress) raw->progress(p.phase, p.done_params, p.total_params, p.seconds, raw->progress_user);
    };
    set_log_level(s.level);
    h->opt = std::make_unique<streamed_adamw>(make_driver(s), std::move(oc));
    *out = h.release();
  });
}

dfa_status dfa_opt_destroy(dfa_optimizer* o) {
  return guard("dfa_opt_destroy", [&] { delete o; });
}

const char* dfa_opt_last_error(void) { return t_last_error.c_str(); }

dfa_status dfa_opt_add_shard(dfa_optimizer* o, void* param, size_t numel, dfa_dtype dtype, int group, const char* name,
                             size_t* index) {
  return guard("dfa_opt_add_shard", [&] {
    auto& opt = opt_of(o);
    const std::size_t i = opt.add_shard(param, numel, dtype_of(dtype, "dfa_opt_add_shard"), group, name ? name : "");
    if (index) *index = i;
  });
}

dfa_status dfa_opt_set_group(dfa_optimizer* o, int group, const dfa_adamw_params* p) {
  return guard("dfa_opt_set_group", [&] {
    need(p, "the hyper-parameters");
    opt_of(o).set_group(group, adamw_params{p->lr, p->beta1, p->beta2, p->eps, p->weight_decay});
  });
}

dfa_status dfa_opt_initialize(dfa_optimizer* o, void* stream) {
  return guard("dfa_opt_initialize", [&] { opt_of(o).initialize(stream_t{stream}); });
}

dfa_status dfa_opt_step(dfa_optimizer* o, const void* const* grads, size_t n, const int* grad_dtypes, float scale,
                        void* stream) {
  return guard("dfa_opt_step", [&] {
    auto& opt = opt_of(o);
    opt.step(std::span<const void* const>(grads, n), grad_types(opt, grads, n, grad_dtypes, "dfa_opt_step"), scale,
             stream_t{stream});
  });
}

dfa_status dfa_opt_step_speculative(dfa_optimizer* o, const void* const* grads, size_t n, const int* grad_dtypes,
                                    float scale, void* stream) {
  return guard("dfa_opt_step_speculative", [&] {
    auto& opt = opt_of(o);
    opt.step_speculative(std::span<const void* const>(grads, n),
                         grad_types(opt, grads, n, grad_dtypes, "dfa_opt_step_speculative"), scale, stream_t{stream});
  });
}

dfa_status dfa_opt_commit_speculation(dfa_optimizer* o) {
  return guard("dfa_opt_commit_speculation", [&] { opt_of(o).commit_speculation(); });
}

dfa_status dfa_opt_discard_speculation(dfa_optimizer* o) {
  return guard("dfa_opt_discard_speculation", [&] { opt_of(o).discard_speculation(); });
}

dfa_status dfa_opt_speculation_pending(dfa_optimizer* o, size_t* out) {
  return guard("dfa_opt_speculation_pending", [&] {
    need(out, "out");
    *out = opt_of(o).speculation_pending();
  });
}

dfa_status dfa_opt_can_speculate(dfa_optimizer* o, size_t shard, int* out) {
  return guard("dfa_opt_can_speculate", [&] {
    need(out, "out");
    *out = opt_of(o).can_speculate(shard) ? 1 : 0;
  });
}

dfa_status dfa_opt_sync_model_params(dfa_optimizer* o, void* stream) {
  return guard("dfa_opt_sync_model_params", [&] { opt_of(o).sync_model_params(stream_t{stream}); });
}

dfa_status dfa_opt_read_state(dfa_optimizer* o, size_t shard, dfa_state_array a, size_t offset, size_t n, float* out) {
  return guard("dfa_opt_read_state",
               [&] { opt_of(o).read_state_range(shard, static_cast<state_array>(a), offset, n, out); });
}

dfa_status dfa_opt_write_state(dfa_optimizer* o, size_t shard, dfa_state_array a, size_t offset, size_t n,
                               const float* in) {
  return guard("dfa_opt_write_state",
               [&] { opt_of(o).write_state_range(shard, static_cast<state_array>(a), offset, n, in); });
}

dfa_status dfa_opt_get_shard_step(dfa_optimizer* o, size_t shard, uint64_t* out) {
  return guard("dfa_opt_get_shard_step", [&] {
    need(out, "out");
    *out = opt_of(o).shard_step(shard);
  });
}

dfa_status dfa_opt_set_shard_step(dfa_optimizer* o, size_t shard, uint64_t step) {
  return guard("dfa_opt_set_shard_step", [&] { opt_of(o).set_shard_step(shard, step); });
}

dfa_status dfa_opt_begin_state_write(dfa_optimizer* o) {
  return guard("dfa_opt_begin_state_write", [&] { opt_of(o).begin_state_write(); });
}

dfa_status dfa_opt_end_state_write(dfa_optimizer* o, int publish) {
  return guard("dfa_opt_end_state_write", [&] { opt_of(o).end_state_write(publish != 0); });
}

dfa_status dfa_opt_set_shard_param(dfa_optimizer* o, size_t shard, void* param) {
  return guard("dfa_opt_set_shard_param", [&] { opt_of(o).set_shard_param(shard, param); });
}

dfa_status dfa_opt_save_checkpoint(dfa_optimizer* o, const char* dir) {
  return guard("dfa_opt_save_checkpoint", [&] {
    need(dir, "dir");
    opt_of(o).save_checkpoint(dir);
  });
}

dfa_status dfa_opt_load_checkpoint(dfa_optimizer* o, const char* dir) {
  return guard("dfa_opt_load_checkpoint", [&] {
    need(dir, "dir");
    opt_of(o).load_checkpoint(dir);
  });
}

dfa_status dfa_opt_set_progress(dfa_optimizer* o, dfa_progress_fn fn, void* user) {
  return guard("dfa_opt_set_progress", [&] {
    need(o, "the optimizer");
    o->progress = fn;
    o->progress_user = user;
  });
}

dfa_status dfa_opt_get_stats(dfa_optimizer* o, dfa_optimizer_stats* out) {
  return guard("dfa_opt_get_stats", [&] {
    auto& opt = opt_of(o);
    need(out, "out");
    const step_report r = opt.last_report();
    *out = dfa_optimizer_stats{};
    out->steps = opt.steps();
    out->shards = opt.shards().size();
    out->piece_elements = opt.piece_elements();
    out->seconds = r.seconds;
    out->params = r.params;
    out->pieces = r.pieces;
    out->bytes_to_device = r.bytes_to_device;
    out->bytes_from_device = r.bytes_from_device;
    out->peak_backed_bytes = r.peak_backed_bytes;
    out->map_seconds = r.map_seconds;
    out->retire_seconds = r.retire_seconds;
    out->io_wait_seconds = r.io_wait_seconds;
  });
}

}  // extern "C"
