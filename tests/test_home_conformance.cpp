// The contract every home keeps (Note [Homes] in optimizer/home.hpp), checked for each
// tier and moment format it supports, on the host driver (so it runs in CI).  The test
// drives a home as the optimizer does: the facade's state writes and checkpoint chunks,
// and a pass of the window pipeline reduced to its home calls (one piece in flight, the
// window's slots being buffers of this test; on the host driver device memory is host
// memory, so the test reads and writes a slot directly).
//
// The contract:
//  1. Traits and capabilities: traits() is traits_of(tier, format); a streamed home is a
//     piece_mover, the others are not; a committed_store is not updated in place.
//  2. A pass's write-back is what reads return: an init pass (main written back from the
//     window) makes main readable, bit for bit, once a committed store commits it.
//  3. Fetch and write-back round-trip: a step pass that fetches every array into the
//     window and writes it back unchanged leaves the state unchanged, bit for bit, in
//     every format; main moves 4 bytes per element, and a moment as many bytes each way.
//  4. Moments a state write did not touch read as zero while no moment was ever stored
//     (PyTorch's initial moments), whatever else the write wrote.
//  5. Checkpoint chunks round-trip: write_chunk into load_slot() (committed by
//     commit_load), then read_chunk, gives the chunk back; host_array, where not null, is
//     that state as plain FP32.
//  6. Speculation: a speculative step pass writes a second copy that reads do not see
//     until it is made current (second_copy::make_current, and a committed store's
//     commit of the step); made current, reads return it.
//  7. An export pass (pass_kind::export_bf16) fetches main, as it is, into the window and
//     writes nothing back: the state is unchanged whatever the window then holds
//     (whatever retire() is called for; a file home's export names the active slot).
//  8. drain() after a pass cut short (window_pipeline::fail: the streams synchronized,
//     then drain; some pieces retired, one written back but not retired, reads ahead
//     started, on the file home a write-back that failed): it waits for what the pass
//     started and never throws; a committed store reads the state of its last commit, a
//     home updated in place holds the new values in the pieces whose write-back was
//     issued and the old ones elsewhere (the pieces a retried step skips); a speculative
//     pass cut short leaves the current copy; and the home then runs a whole pass, whose
//     write-back is what reads return.
// 10. An FP32 parameter is its shard's main (param_is_main; Note [The parameter is the
//     truth]): the home holds no main of such a shard (the device home backs none, its
//     main_param being the parameter; the host home refuses to read or write one), or a
//     durable copy of it (traits().durable_params: file).  An init or export pass leaves
//     the shard out unless durable; a step pass moves its moments only to the device and
//     its moments back, and a durable home takes main from the parameter itself, which
//     reads back as main once committed and after a resume.
//  9. A committed store resumes its last commit: a second home opened on the same
//     directory (optimizer_config::resume) is resumed(), its open() returns the counts
//     of that commit, and it reads that commit's state; a state write ended unpublished
//     (end_write(false)) and a step pass not committed are read neither by the home that
//     made them nor by one opened after it.
// Values of moments are on every format's grid (signed powers of two with a 1 in each
// int8 block), so a round trip through BF16 or int8 is exact and compared bit for bit;
// main is FP32 in every format and takes arbitrary values.
#include <deferalloc/core/chunk_pool.hpp>
#include <deferalloc/core/driver.hpp>
#include <deferalloc/core/reservations.hpp>
#include <deferalloc/optim/optimizer.hpp>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <random>
#include <string>
#include <vector>

#include "../optimizer/home.hpp"
#include "../optimizer/kernels/moment_format.hpp"
#include "../optimizer/store/file_store.hpp"
#include "../optimizer/store/file_util.hpp"

namespace {

using namespace deferalloc;
using namespace deferalloc::optim;

struct home_case {
  tier where;
  moment_format moments;
};

std::string case_name(const testing::TestParamInfo<home_case>& info) {
  return std::string(to_string(info.param.where)) + "_" + to_string(info.param.moments);
}

// Two shards: one of several granules (64 KiB: 16384 elements) and an odd one.
constexpr std::size_t k_numel[] = {3 * 16384 + 100, 5000};

// Element i of shard s's array a: main arbitrary FP32, moments on every format's grid.
float value(std::size_t s, state_array a, std::size_t i, std::uint32_t seed = 0) {
  if (a == state_array::main) {
    std::mt19937 rng(static_cast<std::uint32_t>(s * 1000003 + i) ^ seed);
    return std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
  }
  const int k = static_cast<int>((i % 64 + seed) % 7);  // 2^-k, k = 0 once in each block of 64
  const float m = std::ldexp(1.0f, -k);
  return a == state_array::exp_avg ? ((i / 7) % 2 ? -m : m) : m * m;
}

std::vector<float> values(std::size_t s, state_array a, std::uint32_t seed = 0) {
  std::vector<float> v(k_numel[s]);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = value(s, a, i, seed);
  return v;
}

class HomeConformance : public testing::TestWithParam<home_case> {
 protected:
  void SetUp() override {
    drv_ = make_host_driver({std::size_t{64} << 10, std::size_t{1} << 30});
    pool_ = std::make_shared<chunk_pool>(drv_);
    mgr_ = std::make_unique<reservation_manager>(pool_, drv_);
    cfg_.home = GetParam().where;
    cfg_.moments = GetParam().moments;
    if (cfg_.home == tier::file) {
      char tmpl[] = "/tmp/dfa_home_conformance_XXXXXX";
      ASSERT_NE(::mkdtemp(tmpl), nullptr);
      dir_ = tmpl;
      cfg_.directory = dir_;
    }
    exec_ = drv_->create_stream();
    home_ = make_home(cfg_.home, {*drv_, *drv_, *mgr_, shards_, cfg_, exec_});
    for (std::size_t n : k_numel) {
      shard s;
      s.info.numel = n;
      s.info.name = "shard" + std::to_string(shards_.size());
      for (state_array a : k_state_arrays) s.res[a] = mgr_->reserve(n * 4);
      s.info.main_param = static_cast<float*>(mgr_->address(s.res[state_array::main]));
      if (fp32_param_ && shards_.size() == 1) {  // shard 1's FP32 parameter is its main (contract 10)
        param_.assign(n, 0.0f);
        s.info.param = param_.data();
        s.info.param_type = value_type::fp32;
        s.info.main_param = param_.data();
      }
      s.info.exp_avg = static_cast<float*>(mgr_->address(s.res[state_array::exp_avg]));
      s.info.exp_avg_sq = static_cast<float*>(mgr_->address(s.res[state_array::exp_avg_sq]));
      home_->add_shard(s);
      shards_.add(std::move(s));
    }
    if (committed_store* store = home_->store()) EXPECT_FALSE(store->open().has_value());  // a fresh state file
    // The window: one slot of the largest piece per array.
    for (state_array a : k_state_arrays) {
      slot_res_[a] = mgr_->reserve(k_numel[0] * 4);
      mgr_->materialize(slot_res_[a], 0, whole, fill_mode::zero, nullptr);
      slot_[a] = static_cast<float*>(mgr_->address(slot_res_[a]));
    }
  }

  void TearDown() override {
    home_.reset();
    mgr_.reset();
    if (exec_) drv_->destroy_stream(exec_);
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  bool streamed() const { return home_->traits().streamed; }
  state_counts counts(std::uint64_t step, bool moments) const { return {step, moments, shards_.steps()}; }

  // The optimizer's initialize(): main from the model (here: value(main)), moments never
  // stored.  Streamed homes take it through an init pass, the device home in HBM.
  void initialize() {
    if (!streamed()) {
      for (std::size_t s = 0; s < shards_.size(); ++s) home_->write(s, state_array::main, 0, k_numel[s], values(s, state_array::main).data());
      return;
    }
    run_pass(pass_kind::init, false, false, [&](const piece_ref& p) {
      for (std::size_t i = 0; i < p.n; ++i) slot_[state_array::main][i] = value(p.shard, state_array::main, p.e0 + i);
    });
    if (committed_store* store = home_->store()) store->commit(pass_kind::init, counts(0, false));
  }

  // Writes every array of every shard as write_state_range does (a state write on a
  // committed store, published); `seed` picks the values.
  void write_all(std::uint32_t seed) {
    committed_store* store = home_->store();
    if (store) store->begin_write();
    for (std::size_t s = 0; s < shards_.size(); ++s)
      for (state_array a : k_state_arrays) home_->write(s, a, 0, k_numel[s], values(s, a, seed).data());
    if (store) store->end_write(true, counts(0, true));
  }

  void expect_state(std::size_t s, state_array a, const std::vector<float>& want, const char* what) {
    std::vector<float> got(want.size(), -1.0f);
    home_->read(s, a, 0, want.size(), got.data());
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0)
        << what << ": " << array_name(a) << " of shard " << s << " differs (element 0: " << got[0] << " vs " << want[0]
        << ")";
  }
  void expect_all(std::uint32_t seed, const char* what) {
    for (std::size_t s = 0; s < shards_.size(); ++s)
      for (state_array a : k_state_arrays) expect_state(s, a, values(s, a, seed), what);
  }

  // The pieces of a pass: shards cut on the home's alignment (whole shards where it is
  // coarser), as the optimizer cuts them.
  std::vector<piece_ref> pieces(pass_kind kind = pass_kind::step) const {
    const std::size_t align = std::max<std::size_t>(home_->traits().piece_align / 4, 16384);
    std::vector<piece_ref> out;
    for (std::size_t s = 0; s < shards_.size(); ++s)
      if (kind == pass_kind::step || home_->traits().durable_params || !param_is_main(shards_[s].info))
        for (std::size_t e0 = 0; e0 < k_numel[s]; e0 += align) out.push_back({s, e0, std::min(align, k_numel[s] - e0)});
    return out;
  }

  // One pass through the home's piece_mover with one piece in flight: fetch (main unless
  // init, the moments in a step when stored, else zeros), then `on_device(piece)`, then
  // write-back of the arrays the pass moves and retire.  Checks the bytes moved.
  // With `cut`, the pass stops short as window_pipeline::fail stops a failed one: pieces
  // before `cut` are retired, piece `cut` is written back but not retired, the read
  // ahead of the piece after it is started; then the streams are synchronized and the
  // mover drained.  Returns why the pass stopped (empty: it completed).
  static constexpr std::size_t k_complete = ~std::size_t{0};
  struct cut_short : std::runtime_error {
    cut_short() : std::runtime_error("cut short") {}
  };
  template <typename F>
  std::string run_pass(pass_kind kind, bool moments_stored, bool speculative, F&& on_device,
                       std::size_t cut = k_complete) {
    piece_mover* mover = home_->mover();
    EXPECT_NE(mover, nullptr);
    if (!mover) return "no piece_mover";
    pass_plan plan;
    plan.kind = kind;
    plan.pieces = pieces(kind);
    plan.durable_params = home_->traits().durable_params;
    plan.arrays = kind == pass_kind::step ? 3 : 1;
    plan.fetch_main = kind != pass_kind::init;
    plan.write_back = kind != pass_kind::export_bf16;
    plan.speculative = speculative;
    plan.moments_stored = moments_stored;
    plan.depth = 1;
    for (const auto& p : plan.pieces) plan.window_piece = std::max(plan.window_piece, p.n);
    step_report report;
    mover->begin_pass(plan, report);
    if (cut == k_complete) {
      pass_pieces(plan, *mover, cut, on_device);
      mover->end_pass();
      return {};
    }
    std::string why;
    try {
      pass_pieces(plan, *mover, cut, on_device);
      ADD_FAILURE() << "the pass was not cut short";
    } catch (const std::exception& e) {
      why = e.what();
    }
    drv_->synchronize_stream(exec_);
    mover->drain();
    return why;
  }

  // run_pass's pieces, up to `cut` (throws cut_short there).
  template <typename F>
  void pass_pieces(const pass_plan& plan, piece_mover& mover, std::size_t cut, F& on_device) {
    for (std::size_t i = 0; i < plan.pieces.size(); ++i) {
      const piece_ref& p = plan.pieces[i];
      mover.prefetch(i, p);
      if (i == cut && i + 1 < plan.pieces.size()) mover.prefetch(i + 1, plan.pieces[i + 1]);
      per_array<std::size_t> in{};
      // A step reads and writes an FP32 parameter in place: its main is not fetched.
      const bool param = plan.kind == pass_kind::step && param_is_main(shards_[p.shard].info);
      if (plan.fetch_main && !param)
        in[state_array::main] = mover.to_device(i, p, state_array::main, slot_[state_array::main], exec_);
      if (plan.kind == pass_kind::step)
        for (state_array a : {state_array::exp_avg, state_array::exp_avg_sq}) {
          if (plan.moments_stored) in[a] = mover.to_device(i, p, a, slot_[a], exec_);
          else std::memset(slot_[a], 0, p.n * 4);
        }
      drv_->synchronize_stream(exec_);
      on_device(p);
      if (plan.write_back)
        for (state_array a : first_arrays(plan.arrays)) {
          float* from = slot_[a];
          if (a == state_array::main && param) {
            if (!plan.durable_params) continue;
            from = param_.data() + p.e0;  // the durable copy comes from the parameter
          }
          const std::size_t out = mover.from_device(i, p, a, from, exec_);
          if (a == state_array::main) EXPECT_EQ(out, p.n * 4) << "main moves 4 bytes per element";
          if (in[a] != 0) EXPECT_EQ(out, in[a]) << array_name(a) << " moves as many bytes each way";
          EXPECT_GT(out, 0u);
        }
      if (i == cut) throw cut_short();
      drv_->synchronize_stream(exec_);
      mover.retire(i, p);
    }
  }

  // Fills piece p's slots with seed `seed`'s values, moments in the window's layout
  // (Note [Moment formats]): what a step computed.
  void fill_window(const piece_ref& p, std::uint32_t seed) {
    for (state_array a : k_state_arrays) {
      std::vector<float> v(p.n);
      for (std::size_t i = 0; i < p.n; ++i) v[i] = value(p.shard, a, p.e0 + i, seed);
      if (is_moment(a) && cfg_.moments != moment_format::fp32)
        optim::detail::encode_moments(cfg_.moments, a, slot_[a], p.n, 0, p.n, v.data());
      else
        std::memcpy(slot_[a], v.data(), p.n * 4);
    }
  }

  // A second home on the same directory, as a new process opens it (the first one gone:
  // the state file has one owner); returns its open().
  std::optional<state_counts> reopen() {
    home_.reset();
    cfg_.resume = true;
    home_ = make_home(cfg_.home, {*drv_, *drv_, *mgr_, shards_, cfg_, exec_});
    for (std::size_t s = 0; s < shards_.size(); ++s) home_->add_shard(shards_[s]);
    return home_->store()->open();
  }

  bool fp32_param_ = false;   // shard 1's parameter is FP32 (contract 10)
  std::vector<float> param_;  // its values
  std::shared_ptr<driver> drv_;
  std::shared_ptr<chunk_pool> pool_;
  std::unique_ptr<reservation_manager> mgr_;
  optimizer_config cfg_;
  std::string dir_;
  stream_t exec_ = nullptr;
  shard_table shards_;
  std::unique_ptr<home> home_;
  per_array<reservation_id> slot_res_{};
  per_array<float*> slot_{};
};

TEST_P(HomeConformance, TraitsAndCapabilities) {
  const home_traits want = traits_of(GetParam().where, GetParam().moments), got = home_->traits();
  EXPECT_EQ(got.streamed, want.streamed);
  EXPECT_EQ(got.piece_align, want.piece_align);
  EXPECT_EQ(got.default_depth, want.default_depth);
  EXPECT_EQ(got.whole_arrays, want.whole_arrays);
  EXPECT_EQ(home_->mover() != nullptr, got.streamed) << "a streamed home moves pieces, the others do not";
  if (home_->store()) EXPECT_TRUE(got.streamed) << "a committed store streams its state";
  if (home_->speculation()) EXPECT_TRUE(got.streamed) << "a second copy is stepped by a pass";
}

TEST_P(HomeConformance, WriteBackIsWhatReadsReturn) {
  initialize();
  for (std::size_t s = 0; s < shards_.size(); ++s) expect_state(s, state_array::main, values(s, state_array::main), "init");
}

TEST_P(HomeConformance, FetchAndWriteBackRoundTrip) {
  if (!streamed()) GTEST_SKIP() << "the device home does not stream";
  initialize();
  write_all(1);
  expect_all(1, "state write");
  run_pass(pass_kind::step, true, false, [](const piece_ref&) {});  // unchanged in the window
  if (committed_store* store = home_->store()) store->commit(pass_kind::step, counts(1, true));
  expect_all(1, "fetch and write-back");
}

TEST_P(HomeConformance, UnwrittenMomentsReadZero) {
  initialize();
  committed_store* store = home_->store();
  if (store) store->begin_write();
  const auto m = values(0, state_array::exp_avg);
  home_->write(0, state_array::exp_avg, 0, k_numel[0], m.data());
  if (store) store->end_write(true, counts(0, true));
  expect_state(0, state_array::exp_avg, m, "written moment");
  expect_state(0, state_array::main, values(0, state_array::main), "main not written");
  for (std::size_t s = 0; s < shards_.size(); ++s)
    for (state_array a : {state_array::exp_avg, state_array::exp_avg_sq})
      if (s != 0 || a != state_array::exp_avg) expect_state(s, a, std::vector<float>(k_numel[s], 0.0f), "moment not written");
}

TEST_P(HomeConformance, CheckpointChunksRoundTrip) {
  initialize();
  committed_store* store = home_->store();
  const int slot = store ? store->load_slot() : 0;
  for (std::size_t s = 0; s < shards_.size(); ++s)
    for (state_array a : k_state_arrays) {
      const auto v = values(s, a, 2);
      optim::detail::aligned_buffer buf(optim::detail::file_store::io_bytes(k_numel[s]), true, "test");
      std::memcpy(buf.p, v.data(), v.size() * 4);
      home_->write_chunk(s, a, 0, k_numel[s], buf.p, slot);
    }
  if (store) store->commit_load(slot, counts(5, true));
  for (std::size_t s = 0; s < shards_.size(); ++s)
    for (state_array a : k_state_arrays) {
      const auto v = values(s, a, 2);
      optim::detail::aligned_buffer buf(optim::detail::file_store::io_bytes(k_numel[s]), true, "test");
      home_->read_chunk(s, a, 0, k_numel[s], buf.p);
      EXPECT_EQ(std::memcmp(buf.p, v.data(), v.size() * 4), 0) << array_name(a) << " of shard " << s;
      if (const float* h = home_->host_array(s, a)) EXPECT_EQ(std::memcmp(h, v.data(), v.size() * 4), 0);
    }
}

TEST_P(HomeConformance, SpeculativeCopyIsCurrentOnlyOnceMadeSo) {
  second_copy* copies = home_->speculation();
  if (!copies) GTEST_SKIP() << "this home keeps one copy";
  initialize();
  write_all(1);
  for (std::size_t s = 0; s < shards_.size(); ++s) copies->prepare(s);
  // The speculative step writes seed 3's values; the current copy still reads seed 1's.
  run_pass(pass_kind::step, true, true, [&](const piece_ref& p) { fill_window(p, 3); });
  expect_all(1, "before the speculation is made current");
  for (std::size_t s = 0; s < shards_.size(); ++s) copies->make_current(s);
  if (committed_store* store = home_->store()) store->commit(pass_kind::step, counts(1, true));
  expect_all(3, "after the speculation is made current");
}

TEST_P(HomeConformance, ExportPassWritesNothingBack) {
  if (!streamed()) GTEST_SKIP() << "the device home exports from HBM, without a pass";
  initialize();
  write_all(1);
  std::size_t seen = 0;
  run_pass(pass_kind::export_bf16, true, false, [&](const piece_ref& p) {
    // Main as it is at home (the model's params are downcast from it) ...
    for (std::size_t i = 0; i < p.n; ++i)
      if (slot_[state_array::main][i] != value(p.shard, state_array::main, p.e0 + i, 1)) {
        ADD_FAILURE() << "export: main of " << shards_.where(p) << " differs in the window at element " << p.e0 + i;
        break;
      }
    seen += p.n;
    fill_window(p, 4);  // ... and what the window holds afterwards is not the state
  });
  std::size_t total = 0;
  for (std::size_t n : k_numel) total += n;
  EXPECT_EQ(seen, total);
  expect_all(1, "after an export pass");
}

TEST_P(HomeConformance, DrainAfterAPassCutShort) {
  if (!streamed()) GTEST_SKIP() << "the device home moves no pieces";
  initialize();
  write_all(1);
  committed_store* store = home_->store();
  // The file home's first write-back of the pass fails; drain() meets the failed batch.
  if (store) store->file().inject(optim::detail::file_store::fault_op::write, optim::detail::file_store::fault_kind::eio, 1);
  // Pieces before `cut` retired, piece `cut` written back (coarse formats cut fewer pieces).
  const auto ps = pieces();
  ASSERT_GE(ps.size(), 2u);
  const std::size_t cut = std::min<std::size_t>(2, ps.size() - 1);
  const std::string why = run_pass(pass_kind::step, true, false, [&](const piece_ref& p) { fill_window(p, 3); }, cut);
  if (store) {
    // With one piece in flight the staging ring is two deep: piece 2's write-back waits
    // for piece 0's write, and the pass stops there on its error.
    if (cut == 2) EXPECT_NE(why.find("write"), std::string::npos) << "the pass stopped for another reason: " << why;
    expect_all(1, "a committed store after a pass cut short");
  } else {
    // In place: the pieces whose write-back was issued hold the step's values.
    for (std::size_t s = 0; s < shards_.size(); ++s)
      for (state_array a : k_state_arrays) {
        auto want = values(s, a, 1);
        for (std::size_t j = 0; j <= cut; ++j)
          if (ps[j].shard == s)
            for (std::size_t i = ps[j].e0; i < ps[j].e0 + ps[j].n; ++i) want[i] = value(s, a, i, 3);
        expect_state(s, a, want, "in place after a pass cut short");
      }
  }
  // The home is usable: a whole pass's write-back is what reads return.
  EXPECT_EQ(run_pass(pass_kind::step, true, false, [&](const piece_ref& p) { fill_window(p, 4); }), "");
  if (store) store->commit(pass_kind::step, counts(1, true));
  expect_all(4, "the pass after a drain");
  // A speculative pass cut short leaves the current copy.
  if (second_copy* copies = home_->speculation()) {
    for (std::size_t s = 0; s < shards_.size(); ++s) copies->prepare(s);
    run_pass(pass_kind::step, true, true, [&](const piece_ref& p) { fill_window(p, 5); }, cut);
    expect_all(4, "the current copy after a speculative pass cut short");
  }
}

TEST_P(HomeConformance, ResumeReadsTheLastCommit) {
  if (!home_->store()) GTEST_SKIP() << "this home keeps its state in the process (nothing to resume)";
  EXPECT_FALSE(home_->store()->resumed()) << "a fresh state file";
  initialize();
  write_all(1);
  run_pass(pass_kind::step, true, false, [&](const piece_ref& p) { fill_window(p, 3); });
  const state_counts committed{1, true, {7, 9}};
  home_->store()->commit(pass_kind::step, committed);
  const auto resumed = reopen();
  ASSERT_TRUE(resumed.has_value()) << "a state file with a commit resumes";
  EXPECT_TRUE(home_->store()->resumed());
  EXPECT_EQ(resumed->step, committed.step);
  EXPECT_EQ(resumed->moments_written, committed.moments_written);
  EXPECT_EQ(resumed->shard_steps, committed.shard_steps);
  expect_all(3, "resumed");
}

TEST_P(HomeConformance, UncommittedChangesAreNotResumed) {
  committed_store* store = home_->store();
  if (!store) GTEST_SKIP() << "this home keeps its state in the process (nothing to resume)";
  initialize();
  write_all(1);  // published: the last commit
  store->begin_write();
  for (std::size_t s = 0; s < shards_.size(); ++s)
    for (state_array a : k_state_arrays) home_->write(s, a, 0, k_numel[s], values(s, a, 5).data());
  store->end_write(false, counts(2, true));
  expect_all(1, "after a state write not published");
  run_pass(pass_kind::step, true, false, [&](const piece_ref& p) { fill_window(p, 6); });  // never committed
  expect_all(1, "after a step pass not committed");
  const auto resumed = reopen();
  ASSERT_TRUE(resumed.has_value());
  EXPECT_EQ(resumed->step, 0u) << "the last commit's step count";
  expect_all(1, "resumed after changes not committed");
}

// Contract 10: shard 1's parameter is FP32.
class HomeConformanceFp32Param : public HomeConformance {
 protected:
  void SetUp() override {
    fp32_param_ = true;
    HomeConformance::SetUp();
  }
  void set_param(std::uint32_t seed) { param_ = values(1, state_array::main, seed); }
};

TEST_P(HomeConformanceFp32Param, AnFp32ParameterIsItsShardsMain) {
  const bool durable = GetParam().where == tier::file;
  EXPECT_EQ(home_->traits().durable_params, durable) << "the file tier keeps a durable copy of FP32 parameters";
  float probe[4];
  if (GetParam().where == tier::host) {
    EXPECT_EQ(home_->host_array(1, state_array::main), nullptr);
    EXPECT_THROW(home_->read(1, state_array::main, 0, 4, probe), invalid_state) << "no main of an FP32 parameter at home";
    EXPECT_THROW(home_->write(1, state_array::main, 0, 4, probe), invalid_state);
  }
  if (GetParam().where == tier::device) {
    const reservation_info main = mgr_->info(shards_[1].res[state_array::main]);
    EXPECT_EQ(main.backed_bytes, 0u) << "no HBM for the main of an FP32 parameter";
    EXPECT_GT(mgr_->info(shards_[1].res[state_array::exp_avg]).backed_bytes, 0u);
    set_param(2);
    expect_state(1, state_array::main, values(1, state_array::main, 2), "the device home's main is the parameter");
    return;
  }
  // Init: the durable home copies the parameter, the others leave the shard out.
  set_param(0);
  std::size_t seen = 0;
  run_pass(pass_kind::init, false, false, [&](const piece_ref& p) {
    if (p.shard == 1) ASSERT_TRUE(durable) << "an init pass moves an FP32 parameter only into a durable copy";
    for (std::size_t i = 0; i < p.n; ++i) slot_[state_array::main][i] = value(p.shard, state_array::main, p.e0 + i);
    seen += p.n;
  });
  EXPECT_EQ(seen, k_numel[0] + (durable ? k_numel[1] : 0));
  committed_store* store = home_->store();
  if (store) store->commit(pass_kind::init, counts(0, false));
  if (durable) expect_state(1, state_array::main, values(1, state_array::main), "the durable copy after init");
  // A step: the moments move both ways; main is the parameter (durable: its copy comes back).
  if (store) store->begin_write();
  for (std::size_t s = 0; s < shards_.size(); ++s)
    for (state_array a : k_state_arrays)
      if (s == 0 || is_moment(a)) home_->write(s, a, 0, k_numel[s], values(s, a, 1).data());
  if (store) store->end_write(true, counts(0, true));
  run_pass(pass_kind::step, true, false, [&](const piece_ref& p) {
    fill_window(p, 3);
    if (p.shard == 1)  // what the kernel wrote into the parameter
      for (std::size_t i = 0; i < p.n; ++i) param_[p.e0 + i] = value(1, state_array::main, p.e0 + i, 3);
  });
  if (store) store->commit(pass_kind::step, counts(1, true));
  for (state_array a : k_state_arrays) {
    expect_state(0, a, values(0, a, 3), "the BF16 shard after a step");
    if (is_moment(a) || durable) expect_state(1, a, values(1, a, 3), "the FP32 parameter's shard after a step");
  }
  if (!store) return;
  // The durable copy is what a resume reads.
  set_param(9);
  ASSERT_TRUE(reopen().has_value());
  for (state_array a : k_state_arrays) expect_state(1, a, values(1, a, 3), "resumed");
}

INSTANTIATE_TEST_SUITE_P(EveryHome, HomeConformanceFp32Param,
                         testing::Values(home_case{tier::device, moment_format::fp32},
                                         home_case{tier::host, moment_format::fp32},
                                         home_case{tier::host, moment_format::int8},
                                         home_case{tier::file, moment_format::fp32},
                                         home_case{tier::file, moment_format::bf16}),
                         case_name);

INSTANTIATE_TEST_SUITE_P(EveryHome, HomeConformance,
                         testing::Values(home_case{tier::device, moment_format::fp32},
                                         home_case{tier::host, moment_format::fp32},
                                         home_case{tier::host, moment_format::bf16},
                                         home_case{tier::host, moment_format::int8},
                                         home_case{tier::file, moment_format::fp32},
                                         home_case{tier::file, moment_format::bf16},
                                         home_case{tier::file, moment_format::int8}),
                         case_name);

}  // namespace
