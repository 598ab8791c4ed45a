// deferalloc_demo: the main job in one program.  On the GPU when there is one, on the
// host driver otherwise (DEFERALLOC_CONF may force either: driver:cuda|host).
//
// 1. reserves a large range and shows it costs no physical memory;
// 2. streams a window through it: materialize a window, write it, release it to a
//    host backup, next window ... then restores every window and checks the bytes;
// 3. prints a short table of what it measured.
#include <deferalloc/deferalloc.hpp>

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
    const bool gpu = d.name() == "cuda";
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
    return bad == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "deferalloc_demo: %s\n", e.what());
    return 1;
  }
}
