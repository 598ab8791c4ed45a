// The settings parser (PYTORCH_CUDA_ALLOC_CONF grammar) and the logger.
//
// Two steps: parse_config_text splits the text into keys and values without knowing
// any key, so every face (C ABI, preload, Python) shares one grammar; parse_settings
// interprets the keys and rejects unknown ones with the list of valid keys.
#include <deferalloc/config.hpp>
#include <deferalloc/errors.hpp>

#include <atomic>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <new>

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

const char* const k_keys[] = {"driver", "device", "chunk_classes_mb", "pool_budget_mb", "host_capacity_mb",
                              "host_granularity_kb", "pinned_cache_mb", "pool_cache_mb", "log_level"};

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

/// A size in MB, at most 16 TiB: `to_size(...) << 20` cannot wrap.
std::size_t to_size(const std::string& key, const std::string& v) {
  return static_cast<std::size_t>(to_uint(key, v, 0, k_max_mb));
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

std::string settings_keys() {
  std::string s;
  for (const char* k : k_keys) s += (s.empty() ? "" : ", ") + std::string(k);
  return s;
}

std::size_t quarter_of_ram() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 4
                               : std::size_t{64} << 20;
}

settings parse_settings(std::string_view text) {
  settings s;
  for (const auto& [key, v] : parse_config_text(text)) {
    if (key == "driver") {
      const auto& d = scalar(key, v);
      if (d == "auto") s.driver = driver_kind::automatic;
      else if (d == "cuda") s.driver = driver_kind::cuda;
      else if (d == "host") s.driver = driver_kind::host;
      else throw invalid_argument("DEFERALLOC_CONF: driver must be auto, cuda or host, got '" + d + "'");
    } else if (key == "device") {
      s.device = static_cast<int>(to_uint(key, scalar(key, v), 0, 1023));
    } else if (key == "chunk_classes_mb") {
      s.chunk_classes.clear();
      for (const auto& item : v.items) {
        const std::size_t mb = to_size(key, item);
        if (mb == 0) throw invalid_argument("DEFERALLOC_CONF: chunk_classes_mb items must be in [1, 16777216]");
        s.chunk_classes.push_back(mb << 20);
      }
    } else if (key == "pool_budget_mb") {
      s.pool_budget = to_size(key, scalar(key, v)) << 20;
    } else if (key == "host_capacity_mb") {
      s.host_capacity = to_size(key, scalar(key, v)) << 20;
    } else if (key == "host_granularity_kb") {
      const std::uint64_t kb = to_uint(key, scalar(key, v), 4, std::uint64_t{1} << 20);
      if ((kb & (kb - 1)) != 0)
        throw invalid_argument("DEFERALLOC_CONF: host_granularity_kb is " + std::to_string(kb) +
                               ", not a power of two in [4, 1048576] (4 KiB to 1 GiB)");
      s.host_granularity = static_cast<std::size_t>(kb << 10);
    } else if (key == "pinned_cache_mb") {
      s.pinned_cache = to_size(key, scalar(key, v)) << 20;
    } else if (key == "pool_cache_mb") {
      s.pool_cache = to_size(key, scalar(key, v)) << 20;
    } else if (key == "log_level") {
      const auto& l = scalar(key, v);
      if (l == "off") s.level = log_level::off;
      else if (l == "error") s.level = log_level::error;
      else if (l == "warn") s.level = log_level::warn;
      else if (l == "info") s.level = log_level::info;
      else if (l == "debug") s.level = log_level::debug;
      else throw invalid_argument("DEFERALLOC_CONF: log_level must be off, error, warn, info or debug, got '" + l + "'");
    } else {
      throw invalid_argument("DEFERALLOC_CONF: unknown key '" + key + "'; valid keys: " + settings_keys());
    }
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

void log(log_level level, const std::string& msg) noexcept {
  if (level == log_level::off) return;
  if (const sink* s = g_sink.load()) {
    if (static_cast<int>(level) <= s->level) s->fn(static_cast<int>(level), msg.c_str(), s->user);
    return;
  }
  if (static_cast<int>(level) > g_level.load()) return;
  static const char* const names[] = {"", "error", "warn", "info", "debug"};
  std::fprintf(stderr, "[deferalloc %s] %s\n", names[static_cast<int>(level)], msg.c_str());
}
}  // namespace detail

}  // namespace deferalloc
