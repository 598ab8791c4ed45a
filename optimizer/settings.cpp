// The streamed optimizer's settings table: every key it reads from a settings text
// (DEFERALLOC_CONF's grammar) is one row that sets an optimizer_config field.
#include <deferalloc/core/errors.hpp>
#include <deferalloc/optim/optimizer_settings.hpp>

#include <map>
#include <string>
#include <utility>

#include "setting_rows.hpp"

namespace deferalloc::optim {
namespace {

// Note [Optimizer settings]
// Rationale: one place per knob, in the library that reads it: the allocator need not know
// an optimizer key's type, range or meaning, and no knob is copied from a settings struct
// into optimizer_config by hand.
// Approach: this library owns its table (Note [Settings table] in
// allocator/core/config.cpp: the same rows, detail::setting_row), and each row's setter
// checks a value and stores it in optimizer_config.  A text is split once by the shared
// grammar; the optimizer's keys go through this table, the rest through the allocator's
// (driver, device, log_level ... for make_driver), which knows the names of this table's
// keys only to accept them (Note [Keys other libraries own]).  The C ABI's typed struct
// (dfa_optimizer_config) goes through the same rows, so its ranges and messages are these.
// Limits: tier and moments are checked by parse_tier and parse_moment_format (their
// messages); a key neither table knows is reported by the allocator's parse, whose list
// of valid keys names both tables.
using row = deferalloc::detail::setting_row<optimizer_config>;
using deferalloc::detail::k_any;
using deferalloc::detail::k_max_int;
using deferalloc::detail::k_max_mb;
using deferalloc::detail::mb;
using deferalloc::detail::num;
using deferalloc::detail::scalar;

const row k_table[] = {
    {"tier", "name", 0, 0, "device, host, file", "host", "where the FP32 state lives between steps",
     [](optimizer_config& c, const row& r, const config_value& v) { c.home = parse_tier(scalar(r.key, v)); }},
    {"directory", "path", 0, 0, "a directory", "(none)", "the file tier's directory",
     [](optimizer_config& c, const row& r, const config_value& v) { c.directory = scalar(r.key, v); }},
    {"window_mb", "MB", 0, k_max_mb, nullptr, "512", "HBM budget of the streamed state",
     [](optimizer_config& c, const row& r, const config_value& v) { c.window_bytes = mb(r, v); }},
    {"depth", "integer", 0, k_max_int, nullptr, "0", "pieces in flight (0: 8 host, 3 file tier)",
     [](optimizer_config& c, const row& r, const config_value& v) { c.depth = static_cast<int>(num(r, v)); }},
    {"resume", "flag", 0, k_any, "0 or any other integer", "0", "file tier: continue from the state file's last step",
     [](optimizer_config& c, const row& r, const config_value& v) { c.resume = num(r, v) != 0; }},
    {"rank", "integer", 0, k_max_int, nullptr, "0", "this rank (names the state file)",
     [](optimizer_config& c, const row& r, const config_value& v) { c.rank = static_cast<int>(num(r, v)); }},
    {"io_threads", "integer", 0, k_max_int, nullptr, "8", "file tier: I/O threads",
     [](optimizer_config& c, const row& r, const config_value& v) { c.io_threads = static_cast<int>(num(r, v)); }},
    {"io_request_mb", "MB", 0, k_max_mb, nullptr, "8", "file tier: the size of one request",
     [](optimizer_config& c, const row& r, const config_value& v) { c.io_request_bytes = mb(r, v); }},
    {"keep_window", "flag", 0, k_any, "0 or any other integer", "0", "keep the window's slots backed between passes",
     [](optimizer_config& c, const row& r, const config_value& v) { c.keep_window = num(r, v) != 0; }},
    {"pass_taper", "flag", 0, k_any, "0 or any other integer", "0", "cut each pass's first and last pieces smaller",
     [](optimizer_config& c, const row& r, const config_value& v) { c.pass_taper = num(r, v) != 0; }},
    {"pass_chain", "flag", 0, k_any, "0 or any other integer", "0",
     "host tier with keep_window: a pass leaves its last write-backs to the next",
     [](optimizer_config& c, const row& r, const config_value& v) { c.pass_chain = num(r, v) != 0; }},
    {"writeback_queue_mb", "MB", 0, k_max_mb, nullptr, "0",
     "streamed tiers: write-back bytes a pass keeps queued on the copy engine (0: no bound)",
     [](optimizer_config& c, const row& r, const config_value& v) { c.writeback_queue_bytes = mb(r, v); }},
    {"resident_mb", "MB", 0, k_max_mb, nullptr, "0", "host and file tiers: HBM for shards kept resident",
     [](optimizer_config& c, const row& r, const config_value& v) { c.resident_bytes = mb(r, v); }},
    {"moments", "name", 0, 0, "fp32, bf16, int8", "fp32", "storage of the Adam moments at home",
     [](optimizer_config& c, const row& r, const config_value& v) { c.moments = parse_moment_format(scalar(r.key, v)); }},
    {"progress_line", "flag", 0, k_any, "0 or any other integer", "0", "print a progress line during a long initialize()",
     [](optimizer_config& c, const row& r, const config_value& v) { c.progress_line = num(r, v) != 0; }},
};

}  // namespace

std::vector<setting_doc> optimizer_settings_table() { return deferalloc::detail::docs_of(k_table); }

std::string optimizer_settings_keys() { return deferalloc::detail::keys_of(k_table); }

bool apply_optimizer_setting(optimizer_config& oc, const std::string& key, const config_value& v) {
  const row* r = deferalloc::detail::find_row(k_table, key);
  if (r != nullptr) r->set(oc, *r, v);
  return r != nullptr;
}

engine_settings parse_optimizer_settings(std::string_view text) {
  engine_settings out;
  std::map<std::string, config_value> rest;
  for (auto& [key, v] : parse_config_text(text))
    if (!apply_optimizer_setting(out.optimizer, key, v)) rest.emplace(key, std::move(v));
  out.allocator = settings_from(rest);
  return out;
}

}  // namespace deferalloc::optim
