// Durable optimizer state, on the host driver: a run killed at random moments
// (inside checkpoint saves too) always leaves a loadable newest checkpoint and resumes
// bit-identically; damaged state files and checkpoints are refused or resume from an
// intact committed step, never silently to other state or to step 0; bad input (null
// pointers, foreign-owned files, symlinks) is refused with a named error before
// anything changes.
#include <deferalloc/optim/optimizer.hpp>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "../optimizer/store/file_store.hpp"
#include "durability_model.hpp"

using namespace deferalloc;
using namespace deferalloc::optim;
using namespace dfa_test;
using namespace dfa_test::durability;
namespace fs = std::filesystem;

namespace {

constexpr std::uint64_t k_steps = 12;

std::string child_program() {
  const char* p = std::getenv("DFA_DURABILITY_CHILD");
  return p ? p : "";
}

pid_t spawn_child(const std::string& state_dir, const std::string& ck_dir, const std::string& out, int delay_ms) {
  const std::string prog = child_program(), steps = std::to_string(k_steps), delay = std::to_string(delay_ms);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setenv("DEFERALLOC_TEST_PUBLISH_DELAY_MS", delay.c_str(), 1);
    ::execl(prog.c_str(), prog.c_str(), state_dir.c_str(), ck_dir.c_str(), steps.c_str(), "3", out.c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

}  // namespace

// Kill -9 at random moments, at least 50 times; after every kill the newest complete
// checkpoint loads and continues bit-identically, the state file holds exactly a
// committed step of the uninterrupted run, and the run finally completes bit-identically.
TEST(durability, killed_at_random_moments_resumes_bit_identically) {
  ASSERT_FALSE(child_program().empty()) << "DFA_DURABILITY_CHILD is not set";
  const auto& ref = reference<k_steps>();
  temp_dir root;
  const std::string state_dir = root.path + "/state", ck = root.path + "/ck", out = root.path + "/final.bin";
  // How long an uninterrupted run takes, to aim the kills over all of it.
  auto t0 = std::chrono::steady_clock::now();
  {
    const pid_t pid = spawn_child(state_dir, ck, out, 5);
    int st = 0;
    ASSERT_EQ(::waitpid(pid, &st, 0), pid);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "uninterrupted child run failed";
  }
  const auto full_us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  state fin;
  ASSERT_TRUE(read_state(out, fin));
  ASSERT_TRUE(fin == ref[k_steps]) << "the uninterrupted child run differs from the in-process reference";
  fs::remove_all(state_dir), fs::remove_all(ck), fs::remove(out);

  std::mt19937_64 rng(20261201);
  int kills = 0, inside_save = 0, runs_completed = 0, checkpoints_loaded = 0;
  for (int attempt = 0; kills < 60 && attempt < 400; ++attempt) {
    const int delay_ms = static_cast<int>(rng() % 25);
    const pid_t pid = spawn_child(state_dir, ck, out, delay_ms);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % static_cast<std::uint64_t>(full_us + 1)));
    ::kill(pid, SIGKILL);
    int st = 0;
    ASSERT_EQ(::waitpid(pid, &st, 0), pid);
    if (WIFEXITED(st)) {
      ASSERT_EQ(WEXITSTATUS(st), 0) << "the child failed on its own (attempt " << attempt << ")";
      ASSERT_TRUE(read_state(out, fin));
      ASSERT_TRUE(fin == ref[k_steps]) << "a resumed run finished with other state (attempt " << attempt << ")";
      ++runs_completed;
      fs::remove_all(state_dir), fs::remove_all(ck), fs::remove(out);
      continue;
    }
    ASSERT_TRUE(WIFSIGNALED(st));
    ++kills;
    for (const auto& e : fs::directory_iterator(fs::exists(ck) ? ck : root.path))
      if (e.path().extension() == ".tmp") ++inside_save;
    // The newest complete checkpoint loads, equals the reference at its step and
    // continues bit-identically.
    if (fs::exists(ck)) {
      bool any = false;
      for (const auto& e : fs::directory_iterator(ck)) any = any || e.path().extension() != ".tmp";
      if (any) {
        model m(host(), config(tier::host, {}, false));
        ASSERT_NO_THROW(m.opt->load_checkpoint(ck)) << "kill " << kills << ": the newest checkpoint does not load";
        const std::uint64_t at = m.opt->steps();
        ASSERT_TRUE(at > 0 && at <= k_steps && at % 3 == 0) << "checkpoint at step " << at;
        ASSERT_TRUE(m.snapshot() == ref[at]) << "kill " << kills << ": checkpoint of step " << at << " differs";
        for (std::uint64_t t = at; t < k_steps; ++t) m.step(t);
        ASSERT_TRUE(m.snapshot() == ref[k_steps]) << "kill " << kills << ": continuing the checkpoint of step " << at;
        ++checkpoints_loaded;
      }
    }
    // The state file, if published, holds exactly a committed step of the reference.
    if (fs::exists(state_dir + "/deferalloc-rank0.state")) {
      model m(host(), config(tier::file, state_dir, true));
      ASSERT_TRUE(m.opt->resumed()) << "kill " << kills << ": a published state file did not resume";
      m.opt->sync_model_params();
      const std::uint64_t at = m.opt->steps();
      ASSERT_LE(at, k_steps);
      ASSERT_TRUE(m.snapshot() == ref[at]) << "kill " << kills << ": file tier resumed step " << at << " differs";
    }
  }
  // Finally let it finish: every resume along the way was exact.
  const pid_t pid = spawn_child(state_dir, ck, out, 0);
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  ASSERT_TRUE(read_state(out, fin));
  EXPECT_TRUE(fin == ref[k_steps]) << "the run resumed across the kills differs from the uninterrupted one";
  std::printf("%d kills (%d inside a checkpoint save), %d checkpoints loaded and continued, %d runs completed\n", kills,
              inside_save, checkpoints_loaded, runs_completed);
  EXPECT_GE(kills, 50);
  EXPECT_GE(inside_save, 5) << "too few kills landed inside a checkpoint save";
}

namespace {

int run_child(const std::vector<std::string>& args, pid_t* started = nullptr) {
  const std::string prog = child_program();
  std::vector<char*> argv{const_cast<char*>(prog.c_str())};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execv(prog.c_str(), argv.data());
    ::_exit(127);
  }
  if (started) {
    *started = pid;
    return 0;
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
}

}  // namespace

// Kills (SIGKILL at random moments, and an exit at each write request and at the commit)
// while a file-tier optimizer loads new state: a checkpoint (load_checkpoint) or a state
// dict (one state write: write_state_range per array and set_shard_step per shard, as
// load_state_dict does; and the same without begin/end_state_write, published by the
// destructor).  Every resume is the old state or the new one, bit for bit,
// per-shard step counts included (the model's shards have different counts).
TEST(durability, killed_during_state_loads_resumes_old_or_new) {
  ASSERT_FALSE(child_program().empty()) << "DFA_DURABILITY_CHILD is not set";
  const auto& ref = reference<k_steps>();
  constexpr std::uint64_t k_old = 5, k_new = 9;
  temp_dir root;
  const std::string dir = root.path + "/state", ck = root.path + "/ck", sd = root.path + "/new.bin";
  const std::string path = dir + "/deferalloc-rank0.state";
  {
    model m(host(), config(tier::file, dir, false));
    m.opt->initialize();
    for (std::uint64_t t = 0; t < k_old; ++t) m.step(t);
    ASSERT_TRUE(m.snapshot() == ref[k_old]);
  }
  const std::vector<char> old_file = slurp(path);
  {
    model m(host(), config(tier::host, {}, false));
    m.opt->initialize();
    for (std::uint64_t t = 0; t < k_new; ++t) m.step(t);
    ASSERT_TRUE(m.snapshot() == ref[k_new]);
    ASSERT_NE(m.opt->shard_step(0), m.opt->shard_step(2)) << "the model's shards should have different step counts";
    m.opt->save_checkpoint(ck);
    ASSERT_TRUE(write_state(sd, ref[k_new]));
  }
  int kills = 0, crashes = 0, old_seen = 0, new_seen = 0, completed = 0;
  // Resumes the state file after a child: the old or the new state, exactly.
  auto check = [&](const std::string& what) {
    model m(host(), config(tier::file, dir, true));
    ASSERT_TRUE(m.opt->resumed()) << what;
    m.opt->sync_model_params();
    const state got = m.snapshot();
    // (A state dict carries the shards' step counts, not steps(): compared in the snapshot.)
    const bool is_old = got == ref[k_old], is_new = got == ref[k_new];
    ASSERT_TRUE(is_old || is_new) << what << ": resumed neither the old nor the new state (step " << m.opt->steps() << ")";
    (is_old ? old_seen : new_seen)++;
  };
  auto reset = [&] {
    fs::remove(path + ".new");
    spit(path, old_file);
  };
  // An exit at each write request, then at the commit (past the last write: the load completes).
  for (const std::string kind : {"ck", "sd", "sdi"})
    for (int n = 0; n <= 24; ++n) {
      reset();
      const int rc = run_child({"load", dir, kind == "ck" ? ck : sd, kind, std::to_string(n)});
      ASSERT_TRUE(rc == 86 || rc == 0) << kind << " crash at " << n << ": child exit " << rc;
      (rc == 86 ? crashes : completed)++;
      check(kind + " crash at write " + std::to_string(n));
      if (HasFatalFailure()) return;
    }
  // SIGKILL at random moments over an uninterrupted load's time.
  std::mt19937_64 rng(31);
  for (const std::string kind : {"ck", "sd", "sdi"}) {
    reset();
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_EQ(run_child({"load", dir, kind == "ck" ? ck : sd, kind}), 0) << kind << ": the uninterrupted load failed";
    const auto full_us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
    check(kind + " uninterrupted");
    for (int k = 0; k < 15; ++k) {
      reset();
      pid_t pid = 0;
      run_child({"load", dir, kind == "ck" ? ck : sd, kind}, &pid);
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % static_cast<std::uint64_t>(full_us + 1)));
      ::kill(pid, SIGKILL);
      int st = 0;
      ASSERT_EQ(::waitpid(pid, &st, 0), pid);
      if (WIFSIGNALED(st)) ++kills;
      else ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << kind << ": the child failed on its own";
      check(kind + " killed at random");
      if (HasFatalFailure()) return;
    }
  }
  std::printf("state loads into the file tier: %d exits at a write or commit, %d SIGKILLs, %d loads completed; resumed "
              "%d old, %d new\n", crashes, kills, completed, old_seen, new_seen);
  EXPECT_GE(crashes + kills, 30);
  EXPECT_GT(old_seen, 0);
  EXPECT_GT(new_seen, 0);
}

namespace {

// Opens a copy of a state file and classifies it: refused with corrupt_data, or resumed
// at a committed step whose state (and next step) equal the reference.  Anything else
// (a fresh start, other state, another error type) fails the test.
enum class outcome { refused, resumed_intact };
outcome resume_damaged(const std::string& dir, const std::string& what, std::uint64_t* step_out = nullptr) {
  const auto& ref = reference<k_steps>();
  try {
    model m(host(), config(tier::file, dir, true));
    if (!m.opt->resumed()) {
      ADD_FAILURE() << what << ": a damaged state file was treated as no state (fresh start)";
      return outcome::refused;
    }
    m.opt->sync_model_params();
    const std::uint64_t at = m.opt->steps();
    if (step_out) *step_out = at;
    EXPECT_TRUE(at >= 5 && at <= 6) << what << ": resumed at step " << at;
    EXPECT_TRUE(m.snapshot() == ref[at]) << what << ": resumed to other state at step " << at;
    m.step(at);
    EXPECT_TRUE(m.snapshot() == ref[at + 1]) << what << ": the step after the resume differs";
    return outcome::resumed_intact;
  } catch (const corrupt_data& e) {
    return outcome::refused;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": refused with the wrong error type: " << e.what();
    return outcome::refused;
  }
}

// The layout of durability_model's state file (Note [File tier], Note [Packed arrays]):
// arrays under a block packed (8-byte aligned) at the slot's start, the others after
// them on blocks of their own.
struct file_layout {
  std::uint64_t slot_bytes = 0;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> arrays;  // slot-relative [begin, end) of stored bytes
  file_layout() {
    using fs_t = optim::detail::file_store;
    auto blocks = [](std::uint64_t b) { return (b + fs_t::block - 1) / fs_t::block * fs_t::block; };
    std::uint64_t packed = 0;
    for (std::size_t n : shard_sizes())
      for (int a = 0; a < 3 && n * 4 < fs_t::block; ++a) {
        packed = (packed + 7) / 8 * 8;
        arrays.push_back({packed, packed + n * 4});
        packed += n * 4;
      }
    slot_bytes = blocks(packed);
    for (std::size_t n : shard_sizes())
      for (int a = 0; a < 3 && n * 4 >= fs_t::block; ++a) {
        arrays.push_back({slot_bytes, slot_bytes + fs_t::io_bytes(n)});
        slot_bytes += blocks(n * 4);
      }
  }
};

std::string make_state(const std::string& dir, std::uint64_t steps) {
  model m(host(), config(tier::file, dir, false));
  m.opt->initialize();
  for (std::uint64_t t = 0; t < steps; ++t) m.step(t);
  return dir + "/deferalloc-rank0.state";
}

}  // namespace

// Every flipped byte (headers, both slots, tables, the tail) resumes from an intact
// committed step or is refused with corrupt_data; in the active slot's data it is
// always refused; truncations are always refused.
TEST(durability, damaged_state_file_is_refused_or_resumes_an_intact_step) {
  temp_dir base;
  const std::string path = make_state(base.path + "/orig", 6);
  const std::vector<char> orig = slurp(path);
  const file_layout lay;
  const std::uint64_t data0 = 8192, active = data0;  // step 6 is in slot 0 (init: slot 0, then alternating)
  // Headers, slots, a checksum table per slot, a page of step counts per header copy.
  ASSERT_EQ(orig.size(), data0 + 2 * lay.slot_bytes + 2 * ((lay.slot_bytes / optim::detail::file_store::block * 8 + 4095) / 4096 * 4096) + 2 * 4096);
  std::mt19937_64 rng(7);
  struct probe {
    std::uint64_t off;
    bool must_refuse;
    const char* region;
  };
  std::vector<probe> probes;
  for (std::uint64_t c = 0; c < 2; ++c)
    for (std::uint64_t b : {0, 3, 8, 12, 16, 24, 28, 33, 40, 48, 56, 63, 64, 200, 4095}) probes.push_back({c * 4096 + b, false, "header"});
  for (int i = 0; i < 40; ++i) {
    const auto& [b, e] = lay.arrays[rng() % lay.arrays.size()];
    probes.push_back({active + b + rng() % (e - b), true, "active slot data"});
  }
  for (int i = 0; i < 20; ++i) probes.push_back({data0 + lay.slot_bytes + rng() % lay.slot_bytes, false, "inactive slot"});
  for (int i = 0; i < 20; ++i) probes.push_back({data0 + 2 * lay.slot_bytes + rng() % (orig.size() - data0 - 2 * lay.slot_bytes), false, "tables"});
  probes.push_back({orig.size() - 1, false, "tail"});
  probes.push_back({data0 + 2 * lay.slot_bytes, true, "active table"});
  int refused = 0, resumed = 0, i = 0;
  for (const auto& p : probes) {
    const std::string dir = base.path + "/f" + std::to_string(i++);
    fs::create_directory(dir);
    std::vector<char> b = orig;
    b[p.off] ^= static_cast<char>(1 << (rng() % 8));
    spit(dir + "/deferalloc-rank0.state", b);
    const std::string what = std::string(p.region) + " byte " + std::to_string(p.off);
    const outcome o = resume_damaged(dir, what);
    if (p.must_refuse) EXPECT_EQ(o, outcome::refused) << what << " was not detected";
    (o == outcome::refused ? refused : resumed)++;
    fs::remove_all(dir);
  }
  std::printf("%zu flipped bytes: %d refused with corrupt_data, %d resumed an intact committed step\n", probes.size(), refused,
              resumed);
  // Truncations (fallocate would re-extend them with zeros) are refused, the file untouched.
  for (std::uint64_t size : {std::uint64_t{0}, std::uint64_t{100}, std::uint64_t{4096}, std::uint64_t{8192},
                             data0 + 1000, orig.size() / 2, orig.size() - 4096, orig.size() - 1}) {
    const std::string dir = base.path + "/t" + std::to_string(size);
    fs::create_directory(dir);
    spit(dir + "/deferalloc-rank0.state", std::vector<char>(orig.begin(), orig.begin() + static_cast<std::ptrdiff_t>(size)));
    EXPECT_EQ(resume_damaged(dir, "truncated to " + std::to_string(size)), outcome::refused);
    EXPECT_EQ(fs::file_size(dir + "/deferalloc-rank0.state"), size) << "a refused file was changed";
    fs::remove_all(dir);
  }
  // Both commit records damaged: refused, never a fresh start from step 0.
  {
    const std::string dir = base.path + "/both";
    fs::create_directory(dir);
    std::vector<char> b = orig;
    b[20] ^= 1;
    b[4096 + 20] ^= 1;
    spit(dir + "/deferalloc-rank0.state", b);
    model m(host(), config(tier::file, dir, true));
    try {
      m.opt->resumed();
      ADD_FAILURE() << "both commit records damaged, no error";
    } catch (const corrupt_data& e) {
      EXPECT_NE(std::string(e.what()).find("unreadable"), std::string::npos) << e.what();
    }
    EXPECT_THROW(m.opt->initialize(), corrupt_data) << "initialize() must not start over a damaged state file";
  }
}

// Every flipped byte or truncation of a checkpoint is refused with corrupt_data and
// changes nothing, loading into the host tier (verify, then copy) or the file tier
// (one pass into the inactive slot).
TEST(durability, damaged_checkpoint_is_refused_and_changes_nothing) {
  const auto& ref = reference<k_steps>();
  temp_dir base;
  const std::string ck = base.path + "/ck";
  {
    model m(host(), config(tier::host, {}, false));
    m.opt->initialize();
    for (std::uint64_t t = 0; t < 6; ++t) m.step(t);
    m.opt->save_checkpoint(ck);
  }
  const std::string gen = ck + "/gen-1";
  ASSERT_TRUE(fs::exists(gen + "/manifest.txt"));
  model host_m(host(), config(tier::host, {}, false));
  model file_m(host(), config(tier::file, base.path + "/state", false));
  for (model* m : {&host_m, &file_m}) {
    m->opt->initialize();
    for (std::uint64_t t = 0; t < 2; ++t) m->step(t);
  }
  std::mt19937_64 rng(11);
  int n = 0;
  for (const std::string f : {"shard-0.bin", "shard-1.bin", "shard-2.bin", "manifest.txt"}) {
    const std::string path = gen + "/" + f;
    const std::vector<char> orig = slurp(path);
    std::vector<std::size_t> offs = {0, orig.size() - 1, orig.size() / 3, 2 * orig.size() / 3};
    for (int i = 0; i < 12; ++i) offs.push_back(rng() % orig.size());
    for (std::size_t off : offs) {
      std::vector<char> b = orig;
      b[off] ^= static_cast<char>(1 << (rng() % 8));
      spit(path, b);
      model& m = ++n % 2 ? host_m : file_m;
      EXPECT_THROW(m.opt->load_checkpoint(ck), corrupt_data) << f << " byte " << off;
      EXPECT_EQ(m.opt->steps(), 2u);
      EXPECT_TRUE(m.snapshot() == ref[2]) << f << " byte " << off << ": a refused load changed the state";
    }
    for (std::size_t size : {std::size_t{0}, orig.size() / 2, orig.size() - 1}) {
      spit(path, std::vector<char>(orig.begin(), orig.begin() + static_cast<std::ptrdiff_t>(size)));
      model& m = ++n % 2 ? host_m : file_m;
      EXPECT_THROW(m.opt->load_checkpoint(ck), corrupt_data) << f << " truncated to " << size;
      EXPECT_TRUE(m.snapshot() == ref[2]);
    }
    spit(path, orig);
  }
  for (model* m : {&host_m, &file_m}) {
    m->opt->load_checkpoint(ck);
    EXPECT_TRUE(m->snapshot() == ref[6]) << "the intact checkpoint does not load exactly";
  }
}

// A save that fails part-way (here: a read error of the file tier) leaves the previous
// checkpoint the newest complete one, loadable; no unfinished generation stays.
TEST(durability, failed_save_keeps_the_previous_checkpoint) {
  const auto& ref = reference<k_steps>();
  temp_dir base;
  const std::string ck = base.path + "/ck";
  model m(host(), config(tier::file, base.path + "/state", false));
  m.opt->initialize();
  for (std::uint64_t t = 0; t < 3; ++t) m.step(t);
  m.opt->save_checkpoint(ck);
  m.step(3);
  using fs_t = optim::detail::file_store;
  optim::detail::inject_file_fault(*m.opt, fs_t::fault_op::read, fs_t::fault_kind::eio, 3);
  EXPECT_THROW(m.opt->save_checkpoint(ck), io_error);
  for (const auto& e : fs::directory_iterator(ck)) EXPECT_EQ(e.path().filename(), "gen-1") << "left behind: " << e.path();
  model r(host(), config(tier::host, {}, false));
  r.opt->load_checkpoint(ck);
  EXPECT_EQ(r.opt->steps(), 3u);
  EXPECT_TRUE(r.snapshot() == ref[3]);
  m.opt->save_checkpoint(ck);  // a later save publishes gen-2 and prunes gen-1 (in the background)
  EXPECT_TRUE(fs::exists(ck + "/gen-2"));
  optim::detail::wait_checkpoint_prune(*m.opt);
  EXPECT_FALSE(fs::exists(ck + "/gen-1"));
  r.opt->load_checkpoint(ck);
  EXPECT_TRUE(r.snapshot() == ref[4]);
}

// ---- the bad-input table --------------------------------------------------------------

TEST(durability, null_pointers_are_refused_and_change_nothing) {
  const auto& ref = reference<k_steps>();
  model m(host(), config(tier::host, {}, false));
  EXPECT_THROW(m.opt->add_shard(nullptr, 16), invalid_argument);
  m.opt->initialize();
  m.step(0);
  std::vector<const void*> g = m.grads;
  g[1] = nullptr;
  EXPECT_THROW(m.opt->grad_sq_norm(g, grad_type::bf16), invalid_argument);
  // (A null gradient in step() skips its shard: optimizer.hpp's step.)
  EXPECT_EQ(m.opt->steps(), 1u);
  EXPECT_TRUE(m.snapshot() == ref[1]);
  EXPECT_GT(m.opt->grad_sq_norm(m.grads, grad_type::bf16), 0.0);
}

TEST(durability, foreign_owned_files_are_refused_before_any_write) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another uid";
  temp_dir base;
  const std::string dir = base.path + "/state";
  const std::string path = make_state(dir, 2);
  ASSERT_EQ(::chown(path.c_str(), 4242, 4242), 0);
  const std::vector<char> before = slurp(path);
  {
    model m(host(), config(tier::file, dir, true));
    EXPECT_THROW(m.opt->resumed(), io_error) << "resume of another user's state file";
  }
  {
    model m(host(), config(tier::file, dir, false));
    try {
      m.opt->initialize();
      ADD_FAILURE() << "another user's state file was replaced";
    } catch (const io_error& e) {
      EXPECT_NE(std::string(e.what()).find("owned by uid 4242"), std::string::npos) << e.what();
    }
  }
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 4242u);
  EXPECT_TRUE(slurp(path) == before) << "another user's file was changed";
  // A foreign-owned leftover temporary (<name>.new) and a foreign-owned directory.
  ASSERT_EQ(::chown(path.c_str(), 0, 0), 0);
  fs::remove(path);
  spit(path + ".new", {'x'});
  ASSERT_EQ(::chown((path + ".new").c_str(), 4242, 4242), 0);
  {
    model m(host(), config(tier::file, dir, false));
    EXPECT_THROW(m.opt->initialize(), io_error);
  }
  EXPECT_EQ(fs::file_size(path + ".new"), 1u);
  const std::string ck = base.path + "/ck";
  fs::create_directory(ck);
  ASSERT_EQ(::chown(ck.c_str(), 4242, 4242), 0);
  model h(host(), config(tier::host, {}, false));
  h.opt->initialize();
  EXPECT_THROW(h.opt->save_checkpoint(ck), io_error);
  EXPECT_TRUE(fs::is_empty(ck));
}

TEST(durability, symlinks_are_refused) {
  temp_dir base;
  const std::string victim = base.path + "/victim";
  spit(victim, {'k', 'e', 'e', 'p'});
  // The state file is a symlink.
  const std::string dir = base.path + "/state";
  fs::create_directory(dir);
  fs::create_symlink(victim, dir + "/deferalloc-rank0.state");
  for (bool resume : {true, false}) {
    model m(host(), config(tier::file, dir, resume));
    EXPECT_THROW(resume ? (void)m.opt->resumed() : m.opt->initialize(), io_error) << "resume " << resume;
  }
  fs::remove(dir + "/deferalloc-rank0.state");
  fs::create_symlink(victim, dir + "/deferalloc-rank0.state.new");
  {
    model m(host(), config(tier::file, dir, false));
    EXPECT_THROW(m.opt->initialize(), io_error) << "the temporary name is a symlink";
  }
  // The state directory is a symlink.
  const std::string real = base.path + "/real", link = base.path + "/link";
  fs::create_directory(real);
  fs::create_directory_symlink(real, link);
  EXPECT_THROW(model(host(), config(tier::file, link, false)), io_error) << "refused when the optimizer is built";
  EXPECT_TRUE(fs::is_empty(real));
  // A checkpoint directory, a generation's manifest.
  model h(host(), config(tier::host, {}, false));
  h.opt->initialize();
  EXPECT_THROW(h.opt->save_checkpoint(link), io_error);
  EXPECT_TRUE(fs::is_empty(real));
  const std::string ck = base.path + "/ck";
  h.opt->save_checkpoint(ck);
  EXPECT_THROW(h.opt->load_checkpoint(link), io_error);
  fs::remove(ck + "/gen-1/manifest.txt");
  fs::create_symlink(victim, ck + "/gen-1/manifest.txt");
  EXPECT_THROW(h.opt->load_checkpoint(ck), io_error);
  EXPECT_TRUE(slurp(victim) == std::vector<char>({'k', 'e', 'e', 'p'}));
}
