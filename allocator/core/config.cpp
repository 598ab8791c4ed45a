// The settings parser (PYTORCH_CUDA_ALLOC_CONF grammar); the logger it sets the level of is
// core/log/log.cpp.
//
// Two steps: parse_config_text splits the text into keys and values without knowing
// any key, so every face (C ABI, preload, Python) shares one grammar; parse_settings
// interprets the allocator's keys through its table (Note [Settings table]), passes over
// the keys other libraries of the package own (Note [Keys other libraries own]) and rejects
// unknown ones with the list of valid keys.
#include <deferalloc/core/config.hpp>
#include <deferalloc/core/errors.hpp>

#include <charconv>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "setting_rows.hpp"

namespace deferalloc {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

}  // namespace

// Note [Settings ranges]
// Every number is parsed as an unsigned 64-bit integer and checked against its key's
// range before it is scaled, so no value wraps (device:4294967296 is not device 0, a
// huge pool_budget_mb is not 1 MiB or "unlimited").  Sizes in MB are capped at 16 TiB,
// far above any device or host, and well below the 2^64 bytes where the shift would
// wrap; granularities must be powers of two.  Every error names the key and its range.
namespace detail {

std::uint64_t to_uint(const std::string& key, const std::string& v, std::uint64_t lo, std::uint64_t hi) {
  std::uint64_t out = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (ec == std::errc::result_out_of_range || (ec == std::errc() && p == v.data() + v.size() && (out < lo || out > hi)))
    throw invalid_argument("DEFERALLOC_CONF: " + key + " is " + v + ", outside its range " + range);
  if (ec != std::errc() || p != v.data() + v.size())
    throw invalid_argument("DEFERALLOC_CONF: " + key + " expects an integer in " + range + ", got '" + v + "'");
  return out;
}

const std::string& scalar(const std::string& key, const config_value& v) {
  if (v.is_list || v.items.size() != 1) throw invalid_argument("DEFERALLOC_CONF: " + key + " expects a single value");
  return v.items[0];
}

}  // namespace detail

std::map<std::string, config_value> parse_config_text(std::string_view text) {
  std::map<std::string, config_value> out;
  std::size_t i = 0;
  auto fail = [&](const std::string& why) {
    throw invalid_argument("DEFERALLOC_CONF: " + why + " at position " + std::to_string(i) + " in '" +
                           std::string(text) + "' (grammar: key:value,key:[v1,v2])");
  };
  while (i < text.size()) {
    std::size_t colon = text.find(':', i);
    std::size_t comma = text.find(',', i);
    if (trim(text.substr(i, comma == std::string_view::npos ? std::string_view::npos : comma - i)).empty() &&
        comma != std::string_view::npos) {
      i = comma + 1;  // tolerate empty items ("a:1,,b:2")
      continue;
    }
    if (colon == std::string_view::npos || (comma != std::string_view::npos && comma < colon)) fail("missing ':'");
    std::string key(trim(text.substr(i, colon - i)));
    if (key.empty()) fail("empty key");
    i = colon + 1;
    config_value v;
    std::size_t j = i;
    while (j < text.size() && (text[j] == ' ' || text[j] == '\t')) ++j;
    if (j < text.size() && text[j] == '[') {
      std::size_t close = text.find(']', j);
      if (close == std::string_view::npos) fail("missing ']'");
      v.is_list = true;
      std::string_view body = text.substr(j + 1, close - j - 1);
      std::size_t k = 0;
      while (k <= body.size()) {
        std::size_t c = body.find(',', k);
        std::string_view item = trim(body.substr(k, c == std::string_view::npos ? std::string_view::npos : c - k));
        if (!item.empty()) v.items.emplace_back(item);
        else if (c != std::string_view::npos || k != 0) fail("empty list item");
        if (c == std::string_view::npos) break;
        k = c + 1;
      }
      i = close + 1;
      while (i < text.size() && (text[i] == ' ' || text[i] == '\t')) ++i;
      if (i < text.size() && text[i] != ',') fail("expected ',' after ']'");
      if (i < text.size()) ++i;
    } else {
      std::size_t c = text.find(',', i);
      std::string_view val = trim(text.substr(i, c == std::string_view::npos ? std::string_view::npos : c - i));
      if (val.empty()) fail("empty value for '" + key + "'");
      v.items.emplace_back(val);
      i = c == std::string_view::npos ? text.size() : c + 1;
    }
    out[key] = std::move(v);
  }
  return out;
}

std::size_t quarter_of_ram() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 4
                               : std::size_t{64} << 20;
}

namespace {

// Note [Settings table]
// Rationale: one knob should be written in one place: its name, what a value looks like,
// its range, default and meaning (for messages, settings_table() and docs/SETTINGS.md,
// which the tests compare) and how a value is checked and stored (mimalloc's
// src/options.c style).
// Approach: every key of a library is one row of that library's table
// (detail::setting_row, allocator/core/settings/setting_rows.hpp).  Numeric rows carry
// their range as numbers (lo, hi) and the setter reads it from the row, so the range is
// written once.  This table holds the library's keys (driver, pools, logging) and the
// caching allocator's (caching_allocator_config); the streamed optimizer's keys are rows
// of its own table (optimizer/settings.cpp), which sets optimizer_config directly.
// Limits: the grammar (parse_config_text) is shared; a table knows only its own keys, so
// the keys of the other libraries are named here (Note [Keys other libraries own]).
using row = detail::setting_row<settings>;
using detail::k_max_mb;
using detail::num;
using detail::mb;
using detail::pick;
using detail::scalar;
using detail::to_uint;

double to_fraction(const std::string& key, const std::string& v) {
  double out = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || p != v.data() + v.size())
    throw invalid_argument("DEFERALLOC_CONF: " + key + " expects a number in (0, 1], got '" + v + "'");
  if (!(out > 0.0 && out <= 1.0)) throw invalid_argument("DEFERALLOC_CONF: " + key + " is " + v + ", outside its range (0, 1]");
  return out;
}

const row k_table[] = {
    {"driver", "name", 0, 0, "auto, cuda, host", "auto", "`auto` (cuda when a device is present), `cuda` or `host`",
     [](settings& s, const row& r, const config_value& v) {
       s.driver = pick<driver_kind>(r, v, {{"auto", driver_kind::automatic}, {"cuda", driver_kind::cuda}, {"host", driver_kind::host}});
     }},
    {"device", "integer", 0, 1023, nullptr, "0", "CUDA device ordinal",
     [](settings& s, const row& r, const config_value& v) { s.device = static_cast<int>(num(r, v)); }},
    {"shareable_handles", "name", 0, 0, "auto, none, posix_fd", "auto",
     "CUDA chunks' handle type: `auto` POSIX fd where supported (NCCL can register the memory for other processes)",
     [](settings& s, const row& r, const config_value& v) {
       s.share = pick<shareable_handle>(r, v, {{"auto", shareable_handle::automatic}, {"none", shareable_handle::none},
                             {"posix_fd", shareable_handle::posix_fd}});
     }},
    {"chunk_classes_mb", "list of MB", 1, k_max_mb, nullptr, "powers of two, 2 MiB .. 1 GiB",
     "chunk sizes, e.g. `[2,32,256,1024]`",
     [](settings& s, const row& r, const config_value& v) {
       s.chunk_classes.clear();
       for (const auto& item : v.items) s.chunk_classes.push_back(static_cast<std::size_t>(to_uint(r.key, item, r.lo, r.hi)) << 20);
     }},
    {"pool_budget_mb", "MB", 0, k_max_mb, nullptr, "0", "bytes of chunks alive at once (0: no limit)",
     [](settings& s, const row& r, const config_value& v) { s.pool_budget = mb(r, v); }},
    {"pool_cache_mb", "MB", 0, k_max_mb, nullptr, "64",
     "physical chunks kept cached for reuse; everything above goes back to the device",
     [](settings& s, const row& r, const config_value& v) { s.pool_cache = mb(r, v); }},
    {"pinned_cache_mb", "MB", 0, k_max_mb, nullptr, "RAM/4",
     "pinned backup buffers kept after a restore, for the next pause (0: none); `empty_cache` and `trim` free them",
     [](settings& s, const row& r, const config_value& v) { s.pinned_cache = mb(r, v); }},
    {"host_capacity_mb", "MB", 0, k_max_mb, nullptr, "RAM/4", "host driver capacity (0: RAM/4)",
     [](settings& s, const row& r, const config_value& v) { s.host_capacity = mb(r, v); }},
    {"host_granularity_kb", "KiB, a power of two", 4, std::uint64_t{1} << 20, nullptr, "2048", "host driver granule",
     [](settings& s, const row& r, const config_value& v) {
       const std::uint64_t kb = num(r, v);
       if ((kb & (kb - 1)) != 0)
         throw invalid_argument("DEFERALLOC_CONF: host_granularity_kb is " + std::to_string(kb) +
                                ", not a power of two in [4, 1048576] (4 KiB to 1 GiB)");
       s.host_granularity = static_cast<std::size_t>(kb << 10);
     }},
    {"log_level", "name", 0, 0, "off, error, warn, info, debug", "warn", "what library messages are printed (stderr)",
     [](settings& s, const row& r, const config_value& v) {
       s.level = pick<log_level>(r, v, {{"off", log_level::off}, {"error", log_level::error}, {"warn", log_level::warn},
                             {"info", log_level::info}, {"debug", log_level::debug}});
     }},
    // ---- the caching allocator (caching_allocator_config) ----
    {"small_size_kb", "KiB", 1, std::uint64_t{1} << 20, nullptr, "1024",
     "caching allocator: requests up to this size use the small-block segment",
     [](settings& s, const row& r, const config_value& v) { s.caching.small_size = static_cast<std::size_t>(num(r, v)) << 10; }},
    {"segment_reserve_mb", "MB", 0, k_max_mb, nullptr, "0", "caching allocator: address space per segment (0: twice the device's memory)",
     [](settings& s, const row& r, const config_value& v) { s.caching.segment_reserve = mb(r, v); }},
    {"memory_fraction", "number", 0, 0, "(0, 1]", "1", "caching allocator: fraction of the device's memory it may keep backed",
     [](settings& s, const row& r, const config_value& v) { s.caching.memory_fraction = to_fraction(r.key, scalar(r.key, v)); }},
    {"grow_mb", "MB", 0, k_max_mb, nullptr, "64", "caching allocator: the largest growth step (0: back block by block)",
     [](settings& s, const row& r, const config_value& v) { s.caching.grow_bytes = mb(r, v); }},
};

// Note [Keys other libraries own]
// Rationale: DEFERALLOC_CONF is one namespace read by every library of the package, and
// the allocator reads it (LD_PRELOAD, the C ABI's first call) in processes where the
// optimizer's library is never loaded; an unknown key must still be an error that lists
// the valid keys (a misspelt key is not silently ignored).
// Approach: the allocator's core holds the names of the keys other libraries own, and
// only their names (no type, range or doc: those live in the owner's table).  It accepts
// and ignores them, and lists them in its unknown-key message.  The optimizer's test
// suite (tests/test_optimizer_settings.cpp) checks that this list equals the optimizer's
// table (optimizer/settings.cpp) exactly, and tests/layout_check.py that no optimizer key
// is a row of the allocator's table.
// Limits: a new optimizer key is written twice (its row and its name here); the test
// fails until both agree.  A bad value of such a key is found only by its owner.
constexpr const char* k_other_libraries_keys[] = {
    "tier", "directory", "window_mb", "depth", "resume", "rank", "io_threads", "io_request_mb",
    "keep_window", "pass_taper", "pass_chain", "writeback_queue_mb", "resident_mb", "moments", "progress_line"};

bool owned_elsewhere(const std::string& key) {
  for (const char* k : k_other_libraries_keys)
    if (key == k) return true;
  return false;
}

}  // namespace

std::string settings_keys() { return detail::keys_of(k_table); }

std::vector<std::string> other_libraries_keys() {
  return {std::begin(k_other_libraries_keys), std::end(k_other_libraries_keys)};
}

std::vector<setting_doc> settings_table() { return detail::docs_of(k_table); }

settings settings_from(const std::map<std::string, config_value>& keys) {
  settings s;
  for (const auto& [key, v] : keys) {
    if (const row* r = detail::find_row(k_table, key)) {
      r->set(s, *r, v);
      continue;
    }
    if (owned_elsewhere(key)) continue;
    std::string others;
    for (const char* k : k_other_libraries_keys) others += (others.empty() ? "" : ", ") + std::string(k);
    throw invalid_argument("DEFERALLOC_CONF: unknown key '" + key + "'; valid keys: " + settings_keys() +
                           "; the optimizer's: " + others);
  }
  return s;
}

settings parse_settings(std::string_view text) { return settings_from(parse_config_text(text)); }

}  // namespace deferalloc
