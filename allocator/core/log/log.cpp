// The internal logger (log.hpp): the level, the sink, and the lines held while a mutex is
// held (Note [Logging outside locks] in log.hpp).  The settings' log_level reaches it
// through set_log_level (allocator/core/config.cpp).
#include <atomic>
#include <cstdio>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "log.hpp"

namespace deferalloc {
namespace {
std::atomic<int> g_level{static_cast<int>(log_level::warn)};
}  // namespace

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
