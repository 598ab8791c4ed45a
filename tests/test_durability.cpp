// Durable optimizer state (issue 11), on the host driver: a run killed at random moments
// (inside checkpoint saves too) always leaves a loadable newest checkpoint and resumes
// bit-identically; damaged state files and checkpoints are refused or resume from an
// intact committed step, never silently to other state or to step 0; bad input (null
// pointers, foreign-owned files, symlinks) is refused with a named error before
// anything changes.
#include <deferalloc/optimizer.hpp>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "../optimizer/file_store.hpp"
#include "durability_model.hpp"

using namespace deferalloc;
using namespace deferalloc::optim;
using namespace dfa_test;
using namespace dfa_test::durability;
namespace fs = std::filesystem;

namespace {

constexpr std::uint64_t k_steps = 12;

std::shared_ptr<driver> host() { return make_host_driver({64_KiB, 1_GiB}); }

// The uninterrupted run's state after every step (ref[t]: after t steps).
const std::vector<state>& reference() {
  static const std::vector<state> ref = [] {
    std::vector<state> r;
    model m(host(), config(tier::host, {}, false));
    m.opt->initialize();
    r.push_back(m.snapshot());
    for (std::uint64_t t = 0; t < k_steps; ++t) {
      m.step(t);
      r.push_back(m.snapshot());
    }
    return r;
  }();
  return ref;
}

std::vector<char> slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
void spit(const std::string& path, const std::vector<char>& b) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(b.data(), static_cast<std::streamsize>(b.size()));
}

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
  const auto& ref = reference();
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
