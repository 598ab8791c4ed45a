// The optimizer's settings table (optimizer/settings.cpp) and its typed C config
// (dfa_optimizer_config): the allocator's list of the keys it does not own equals this
// table, docs/SETTINGS.md documents it, and the struct, the string and DEFERALLOC_CONF's
// grammar give the same optimizer.
#include <deferalloc/core/errors.hpp>
#include <deferalloc/optim/optimizer_settings.hpp>
#include <deferalloc/optimizer.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "settings_doc.hpp"

namespace {

using namespace deferalloc;
using namespace deferalloc::optim;

std::vector<std::string> table_keys() {
  std::vector<std::string> out;
  for (const setting_doc& d : optimizer_settings_table()) out.emplace_back(d.key);
  return out;
}

// Note [Keys other libraries own] in allocator/core/config.cpp.
TEST(optimizer_settings, the_allocator_names_exactly_this_tables_keys) {
  EXPECT_EQ(other_libraries_keys(), table_keys())
      << "allocator/core/config.cpp's k_other_libraries_keys must list optimizer/settings.cpp's keys, in order";
  for (const setting_doc& d : settings_table())
    for (const std::string& k : table_keys()) EXPECT_NE(k, d.key) << "a key in both tables";
}

TEST(optimizer_settings, docs_list_the_table) {
  dfa_test::expect_documented(DFA_SETTINGS_DOC, "## The optimizer's keys", optimizer_settings_table());
}

TEST(optimizer_settings, every_key_sets_optimizer_config) {
  const engine_settings d = parse_optimizer_settings("");
  const optimizer_config c0;
  EXPECT_EQ(d.optimizer.home, c0.home);
  EXPECT_EQ(d.optimizer.window_bytes, c0.window_bytes);
  EXPECT_EQ(d.optimizer.io_threads, c0.io_threads);
  EXPECT_EQ(d.allocator.driver, settings{}.driver);

  const engine_settings s = parse_optimizer_settings(
      "driver:host,host_granularity_kb:64,log_level:error,tier:file,directory:/tmp/x,window_mb:64,depth:4,resume:1,"
      "rank:3,io_threads:2,io_request_mb:16,keep_window:7,resident_mb:128,moments:bf16,progress_line:0");
  EXPECT_EQ(s.allocator.driver, driver_kind::host);
  EXPECT_EQ(s.allocator.host_granularity, 64u << 10);
  EXPECT_EQ(s.allocator.level, log_level::error);
  const optimizer_config& o = s.optimizer;
  EXPECT_EQ(o.home, tier::file);
  EXPECT_EQ(o.directory, "/tmp/x");
  EXPECT_EQ(o.window_bytes, std::size_t{64} << 20);
  EXPECT_EQ(o.depth, 4);
  EXPECT_EQ(o.resume, true);
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.io_threads, 2);
  EXPECT_EQ(o.io_request_bytes, std::size_t{16} << 20);
  EXPECT_EQ(o.keep_window, true) << "any nonzero integer is true, as before";
  EXPECT_EQ(o.resident_bytes, std::size_t{128} << 20);
  EXPECT_EQ(o.moments, moment_format::bf16);
  EXPECT_EQ(o.progress_line, false);

  for (const char* bad : {"window_mb:17592186044416", "depth:2147483648", "rank:-1", "io_threads:x", "tier:[host]",
                          "tier:disk", "moments:int4", "resume:[1]", "pool_budget_mb:-1", "driver:gpu"}) {
    const std::string key(bad, std::string_view(bad).find(':'));
    try {
      (void)parse_optimizer_settings(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const invalid_argument& e) {
      const std::string w = e.what();
      EXPECT_TRUE(w.find(key) != std::string::npos || w.find(bad + key.size() + 1) != std::string::npos) << bad << ": " << w;
    }
  }
}

TEST(optimizer_settings, an_unknown_key_lists_both_tables) {
  try {
    (void)parse_optimizer_settings("driver:host,colour:blue");
    FAIL() << "no error";
  } catch (const invalid_argument& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("unknown key 'colour'"), std::string::npos) << w;
    EXPECT_NE(w.find(settings_keys()), std::string::npos) << w;
    for (const std::string& k : table_keys()) EXPECT_NE(w.find(k), std::string::npos) << k << ": " << w;
  }
}

dfa_optimizer_config initialized() {
  dfa_optimizer_config c{};
  c.struct_size = sizeof c;
  EXPECT_EQ(dfa_opt_config_init(&c), DFA_SUCCESS) << dfa_opt_last_error();
  return c;
}

TEST(optimizer_settings, config_init_gives_the_tables_defaults) {
  const dfa_optimizer_config c = initialized();
  const engine_settings d = parse_optimizer_settings("");
  EXPECT_EQ(c.struct_size, sizeof c);
  EXPECT_EQ(c.driver, DFA_DRIVER_AUTO);
  EXPECT_EQ(c.device, 0);
  EXPECT_EQ(c.allocator_settings, nullptr);
  EXPECT_EQ(c.tier, DFA_TIER_HOST);
  EXPECT_EQ(c.directory, nullptr);
  EXPECT_EQ(c.window_mb << 20, d.optimizer.window_bytes);
  EXPECT_EQ(c.depth, d.optimizer.depth);
  EXPECT_EQ(c.resume != 0, d.optimizer.resume);
  EXPECT_EQ(c.rank, d.optimizer.rank);
  EXPECT_EQ(c.io_threads, d.optimizer.io_threads);
  EXPECT_EQ(c.io_request_mb << 20, d.optimizer.io_request_bytes);
  EXPECT_EQ(c.keep_window != 0, d.optimizer.keep_window);
  EXPECT_EQ(c.resident_mb << 20, d.optimizer.resident_bytes);
  EXPECT_EQ(c.moments, DFA_MOMENTS_FP32);
  EXPECT_EQ(c.progress_line != 0, d.optimizer.progress_line);
}

TEST(optimizer_settings, a_struct_of_another_size_is_refused) {
  dfa_optimizer_config c{};
  c.struct_size = sizeof c - 8;
  EXPECT_EQ(dfa_opt_config_init(&c), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dfa_opt_last_error()).find("struct_size"), std::string::npos) << dfa_opt_last_error();
  dfa_optimizer* o = nullptr;
  c = initialized();
  c.struct_size += 8;
  EXPECT_EQ(dfa_opt_create_with_config(&c, &o), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dfa_opt_last_error()).find("struct_size"), std::string::npos) << dfa_opt_last_error();
  EXPECT_EQ(dfa_opt_create_with_config(nullptr, &o), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(o, nullptr);
}

TEST(optimizer_settings, bad_fields_are_refused_by_their_keys_rows) {
  struct bad {
    void (*change)(dfa_optimizer_config&);
    const char* says;
  };
  const bad table[] = {
      {[](dfa_optimizer_config& c) { c.window_mb = std::uint64_t{1} << 44; }, "window_mb"},
      {[](dfa_optimizer_config& c) { c.depth = -1; }, "depth"},
      {[](dfa_optimizer_config& c) { c.io_threads = -2; }, "io_threads"},
      {[](dfa_optimizer_config& c) { c.device = 1024; }, "device"},
      {[](dfa_optimizer_config& c) { c.tier = 3; }, "tier"},
      {[](dfa_optimizer_config& c) { c.moments = -1; }, "moments"},
      {[](dfa_optimizer_config& c) { c.driver = 9; }, "driver"},
      {[](dfa_optimizer_config& c) { c.allocator_settings = "tier:file"; }, "tier"},
      {[](dfa_optimizer_config& c) { c.allocator_settings = "device:1"; }, "device"},
      {[](dfa_optimizer_config& c) { c.allocator_settings = "host_granularity_kb:12"; }, "host_granularity_kb"},
      {[](dfa_optimizer_config& c) { c.allocator_settings = "colour:blue"; }, "colour"},
      {[](dfa_optimizer_config& c) { c.tier = DFA_TIER_FILE; }, "directory"},
  };
  for (const bad& b : table) {
    dfa_optimizer_config c = initialized();
    c.driver = DFA_DRIVER_HOST;
    b.change(c);
    dfa_optimizer* o = nullptr;
    EXPECT_EQ(dfa_opt_create_with_config(&c, &o), DFA_ERROR_INVALID_ARGUMENT) << b.says;
    EXPECT_NE(std::string(dfa_opt_last_error()).find(b.says), std::string::npos) << dfa_opt_last_error();
    EXPECT_EQ(o, nullptr);
  }
}

// The struct and the string build the same optimizer: the same steps give the same bits.
TEST(optimizer_settings, the_struct_and_the_string_step_alike) {
  dfa_optimizer_config c = initialized();
  c.driver = DFA_DRIVER_HOST;
  c.allocator_settings = "host_granularity_kb:64";
  c.window_mb = 1;
  c.depth = 2;
  c.moments = DFA_MOMENTS_BF16;
  dfa_optimizer *a = nullptr, *b = nullptr;
  ASSERT_EQ(dfa_opt_create_with_config(&c, &a), DFA_SUCCESS) << dfa_opt_last_error();
  ASSERT_EQ(dfa_opt_create("driver:host,host_granularity_kb:64,tier:host,window_mb:1,depth:2,moments:bf16", &b),
            DFA_SUCCESS) << dfa_opt_last_error();
  const std::size_t n = 70000;  // several pieces of a 1 MiB window
  std::vector<float> pa(n), pb(n), g(n);
  for (std::size_t i = 0; i < n; ++i) {
    pa[i] = pb[i] = 0.001f * float(i % 977);
    g[i] = 0.01f * float(i % 31) - 0.15f;
  }
  ASSERT_EQ(dfa_opt_add_shard(a, pa.data(), n, DFA_DTYPE_FP32, 0, nullptr, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_add_shard(b, pb.data(), n, DFA_DTYPE_FP32, 0, nullptr, nullptr), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_initialize(a, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  ASSERT_EQ(dfa_opt_initialize(b, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  const void* grads[1] = {g.data()};
  for (int t = 0; t < 3; ++t) {
    ASSERT_EQ(dfa_opt_step(a, grads, 1, nullptr, 1.0f, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
    ASSERT_EQ(dfa_opt_step(b, grads, 1, nullptr, 1.0f, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  }
  EXPECT_EQ(pa, pb);
  dfa_optimizer_stats sa{}, sb{};
  ASSERT_EQ(dfa_opt_get_stats(a, &sa), DFA_SUCCESS);
  ASSERT_EQ(dfa_opt_get_stats(b, &sb), DFA_SUCCESS);
  EXPECT_EQ(sa.piece_elements, sb.piece_elements);
  EXPECT_EQ(sa.bytes_to_device, sb.bytes_to_device) << "bf16 moments in both";
  EXPECT_LT(sa.bytes_to_device, 12 * n) << "bf16 moments move fewer than 12 bytes per element";
  EXPECT_EQ(dfa_opt_destroy(a), DFA_SUCCESS);
  EXPECT_EQ(dfa_opt_destroy(b), DFA_SUCCESS);
}

}  // namespace
