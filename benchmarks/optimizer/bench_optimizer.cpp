// The streamed AdamW step and initializer on each tier, each beside its bound or the
// baseline a user would otherwise pick, measured in the same run:
//   device tier  vs torch fused AdamW (at::_fused_adamw_ through LibTorch), same sizes;
//   host tier    vs the PCIe bound from a duplex pinned copy (12 B/param each way) and
//                vs the serial order (read -> step -> write, one 200 M-element bucket at a
//                time through one staging buffer, with torch's fused AdamW);
//   file tier    vs the bound from direct-I/O read and write bandwidth on the same disk;
//   initialize   vs each link's bound (device: D2D copy; host: D2H; file: disk write).
// Sizes: DFA_BENCH_HOST_MPARAMS (default 4000), DFA_BENCH_FILE_MPARAMS (250),
// DFA_BENCH_DEVICE_MPARAMS (1000); file tier under DFA_BENCH_DIR (default /tmp).
// Counters: gparams_per_s (work), gbps (baselines), peak_state_hbm (bytes, host tier:
// cuMemGetInfo sampled after every piece of init and steps), window.
#include <deferalloc/core/chunk_pool.hpp>
#include <deferalloc/core/reservations.hpp>
#include <deferalloc/optim/optimizer.hpp>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "bench_common.hpp"

#ifdef DFA_HAVE_TORCH
#include <ATen/ATen.h>
#endif

using namespace deferalloc;
using namespace deferalloc::optim;
using namespace dfa_bench;

namespace {

std::size_t env_size(const char* name, std::size_t def) {
  const char* e = std::getenv(name);
  return e ? std::strtoull(e, nullptr, 10) : def;
}
std::string bench_dir() {
  const char* e = std::getenv("DFA_BENCH_DIR");
  return e ? e : "/tmp";
}

// The model: BF16 params and gradients in shards of at most 500 M elements (cudaMalloc).
struct model {
  explicit model(std::size_t count) {
    const std::size_t shard = 500'000'000;
    for (std::size_t done = 0; done < count; done += shard) sizes.push_back(std::min(shard, count - done));
    for (auto n : sizes) {
      void *p = nullptr, *g = nullptr;
      DFA_BENCH_CUDA(cudaMalloc(&p, n * 2));
      DFA_BENCH_CUDA(cudaMalloc(&g, n * 2));
      DFA_BENCH_CUDA(cudaMemset(p, 0x3F, n * 2));  // bf16 0x3F3F = 0.746
      DFA_BENCH_CUDA(cudaMemset(g, 0x3D, n * 2));  // bf16 0x3D3D = 0.046
      params.push_back(static_cast<std::uint16_t*>(p));
      grads.push_back(g);
    }
  }
  ~model() {
    for (auto p : params) cudaFree(p);
    for (auto g : grads) cudaFree(const_cast<void*>(g));
  }
  std::size_t total() const {
    std::size_t t = 0;
    for (auto n : sizes) t += n;
    return t;
  }
  std::vector<std::size_t> sizes;
  std::vector<std::uint16_t*> params;
  std::vector<const void*> grads;
};

// Step and init throughput of one tier; iteration 0 of the loop is the first step.
void BM_tier(benchmark::State& st, tier t, std::size_t params) {
  if (!on_gpu()) {
    st.SkipWithError("no CUDA device");
    return;
  }
  auto drv = make_cuda_driver(0);
  model mdl(params);
  optimizer_config cfg;
  cfg.home = t;
  cfg.directory = bench_dir() + "/dfa-bench-state";
  ::mkdir(cfg.directory.c_str(), 0700);  // the file tier refuses a missing directory
  cfg.window_bytes = env_size("DFA_BENCH_WINDOW_MB", 512) << 20;
  cfg.depth = static_cast<int>(env_size("DFA_BENCH_DEPTH", 3));
  std::size_t free0 = 0, peak = 0;
  cfg.on_progress = [&](const progress&) { peak = std::max(peak, free0 - drv->get_memory_info().free_bytes); };
  {  // Warm-up: load the kernels' module (lazy loading) outside the timed initializer.
    optimizer_config small = cfg;
    small.home = tier::device;
    small.on_progress = nullptr;
    streamed_adamw warm(drv, small);
    warm.add_shard(mdl.params[0], 1 << 20);
    warm.initialize();
    const void* g0[] = {mdl.grads[0]};
    warm.step(g0, grad_type::bf16);
    warm.sync_model_params();
    DFA_BENCH_CUDA(cudaDeviceSynchronize());
  }
  streamed_adamw opt(drv, cfg);
  for (std::size_t i = 0; i < mdl.sizes.size(); ++i) opt.add_shard(mdl.params[i], mdl.sizes[i]);
  DFA_BENCH_CUDA(cudaDeviceSynchronize());
  free0 = drv->get_memory_info().free_bytes;
  opt.initialize();
  const step_report init = opt.last_report();
  opt.step(mdl.grads, grad_type::bf16);  // warm-up (first step reads no moments)
  DFA_BENCH_CUDA(cudaDeviceSynchronize());
  for (auto _ : st) {
    auto t0 = clock::now();
    opt.step(mdl.grads, grad_type::bf16);
    DFA_BENCH_CUDA(cudaDeviceSynchronize());
    st.SetIterationTime(seconds_since(t0));
  }
  st.counters["params"] = static_cast<double>(mdl.total());
  st.counters["gparams_per_s"] = benchmark::Counter(static_cast<double>(mdl.total()) / 1e9 * st.iterations(),
                                                    benchmark::Counter::kIsRate);
  st.counters["init_gparams_per_s"] = init.gparams_per_second();
  if (t == tier::device) {
    // The initializer's mirror (BF16 <- FP32, 6 B/param) over memory already touched: tells
    // the kernel's speed apart from the first write into freshly created chunks.
    DFA_BENCH_CUDA(cudaDeviceSynchronize());
    auto t0 = clock::now();
    opt.sync_model_params();
    DFA_BENCH_CUDA(cudaDeviceSynchronize());
    st.counters["downcast_gparams_per_s"] = static_cast<double>(mdl.total()) / seconds_since(t0) / 1e9;
  }
  if (t != tier::device) {
    st.counters["peak_state_hbm"] = static_cast<double>(peak);
    st.counters["window"] = static_cast<double>(cfg.window_bytes);
    st.counters["granule"] = static_cast<double>(drv->granularity());
  }
  if (t == tier::file) {  // plain calls: std::filesystem crashed here with the GPU machine's static libstdc++
    ::unlink((cfg.directory + "/deferalloc-rank0.state").c_str());
    ::rmdir(cfg.directory.c_str());
  }
}

// Duplex pinned copy: H2D and D2H of `bytes` each, at once, on two streams.
void BM_pinned_duplex(benchmark::State& st) {
  if (!on_gpu()) {
    st.SkipWithError("no CUDA device");
    return;
  }
  const std::size_t bytes = std::size_t{4} << 30;
  void *h1, *h2, *d1, *d2;
  DFA_BENCH_CUDA(cudaMallocHost(&h1, bytes));
  DFA_BENCH_CUDA(cudaMallocHost(&h2, bytes));
  DFA_BENCH_CUDA(cudaMalloc(&d1, bytes));
  DFA_BENCH_CUDA(cudaMalloc(&d2, bytes));
  cudaStream_t a, b;
  cudaEvent_t a0, a1, b0, b1;
  DFA_BENCH_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  DFA_BENCH_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  for (auto e : {&a0, &a1, &b0, &b1}) DFA_BENCH_CUDA(cudaEventCreate(e));
  double h2d = 0, d2h = 0;
  for (auto _ : st) {
    auto t0 = clock::now();
    DFA_BENCH_CUDA(cudaEventRecord(a0, a));
    DFA_BENCH_CUDA(cudaEventRecord(b0, b));
    DFA_BENCH_CUDA(cudaMemcpyAsync(d1, h1, bytes, cudaMemcpyHostToDevice, a));
    DFA_BENCH_CUDA(cudaMemcpyAsync(h2, d2, bytes, cudaMemcpyDeviceToHost, b));
    DFA_BENCH_CUDA(cudaEventRecord(a1, a));
    DFA_BENCH_CUDA(cudaEventRecord(b1, b));
    DFA_BENCH_CUDA(cudaDeviceSynchronize());
    st.SetIterationTime(seconds_since(t0));
    float ms_a = 0, ms_b = 0;
    DFA_BENCH_CUDA(cudaEventElapsedTime(&ms_a, a0, a1));
    DFA_BENCH_CUDA(cudaEventElapsedTime(&ms_b, b0, b1));
    h2d = bytes / (ms_a * 1e-3), d2h = bytes / (ms_b * 1e-3);
  }
  st.counters["h2d_gbps"] = h2d / 1e9;
  st.counters["d2h_gbps"] = d2h / 1e9;
  // One direction alone, for the initializer's bound.
  auto t0 = clock::now();
  DFA_BENCH_CUDA(cudaMemcpyAsync(h2, d2, bytes, cudaMemcpyDeviceToHost, b));
  DFA_BENCH_CUDA(cudaStreamSynchronize(b));
  st.counters["d2h_alone_gbps"] = bytes / seconds_since(t0) / 1e9;
  t0 = clock::now();
  DFA_BENCH_CUDA(cudaMemcpyAsync(d2, d1, bytes, cudaMemcpyDeviceToDevice, b));
  DFA_BENCH_CUDA(cudaStreamSynchronize(b));
  st.counters["d2d_gbps"] = 2.0 * bytes / seconds_since(t0) / 1e9;  // read + write
  for (auto e : {a0, a1, b0, b1}) cudaEventDestroy(e);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  cudaFreeHost(h1);
  cudaFreeHost(h2);
  cudaFree(d1);
  cudaFree(d2);
}

// First write into memory that was never touched, against a second write into the same
// memory: a 2 GiB D2D copy into (a) a fresh cudaMalloc buffer, (b) a fresh deferred
// reservation (cuMemCreate + cuMemMap through the pool).  Tells whether the device-tier
// initializer's one-shot figure pays for first touch, and whether VMM memory pays more
// than cudaMalloc memory for it.
void BM_first_touch(benchmark::State& st) {
  if (!on_gpu()) {
    st.SkipWithError("no CUDA device");
    return;
  }
  const std::size_t bytes = std::size_t{2} << 30;
  auto drv = make_cuda_driver(0);
  auto pool = std::make_shared<chunk_pool>(drv);
  reservation_manager mgr(pool, drv);
  void* src = nullptr;
  DFA_BENCH_CUDA(cudaMalloc(&src, bytes));
  DFA_BENCH_CUDA(cudaMemset(src, 1, bytes));
  DFA_BENCH_CUDA(cudaDeviceSynchronize());
  auto copy = [&](void* dst) {
    DFA_BENCH_CUDA(cudaDeviceSynchronize());
    auto t0 = clock::now();
    DFA_BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr));
    DFA_BENCH_CUDA(cudaDeviceSynchronize());
    return 2.0 * bytes / seconds_since(t0) / 1e9;  // read + write, as d2d_gbps
  };
  double mf = 0, ms = 0, vf = 0, vs = 0;
  for (auto _ : st) {
    void* dst = nullptr;
    auto t0 = clock::now();
    DFA_BENCH_CUDA(cudaMalloc(&dst, bytes));
    mf = copy(dst), ms = copy(dst);
    DFA_BENCH_CUDA(cudaFree(dst));
    const reservation_id r = mgr.reserve(bytes);
    mgr.materialize(r, 0, bytes, fill_mode::undefined, nullptr);
    vf = copy(mgr.address(r)), vs = copy(mgr.address(r));
    mgr.free(r);
    pool->trim(0);  // the next iteration creates its chunks again
    st.SetIterationTime(seconds_since(t0));
  }
  st.counters["cudamalloc_first_gbps"] = mf;
  st.counters["cudamalloc_second_gbps"] = ms;
  st.counters["vmm_first_gbps"] = vf;
  st.counters["vmm_second_gbps"] = vs;
  cudaFree(src);
}

// Direct-I/O write then read bandwidth on the benchmark directory's disk: 8 threads,
// 8 MiB requests, the same shape as the file tier's I/O.
void BM_direct_io(benchmark::State& st) {
  const std::size_t bytes = std::size_t{4} << 30, req = std::size_t{8} << 20;
  const int threads = 8;
  const std::string path = bench_dir() + "/dfa-bench-io.tmp";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    st.SkipWithError("cannot open a file with O_DIRECT in DFA_BENCH_DIR");
    return;
  }
  ::fallocate(fd, 0, 0, static_cast<off_t>(bytes));
  std::vector<void*> bufs(threads);
  for (auto& b : bufs) {
    b = std::aligned_alloc(4096, req);
    std::memset(b, 0x5A, req);
  }
  auto pass = [&](bool write) {
    std::atomic<std::size_t> next{0};
    std::atomic<bool> failed{false};
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        for (std::size_t off; (off = next.fetch_add(req)) < bytes;) {
          ssize_t n = write ? ::pwrite(fd, bufs[t], req, off) : ::pread(fd, bufs[t], req, off);
          if (n != static_cast<ssize_t>(req)) failed = true;
        }
      });
    for (auto& t : ts) t.join();
    return !failed;
  };
  double wbw = 0, rbw = 0;
  for (auto _ : st) {
    auto t0 = clock::now();
    bool ok = pass(true);
    ::fdatasync(fd);
    wbw = bytes / seconds_since(t0);
    t0 = clock::now();
    ok = pass(false) && ok;
    rbw = bytes / seconds_since(t0);
    st.SetIterationTime(bytes / wbw + bytes / rbw);
    if (!ok) st.SkipWithError("short direct I/O");
  }
  st.counters["write_gbps"] = wbw / 1e9;
  st.counters["read_gbps"] = rbw / 1e9;
  for (auto b : bufs) std::free(b);
  ::close(fd);
  ::unlink(path.c_str());
}

#ifdef DFA_HAVE_TORCH
// torch fused AdamW with FP32 params and grads resident: 28 B/param, as the device tier.
void BM_torch_fused_adamw(benchmark::State& st, std::size_t params) {
  if (!on_gpu()) {
    st.SkipWithError("no CUDA device");
    return;
  }
  const std::size_t shard = 500'000'000;
  auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  std::vector<at::Tensor> p, g, m, v, steps;
  for (std::size_t done = 0; done < params; done += shard) {
    const auto n = static_cast<int64_t>(std::min(shard, params - done));
    p.push_back(at::randn({n}, opts));
    g.push_back(at::randn({n}, opts).mul_(0.1));
    m.push_back(at::zeros({n}, opts));
    v.push_back(at::zeros({n}, opts));
    steps.push_back(at::zeros({1}, opts));
  }
  auto step = [&] {
    for (auto& s : steps) s.add_(1);
    at::_fused_adamw_(p, g, m, v, {}, steps, 1e-3, 0.9, 0.999, 0.01, 1e-8, false, false);
  };
  step();
  DFA_BENCH_CUDA(cudaDeviceSynchronize());
  for (auto _ : st) {
    auto t0 = clock::now();
    step();
    DFA_BENCH_CUDA(cudaDeviceSynchronize());
    st.SetIterationTime(seconds_since(t0));
  }
  st.counters["gparams_per_s"] =
      benchmark::Counter(static_cast<double>(params) / 1e9 * st.iterations(), benchmark::Counter::kIsRate);
}

// The known streaming backend's order: per 200 M-element bucket, H2D the state into one
// staging buffer, torch fused AdamW, D2H back, each waited for before the next.
void BM_serial_baseline(benchmark::State& st, std::size_t params) {
  if (!on_gpu()) {
    st.SkipWithError("no CUDA device");
    return;
  }
  const std::size_t bucket = 200'000'000;
  const auto b = static_cast<int64_t>(bucket);
  auto dopts = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  auto hopts = at::TensorOptions().dtype(at::kFloat).pinned_memory(true);
  std::vector<at::Tensor> home;
  for (int i = 0; i < 3; ++i) home.push_back(at::full({static_cast<int64_t>(params)}, 0.5f, hopts));
  at::Tensor sp = at::empty({b}, dopts), sm = at::empty({b}, dopts), sv = at::empty({b}, dopts);
  at::Tensor grad = at::full({b}, 0.01f, dopts), steps = at::ones({1}, dopts);
  auto step = [&] {
    for (std::size_t off = 0; off < params; off += bucket) {
      const auto n = static_cast<int64_t>(std::min(bucket, params - off));
      at::Tensor dst[3] = {sp.narrow(0, 0, n), sm.narrow(0, 0, n), sv.narrow(0, 0, n)};
      for (int i = 0; i < 3; ++i) dst[i].copy_(home[i].narrow(0, off, n), true);
      DFA_BENCH_CUDA(cudaDeviceSynchronize());
      at::_fused_adamw_({dst[0]}, {grad.narrow(0, 0, n)}, {dst[1]}, {dst[2]}, {}, {steps}, 1e-3, 0.9, 0.999, 0.01, 1e-8,
                        false, false);
      DFA_BENCH_CUDA(cudaDeviceSynchronize());
      for (int i = 0; i < 3; ++i) home[i].narrow(0, off, n).copy_(dst[i], true);
      DFA_BENCH_CUDA(cudaDeviceSynchronize());
    }
  };
  step();
  for (auto _ : st) {
    auto t0 = clock::now();
    step();
    st.SetIterationTime(seconds_since(t0));
  }
  st.counters["gparams_per_s"] =
      benchmark::Counter(static_cast<double>(params) / 1e9 * st.iterations(), benchmark::Counter::kIsRate);
}
#endif

const std::size_t k_device = env_size("DFA_BENCH_DEVICE_MPARAMS", 1000) * 1'000'000;
const std::size_t k_host = env_size("DFA_BENCH_HOST_MPARAMS", 4000) * 1'000'000;
const std::size_t k_file = env_size("DFA_BENCH_FILE_MPARAMS", 250) * 1'000'000;

}  // namespace

BENCHMARK(BM_pinned_duplex)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_first_touch)->Iterations(2)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_direct_io)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_tier, device, tier::device, k_device)->Iterations(5)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_tier, host, tier::host, k_host)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_tier, file, tier::file, k_file)->Iterations(2)->UseManualTime()->Unit(benchmark::kMillisecond);
#ifdef DFA_HAVE_TORCH
BENCHMARK_CAPTURE(BM_torch_fused_adamw, same_size_as_device, k_device)->Iterations(5)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_serial_baseline, bucket_200M, std::min<std::size_t>(k_host, 1'000'000'000))
    ->Iterations(2)->UseManualTime()->Unit(benchmark::kMillisecond);
#endif

BENCHMARK_MAIN();
