// deferalloc_demo: the main job in one program.  On the GPU when there is one, on the
// host driver otherwise (DEFERALLOC_CONF may force either: driver:cuda|host).
//
// 1. reserves a large range and shows it costs no physical memory;
// 2. streams a window through it: materialize a window, write it, release it to a
//    host backup, next window ... then restores every window and checks the bytes;
// 3. runs the streamed AdamW optimizer with its FP32 state in pinned host memory: the
//    state's addresses are stable, its HBM never exceeds the window;
// 4. prints a short table of what it measured.
#include <deferalloc/deferalloc.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

using namespace deferalloc;
using clk = std::chrono::steady_clock;

static double since(clk::time_point t) { return std::chrono::duration<double>(clk::now() - t).count(); }

int main(int argc, char** argv) {
  try {
    const char* conf = std::getenv("DEFERALLOC_CONF");
    context ctx(parse_settings(conf ? conf : ""));
    driver& d = *ctx.drv;
    reservation_manager& m = *ctx.reservations;
    const bool gpu = d.kind() == deferalloc::driver_kind::cuda;
    const std::size_t GiB = std::size_t{1} << 30, MiB = std::size_t{1} << 20;
    const std::size_t reserve_bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (gpu ? 64 : 4)) * GiB;
    const std::size_t window = gpu ? 512 * MiB : 64 * MiB;
    const std::size_t streamed = gpu ? 8 * GiB : 512 * MiB;  // bytes pushed through the window
    std::printf("deferalloc demo: driver %s, device %d, granularity %zu KiB\n", d.name().c_str(), d.device(),
                d.granularity() >> 10);

    const auto free0 = d.get_memory_info().free_bytes;
    auto t0 = clk::now();
    const reservation_id id = m.reserve(reserve_bytes);
    const double t_reserve = since(t0);
    char* const base = static_cast<char*>(m.address(id));
    const auto free1 = d.get_memory_info().free_bytes;
    std::printf("reserved %zu GiB at %p in %.1f us; physical memory used: %zu bytes\n", reserve_bytes / GiB,
                static_cast<void*>(base), t_reserve * 1e6, free0 - free1);

    // Stream windows through the reservation, each released to a host backup.
    std::vector<std::uint8_t> pattern(window);
    std::mt19937_64 rng(42);
    for (auto& b : pattern) b = static_cast<std::uint8_t>(rng());
    const std::size_t windows = streamed / window;
    std::size_t peak_physical = 0;
    double t_mat = 0, t_rel = 0;
    for (std::size_t w = 0; w < windows; ++w) {
      const std::size_t off = w * window;
      t0 = clk::now();
      m.materialize(id, off, window, fill_mode::undefined);
      t_mat += since(t0);
      pattern[0] = static_cast<std::uint8_t>(w);  // each window distinct
      d.copy_async(base + off, pattern.data(), window, nullptr);
      d.synchronize_stream(nullptr);
      peak_physical = std::max(peak_physical, free0 - d.get_memory_info().free_bytes);
      t0 = clk::now();
      m.release(id, off, window, keep_mode::host);
      t_rel += since(t0);
    }
    // Restore everything at the same addresses and check every byte.
    std::vector<std::uint8_t> out(window);
    std::size_t bad = 0;
    double t_restore = 0;
    for (std::size_t w = 0; w < windows; ++w) {
      const std::size_t off = w * window;
      t0 = clk::now();
      m.materialize(id, off, window, fill_mode::restore);
      d.synchronize_stream(nullptr);
      t_restore += since(t0);
      d.copy_async(out.data(), base + off, window, nullptr);
      d.synchronize_stream(nullptr);
      pattern[0] = static_cast<std::uint8_t>(w);
      bad += out != pattern;
      m.release(id, off, window, keep_mode::discard);
    }
    if (static_cast<char*>(m.address(id)) != base) ++bad;
    auto st = m.stats();
    m.free(id);
    ctx.pool->trim();

    const double gb = static_cast<double>(windows * window) / 1e9;
    std::printf("\n%-44s %12s\n", "measure", "value");
    std::printf("%-44s %12zu\n", "reserved bytes (GiB)", reserve_bytes / GiB);
    std::printf("%-44s %12.1f\n", "physical peak while streaming (MiB)", peak_physical / double(MiB));
    std::printf("%-44s %12.1f\n", "window (MiB)", window / double(MiB));
    std::printf("%-44s %12.2f\n", "streamed (GB)", gb);
    std::printf("%-44s %12.2f\n", "release to host backup (GB/s)", gb / t_rel);
    std::printf("%-44s %12.2f\n", "materialize + restore (GB/s)", gb / t_restore);
    std::printf("%-44s %12.2f\n", "materialize, empty window (GB/s)", gb / t_mat);
    std::printf("%-44s %12llu\n", "chunks created", static_cast<unsigned long long>(st.pool.chunks_created));
    std::printf("%-44s %12llu\n", "chunks reused", static_cast<unsigned long long>(st.pool.chunks_reused));
    std::printf("%-44s %12s\n", "contents restored bit-exactly", bad == 0 ? "yes" : "NO");

    // The optimizer: FP32 main params + Adam moments of `params` BF16 parameters, home in
    // pinned host memory, streamed through a window.
    const std::size_t params = gpu ? std::size_t{1} << 30 : std::size_t{16} << 20;
    const std::size_t slice = std::size_t{64} << 20;  // host staging for the model's data
    auto model_id = m.reserve(params * 2), grad_id = m.reserve(params * 2);
    m.materialize(model_id, 0, whole, fill_mode::undefined);
    m.materialize(grad_id, 0, whole, fill_mode::undefined);
    std::vector<std::uint16_t> host(slice / 2);
    for (std::size_t off = 0; off < params * 2; off += slice) {
      for (auto& h : host) h = static_cast<std::uint16_t>(0x3C00 + (rng() & 0xFF));  // bf16 ~ 0.008 .. 0.016
      const std::size_t n = std::min(slice, params * 2 - off);
      d.copy_async(static_cast<char*>(m.address(model_id)) + off, host.data(), n, nullptr);
      d.copy_async(static_cast<char*>(m.address(grad_id)) + off, host.data(), n, nullptr);
      d.synchronize_stream(nullptr);
    }
    optim::optimizer_config oc;
    oc.home = optim::tier::host;
    oc.progress_line = true;
    const std::size_t free_before = d.get_memory_info().free_bytes;
    std::size_t opt_peak = 0;
    oc.on_progress = [&](const optim::progress&) { opt_peak = std::max(opt_peak, free_before - d.get_memory_info().free_bytes); };
    optim::streamed_adamw opt(ctx.drv, oc);
    opt.add_shard(static_cast<std::uint16_t*>(m.address(model_id)), params, "model");
    float* const state_addr = opt.shards()[0].main_param;
    opt.initialize();
    const auto init = opt.last_report();
    const void* grads[] = {m.address(grad_id)};
    double best = 0;
    for (int s = 1; s <= 4; ++s) {
      opt.step(grads, optim::grad_type::bf16);
      d.synchronize_stream(nullptr);
      const auto r = opt.last_report();
      best = std::max(best, r.gparams_per_second());
      std::printf("step %d: %.2f Gparam/s, %.2f GB to and %.2f GB from the device, state HBM peak %.0f MiB\n", s,
                  r.gparams_per_second(), r.bytes_to_device / 1e9, r.bytes_from_device / 1e9, opt_peak / double(MiB));
    }
    const bool stable = opt.shards()[0].main_param == state_addr;
    std::printf("\n%-44s %12s\n", "optimizer (host tier)", "value");
    std::printf("%-44s %12.2f\n", "parameters (G)", params / 1e9);
    std::printf("%-44s %12.1f\n", "FP32 state kept off the GPU (GB)", params * 12 / 1e9);
    std::printf("%-44s %12.0f\n", "window (MiB)", oc.window_bytes / double(MiB));
    std::printf("%-44s %12.0f\n", "state HBM peak, sampled (MiB)", opt_peak / double(MiB));
    std::printf("%-44s %12.2f\n", "initialize (Gparam/s)", init.gparams_per_second());
    std::printf("%-44s %12.2f\n", "best step (Gparam/s)", best);
    std::printf("%-44s %12s\n", "state address stable", stable ? "yes" : "NO");
    m.free(model_id);
    m.free(grad_id);
    return bad == 0 && stable ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deferalloc_demo: %s\n", e.what());
    return 1;
  }
}
