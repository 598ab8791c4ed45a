// The C ABI on the host driver (DEFERALLOC_CONF set by ctest): every bad input gets
// its status and a message naming the call, and changes nothing.
#include <deferalloc/deferalloc.h>
#include <gtest/gtest.h>

#include <climits>
#include <csignal>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace {

class c_api : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(dfa_init(nullptr), DFA_SUCCESS) << dfa_last_error(); }
  void TearDown() override { EXPECT_EQ(dfa_shutdown(), DFA_SUCCESS); }
};

// An enumeration object holding `v`, as a C caller (or ctypes) passes an int: the bytes
// are copied, no conversion to the enumeration takes place here.
template <typename E>
E raw_enum(int v) {
  static_assert(sizeof(E) == sizeof(int));
  E e;
  std::memcpy(&e, &v, sizeof e);
  return e;
}

}  // namespace

TEST_F(c_api, reserve_materialize_release_free) {
  const char* name = nullptr;
  ASSERT_EQ(dfa_driver_name(&name), DFA_SUCCESS);
  EXPECT_STREQ(name, "host");
  size_t g = 0;
  ASSERT_EQ(dfa_granularity(&g), DFA_SUCCESS);
  dfa_reservation r = 0;
  void* p = nullptr;
  ASSERT_EQ(dfa_reserve(3 * g + 10, &r, &p), DFA_SUCCESS);
  ASSERT_NE(p, nullptr);
  int backed = -1;
  ASSERT_EQ(dfa_is_backed(r, 0, DFA_WHOLE, &backed), DFA_SUCCESS);
  EXPECT_EQ(backed, 0);
  ASSERT_EQ(dfa_materialize(r, 0, DFA_WHOLE, DFA_FILL_ZERO, nullptr), DFA_SUCCESS) << dfa_last_error();
  std::memset(p, 0x5A, 3 * g + 10);
  ASSERT_EQ(dfa_release(r, 0, 3 * g + 10, DFA_KEEP_HOST, nullptr), DFA_SUCCESS) << dfa_last_error();
  ASSERT_EQ(dfa_materialize(r, 0, DFA_WHOLE, DFA_FILL_RESTORE, nullptr), DFA_SUCCESS) << dfa_last_error();
  EXPECT_EQ(static_cast<unsigned char*>(p)[3 * g + 9], 0x5A);
  dfa_reservation found = 0;
  ASSERT_EQ(dfa_find(static_cast<char*>(p) + g, &found), DFA_SUCCESS);
  EXPECT_EQ(found, r);
  dfa_stats st{};
  ASSERT_EQ(dfa_get_stats(&st), DFA_SUCCESS);
  EXPECT_EQ(st.reservations, 1u);
  EXPECT_EQ(st.backed_bytes, 4 * g);
  ASSERT_EQ(dfa_free_reservation(r, nullptr), DFA_SUCCESS);
  size_t released = 0;
  ASSERT_EQ(dfa_trim(0, &released), DFA_SUCCESS);
  EXPECT_GE(released, 4 * g);
  EXPECT_STREQ(dfa_last_error(), "");
}

// A hidden reservation (Note [Hidden reservations]): dfa_find refuses every pointer in it
// with the owner's words; its owner's calls on the id still act on it; freed, the id is gone.
TEST_F(c_api, hidden_reservation_is_refused_by_find) {
  size_t g = 0;
  dfa_reservation r = 0, found = 0;
  void* p = nullptr;
  ASSERT_EQ(dfa_granularity(&g), DFA_SUCCESS);
  ASSERT_EQ(dfa_reserve(4 * g, &r, &p), DFA_SUCCESS);
  ASSERT_EQ(dfa_hide_reservation(r, "arena 'x' of a test"), DFA_SUCCESS) << dfa_last_error();
  for (size_t off : {size_t{0}, g + 7, 4 * g - 1}) {
    ASSERT_EQ(dfa_find(static_cast<char*>(p) + off, &found), DFA_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(dfa_last_error()).find("arena 'x' of a test"), std::string::npos) << dfa_last_error();
  }
  EXPECT_EQ(found, 0u);
  ASSERT_EQ(dfa_materialize_whole_pieces(r, g, g, DFA_FILL_ZERO, nullptr), DFA_SUCCESS) << dfa_last_error();
  int backed = 0;
  ASSERT_EQ(dfa_is_backed(r, g, g, &backed), DFA_SUCCESS);
  EXPECT_EQ(backed, 1);
  EXPECT_EQ(dfa_hide_reservation(r, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(dfa_free_reservation(r, nullptr), DFA_SUCCESS);
  EXPECT_EQ(dfa_hide_reservation(r, "gone"), DFA_ERROR_INVALID_ARGUMENT);
}

// The batched calls: many whole reservations released with their contents kept and backed
// again bit-exactly, one id that is not a reservation refusing the whole batch.
TEST_F(c_api, release_and_materialize_many) {
  size_t g = 0;
  ASSERT_EQ(dfa_granularity(&g), DFA_SUCCESS);
  constexpr int n = 5;
  dfa_reservation rs[n]{};
  void* ps[n]{};
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(dfa_reserve((i + 1) * g, &rs[i], &ps[i]), DFA_SUCCESS);
    ASSERT_EQ(dfa_materialize(rs[i], 0, DFA_WHOLE, DFA_FILL_ZERO, nullptr), DFA_SUCCESS) << dfa_last_error();
    std::memset(ps[i], 0x30 + i, (i + 1) * g);
  }
  ASSERT_EQ(dfa_release_many(rs, n, DFA_KEEP_HOST, nullptr), DFA_SUCCESS) << dfa_last_error();
  dfa_stats st{};
  ASSERT_EQ(dfa_get_stats(&st), DFA_SUCCESS);
  EXPECT_EQ(st.backed_bytes, 0u);
  ASSERT_EQ(dfa_materialize_many(rs, n, DFA_FILL_RESTORE, nullptr), DFA_SUCCESS) << dfa_last_error();
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(static_cast<unsigned char*>(ps[i])[0], 0x30 + i);
    EXPECT_EQ(static_cast<unsigned char*>(ps[i])[(i + 1) * g - 1], 0x30 + i);
  }
  dfa_reservation bad[2] = {rs[0], rs[n - 1] + 1000};
  EXPECT_EQ(dfa_release_many(bad, 2, DFA_KEEP_DISCARD, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  int backed = 0;
  ASSERT_EQ(dfa_is_backed(rs[0], 0, DFA_WHOLE, &backed), DFA_SUCCESS);
  EXPECT_EQ(backed, 1);  // nothing released
  EXPECT_EQ(dfa_release_many(nullptr, 1, DFA_KEEP_DISCARD, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_release_many(nullptr, 0, DFA_KEEP_DISCARD, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_release_many(rs, n, DFA_KEEP_DISCARD, nullptr), DFA_SUCCESS) << dfa_last_error();
  ASSERT_EQ(dfa_materialize_many(rs, n, DFA_FILL_UNDEFINED, nullptr), DFA_SUCCESS) << dfa_last_error();

  // Only the kept ranges copied: the last granule of rs[1], the second of rs[4].
  std::memset(ps[1], 0x41, 2 * g);
  std::memset(ps[4], 0x44, 5 * g);
  const dfa_range kept[2] = {{rs[4], g, g}, {rs[1], g, g}};
  const dfa_range outside[1] = {{rs[0] + 1000, 0, g}};
  EXPECT_EQ(dfa_release_many_keeping(rs, n, outside, 1, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_release_many_keeping(rs, n, nullptr, 1, nullptr), DFA_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(dfa_get_stats(&st), DFA_SUCCESS);
  const size_t saved = st.backup_bytes;
  ASSERT_EQ(dfa_release_many_keeping(rs, n, kept, 2, nullptr), DFA_SUCCESS) << dfa_last_error();
  ASSERT_EQ(dfa_get_stats(&st), DFA_SUCCESS);
  EXPECT_EQ(st.backed_bytes, 0u);
  EXPECT_EQ(st.backup_bytes - saved, 2 * g);
  EXPECT_EQ(dfa_materialize_whole_pieces(rs[1], 0, DFA_WHOLE, static_cast<dfa_fill>(7), nullptr), DFA_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(dfa_materialize_whole_pieces(rs[1], 0, DFA_WHOLE, DFA_FILL_RESTORE, nullptr), DFA_SUCCESS) << dfa_last_error();
  ASSERT_EQ(dfa_materialize_many(rs, n, DFA_FILL_RESTORE, nullptr), DFA_SUCCESS) << dfa_last_error();
  EXPECT_EQ(static_cast<unsigned char*>(ps[1])[g], 0x41);
  EXPECT_EQ(static_cast<unsigned char*>(ps[4])[2 * g - 1], 0x44);
  for (int i = 0; i < n; ++i) ASSERT_EQ(dfa_free_reservation(rs[i], nullptr), DFA_SUCCESS);
}

TEST_F(c_api, bad_input_table) {
  size_t g = 0;
  ASSERT_EQ(dfa_granularity(&g), DFA_SUCCESS);
  dfa_reservation r = 0;
  void* p = nullptr;
  ASSERT_EQ(dfa_reserve(4 * g, &r, &p), DFA_SUCCESS);
  ASSERT_EQ(dfa_materialize(r, 0, 2 * g, DFA_FILL_ZERO, nullptr), DFA_SUCCESS);
  dfa_stats before{};
  ASSERT_EQ(dfa_get_stats(&before), DFA_SUCCESS);
  dfa_reservation out = 0;
  int flag = 0;
  struct row {
    const char* call;
    std::function<dfa_status()> f;
    dfa_status expect;
  };
  const std::vector<row> table = {
      {"dfa_reserve", [&] { return dfa_reserve(0, &out, nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_reserve", [&] { return dfa_reserve(g, nullptr, nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_reserve", [&] { return dfa_reserve(SIZE_MAX, &out, nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_materialize", [&] { return dfa_materialize(r + 100, 0, g, DFA_FILL_ZERO, nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_materialize", [&] { return dfa_materialize(r, 3, g, DFA_FILL_ZERO, nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_materialize", [&] { return dfa_materialize(r, 0, 9 * g, DFA_FILL_ZERO, nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_materialize", [&] { return dfa_materialize(r, 0, g, static_cast<dfa_fill>(7), nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_materialize", [&] { return dfa_materialize(r, 2 * g, g, DFA_FILL_RESTORE, nullptr); }, DFA_ERROR_INVALID_STATE},
      {"dfa_release", [&] { return dfa_release(r, 0, 0, DFA_KEEP_DISCARD, nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_release", [&] { return dfa_release(r, 0, g, static_cast<dfa_keep>(9), nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_is_backed", [&] { return dfa_is_backed(r, 0, g, nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_find", [&] { return dfa_find(nullptr, &out); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_find", [&] { return dfa_find(&flag, &out); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_get_stats", [&] { return dfa_get_stats(nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
      {"dfa_init", [&] { return dfa_init("driver:host"); }, DFA_ERROR_INVALID_STATE},
      {"dfa_free_reservation", [&] { return dfa_free_reservation(r + 100, nullptr); }, DFA_ERROR_INVALID_ARGUMENT},
  };
  for (const auto& row : table) {
    EXPECT_EQ(row.f(), row.expect) << row.call;
    const std::string msg = dfa_last_error();
    EXPECT_EQ(msg.rfind(std::string(row.call) + ": ", 0), 0u) << "message must name the call: " << msg;
    dfa_stats now{};
    ASSERT_EQ(dfa_get_stats(&now), DFA_SUCCESS);
    EXPECT_EQ(now.backed_bytes, before.backed_bytes) << row.call;
    EXPECT_EQ(now.reservations, before.reservations) << row.call;
    EXPECT_EQ(std::memcmp(now.driver_calls, before.driver_calls, sizeof now.driver_calls), 0) << row.call;
  }
  ASSERT_EQ(dfa_free_reservation(r, nullptr), DFA_SUCCESS);
  EXPECT_EQ(dfa_free_reservation(r, nullptr), DFA_ERROR_INVALID_ARGUMENT) << "double free";
  EXPECT_NE(std::string(dfa_last_error()).find("unknown reservation"), std::string::npos) << dfa_last_error();
}

// A release that cuts through a chunk larger than the largest class (an exact chunk of
// dfa_materialize_whole_pieces) splits it (Note [Splitting chunks]): the rest keeps its bytes.
TEST(c_api_split, chunk_larger_than_the_largest_class) {
  ASSERT_EQ(dfa_init("driver:host,host_granularity_kb:64,chunk_classes_mb:1"), DFA_SUCCESS) << dfa_last_error();
  constexpr size_t mib = size_t{1} << 20, bytes = 6 * mib;
  dfa_reservation r = 0;
  void* p = nullptr;
  ASSERT_EQ(dfa_reserve(bytes, &r, &p), DFA_SUCCESS);
  dfa_stats s0{};
  ASSERT_EQ(dfa_get_stats(&s0), DFA_SUCCESS);
  ASSERT_EQ(dfa_materialize_whole_pieces(r, 0, bytes, DFA_FILL_UNDEFINED, nullptr), DFA_SUCCESS) << dfa_last_error();
  dfa_stats s1{};
  ASSERT_EQ(dfa_get_stats(&s1), DFA_SUCCESS);
  EXPECT_EQ(s1.driver_calls[4] - s0.driver_calls[4], 1u) << "one map: one chunk of 6 MiB";
  auto* b = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < bytes; i += 4096) b[i] = static_cast<unsigned char>(i / 4096 % 251);
  ASSERT_EQ(dfa_release(r, 2 * mib, mib, DFA_KEEP_DISCARD, nullptr), DFA_SUCCESS) << dfa_last_error();
  int backed = -1;
  ASSERT_EQ(dfa_is_backed(r, 2 * mib, mib, &backed), DFA_SUCCESS);
  EXPECT_EQ(backed, 0);
  for (auto [off, len] : {std::pair{size_t{0}, 2 * mib}, std::pair{3 * mib, 3 * mib}}) {
    ASSERT_EQ(dfa_is_backed(r, off, len, &backed), DFA_SUCCESS);
    EXPECT_EQ(backed, 1);
    for (size_t i = off; i < off + len; i += 4096) ASSERT_EQ(b[i], i / 4096 % 251) << i;
  }
  ASSERT_EQ(dfa_free_reservation(r, nullptr), DFA_SUCCESS);
  EXPECT_EQ(dfa_shutdown(), DFA_SUCCESS);
}

TEST(c_api_init, unknown_config_key_is_refused_with_the_valid_keys) {
  EXPECT_EQ(dfa_init("driver:host,bogus:1"), DFA_ERROR_INVALID_ARGUMENT);
  const std::string msg = dfa_last_error();
  EXPECT_NE(msg.find("dfa_init: "), std::string::npos) << msg;
  EXPECT_NE(msg.find("valid keys"), std::string::npos) << msg;
  EXPECT_EQ(dfa_shutdown(), DFA_SUCCESS);
}

TEST(c_api_init, cuda_driver_without_a_device_is_a_clear_error) {
  if (dfa_init("driver:cuda") == DFA_SUCCESS) {
    dfa_shutdown();
    GTEST_SKIP() << "a CUDA device is present";
  }
  EXPECT_NE(std::string(dfa_last_error()).find("cuda_driver"), std::string::npos) << dfa_last_error();
}

TEST_F(c_api, out_of_range_modes_are_refused_as_integers) {
  size_t g = 0;
  ASSERT_EQ(dfa_granularity(&g), DFA_SUCCESS);
  dfa_reservation r = 0;
  ASSERT_EQ(dfa_reserve(2 * g, &r, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_materialize(r, 0, g, DFA_FILL_ZERO, nullptr), DFA_SUCCESS);
  dfa_stats before{};
  ASSERT_EQ(dfa_get_stats(&before), DFA_SUCCESS);
  for (int v : {3, 4, 7, 255, -1, INT_MAX, INT_MIN}) {
    EXPECT_EQ(dfa_materialize(r, g, g, raw_enum<dfa_fill>(v), nullptr), DFA_ERROR_INVALID_ARGUMENT) << v;
    EXPECT_NE(std::string(dfa_last_error()).find("fill " + std::to_string(v) + " is not"), std::string::npos)
        << dfa_last_error();
  }
  for (int v : {2, 3, 255, -1, INT_MAX, INT_MIN}) {
    EXPECT_EQ(dfa_release(r, 0, g, raw_enum<dfa_keep>(v), nullptr), DFA_ERROR_INVALID_ARGUMENT) << v;
    EXPECT_NE(std::string(dfa_last_error()).find("keep " + std::to_string(v) + " is not"), std::string::npos)
        << dfa_last_error();
    EXPECT_EQ(dfa_tag_pause("t", raw_enum<dfa_keep>(v), nullptr), DFA_ERROR_INVALID_ARGUMENT) << v;
  }
  dfa_stats now{};
  ASSERT_EQ(dfa_get_stats(&now), DFA_SUCCESS);
  EXPECT_EQ(now.backed_bytes, before.backed_bytes);
  EXPECT_EQ(std::memcmp(now.driver_calls, before.driver_calls, sizeof now.driver_calls), 0);
  EXPECT_EQ(dfa_free_reservation(r, nullptr), DFA_SUCCESS);
}

// Note [Released-memory faults]: the process still dies of SIGSEGV, but says why first.
TEST_F(c_api, touching_released_memory_names_the_reservation) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  size_t g = 0;
  ASSERT_EQ(dfa_granularity(&g), DFA_SUCCESS);
  dfa_reservation r = 0;
  void* p = nullptr;
  ASSERT_EQ(dfa_reserve(4 * g, &r, &p), DFA_SUCCESS);
  ASSERT_EQ(dfa_materialize(r, 0, DFA_WHOLE, DFA_FILL_ZERO, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_release(r, 2 * g, g, DFA_KEEP_DISCARD, nullptr), DFA_SUCCESS);
  volatile char* bytes = static_cast<char*>(p);
  bytes[g] = 1;  // still backed: fine
  const std::string expect = "reservation " + std::to_string(r) + " \\(address 0x[0-9a-f]+, " + std::to_string(4 * g) +
                             " bytes\\), offset " + std::to_string(2 * g + 8) + ", touched while released";
  EXPECT_EXIT(bytes[2 * g + 8] = 1, ::testing::KilledBySignal(SIGSEGV), expect);
  // A fault outside every reservation is handed on unnamed (the default action here).
  EXPECT_EXIT(*static_cast<volatile int*>(nullptr) = 1, ::testing::KilledBySignal(SIGSEGV), "^$");
  EXPECT_EQ(dfa_free_reservation(r, nullptr), DFA_SUCCESS);
}
