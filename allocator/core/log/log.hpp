// Internal logging to stderr, filtered by the level from the settings.
#pragma once
#include <deferalloc/core/config.hpp>
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/export.hpp>

#include <mutex>
#include <string>

namespace deferalloc::detail {
// Exported (not in a public header) so the optimizer library logs the same way.
DFA_API void log(log_level level, const std::string& msg) noexcept;

// Where log() sends a message instead of stderr (dfa_set_log_callback): `fn` gets every
// message at or below `level`, whatever the settings' log_level; nullptr restores stderr.
using log_sink = void (*)(int level, const char* msg, void* user);
DFA_API void set_log_sink(log_sink fn, void* user, log_level level) noexcept;

// Note [Logging outside locks]
// Rationale: the sink may be Python (dfa_set_log_callback from deferalloc/_logging.py): it
// takes the GIL and may allocate through torch, back into this library.  Called under a
// mutex of ours, it deadlocks against a thread that holds the GIL and waits for that
// mutex (a torch allocation waiting for the caching allocator), or against itself.
// Approach: a section that holds a mutex and may log opens a log_hold before locking
// (log_after_unlock<M> does both); log() on a thread with a hold open keeps the line, and
// the outermost hold's end, after the mutex is released, delivers the kept lines in order
// on the same thread (before the exception or result of the section reaches its caller).
// Only lines for a callback are kept: without one, lines go to stderr at once (stderr
// cannot call back, and a process dying inside the section has printed them).
// Limits: at most 64 lines kept per section (the rest are counted: one line says how many
// were lost); a thread whose lines are kept cannot see them before the section ends.
struct log_hold_state {
  int depth = 0;  // holds open on this thread
  int kept = 0;   // lines kept or lost since the outermost hold opened
};
// Trivial and constant-initialised: a hold costs two thread-local increments.
DFA_API extern constinit thread_local log_hold_state t_log_hold;
/// Delivers the lines kept by this thread's holds (the last one has just closed).
DFA_API void deliver_held_logs() noexcept;

class log_hold {
 public:
  log_hold() noexcept { ++t_log_hold.depth; }
  ~log_hold() {
    if (--t_log_hold.depth == 0 && t_log_hold.kept != 0) deliver_held_logs();
  }
  log_hold(const log_hold&) = delete;
  log_hold& operator=(const log_hold&) = delete;
};

/// std::lock_guard whose section's log lines are delivered after the unlock.
template <class Mutex>
class log_after_unlock {
 public:
  explicit log_after_unlock(Mutex& m) : lk_(m) {}

 private:
  log_hold hold_;  // declared first: destroyed after lk_ unlocks
  std::lock_guard<Mutex> lk_;
};

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
