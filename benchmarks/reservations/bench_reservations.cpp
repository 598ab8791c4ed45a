// Materialize + release throughput and host-backup bandwidth, each beside the baseline
// a user would otherwise pick, in the same run:
//   - deferalloc materialize/release of 4 GiB split into 1, 64 and 2,048 reservations,
//     warm pool (chunks recycled) and cold pool (trimmed before each iteration),
//     per-reservation calls and one batched call;
//   - the naive VMM baseline: cuMemCreate + cuMemMap + cuMemSetAccess per 2 MiB granule
//     (and cuMemUnmap + cuMemRelease per granule), through the same driver;
//   - cudaMalloc / cudaFree of the same sizes;
//   - release(keep=host) and materialize(restore) of 4 GiB in 64 reservations against
//     a plain pinned cudaMemcpy of the same pieces, each direction.
// Bytes per second counts address space backed (or bytes copied) per second.
// benchmarks/report.py turns the JSON output into ratios against the targets.
#include <vector>

#include "bench_common.hpp"

using namespace deferalloc;
using namespace dfa_bench;

namespace {

void add_driver_counters(benchmark::State& st, const driver_call_counts& before, const driver& d) {
  const auto after = d.call_counts();
  const double it = static_cast<double>(st.iterations());
  st.counters["creates_per_iter"] = (after[primitive::create] - before[primitive::create]) / it;
  st.counters["maps_per_iter"] = (after[primitive::map] - before[primitive::map]) / it;
  st.counters["set_access_per_iter"] = (after[primitive::set_access] - before[primitive::set_access]) / it;
}

// The driver under measurement, a pool, a manager and `n` reservations of total_bytes()/n.
// The pool and the pinned cache keep everything given back ("warm": recycled; the cold
// runs trim the pool explicitly), unlike the default bound of 64 MiB.
struct bench_stack {
  explicit bench_stack(std::size_t n)
      : drv(make_bench_driver()), pool(std::make_shared<chunk_pool>(drv, chunk_pool_config{{}, 0, no_cache_limit})),
        m(std::make_unique<reservation_manager>(pool, drv, reservation_manager_config{no_cache_limit})),
        each(total_bytes() / n) {
    for (std::size_t i = 0; i < n; ++i) rs.push_back({m->reserve(each), 0, whole});
  }
  ~bench_stack() {
    for (const auto& r : rs) m->free(r.id);
  }
  std::shared_ptr<driver> drv;
  std::shared_ptr<chunk_pool> pool;
  std::unique_ptr<reservation_manager> m;
  std::size_t each;
  std::vector<range> rs;
};

void BM_materialize_release(benchmark::State& st) {
  const auto n = static_cast<std::size_t>(st.range(0));
  const bool warm = st.range(1) != 0, batch = st.range(2) != 0;
  bench_stack b(n);
  auto& drv = b.drv;
  auto& pool = b.pool;
  auto& m = *b.m;
  auto& rs = b.rs;
  const std::size_t each = b.each;
  auto cycle = [&] {
    if (batch) {
      m.materialize(rs, fill_mode::undefined);
      m.release(rs, keep_mode::discard);
    } else {
      for (const auto& r : rs) m.materialize(r.id, 0, whole, fill_mode::undefined);
      for (const auto& r : rs) m.release(r.id, 0, whole, keep_mode::discard);
    }
  };
  cycle();  // warm-up
  const auto calls0 = drv->call_counts();
  for (auto _ : st) {
    if (!warm) {
      st.PauseTiming();
      pool->trim();
      st.ResumeTiming();
    }
    cycle();
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * n * each));
  add_driver_counters(st, calls0, *drv);
  st.SetLabel(drv->name());
}

void BM_per_granule_baseline(benchmark::State& st) {
  const auto n = static_cast<std::size_t>(st.range(0));
  auto drv = make_bench_driver();
  const std::size_t g = drv->granularity();
  const std::size_t each = total_bytes() / n;
  std::vector<std::uintptr_t> vas;
  for (std::size_t i = 0; i < n; ++i) vas.push_back(drv->reserve(each, g));
  std::vector<chunk_handle> hs(total_bytes() / g);
  auto cycle = [&] {
    std::size_t k = 0;
    for (auto va : vas)
      for (std::size_t off = 0; off < each; off += g, ++k) {
        hs[k] = drv->create(g);
        drv->map(va + off, g, hs[k]);
        drv->set_access(va + off, g);
      }
    k = 0;
    for (auto va : vas)
      for (std::size_t off = 0; off < each; off += g, ++k) {
        drv->unmap(va + off, g);
        drv->release(hs[k]);
      }
  };
  cycle();  // warm-up
  const auto calls0 = drv->call_counts();
  for (auto _ : st) cycle();
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * n * each));
  add_driver_counters(st, calls0, *drv);
  st.SetLabel(drv->name());
  for (auto va : vas) drv->free_reservation(va, each);
}

void BM_cudaMalloc_baseline(benchmark::State& st) {
  if (!on_gpu()) {
    st.SkipWithError("no CUDA device");
    return;
  }
  const auto n = static_cast<std::size_t>(st.range(0));
  const std::size_t each = total_bytes() / n;
  std::vector<void*> ps(n);
  for (auto _ : st) {
    for (auto& p : ps) DFA_BENCH_CUDA(cudaMalloc(&p, each));
    for (auto& p : ps) DFA_BENCH_CUDA(cudaFree(p));
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * n * each));
}

// direction 0: release(keep=host) = device -> host; 1: materialize(restore) = host -> device.
void BM_host_backup(benchmark::State& st) {
  const bool restore = st.range(0) != 0;
  const std::size_t n = 64;
  bench_stack b(n);
  auto& drv = b.drv;
  auto& m = *b.m;
  auto& rs = b.rs;
  const std::size_t each = b.each;
  m.materialize(rs, fill_mode::zero);
  drv->synchronize_stream(nullptr);
  m.release(rs, keep_mode::host);  // warm-up: pins the backup buffers once
  m.materialize(rs, fill_mode::restore);
  drv->synchronize_stream(nullptr);
  for (auto _ : st) {
    double t = 0;
    if (!restore) {
      auto t0 = clock::now();
      m.release(rs, keep_mode::host);
      t = seconds_since(t0);
      m.materialize(rs, fill_mode::restore);
      drv->synchronize_stream(nullptr);
    } else {
      m.release(rs, keep_mode::host);
      auto t0 = clock::now();
      m.materialize(rs, fill_mode::restore);
      drv->synchronize_stream(nullptr);
      t = seconds_since(t0);
    }
    st.SetIterationTime(t);
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * n * each));
  st.SetLabel(drv->name());
}

void BM_pinned_memcpy_baseline(benchmark::State& st) {
  if (!on_gpu()) {
    st.SkipWithError("no CUDA device");
    return;
  }
  const bool h2d = st.range(0) != 0;
  const std::size_t n = 64, each = total_bytes() / n;
  void* dev = nullptr;
  DFA_BENCH_CUDA(cudaMalloc(&dev, n * each));
  std::vector<void*> host(n);
  for (auto& h : host) DFA_BENCH_CUDA(cudaMallocHost(&h, each));
  cudaStream_t s{};
  DFA_BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (auto _ : st) {
    auto t0 = clock::now();
    for (std::size_t i = 0; i < n; ++i) {
      char* d = static_cast<char*>(dev) + i * each;
      if (h2d) DFA_BENCH_CUDA(cudaMemcpyAsync(d, host[i], each, cudaMemcpyHostToDevice, s));
      else DFA_BENCH_CUDA(cudaMemcpyAsync(host[i], d, each, cudaMemcpyDeviceToHost, s));
    }
    DFA_BENCH_CUDA(cudaStreamSynchronize(s));
    st.SetIterationTime(seconds_since(t0));
  }
  st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * n * each));
  DFA_BENCH_CUDA(cudaStreamDestroy(s));
  for (auto h : host) DFA_BENCH_CUDA(cudaFreeHost(h));
  DFA_BENCH_CUDA(cudaFree(dev));
}

}  // namespace

BENCHMARK(BM_materialize_release)
    ->ArgsProduct({{1, 64, 2048}, {1, 0}, {0, 1}})
    ->ArgNames({"reservations", "warm", "batch"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_per_granule_baseline)->Arg(1)->Arg(64)->Arg(2048)->ArgName("reservations")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_cudaMalloc_baseline)->Arg(1)->Arg(64)->Arg(2048)->ArgName("reservations")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_host_backup)->Arg(0)->Arg(1)->ArgName("restore")->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_pinned_memcpy_baseline)->Arg(0)->Arg(1)->ArgName("h2d")->Unit(benchmark::kMillisecond)->UseManualTime();

BENCHMARK_MAIN();
