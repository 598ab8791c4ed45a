// Never silently wrong, on the host driver: per-shard step counts survive the
// file tier's commits and checkpoints; a state write killed part-way leaves the old
// state; checkpoint generation names cannot lose a checkpoint; one optimizer per state
// file; permission errors say so.  The kill tests are in test_durability.cpp.
#include <deferalloc/deferalloc.h>
#include <deferalloc/optimizer.h>
#include <deferalloc/optim/optimizer.hpp>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>

#include "../optimizer/store/file_store.hpp"
#include "durability_model.hpp"

using namespace deferalloc;
using namespace deferalloc::optim;
using namespace dfa_test;
using namespace dfa_test::durability;
namespace fs = std::filesystem;

namespace {

std::vector<std::uint64_t> steps_of(streamed_adamw& o) {
  std::vector<std::uint64_t> v;
  for (std::size_t s = 0; s < o.shards().size(); ++s) v.push_back(o.shard_step(s));
  return v;
}


std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// Runs `fn` in a child process as an unprivileged user when this one is root (so that
// file modes apply), owning `dir`; the child's exit status (0: fn returned true).
int as_unprivileged(const std::string& dir, const std::function<bool()>& fn) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::geteuid() == 0) {
      for (const auto& e : fs::recursive_directory_iterator(dir)) (void)::lchown(e.path().c_str(), 65534, 65534);
      (void)::chown(dir.c_str(), 65534, 65534);
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(70);
    }
    bool ok = false;
    try {
      ok = fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "unexpected error: %s\n", e.what());
    }
    std::fflush(stderr);
    ::_exit(ok ? 0 : 1);
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// Sets an environment variable for a scope (a test hook of the library).
struct scoped_env {
  scoped_env(const char* k, const char* v) : key(k) { ::setenv(k, v, 1); }
  ~scoped_env() { ::unsetenv(key); }
  const char* key;
};

}  // namespace

// ---- 1: per-shard step counts -------------------------------------------------------

// The model's last shard has no gradient at step 1 (and 5): its step count lags.  The
// file tier's resume, checkpoints (into every tier) and set_shard_step keep each count.
TEST(state_integrity, per_shard_steps_survive_resume_and_checkpoints) {
  const auto& ref = reference<8>();
  temp_dir base;
  const std::string dir = base.path + "/state", ck = base.path + "/ck";
  std::vector<std::uint64_t> steps;
  {
    model m(host(), config(tier::file, dir, false));
    m.opt->initialize();
    for (std::uint64_t t = 0; t < 4; ++t) m.step(t);
    steps = steps_of(*m.opt);
    ASSERT_EQ(steps, (std::vector<std::uint64_t>{4, 4, 3}));
    m.opt->save_checkpoint(ck);
  }
  {
    model m(host(), config(tier::file, dir, true));
    ASSERT_TRUE(m.opt->resumed());
    EXPECT_EQ(steps_of(*m.opt), steps) << "the file tier's resume lost the per-shard step counts";
    m.opt->sync_model_params();
    EXPECT_TRUE(m.snapshot() == ref[4]);
    m.step(4);
    EXPECT_TRUE(m.snapshot() == ref[5]) << "the step after the resume differs (bias correction of the lagging shard)";
  }
  for (tier t : {tier::host, tier::device, tier::file}) {
    model m(host(), config(t, base.path + "/load-" + to_string(t), false));
    m.opt->initialize();
    m.step(0);
    m.opt->load_checkpoint(ck);
    EXPECT_EQ(steps_of(*m.opt), steps) << to_string(t) << " tier: load_checkpoint collapsed the step counts";
    EXPECT_TRUE(m.snapshot() == ref[4]) << to_string(t);
  }
  {  // the file tier's load persisted them
    model m(host(), config(tier::file, base.path + "/load-file", true));
    ASSERT_TRUE(m.opt->resumed());
    EXPECT_EQ(steps_of(*m.opt), steps);
  }
  {  // set_shard_step (load_state_dict) on the file tier is committed
    model m(host(), config(tier::file, dir, true));
    ASSERT_TRUE(m.opt->resumed());
    m.opt->set_shard_step(1, 42);
  }
  model m(host(), config(tier::file, dir, true));
  ASSERT_TRUE(m.opt->resumed());
  EXPECT_EQ(m.opt->shard_step(1), 42u);
  EXPECT_EQ(m.opt->shard_step(2), 4u);
}

// A state file of format 2 (one step count per file) and a checkpoint of format 2 still
// load, every shard at the file's step; the file's next commit keeps per-shard counts.
TEST(state_integrity, format_2_files_load_with_one_step_count) {
  const scoped_env unpacked("DEFERALLOC_TEST_UNPACKED_STATE", "1");  // the layout of formats 2 to 4
  temp_dir base;
  const std::string dir = base.path + "/state", ck = base.path + "/ck";
  {
    model m(host(), config(tier::file, dir, false));
    m.opt->initialize();
    for (std::uint64_t t = 0; t < 3; ++t) m.step(t);
    m.opt->save_checkpoint(ck);
  }
  // Rewrite the state file as format 2: version 2, the header checksum over the 56 bytes
  // before it (where steps_sum is now), no step-count areas.
  const std::string path = dir + "/deferalloc-rank0.state";
  std::vector<char> b = slurp(path);
  for (std::size_t c = 0; c < 2; ++c) {
    char* h = b.data() + c * 4096;
    if (std::all_of(h, h + 64, [](char x) { return x == 0; })) continue;
    const std::uint32_t v = 2;
    std::memcpy(h + 8, &v, 4);
    const std::uint64_t sum = optim::detail::checksum64(h, 56);
    std::memcpy(h + 56, &sum, 8);
    std::memset(h + 64, 0, 8);
  }
  b.resize(b.size() - 2 * 4096);
  spit(path, b);
  {
    model m(host(), config(tier::file, dir, true));
    ASSERT_TRUE(m.opt->resumed());
    EXPECT_EQ(steps_of(*m.opt), (std::vector<std::uint64_t>{3, 3, 3})) << "format 2: every shard at the file's step";
    m.opt->set_shard_step(2, 2);  // a commit: the file becomes format 3
  }
  {
    model m(host(), config(tier::file, dir, true));
    ASSERT_TRUE(m.opt->resumed());
    EXPECT_EQ(steps_of(*m.opt), (std::vector<std::uint64_t>{3, 3, 2}));
    m.opt->sync_model_params();
    EXPECT_TRUE(m.snapshot() == reference<8>()[3]);
  }
  // The manifest as format 2: no step per shard line, version 2, its end checksum.
  const std::string mpath = ck + "/gen-1/manifest.txt";
  std::string text(slurp(mpath).data(), slurp(mpath).size());
  text = text.substr(0, text.rfind("end "));
  for (std::size_t at; (at = text.find(" step ")) != std::string::npos;) text.erase(at, text.find('\n', at) - at);
  text.replace(text.find(" 3\n"), 3, " 2\n");
  char end[64];
  std::snprintf(end, sizeof end, "end %016llx\n",
                static_cast<unsigned long long>(optim::detail::checksum64(text.data(), text.size())));
  text += end;
  spit(mpath, std::vector<char>(text.begin(), text.end()));
  model m(host(), config(tier::host, {}, false));
  m.opt->load_checkpoint(ck);
  EXPECT_EQ(steps_of(*m.opt), (std::vector<std::uint64_t>{3, 3, 3}));
}

// ---- 2: state writes are published by one commit --------------------------------------

// A process killed at each write request of a write_state_range into the file tier: the
// resume is the old state, exactly (once the commit is written: the new one).
TEST(state_integrity, killed_state_write_leaves_the_old_state) {
  const auto& ref = reference<8>();
  temp_dir base;
  const std::string dir = base.path + "/state";
  {
    model m(host(), config(tier::file, dir, false));
    m.opt->initialize();
    for (std::uint64_t t = 0; t < 3; ++t) m.step(t);
  }
  const std::string path = dir + "/deferalloc-rank0.state";
  const std::vector<char> orig = slurp(path);
  const std::size_t n = shard_sizes()[0];
  const std::vector<float> ones(n, 1.0f);
  int old_seen = 0, new_seen = 0;
  for (std::uint64_t nth = 1; nth <= 24; nth += 2) {
    spit(path, orig);
    const pid_t pid = ::fork();
    if (pid == 0) {
      model m(host(), config(tier::file, dir, true));
      m.opt->resumed();
      optim::detail::inject_file_fault(*m.opt, optim::detail::file_fault_op::write, optim::detail::file_fault_kind::crash, nth);
      m.opt->write_state_range(0, state_array::exp_avg, 0, n, ones.data());
      m.opt.reset();  // publishes the write (Note [State writes])
      ::_exit(0);
    }
    int st = 0;
    ASSERT_EQ(::waitpid(pid, &st, 0), pid);
    ASSERT_TRUE(WIFEXITED(st));
    model m(host(), config(tier::file, dir, true));
    std::string err;
    try {
      ASSERT_TRUE(m.opt->resumed());
      m.opt->sync_model_params();
    } catch (const std::exception& e) {
      err = e.what();
    }
    ASSERT_EQ(err, "") << "write " << nth << ": the state file does not resume";
    std::vector<float> got(n);
    m.opt->read_state_range(0, state_array::exp_avg, 0, n, got.data());
    if (WEXITSTATUS(st) == 86) {
      EXPECT_TRUE(m.snapshot() == ref[3]) << "killed at write " << nth << ": not the old state";
      ++old_seen;
    } else {
      EXPECT_EQ(got, ones);
      ++new_seen;
    }
  }
  EXPECT_GT(old_seen, 0);
  EXPECT_GT(new_seen, 0);
  // Writes array after array are published together by the next use of the state.
  model m(host(), config(tier::file, dir, true));
  ASSERT_TRUE(m.opt->resumed());
  m.opt->write_state_range(0, state_array::exp_avg, 0, n, ones.data());
  m.opt->write_state_range(0, state_array::exp_avg_sq, 0, n, ones.data());
  m.opt->set_shard_step(0, 77);
  std::vector<float> got(n);
  m.opt->read_state_range(0, state_array::exp_avg_sq, 0, n, got.data());
  EXPECT_EQ(got, ones);
  m.opt.reset();
  model again(host(), config(tier::file, dir, true));
  ASSERT_TRUE(again.opt->resumed());
  EXPECT_EQ(again.opt->shard_step(0), 77u);
  again.opt->read_state_range(0, state_array::exp_avg, 0, n, got.data());
  EXPECT_EQ(got, ones);
}

// ---- 3: checkpoint generation names ----------------------------------------------------

TEST(state_integrity, stray_generation_names_never_lose_a_checkpoint) {
  const auto& ref = reference<8>();
  temp_dir base;
  const std::string ck = base.path + "/ck";
  model m(host(), config(tier::host, {}, false));
  m.opt->initialize();
  m.step(0);
  m.opt->save_checkpoint(ck);  // gen-1
  // An unfinished generation with the largest number the loader reads, and foreign names.
  fs::create_directory(ck + "/gen-999999999999999999.tmp");
  fs::create_directory(ck + "/gen-x");
  fs::create_directory(ck + "/gen-00000000000000000007.tmp");
  m.step(1);
  m.opt->save_checkpoint(ck);
  optim::detail::wait_checkpoint_prune(*m.opt);
  EXPECT_TRUE(fs::is_directory(ck + "/gen-2")) << "numbered from the stray .tmp";
  EXPECT_FALSE(fs::exists(ck + "/gen-1000000000000000000")) << "a number the loader cannot read";
  EXPECT_TRUE(fs::exists(ck + "/gen-999999999999999999.tmp")) << "a stray entry above the generations was removed";
  {
    model r(host(), config(tier::host, {}, false));
    r.opt->load_checkpoint(ck);
    EXPECT_TRUE(r.snapshot() == ref[2]);
  }
  // A symlinked newest generation: refused with the reason (never an older one
  // silently), by the load and by a save (whose generation the load would not reach).
  fs::create_directory_symlink(ck + "/gen-2", ck + "/gen-3");
  {
    model r(host(), config(tier::host, {}, false));
    const std::string e = error_of([&] { r.opt->load_checkpoint(ck); });
    EXPECT_NE(e.find("gen-3 is a symbolic link"), std::string::npos) << e;
    EXPECT_FALSE(r.opt->initialized());
  }
  m.step(2);
  EXPECT_NE(error_of([&] { m.opt->save_checkpoint(ck); }).find("symbolic link"), std::string::npos);
  EXPECT_TRUE(fs::is_directory(ck + "/gen-2")) << "a refused save removed a generation";
  fs::remove(ck + "/gen-3");
  spit(ck + "/gen-4", {'x'});  // a file
  {
    model r(host(), config(tier::host, {}, false));
    EXPECT_NE(error_of([&] { r.opt->load_checkpoint(ck); }).find("gen-4 is not a directory"), std::string::npos);
  }
  fs::remove(ck + "/gen-4");
  m.opt->save_checkpoint(ck);
  optim::detail::wait_checkpoint_prune(*m.opt);
  EXPECT_TRUE(fs::is_directory(ck + "/gen-3"));
  EXPECT_FALSE(fs::exists(ck + "/gen-2"));
  EXPECT_TRUE(fs::exists(ck + "/gen-x"));
}

// A checkpoint directory that cannot be listed fails the save before anything is
// written or removed, and the load, naming the directory and "Permission denied".
TEST(state_integrity, unlistable_checkpoint_directory_is_permission_denied) {
  temp_dir base;
  const std::string ck = base.path + "/ck";
  {
    model m(host(), config(tier::host, {}, false));
    m.opt->initialize();
    m.opt->save_checkpoint(ck);
    m.step(0);
    m.opt->save_checkpoint(ck);  // gen-2 (gen-1 pruned)
    optim::detail::wait_checkpoint_prune(*m.opt);
  }
  const int rc = as_unprivileged(base.path, [&] {
    bool ok = true;
    model m(host(), config(tier::host, {}, false));
    m.opt->initialize();
    for (mode_t mode : {0300, 0000}) {
      ::chmod(ck.c_str(), mode);
      const std::string save = error_of([&] { m.opt->save_checkpoint(ck); });
      const std::string load = error_of([&] { m.opt->load_checkpoint(ck); });
      ::chmod(ck.c_str(), 0700);
      for (const std::string& e : {save, load})
        if (e.find("Permission denied") == std::string::npos || e.find(ck) == std::string::npos) {
          std::fprintf(stderr, "mode %o: %s\n", static_cast<unsigned>(mode), e.c_str());
          ok = false;
        }
      for (const auto& e : fs::directory_iterator(ck))
        if (e.path().filename() != "gen-2") {
          std::fprintf(stderr, "mode %o: left %s\n", static_cast<unsigned>(mode), e.path().c_str());
          ok = false;
        }
    }
    m.opt->load_checkpoint(ck);
    return ok && m.opt->steps() == 1;
  });
  EXPECT_EQ(rc, 0) << "see the child's messages above";
}

// ---- 4: one owner per state file ------------------------------------------------------

TEST(state_integrity, a_second_optimizer_on_a_state_file_is_refused) {
  temp_dir base;
  const std::string dir = base.path + "/state";
  model a(host(), config(tier::file, dir, false));
  a.opt->initialize();
  a.step(0);
  for (bool resume : {true, false}) {
    model b(host(), config(tier::file, dir, resume));
    std::string e;
    try {
      resume ? (void)b.opt->resumed() : b.opt->initialize();
    } catch (const invalid_state& x) {
      e = x.what();
    }
    EXPECT_NE(e.find("in use by another optimizer"), std::string::npos) << "resume " << resume << ": " << e;
    EXPECT_NE(e.find("process " + std::to_string(::getpid())), std::string::npos) << e;
  }
  a.step(1);  // the first is unharmed
  EXPECT_TRUE(a.snapshot() == reference<8>()[2]);
  // Another process holding it.
  int to_child[2], from_child[2];
  ASSERT_EQ(::pipe(to_child), 0);
  ASSERT_EQ(::pipe(from_child), 0);
  const std::string dir2 = base.path + "/state2";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(to_child[1]);  // else the parent's close would not end the read below
    ::close(from_child[0]);
    model c(host(), config(tier::file, dir2, false));
    c.opt->initialize();
    char x = 1;
    (void)!::write(from_child[1], &x, 1);
    (void)!::read(to_child[0], &x, 1);
    ::_exit(0);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  char x = 0;
  ASSERT_EQ(::read(from_child[0], &x, 1), 1);
  {
    model b(host(), config(tier::file, dir2, true));
    const std::string e = error_of([&] { b.opt->resumed(); });
    EXPECT_NE(e.find("process " + std::to_string(pid)), std::string::npos) << e;
  }
  ::close(to_child[1]);
  ::close(from_child[0]);
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  model b(host(), config(tier::file, dir2, true));
  EXPECT_TRUE(b.opt->resumed()) << "the lock outlived its holder";
}

// A process forked while an optimizer holds its state file (a DataLoader worker forked
// after the optimizer was built) does not keep the lock: once the parent closes the
// optimizer, a new one in the parent takes the file while the child still runs.
TEST(state_integrity, a_forked_child_does_not_keep_the_owner_lock) {
  temp_dir base;
  const std::string dir = base.path + "/state";
  auto a = std::make_unique<model>(host(), config(tier::file, dir, false));
  a->opt->initialize();
  a->step(0);
  int to_child[2], from_child[2];
  ASSERT_EQ(::pipe(to_child), 0);
  ASSERT_EQ(::pipe(from_child), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(to_child[1]);
    ::close(from_child[0]);
    char x = 1;
    (void)!::write(from_child[1], &x, 1);  // running: the fork's child handler has run
    (void)!::read(to_child[0], &x, 1);     // alive until the parent has checked
    ::_exit(0);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  char x = 0;
  ASSERT_EQ(::read(from_child[0], &x, 1), 1);
  ::close(from_child[0]);
  a.reset();
  std::string e = "(no error)";
  bool resumed = false;
  {
    model b(host(), config(tier::file, dir, true));
    e = error_of([&] { resumed = b.opt->resumed(); });
  }
  ::close(to_child[1]);
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  EXPECT_EQ(e, "(no error)") << "the forked child kept the lock";
  EXPECT_TRUE(resumed);
}

// A forked child that destroys the optimizer it inherited (a DataLoader worker exiting,
// or one that deletes it) touches nothing of the parent's: no join of the parent's I/O
// threads (it would hang), no unlink of its unpublished state file, no close of a lock
// fd, not even its own optimizer's that got the closed lock fd's number again.  The parent
// steps on and closes cleanly.
TEST(state_integrity, a_forked_child_destroying_the_inherited_optimizer_touches_nothing) {
  const auto& ref = reference<8>();
  temp_dir base;
  const std::string dir = base.path + "/state", dir2 = base.path + "/child";
  auto a = std::make_unique<model>(host(), config(tier::file, dir, false));
  EXPECT_FALSE(a->opt->resumed());  // opens the state file: <state>.new until the first commit
  const std::string fresh = dir + "/deferalloc-rank0.state.new";
  ASSERT_TRUE(fs::exists(fresh));
  // The child's exit status: 0, or 1 its own lock was lost, 2 an error, 128 + a signal.
  auto in_child = [&](bool own) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::alarm(60);  // a join of the parent's threads would hang
      int rc = 0;
      try {
        std::unique_ptr<model> c;
        if (own) {
          c = std::make_unique<model>(host(), config(tier::file, dir2, false));
          c->opt->initialize();
        }
        a.reset();
        if (own) {
          model d(host(), config(tier::file, dir2, true));
          const std::string e = error_of([&] { d.opt->resumed(); });
          if (e.find("in use") == std::string::npos) rc |= 1;
          c->step(0);
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child: %s\n", e.what());
        rc |= 2;
      }
      std::fflush(stderr);
      ::_exit(rc);
    }
    int st = 0;
    EXPECT_EQ(::waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  };
  EXPECT_EQ(in_child(false), 0);
  EXPECT_TRUE(fs::exists(fresh)) << "the child removed the parent's unpublished state file";
  a->opt->initialize();
  a->step(0);
  a->step(1);
  EXPECT_EQ(in_child(true), 0) << "1: the child's own optimizer lost its lock";
  a->step(2);
  EXPECT_TRUE(a->snapshot() == ref[3]);
  EXPECT_NE(error_of([&] { model(host(), config(tier::file, dir, true)).opt->resumed(); }).find("in use"),
            std::string::npos) << "the parent lost its lock";
  a.reset();
  model r(host(), config(tier::file, dir, true));
  EXPECT_TRUE(r.opt->resumed());
  r.opt->sync_model_params();
  EXPECT_TRUE(r.snapshot() == ref[3]);
}

// A state file opened by a file store whose construction then fails (no memory for its
// I/O threads' stacks) is closed, and an unpublished one removed: the descriptor leaked.
TEST(state_integrity, a_file_store_failing_after_the_open_closes_the_state_file) {
  temp_dir base;
  const std::string dir = base.path + "/state";
  const pid_t pid = ::fork();
  if (pid == 0) {  // a child: the address-space limit would hit the test runner's threads too
    auto fds = [] {
      int n = 0;
      for (const auto& e : fs::directory_iterator("/proc/self/fd")) n += e.path().filename() != "." ? 1 : 0;
      return n;
    };
    auto vm_kb = [] {
      std::ifstream f("/proc/self/status");
      std::string line;
      while (std::getline(f, line))
        if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7));
      return 0ull;
    };
    auto cfg = config(tier::file, dir, false);
    cfg.io_threads = 64;  // more than glibc's cache of joined threads' stacks serves
    model m(host(), cfg);
    const int before = fds();
    rlimit old{};
    ::getrlimit(RLIMIT_AS, &old);
    rlimit lim = old;
    lim.rlim_cur = (vm_kb() + 1024) * 1024;  // no room for an I/O thread's stack
    ::setrlimit(RLIMIT_AS, &lim);
    const std::string e = error_of([&] { m.opt->initialize(); });
    ::setrlimit(RLIMIT_AS, &old);
    int rc = 0;
    if (e == "(no error)") rc |= 1;  // (the limit did not bite: the test proves nothing)
    if (fds() != before) rc |= 2;
    if (fs::exists(dir + "/deferalloc-rank0.state.new")) rc |= 4;
    if (rc) std::fprintf(stderr, "error: %s, fds %d -> %d\n", e.c_str(), before, fds());
    ::_exit(rc);
  }
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0) << "1: no failure, 2: a descriptor leaked, 4: the unpublished file stayed";
}

// set_shard_step before the state exists is refused (initialize() would reset the counts,
// a resume would read the file's over it); on a resumed file tier it first reads the file,
// then changes the count, and the change is committed.
TEST(state_integrity, set_shard_step_needs_the_state_and_reads_a_resumed_file_first) {
  temp_dir base;
  const std::string dir = base.path + "/state";
  {
    model h(host(), config(tier::host, "", false));
    const std::string e = error_of([&] { h.opt->set_shard_step(1, 5); });
    EXPECT_NE(e.find("set_shard_step: no state yet"), std::string::npos) << e;
    model f(host(), config(tier::file, dir, false));
    EXPECT_NE(error_of([&] { f.opt->set_shard_step(1, 5); }).find("no state yet"), std::string::npos);
    EXPECT_FALSE(fs::exists(dir + "/deferalloc-rank0.state.new")) << "refused after creating the state file";
    f.opt->initialize();
    f.step(0), f.step(1);
  }
  {
    model m(host(), config(tier::file, dir, true));
    m.opt->set_shard_step(1, 42);  // the first call: the file is opened by it
    EXPECT_TRUE(m.opt->resumed());
    EXPECT_EQ(m.opt->shard_step(1), 42u);
    EXPECT_EQ(m.opt->shard_step(0), 2u);
  }
  model m(host(), config(tier::file, dir, true));
  EXPECT_TRUE(m.opt->resumed());
  EXPECT_EQ(m.opt->shard_step(1), 42u) << "the count set after the resume was committed";
}

// ---- 7 (part): what resumes and refusals say -----------------------------------------

namespace {
std::mutex g_log_mu;
std::vector<std::string> g_log;
void capture(int, const char* m, void*) {
  std::lock_guard lk(g_log_mu);
  g_log.emplace_back(m);
}
}  // namespace

// A state file with one commit so far has a second commit record never written: its
// resume is silent (no "damaged").
TEST(state_integrity, never_written_commit_record_is_not_damaged) {
  temp_dir base;
  const std::string dir = base.path + "/state";
  {
    model m(host(), config(tier::file, dir, false));
    m.opt->initialize();
  }
  ASSERT_EQ(dfa_set_log_callback(capture, nullptr, 3), DFA_SUCCESS);
  {
    model m(host(), config(tier::file, dir, true));
    EXPECT_TRUE(m.opt->resumed());
  }
  dfa_set_log_callback(nullptr, nullptr, 0);
  for (const auto& l : g_log) EXPECT_EQ(l.find("damaged"), std::string::npos) << l;
}

// Files of the layout before packing keep their format: FP32 moments header format 3,
// which a build that predates format 4 reads (a format-4 header looks damaged to it: it
// would resume a step back); compressed moments format 4, which records their format.
// New files are format 5 (packed), whatever the moments.  All resume here.
TEST(state_integrity, fp32_state_files_keep_header_format_3) {
  temp_dir base;
  auto versions = [](const std::string& file) {
    std::ifstream f(file, std::ios::binary);
    std::vector<std::uint32_t> v;
    for (std::streamoff copy : {0, 4096}) {
      std::uint32_t x = 0;
      f.seekg(copy + 8);
      f.read(reinterpret_cast<char*>(&x), 4);
      v.push_back(x);
    }
    return v;
  };
  for (bool old : {true, false})
  for (moment_format mf : {moment_format::fp32, moment_format::bf16}) {
    SCOPED_TRACE(old ? "the layout before packing" : "packed");
    const std::string dir = base.path + "/" + to_string(mf) + (old ? "-old" : "");
    auto cfg = config(tier::file, dir, false);
    cfg.moments = mf;
    {
      std::unique_ptr<scoped_env> unpacked;
      if (old) unpacked = std::make_unique<scoped_env>("DEFERALLOC_TEST_UNPACKED_STATE", "1");
      model m(host(), cfg);
      m.opt->initialize();
      m.step(0);
      m.step(1);
    }
    const std::uint32_t want = !old ? 5 : mf == moment_format::fp32 ? 3 : 4;
    EXPECT_EQ(versions(dir + "/deferalloc-rank0.state"), (std::vector<std::uint32_t>{want, want})) << to_string(mf);
    cfg.resume = true;
    {
      model m(host(), cfg);
      EXPECT_TRUE(m.opt->resumed()) << to_string(mf);
      EXPECT_EQ(m.opt->shard_step(0), 2u) << to_string(mf);
      m.step(2);
      if (mf == moment_format::fp32) EXPECT_TRUE(m.snapshot() == reference<8>()[3]);
    }
    EXPECT_EQ(versions(dir + "/deferalloc-rank0.state"), (std::vector<std::uint32_t>{want, want}))
        << to_string(mf) << ": a resumed file keeps its format";
  }
}

// ---- small arrays packed in the state file ---------------------------------------------

// 10,000 parameters of 20 elements: the state file is two slots of state and the fixed
// header (at most 1.1x), not a 64 KiB block per array (3.9 GB); a resume reads back
// every array exactly (Note [Packed arrays]).  bench_small_params times the step.
TEST(state_integrity, small_arrays_are_packed_in_the_state_file) {
  constexpr std::size_t params = 10000, numel = 20, stride = 64;
  temp_dir base;
  const std::string dir = base.path + "/state";
  auto d = host();
  dfa_test::stack st(d);
  auto buffer = [&](std::uint16_t value) {
    auto id = st.mgr->reserve(params * stride);
    st.mgr->materialize(id, 0, whole, fill_mode::zero);
    auto* p = static_cast<char*>(st.mgr->address(id));
    const std::vector<std::uint16_t> v(params * stride / 2, value);
    d->copy_async(p, v.data(), v.size() * 2, nullptr);
    d->synchronize_stream(nullptr);
    return p;
  };
  char* p = buffer(0x3f80);  // bf16 1.0
  char* g = buffer(0x3c23);  // bf16 0.01
  std::vector<const void*> grads;
  for (std::size_t i = 0; i < params; ++i) grads.push_back(g + i * stride);
  auto cfg = config(tier::file, dir, false);
  auto make = [&] {
    auto o = std::make_unique<streamed_adamw>(d, cfg);
    for (std::size_t i = 0; i < params; ++i)
      o->add_shard(reinterpret_cast<std::uint16_t*>(p + i * stride), numel, "p" + std::to_string(i));
    return o;
  };
  auto state_of = [&](streamed_adamw& o, std::size_t s) {
    std::vector<float> v(3 * numel);
    o.read_state(s, v.data(), v.data() + numel, v.data() + 2 * numel);
    return v;
  };
  std::vector<std::vector<float>> want;
  {
    auto o = make();
    o->initialize();
    for (int t = 0; t < 3; ++t) {
      grads[t] = t == 1 ? nullptr : g + t * stride;  // shard 1 is not stepped once
      o->step(grads, grad_type::bf16);
      grads[t] = g + t * stride;
    }
    for (std::size_t s : {std::size_t{0}, std::size_t{1}, params / 2, params - 1}) want.push_back(state_of(*o, s));
  }
  const std::uint64_t size = fs::file_size(dir + "/deferalloc-rank0.state");
  const double state = 2.0 * params * numel * 12;  // two slots of main, exp_avg, exp_avg_sq
  std::printf("state file: %llu bytes for two slots of %.0f bytes of state (%.3fx)\n",
              static_cast<unsigned long long>(size), state / 2, size / (state + 2 * 4096));
  EXPECT_LE(static_cast<double>(size), 1.1 * (state + 2 * 4096)) << "the small arrays are not packed";
  cfg.resume = true;
  auto o = make();
  ASSERT_TRUE(o->resumed());
  EXPECT_EQ(o->shard_step(0), 3u);
  EXPECT_EQ(o->shard_step(1), 2u);
  std::size_t k = 0;
  for (std::size_t s : {std::size_t{0}, std::size_t{1}, params / 2, params - 1})
    EXPECT_EQ(state_of(*o, s), want[k++]) << "shard " << s;
  EXPECT_NE(want[0], want[1]) << "shard 1 was not stepped once";
}

// ---- the state file removed under a running optimizer ---------------------------------

// `rm` of the state file, `rm -rf` of its directory, or another file renamed over it:
// the next commit raises io_error naming the path (never steps into an unlinked inode
// that a resume cannot find); save_checkpoint still reads the held state.
TEST(state_integrity, a_removed_or_replaced_state_file_is_noticed_at_the_next_commit) {
  const auto& ref = reference<8>();
  for (const char* how : {"rm", "rm -rf", "replace"}) {
    SCOPED_TRACE(how);
    temp_dir base;
    const std::string dir = base.path + "/state", ck = base.path + "/ck";
    const std::string path = dir + "/deferalloc-rank0.state";
    model m(host(), config(tier::file, dir, false));
    m.opt->initialize();
    m.step(0);
    m.step(1);
    if (std::string(how) == "rm") fs::remove(path);
    if (std::string(how) == "rm -rf") fs::remove_all(dir);
    if (std::string(how) == "replace") {
      spit(path + ".other", {'x'});
      fs::rename(path + ".other", path);
    }
    try {
      m.step(2);
      ADD_FAILURE() << "a step after the state file was removed raised nothing";
    } catch (const io_error& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find(path), std::string::npos) << w;
      EXPECT_NE(w.find("removed or replaced while this optimizer held it"), std::string::npos) << w;
      EXPECT_NE(w.find("not durable"), std::string::npos) << w;
    }
    EXPECT_THROW(m.step(2), io_error) << "the second step after the removal";
    m.opt->save_checkpoint(ck);  // the held state: the steps are kept through a checkpoint
    model r(host(), config(tier::host, {}, false));
    r.opt->load_checkpoint(ck);
    EXPECT_TRUE(r.snapshot() == ref[2]);
  }
}

// ---- checkpoint generations: only the saver's spelling ---------------------------------

// A foreign gen-007 (a user's directory) is no generation: the load takes gen-1, the
// next save is gen-2, the prune never touches gen-007 or its file.
TEST(state_integrity, a_foreign_gen_007_is_not_generation_7) {
  temp_dir base;
  const std::string ck = base.path + "/ck";
  fs::create_directories(ck + "/gen-007");
  spit(ck + "/gen-007/notes.txt", {'m', 'i', 'n', 'e'});
  fs::create_directory(ck + "/gen-01.tmp");
  model m(host(), config(tier::host, {}, false));
  m.opt->initialize();
  for (std::uint64_t t = 0; t < 2; ++t) {
    m.step(t);
    m.opt->save_checkpoint(ck);
    optim::detail::wait_checkpoint_prune(*m.opt);
    EXPECT_TRUE(fs::is_directory(ck + "/gen-" + std::to_string(t + 1))) << "numbered from gen-007";
    model r(host(), config(tier::host, {}, false));
    r.opt->load_checkpoint(ck);
    EXPECT_TRUE(r.snapshot() == reference<8>()[t + 1]) << "not the newest generation";
  }
  EXPECT_FALSE(fs::exists(ck + "/gen-1"));
  EXPECT_TRUE(fs::exists(ck + "/gen-007/notes.txt")) << "the prune removed a user's directory";
  EXPECT_TRUE(fs::exists(ck + "/gen-01.tmp"));
}

// ---- the file tier's directory ---------------------------------------------------------

// A missing directory is refused at construction, before any step, and never created;
// a directory where the state file cannot be made says so.
TEST(state_integrity, file_tier_directory_messages) {
  temp_dir base;
  const std::string missing = base.path + "/nope";
  auto cfg = config(tier::host, {}, false);
  cfg.home = tier::file;
  cfg.directory = missing;
  const std::string e = error_of([&] { streamed_adamw o(host(), cfg); });
  EXPECT_NE(e.find("directory " + missing + " does not exist (create it first)"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(missing));
  dfa_optimizer* h = nullptr;
  EXPECT_EQ(dfa_opt_create(("driver:host,host_granularity_kb:64,tier:file,window_mb:8,directory:" + missing).c_str(), &h),
            DFA_ERROR_IO);
  EXPECT_NE(std::string(dfa_opt_last_error()).find("does not exist (create it first)"), std::string::npos)
      << dfa_opt_last_error();
  EXPECT_EQ(h, nullptr);
  if (::geteuid() == 0 && fs::is_directory("/proc")) {  // root: /proc passes the owner check
    cfg.directory = "/proc";
    const std::string p = error_of([&] {
      model m(host(), cfg);
      m.opt->initialize();
    });
    EXPECT_NE(p.find("cannot create the state file in /proc: "), std::string::npos) << p;
    EXPECT_EQ(p.find(".lock:"), std::string::npos) << p;
  }
  // Unprivileged, a directory without write permission.
  const std::string ro = base.path + "/ro";
  fs::create_directory(ro);
  EXPECT_EQ(as_unprivileged(base.path, [&] {
              ::chmod(ro.c_str(), 0500);
              auto c2 = cfg;
              c2.directory = ro;
              model m(host(), c2);
              const std::string p = error_of([&] { m.opt->initialize(); });
              if (p.find("cannot create the state file in " + ro + ": Permission denied") == std::string::npos) {
                std::fprintf(stderr, "%s\n", p.c_str());
                return false;
              }
              return true;
            }),
            0);
}
