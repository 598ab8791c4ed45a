// The optimizer's C ABI (include/deferalloc/optimizer.h): streamed_adamw behind an
// opaque handle, for ctypes and other foreign callers.
//
// Each entry point runs through guard(), which maps every exception to a dfa_status and
// a thread-local message "dfa_opt_<call>: <cause>" (this library's own, beside the
// allocator's dfa_last_error()).  No global state besides that message: each handle
// owns its driver, pool and streams, built from its settings (the typed
// dfa_optimizer_config or a settings string, both through the optimizer's settings table:
// Note [Optimizer settings] in optimizer/settings.cpp), so any number can live in one
// process (the host driver's tests build several).  Arguments: null pointers, struct_size
// and the config's enums are checked here, the rest by streamed_adamw (Note [Arguments
// are checked where they enter] in docs/DESIGN.md).
#include <deferalloc/core/context.hpp>
#include <deferalloc/core/errors.hpp>
#include <deferalloc/optim/optimizer.hpp>
#include <deferalloc/optim/optimizer_settings.hpp>
#include <deferalloc/optimizer.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <string_view>
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
using deferalloc::detail::enum_from_c;

streamed_adamw& opt_of(dfa_optimizer* o) {
  need(o, "the optimizer");
  return *o->opt;
}

static_assert(DFA_TIER_DEVICE == int(tier::device) && DFA_TIER_HOST == int(tier::host) && DFA_TIER_FILE == int(tier::file));
static_assert(DFA_MOMENTS_FP32 == int(moment_format::fp32) && DFA_MOMENTS_BF16 == int(moment_format::bf16) &&
              DFA_MOMENTS_INT8 == int(moment_format::int8));
static_assert(DFA_DRIVER_AUTO == int(driver_kind::automatic) && DFA_DRIVER_CUDA == int(driver_kind::cuda) &&
              DFA_DRIVER_HOST == int(driver_kind::host));

void need_known_size(const dfa_optimizer_config* c) {
  need(c, "the config");
  if (c->struct_size != sizeof(dfa_optimizer_config))
    throw invalid_argument("dfa_optimizer_config: struct_size is " + std::to_string(c->struct_size) +
                           ", this library knows " + std::to_string(sizeof(dfa_optimizer_config)) +
                           " (set struct_size = sizeof(dfa_optimizer_config) from this library's optimizer.h)");
}

bool is_optimizer_key(const std::string& key) {
  for (const setting_doc& d : optimizer_settings_table())
    if (key == d.key) return true;
  return false;
}

// An enumeration field's value, checked against its last enumerator.
int enumerator(const char* field, int v, int last) {
  if (v < 0 || v > last)
    throw invalid_argument("dfa_optimizer_config: " + std::string(field) + " is " + std::to_string(v) + ", not one of 0 .. " +
                           std::to_string(last));
  return v;
}

// A typed config through the same rows as a settings text: each field is its key's value.
engine_settings from_config(const dfa_optimizer_config* c) {
  need_known_size(c);
  engine_settings e;
  auto keys = parse_config_text(c->allocator_settings ? c->allocator_settings : "");
  for (const auto& [key, v] : keys)
    if (key == "driver" || key == "device" || is_optimizer_key(key))
      throw invalid_argument("dfa_optimizer_config: allocator_settings names '" + key +
                             "', a field of dfa_optimizer_config");
  const char* const drivers[] = {"auto", "cuda", "host"};
  keys["driver"] = {{drivers[enumerator("driver", c->driver, DFA_DRIVER_HOST)]}, false};
  keys["device"] = {{std::to_string(c->device)}, false};
  e.allocator = settings_from(keys);
  auto set = [&](const char* key, std::string v) { apply_optimizer_setting(e.optimizer, key, {{std::move(v)}, false}); };
  auto flag = [](int v) { return std::string(v != 0 ? "1" : "0"); };
  set("tier", to_string(static_cast<tier>(enumerator("tier", c->tier, DFA_TIER_FILE))));
  if (c->directory) set("directory", c->directory);
  set("window_mb", std::to_string(c->window_mb));
  set("depth", std::to_string(c->depth));
  set("resume", flag(c->resume));
  set("rank", std::to_string(c->rank));
  set("io_threads", std::to_string(c->io_threads));
  set("io_request_mb", std::to_string(c->io_request_mb));
  set("keep_window", flag(c->keep_window));
  set("resident_mb", std::to_string(c->resident_mb));
  set("moments", to_string(static_cast<moment_format>(enumerator("moments", c->moments, DFA_MOMENTS_INT8))));
  set("progress_line", flag(c->progress_line));
  set("pass_taper", flag(c->pass_taper));
  set("pass_chain", flag(c->pass_chain));
  set("writeback_queue_mb", std::to_string(c->writeback_queue_mb));
  return e;
}

// Note [Applying a settings text to the typed config]
// Rationale: a face that takes settings from several places (DEFERALLOC_CONF, keyword
// arguments, a settings= text) must merge them in one order without splitting any text
// itself: a value given as a typed field (a directory with a comma) is never parsed, and
// a key is checked by its table's row wherever it comes from.
// Approach: dfa_opt_config_apply_text parses the text once; each optimizer key goes
// through its row into a scratch optimizer_config and that one field is copied into the
// struct; driver and device go through the allocator's rows; every other key is checked
// by the allocator's table (its value too) and handed back as "key:value" text for
// allocator_settings.  The struct is changed only when the whole text is good.
// Limits: a directory set by text is an interned copy that lives as long as the process
// (the struct holds a const char*); a face sets it once or a few times.
const char* interned(const std::string& s) {
  static std::mutex m;
  static std::set<std::string> strings;  // nodes never move: c_str() stays valid
  std::lock_guard lock(m);
  return strings.insert(s).first->c_str();
}

// One optimizer key's field of the struct, from a scratch config its row has set.
void copy_field(dfa_optimizer_config& c, const std::string& key, const optimizer_config& oc) {
  if (key == "tier") c.tier = static_cast<int>(oc.home);
  else if (key == "directory") c.directory = interned(oc.directory);
  else if (key == "window_mb") c.window_mb = oc.window_bytes >> 20;
  else if (key == "depth") c.depth = oc.depth;
  else if (key == "resume") c.resume = oc.resume ? 1 : 0;
  else if (key == "rank") c.rank = oc.rank;
  else if (key == "io_threads") c.io_threads = oc.io_threads;
  else if (key == "io_request_mb") c.io_request_mb = oc.io_request_bytes >> 20;
  else if (key == "keep_window") c.keep_window = oc.keep_window ? 1 : 0;
  else if (key == "resident_mb") c.resident_mb = oc.resident_bytes >> 20;
  else if (key == "moments") c.moments = static_cast<int>(oc.moments);
  else if (key == "progress_line") c.progress_line = oc.progress_line ? 1 : 0;
  else if (key == "pass_taper") c.pass_taper = oc.pass_taper ? 1 : 0;
  else if (key == "pass_chain") c.pass_chain = oc.pass_chain ? 1 : 0;
  else if (key == "writeback_queue_mb") c.writeback_queue_mb = oc.writeback_queue_bytes >> 20;
  else throw invalid_argument("dfa_opt_config_apply_text: no field for the optimizer key '" + key + "'");
}

std::string as_text(const std::string& key, const config_value& v) {
  std::string out = key + ":";
  if (!v.is_list) return out + v.items.at(0);
  out += "[";
  for (std::size_t i = 0; i < v.items.size(); ++i) out += (i ? "," : "") + v.items[i];
  return out + "]";
}

// The struct after `text`, and the allocator's keys of `text` as text.
std::string apply_text(dfa_optimizer_config& c, std::string_view text) {
  std::string rest;
  for (const auto& [key, v] : parse_config_text(text)) {
    optimizer_config scratch;
    if (apply_optimizer_setting(scratch, key, v)) {
      copy_field(c, key, scratch);
      continue;
    }
    const settings s = settings_from({{key, v}});  // checks the key and its value
    if (key == "driver") c.driver = static_cast<int>(s.driver);
    else if (key == "device") c.device = s.device;
    else rest += (rest.empty() ? "" : ",") + as_text(key, v);
  }
  return rest;
}

dfa_optimizer* create(engine_settings e) {
  auto h = std::make_unique<dfa_optimizer>();
  dfa_optimizer* raw = h.get();
  e.optimizer.on_progress = [raw](const progress& p) {
    if (raw->progress) raw->progress(p.phase, p.done_params, p.total_params, p.seconds, raw->progress_user);
  };
  set_log_level(e.allocator.level);
  h->opt = std::make_unique<streamed_adamw>(make_driver(e.allocator), std::move(e.optimizer));
  return h.release();
}

// The gradients' types of a step call (grad_dtypes null: each shard's parameter type);
// the step checks their number and values.
std::vector<value_type> grad_types(const streamed_adamw& opt, const void* const* grads, std::size_t n,
                                   const int* grad_dtypes) {
  need(grads, "grads");
  const auto& shards = opt.shards();
  // A count other than the shards' is refused by the step before it reads anything: the
  // caller's arrays are not read past what the step would read either.
  if (n != shards.size()) return {};
  std::vector<value_type> gts(n);
  for (std::size_t i = 0; i < n; ++i)
    gts[i] = grad_dtypes ? static_cast<value_type>(grad_dtypes[i]) : shards[i].param_type;
  return gts;
}

}  // namespace

extern "C" {

dfa_status dfa_opt_config_init(dfa_optimizer_config* c) {
  return guard("dfa_opt_config_init", [&] {
    need_known_size(c);
    const optimizer_config d;
    const settings s;
    *c = dfa_optimizer_config{};
    c->struct_size = sizeof *c;
    c->driver = static_cast<int>(s.driver);
    c->device = s.device;
    c->tier = static_cast<int>(d.home);
    c->window_mb = d.window_bytes >> 20;
    c->depth = d.depth;
    c->resume = d.resume;
    c->rank = d.rank;
    c->io_threads = d.io_threads;
    c->io_request_mb = d.io_request_bytes >> 20;
    c->keep_window = d.keep_window;
    c->resident_mb = d.resident_bytes >> 20;
    c->moments = static_cast<int>(d.moments);
    c->progress_line = d.progress_line;
    c->pass_taper = d.pass_taper;
    c->pass_chain = d.pass_chain;
    c->writeback_queue_mb = d.writeback_queue_bytes >> 20;
  });
}

dfa_status dfa_opt_config_apply_text(dfa_optimizer_config* c, const char* text, char* rest, size_t cap,
                                     size_t* needed) {
  return guard("dfa_opt_config_apply_text", [&] {
    need_known_size(c);
    need(needed, "needed");
    dfa_optimizer_config next = *c;
    const std::string r = apply_text(next, text ? text : "");
    *needed = r.size() + 1;
    if (rest == nullptr || cap < r.size() + 1)
      throw invalid_argument("rest buffer too small: " + std::to_string(r.size() + 1) + " bytes needed");
    std::memcpy(rest, r.c_str(), r.size() + 1);
    *c = next;
  });
}

dfa_status dfa_opt_create_with_config(const dfa_optimizer_config* c, dfa_optimizer** out) {
  return guard("dfa_opt_create_with_config", [&] {
    need(out, "out");
    *out = nullptr;
    *out = create(from_config(c));
  });
}

dfa_status dfa_opt_create(const char* text, dfa_optimizer** out) {
  return guard("dfa_opt_create", [&] {
    need(out, "out");
    *out = nullptr;
    *out = create(parse_optimizer_settings(text ? text : ""));
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
    const std::size_t i = opt.add_shard(param, numel, enum_from_c<value_type>(dtype), group, name ? name : "");
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
    opt.step(std::span<const void* const>(grads, n), grad_types(opt, grads, n, grad_dtypes), scale,
             stream_t{stream});
  });
}

dfa_status dfa_opt_step_speculative(dfa_optimizer* o, const void* const* grads, size_t n, const int* grad_dtypes,
                                    float scale, void* stream) {
  return guard("dfa_opt_step_speculative", [&] {
    auto& opt = opt_of(o);
    opt.step_speculative(std::span<const void* const>(grads, n),
                         grad_types(opt, grads, n, grad_dtypes), scale, stream_t{stream});
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
  return guard("dfa_opt_read_state", [&] {
    opt_of(o).read_state_range(shard, enum_from_c<state_array>(a), offset, n, out);
  });
}

dfa_status dfa_opt_write_state(dfa_optimizer* o, size_t shard, dfa_state_array a, size_t offset, size_t n,
                               const float* in) {
  return guard("dfa_opt_write_state", [&] {
    opt_of(o).write_state_range(shard, enum_from_c<state_array>(a), offset, n, in);
  });
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
