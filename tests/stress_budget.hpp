// How long a stress test runs: until each counter it names has reached its floor (and at
// least DFA_STRESS_SECONDS, default 3, so that a fast machine does more than the floor),
// with a time cap as a guard against a hang (DFA_STRESS_CAP_SECONDS, default 600).
//
// Note [Stress runs end on counts]
// Rationale: a test that asserts how much a fixed time achieved fails on a loaded machine
// (a 3-second ThreadSanitizer run on two busy cores verified 72-100 blocks against a floor
// of 100). What the test promises is that it exercised the allocator at least so much.
// Approach: the run ends when every floor is reached and the minimum time has passed, or
// at the cap; the test then asserts the floors, so reaching the cap first is a failure that
// names the counters that fell short. Limits: a machine so slow that it cannot reach the
// floors within the cap fails the test; the cap is ten minutes for that reason.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace dfa_test {

class stress_budget {
 public:
  using clock = std::chrono::steady_clock;

  stress_budget() : start_(clock::now()), min_(env_seconds("DFA_STRESS_SECONDS", 3.0)),
                    cap_(env_seconds("DFA_STRESS_CAP_SECONDS", 600.0)) {
    if (cap_ < min_) cap_ = min_;
  }

  /// The run goes on until `read()` >= `floor` (call before the threads start).
  template <class Atomic>
  void need(std::string what, const Atomic& counter, std::uint64_t floor) {
    floors_.push_back({std::move(what), [&counter] { return static_cast<std::uint64_t>(counter.load()); }, floor});
  }

  /// True while the run should go on; safe to call from any thread.
  bool running() const {
    const double t = elapsed();
    if (t >= cap_) return false;
    if (t < min_) return true;
    for (const auto& f : floors_)
      if (f.read() < f.floor) return true;
    return false;
  }

  /// Empty when every floor was reached; otherwise which ones fell short, and after how long.
  std::string shortfall() const {
    std::string out;
    for (const auto& f : floors_)
      if (f.read() < f.floor)
        out += f.what + " " + std::to_string(f.read()) + " < " + std::to_string(f.floor) + "; ";
    if (!out.empty()) out += "after " + std::to_string(elapsed()) + " s (cap " + std::to_string(cap_) + " s)";
    return out;
  }

  double elapsed() const { return std::chrono::duration<double>(clock::now() - start_).count(); }
  double min_seconds() const { return min_; }

 private:
  static double env_seconds(const char* name, double fallback) {
    const char* e = std::getenv(name);
    const double v = e != nullptr ? std::atof(e) : 0.0;
    return v > 0 ? v : fallback;
  }
  struct floor_t {
    std::string what;
    std::function<std::uint64_t()> read;
    std::uint64_t floor;
  };
  clock::time_point start_;
  double min_, cap_;
  std::vector<floor_t> floors_;
};

}  // namespace dfa_test
