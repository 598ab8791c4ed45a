// The settings parser (PYTORCH_CUDA_ALLOC_CONF grammar) and the logger.
//
// Two steps: parse_config_text splits the text into keys and values without knowing
// any key, so every face (C ABI, preload, Python) shares one grammar; parse_settings
// interprets the keys through one table (Note [Settings table]) and rejects unknown ones
// with the list of valid keys.
#include <deferalloc/config.hpp>
#include <deferalloc/errors.hpp>

#include <atomic>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <iterator>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "log.hpp"

namespace deferalloc {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

std::atomic<int> g_level{static_cast<int>(log_level::warn)};

// Note [Settings ranges]
// Every number is parsed as an unsigned 64-bit integer and checked against its key's
// range before it is scaled, so no value wraps (device:4294967296 is not device 0, a
// huge pool_budget_mb is not 1 MiB or "unlimited").  Sizes in MB are capped at 16 TiB,
// far above any device or host, and well below the 2^64 bytes where the shift would
// wrap; granularities must be powers of two.  Every error names the key and its range.
constexpr std::uint64_t k_max_mb = std::uint64_t{1} << 24;  // 16 TiB

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

}  // namespace

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
// Every key of DEFERALLOC_CONF is one row of k_table (mimalloc's src/options.c style):
// its name, what a value looks like, its range, its default and meaning (for messages,
// settings_table() and docs/SETTINGS.md's table, which tests/test_config.cpp compares), and a
// setter that checks the value and stores it.  Numeric rows carry their range as
// numbers (lo, hi) and the setter reads it from the row, so the range is written once.
// The keys are the library's (driver, pools, logging), the caching allocator's
// (caching_allocator_config) and the streamed optimizer's (optimizer_settings, read by
// the optimizer's C ABI and Python): one grammar, one list of valid keys.
struct row {
  const char* key;
  const char* type;
  std::uint64_t lo, hi;  ///< numeric rows: the accepted range (before scaling)
  const char* values;    ///< other rows: the accepted values, as text
  const char* def;
  const char* doc;
  void (*set)(settings& s, const row& r, const config_value& v);
};

constexpr std::uint64_t k_max_int = 2147483647;
constexpr std::uint64_t k_any = ~std::uint64_t{0};

std::uint64_t num(const row& r, const config_value& v) { return to_uint(r.key, scalar(r.key, v), r.lo, r.hi); }
std::size_t mb(const row& r, const config_value& v) { return static_cast<std::size_t>(num(r, v)) << 20; }

double to_fraction(const std::string& key, const std::string& v) {
  double out = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || p != v.data() + v.size())
    throw invalid_argument("DEFERALLOC_CONF: " + key + " expects a number in (0, 1], got '" + v + "'");
  if (!(out > 0.0 && out <= 1.0)) throw invalid_argument("DEFERALLOC_CONF: " + key + " is " + v + ", outside its range (0, 1]");
  return out;
}

// A name-valued row: the value must be one of `names` (in the row's order for the message).
template <class E>
E pick(const row& r, const config_value& v, std::initializer_list<std::pair<const char*, E>> names) {
  const auto& got = scalar(r.key, v);
  std::string list;
  for (const auto& [n, e] : names) {
    if (got == n) return e;
    list += (list.empty() ? "" : ", ") + std::string(n);
  }
  throw invalid_argument("DEFERALLOC_CONF: " + std::string(r.key) + " must be one of " + list + ", got '" + got + "'");
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
    // ---- the streamed optimizer (optimizer_settings; checked further by the optimizer) ----
    {"tier", "name", 0, 0, "device, host, file", "host", "optimizer: where the FP32 state lives between steps",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.tier = scalar(r.key, v); }},
    {"directory", "path", 0, 0, "a directory", "(none)", "optimizer: the file tier's directory",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.directory = scalar(r.key, v); }},
    {"window_mb", "MB", 0, k_max_mb, nullptr, "512", "optimizer: HBM budget of the streamed state",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.window_bytes = mb(r, v); }},
    {"depth", "integer", 0, k_max_int, nullptr, "0", "optimizer: pieces in flight (0: 8 host, 3 file tier)",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.depth = static_cast<int>(num(r, v)); }},
    {"resume", "flag", 0, k_any, "0 or any other integer",  "0", "optimizer: file tier, continue from the state file's last step",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.resume = num(r, v) != 0; }},
    {"rank", "integer", 0, k_max_int, nullptr, "0", "optimizer: this rank (names the state file)",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.rank = static_cast<int>(num(r, v)); }},
    {"io_threads", "integer", 0, k_max_int, nullptr, "8", "optimizer: file tier I/O threads",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.io_threads = static_cast<int>(num(r, v)); }},
    {"io_request_mb", "MB", 0, k_max_mb, nullptr, "8", "optimizer: file tier, the size of one request",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.io_request_bytes = mb(r, v); }},
    {"keep_window", "flag", 0, k_any, "0 or any other integer",  "0", "optimizer: keep the window's slots backed between passes",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.keep_window = num(r, v) != 0; }},
    {"resident_mb", "MB", 0, k_max_mb, nullptr, "0", "optimizer: host tier, HBM for shards kept resident",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.resident_bytes = mb(r, v); }},
    {"moments", "name", 0, 0, "fp32, bf16, int8", "fp32", "optimizer: storage of the Adam moments at home",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.moments = scalar(r.key, v); }},
    {"progress_line", "flag", 0, k_any, "0 or any other integer",  "0", "optimizer: print a progress line during a long initialize()",
     [](settings& s, const row& r, const config_value& v) { s.optimizer.progress_line = num(r, v) != 0; }},
};

}  // namespace

std::string settings_keys() {
  std::string s;
  for (const row& r : k_table) s += (s.empty() ? "" : ", ") + std::string(r.key);
  return s;
}

std::vector<setting_doc> settings_table() {
  // The range text of numeric rows is made from their numbers once, and lives as long as the process.
  static const std::vector<std::string> ranges = [] {
    std::vector<std::string> out;
    for (const row& r : k_table)
      out.push_back(r.values ? r.values : "[" + std::to_string(r.lo) + ", " + std::to_string(r.hi) + "]");
    return out;
  }();
  std::vector<setting_doc> out;
  for (std::size_t i = 0; i < std::size(k_table); ++i)
    out.push_back({k_table[i].key, k_table[i].type, ranges[i].c_str(), k_table[i].def, k_table[i].doc});
  return out;
}

settings parse_settings(std::string_view text) {
  settings s;
  for (const auto& [key, v] : parse_config_text(text)) {
    const row* found = nullptr;
    for (const row& r : k_table)
      if (key == r.key) found = &r;
    if (found == nullptr)
      throw invalid_argument("DEFERALLOC_CONF: unknown key '" + key + "'; valid keys: " + settings_keys());
    found->set(s, *found, v);
  }
  return s;
}

void set_log_level(log_level l) noexcept { g_level.store(static_cast<int>(l)); }
log_level get_log_level() noexcept { return static_cast<log_level>(g_level.load()); }

namespace detail {
namespace {
struct sink {
  log_sink fn = nullptr;
  void* user = nullptr;
  int level = 0;
};
std::atomic<sink*> g_sink{nullptr};
}  // namespace

void set_log_sink(log_sink fn, void* user, log_level level) noexcept {
  // Never freed: a message being delivered on another thread may still hold the old one.
  auto* s = fn ? new (std::nothrow) sink{fn, user, static_cast<int>(level)} : nullptr;
  if (fn && !s) return;
  g_sink.store(s);
}

constinit thread_local log_hold_state t_log_hold;

namespace {
constexpr int k_max_held = 64;
// The lines kept by this thread's holds (Note [Logging outside locks] in log.hpp).
thread_local std::vector<std::pair<log_level, std::string>> t_held;
thread_local int t_lost = 0;

// Whether a line at `level` goes anywhere now.
bool wanted(log_level level) noexcept {
  if (level == log_level::off) return false;
  if (const sink* s = g_sink.load()) return static_cast<int>(level) <= s->level;
  return static_cast<int>(level) <= g_level.load();
}

void deliver(log_level level, const char* msg) noexcept {
  if (const sink* s = g_sink.load()) {
    if (static_cast<int>(level) <= s->level) s->fn(static_cast<int>(level), msg, s->user);
    return;
  }
  if (static_cast<int>(level) > g_level.load()) return;
  static const char* const names[] = {"", "error", "warn", "info", "debug"};
  std::fprintf(stderr, "[deferalloc %s] %s\n", names[static_cast<int>(level)], msg);
}
}  // namespace

void deliver_held_logs() noexcept {
  std::vector<std::pair<log_level, std::string>> lines;
  lines.swap(t_held);
  const int lost = t_lost;
  t_lost = 0;
  t_log_hold.kept = 0;
  for (const auto& [level, msg] : lines) deliver(level, msg.c_str());
  if (lost != 0) {
    char line[160];
    std::snprintf(line, sizeof line, "%d log lines lost (more than %d in one locked section, or no memory to keep them)",
                  lost, k_max_held);
    deliver(log_level::warn, line);
  }
}

void log(log_level level, const std::string& msg) noexcept {
  if (!wanted(level)) return;
  // Only a callback can call back into the library: stderr lines go out at once, so a
  // process that dies inside the section still printed them.
  if (t_log_hold.depth > 0 && g_sink.load() != nullptr) {
    t_log_hold.kept = 1;
    try {
      if (t_held.size() >= k_max_held) throw std::length_error("too many held lines");
      t_held.emplace_back(level, msg);
    } catch (...) {
      ++t_lost;
    }
    return;
  }
  deliver(level, msg.c_str());
}
}  // namespace detail

}  // namespace deferalloc
