// Allocation speed, in one run, of deferalloc's caching allocator (C++ API) against
// PyTorch's native caching allocator (c10::cuda::CUDACachingAllocator::
// raw_alloc_with_stream / raw_delete) and cudaMallocAsync (default pool, release
// threshold raised so it caches):
//  - BM_pairs: cached alloc/free pairs, 512 B .. 64 MiB, on 1 and 4 streams;
//    items_per_second = pairs per second;
//  - BM_random: rmm's random-allocations scenario: 10,000 and 100,000 operations, 73%
//    allocations, sizes uniform in [1, 4 MiB] and [1, 64 MiB], live bytes capped at
//    16 GB; counters peak_reserved / peak_allocated and their ratio, peak reserved over
//    the peak of the bytes asked for (one denominator for all), device allocations.
// Without a GPU every benchmark reports SkipWithError.
#include <benchmark/benchmark.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#include <deferalloc/caching/caching_allocator.hpp>
#include <deferalloc/core/context.hpp>
#include <torch/torch.h>

#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct resource {
  virtual ~resource() = default;
  virtual void* alloc(std::size_t n, cudaStream_t s) = 0;
  virtual void free(void* p, std::size_t n, cudaStream_t s) = 0;
  virtual void reset_peaks() = 0;
  virtual double peak_reserved() = 0;
  virtual double peak_allocated() = 0;
  virtual void release_cache() = 0;
  /// Physical allocations made so far (cudaMalloc / cuMemCreate-backed growths); -1 unknown.
  virtual double device_allocs() { return -1; }
  /// VMM driver calls made so far (deferalloc only); -1 unknown.
  virtual double driver_calls() { return -1; }
  /// Blocks taken from another stream / lazy free events recorded (deferalloc only).
  virtual double reuses() { return 0; }
  virtual double events() { return 0; }
};

struct deferalloc_resource final : resource {
  deferalloc::context ctx{deferalloc::parse_settings("driver:cuda")};
  deferalloc::caching_allocator a{*ctx.reservations};
  void* alloc(std::size_t n, cudaStream_t s) override { return a.allocate(n, deferalloc::stream_t{s}); }
  void free(void* p, std::size_t n, cudaStream_t s) override { a.deallocate(p, n, deferalloc::stream_t{s}); }
  void reset_peaks() override { a.reset_peak_stats(); }
  double peak_reserved() override { return static_cast<double>(a.stat("reserved_bytes.all.peak")); }
  double peak_allocated() override { return static_cast<double>(a.stat("allocated_bytes.all.peak")); }
  void release_cache() override { a.empty_cache(); }
  double device_allocs() override { return static_cast<double>(a.stat("num_device_alloc")); }
  double reuses() override { return static_cast<double>(a.stat("deferalloc.cross_stream_reuses")); }
  double events() override { return static_cast<double>(a.stat("deferalloc.stream_events")); }
  double driver_calls() override {
    double n = 0;
    for (auto c : ctx.drv->call_counts().calls) n += static_cast<double>(c);
    return n;
  }
};

struct torch_resource final : resource {
  torch_resource() { at::empty({1}, at::TensorOptions().device(at::kCUDA)); }  // initializes the allocator
  void* alloc(std::size_t n, cudaStream_t s) override {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(n, s);
  }
  void free(void* p, std::size_t, cudaStream_t) override { c10::cuda::CUDACachingAllocator::raw_delete(p); }
  void reset_peaks() override { c10::cuda::CUDACachingAllocator::resetPeakStats(0); }
  double peak_reserved() override {
    return static_cast<double>(c10::cuda::CUDACachingAllocator::getDeviceStats(0).reserved_bytes[0].peak);
  }
  double peak_allocated() override {
    return static_cast<double>(c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak);
  }
  void release_cache() override { c10::cuda::CUDACachingAllocator::emptyCache(); }
  double device_allocs() override {
    return static_cast<double>(c10::cuda::CUDACachingAllocator::getDeviceStats(0).num_device_alloc);
  }
};

struct async_resource final : resource {
  cudaMemPool_t pool{};
  async_resource() {
    cuda_check(cudaDeviceGetDefaultMemPool(&pool, 0), "cudaDeviceGetDefaultMemPool");
    std::uint64_t keep = ~std::uint64_t{0};
    cuda_check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "release threshold");
  }
  void* alloc(std::size_t n, cudaStream_t s) override {
    void* p = nullptr;
    cuda_check(cudaMallocAsync(&p, n, s), "cudaMallocAsync");
    return p;
  }
  void free(void* p, std::size_t, cudaStream_t s) override { cuda_check(cudaFreeAsync(p, s), "cudaFreeAsync"); }
  void reset_peaks() override {
    std::uint64_t zero = 0;
    cuda_check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero), "reset");
    cuda_check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero), "reset");
  }
  double get(cudaMemPoolAttr a) {
    std::uint64_t v = 0;
    cuda_check(cudaMemPoolGetAttribute(pool, a, &v), "attribute");
    return static_cast<double>(v);
  }
  double peak_reserved() override { return get(cudaMemPoolAttrReservedMemHigh); }
  double peak_allocated() override { return get(cudaMemPoolAttrUsedMemHigh); }
  void release_cache() override {
    cuda_check(cudaDeviceSynchronize(), "sync");
    cuda_check(cudaMemPoolTrimTo(pool, 0), "trim");
  }
};

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

template <typename R>
resource* get() {
  static std::unique_ptr<R> r;
  if (!r) r = std::make_unique<R>();
  return r.get();
}

// The same four streams for every benchmark (allocators keep per-stream state, as
// PyTorch's stream pool does; streams are never destroyed during the run).
std::vector<cudaStream_t> streams(int n) {
  static std::vector<cudaStream_t> all;
  while (all.size() < 4) {
    cudaStream_t x = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking), "cudaStreamCreate");
    all.push_back(x);
  }
  return {all.begin(), all.begin() + n};
}

template <typename R>
void BM_pairs(benchmark::State& state) {
  if (!have_gpu()) return state.SkipWithError("needs a GPU");
  resource* r = get<R>();
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::vector<cudaStream_t> ss = streams(static_cast<int>(state.range(1)));
  for (auto s : ss) r->free(r->alloc(n, s), n, s);  // warm: the block is cached
  const double allocs0 = r->device_allocs(), calls0 = r->driver_calls(), reuses0 = r->reuses(), events0 = r->events();
  for (auto _ : state)
    for (auto s : ss) {
      void* p = r->alloc(n, s);
      benchmark::DoNotOptimize(p);
      r->free(p, n, s);
    }
  for (auto s : ss) cuda_check(cudaStreamSynchronize(s), "sync");
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * ss.size()));  // pairs
  state.counters["streams"] = static_cast<double>(ss.size());
  state.counters["device_allocs_in_loop"] = r->device_allocs() - allocs0;
  state.counters["driver_calls_in_loop"] = r->driver_calls() - calls0;
  state.counters["cross_stream_reuses_in_loop"] = r->reuses() - reuses0;
  state.counters["stream_events_in_loop"] = r->events() - events0;
}

template <typename R>
void BM_random(benchmark::State& state) {
  if (!have_gpu()) return state.SkipWithError("needs a GPU");
  resource* r = get<R>();
  const auto ops = static_cast<std::size_t>(state.range(0));
  const auto max_size = static_cast<std::size_t>(state.range(1)) << 20;
  constexpr std::size_t cap = 16'000'000'000ull;
  cudaStream_t s = streams(1)[0];
  std::size_t peak_live = 0;
  double allocs0 = 0;
  r->release_cache();
  r->reset_peaks();
  for (auto _ : state) {
    std::mt19937_64 rng(42);
    std::uniform_int_distribution<std::size_t> size_dist(1, max_size);
    std::vector<std::pair<void*, std::size_t>> live;
    std::size_t live_bytes = 0;
    peak_live = 0;
    allocs0 = r->device_allocs();
    for (std::size_t i = 0; i < ops; ++i) {
      const std::size_t n = size_dist(rng);
      const bool alloc = live.empty() || (rng() % 100 < 73 && live_bytes + n <= cap);
      if (alloc) {
        live.emplace_back(r->alloc(n, s), n);
        live_bytes += n;
        peak_live = std::max(peak_live, live_bytes);
      } else {
        const std::size_t k = rng() % live.size();
        r->free(live[k].first, live[k].second, s);
        live_bytes -= live[k].second;
        live[k] = live.back();
        live.pop_back();
      }
    }
    for (auto& [p, n] : live) r->free(p, n, s);
  }
  cuda_check(cudaStreamSynchronize(s), "sync");
  state.counters["peak_reserved_GB"] = r->peak_reserved() / 1e9;
  state.counters["peak_allocated_GB"] = r->peak_allocated() / 1e9;
  state.counters["reserved_over_allocated"] = r->peak_reserved() / std::max(1.0, r->peak_allocated());
  // The same denominator for every allocator: the peak of the bytes the run asked for
  // (allocators count rounding and unsplit remainders in "allocated" differently).
  state.counters["peak_live_GB"] = static_cast<double>(peak_live) / 1e9;
  state.counters["reserved_over_live"] = r->peak_reserved() / std::max(1.0, static_cast<double>(peak_live));
  state.counters["device_allocs"] = r->device_allocs() - allocs0;
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * ops));
  r->release_cache();
}

void pair_args(benchmark::internal::Benchmark* b) {
  for (int streams : {1, 4})
  {
    for (std::int64_t n = 512; n <= (64 << 20); n *= 8) b->Args({n, streams});
    b->Args({64 << 20, streams});
  }
}
void random_args(benchmark::internal::Benchmark* b) {
  for (std::int64_t ops : {10'000, 100'000})
    for (std::int64_t mib : {4, 64}) b->Args({ops, mib});
  b->Iterations(1)->Unit(benchmark::kMillisecond);
}

}  // namespace

BENCHMARK_TEMPLATE(BM_pairs, deferalloc_resource)->Apply(pair_args);
BENCHMARK_TEMPLATE(BM_pairs, torch_resource)->Apply(pair_args);
BENCHMARK_TEMPLATE(BM_pairs, async_resource)->Apply(pair_args);
BENCHMARK_TEMPLATE(BM_random, deferalloc_resource)->Apply(random_args);
BENCHMARK_TEMPLATE(BM_random, torch_resource)->Apply(random_args);
BENCHMARK_TEMPLATE(BM_random, async_resource)->Apply(random_args);

BENCHMARK_MAIN();
