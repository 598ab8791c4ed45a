// Pause/resume of one tag holding 16 GiB in 1,000 allocations (the acceptance scenario),
// timed on the GPU, with and without host backup, against pinned cudaMemcpyAsync of the
// same 1,000 pieces in the same run.  Prints a table and RESULT lines; exit 77 without
// a GPU, 1 when a contents check fails.
//   bench_pause_resume [total_GiB=16] [count=1000] [reps=5]
#include <deferalloc/caching/caching_allocator.hpp>
#include <deferalloc/core/context.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CUDA_CHECK(call)                                                                        \
  do {                                                                                          \
    cudaError_t e_ = (call);                                                                    \
    if (e_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

namespace {
using clk = std::chrono::steady_clock;
double ms(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 16.0;
  const int count = argc > 2 ? std::atoi(argv[2]) : 1000;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  if (!deferalloc::cuda_device_available()) {
    std::printf("SKIPPED: needs a GPU\n");
    return 77;
  }
  const std::size_t total = static_cast<std::size_t>(gib * (1ull << 30));
  const std::size_t size = total / count / 512 * 512;
  const double bytes = static_cast<double>(size) * count;
  try {
    // The stream outlives the allocator: freeing its segments waits for the streams that used them.
    struct stream_guard {
      cudaStream_t s = nullptr;
      ~stream_guard() { cudaStreamDestroy(s); }
    } guard;
    CUDA_CHECK(cudaStreamCreateWithFlags(&guard.s, cudaStreamNonBlocking));
    cudaStream_t s = guard.s;
    const deferalloc::stream_t ds{s};  // the same stream, typed for deferalloc
    deferalloc::context ctx(deferalloc::parse_settings("driver:cuda"));
    deferalloc::caching_allocator a(*ctx.reservations);
    std::vector<void*> ps;
    {
      deferalloc::tag_scope region(a, "bench");
      for (int i = 0; i < count; ++i) ps.push_back(a.allocate(size, ds));
    }
    auto fill = [&] {
      for (int i = 0; i < count; ++i) CUDA_CHECK(cudaMemsetAsync(ps[i], (i * 7 + 1) & 0xFF, size, s));
      CUDA_CHECK(cudaStreamSynchronize(s));
    };
    auto verify = [&] {
      unsigned char first = 0, last = 0;
      for (int i = 0; i < count; ++i) {
        CUDA_CHECK(cudaMemcpy(&first, ps[i], 1, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(&last, static_cast<char*>(ps[i]) + size - 1, 1, cudaMemcpyDeviceToHost));
        if (first != ((i * 7 + 1) & 0xFF) || last != first) return false;
      }
      return true;
    };
    fill();
    // Warm the pool and the pinned backup buffers (first cycles create chunks and pin).
    for (int i = 0; i < 2; ++i) {
      a.pause("bench", deferalloc::keep_mode::discard, ds);
      a.resume("bench", ds);
    }
    fill();
    a.pause("bench", deferalloc::keep_mode::host, ds);
    a.resume("bench", ds);
    CUDA_CHECK(cudaStreamSynchronize(s));

    std::vector<double> p_ms, r_ms, ph_ms, rh_ms;
    // One timed pause + resume of the tag.
    auto cycle = [&](deferalloc::keep_mode keep, std::vector<double>& pause_ms, std::vector<double>& resume_ms) {
      auto t0 = clk::now();
      a.pause("bench", keep, ds);
      auto t1 = clk::now();
      a.resume("bench", ds);
      CUDA_CHECK(cudaStreamSynchronize(s));
      auto t2 = clk::now();
      pause_ms.push_back(ms(t0, t1));
      resume_ms.push_back(ms(t1, t2));
    };
    for (int r = 0; r < reps; ++r) cycle(deferalloc::keep_mode::discard, p_ms, r_ms);
    fill();
    bool ok = true;
    for (int r = 0; r < reps; ++r) {
      cycle(deferalloc::keep_mode::host, ph_ms, rh_ms);
      ok &= verify();
    }

    // Baseline: pinned cudaMemcpyAsync of the same pieces, both ways.
    void* host = nullptr;
    CUDA_CHECK(cudaHostAlloc(&host, static_cast<std::size_t>(bytes), cudaHostAllocDefault));
    std::vector<double> d2h_ms, h2d_ms;
    for (int r = 0; r < reps; ++r) {
      auto t0 = clk::now();
      for (int i = 0; i < count; ++i)
        CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(host) + std::size_t(i) * size, ps[i], size, cudaMemcpyDeviceToHost, s));
      CUDA_CHECK(cudaStreamSynchronize(s));
      auto t1 = clk::now();
      for (int i = 0; i < count; ++i)
        CUDA_CHECK(cudaMemcpyAsync(ps[i], static_cast<char*>(host) + std::size_t(i) * size, size, cudaMemcpyHostToDevice, s));
      CUDA_CHECK(cudaStreamSynchronize(s));
      auto t2 = clk::now();
      d2h_ms.push_back(ms(t0, t1));
      h2d_ms.push_back(ms(t1, t2));
    }
    CUDA_CHECK(cudaFreeHost(host));
    for (void* p : ps) a.deallocate(p, size, ds);

    const double gb = bytes / 1e9;
    const double pause = median(p_ms), resume = median(r_ms);
    const double pause_bw = gb / (median(ph_ms) / 1e3), resume_bw = gb / (median(rh_ms) / 1e3);
    const double d2h_bw = gb / (median(d2h_ms) / 1e3), h2d_bw = gb / (median(h2d_ms) / 1e3);
    std::printf("pause/resume of %.1f GiB in %d allocations of one tag (median of %d)\n", bytes / (1ull << 30), count, reps);
    std::printf("%-34s %12s %12s %10s\n", "scenario", "deferalloc", "baseline", "ratio");
    std::printf("%-34s %9.2f ms %12s %10s\n", "pause, no backup", pause, "", "");
    std::printf("%-34s %9.2f ms %12s %10s\n", "resume, no backup", resume, "", "");
    std::printf("%-34s %9.2f ms %9.2f ms %10s\n", "pause + resume, no backup", pause + resume, 20.0, "(target)");
    std::printf("%-34s %7.1f GB/s %7.1f GB/s %9.2fx\n", "pause, host backup (D2H)", pause_bw, d2h_bw, pause_bw / d2h_bw);
    std::printf("%-34s %7.1f GB/s %7.1f GB/s %9.2fx\n", "resume, restore (H2D)", resume_bw, h2d_bw, resume_bw / h2d_bw);
    std::printf("contents after every restore: %s\n", ok ? "identical" : "DIFFERENT");
    std::printf("RESULT pause_resume_ms %.3f\nRESULT pause_host_GBps %.2f\nRESULT resume_host_GBps %.2f\n"
                "RESULT pinned_d2h_GBps %.2f\nRESULT pinned_h2d_GBps %.2f\n",
                pause + resume, pause_bw, resume_bw, d2h_bw, h2d_bw);
    const bool fast = pause + resume <= 20.0 && pause_bw >= 0.8 * d2h_bw && resume_bw >= 0.8 * h2d_bw;
    std::printf("acceptance (<= 20 ms; >= 80%% of pinned copy each way): %s\n", fast ? "PASS" : "FAIL");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pause_resume: %s\n", e.what());
    return 1;
  }
}
