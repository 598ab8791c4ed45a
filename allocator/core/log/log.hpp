// Internal logging to stderr, filtered by the level from the settings.
#pragma once
#include <deferalloc/config.hpp>
#include <deferalloc/errors.hpp>
#include <deferalloc/export.hpp>

#include <string>

namespace deferalloc::detail {
// Exported (not in a public header) so the optimizer library logs the same way.
DFA_API void log(log_level level, const std::string& msg) noexcept;

// Where log() sends a message instead of stderr (dfa_set_log_callback): `fn` gets every
// message at or below `level`, whatever the settings' log_level; nullptr restores stderr.
using log_sink = void (*)(int level, const char* msg, void* user);
DFA_API void set_log_sink(log_sink fn, void* user, log_level level) noexcept;

/// For a catch block that cleans up and goes on (a rollback or a destructor): logs
/// "<where>: <what of the exception being handled>" at `level`, so that no failure is
/// dropped without a word.
inline void log_current(const char* where, log_level level = log_level::error) noexcept {
  try {
    log(level, std::string(where) + ": " + message_of(std::current_exception()));
  } catch (...) {  // no memory for the line: log() itself never throws
    log(level, where);
  }
}
}
