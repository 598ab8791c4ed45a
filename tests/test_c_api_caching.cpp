// The C ABI of the PyTorch faces on the host driver: dfa_malloc/dfa_free and the
// CUDAPluggableAllocator hooks, tags, statistics and the DLPack export.  Failures
// set dfa_last_error() and change nothing; nothing crashes.
#include <deferalloc/deferalloc.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "../allocator/abi/dlpack_abi.hpp"
#include "log_probe.hpp"

namespace {
class c_api_caching : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(dfa_init(nullptr), DFA_SUCCESS) << dfa_last_error(); }
  void TearDown() override { EXPECT_EQ(dfa_shutdown(), DFA_SUCCESS); }
  static int64_t stat(const char* k) {
    int64_t v = -1;
    EXPECT_EQ(dfa_memory_stat(0, k, &v), DFA_SUCCESS) << dfa_last_error();
    return v;
  }
};
}  // namespace

TEST_F(c_api_caching, malloc_free_and_hooks) {
  void* p = dfa_malloc(3000, 0, nullptr);
  ASSERT_NE(p, nullptr) << dfa_last_error();
  std::memset(p, 0x11, 3000);  // host driver: the block is host memory
  EXPECT_EQ(stat("allocated_bytes.all.current"), 3072);
  size_t size = 0;
  EXPECT_EQ(dfa_base_alloc_hook(static_cast<char*>(p) + 100, &size), p);
  EXPECT_EQ(size, 3072u);
  dfa_record_stream_hook(p, nullptr);
  EXPECT_STREQ(dfa_last_error(), "");
  dfa_free(p, 3000, 0, nullptr);
  EXPECT_STREQ(dfa_last_error(), "");
  EXPECT_EQ(stat("allocated_bytes.all.current"), 0);
  EXPECT_EQ(stat("allocated_bytes.all.peak"), 3072);
  ASSERT_EQ(dfa_reset_peak_stats(0), DFA_SUCCESS);
  EXPECT_EQ(stat("allocated_bytes.all.peak"), 0);
  dfa_init_hook(1);
  dfa_memory_fraction_hook(0.5, 0);
  EXPECT_STREQ(dfa_last_error(), "");
  dfa_empty_cache_hook();
  EXPECT_EQ(stat("reserved_bytes.all.current"), 0) << "empty_cache must release every free granule";
}

TEST_F(c_api_caching, bad_input_sets_the_error_and_changes_nothing) {
  int x = 0;
  EXPECT_EQ(dfa_malloc(0, 0, nullptr), nullptr);
  EXPECT_STREQ(dfa_last_error(), "") << "0 bytes is an empty tensor, not an error";
  EXPECT_EQ(dfa_malloc(size_t{1} << 60, 0, nullptr), nullptr);
  EXPECT_NE(std::string(dfa_last_error()).find("dfa_malloc"), std::string::npos);
  dfa_free(&x, 4, 0, nullptr);
  EXPECT_NE(std::string(dfa_last_error()).find("not returned by this allocator"), std::string::npos) << dfa_last_error();
  EXPECT_EQ(dfa_base_alloc_hook(&x, nullptr), nullptr);
  dfa_memory_fraction_hook(2.0, 0);
  EXPECT_NE(std::string(dfa_last_error()).find("fraction"), std::string::npos);
  EXPECT_EQ(dfa_set_memory_fraction(-1, 0), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_memory_stat(0, "nonsense", nullptr), DFA_ERROR_INVALID_ARGUMENT);
  int64_t v = 0;
  EXPECT_EQ(dfa_memory_stat(0, "nonsense", &v), DFA_ERROR_INVALID_ARGUMENT);
  char small[4];
  size_t needed = 0;
  EXPECT_EQ(dfa_memory_stats(0, small, sizeof small, &needed), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_GT(needed, 1000u);
  std::string text(needed, '\0');
  ASSERT_EQ(dfa_memory_stats(0, text.data(), text.size(), &needed), DFA_SUCCESS);
  EXPECT_NE(text.find("reserved_bytes.all.peak "), std::string::npos);
  EXPECT_NE(text.find("num_ooms 0\n"), std::string::npos);
  EXPECT_EQ(dfa_set_resident(&x, 1), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(stat("allocation.all.current"), 0);
}

TEST_F(c_api_caching, tags_pause_and_resume) {
  EXPECT_EQ(dfa_tag_resume("unknown", nullptr), DFA_ERROR_INVALID_ARGUMENT) << "resume of an unknown tag";
  EXPECT_EQ(dfa_tag_end(), DFA_ERROR_INVALID_STATE);
  EXPECT_EQ(dfa_tag_begin(""), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(dfa_last_error(), "dfa_tag_begin: register_tag: the tag is empty") << "checked once, by the C++ call";
  ASSERT_EQ(dfa_tag_begin("rollout"), DFA_SUCCESS);
  void* p = dfa_malloc(6 << 20, 0, nullptr);
  ASSERT_NE(p, nullptr) << dfa_last_error();
  EXPECT_EQ(dfa_tag_pause("rollout", DFA_KEEP_HOST, nullptr), DFA_ERROR_INVALID_STATE) << "pause inside a region";
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  void* q = dfa_malloc(1 << 20, 0, nullptr);  // untagged
  std::memset(p, 0x42, 6 << 20);
  ASSERT_EQ(dfa_tag_pause("rollout", DFA_KEEP_HOST, nullptr), DFA_SUCCESS) << dfa_last_error();
  int paused = 0;
  ASSERT_EQ(dfa_tag_is_paused("rollout", &paused), DFA_SUCCESS);
  EXPECT_EQ(paused, 1);
  EXPECT_EQ(dfa_tag_pause("rollout", DFA_KEEP_HOST, nullptr), DFA_ERROR_INVALID_STATE) << "double pause";
  EXPECT_EQ(stat("deferalloc.paused_bytes") >= (6 << 20), true);
  EXPECT_GE(stat("deferalloc.manager.backup_bytes"), 6 << 20);
  ASSERT_EQ(dfa_tag_resume("rollout", nullptr), DFA_SUCCESS) << dfa_last_error();
  EXPECT_EQ(static_cast<unsigned char*>(p)[(6 << 20) - 1], 0x42);
  EXPECT_EQ(static_cast<unsigned char*>(p)[0], 0x42);
  dfa_free(p, 6 << 20, 0, nullptr);
  dfa_free(q, 1 << 20, 0, nullptr);
  EXPECT_STREQ(dfa_last_error(), "");
}

TEST_F(c_api_caching, dlpack_export_and_deleter_frees_the_reservation) {
  dfa_reservation r = 0;
  void* addr = nullptr;
  ASSERT_EQ(dfa_reserve(4096 * 8, &r, &addr), DFA_SUCCESS);
  const int64_t shape[2] = {64, 128};
  DLManagedTensor* t = nullptr;
  EXPECT_EQ(dfa_export_dlpack(r, shape, 2, 2, 64, 1, &t), DFA_ERROR_INVALID_ARGUMENT) << "64x128 f64 does not fit";
  EXPECT_EQ(dfa_export_dlpack(r + 99, shape, 2, 2, 32, 1, &t), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_export_dlpack(r, nullptr, 2, 2, 32, 1, &t), DFA_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(dfa_export_dlpack(r, shape, 2, 2, 32, 1, &t), DFA_SUCCESS) << dfa_last_error();
  EXPECT_EQ(t->dl_tensor.data, addr);
  EXPECT_EQ(t->dl_tensor.device.device_type, 1) << "kDLCPU on the host driver";
  EXPECT_EQ(t->dl_tensor.shape[1], 128);
  EXPECT_EQ(t->dl_tensor.dtype.bits, 32);
  t->deleter(t);
  int backed = 0;
  EXPECT_EQ(dfa_is_backed(r, 0, DFA_WHOLE, &backed), DFA_ERROR_INVALID_ARGUMENT) << "the deleter freed it";
  // A tensor that outlives the instance: its deleter does nothing harmful.
  ASSERT_EQ(dfa_reserve(4096, &r, &addr), DFA_SUCCESS);
  const int64_t one = 1024;
  ASSERT_EQ(dfa_export_dlpack(r, &one, 1, 2, 32, 1, &t), DFA_SUCCESS);
  ASSERT_EQ(dfa_shutdown(), DFA_SUCCESS);
  ASSERT_EQ(dfa_init(nullptr), DFA_SUCCESS);
  t->deleter(t);
}

// Note [Reservations of the ABI]: a dfa_malloc block's segment is not the caller's to free.
TEST_F(c_api_caching, abi_refuses_the_caching_allocators_segments) {
  const size_t n = 3 << 20;
  void* p = dfa_malloc(n, 0, nullptr);
  ASSERT_NE(p, nullptr) << dfa_last_error();
  std::memset(p, 0x3C, n);
  dfa_reservation found = 0;
  EXPECT_EQ(dfa_find(p, &found), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dfa_last_error()).find("caching allocator"), std::string::npos) << dfa_last_error();
  dfa_reservation mine = 0;
  ASSERT_EQ(dfa_reserve(1 << 20, &mine, nullptr), DFA_SUCCESS);
  // Every id the manager knows that dfa_reserve did not hand out is a segment: refused.
  int segments = 0;
  const int64_t shape[1] = {16};
  DLManagedTensor* t = nullptr;
  int backed = 0;
  for (dfa_reservation id = 1; id < mine + 8; ++id) {
    if (id == mine) continue;
    const dfa_status st = dfa_free_reservation(id, nullptr);
    ASSERT_EQ(st, DFA_ERROR_INVALID_ARGUMENT) << "id " << id;
    if (std::string(dfa_last_error()).find("caching allocator") == std::string::npos) continue;
    ++segments;
    const struct {
      const char* call;
      dfa_status st;
    } rows[] = {
        {"dfa_release", dfa_release(id, 0, DFA_WHOLE, DFA_KEEP_DISCARD, nullptr)},
        {"dfa_materialize", dfa_materialize(id, 0, DFA_WHOLE, DFA_FILL_ZERO, nullptr)},
        {"dfa_record_stream", dfa_record_stream(id, nullptr)},
        {"dfa_is_backed", dfa_is_backed(id, 0, DFA_WHOLE, &backed)},
        {"dfa_export_dlpack", dfa_export_dlpack(id, shape, 1, 2, 32, 1, &t)},
    };
    for (const auto& row : rows) EXPECT_EQ(row.st, DFA_ERROR_INVALID_ARGUMENT) << row.call << " on segment " << id;
    EXPECT_NE(std::string(dfa_last_error()).find("caching allocator"), std::string::npos) << dfa_last_error();
  }
  EXPECT_GE(segments, 1) << "the block's segment must be among the ids below the last one handed out";
  // The block is intact and the allocator still serves mapped memory.
  for (size_t i = 0; i < n; i += 4096) ASSERT_EQ(static_cast<unsigned char*>(p)[i], 0x3C) << i;
  dfa_free(p, n, 0, nullptr);
  void* q = dfa_malloc(n, 0, nullptr);
  ASSERT_NE(q, nullptr) << dfa_last_error();
  std::memset(q, 0x11, n);
  dfa_free(q, n, 0, nullptr);
  EXPECT_EQ(dfa_free_reservation(mine, nullptr), DFA_SUCCESS);
}

TEST_F(c_api_caching, tagged_region_does_not_survive_shutdown) {
  ASSERT_EQ(dfa_tag_begin("left-open"), DFA_SUCCESS);
  std::thread other([] { EXPECT_EQ(dfa_tag_begin("other-thread"), DFA_SUCCESS); });
  other.join();
  ASSERT_EQ(dfa_shutdown(), DFA_SUCCESS);
  ASSERT_EQ(dfa_init(nullptr), DFA_SUCCESS) << dfa_last_error();
  EXPECT_EQ(dfa_tag_end(), DFA_ERROR_INVALID_STATE) << "the region belonged to the previous instance";
  void* p = dfa_malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr) << dfa_last_error();
  int paused = 0;
  EXPECT_EQ(dfa_tag_is_paused("left-open", &paused), DFA_ERROR_INVALID_ARGUMENT) << "the block must be untagged";
  EXPECT_EQ(dfa_tag_pause("left-open", DFA_KEEP_DISCARD, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  dfa_free(p, 4096, 0, nullptr);
}

TEST_F(c_api_caching, tag_names_lists_every_tag) {
  size_t needed = 0;
  ASSERT_EQ(dfa_tag_names(nullptr, 0, &needed), DFA_SUCCESS) << dfa_last_error();
  EXPECT_EQ(needed, 1u);
  ASSERT_EQ(dfa_tag_begin("x"), DFA_SUCCESS);
  ASSERT_EQ(dfa_tag_begin("y"), DFA_SUCCESS);
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  char small[2];
  EXPECT_EQ(dfa_tag_names(small, sizeof small, &needed), DFA_ERROR_INVALID_ARGUMENT);
  std::string text(needed, '\0');
  ASSERT_EQ(dfa_tag_names(text.data(), text.size(), &needed), DFA_SUCCESS);
  EXPECT_EQ(std::string(text.c_str()), "x\ny\n");
}

// At the C ABI: blocks of one tag freed and re-allocated under another
// never share memory, so pausing one tag leaves every block of the other mapped and intact.
TEST_F(c_api_caching, pausing_one_tag_never_unmaps_another_after_cross_tag_reuse) {
  struct block {
    void* p;
    size_t n;
    unsigned char v;
  };
  std::vector<block> a, b;
  std::mt19937 rng(10);
  auto alloc = [&](const char* tag, std::vector<block>& into) {
    const size_t n = size_t{1} << (12 + rng() % 11);  // 4 KiB .. 4 MiB
    EXPECT_EQ(dfa_tag_begin(tag), DFA_SUCCESS);
    void* p = dfa_malloc(n, 0, nullptr);
    EXPECT_EQ(dfa_tag_end(), DFA_SUCCESS);
    ASSERT_NE(p, nullptr) << dfa_last_error();
    const auto v = static_cast<unsigned char>(rng() | 1);
    std::memset(p, v, n);
    into.push_back({p, n, v});
  };
  auto drop = [&](std::vector<block>& from) {
    if (from.empty()) return;
    const size_t i = rng() % from.size();
    dfa_free(from[i].p, from[i].n, 0, nullptr);
    from.erase(from.begin() + static_cast<std::ptrdiff_t>(i));
  };
  auto intact = [](const std::vector<block>& bs) {
    for (const block& x : bs)
      for (size_t i = 0; i < x.n; i += 512)
        if (static_cast<const unsigned char*>(x.p)[i] != x.v) return false;
    return true;
  };
  for (int round = 0; round < 200; ++round) {
    alloc(round % 2 ? "a" : "b", round % 2 ? a : b);
    if (round % 3 == 0) drop(a);
    if (round % 5 == 0) drop(b);
  }
  for (int cycle = 0; cycle < 3; ++cycle) {
    ASSERT_EQ(dfa_tag_pause("a", DFA_KEEP_HOST, nullptr), DFA_SUCCESS) << dfa_last_error();
    EXPECT_TRUE(intact(b)) << "pausing 'a' changed a block of 'b'";  // an unmapped block faults here
    ASSERT_EQ(dfa_tag_resume("a", nullptr), DFA_SUCCESS) << dfa_last_error();
    EXPECT_TRUE(intact(a)) << "a block of 'a' lost its contents across pause/resume";
    ASSERT_EQ(dfa_tag_pause("b", DFA_KEEP_DISCARD, nullptr), DFA_SUCCESS) << dfa_last_error();
    EXPECT_TRUE(intact(a)) << "pausing 'b' changed a block of 'a'";
    ASSERT_EQ(dfa_tag_resume("b", nullptr), DFA_SUCCESS) << dfa_last_error();
    for (block& x : b) std::memset(x.p, x.v, x.n);  // discarded: write them again
    drop(a);
    drop(b);
    alloc("a", a);
    alloc("b", b);
  }
  for (block& x : a) dfa_free(x.p, x.n, 0, nullptr);
  for (block& x : b) dfa_free(x.p, x.n, 0, nullptr);
  EXPECT_STREQ(dfa_last_error(), "");
}

// A tag with a control character is refused where it enters: "a\nb" would split
// dfa_tag_names' list, so pausing every tag would fail.
TEST_F(c_api_caching, tag_names_with_control_characters_are_refused) {
  EXPECT_EQ(dfa_tag_begin("a\nb"), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(dfa_last_error()),
            "dfa_tag_begin: register_tag: the tag 'a\\nb' contains the control character 0x0a at offset 1; a tag name "
            "is printable text (a newline would split the list of tags, a NUL cut the name)");
  EXPECT_EQ(dfa_tag_begin("tab\there"), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_tag_begin("del\x7f"), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_tag_end(), DFA_ERROR_INVALID_STATE) << "no region was opened";
  EXPECT_EQ(dfa_tag_pause("a\nb", DFA_KEEP_DISCARD, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dfa_last_error()).find("control character 0x0a"), std::string::npos) << dfa_last_error();
  int paused = 0;
  EXPECT_EQ(dfa_tag_is_paused("x\ry", &paused), DFA_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(dfa_tag_begin("fine tag-1.ü"), DFA_SUCCESS) << "spaces, punctuation and UTF-8 are text";
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  size_t needed = 0;
  ASSERT_EQ(dfa_tag_names(nullptr, 0, &needed), DFA_SUCCESS);
  std::string text(needed, '\0');
  ASSERT_EQ(dfa_tag_names(text.data(), text.size(), &needed), DFA_SUCCESS);
  EXPECT_EQ(std::string(text.c_str()), "fine tag-1.ü\n");
}

namespace {
// Collects the library's log lines at warn (level 2) and above.
struct log_lines {
  std::vector<std::string> warn;
  static void fn(int level, const char* msg, void* user) {
    if (level <= 2) static_cast<log_lines*>(user)->warn.emplace_back(msg);
  }
};
std::string refusal() { return dfa_last_refusal(); }
}  // namespace

// A refused allocation leaves one warn line and dfa_last_refusal with
// the reason and the fix; the paused tag stays paused (allocation in a paused tag is
// refused, Note [Refusals]).
TEST_F(c_api_caching, a_refused_allocation_says_why_once) {
  log_lines logs;
  ASSERT_EQ(dfa_set_log_callback(&log_lines::fn, &logs, 2), DFA_SUCCESS);
  ASSERT_EQ(dfa_tag_begin("p"), DFA_SUCCESS);
  void* p = dfa_malloc(1 << 20, 0, nullptr);
  ASSERT_NE(p, nullptr) << dfa_last_error();
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  ASSERT_EQ(dfa_tag_pause("p", DFA_KEEP_HOST, nullptr), DFA_SUCCESS) << dfa_last_error();
  dfa_clear_last_refusal();  // thread-local: an earlier test's refusal may be there
  EXPECT_EQ(refusal(), "");
  ASSERT_EQ(dfa_tag_begin("p"), DFA_SUCCESS);
  EXPECT_EQ(dfa_malloc(100, 0, nullptr), nullptr);
  const std::string paused =
      "deferalloc refused 100 bytes (100 B) in tag 'p': the tag 'p' is paused (pause gave its memory back). Fix: "
      "resume('p') before allocating in it, or allocate outside its region.";
  EXPECT_EQ(std::string(dfa_last_error()), "dfa_malloc: " + paused);
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  EXPECT_EQ(refusal(), paused);
  ASSERT_EQ(logs.warn.size(), 1u);
  EXPECT_EQ(logs.warn[0], paused);
  dfa_empty_cache_hook();  // what PyTorch calls between its retries: the refusal stays readable
  EXPECT_EQ(refusal(), paused);
  void* q = dfa_malloc(4096, 0, nullptr);  // untagged: served, which clears it
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(refusal(), "");
  int is_paused = 0;
  ASSERT_EQ(dfa_tag_is_paused("p", &is_paused), DFA_SUCCESS);
  EXPECT_EQ(is_paused, 1) << "the refused allocation leaves the tag paused";
  ASSERT_EQ(dfa_tag_resume("p", nullptr), DFA_SUCCESS) << dfa_last_error();
  dfa_clear_last_refusal();
  EXPECT_EQ(refusal(), "");
  dfa_free(p, 0, 0, nullptr);
  dfa_free(q, 0, 0, nullptr);
  ASSERT_EQ(dfa_set_log_callback(nullptr, nullptr, 2), DFA_SUCCESS);
}

// Note [Logging outside locks] at the C ABI: lines logged under the caching allocator's
// mutex (a refusal) or under the instance's lock (the driver chosen at dfa_init) reach
// the callback after every lock is released, so a callback may call the library.
TEST_F(c_api_caching, the_log_callback_runs_outside_the_librarys_locks) {
  dfa_test::log_probe probe([] {
    int64_t v = 0;
    (void)dfa_memory_stat(0, "num_ooms", &v);  // the instance's lock, then the allocator's
  });
  ASSERT_EQ(dfa_shutdown(), DFA_SUCCESS);
  ASSERT_EQ(dfa_set_log_callback(&dfa_test::log_probe::fn, &probe, 3), DFA_SUCCESS);
  ASSERT_EQ(dfa_init("driver:auto,host_granularity_kb:64"), DFA_SUCCESS) << dfa_last_error();
  const char* n = nullptr;
  ASSERT_EQ(dfa_driver_name(&n), DFA_SUCCESS);
  const std::string name = n;
  ASSERT_EQ(dfa_tag_begin("p"), DFA_SUCCESS);
  void* p = dfa_malloc(1 << 20, 0, nullptr);
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  ASSERT_EQ(dfa_tag_pause("p", DFA_KEEP_DISCARD, nullptr), DFA_SUCCESS) << dfa_last_error();
  ASSERT_EQ(dfa_tag_begin("p"), DFA_SUCCESS);
  EXPECT_EQ(dfa_malloc(100, 0, nullptr), nullptr);
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  ASSERT_EQ(dfa_set_log_callback(nullptr, nullptr, 2), DFA_SUCCESS);
  std::size_t refusals = 0;
  for (const std::string& l : probe.lines) refusals += l.rfind("deferalloc refused 100 bytes", 0) == 0;
  EXPECT_EQ(refusals, 1u);
  if (name == "host")
    EXPECT_NE(std::find(probe.lines.begin(), probe.lines.end(), "no CUDA device: using the host driver (driver:auto)"),
              probe.lines.end());
  EXPECT_TRUE(probe.blocked.empty()) << probe.blocked.size() << " lines delivered under a lock, the first: "
                                     << probe.blocked.front();
  ASSERT_EQ(dfa_tag_resume("p", nullptr), DFA_SUCCESS) << dfa_last_error();
  dfa_free(p, 0, 0, nullptr);
}

// dfa_last_refusal is the calling thread's, and valid until its next dfa_malloc: another
// thread's refusal never shows, and a successful allocation clears an old one (PyTorch's
// note on a later, unrelated out-of-memory error would otherwise name it).
TEST_F(c_api_caching, the_last_refusal_is_this_threads_last_malloc) {
  ASSERT_EQ(dfa_tag_begin("p"), DFA_SUCCESS);
  void* p = dfa_malloc(1 << 20, 0, nullptr);
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  ASSERT_NE(p, nullptr) << dfa_last_error();
  ASSERT_EQ(dfa_tag_pause("p", DFA_KEEP_DISCARD, nullptr), DFA_SUCCESS) << dfa_last_error();
  auto refused_in_p = [](size_t bytes) {
    EXPECT_EQ(dfa_tag_begin("p"), DFA_SUCCESS);
    EXPECT_EQ(dfa_malloc(bytes, 0, nullptr), nullptr);
    EXPECT_EQ(dfa_tag_end(), DFA_SUCCESS);
    return refusal();
  };
  dfa_clear_last_refusal();
  std::string other;
  std::thread([&] { other = refused_in_p(200); }).join();
  EXPECT_EQ(other.rfind("deferalloc refused 200 bytes", 0), 0u) << other;
  EXPECT_EQ(refusal(), "") << "another thread's refusal";
  const std::string mine = refused_in_p(100);
  EXPECT_EQ(mine.rfind("deferalloc refused 100 bytes", 0), 0u) << mine;
  std::thread([&] { (void)refused_in_p(300); }).join();
  EXPECT_EQ(refusal(), mine) << "another thread's later refusal";
  void* q = dfa_malloc(4096, 0, nullptr);
  ASSERT_NE(q, nullptr) << dfa_last_error();
  EXPECT_EQ(refusal(), "") << "a successful allocation clears the old refusal";
  EXPECT_EQ(refused_in_p(100), mine);
  EXPECT_EQ(dfa_malloc(0, 0, nullptr), nullptr);
  EXPECT_EQ(refusal(), "") << "size 0 is no refusal";
  dfa_free(q, 0, 0, nullptr);
  ASSERT_EQ(dfa_tag_resume("p", nullptr), DFA_SUCCESS) << dfa_last_error();
  dfa_free(p, 0, 0, nullptr);
}

// A log callback that calls the library while a refusal's line is delivered (Python's
// garbage collector freeing a tensor): the refusal's
// message is stored after the callback ran, so dfa_last_error / dfa_last_refusal still say
// why dfa_malloc failed.
TEST_F(c_api_caching, a_callback_calling_the_library_keeps_the_refusals_message) {
  struct reentry {
    void* spare = nullptr;
    int calls = 0;
    static void fn(int level, const char* msg, void* user) {
      auto* r = static_cast<reentry*>(user);
      if (level != 2 || std::string_view(msg).rfind("deferalloc refused", 0) != 0) return;
      ++r->calls;
      dfa_free(r->spare, 0, 0, nullptr);  // succeeds: clears this thread's dfa_last_error
      r->spare = nullptr;
    }
  } r;
  r.spare = dfa_malloc(4096, 0, nullptr);
  ASSERT_NE(r.spare, nullptr) << dfa_last_error();
  ASSERT_EQ(dfa_tag_begin("p"), DFA_SUCCESS);
  void* p = dfa_malloc(1 << 20, 0, nullptr);
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  ASSERT_NE(p, nullptr) << dfa_last_error();
  ASSERT_EQ(dfa_tag_pause("p", DFA_KEEP_DISCARD, nullptr), DFA_SUCCESS) << dfa_last_error();
  ASSERT_EQ(dfa_set_log_callback(&reentry::fn, &r, 2), DFA_SUCCESS);
  ASSERT_EQ(dfa_tag_begin("p"), DFA_SUCCESS);
  EXPECT_EQ(dfa_malloc(100, 0, nullptr), nullptr);
  const std::string error = dfa_last_error();
  const std::string why = refusal();
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  ASSERT_EQ(dfa_set_log_callback(nullptr, nullptr, 2), DFA_SUCCESS);
  EXPECT_EQ(r.calls, 1);
  EXPECT_EQ(error.rfind("dfa_malloc: deferalloc refused 100 bytes", 0), 0u) << error;
  EXPECT_EQ(why.rfind("deferalloc refused 100 bytes", 0), 0u) << why;
  ASSERT_EQ(dfa_tag_resume("p", nullptr), DFA_SUCCESS) << dfa_last_error();
  dfa_free(p, 0, 0, nullptr);
}

TEST_F(c_api_caching, refusals_name_the_fraction_the_budget_and_the_device) {
  log_lines logs;
  ASSERT_EQ(dfa_set_log_callback(&log_lines::fn, &logs, 2), DFA_SUCCESS);
  // The memory fraction: 16 MiB of host capacity, half of it allowed.
  ASSERT_EQ(dfa_shutdown(), DFA_SUCCESS);
  ASSERT_EQ(dfa_init("driver:host,host_granularity_kb:64,host_capacity_mb:16"), DFA_SUCCESS) << dfa_last_error();
  ASSERT_EQ(dfa_set_memory_fraction(0.5, 0), DFA_SUCCESS);
  EXPECT_EQ(dfa_malloc(12 << 20, 0, nullptr), nullptr);
  EXPECT_EQ(refusal(),
            "deferalloc refused 12582912 bytes (12.00 MiB): the memory fraction 0.500000 allows 8388608 bytes (8.00 "
            "MiB) and 0 (0 B) are backed. Fix: free tensors, pause a tag, or raise the fraction "
            "(torch.cuda.set_per_process_memory_fraction, or memory_fraction in DEFERALLOC_CONF).");
  // The device: a deferred reservation (outside the caching allocator's fraction) holds
  // 12 of the 16 MiB, so 8 MiB fit the fraction but not the device.
  ASSERT_EQ(dfa_set_memory_fraction(1.0, 0), DFA_SUCCESS);
  dfa_reservation r = 0;
  ASSERT_EQ(dfa_reserve(12 << 20, &r, nullptr), DFA_SUCCESS) << dfa_last_error();
  ASSERT_EQ(dfa_materialize(r, 0, 12 << 20, DFA_FILL_UNDEFINED, nullptr), DFA_SUCCESS) << dfa_last_error();
  EXPECT_EQ(dfa_malloc(8 << 20, 0, nullptr), nullptr);
  const std::string dev = refusal();
  // (The free bytes depend on what the failed attempt left cached in the pool.)
  EXPECT_EQ(dev.rfind("deferalloc refused 8388608 bytes (8.00 MiB): the device is out of memory: ", 0), 0u) << dev;
  EXPECT_NE(dev.find(" of 16777216 bytes ("), std::string::npos) << dev;
  EXPECT_NE(dev.find(" of 16.00 MiB) are free; deferalloc holds 0 bytes backed, 0 of them allocated (out of memory "),
            std::string::npos)
      << dev;
  EXPECT_TRUE(dev.ends_with(". Fix: free tensors, pause a tag (deferalloc.pause), or make the other users of the "
                            "device give memory back."))
      << dev;
  // The pool's budget.
  ASSERT_EQ(dfa_shutdown(), DFA_SUCCESS);
  ASSERT_EQ(dfa_init("driver:host,host_granularity_kb:64,pool_budget_mb:4"), DFA_SUCCESS) << dfa_last_error();
  EXPECT_EQ(dfa_malloc(6 << 20, 0, nullptr), nullptr);
  const std::string budget = refusal();
  EXPECT_EQ(budget.rfind("deferalloc refused 6291456 bytes (6.00 MiB): the chunk pool's budget of 4194304 bytes (4.00 "
                         "MiB) is reached (",
                         0),
            0u)
      << budget;
  EXPECT_NE(budget.find(" bytes alive) (out of memory backing "), std::string::npos) << budget;
  EXPECT_TRUE(budget.ends_with(". Fix: free tensors, pause a tag, or raise pool_budget_mb in DEFERALLOC_CONF.")) << budget;
  ASSERT_EQ(logs.warn.size(), 3u) << "one warn line per refused allocation";
  EXPECT_EQ(logs.warn[2], budget);
  ASSERT_EQ(dfa_set_log_callback(nullptr, nullptr, 2), DFA_SUCCESS);
}

// At the C ABI: a tag's freed blocks go back to the device with
// empty_cache while another tag's live blocks keep their memory and contents.
TEST_F(c_api_caching, a_tags_freed_memory_goes_back_and_the_other_tag_stays) {
  std::vector<void*> live, gone;
  ASSERT_EQ(dfa_tag_begin("live"), DFA_SUCCESS);
  for (int i = 0; i < 8; ++i) {
    live.push_back(dfa_malloc(1 << 20, 0, nullptr));
    ASSERT_NE(live.back(), nullptr) << dfa_last_error();
    std::memset(live.back(), 0x40 + i, 1 << 20);
  }
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  const int64_t live_backed = stat("deferalloc.backed_bytes");
  ASSERT_EQ(dfa_tag_begin("freed"), DFA_SUCCESS);
  for (int i = 0; i < 64; ++i) {
    gone.push_back(dfa_malloc((1 << 20) + 4096 * i, 0, nullptr));
    ASSERT_NE(gone.back(), nullptr) << dfa_last_error();
  }
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  EXPECT_GT(stat("deferalloc.backed_bytes"), live_backed + (64 << 20));
  for (void* p : gone) dfa_free(p, 0, 0, nullptr);
  size_t released = 0;
  ASSERT_EQ(dfa_empty_cache(0, &released), DFA_SUCCESS) << dfa_last_error();
  EXPECT_GE(released, size_t{64} << 20);
  EXPECT_EQ(stat("deferalloc.backed_bytes"), live_backed) << "every chunk of the freed tag went back";
  EXPECT_LE(stat("deferalloc.pool.alive_bytes"), live_backed) << "and on to the device (physical-memory policy)";
  for (int i = 0; i < 8; ++i) {
    const auto* c = static_cast<const unsigned char*>(live[i]);
    EXPECT_TRUE(c[0] == 0x40 + i && c[(1 << 20) - 1] == 0x40 + i) << "live block " << i << " changed";
    dfa_free(live[i], 0, 0, nullptr);
  }
}

// At the C ABI: the snapshot lists segments, backed runs, blocks, tags,
// paused ranges and the recorded events (Note [Memory snapshots]).
TEST_F(c_api_caching, memory_snapshot_lists_state_and_recorded_events) {
  ASSERT_EQ(dfa_record_memory_history(100), DFA_SUCCESS) << dfa_last_error();
  void* a = dfa_malloc(1 << 20, 0, nullptr);
  ASSERT_EQ(dfa_tag_begin("t"), DFA_SUCCESS);
  void* b = dfa_malloc(2 << 20, 0, nullptr);
  ASSERT_EQ(dfa_tag_end(), DFA_SUCCESS);
  ASSERT_TRUE(a && b) << dfa_last_error();
  dfa_free(a, 0, 0, nullptr);
  ASSERT_EQ(dfa_tag_pause("t", DFA_KEEP_DISCARD, nullptr), DFA_SUCCESS) << dfa_last_error();
  size_t needed = 0;
  ASSERT_EQ(dfa_memory_snapshot(nullptr, 0, &needed), DFA_SUCCESS) << dfa_last_error();
  std::string text(needed, '\0');
  ASSERT_EQ(dfa_memory_snapshot(text.data(), text.size(), &needed), DFA_SUCCESS) << dfa_last_error();
  text.resize(needed - 1);
  const char* want[] = {"D 0\n",          "\nG 2 0 1 0 t\n",       "\nS 2 ",          "\nB ",
                        "\nP 2 ",         "\nE segment_map ",      "\nE alloc ",      "\nE free_requested ",
                        "\nE free_completed ", "\nE segment_unmap "};
  for (const char* w : want) EXPECT_NE(text.find(w), std::string::npos) << "missing '" << w << "' in\n" << text;
  ASSERT_EQ(dfa_record_memory_history(0), DFA_SUCCESS);
  ASSERT_EQ(dfa_memory_snapshot(text.data(), text.size(), &needed), DFA_SUCCESS);
  EXPECT_EQ(std::string(text.c_str()).find("\nE "), std::string::npos) << "stopping drops the events";
  ASSERT_EQ(dfa_tag_resume("t", nullptr), DFA_SUCCESS);
  dfa_free(b, 0, 0, nullptr);
}

// A deferred reservation's backed runs ("R" after its "Q" line) are its backed granules,
// adjacent chunks merged, the same as asking granule by granule.
TEST_F(c_api_caching, memory_snapshot_lists_a_reservations_backed_runs) {
  size_t g = 0;
  ASSERT_EQ(dfa_granularity(&g), DFA_SUCCESS);
  dfa_reservation r = 0;
  ASSERT_EQ(dfa_reserve(16 * g, &r, nullptr), DFA_SUCCESS) << dfa_last_error();
  const std::pair<size_t, size_t> backed[] = {{1, 2}, {3, 1}, {6, 1}, {9, 7}};  // [1, 4) from two calls
  for (auto [first, n] : backed)
    ASSERT_EQ(dfa_materialize(r, first * g, n * g, DFA_FILL_UNDEFINED, nullptr), DFA_SUCCESS) << dfa_last_error();
  ASSERT_EQ(dfa_release(r, 12 * g, g, DFA_KEEP_DISCARD, nullptr), DFA_SUCCESS) << dfa_last_error();
  std::string want;  // granule by granule, as the snapshot used to ask
  int on[17] = {};
  for (size_t i = 0; i < 16; ++i) ASSERT_EQ(dfa_is_backed(r, i * g, g, &on[i]), DFA_SUCCESS);
  for (size_t i = 0, j = 0; i < 16; i = j + 1) {
    for (j = i; on[j]; ++j) {
    }
    if (j > i) want += "R " + std::to_string(i * g) + " " + std::to_string((j - i) * g) + "\n";
  }
  EXPECT_EQ(want, "R " + std::to_string(g) + " " + std::to_string(3 * g) + "\nR " + std::to_string(6 * g) + " " +
                      std::to_string(g) + "\nR " + std::to_string(9 * g) + " " + std::to_string(3 * g) + "\nR " +
                      std::to_string(13 * g) + " " + std::to_string(3 * g) + "\n");
  size_t needed = 0;
  ASSERT_EQ(dfa_memory_snapshot(nullptr, 0, &needed), DFA_SUCCESS) << dfa_last_error();
  std::string text(needed, '\0');
  ASSERT_EQ(dfa_memory_snapshot(text.data(), text.size(), &needed), DFA_SUCCESS) << dfa_last_error();
  text.resize(needed - 1);
  const std::size_t q = text.find("\nQ " + std::to_string(r) + " ");
  ASSERT_NE(q, std::string::npos) << text;
  const std::size_t runs = text.find('\n', q + 1) + 1;
  const std::size_t end = text.find("\nQ ", runs);
  EXPECT_EQ(text.substr(runs, end == std::string::npos ? std::string::npos : end + 1 - runs), want) << text;
  ASSERT_EQ(dfa_free_reservation(r, nullptr), DFA_SUCCESS);
}

// The history is a ring of the newest max_entries events, oldest first.
TEST_F(c_api_caching, memory_history_keeps_the_newest_events_in_order) {
  ASSERT_EQ(dfa_record_memory_history(5), DFA_SUCCESS) << dfa_last_error();
  std::vector<void*> ps;
  for (int i = 0; i < 9; ++i) ps.push_back(dfa_malloc(4096 * (i + 1), 0, nullptr));
  for (void* p : ps) dfa_free(p, 0, 0, nullptr);  // 9 x (free_requested, free_completed) after the allocs
  size_t needed = 0;
  ASSERT_EQ(dfa_memory_snapshot(nullptr, 0, &needed), DFA_SUCCESS);
  std::string text(needed, '\0');
  ASSERT_EQ(dfa_memory_snapshot(text.data(), text.size(), &needed), DFA_SUCCESS);
  std::vector<std::string> events;
  for (std::size_t at = text.find("\nE "); at != std::string::npos; at = text.find("\nE ", at + 1))
    events.push_back(text.substr(at + 3, text.find('\n', at + 1) - at - 3));
  ASSERT_EQ(events.size(), 5u) << text;
  char last[64];
  std::snprintf(last, sizeof last, "free_completed %llu 36864 ",
                static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(ps[8])));
  EXPECT_EQ(events[4].rfind(last, 0), 0u) << events[4];
  EXPECT_EQ(events[0].rfind("free_completed ", 0), 0u) << events[0];
  EXPECT_EQ(events[1].rfind("free_requested ", 0), 0u) << events[1];
  ASSERT_EQ(dfa_record_memory_history(0), DFA_SUCCESS);
}
