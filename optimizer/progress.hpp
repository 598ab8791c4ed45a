// Progress of a long operation (a pass, a checkpoint save or load): the user's
// optimizer_config::on_progress, and a line on stderr when progress_line is set.
#pragma once
#include <deferalloc/optim/optimizer.hpp>

#include <chrono>
#include <cstddef>

namespace deferalloc::optim {

/// One operation's progress: `phase` over `total` parameters, timed from construction.
/// On a terminal one line rewritten in place ('\r', twice a second); in a log (stderr
/// not a terminal) whole lines: the first after a second, then one every 10 s, and the
/// last.
class progress_meter {
 public:
  progress_meter(const optimizer_config& cfg, const char* phase, std::size_t total);
  /// `done` of the total parameters are done.
  void report(std::size_t done);

 private:
  using clock = std::chrono::steady_clock;
  const optimizer_config& cfg_;
  const char* phase_;
  std::size_t total_;
  clock::time_point t0_, last_line_;
};

}  // namespace deferalloc::optim
