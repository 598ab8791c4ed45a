#include "progress.hpp"

#include <cstdio>

#include <unistd.h>

namespace deferalloc::optim {

namespace {
double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

progress_meter::progress_meter(const optimizer_config& cfg, const char* phase, std::size_t total)
    : cfg_(cfg), phase_(phase), total_(total), t0_(clock::now()), last_line_(t0_) {}

void progress_meter::report(std::size_t done) {
  const double sec = since(t0_);
  if (cfg_.on_progress) cfg_.on_progress(progress{phase_, done, total_, sec});
  static const bool tty = ::isatty(STDERR_FILENO) == 1;
  const bool due = last_line_ == t0_ || since(last_line_) > (tty ? 0.5 : 10.0) || done == total_;
  if (cfg_.progress_line && sec > 1.0 && due) {
    last_line_ = clock::now();
    std::fprintf(stderr, "%s[deferalloc] %s %5.1f%%  %.2f Gparam/s%s", tty ? "\r" : "", phase_, 100.0 * done / total_,
                 done / sec / 1e9, done == total_ || !tty ? "\n" : "");
    std::fflush(stderr);
  }
}

}  // namespace deferalloc::optim
