// The streamed AdamW optimizer, on the driver under test (host: the CPU twin; cuda:
// the CUDA kernels).  Tiers must agree bit for bit, match a double-precision
// reference, keep the HBM peak under the window, survive I/O and memory faults with
// the previous step intact, resume after a crash, and checkpoint exactly.
#include <deferalloc/optim/optimizer.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <tuple>

#include <deferalloc/deferalloc.h>

#include "../optimizer/kernels/adamw_math.hpp"
#include "../optimizer/store/file_store.hpp"
#include "common.hpp"
#include "core/driver/fault_driver.hpp"

using namespace deferalloc;
using namespace deferalloc::optim;
using namespace dfa_test;

namespace {

// Device memory for the model's BF16 params and gradients, from its own manager.
struct device_buffers {
  explicit device_buffers(std::shared_ptr<driver> d) : s(std::move(d)) {}
  void* alloc(std::size_t bytes) {
    auto id = s.mgr->reserve(bytes);
    s.mgr->materialize(id, 0, whole, fill_mode::zero);
    return s.mgr->address(id);
  }
  stack s;
};

std::vector<std::uint16_t> random_bf16(std::size_t n, std::uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = optim::detail::to_bf16(nd(rng));
  return v;
}

struct problem {
  std::vector<std::size_t> sizes;
  std::size_t window;
  int steps = 10;
  std::vector<std::vector<std::uint16_t>> params;             // initial BF16 params
  std::vector<std::vector<std::vector<std::uint16_t>>> grads;  // [step][shard]
  adamw_params hyper{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f};
  float scale(int step) const { return step % 3 == 1 ? 0.5f : 1.0f; }
};

// Shard sizes in units of the granule (in floats): one larger than the window, odd tails.
problem make_problem(std::size_t granule, int steps = 10) {
  problem p;
  const std::size_t base = granule / 4;
  p.sizes = {13 * base + 1, base + base / 3 + 3, 5001};
  p.window = 3 * 12 * granule;  // depth 3, one granule of each array per piece
  p.steps = steps;
  for (std::size_t s = 0; s < p.sizes.size(); ++s) p.params.push_back(random_bf16(p.sizes[s], 10 + s, 1.0f));
  p.grads.resize(steps);
  for (int t = 0; t < steps; ++t)
    for (std::size_t s = 0; s < p.sizes.size(); ++s) p.grads[t].push_back(random_bf16(p.sizes[s], 1000 * t + s, 0.1f));
  return p;
}

struct result {
  std::vector<std::vector<float>> main, m, v;
  std::vector<std::vector<std::uint16_t>> bf16;
};

// The model and its optimizer on one driver.
struct run {
  run(std::shared_ptr<driver> d, const problem& p, optimizer_config cfg) : drv(d), bufs(d), prob(p) {
    cfg.window_bytes = p.window;
    cfg.adamw = p.hyper;
    opt = std::make_unique<streamed_adamw>(d, cfg);
    for (std::size_t s = 0; s < p.sizes.size(); ++s) {
      params.push_back(static_cast<std::uint16_t*>(bufs.alloc(p.sizes[s] * 2)));
      grads.push_back(bufs.alloc(p.sizes[s] * 2));
      upload(*d, params.back(), as_bytes(p.params[s]));
      opt->add_shard(params.back(), p.sizes[s], "layer" + std::to_string(s));
    }
  }
  static std::vector<std::uint8_t> as_bytes(const std::vector<std::uint16_t>& v) {
    std::vector<std::uint8_t> b(v.size() * 2);
    std::memcpy(b.data(), v.data(), b.size());
    return b;
  }
  void load_grads(int t) {
    for (std::size_t s = 0; s < prob.sizes.size(); ++s) upload(*drv, const_cast<void*>(grads[s]), as_bytes(prob.grads[t][s]));
  }
  void step(int t) {
    load_grads(t);
    opt->step(grads, grad_type::bf16, prob.scale(t));
    drv->synchronize_stream(nullptr);
  }
  result state() {
    result r;
    for (std::size_t s = 0; s < prob.sizes.size(); ++s) {
      const std::size_t n = prob.sizes[s];
      r.main.emplace_back(n, -1.0f);
      r.m.emplace_back(n, -1.0f);
      r.v.emplace_back(n, -1.0f);
      opt->read_state(s, r.main.back().data(), r.m.back().data(), r.v.back().data());
      auto raw = download(*drv, params[s], n * 2);
      r.bf16.emplace_back(n);
      std::memcpy(r.bf16.back().data(), raw.data(), n * 2);
    }
    return r;
  }
  std::shared_ptr<driver> drv;
  device_buffers bufs;
  const problem& prob;
  std::unique_ptr<streamed_adamw> opt;
  std::vector<std::uint16_t*> params;
  std::vector<const void*> grads;
};

optimizer_config config_for(tier t, const std::string& dir = {}) {
  optimizer_config c;
  c.home = t;
  c.directory = dir;
  c.io_threads = 3;
  c.io_request_bytes = 64 << 10;
  c.depth = 3;  // the problems' windows are sized for it; depth 0 (the default) has its own test
  return c;
}

void expect_same(const result& a, const result& b, const std::string& what) {
  for (std::size_t s = 0; s < a.main.size(); ++s) {
    EXPECT_EQ(std::memcmp(a.main[s].data(), b.main[s].data(), a.main[s].size() * 4), 0) << what << ": main, shard " << s;
    EXPECT_EQ(std::memcmp(a.m[s].data(), b.m[s].data(), a.m[s].size() * 4), 0) << what << ": exp_avg, shard " << s;
    EXPECT_EQ(std::memcmp(a.v[s].data(), b.v[s].data(), a.v[s].size() * 4), 0) << what << ": exp_avg_sq, shard " << s;
    EXPECT_EQ(a.bf16[s], b.bf16[s]) << what << ": bf16 params, shard " << s;
  }
}

// The CPU twin (same per-element arithmetic) in float, and a reference in double.
// `before(t, r)` runs before step t (a user's edit of the parameters).
result cpu_twin(const problem& p, int steps, const std::function<void(int, result&)>& before = {}) {
  result r;
  for (std::size_t s = 0; s < p.sizes.size(); ++s) {
    r.main.emplace_back(p.sizes[s]);
    for (std::size_t i = 0; i < p.sizes[s]; ++i) r.main[s][i] = optim::detail::from_bf16(p.params[s][i]);
    r.m.emplace_back(p.sizes[s], 0.0f);
    r.v.emplace_back(p.sizes[s], 0.0f);
    r.bf16.push_back(p.params[s]);
  }
  for (int t = 0; t < steps; ++t) {
    if (before) before(t, r);
    const auto& h = p.hyper;
    // The bias corrections with the powf of the backend under test (the device's on CUDA).
    static const std::shared_ptr<driver> pow_driver = make_driver();
    const auto k = optim::detail::make_scalars(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, t + 1, p.scale(t),
                                               [](float b, float e) { return optim::backend_pow(*pow_driver, b, e); });
    for (std::size_t s = 0; s < p.sizes.size(); ++s)
      for (std::size_t i = 0; i < p.sizes[s]; ++i)
        r.bf16[s][i] = optim::detail::adamw_element(r.main[s][i], r.m[s][i], r.v[s][i],
                                                    optim::detail::from_bf16(p.grads[t][s][i]), k);
  }
  return r;
}

double rel_error_vs_double(const problem& p, const result& got) {
  double num = 0, den = 0;
  for (std::size_t s = 0; s < p.sizes.size(); ++s)
    for (std::size_t i = 0; i < p.sizes[s]; ++i) {
      double x = optim::detail::from_bf16(p.params[s][i]), m = 0, v = 0;
      const auto& h = p.hyper;
      for (int t = 0; t < p.steps; ++t) {
        const double g = double(optim::detail::from_bf16(p.grads[t][s][i])) * p.scale(t);
        x -= double(h.lr) * h.weight_decay * x;
        m = h.beta1 * m + (1.0 - h.beta1) * g;
        v = h.beta2 * v + (1.0 - h.beta2) * g * g;
        const double bc1 = 1.0 - std::pow(double(h.beta1), t + 1.0), bc2 = 1.0 - std::pow(double(h.beta2), t + 1.0);
        x -= (h.lr / bc1) * m / (std::sqrt(v) / std::sqrt(bc2) + h.eps);
      }
      num += (got.main[s][i] - x) * (got.main[s][i] - x);
      den += x * x;
    }
  return std::sqrt(num / den);
}

}  // namespace

TEST(optimizer, tiers_agree_bit_for_bit_and_match_the_references) {
  auto d = make_driver();
  const problem p = make_problem(d->granularity());
  temp_dir dir;
  std::vector<result> results;
  for (tier t : {tier::device, tier::host, tier::file}) {
    run r(d, p, config_for(t, dir.path));
    r.opt->initialize();
    for (int s = 0; s < p.steps; ++s) r.step(s);
    EXPECT_EQ(r.opt->steps(), static_cast<std::uint64_t>(p.steps));
    results.push_back(r.state());
  }
  expect_same(results[0], results[1], "device vs host tier");
  expect_same(results[0], results[2], "device vs file tier");
  expect_same(results[0], cpu_twin(p, p.steps), "kernel vs CPU twin");
  const double err = rel_error_vs_double(p, results[0]);
  std::printf("relative error of main params against the double reference after %d steps: %.3g\n", p.steps, err);
  EXPECT_LT(err, 1e-6);
}

TEST(optimizer, peak_physical_memory_stays_under_the_window_and_addresses_are_stable) {
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 3);
  std::size_t free0 = 0, worst = 0;
  optimizer_config cfg = config_for(tier::host);
  cfg.on_progress = [&](const progress&) { worst = std::max(worst, free0 - d->get_memory_info().free_bytes); };
  run r(d, p, cfg);
  free0 = d->get_memory_info().free_bytes;
  float* const main0 = r.opt->shards()[0].main_param;
  r.opt->initialize();
  for (int s = 0; s < p.steps; ++s) {
    r.step(s);
    EXPECT_EQ(r.opt->shards()[0].main_param, main0);
    EXPECT_EQ(r.opt->reservations().stats().backed_bytes, 0u) << "state left backed between steps";
    EXPECT_LE(r.opt->last_report().peak_backed_bytes, p.window);
  }
  std::printf("window %zu bytes, worst sampled use %zu bytes, piece %zu elements\n", p.window, worst,
              r.opt->piece_elements());
  EXPECT_GT(worst, 0u);
  EXPECT_LE(worst, p.window + d->granularity());
}

// Note [Window slots]: every piece of a pass moves through the depth slots of the window,
// so a pass maps 3 * depth chunks whatever its number of pieces (a model of many tiny
// shards costs no mapping per shard); results stay bit-identical on every tier, the peak
// stays under the window, and with keep_window a second pass maps nothing.
TEST(optimizer, a_pass_maps_the_window_once_whatever_its_pieces) {
  auto d = make_driver();
  const std::size_t g = d->granularity(), base = g / 4;
  problem p = make_problem(g, 4);
  p.window = 3 * 12 * 2 * g;  // pieces of 2 g elements: 8 granules of FP32
  p.sizes = {16 * base + base / 2};  // two full pieces and a tail of half a granule
  for (std::size_t k = 0; k < 24; ++k) p.sizes.push_back(700 + 97 * k);  // norms and biases
  p.params.clear();
  p.grads.assign(p.steps, {});
  for (std::size_t s = 0; s < p.sizes.size(); ++s) p.params.push_back(random_bf16(p.sizes[s], 10 + s, 1.0f));
  for (int t = 0; t < p.steps; ++t)
    for (std::size_t s = 0; s < p.sizes.size(); ++s) p.grads[t].push_back(random_bf16(p.sizes[s], 1000 * t + s, 0.1f));
  temp_dir dir;
  std::vector<result> results;
  for (tier t : {tier::device, tier::host, tier::file}) {
    run r(d, p, config_for(t, dir.path));
    r.opt->initialize();
    for (int s = 0; s < p.steps; ++s) {
      const auto maps0 = d->call_counts()[primitive::map];
      r.step(s);
      EXPECT_LE(r.opt->last_report().peak_backed_bytes, p.window);
      // 27 in the window's pieces (the host driver's); a pass cut finer has more (Note [Pass pieces]).
      if (t == tier::host) EXPECT_GE(r.opt->last_report().pieces, 27u);
      if (t != tier::device) {
        EXPECT_EQ(d->call_counts()[primitive::map] - maps0, 3u * 3u) << "3 arrays x depth 3 slots, not 3 per piece";
      }
    }
    if (t == tier::host) EXPECT_EQ(r.opt->piece_elements(), 8 * base);
    results.push_back(r.state());
  }
  expect_same(results[0], results[1], "device vs host tier");
  expect_same(results[0], results[2], "device vs file tier");
  expect_same(results[0], cpu_twin(p, p.steps), "kernel vs CPU twin");

  // keep_window: the slots stay backed between passes; the next step maps nothing, the
  // state holds the window between steps, and the bits are the same.
  optimizer_config cfg = config_for(tier::host);
  cfg.keep_window = true;
  run r(d, p, cfg);
  r.opt->initialize();
  std::size_t kept = 0;
  for (int s = 0; s < p.steps; ++s) {
    const auto maps0 = d->call_counts()[primitive::map];
    r.step(s);
    if (s > 0) EXPECT_EQ(d->call_counts()[primitive::map], maps0) << "step " << s;
    // The slots stay backed: three arrays of the pass's largest piece each (at most the
    // window; Note [Pass pieces]), the same after every step.
    const std::size_t backed = r.opt->reservations().stats().backed_bytes;
    if (s == 0) kept = backed;
    EXPECT_EQ(backed, kept) << "the window stays backed, step " << s;
    EXPECT_GT(backed, 0u);
    EXPECT_LE(backed, p.window);
  }
  expect_same(r.state(), results[0], "keep_window vs device tier");

  // Tiny shards only: the slots are backed for the largest piece, one granule per array.
  problem q = p;
  q.sizes.erase(q.sizes.begin());
  q.params.erase(q.params.begin());
  for (auto& gs : q.grads) gs.erase(gs.begin());
  run rq(d, q, config_for(tier::host));
  rq.opt->initialize();
  rq.step(0);
  EXPECT_EQ(rq.opt->last_report().peak_backed_bytes, 3 * 3 * g) << "depth 3 slots of one granule per array";
  expect_same(rq.state(), cpu_twin(q, 1), "tiny shards vs CPU twin");
}

// Note [Window slots]: depth 0 is the tier's depth (host 8, file 3), or as many slots of
// one unit (granule; file tier: checksum block) as the window holds if fewer; the window's
// piece is a power of two of units (it halves down to one), and the bits do not change.
TEST(optimizer, depth_0_is_the_tiers_depth_or_what_the_window_holds) {
  auto d = make_driver();
  const std::size_t g = d->granularity();
  problem p = make_problem(g, 3);
  p.window = 20 * 12 * g;  // 80 units of FP32 per array
  temp_dir dir;
  std::vector<result> results;
  struct want {
    tier t;
    std::size_t window;
    int depth;
    std::size_t piece;  // elements
  };
  const std::size_t unit = g / 4, falign = std::max(g, optim::detail::file_store::block) / 4;
  for (const want& w : {want{tier::host, 20 * 12 * g, 8, 8 * unit},  // 80 / 8 = 10 units: 8
                        want{tier::host, 5 * 12 * g, 8, 2 * unit},   // 20 / 8 = 2.5: 2
                        want{tier::host, 12 * g, 4, unit},           // 4 units: 4 slots of one
                        want{tier::file, 20 * 12 * g, 3, std::bit_floor(20 * 12 * g / 36 / falign) * falign}}) {
    problem q = p;
    q.window = w.window;
    optimizer_config c = config_for(w.t, dir.path);
    c.depth = 0;
    run r(d, q, c);
    EXPECT_EQ(r.opt->config().depth, w.depth) << "window " << w.window;
    EXPECT_EQ(r.opt->piece_elements(), w.piece) << "window " << w.window;
    r.opt->initialize();
    for (int s = 0; s < q.steps; ++s) {
      r.step(s);
      EXPECT_LE(r.opt->last_report().peak_backed_bytes, q.window);
    }
    results.push_back(r.state());
  }
  for (const auto& r : results) expect_same(r, cpu_twin(p, p.steps), "depth 0 vs CPU twin");
  // Too small for one slot: the same error as before.
  optimizer_config c = config_for(tier::host);
  c.depth = 0;
  c.window_bytes = g;
  EXPECT_THROW(streamed_adamw(d, c), invalid_argument);
  // An explicit depth the window cannot hold: the error says how much it needs, naming
  // what was set (whole MiB as window_mb, as Python passes it; else window_bytes in bytes:
  // the host driver's 64 KiB granule).
  c.depth = 8;
  c.window_bytes = 12 * g;
  const std::size_t mib = std::size_t{1} << 20;
  const std::string want = (12 * g) % mib == 0
                               ? "streamed_adamw: window_mb " + std::to_string(12 * g / mib) +
                                     " is too small: 8 pieces in flight need at least " + std::to_string(24 * g / mib) +
                                     " MiB (raise window_mb, or lower depth)"
                               : "streamed_adamw: window_bytes " + std::to_string(12 * g) +
                                     " is too small: 8 pieces in flight need at least " + std::to_string(24 * g) +
                                     " bytes (raise window_bytes, or lower depth)";
  try {
    streamed_adamw o(d, c);
    ADD_FAILURE() << "depth 8 in a window of 4 slots";
  } catch (const invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), want);
  }
}

// Note [Pass pieces]: a pass is cut into 12 to 24 pieces (never below 1 Mi elements) even
// when the window would take it whole, and the bits do not depend on the cut.
TEST(optimizer, a_pass_is_cut_finer_than_the_window_and_the_bits_do_not_change) {
  auto d = make_driver();
  const std::size_t g = d->granularity(), mi = std::size_t{1} << 20;
  problem p = make_problem(g, 3);
  p.sizes = {4 * mi + 5, 3001};
  p.params.clear();
  p.grads.assign(p.steps, {});
  for (std::size_t s = 0; s < p.sizes.size(); ++s) p.params.push_back(random_bf16(p.sizes[s], 20 + s, 1.0f));
  for (int t = 0; t < p.steps; ++t)
    for (std::size_t s = 0; s < p.sizes.size(); ++s) p.grads[t].push_back(random_bf16(p.sizes[s], 2000 * t + s, 0.1f));
  std::vector<result> results;
  for (std::size_t window_pieces : {std::size_t{8}, std::size_t{1}}) {  // a window of 8 Mi-element pieces, of 1
    problem q = p;
    q.window = 3 * 12 * window_pieces * mi;
    run r(d, q, config_for(tier::host));
    r.opt->initialize();
    for (int s = 0; s < q.steps; ++s) {
      r.step(s);
      // 4 Mi + 5 elements in 1 Mi-element pieces: 5 pieces; the small shard: 1.
      EXPECT_EQ(r.opt->last_report().pieces, 6u) << "window of " << window_pieces << " Mi-element pieces";
    }
    EXPECT_EQ(r.opt->piece_elements(), window_pieces * mi);
    results.push_back(r.state());
  }
  expect_same(results[0], results[1], "a window of 8 Mi-element pieces vs 1");
  expect_same(results[0], cpu_twin(p, p.steps), "kernel vs CPU twin");
}

// Note [Pass pieces], the taper (pass_taper): the pass's first piece is cut into a quarter,
// a quarter and a half, its last into a half, a quarter and a quarter (never below the
// granule: a piece of two granules is cut in halves); the bits do not change.
void tapered_passes(const std::shared_ptr<deferalloc::driver>& d) {
  SCOPED_TRACE("granule " + std::to_string(d->granularity()));
  const std::size_t mi = std::size_t{1} << 20;
  // The pieces are 1 Mi elements.  Host driver (64 KiB granules): {4 Mi + 5, 3001}: 5 + 1
  // pieces, the first cut in 3 (the last is tiny): 8.  {4 Mi}: 4 pieces, the first and the
  // last cut in 3: 8.  {1 Mi}: one piece, cut from its start (a quarter, a quarter, a half)
  // and that half from its end: 4.  CUDA driver (2 MiB granules, 512 Ki elements: a
  // quarter piece is below the granule): each end piece in halves: 7, 6 and 2.
  const bool quarters = mi / 4 >= d->granularity() / 4;
  for (const auto& [sizes, untapered, tapered] :
       {std::tuple{std::vector<std::size_t>{4 * mi + 5, 3001}, 6u, quarters ? 8u : 7u},
        std::tuple{std::vector<std::size_t>{4 * mi}, 4u, quarters ? 8u : 6u},
        std::tuple{std::vector<std::size_t>{mi}, 1u, quarters ? 4u : 2u}}) {
    problem p = make_problem(d->granularity(), 3);
    p.sizes = sizes;
    p.params.clear();
    p.grads.assign(p.steps, {});
    for (std::size_t s = 0; s < p.sizes.size(); ++s) p.params.push_back(random_bf16(p.sizes[s], 20 + s, 1.0f));
    for (int t = 0; t < p.steps; ++t)
      for (std::size_t s = 0; s < p.sizes.size(); ++s) p.grads[t].push_back(random_bf16(p.sizes[s], 2000 * t + s, 0.1f));
    p.window = 3 * 12 * 8 * mi;
    std::vector<result> results;
    for (bool taper : {false, true}) {
      optimizer_config cfg = config_for(tier::host);
      cfg.pass_taper = taper;
      run r(d, p, cfg);
      r.opt->initialize();
      for (int s = 0; s < p.steps; ++s) {
        r.step(s);
        EXPECT_EQ(r.opt->last_report().pieces, taper ? tapered : untapered) << sizes.size() << " shards, taper " << taper;
      }
      results.push_back(r.state());
    }
    expect_same(results[0], results[1], "tapered vs untapered passes");
    expect_same(results[0], cpu_twin(p, p.steps), "kernel vs CPU twin");
  }
}

TEST(optimizer, a_tapered_pass_cuts_its_end_pieces_and_the_bits_do_not_change) {
  // This suite's driver, and a host driver with the CUDA driver's 2 MiB granules (both
  // cuts checked without a GPU).
  for (const auto& d : {make_driver(), deferalloc::make_host_driver({2_MiB, 1_GiB})})
    tapered_passes(d);
}

// Note [Resident shards]: a resident shard costs its elements rounded up to the granule,
// not whole pieces, so tiny shards leave the budget to big ones; resident and streamed
// give the same bits.
TEST(optimizer, resident_shards_cost_their_granules_not_their_padding) {
  auto d = make_driver();
  const std::size_t g = d->granularity(), base = g / 4;
  problem p = make_problem(g, 3);
  p.window = 8 * 3 * 12 * g;  // pieces of 32 granules of FP32
  p.sizes.clear();
  for (std::size_t k = 0; k < 10; ++k) p.sizes.push_back(1000 + 37 * k);  // norms: one granule each
  p.sizes.push_back(40 * base);                                        // 40 granules (2 pieces)
  p.sizes.push_back(40 * base);                                        // does not fit: streamed
  p.params.clear();
  p.grads.assign(p.steps, {});
  for (std::size_t s = 0; s < p.sizes.size(); ++s) p.params.push_back(random_bf16(p.sizes[s], 10 + s, 1.0f));
  for (int t = 0; t < p.steps; ++t)
    for (std::size_t s = 0; s < p.sizes.size(); ++s) p.grads[t].push_back(random_bf16(p.sizes[s], 1000 * t + s, 0.1f));
  optimizer_config cfg = config_for(tier::host);
  cfg.resident_bytes = 3 * (10 * g + 40 * g);  // the ten norms and the first big shard, exactly
  run r(d, p, cfg);
  const auto free0 = d->get_memory_info().free_bytes;
  r.opt->initialize();
  const auto held = free0 - d->get_memory_info().free_bytes;
  for (std::size_t s = 0; s < p.sizes.size(); ++s)
    EXPECT_EQ(r.opt->shards()[s].resident, s + 1 < p.sizes.size()) << "shard " << s;
  // The resident shards back their granules only; on CUDA, initialize() also takes the
  // 16-bit parameters' edit hashes (a few bytes per shard, Note [Edits of 16-bit
  // parameters]), which cudaMalloc serves from one 2 MiB page.
  const std::size_t hashes = d->kind() == driver_kind::cuda ? std::size_t{2} << 20 : 0;
  EXPECT_EQ(held, cfg.resident_bytes + hashes) << "the resident shards back their granules only";
  for (int t = 0; t < p.steps; ++t) r.step(t);
  expect_same(r.state(), cpu_twin(p, p.steps), "resident split vs CPU twin");
}

TEST(optimizer, never_written_moments_are_not_copied) {
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 2);
  run r(d, p, config_for(tier::host));
  std::size_t params = 0;
  for (auto n : p.sizes) params += n;
  r.opt->initialize();
  EXPECT_EQ(r.opt->last_report().bytes_to_device, 0u);
  EXPECT_EQ(r.opt->last_report().bytes_from_device, params * 4);
  r.step(0);
  EXPECT_EQ(r.opt->last_report().bytes_to_device, params * 4) << "first step must read only the main params";
  EXPECT_EQ(r.opt->last_report().bytes_from_device, params * 12);
  r.step(1);
  EXPECT_EQ(r.opt->last_report().bytes_to_device, params * 12);
}

// I/O faults at every request of a step leave the previous step intact and loadable;
// also with resident shards (Note [Resident shards on the file tier]): a failed step put
// them back from the state file, their writes into it are requests too.
TEST(optimizer, file_tier_faults_keep_the_previous_step) {
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 3);
  const result expect2 = cpu_twin(p, 2), expect3 = cpu_twin(p, 3);
  using fk = optim::detail::file_store::fault_kind;
  using fo = optim::detail::file_store::fault_op;
  struct fault {
    fo op;
    fk kind;
    const char* name;
  };
  const fault faults[] = {{fo::read, fk::eio, "EIO on read"},
                          {fo::read, fk::short_read, "short read"},
                          {fo::write, fk::enospc, "ENOSPC on write"},
                          {fo::write, fk::eio, "EIO on write"},
                          {fo::commit, fk::eio, "failed commit"}};
  int injected = 0;
  // Shards 1 and 2 resident (2 and 1 granules per array), shard 0 (14) streamed.
  for (const std::size_t resident : {std::size_t{0}, 3 * 3 * d->granularity()})
  for (const auto& f : faults) {
    for (std::uint64_t nth : {1, 3, 7, 1000}) {
      if (f.op == fo::commit && nth > 1) break;
      temp_dir dir;
      optimizer_config cfg = config_for(tier::file, dir.path);
      cfg.resident_bytes = resident;
      run r(d, p, cfg);
      r.opt->initialize();
      r.step(0);
      r.step(1);
      optim::detail::inject_file_fault(*r.opt, f.op, f.kind, nth);
      r.load_grads(2);
      bool threw = false;
      try {
        r.opt->step(r.grads, grad_type::bf16, p.scale(2));
      } catch (const io_error& e) {
        threw = true;
        const std::string w = e.what();
        if (f.op != fo::commit) EXPECT_NE(w.find("shard"), std::string::npos) << w;
        EXPECT_NE(w.find(dir.path), std::string::npos) << w;
      }
      d->synchronize_stream(nullptr);
      const std::string where =
          std::string(f.name) + " at request " + std::to_string(nth) + (resident ? ", resident shards" : "");
      if (resident) EXPECT_TRUE(r.opt->shards()[1].resident && !r.opt->shards()[0].resident) << where;
      if (!threw) {
        EXPECT_EQ(nth, 1000u) << where << ": the fault did not surface";
        expect_same(r.state(), expect3, where + " (no fault reached)");
        continue;
      }
      ++injected;
      EXPECT_EQ(r.opt->steps(), 2u) << where;
      expect_same(r.state(), expect2, where + ": previous step");
      r.step(2);
      expect_same(r.state(), expect3, where + ": the step after the fault");
    }
  }
  EXPECT_GE(injected, 18);
}

// Out of memory at every driver call of a step (file tier): previous step intact.
TEST(optimizer, out_of_memory_during_a_step_keeps_the_previous_step) {
  auto inner = make_driver();
  const problem p = make_problem(inner->granularity(), 3);
  const result expect2 = cpu_twin(p, 2), expect3 = cpu_twin(p, 3);
  int injected = 0;
  for (primitive prim : {primitive::create, primitive::map, primitive::set_access}) {
    for (std::uint64_t nth : {1, 2, 5, 9}) {
      auto f = std::make_shared<fault_driver>(make_driver());
      temp_dir dir;
      run r(f, p, config_for(tier::file, dir.path));
      r.opt->initialize();
      r.step(0);
      r.step(1);
      r.opt->reservations().pool().trim();  // so that create is called again
      f->fail_nth(prim, nth);
      r.load_grads(2);
      bool threw = false;
      try {
        r.opt->step(r.grads, grad_type::bf16, p.scale(2));
      } catch (const error& e) {
        threw = true;
        EXPECT_NE(std::string(e.what()).find("shard"), std::string::npos) << e.what();
      }
      f->clear();
      const std::string where = std::string(to_string(prim)) + " fault at call " + std::to_string(nth);
      if (!threw) {
        expect_same(r.state(), expect3, where + " (absorbed or not reached)");
        continue;
      }
      ++injected;
      expect_same(r.state(), expect2, where + ": previous step");
      r.step(2);
      expect_same(r.state(), expect3, where + ": the step after the fault");
    }
  }
  EXPECT_GT(injected, 3);
}

// Host tier: in place; a failed step retried with the same gradients completes exactly.
namespace {
// Initializes r, steps once, then fails its second step part-way: the 13th copy from there
// (the gradients' uploads, then six per piece: three arrays each way) fails after the
// pass's first piece was written back.
void fail_second_step(run& r, fault_driver& f, const problem& p) {
  r.opt->initialize();
  r.step(0);
  f.fail_nth_copy(13);
  r.load_grads(1);
  EXPECT_THROW(r.opt->step(r.grads, grad_type::bf16, p.scale(1)), cuda_error);
}
}  // namespace

TEST(optimizer, host_tier_step_retried_after_a_fault_completes_exactly) {
  auto f = std::make_shared<fault_driver>(make_driver());
  const problem p = make_problem(f->granularity(), 2);
  run r(f, p, config_for(tier::host));
  fail_second_step(r, *f, p);
  EXPECT_EQ(f->fired(), 1u);
  EXPECT_EQ(r.opt->steps(), 1u);
  // In place: the pieces written back before the fault already hold step 2's values, the
  // others still step 1's (wherever the pass cut its pieces, Note [Pass pieces]).
  std::vector<float> main0(p.sizes[0]);
  r.opt->read_state(0, main0.data(), nullptr, nullptr);
  const result one = cpu_twin(p, 1), two = cpu_twin(p, 2);
  std::size_t d = 0;
  while (d < main0.size() && std::memcmp(&main0[d], &two.main[0][d], 4) == 0) ++d;
  EXPECT_GT(d, 0u) << "no piece was written back before the fault";
  EXPECT_LT(d, main0.size()) << "the fault hit after the whole shard was written back";
  EXPECT_EQ(std::memcmp(main0.data() + d, one.main[0].data() + d, 4 * (main0.size() - d)), 0)
      << "elements from " << d << " on are neither step 1's nor step 2's";
  r.opt->step(r.grads, grad_type::bf16, p.scale(1));
  f->synchronize_stream(nullptr);
  expect_same(r.state(), two, "retried step");
}

// A failed sync_model_params (the export pass) between a failed step and its retry
// leaves the retry's progress alone: the retry skips the pieces the failed step wrote
// back, no more and no fewer (an export pass writes no state back).
TEST(optimizer, host_tier_retry_survives_a_failed_export_pass) {
  auto f = std::make_shared<fault_driver>(make_driver());
  const problem p = make_problem(f->granularity(), 2);
  run r(f, p, config_for(tier::host));
  fail_second_step(r, *f, p);
  f->fail_nth_copy(1);  // the export pass's first fetch of main
  EXPECT_THROW(r.opt->sync_model_params(), cuda_error);
  EXPECT_EQ(f->fired(), 2u);
  EXPECT_EQ(r.opt->steps(), 1u);
  r.opt->step(r.grads, grad_type::bf16, p.scale(1));
  f->synchronize_stream(nullptr);
  expect_same(r.state(), cpu_twin(p, 2), "retried step after a failed export pass");
}

// Note [Speculative steps]: a speculative step then commit is the plain step, bit for
// bit; a discard leaves state and step counts as they were, and the redo that follows
// (speculative or plain) rewrites the BF16 params; several pending steps over disjoint
// shards commit as one; skipped shards and compressed moments included.
namespace {
std::vector<const void*> only(const std::vector<const void*>& grads, std::vector<bool> take) {
  std::vector<const void*> g(grads.size(), nullptr);
  for (std::size_t s = 0; s < g.size(); ++s)
    if (take[s]) g[s] = grads[s];
  return g;
}
void speculate(run& r, const std::vector<const void*>& g, float scale) {
  const std::vector<value_type> gts(g.size(), value_type::bf16);
  r.opt->step_speculative(g, gts, scale);
  r.drv->synchronize_stream(nullptr);
}
}  // namespace

TEST(optimizer, speculative_step_commit_is_the_step_and_discard_keeps_the_state) {
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 5);
  // Step 3 skips shard 1 (a parameter without a gradient).
  const std::vector<bool> all{true, true, true}, skip1{true, false, true};
  for (moment_format fmt : {moment_format::fp32, moment_format::bf16, moment_format::int8}) {
    SCOPED_TRACE(to_string(fmt));
    optimizer_config cfg = config_for(tier::host);
    cfg.moments = fmt;
    run plain(d, p, cfg), spec(d, p, cfg);
    plain.opt->initialize();
    spec.opt->initialize();
    for (int t = 0; t < p.steps; ++t) {
      SCOPED_TRACE("step " + std::to_string(t));
      const auto& mask = t == 3 ? skip1 : all;
      plain.load_grads(t);
      plain.opt->step(only(plain.grads, mask), grad_type::bf16, p.scale(t));
      plain.drv->synchronize_stream(nullptr);
      spec.load_grads(t);
      const auto g = only(spec.grads, mask);
      if (t == 0 || t == 2 || t == 4) {
        // A wrong speculation (here: twice the scale), discarded: nothing changed.
        const result before = spec.state();
        std::vector<std::uint64_t> steps0;
        for (std::size_t s = 0; s < p.sizes.size(); ++s) steps0.push_back(spec.opt->shard_step(s));
        speculate(spec, g, 2 * p.scale(t));
        EXPECT_EQ(spec.opt->speculation_pending(), 3u);
        const result pending = spec.state();
        EXPECT_EQ(spec.opt->steps(), static_cast<std::uint64_t>(t)) << "steps() moves at commit";
        for (std::size_t s = 0; s < p.sizes.size(); ++s) {
          EXPECT_EQ(spec.opt->shard_step(s), steps0[s]) << "shard " << s << ": step count moves at commit";
          EXPECT_EQ(pending.main[s], before.main[s]) << "shard " << s << ": reads see the committed state";
          EXPECT_EQ(pending.v[s], before.v[s]) << "shard " << s;
          EXPECT_NE(pending.bf16[s], before.bf16[s]) << "shard " << s << ": the speculation wrote the params";
        }
        spec.opt->discard_speculation();
        EXPECT_EQ(spec.opt->speculation_pending(), 0u);
        const result after = spec.state();
        for (std::size_t s = 0; s < p.sizes.size(); ++s) {
          EXPECT_EQ(after.main[s], before.main[s]) << "shard " << s;
          EXPECT_EQ(after.m[s], before.m[s]) << "shard " << s;
          EXPECT_EQ(after.v[s], before.v[s]) << "shard " << s;
          EXPECT_EQ(spec.opt->shard_step(s), steps0[s]) << "shard " << s;
        }
      }
      if (t == 2) {
        spec.opt->step(g, grad_type::bf16, p.scale(t));  // the redo as a plain step
        spec.drv->synchronize_stream(nullptr);
      } else if (t == 1) {
        // Two pending speculative steps over disjoint shards, committed as one.
        speculate(spec, only(g, {true, false, false}), p.scale(t));
        speculate(spec, only(g, {false, true, true}), p.scale(t));
        EXPECT_EQ(spec.opt->speculation_pending(), 3u);
        spec.opt->commit_speculation();
      } else {
        speculate(spec, g, p.scale(t));
        EXPECT_EQ(spec.opt->speculation_pending(), t == 3 ? 2u : 3u);
        spec.opt->commit_speculation();
      }
      EXPECT_EQ(spec.opt->speculation_pending(), 0u);
      for (std::size_t s = 0; s < p.sizes.size(); ++s)
        EXPECT_EQ(spec.opt->shard_step(s), plain.opt->shard_step(s)) << "shard " << s;
      expect_same(spec.state(), plain.state(), "speculative vs plain");
    }
    EXPECT_EQ(spec.opt->steps(), plain.opt->steps());
    EXPECT_EQ(plain.opt->shard_step(1), static_cast<std::uint64_t>(p.steps - 1)) << "the skipped step";
  }
}

// Note [Chained passes]: with keep_window on the host tier a step's pass leaves its last
// write-backs to the next pass (ordered on the device: on the CUDA driver this test runs
// the real streams) and every other call waits for them first; the bits are those of
// unchained passes whatever the passes' sizes (more pieces than slots, fewer, one).
namespace {
// The suite's driver, counting the host's waits for an event.
class counting_driver final : public deferalloc::driver, public fault_vmm, public fault_streams {
 public:
  explicit counting_driver(std::shared_ptr<deferalloc::driver> inner)
      : fault_vmm(inner), fault_streams(inner), inner_(std::move(inner)) {}
  void synchronize(event_t e) override {
    ++event_waits;
    fault_streams::synchronize(e);
  }
  std::string name() const override { return "counting(" + inner_->name() + ")"; }
  driver_kind kind() const override { return inner_->kind(); }
  int device() const override { return inner_->device(); }
  std::size_t event_waits = 0;

 private:
  std::shared_ptr<deferalloc::driver> inner_;
};
}  // namespace

TEST(optimizer, chained_passes_give_the_bits_of_unchained_ones_and_other_calls_wait_for_them) {
  auto d = std::make_shared<counting_driver>(make_driver());
  const problem p = make_problem(d->granularity(), 4);
  const std::vector<bool> big{true, false, false}, middle{false, true, false}, tiny{false, false, true};
  for (moment_format fmt : {moment_format::fp32, moment_format::int8}) {
    SCOPED_TRACE(to_string(fmt));
    std::vector<result> results;
    std::vector<std::size_t> commit_waits;
    for (bool chain : {false, true}) {
      optimizer_config cfg = config_for(tier::host);
      cfg.moments = fmt;
      cfg.keep_window = true;
      cfg.pass_chain = chain;
      run r(d, p, cfg);
      r.opt->initialize();
      std::size_t waits = 0;
      for (int t = 0; t < p.steps; ++t) {
        r.load_grads(t);
        if (t % 2 == 0) {
          // Bucket passes back to back: 2 pieces (fewer than the 3 slots), 1, then 14.
          for (const auto& mask : {middle, tiny, big}) speculate(r, only(r.grads, mask), p.scale(t));
          const std::size_t before = d->event_waits;
          r.opt->commit_speculation();
          waits += d->event_waits - before;
        } else {
          r.step(t);  // one chained pass over all, then state reads wait for it
        }
      }
      commit_waits.push_back(waits);
      results.push_back(r.state());
    }
    expect_same(results[0], results[1], "chained vs unchained passes");
    if (fmt == moment_format::fp32) expect_same(results[0], cpu_twin(p, p.steps), "kernel vs CPU twin");
    EXPECT_EQ(commit_waits[0], 0u) << "an unchained pass waited for its own write-backs";
    EXPECT_EQ(commit_waits[1], 2u) << "the commit after chained passes waits for them, once a commit";
  }
}

// Note [Chained passes]: what a chained pass's first fetch waits for, on the device.  The
// host driver ignores stream and event handles, so this driver hands out its own and keeps
// a clock per stream: the user's stream's gradients (`user`, raised by the test as each
// bucket's gradients come) and the write-backs issued (D2H copies; `bytes`: theirs), each
// stream holding the latest of each that it waits for.  The host's waits for an event
// of the D2H stream tell which write-backs it knows done: `queued` is the most D2H
// bytes ever issued and not yet waited for (what a D2H copy of the user's queues behind).
namespace {
class clock_driver final : public deferalloc::driver, public fault_vmm, public fault_streams {
 public:
  struct clock {
    std::uint64_t user = 0, written = 0, bytes = 0;
  };
  explicit clock_driver(std::shared_ptr<deferalloc::driver> inner)
      : fault_vmm(inner), fault_streams(inner), inner_(std::move(inner)) {}
  stream_t create_stream() override {
    created_.push_back(fake());
    return created_.back();
  }
  stream_t create_priority_stream() override {
    // (stream_set: the H2D and D2H streams, then the compute stream)
    if (h2d_ == nullptr && created_.size() >= 2) h2d_ = created_[created_.size() - 2], d2h_ = created_.back();
    return fake();
  }
  void destroy_stream(stream_t) noexcept override {}
  event_t create_event() override { return event_t{fake_handle()}; }
  void destroy_event(event_t) noexcept override {}
  void record(event_t e, stream_t s) override { events_[e] = at(s); }
  void stream_wait(stream_t s, event_t e) override {
    clock& c = streams_[s];
    const clock f = events_[e];
    c = {std::max(c.user, f.user), std::max(c.written, f.written), std::max(c.bytes, f.bytes)};
  }
  void synchronize(event_t e) override {
    fault_streams::synchronize(e);
    waited_bytes_ = std::max(waited_bytes_, events_[e].bytes);
  }
  void synchronize_stream(stream_t s) override {
    fault_streams::synchronize_stream(s);
    if (s == d2h_) waited_bytes_ = streams_[s].bytes;
  }
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_t s) override {
    fault_streams::copy_async(dst, src, bytes, s);
    if (s == h2d_ && !first_fetch) first_fetch = at(s);
    if (s == d2h_) {
      clock& c = streams_[s];
      c.written = ++written;
      c.bytes += bytes;
      queued = std::max<std::size_t>(queued, c.bytes - waited_bytes_);
    }
  }
  std::string name() const override { return "clock(" + inner_->name() + ")"; }
  driver_kind kind() const override { return inner_->kind(); }
  int device() const override { return inner_->device(); }
  std::uint64_t user = 0;           // the user's stream's position (the test raises it)
  std::uint64_t written = 0;        // write-backs issued
  std::optional<clock> first_fetch;  // the clock of the first H2D copy since reset
  std::size_t queued = 0;            // the most write-back bytes ever queued (the test resets it)
 private:
  void* fake_handle() { return &handles_[next_++ % handles_.size()]; }
  stream_t fake() { return stream_t{fake_handle()}; }
  clock at(stream_t s) { return s == nullptr ? clock{user, 0} : streams_[s]; }
  std::shared_ptr<deferalloc::driver> inner_;
  std::array<char, 256> handles_{};
  std::size_t next_ = 0;
  std::vector<stream_t> created_;
  stream_t h2d_ = nullptr, d2h_ = nullptr;
  std::map<stream_t, clock> streams_;
  std::map<event_t, clock> events_;
  std::uint64_t waited_bytes_ = 0;  // the D2H stream's bytes the host waited for
};
}  // namespace

TEST(optimizer, chained_pass_fetches_ahead_of_its_gradients_and_after_a_shared_shards_write_back) {
  if (make_driver()->kind() != driver_kind::host)
    GTEST_SKIP() << "needs the host driver (its own stream and event handles stand in for the driver's)";
  auto d = std::make_shared<clock_driver>(make_driver());
  const problem p = make_problem(d->granularity(), 4);
  const std::vector<bool> middle{false, true, false}, tiny{false, false, true};
  optimizer_config cfg = config_for(tier::host);
  cfg.keep_window = true;
  cfg.pass_chain = true;
  run r(d, p, cfg);
  r.opt->initialize();
  r.load_grads(0);
  auto bucket = [&](const std::vector<bool>& mask) {  // its gradients come after the previous bucket's
    ++d->user;
    d->first_fetch.reset();
    speculate(r, only(r.grads, mask), p.scale(0));
    EXPECT_TRUE(d->first_fetch.has_value());
    return d->first_fetch.value_or(clock_driver::clock{});
  };
  bucket(middle);
  const std::uint64_t after_middle = d->written;
  const clock_driver::clock second = bucket(tiny);
  EXPECT_LT(second.user, d->user) << "a chained pass's fetch waited for its own gradients";
  EXPECT_LT(second.written, after_middle) << "a fetch waited for the write-backs of a pass sharing no shard";
  r.opt->commit_speculation();
  ++d->user;
  r.step(1);  // one chained pass over every shard
  const std::uint64_t after_all = d->written;
  const clock_driver::clock shared = bucket(middle);
  EXPECT_LT(shared.user, d->user) << "a chained pass's fetch waited for its own gradients";
  EXPECT_EQ(shared.written, after_all) << "a fetch read a shard before the previous pass's write-back of it";
  r.opt->commit_speculation();
}

// Note [The write-back queue]: with writeback_queue_bytes a pass keeps at most that many
// bytes of write-backs (plus one piece's), or two pieces', issued and not yet waited for on
// the host, counting those a chained previous pass left in flight; without it, a window's worth
// (chained passes: more).  The bits do not change, on either streamed tier, chained or not
// (on the CUDA driver the bits only: the clock needs the host driver's own handles).
TEST(optimizer, the_write_back_queue_keeps_its_bound_and_the_bits_do_not_change) {
  const bool host = make_driver()->kind() == driver_kind::host;
  if (!host) std::printf("the bound's peaks are checked on the host driver only (its clock driver's handles)\n");
  const std::size_t g = make_driver()->granularity();
  problem p = make_problem(g, 4);
  p.window = 8 * 3 * g;  // depth 8 (17 pieces a pass), one granule of each array per piece
  const std::size_t piece_out = 3 * g;  // a whole piece's write-back (FP32 state)
  const std::vector<bool> big{true, false, false}, middle{false, true, false}, tiny{false, false, true};
  temp_dir dir;
  struct mode {
    tier t;
    bool chain;
  };
  for (const mode m : {mode{tier::host, false}, mode{tier::host, true}, mode{tier::file, false}}) {
    SCOPED_TRACE(std::string(to_string(m.t)) + (m.chain ? ", chained" : ""));
    std::vector<result> results;
    std::vector<std::size_t> peaks;
    const std::vector<std::size_t> bounds{0, 1, 2 * piece_out + 1};
    for (std::size_t bound : bounds) {
      const std::string sub = dir.path + "/" + to_string(m.t) + std::to_string(m.chain) + "_" + std::to_string(bound);
      std::filesystem::create_directories(sub);
      // (A clock driver finds the D2H stream of its first optimizer only.)
      auto clocked = host ? std::make_shared<clock_driver>(make_driver()) : nullptr;
      const std::shared_ptr<driver> d = clocked ? std::static_pointer_cast<driver>(clocked) : make_driver();
      optimizer_config cfg = config_for(m.t, sub);
      cfg.depth = 8;
      cfg.writeback_queue_bytes = bound;
      cfg.keep_window = cfg.pass_chain = m.chain;
      run r(d, p, cfg);
      r.opt->initialize();
      if (clocked) clocked->queued = 0;
      for (int t = 0; t < p.steps; ++t) {
        if (m.chain && t % 2 == 1) {  // bucket passes back to back: 2 pieces, 14, then 1
          r.load_grads(t);
          for (const auto& mask : {middle, big, tiny}) speculate(r, only(r.grads, mask), p.scale(t));
          r.opt->commit_speculation();
        } else {
          r.step(t);
        }
      }
      peaks.push_back(clocked ? clocked->queued : 0);
      results.push_back(r.state());
    }
    expect_same(results[0], results[1], "bound 1 vs none");
    expect_same(results[0], results[2], "bound of two pieces vs none");
    if (!m.chain) expect_same(results[0], cpu_twin(p, p.steps), "kernel vs CPU twin");
    if (!host) continue;
    // (Chained passes queue more: the next pass's write-backs join the previous one's.)
    if (m.chain) EXPECT_GT(peaks[0], 8 * piece_out) << "without a bound chained passes queue more than a window";
    else EXPECT_EQ(peaks[0], 8 * piece_out) << "without a bound a pass queues a window's write-backs";
    EXPECT_EQ(peaks[1], 2 * piece_out) << "a bound under a piece: two pieces' write-backs at a time";
    EXPECT_LT(peaks[2], bounds[2] + piece_out) << "at most the bound plus one piece";
    EXPECT_EQ(peaks[2], 3 * piece_out) << "a bound just over two pieces lets a third queue";
  }
}

TEST(optimizer, speculative_step_failed_part_way_leaves_the_state) {
  auto f = std::make_shared<fault_driver>(make_driver());
  const problem p = make_problem(f->granularity(), 2);
  run r(f, p, config_for(tier::host));
  r.opt->initialize();
  r.step(0);
  r.load_grads(1);
  // No pinned memory for the second copy of the last shard: nothing ran.
  f->fail_nth(primitive::host_alloc, 9);
  EXPECT_THROW(speculate(r, r.grads, p.scale(1)), out_of_memory);
  EXPECT_EQ(r.opt->speculation_pending(), 0u);
  f->fail_nth_copy(13);  // piece 2's first fetch (see host_tier_step_retried_after_a_fault_completes_exactly)
  EXPECT_THROW(speculate(r, r.grads, p.scale(1)), cuda_error);
  EXPECT_EQ(f->fired(), 2u);
  EXPECT_EQ(r.opt->speculation_pending(), 0u);
  const result one = cpu_twin(p, 1), two = cpu_twin(p, 2);
  const result now = r.state();
  for (std::size_t s = 0; s < p.sizes.size(); ++s) {
    EXPECT_EQ(now.main[s], one.main[s]) << "shard " << s << ": the current copy is intact";
    EXPECT_EQ(now.v[s], one.v[s]) << "shard " << s;
    EXPECT_EQ(r.opt->shard_step(s), 1u);
  }
  speculate(r, r.grads, p.scale(1));
  r.opt->commit_speculation();
  expect_same(r.state(), two, "speculative step after a failed one");
}

// File tier (Note [Speculative steps]): speculative steps over disjoint shards write the
// inactive slot, one commit carries the shards not stepped and publishes the step: the
// result is the plain step's, steps() moves once per commit (the state file records one
// step per commit, so a resume continues there), a discard leaves the committed state,
// and a plain step is refused while a speculation is pending.
TEST(optimizer, file_tier_speculative_steps_commit_once) {
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 4);
  temp_dir dir_plain, dir_spec;
  const std::vector<value_type> gts(p.sizes.size(), value_type::bf16);
  {
    run plain(d, p, config_for(tier::file, dir_plain.path)), spec(d, p, config_for(tier::file, dir_spec.path));
    plain.opt->initialize();
    spec.opt->initialize();
    for (std::size_t s = 0; s < p.sizes.size(); ++s) EXPECT_TRUE(spec.opt->can_speculate(s));
    for (int t = 0; t < p.steps; ++t) {
      SCOPED_TRACE("step " + std::to_string(t));
      // Step 2 skips shard 1: the commit carries it unchanged.
      const std::vector<bool> mask = t == 2 ? std::vector<bool>{true, false, true} : std::vector<bool>{true, true, true};
      plain.load_grads(t);
      plain.opt->step(only(plain.grads, mask), grad_type::bf16, p.scale(t));
      plain.drv->synchronize_stream(nullptr);
      spec.load_grads(t);
      const auto g = only(spec.grads, mask);
      if (t == 1) {  // a wrong speculation, discarded
        const result before = spec.state();
        speculate(spec, g, 2 * p.scale(t));
        EXPECT_THROW(spec.opt->step(only(spec.grads, {false, false, false}), grad_type::bf16), invalid_state)
            << "a plain step while a speculation is pending";
        spec.opt->discard_speculation();
        const result after = spec.state();
        for (std::size_t s = 0; s < p.sizes.size(); ++s) {
          EXPECT_EQ(after.main[s], before.main[s]) << "shard " << s;
          EXPECT_EQ(after.v[s], before.v[s]) << "shard " << s;
        }
      }
      speculate(spec, only(g, {mask[0], false, false}), p.scale(t));  // "buckets"
      EXPECT_EQ(spec.opt->steps(), static_cast<std::uint64_t>(t)) << "steps() moves at commit";
      speculate(spec, only(g, {false, false, mask[2]}), p.scale(t));
      if (mask[1]) speculate(spec, only(g, {false, true, false}), p.scale(t));
      spec.opt->commit_speculation();
      EXPECT_EQ(spec.opt->steps(), static_cast<std::uint64_t>(t + 1)) << "one commit per step";
      for (std::size_t s = 0; s < p.sizes.size(); ++s)
        EXPECT_EQ(spec.opt->shard_step(s), plain.opt->shard_step(s)) << "shard " << s;
      expect_same(spec.state(), plain.state(), "speculative vs plain");
    }
  }
  optimizer_config cfg = config_for(tier::file, dir_spec.path);
  cfg.resume = true;
  run r(d, p, cfg);
  EXPECT_TRUE(r.opt->resumed());
  EXPECT_EQ(r.opt->steps(), static_cast<std::uint64_t>(p.steps)) << "the state file's step: one per commit";
}

// Note [Resident steps join a speculation]: on the file tier a plain step of resident shards
// only joins a pending speculation; commit_speculation makes it durable with the rest,
// discard_speculation undoes it.
TEST(optimizer, file_tier_resident_steps_join_a_speculation) {
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 3);
  temp_dir dir;
  const std::vector<value_type> gts(p.sizes.size(), value_type::bf16);
  optimizer_config cfg = config_for(tier::file, dir.path);
  cfg.resident_bytes = 3 * 3 * d->granularity();  // shards 1 and 2 resident, 0 streamed
  {
    run r(d, p, cfg);
    r.opt->initialize();
    ASSERT_TRUE(!r.opt->shards()[0].resident && r.opt->shards()[1].resident && r.opt->shards()[2].resident);
    for (int t = 0; t < 2; ++t) {  // t 0: committed; t 1: discarded, then stepped plainly
      r.load_grads(t);
      r.opt->step_speculative(only(r.grads, {true, false, false}), gts, p.scale(t));
      EXPECT_THROW(r.opt->step(r.grads, grad_type::bf16, p.scale(t)), invalid_state) << "a pending shard too";
      r.opt->step(only(r.grads, {false, true, true}), grad_type::bf16, p.scale(t));  // joins
      EXPECT_EQ(r.opt->shard_step(1), std::uint64_t(t + 1));
      if (t == 0) r.opt->commit_speculation();
      else r.opt->discard_speculation(), r.opt->sync_model_params();  // (a discard leaves BF16 params)
      d->synchronize_stream(nullptr);
      expect_same(r.state(), cpu_twin(p, 1), t == 0 ? "committed" : "discarded: back at the commit");
      EXPECT_EQ(r.opt->shard_step(1), 1u);
    }
    r.step(1);
    expect_same(r.state(), cpu_twin(p, 2), "stepped plainly after the discard");
  }
  cfg.resume = true;  // the commits held the resident shards
  run again(d, p, cfg);
  again.opt->sync_model_params();
  d->synchronize_stream(nullptr);
  expect_same(again.state(), cpu_twin(p, 2), "resumed");
}

TEST(optimizer, speculative_step_errors) {
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 2);
  temp_dir dir, ck;
  const std::vector<value_type> gts(p.sizes.size(), value_type::bf16);
  for (tier t : {tier::device}) {
    run r(d, p, config_for(t, dir.path));
    r.opt->initialize();
    EXPECT_FALSE(r.opt->can_speculate(0));
    r.load_grads(0);
    EXPECT_THROW(r.opt->step_speculative(r.grads, gts), invalid_state) << to_string(t) << " tier";
    EXPECT_EQ(r.opt->speculation_pending(), 0u);
  }
  // A resident shard (the first) cannot speculate; the streamed ones can.
  optimizer_config cfg = config_for(tier::host);
  cfg.resident_bytes = 3 * (p.sizes[0] * 4 + d->granularity());
  run r(d, p, cfg);
  EXPECT_THROW(r.opt->step_speculative(r.grads, gts), invalid_state) << "before initialize";
  r.opt->initialize();
  ASSERT_TRUE(r.opt->shards()[0].resident);
  EXPECT_FALSE(r.opt->can_speculate(0));
  EXPECT_TRUE(r.opt->can_speculate(1));
  EXPECT_THROW(r.opt->can_speculate(3), invalid_argument);
  r.load_grads(0);
  EXPECT_THROW(r.opt->step_speculative(r.grads, gts), invalid_state) << "a resident shard";
  EXPECT_EQ(r.opt->speculation_pending(), 0u);
  const auto streamed = only(r.grads, {false, true, true});
  r.opt->step(only(r.grads, {true, false, false}), grad_type::bf16);  // resident: plain, while ...
  r.opt->step_speculative(streamed, gts);                             // ... the others speculate
  EXPECT_THROW(r.opt->step_speculative(only(r.grads, {false, true, false}), gts), invalid_state) << "pending twice";
  EXPECT_THROW(r.opt->step(streamed, grad_type::bf16), invalid_state) << "a plain step of a pending shard";
  std::vector<float> buf(p.sizes[1]);
  EXPECT_THROW(r.opt->write_state_range(1, state_array::main, 0, 4, buf.data()), invalid_state);
  EXPECT_THROW(r.opt->write_state_range(0, state_array::main, 0, 4, buf.data()), invalid_state) << "any shard";
  EXPECT_THROW(r.opt->set_shard_step(1, 7), invalid_state);
  r.opt->save_checkpoint(ck.path);  // saves the committed state
  EXPECT_THROW(r.opt->load_checkpoint(ck.path), invalid_state);
  r.opt->read_state_range(1, state_array::exp_avg, 0, buf.size(), buf.data());
  EXPECT_EQ(buf, std::vector<float>(buf.size(), 0.0f)) << "reads see the committed (never stepped) moments";
  r.opt->discard_speculation();
  r.opt->load_checkpoint(ck.path);
  r.opt->set_shard_step(1, 0);
  EXPECT_THROW(r.opt->step_speculative(std::vector<const void*>(2, nullptr), gts), invalid_argument) << "2 gradients";
  r.opt->commit_speculation();  // nothing pending: nothing happens
  EXPECT_EQ(r.opt->steps(), 1u) << "the resident shard's plain step";
}

TEST(optimizer, checkpoint_continues_bit_identically_and_refuses_corruption) {
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 6);
  temp_dir dir, ck;
  run a(d, p, config_for(tier::host));
  a.opt->initialize();
  for (int s = 0; s < 3; ++s) a.step(s);
  a.opt->save_checkpoint(ck.path);
  for (int s = 3; s < 6; ++s) a.step(s);
  const result uninterrupted = a.state();

  // Loaded into another tier, at another address, continues exactly.
  run b(d, p, config_for(tier::file, dir.path));
  b.opt->initialize();
  b.opt->load_checkpoint(ck.path);
  EXPECT_EQ(b.opt->steps(), 3u);
  for (int s = 3; s < 6; ++s) b.step(s);
  expect_same(b.state(), uninterrupted, "checkpoint at step 3, continued to 6");

  // A flipped byte is refused and changes nothing.
  const result before = b.state();
  {
    std::fstream f(ck.path + "/gen-1/shard-1.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1234);
    char c = 0;
    f.read(&c, 1);
    f.seekp(1234);
    c ^= 0x10;
    f.write(&c, 1);
  }
  EXPECT_THROW(b.opt->load_checkpoint(ck.path), corrupt_data);
  expect_same(b.state(), before, "after a refused load");
  EXPECT_EQ(b.opt->steps(), 6u);

  // Another layout is refused with a clear message.
  problem q = p;
  q.sizes[1] += 1;
  q.params[1].push_back(0);
  for (auto& g : q.grads) g[1].push_back(0);
  run c(d, q, config_for(tier::host));
  c.opt->initialize();
  try {
    c.opt->load_checkpoint(ck.path);
    FAIL() << "a mismatched layout was loaded";
  } catch (const corrupt_data& e) {
    EXPECT_NE(std::string(e.what()).find("layout mismatch"), std::string::npos) << e.what();
  }
}

// Runs `steps` in a forked child, whose last step a file fault of kind `crash` kills;
// returns once the child died so.
template <typename F>
void in_a_child_killed_mid_step(F&& steps) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    steps();
    ::_exit(0);  // not reached: the fault kills the process mid-step
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 86) << "the child was not killed mid-step";
}

// A process killed in the middle of a step resumes from the last committed step.
TEST(optimizer, file_tier_resumes_after_a_crash) {
  if (driver_name() != "host") GTEST_SKIP() << "fork() with a CUDA context is not supported; runs on the host driver";
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 3);
  temp_dir dir;
  ASSERT_NO_FATAL_FAILURE(in_a_child_killed_mid_step([&] {
    run r(d, p, config_for(tier::file, dir.path));
    r.opt->initialize();
    r.step(0);
    r.step(1);
    optim::detail::inject_file_fault(*r.opt, optim::detail::file_fault_op::write, optim::detail::file_fault_kind::crash, 5);
    r.step(2);
  }));
  optimizer_config cfg = config_for(tier::file, dir.path);
  cfg.resume = true;
  run r(d, p, cfg);
  r.opt->sync_model_params();
  d->synchronize_stream(nullptr);
  EXPECT_TRUE(r.opt->resumed());
  EXPECT_EQ(r.opt->steps(), 2u);
  expect_same(r.state(), cpu_twin(p, 2), "resumed state");
  EXPECT_THROW(r.opt->initialize(), invalid_state);
  r.step(2);
  expect_same(r.state(), cpu_twin(p, 3), "step after the resume");
}

// ---- Note [The parameter is the truth]: an FP32 parameter is its shard's main ----------

// One FP32 parameter of several pieces (and its FP32 gradient) in device memory, its
// optimizer, and a reference AdamW in float (the kernels' arithmetic) that sees what the
// parameter holds.
struct fp32_param {
  fp32_param(std::shared_ptr<driver> d, tier t, const std::string& dir, std::size_t writeback_queue = 0)
      : drv(d), bufs(d) {
    const std::size_t base = d->granularity() / 4;
    n = 13 * base + 1;
    optimizer_config cfg = config_for(t, dir);
    cfg.writeback_queue_bytes = writeback_queue;
    cfg.window_bytes = 3 * 12 * d->granularity();
    cfg.adamw = hyper;
    param = static_cast<float*>(bufs.alloc(n * 4));
    grad = bufs.alloc(n * 4);
    w = floats(1, 1.0f);
    m.assign(n, 0.0f);
    v.assign(n, 0.0f);
    set(w);
    opt = std::make_unique<streamed_adamw>(d, cfg);
    opt->add_shard(param, n, value_type::fp32, 0, "w");
  }
  std::vector<float> floats(std::uint64_t seed, float scale) const {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.0f, scale);
    std::vector<float> out(n);
    for (auto& x : out) x = nd(rng);
    return out;
  }
  static std::vector<std::uint8_t> bytes(const std::vector<float>& f) {
    std::vector<std::uint8_t> b(f.size() * 4);
    std::memcpy(b.data(), f.data(), b.size());
    return b;
  }
  // The user writes the parameter (an edit outside the optimizer); the reference sees it.
  void set(const std::vector<float>& values) {
    upload(*drv, param, bytes(values));
    w = values;
  }
  std::vector<float> now() const {
    auto raw = download(*drv, param, n * 4);
    std::vector<float> out(n);
    std::memcpy(out.data(), raw.data(), n * 4);
    return out;
  }
  // Step number `t`'s gradient, uploaded.
  std::vector<float> gradient(int t) {
    auto g = floats(100 + t, 0.1f);
    upload(*drv, grad, bytes(g));
    return g;
  }
  void reference_step(const std::vector<float>& g, float scale) {
    const auto k = optim::detail::make_scalars(hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, ++t,
                                               scale, [this](float b, float e) { return optim::backend_pow(*drv, b, e); });
    for (std::size_t i = 0; i < n; ++i) optim::detail::adamw_update(w[i], m[i], v[i], g[i], k);
  }
  void step(int k, float scale = 1.0f) {
    const auto g = gradient(k);
    const void* gs[1] = {grad};
    opt->step(gs, std::vector<value_type>{value_type::fp32}, scale);
    drv->synchronize_stream(nullptr);
    reference_step(g, scale);
  }
  // The parameter, main, and the moments are the reference's, bit for bit.
  void expect_reference(const std::string& what) {
    EXPECT_EQ(now(), w) << what << ": the parameter";
    std::vector<float> got_w(n), got_m(n), got_v(n);
    opt->read_state(0, got_w.data(), got_m.data(), got_v.data());
    EXPECT_EQ(got_w, w) << what << ": read_state(main) is the parameter";
    EXPECT_EQ(got_m, m) << what << ": exp_avg";
    EXPECT_EQ(got_v, v) << what << ": exp_avg_sq";
  }
  std::shared_ptr<driver> drv;
  device_buffers bufs;
  const adamw_params hyper{1e-2, 0.9, 0.95, 1e-8, 0.1};
  std::size_t n = 0;
  float* param = nullptr;
  void* grad = nullptr;
  std::vector<float> w, m, v;  // the reference
  std::uint64_t t = 0;
  std::unique_ptr<streamed_adamw> opt;
};

// A user's edit of an FP32 weight between steps (w.zero_(), load_state_dict, an EMA swap)
// is what the next step reads, on every tier; write_state(main) writes the parameter; a
// speculative step discarded puts the parameter back, so the redo starts from it;
// checkpoints carry the parameter as main.
TEST(optimizer, an_fp32_parameter_edited_between_steps_is_what_the_next_step_reads) {
  auto d = make_driver();
  temp_dir dir;
  for (tier t : {tier::device, tier::host, tier::file}) {
    SCOPED_TRACE(to_string(t));
    const std::string sub = dir.path + "/" + to_string(t);
    std::filesystem::create_directories(sub + "/ckpt");
    fp32_param f(d, t, sub);
    f.opt->initialize();
    f.step(0);
    f.step(1, 0.5f);
    f.set(std::vector<float>(f.n, 0.0f));  // with torch.no_grad(): w.zero_()
    f.step(2);
    f.expect_reference("the step after w.zero_()");
    const auto loaded = f.floats(7, 1.0f);
    f.opt->write_state_range(0, state_array::main, 0, f.n, loaded.data());
    f.w = loaded;
    EXPECT_EQ(f.now(), loaded) << "write_state(main) writes the parameter";
    f.step(3);
    f.expect_reference("the step after write_state(main)");

    f.opt->save_checkpoint(sub + "/ckpt");
    const auto w3 = f.w, m3 = f.m, v3 = f.v;
    const std::uint64_t t3 = f.t;
    f.step(4);
    f.opt->load_checkpoint(sub + "/ckpt");
    f.w = w3, f.m = m3, f.v = v3, f.t = t3;
    f.expect_reference("a checkpoint's main is the parameter");

    if (t == tier::device) continue;
    // A speculation (with the wrong scale) discarded: the parameter as it was; the redo
    // starts from it.
    f.set(std::vector<float>(f.n, 0.25f));
    f.gradient(5);
    const void* gs[1] = {f.grad};
    const std::vector<value_type> gts{value_type::fp32};
    f.opt->step_speculative(gs, gts, 2.0f);
    d->synchronize_stream(nullptr);
    EXPECT_NE(f.now(), f.w) << "the speculation stepped the parameter";
    std::vector<float> pending(f.n);
    f.opt->read_state_range(0, state_array::main, 0, f.n, pending.data());
    EXPECT_EQ(pending, f.w) << "while pending, main reads the committed values";
    f.opt->discard_speculation();
    EXPECT_EQ(f.now(), f.w) << "discard puts the parameter back";
    f.step(5);
    f.expect_reference("the redo after a discarded speculation");
    const auto g6 = f.gradient(6);
    f.opt->step_speculative(gs, gts, 1.0f);
    f.opt->commit_speculation();
    d->synchronize_stream(nullptr);
    f.reference_step(g6, 1.0f);
    f.expect_reference("a committed speculation");
  }
}

// Note [The write-back queue]: a failed host-tier step writes back every piece it stepped
// (with a bound, several wait for theirs), so its retry skips exactly those: an FP32
// parameter is stepped in place, so a piece stepped twice would show.  Each copy of the
// step fails in turn.
TEST(optimizer, a_retried_host_tier_step_steps_each_piece_once_whatever_copy_failed) {
  for (std::size_t bound : {std::size_t{0}, std::size_t{1}}) {
    std::uint64_t nth = 1, pieces = 0;
    for (;; ++nth) {
      SCOPED_TRACE("bound " + std::to_string(bound) + ", copy " + std::to_string(nth) + " fails");
      auto f = std::make_shared<fault_driver>(make_driver());
      fp32_param w(f, tier::host, "", bound);
      // The pieces follow the driver's granularity (4 on the host driver of the tests, 7 on CUDA's).
      pieces = (w.n + w.opt->piece_elements() - 1) / w.opt->piece_elements();
      w.opt->initialize();
      w.step(0);
      const auto g = w.gradient(1);
      const void* gs[1] = {w.grad};
      const std::vector<value_type> gts{value_type::fp32};
      f->fail_nth_copy(nth);
      bool failed = false;
      try {
        w.opt->step(gs, gts, 1.0f);
      } catch (const cuda_error&) {
        failed = true;
      }
      f->clear();
      if (!failed) break;  // past the step's last copy
      w.opt->step(gs, gts, 1.0f);
      f->synchronize_stream(nullptr);
      w.reference_step(g, 1.0f);
      w.expect_reference("the retried step");
      if (::testing::Test::HasFailure()) return;
    }
    EXPECT_EQ(nth, 4 * pieces + 1) << "the step's copies: its " << pieces << " pieces' two moments, in and out";
  }
}

// Note [The write-back queue]: a copy that keeps failing, so that the failed step cannot
// write back a piece it stepped: the FP32 parameter of that piece is stepped and its moments
// are not at home, so the retry is refused (it would step the piece twice) until a
// checkpoint is loaded.
namespace {
class failing_driver final : public deferalloc::driver, public fault_vmm, public fault_streams {
 public:
  explicit failing_driver(std::shared_ptr<deferalloc::driver> inner)
      : fault_vmm(inner), fault_streams(inner), inner_(std::move(inner)) {}
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_t s) override {
    if (fail_from != 0 && ++copies >= fail_from) throw cuda_error("injected fault in copy_async, and in every one after");
    fault_streams::copy_async(dst, src, bytes, s);
  }
  std::string name() const override { return "failing(" + inner_->name() + ")"; }
  driver_kind kind() const override { return inner_->kind(); }
  int device() const override { return inner_->device(); }
  std::uint64_t fail_from = 0, copies = 0;  // from the fail_from-th copy on (0: none), counted in copies

 private:
  std::shared_ptr<deferalloc::driver> inner_;
};
}  // namespace

TEST(optimizer, a_step_that_could_not_write_back_a_stepped_piece_refuses_its_retry) {
  struct fault {
    std::size_t bound;
    std::uint64_t from;  // the first failing copy, counted from the step's first
  };
  // Bound 0: the first piece's write-back fails (after its two moments came in).  Bound 1:
  // the third piece's fetch fails while the second piece, stepped, waits for its write-back.
  for (const fault x : {fault{0, 3}, fault{1, 7}}) {
    SCOPED_TRACE("bound " + std::to_string(x.bound) + ", copies fail from " + std::to_string(x.from));
    temp_dir dir;
    auto f = std::make_shared<failing_driver>(make_driver());
    fp32_param w(f, tier::host, "", x.bound);
    w.opt->initialize();
    w.step(0);
    w.opt->save_checkpoint(dir.path);
    const auto w1 = w.w, m1 = w.m, v1 = w.v;
    const std::uint64_t t1 = w.t;
    w.gradient(1);
    const void* gs[1] = {w.grad};
    const std::vector<value_type> gts{value_type::fp32};
    f->copies = 0;
    f->fail_from = x.from;
    EXPECT_THROW(w.opt->step(gs, gts, 1.0f), cuda_error);
    f->fail_from = 0;
    try {
      w.opt->step(gs, gts, 1.0f);
      ADD_FAILURE() << "the retry of a torn step ran";
    } catch (const invalid_state& e) {
      EXPECT_NE(std::string(e.what()).find("load a checkpoint"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("shard 0"), std::string::npos) << e.what();
    }
    EXPECT_THROW(w.opt->step_speculative(gs, gts, 1.0f), invalid_state) << "a speculation before the retry";
    if (x.bound == 0) {
      w.opt->load_checkpoint(dir.path);
    } else {  // a state write replaces what the failed try wrote (load_state_dict's way)
      w.opt->write_state_range(0, state_array::main, 0, w.n, w1.data());
      w.opt->write_state_range(0, state_array::exp_avg, 0, w.n, m1.data());
      w.opt->write_state_range(0, state_array::exp_avg_sq, 0, w.n, v1.data());
    }
    w.w = w1, w.m = m1, w.v = v1, w.t = t1;
    w.expect_reference("the state restored after a torn step");
    w.step(1);
    w.expect_reference("a step after the state was restored");
  }
}

// A 16-bit parameter's piece that was stepped and whose write-back never started is redone
// exactly from its main by the retry, whatever copy kept failing; one whose write-back
// copied main and not its moments is torn (the retry is refused); a commit of a speculation
// waits for a retry (it would adopt the failed step's number).
TEST(optimizer, a_retry_redoes_a_bf16_piece_that_never_reached_home) {
  const std::size_t g = make_driver()->granularity();
  const problem p = make_problem(g, 2);
  const result two = cpu_twin(p, 2);
  for (std::uint64_t from : {4u, 10u, 16u, 22u}) {
    SCOPED_TRACE("copies fail from " + std::to_string(from));
    auto f = std::make_shared<failing_driver>(make_driver());
    optimizer_config cfg = config_for(tier::host);
    cfg.writeback_queue_bytes = 1;
    run r(f, p, cfg);
    r.opt->initialize();
    r.step(0);
    r.load_grads(1);
    f->copies = 0;
    f->fail_from = from;
    EXPECT_THROW(r.opt->step(r.grads, grad_type::bf16, p.scale(1)), cuda_error);
    f->fail_from = 0;
    r.opt->step(r.grads, grad_type::bf16, p.scale(1));
    f->synchronize_stream(nullptr);
    expect_same(r.state(), two, "the retried step");
  }
  {  // the first piece's main copied home, its moments not
    auto f = std::make_shared<failing_driver>(make_driver());
    run r(f, p, config_for(tier::host));
    r.opt->initialize();
    r.step(0);
    r.load_grads(1);
    f->copies = 0;
    f->fail_from = 5;
    EXPECT_THROW(r.opt->step(r.grads, grad_type::bf16, p.scale(1)), cuda_error);
    f->fail_from = 0;
    EXPECT_THROW(r.opt->step(r.grads, grad_type::bf16, p.scale(1)), invalid_state) << "a torn piece redone";
  }
  // Shard 0 speculates while a plain step of the others fails: the commit waits for its retry.
  auto f = std::make_shared<failing_driver>(make_driver());
  run r(f, p, config_for(tier::host));
  r.opt->initialize();
  r.load_grads(0);
  speculate(r, only(r.grads, {true, false, false}), p.scale(0));
  f->copies = 0;
  f->fail_from = 2;
  const auto rest = only(r.grads, {false, true, true});
  EXPECT_THROW(r.opt->step(rest, grad_type::bf16, p.scale(0)), cuda_error);
  f->fail_from = 0;
  try {
    r.opt->commit_speculation();
    ADD_FAILURE() << "a commit adopted a failed step's number";
  } catch (const invalid_state& e) {
    EXPECT_NE(std::string(e.what()).find("a failed step awaits its retry"), std::string::npos) << e.what();
  }
  r.opt->step(rest, grad_type::bf16, p.scale(0));
  r.opt->commit_speculation();
}

// A failed step is retried by a step over the same shards: a step over others (the next
// bucket of a BackwardOverlap, which has the same step number) would be taken for the retry
// and skip the failed try's count of its own pieces, so it is refused; unless the failed try
// changed nothing (a fault at its first copy).
TEST(optimizer, a_step_over_other_shards_waits_for_a_failed_steps_retry) {
  const std::size_t g = make_driver()->granularity();
  const problem p = make_problem(g, 2);
  const std::vector<bool> big{true, false, false}, rest{false, true, true};
  auto reference = [&] {
    auto d = make_driver();
    run r(d, p, config_for(tier::host));
    r.opt->initialize();
    r.load_grads(0);
    r.opt->step(only(r.grads, big), grad_type::bf16, p.scale(0));
    r.opt->step(only(r.grads, rest), grad_type::bf16, p.scale(0));
    d->synchronize_stream(nullptr);
    return r.state();
  }();
  for (std::uint64_t nth : {1u, 13u}) {  // the first fetch; the second piece's write-back
    SCOPED_TRACE("copy " + std::to_string(nth) + " fails");
    auto f = std::make_shared<fault_driver>(make_driver());
    run r(f, p, config_for(tier::host));
    r.opt->initialize();
    r.load_grads(0);
    f->fail_nth_copy(nth);
    EXPECT_THROW(r.opt->step(only(r.grads, big), grad_type::bf16, p.scale(0)), cuda_error);
    if (nth == 1) {  // nothing reached home: the other shards may step first
      r.opt->step(only(r.grads, rest), grad_type::bf16, p.scale(0));
      r.opt->step(only(r.grads, big), grad_type::bf16, p.scale(0));
    } else {
      try {
        r.opt->step(only(r.grads, rest), grad_type::bf16, p.scale(0));
        ADD_FAILURE() << "a step over other shards was taken for the retry";
      } catch (const invalid_state& e) {
        EXPECT_NE(std::string(e.what()).find("other shards"), std::string::npos) << e.what();
      }
      r.opt->step(only(r.grads, big), grad_type::bf16, p.scale(0));
      r.opt->step(only(r.grads, rest), grad_type::bf16, p.scale(0));
    }
    f->synchronize_stream(nullptr);
    const result got = r.state();
    // Each shard is stepped once, with its step count: the state does not depend on the order.
    for (std::size_t s = 0; s < 3; ++s) {
      EXPECT_EQ(got.main[s], reference.main[s]) << "main, shard " << s;
      EXPECT_EQ(got.m[s], reference.m[s]) << "exp_avg, shard " << s;
      EXPECT_EQ(got.bf16[s], reference.bf16[s]) << "bf16, shard " << s;
    }
  }
}

// The host tier moves an FP32 parameter's moments only (8 B in, 8 out per element); the
// file tier also writes the parameter's durable copy (12 B out).
TEST(optimizer, fp32_parameters_stream_only_their_moments) {
  auto d = make_driver();
  temp_dir dir;
  for (tier t : {tier::host, tier::file}) {
    SCOPED_TRACE(to_string(t));
    fp32_param f(d, t, dir.path);
    f.opt->initialize();
    f.step(0);
    const std::size_t out = t == tier::file ? 12 : 8;
    EXPECT_EQ(f.opt->last_report().bytes_to_device, 0u) << "moments never written are zeroed on the device";
    EXPECT_EQ(f.opt->last_report().bytes_from_device, out * f.n);
    f.step(1);
    EXPECT_EQ(f.opt->last_report().bytes_to_device, 8 * f.n);
    EXPECT_EQ(f.opt->last_report().bytes_from_device, out * f.n);
    f.expect_reference("after two steps");
  }
}

// A file tier killed mid-step after an edit of an FP32 parameter resumes the edited and
// stepped values (the durable copy of the last committed step).
TEST(optimizer, file_tier_resumes_an_edited_fp32_parameter) {
  if (driver_name() != "host") GTEST_SKIP() << "fork() with a CUDA context is not supported; runs on the host driver";
  auto d = make_driver();
  temp_dir dir;
  ASSERT_NO_FATAL_FAILURE(in_a_child_killed_mid_step([&] {
    fp32_param f(d, tier::file, dir.path);
    f.opt->initialize();
    f.step(0);
    f.set(std::vector<float>(f.n, 0.5f));
    f.step(1);
    optim::detail::inject_file_fault(*f.opt, optim::detail::file_fault_op::write, optim::detail::file_fault_kind::crash, 2);
    f.step(2);
  }));
  fp32_param ref(d, tier::host, dir.path);  // the reference of the same steps
  ref.reference_step(ref.gradient(0), 1.0f);
  ref.w.assign(ref.n, 0.5f);
  ref.reference_step(ref.gradient(1), 1.0f);

  fp32_param f(d, tier::host, dir.path);  // its optimizer replaced by the resuming one
  optimizer_config cfg = config_for(tier::file, dir.path);
  cfg.window_bytes = 3 * 12 * d->granularity();
  cfg.adamw = f.hyper;
  cfg.resume = true;
  f.opt = std::make_unique<streamed_adamw>(d, cfg);
  f.opt->add_shard(f.param, f.n, value_type::fp32, 0, "w");
  f.set(std::vector<float>(f.n, 9.0f));  // the new process's parameter, before the resume
  f.opt->sync_model_params();
  d->synchronize_stream(nullptr);
  EXPECT_TRUE(f.opt->resumed());
  EXPECT_EQ(f.opt->steps(), 2u);
  f.w = ref.w, f.m = ref.m, f.v = ref.v, f.t = ref.t;
  f.expect_reference("resumed");
  f.step(2);
  f.expect_reference("the step after the resume");
}

// Note [A forked child and device memory]: the host driver's device memory is shared
// with a forked child, so a child's step of a device-tier optimizer (or of resident
// shards) would write the parent's state: refused, and the parent's state is unchanged.
TEST(optimizer, a_forked_child_cannot_change_state_in_device_memory) {
  if (driver_name() != "host") GTEST_SKIP() << "fork() with a CUDA context is not supported; runs on the host driver";
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 2);
  optimizer_config resident = config_for(tier::host);
  resident.resident_bytes = std::size_t{1} << 20;  // the small shards
  for (const optimizer_config& cfg : {config_for(tier::device), resident}) {
    SCOPED_TRACE(to_string(cfg.home));
    run r(d, p, cfg);
    r.opt->initialize();
    r.step(0);
    const result before = r.state();
    r.load_grads(1);
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Exit status: bit 0 a step was not refused, bit 1 a state write, bit 2 a wrong message.
      const std::string owner = "belongs to process " + std::to_string(::getppid()) + "; a forked child cannot change it";
      int rc = 0;
      try {
        r.opt->step(r.grads, grad_type::bf16);
        rc |= 1;
      } catch (const invalid_state& e) {
        if (std::string(e.what()).find(owner + " (step)") == std::string::npos) rc |= 4;
      }
      std::vector<float> zeros(p.sizes[2], 0.0f);
      try {
        r.opt->write_state_range(2, state_array::exp_avg, 0, zeros.size(), zeros.data());
        rc |= 2;
      } catch (const invalid_state& e) {
        if (std::string(e.what()).find(owner + " (write_state_range)") == std::string::npos) rc |= 4;
      }
      ::_exit(rc);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 0) << "1: a step, 2: a state write not refused in the child; 4: another message";
    expect_same(r.state(), before, "the parent's state after the child");
    r.step(1);  // the parent steps on
  }
}

// Note [Edits of 16-bit parameters]: a BF16 parameter changed outside the optimizer
// between steps is taken into its main (main = float(param) where param is not main's
// rounding) by the next step, with one warning line naming the shard; the other shards
// are untouched and nothing is logged without an edit.  Parameters loaded after the
// optimizer's state (a model's state_dict saved with it) change nothing.
// The edit hash's term (Note [Edits of 16-bit parameters]): at any index, every 16-bit
// value has its own term, and two different values swapped between indices (up to 2^31
// apart) change the sum.
TEST(optimizer, the_edit_terms_tell_every_value_and_every_swap) {
  using deferalloc::optim::detail::edit_term;
  for (std::size_t i : {std::size_t{0}, std::size_t{1}, std::size_t{12345}, (std::size_t{1} << 31) - 1,
                        std::size_t{1} << 40}) {
    std::vector<std::uint64_t> terms;
    for (std::uint32_t b = 0; b < 65536; ++b) terms.push_back(edit_term(static_cast<std::uint16_t>(b), i));
    std::sort(terms.begin(), terms.end());
    EXPECT_EQ(std::adjacent_find(terms.begin(), terms.end()), terms.end()) << "index " << i;
  }
  const std::uint16_t a = 0x3F80, b = 0x3F81;  // BF16 1.0 and its neighbour
  for (std::size_t i : {std::size_t{0}, std::size_t{7}, std::size_t{1} << 30})
    for (std::size_t d : {std::size_t{1}, std::size_t{8}, std::size_t{1} << 20, (std::size_t{1} << 31) - 1})
      EXPECT_NE(edit_term(a, i) + edit_term(b, i + d), edit_term(b, i) + edit_term(a, i + d)) << i << " " << d;
}

TEST(optimizer, an_edited_bf16_parameter_is_taken_into_main_with_a_warning) {
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 3);
  const std::uint16_t one = 0x3F80;  // BF16 1.0
  const result want = cpu_twin(p, p.steps, [&](int t, result& r) {
    if (t != 1) return;
    for (std::size_t i = 0; i < p.sizes[1]; ++i)
      if (optim::detail::to_bf16(r.main[1][i]) != one) r.main[1][i] = 1.0f;
    r.bf16[1].assign(p.sizes[1], one);
  });
  temp_dir dir;
  std::vector<std::string> lines;
  const dfa_log_fn keep = [](int, const char* msg, void* user) { static_cast<std::vector<std::string>*>(user)->push_back(msg); };
  ASSERT_EQ(dfa_set_log_callback(keep, &lines, 2), DFA_SUCCESS);
  for (tier t : {tier::device, tier::host, tier::file}) {
    SCOPED_TRACE(to_string(t));
    lines.clear();
    std::filesystem::create_directories(dir.path + "/" + to_string(t));
    run r(d, p, config_for(t, dir.path + "/" + to_string(t)));
    r.opt->initialize();
    r.step(0);
    upload(*d, r.params[1], run::as_bytes(std::vector<std::uint16_t>(p.sizes[1], one)));  // w.fill_(1)
    r.step(1);
    r.step(2);  // (the device tier reports at its next step)
    expect_same(r.state(), want, "the edit taken into main");
    ASSERT_EQ(lines.size(), 1u) << "one warning line";
    EXPECT_NE(lines[0].find("shard 1 ('layer1')"), std::string::npos) << lines[0];
    EXPECT_NE(lines[0].find("changed outside the optimizer"), std::string::npos) << lines[0];
  }
  // A fresh optimizer takes the state (write_state), then the model's parameters are
  // loaded: the next steps are the first one's, bit for bit, with nothing logged.
  lines.clear();
  run a(d, p, config_for(tier::host)), b(d, p, config_for(tier::host));
  a.opt->initialize();
  a.step(0);
  b.opt->initialize();
  for (std::size_t s = 0; s < p.sizes.size(); ++s) {
    std::vector<float> buf(p.sizes[s]);
    for (state_array arr : {state_array::main, state_array::exp_avg, state_array::exp_avg_sq}) {
      a.opt->read_state_range(s, arr, 0, buf.size(), buf.data());
      b.opt->write_state_range(s, arr, 0, buf.size(), buf.data());
    }
    b.opt->set_shard_step(s, a.opt->shard_step(s));
    upload(*d, b.params[s], download(*d, a.params[s], p.sizes[s] * 2));
  }
  a.step(1);
  b.step(1);
  expect_same(b.state(), a.state(), "parameters loaded after the state");
  EXPECT_TRUE(lines.empty()) << lines[0];
  dfa_set_log_callback(nullptr, nullptr, 0);
}

TEST(optimizer, bad_input) {
  auto d = make_driver();
  const problem p = make_problem(d->granularity(), 1);
  optimizer_config bad = config_for(tier::file, "");
  EXPECT_THROW(streamed_adamw(d, bad), invalid_argument);
  optimizer_config small = config_for(tier::host);
  small.window_bytes = d->granularity();
  EXPECT_THROW(streamed_adamw(d, small), invalid_argument);
  EXPECT_THROW(parse_tier("disk"), invalid_argument);
  run r(d, p, config_for(tier::host));
  EXPECT_THROW(r.opt->step(r.grads, grad_type::bf16), invalid_state) << "step before initialize";
  EXPECT_THROW(r.opt->add_shard(nullptr, 10), invalid_argument);
  EXPECT_THROW(r.opt->add_shard(r.params[0], 0), invalid_argument);
  r.opt->initialize();
  EXPECT_THROW(r.opt->initialize(), invalid_state);
  EXPECT_THROW(r.opt->add_shard(r.params[0], 10), invalid_state);
  std::vector<const void*> few(r.grads.begin(), r.grads.end() - 1);
  EXPECT_THROW(r.opt->step(few, grad_type::bf16), invalid_argument);
  EXPECT_THROW(r.opt->set_hyper(adamw_params{-1.0}), invalid_argument) << "negative learning rate";
  EXPECT_THROW(r.opt->set_group(1, adamw_params{1e-3, 1.0}), invalid_argument) << "beta1 = 1";
  EXPECT_EQ(r.opt->steps(), 0u);
}
