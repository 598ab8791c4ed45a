// The distributed optimizer (ZeRO-1 over a communicator), three ways:
//  - DFA_TEST_DRIVER=host: ranks are threads on host drivers, joined by an in-process
//    communicator (sums in rank order, one rounding); runs in CI.
//  - DFA_TEST_DRIVER=cuda, DFA_TEST_WORLD=1 (label gpu): one GPU, NCCL at world size 1.
//  - DFA_TEST_DRIVER=cuda, DFA_TEST_WORLD=2 (label multigpu): one thread per GPU, NCCL.
// Without the GPUs or NCCL it prints why and exits 77 (ctest: Skipped).
//
// What must hold: the layout covers every element once with zero padding; the tiers
// give bit-identical BF16 params and state; world size 2 is bit-identical to world
// size 1 fed the BF16 sum of the two ranks' gradients halved (exact in BF16); every
// rank ends with the same params; a checkpoint continues bit-identically and refuses
// another world size; the flat buffers survive deregister -> release -> restore ->
// register between steps (pause/resume) with identical results and no hang.
#include <deferalloc/distributed/distributed.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>

#include "../optimizer/kernels/adamw_math.hpp"
#include "common.hpp"

using namespace deferalloc;
using namespace deferalloc::dist;
using namespace dfa_test;
using optim::detail::from_bf16;
using optim::detail::to_bf16;
using optim::tier;

namespace {

int test_world() {
  const char* e = std::getenv("DFA_TEST_WORLD");
  return e && *e ? std::atoi(e) : 0;
}
bool on_cuda() { return driver_name() == "cuda"; }

// ---- an in-process communicator: ranks are threads, memory is host memory ----------
struct group {
  explicit group(int w) : world(w), ptrs(static_cast<std::size_t>(w)) {}
  void barrier() {
    std::unique_lock lk(mu);
    const std::uint64_t g = gen;
    if (++arrived == world) {
      arrived = 0;
      ++gen;
      cv.notify_all();
    } else {
      cv.wait(lk, [&] { return gen != g; });
    }
  }
  int world;
  std::vector<const void*> ptrs;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  std::uint64_t gen = 0;
  std::atomic<int> live_registrations{0}, registrations{0};
};

class thread_comm final : public communicator {
 public:
  thread_comm(std::shared_ptr<group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return g_->world; }
  void reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, stream_t) override {
    g_->ptrs[rank_] = send;
    g_->barrier();
    std::vector<std::uint8_t> tmp(count * size_of(t));
    const std::size_t off = static_cast<std::size_t>(rank_) * count;
    for (std::size_t i = 0; i < count; ++i) {
      double acc = 0;
      float accf = 0;
      for (int k = 0; k < g_->world; ++k) {
        const void* p = g_->ptrs[k];
        if (t == dtype::bf16) accf += from_bf16(static_cast<const std::uint16_t*>(p)[off + i]);
        if (t == dtype::fp32) accf += static_cast<const float*>(p)[off + i];
        if (t == dtype::fp64) acc += static_cast<const double*>(p)[off + i];
      }
      if (t == dtype::bf16) reinterpret_cast<std::uint16_t*>(tmp.data())[i] = to_bf16(accf);
      if (t == dtype::fp32) reinterpret_cast<float*>(tmp.data())[i] = accf;
      if (t == dtype::fp64) reinterpret_cast<double*>(tmp.data())[i] = acc;
    }
    g_->barrier();
    std::memcpy(recv, tmp.data(), tmp.size());
  }
  void all_gather(const void* send, void* recv, std::size_t count, dtype t, stream_t) override {
    g_->ptrs[rank_] = send;
    g_->barrier();
    const std::size_t b = count * size_of(t);
    for (int k = 0; k < g_->world; ++k) {
      char* dst = static_cast<char*>(recv) + k * b;
      if (dst != g_->ptrs[k]) std::memcpy(dst, g_->ptrs[k], b);
    }
    g_->barrier();
  }
  void* register_buffer(void* ptr, std::size_t) override {
    ++g_->live_registrations;
    ++g_->registrations;
    return ptr;
  }
  void deregister_buffer(void* h) override {
    if (h) --g_->live_registrations;
  }
  std::string name() const override { return "threads"; }

 private:
  std::shared_ptr<group> g_;
  int rank_;
};

// ---- one rank: flat buffers in its own reservations, the optimizer ------------------
constexpr float k_lr = 1e-2f;

struct rank_run {
  rank_run(std::shared_ptr<driver> d, std::shared_ptr<communicator> c, std::size_t numel, tier t,
           const std::string& dir, float max_norm)
      : drv(std::move(d)), comm(std::move(c)), s(drv) {
    if (t == tier::file) std::filesystem::create_directories(dir);  // the file tier refuses a missing one
    lay = distributed_adamw::layout_for(numel, *comm, 256);
    pid = s.mgr->reserve(lay.padded_numel * 2);
    gid = s.mgr->reserve(lay.padded_numel * 2);
    s.mgr->materialize(pid, 0, whole, fill_mode::zero);
    s.mgr->materialize(gid, 0, whole, fill_mode::zero);
    params = static_cast<std::uint16_t*>(s.mgr->address(pid));
    grads = s.mgr->address(gid);
    dist_config cfg;
    cfg.optimizer.home = t;
    cfg.optimizer.directory = dir;
    cfg.optimizer.io_threads = 2;
    cfg.optimizer.io_request_bytes = 64 << 10;
    cfg.optimizer.window_bytes = 3 * 12 * drv->granularity();
    cfg.optimizer.adamw = {k_lr, 0.9f, 0.95f, 1e-8f, 0.1f};
    cfg.max_grad_norm = max_norm;
    cfg.align = 256;
    std::vector<std::uint16_t> p(lay.padded_numel, 0);
    std::mt19937_64 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (std::size_t i = 0; i < numel; ++i) p[i] = to_bf16(nd(rng));
    put(params, p);
    opt = std::make_unique<distributed_adamw>(drv, comm, numel, params, grads, cfg);
  }
  void put(void* dev, const std::vector<std::uint16_t>& v) {
    drv->copy_async(dev, v.data(), v.size() * 2, nullptr);
    drv->synchronize_stream(nullptr);
  }
  std::vector<std::uint16_t> get(const void* dev) {
    std::vector<std::uint16_t> v(lay.padded_numel, 0xDEAD);  // poisoned
    drv->copy_async(v.data(), dev, v.size() * 2, nullptr);
    drv->synchronize_stream(nullptr);
    return v;
  }
  void step(const std::vector<std::uint16_t>& g) {
    put(grads, g);
    opt->step(nullptr);
    drv->synchronize_stream(nullptr);
  }
  std::shared_ptr<driver> drv;
  std::shared_ptr<communicator> comm;
  stack s;
  shard_layout lay;
  reservation_id pid{}, gid{};
  std::uint16_t* params = nullptr;
  void* grads = nullptr;
  std::unique_ptr<distributed_adamw> opt;
};

// Gradient of `rank` at `step`: random BF16 on the first numel elements, zero padding.
std::vector<std::uint16_t> grad_of(std::size_t numel, std::size_t padded, int step, int rank) {
  std::vector<std::uint16_t> g(padded, 0);
  std::mt19937_64 rng(1000 * step + rank);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  for (std::size_t i = 0; i < numel; ++i) g[i] = to_bf16(nd(rng));
  return g;
}

struct outcome {
  std::vector<std::uint16_t> params;  // rank 0's whole flat buffer (every rank checked equal)
  std::vector<float> main;            // the FP32 main params, shards concatenated
};

enum class event_kind { none, pause_registered, checkpoint };

struct scenario {
  int world = 2;
  std::size_t numel = 0;
  tier home = tier::host;
  int steps = 6;
  float max_norm = 0;
  event_kind ev = event_kind::none;
  int at = 3;  // the event happens after this many steps
};

std::shared_ptr<driver> driver_for(int rank) {
  if (on_cuda()) return make_cuda_driver(rank);
  return make_host_driver({64_KiB, 1_GiB});
}

// Runs `sc` with one thread per rank.  `make_comm(rank, drv)` builds each communicator.
template <class MakeComm>
outcome run_group(const scenario& sc, MakeComm make_comm) {
  temp_dir dir, ckpt;
  std::vector<outcome> out(static_cast<std::size_t>(sc.world));
  std::vector<std::string> errors(static_cast<std::size_t>(sc.world));
  auto body = [&](int r) {
    try {
      auto drv = driver_for(r);
      auto comm = make_comm(r, drv);
      auto rr = std::make_unique<rank_run>(drv, comm, sc.numel, sc.home, dir.path, sc.max_norm);
      rr->opt->initialize(nullptr);
      const std::size_t P = rr->lay.padded_numel;
      for (int t = 0; t < sc.steps; ++t) {
        if (t == sc.at && sc.ev == event_kind::pause_registered) {
          // As a trainer around a rollout: deregister, release both buffers (contents to
          // host), give the chunks back, restore at the same addresses, register again.
          const auto before = rr->get(rr->params);
          rr->opt->deregister_buffers();
          rr->s.mgr->release(rr->pid, 0, whole, keep_mode::host, nullptr);
          rr->s.mgr->release(rr->gid, 0, whole, keep_mode::discard, nullptr);
          rr->s.pool->trim();
          rr->s.mgr->materialize(rr->pid, 0, whole, fill_mode::restore, nullptr);
          rr->s.mgr->materialize(rr->gid, 0, whole, fill_mode::zero, nullptr);
          rr->drv->synchronize_stream(nullptr);
          if (!rr->opt->register_buffers()) throw std::runtime_error("register_buffers failed");
          if (rr->get(rr->params) != before) throw std::runtime_error("params changed across the pause");
        }
        if (t == sc.at && sc.ev == event_kind::checkpoint) {
          rr->opt->save_checkpoint(ckpt.path);
          // A fresh optimizer (and fresh, poisoned model params) loads it and continues.
          auto comm2 = comm;
          rr.reset();
          rr = std::make_unique<rank_run>(drv, comm2, sc.numel, sc.home, dir.path + "/2", sc.max_norm);
          rr->put(rr->params, std::vector<std::uint16_t>(P, 0x7F7F));
          rr->opt->load_checkpoint(ckpt.path, nullptr);
          rr->drv->synchronize_stream(nullptr);
        }
        rr->step(grad_of(sc.numel, P, t, r));
      }
      out[r].params = rr->get(rr->params);
      std::vector<float> m(rr->lay.shard, -1.0f);
      rr->opt->optimizer().read_state(0, m.data(), nullptr, nullptr);
      out[r].main = std::move(m);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  std::vector<std::thread> th;
  for (int r = 0; r < sc.world; ++r) th.emplace_back(body, r);
  for (auto& t : th) t.join();
  for (int r = 0; r < sc.world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  outcome o;
  if (!errors[0].empty()) return o;
  o.params = out[0].params;
  for (int r = 0; r < sc.world; ++r) {
    EXPECT_EQ(out[r].params, out[0].params) << "rank " << r << " holds other params than rank 0";
    o.main.insert(o.main.end(), out[r].main.begin(), out[r].main.end());
  }
  for (std::size_t i = sc.numel; i < o.params.size(); ++i)
    if (o.params[i] != 0) {
      ADD_FAILURE() << "padding element " << i << " is " << o.params[i] << ", not 0";
      break;
    }
  return o;
}

// The communicator for this run: threads on the host driver, NCCL on the CUDA driver.
struct comm_factory {
  explicit comm_factory(int world) : g(std::make_shared<group>(world)) {
    if (on_cuda()) id = nccl_unique_id();
  }
  std::shared_ptr<communicator> operator()(int r, std::shared_ptr<driver> drv) {
    if (on_cuda()) return make_nccl_communicator(std::move(drv), id, g->world, r);
    return std::make_shared<thread_comm>(g, r);
  }
  std::shared_ptr<group> g;
  unique_id id{};
};

std::size_t problem_numel(int world) {
  // Shards several pieces long with an odd tail (piece = one granule of floats).
  const std::size_t piece = on_cuda() ? (2_MiB / 4) : (64_KiB / 4);
  return world * (3 * piece + piece / 3) + 1234 + world;
}

int world_under_test() { return on_cuda() ? std::max(1, test_world()) : 2; }

}  // namespace

TEST(distributed_layout, covers_every_element_once_with_aligned_zero_padding) {
  for (std::size_t numel : {1ul, 5ul, 1023ul, 1024ul, 1025ul, 4096ul * 3 + 17, 1000003ul})
    for (int world : {1, 2, 3, 7, 8})
      for (std::size_t align : {1ul, 256ul, 1024ul}) {
        std::size_t covered = 0;
        for (int r = 0; r < world; ++r) {
          auto l = make_layout(numel, world, r, align);
          EXPECT_EQ(l.shard % align, 0u);
          EXPECT_EQ(l.padded_numel, l.shard * world);
          EXPECT_GE(l.padded_numel, numel);
          EXPECT_LT(l.padded_numel - numel, world * align + world) << numel << " " << world;
          EXPECT_EQ(l.begin, l.shard * r);
          EXPECT_EQ(covered, std::min(numel, l.begin));
          covered += l.valid;
        }
        EXPECT_EQ(covered, numel) << "numel " << numel << " world " << world << " align " << align;
      }
  EXPECT_THROW(make_layout(0, 2, 0), invalid_argument);
  EXPECT_THROW(make_layout(10, 0, 0), invalid_argument);
  EXPECT_THROW(make_layout(10, 2, 2), invalid_argument);
  EXPECT_THROW(make_layout(10, 2, -1), invalid_argument);
  EXPECT_THROW(make_layout(10, 2, 0, 0), invalid_argument);
}

TEST(distributed, world_one_local_equals_the_streamed_optimizer) {
  if (test_world() > 1) GTEST_SKIP() << "world-size-1 test";
  auto drv = make_driver();
  const std::size_t numel = problem_numel(1);
  auto comm = make_local_communicator(drv);
  rank_run a(drv, comm, numel, tier::host, {}, 0);
  a.opt->initialize(nullptr);
  // The plain optimizer on a copy of the same params, fed the same gradients.
  stack s2(drv);
  auto id = s2.mgr->reserve(a.lay.padded_numel * 2), gid = s2.mgr->reserve(a.lay.padded_numel * 2);
  s2.mgr->materialize(id, 0, whole, fill_mode::zero);
  s2.mgr->materialize(gid, 0, whole, fill_mode::zero);
  auto* p2 = static_cast<std::uint16_t*>(s2.mgr->address(id));
  a.put(p2, a.get(a.params));
  optim::optimizer_config oc;
  oc.home = tier::device;
  oc.adamw = {k_lr, 0.9f, 0.95f, 1e-8f, 0.1f};
  optim::streamed_adamw plain(drv, oc);
  plain.add_shard(p2, a.lay.padded_numel);
  plain.initialize(nullptr);
  for (int t = 0; t < 4; ++t) {
    auto g = grad_of(numel, a.lay.padded_numel, t, 0);
    a.step(g);
    a.put(s2.mgr->address(gid), g);
    const void* gp[1] = {s2.mgr->address(gid)};
    plain.step(gp, optim::grad_type::bf16, 1.0f, nullptr);
    drv->synchronize_stream(nullptr);
  }
  EXPECT_EQ(a.get(a.params), a.get(p2));
}

TEST(distributed, tiers_are_bit_identical_and_ranks_agree) {
  const int world = world_under_test();
  if (on_cuda() && world < 2 && test_world() == 0) GTEST_SKIP() << "set DFA_TEST_WORLD";
  std::vector<outcome> res;
  temp_dir keep;
  for (tier t : {tier::device, tier::host, tier::file}) {
    scenario sc;
    sc.world = world;
    sc.numel = problem_numel(world);
    sc.home = t;
    sc.max_norm = 1.0f;  // clipping active: the gradients' norm is well above 1
    comm_factory f(world);
    res.push_back(run_group(sc, f));
  }
  ASSERT_EQ(res.size(), 3u);
  EXPECT_EQ(res[0].params, res[1].params) << "device vs host tier";
  EXPECT_EQ(res[0].params, res[2].params) << "device vs file tier";
  EXPECT_EQ(res[0].main, res[1].main);
  EXPECT_EQ(res[0].main, res[2].main);
}

TEST(distributed, three_ranks_with_uneven_shards) {
  if (on_cuda()) GTEST_SKIP() << "host-driver test (three ranks in threads)";
  scenario sc;
  sc.world = 3;
  sc.numel = problem_numel(3) + 1;
  comm_factory f(3);
  auto a = run_group(sc, f);
  sc.home = tier::device;
  comm_factory f2(3);
  auto b = run_group(sc, f2);
  EXPECT_EQ(a.params, b.params);
}

TEST(distributed, world_two_equals_world_one_on_the_halved_bf16_sum) {
  const int world = world_under_test();
  if (world != 2) GTEST_SKIP() << "needs world size 2";
  scenario sc;
  sc.world = 2;
  sc.numel = problem_numel(2);
  comm_factory f(2);
  const outcome two = run_group(sc, f);
  // World size 1 with the gradient a trainer computes with two micro-batches of half
  // the loss each: bf16(g0/2 + g1/2) = bf16(g0 + g1) / 2 exactly (powers of two).
  auto drv = driver_for(0);
  auto comm = make_local_communicator(drv);
  rank_run one(drv, comm, sc.numel, tier::host, {}, 0);
  one.opt->initialize(nullptr);
  const std::size_t P2 = two.params.size();
  for (int t = 0; t < sc.steps; ++t) {
    auto g0 = grad_of(sc.numel, P2, t, 0), g1 = grad_of(sc.numel, P2, t, 1);
    std::vector<std::uint16_t> g(one.lay.padded_numel, 0);
    for (std::size_t i = 0; i < sc.numel; ++i) g[i] = to_bf16(0.5f * from_bf16(to_bf16(from_bf16(g0[i]) + from_bf16(g1[i]))));
    one.step(g);
  }
  auto p1 = one.get(one.params);
  ASSERT_FALSE(two.params.empty());
  EXPECT_TRUE(std::equal(p1.begin(), p1.begin() + sc.numel, two.params.begin()))
      << "world 2 differs from world 1 fed the halved BF16 sum";
}

TEST(distributed, pause_resume_of_registered_buffers_between_steps) {
  const int world = world_under_test();
  for (tier t : {tier::host, tier::device}) {
    scenario sc;
    sc.world = world;
    sc.numel = problem_numel(world);
    sc.home = t;
    comm_factory f(world), f2(world);
    auto plain = run_group(sc, f);
    sc.ev = event_kind::pause_registered;
    auto paused = run_group(sc, f2);
    EXPECT_EQ(plain.params, paused.params) << optim::to_string(t);
    if (!on_cuda()) {
      EXPECT_EQ(f2.g->live_registrations.load(), 0) << "every registration undone";
      EXPECT_EQ(f2.g->registrations.load(), 4 * world) << "registered at construction and after the resume";
    }
  }
}

TEST(distributed, checkpoint_continues_bit_identically_and_refuses_another_world) {
  const int world = world_under_test();
  for (tier t : {tier::host, tier::file}) {
    scenario sc;
    sc.world = world;
    sc.numel = problem_numel(world);
    sc.home = t;
    sc.max_norm = 1.0f;
    comm_factory f(world), f2(world);
    auto straight = run_group(sc, f);
    sc.ev = event_kind::checkpoint;
    auto resumed = run_group(sc, f2);
    EXPECT_EQ(straight.params, resumed.params) << optim::to_string(t);
    EXPECT_EQ(straight.main, resumed.main) << optim::to_string(t);
  }
  if (on_cuda()) return;
  // A world-size-2 checkpoint does not load at world size 1.
  temp_dir ckpt;
  {
    scenario sc;
    sc.numel = problem_numel(2);
    auto g = std::make_shared<group>(2);
    std::vector<std::thread> th;
    for (int r = 0; r < 2; ++r)
      th.emplace_back([&, r] {
        rank_run rr(make_host_driver({64_KiB, 1_GiB}), std::make_shared<thread_comm>(g, r), sc.numel, tier::host, {}, 0);
        rr.opt->initialize(nullptr);
        rr.opt->save_checkpoint(ckpt.path);
      });
    for (auto& x : th) x.join();
    auto drv = make_host_driver({64_KiB, 1_GiB});
    rank_run one(drv, make_local_communicator(drv), sc.numel, tier::host, {}, 0);
    EXPECT_THROW(one.opt->load_checkpoint(ckpt.path, nullptr), corrupt_data);
  }
}

TEST(distributed, bad_input_is_refused) {
  if (on_cuda()) GTEST_SKIP() << "host-driver test";
  auto drv = make_driver();
  auto comm = make_local_communicator(drv);
  dist_config cfg;
  std::uint16_t p[4]{};
  EXPECT_THROW(distributed_adamw(drv, comm, 4, nullptr, p, cfg), invalid_argument);
  EXPECT_THROW(distributed_adamw(drv, nullptr, 4, p, p, cfg), invalid_argument);
  EXPECT_THROW(distributed_adamw(drv, comm, 0, p, p, cfg), invalid_argument);
  cfg.max_grad_norm = -1;
  EXPECT_THROW(distributed_adamw(drv, comm, 4, p, p, cfg), invalid_argument);
  EXPECT_THROW(make_nccl_communicator(drv, unique_id{}, 1, 0), invalid_argument);  // host driver
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (on_cuda()) {
    const int world = std::max(1, test_world());
    try {
      for (int r = 0; r < world; ++r) make_cuda_driver(r);
    } catch (const std::exception& e) {
      std::printf("SKIPPED: needs %d GPU(s): %s\n", world, e.what());
      return 77;
    }
    if (!nccl_available()) {
      try {
        nccl_version();
      } catch (const std::exception& e) {
        std::printf("SKIPPED: needs NCCL: %s\n", e.what());
      }
      return 77;
    }
    std::printf("driver under test: cuda, world %d, NCCL %d\n", world, nccl_version());
  } else {
    std::printf("driver under test: host (ranks are threads)\n");
  }
  return RUN_ALL_TESTS();
}
