// The optimizer's settings table (optimizer/settings.cpp) and its typed C config
// (dfa_optimizer_config): the allocator's list of the keys it does not own equals this
// table, docs/SETTINGS.md documents it, and the struct, the string and DEFERALLOC_CONF's
// grammar give the same optimizer.
#include <deferalloc/core/errors.hpp>
#include <deferalloc/optim/optimizer_settings.hpp>
#include <deferalloc/optimizer.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "common.hpp"
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
  EXPECT_EQ(c.pass_taper != 0, d.optimizer.pass_taper);
  EXPECT_EQ(c.pass_chain != 0, d.optimizer.pass_chain);
  EXPECT_EQ(c.pass_chain, 0) << "chained passes are off until timed on a GPU";
  EXPECT_EQ(c.writeback_queue_mb << 20, d.optimizer.writeback_queue_bytes);
  EXPECT_EQ(c.writeback_queue_mb, 0u) << "the write-back queue is unbounded until timed on a GPU";
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

// Note [Applying a settings text to the typed config] in optimizer/abi/c_api_optimizer.cpp.
struct applied {
  dfa_status status;
  std::string rest;
  std::size_t needed;
};

bool same(const dfa_optimizer_config& a, const dfa_optimizer_config& b) {
  return a.struct_size == b.struct_size && a.driver == b.driver && a.device == b.device &&
         a.allocator_settings == b.allocator_settings && a.tier == b.tier && a.directory == b.directory &&
         a.window_mb == b.window_mb && a.depth == b.depth && a.resume == b.resume && a.rank == b.rank &&
         a.io_threads == b.io_threads && a.io_request_mb == b.io_request_mb && a.keep_window == b.keep_window &&
         a.resident_mb == b.resident_mb && a.moments == b.moments && a.progress_line == b.progress_line &&
         a.pass_taper == b.pass_taper && a.pass_chain == b.pass_chain && a.writeback_queue_mb == b.writeback_queue_mb;
}

applied apply(dfa_optimizer_config& c, const char* text) {
  std::vector<char> rest(4096, 'x');
  std::size_t needed = 0;
  const dfa_status st = dfa_opt_config_apply_text(&c, text, rest.data(), rest.size(), &needed);
  return {st, st == DFA_SUCCESS ? std::string(rest.data()) : std::string(), needed};
}

TEST(optimizer_settings, apply_text_sets_fields_and_hands_back_the_allocators_keys) {
  dfa_optimizer_config c = initialized();
  const applied a = apply(c,
                          "driver:host,device:3,tier:file,directory:/tmp/a b,window_mb:2,depth:3,resume:1,rank:2,"
                          "io_threads:4,io_request_mb:16,keep_window:5,resident_mb:8,moments:int8,progress_line:1,"
                          "pass_taper:3,pass_chain:2,writeback_queue_mb:48,log_level:error,host_granularity_kb:64,chunk_classes_mb:[2, 32]");
  ASSERT_EQ(a.status, DFA_SUCCESS) << dfa_opt_last_error();
  EXPECT_EQ(c.driver, DFA_DRIVER_HOST);
  EXPECT_EQ(c.device, 3);
  EXPECT_EQ(c.tier, DFA_TIER_FILE);
  ASSERT_NE(c.directory, nullptr);
  EXPECT_STREQ(c.directory, "/tmp/a b");
  EXPECT_EQ(c.window_mb, 2u);
  EXPECT_EQ(c.depth, 3);
  EXPECT_EQ(c.resume, 1);
  EXPECT_EQ(c.rank, 2);
  EXPECT_EQ(c.io_threads, 4);
  EXPECT_EQ(c.io_request_mb, 16u);
  EXPECT_EQ(c.keep_window, 1);
  EXPECT_EQ(c.resident_mb, 8u);
  EXPECT_EQ(c.moments, DFA_MOMENTS_INT8);
  EXPECT_EQ(c.progress_line, 1);
  EXPECT_EQ(c.pass_taper, 1) << "any nonzero integer is true";
  EXPECT_EQ(c.pass_chain, 1);
  EXPECT_EQ(c.writeback_queue_mb, 48u);
  EXPECT_EQ(c.allocator_settings, nullptr) << "the caller sets it from the rests";
  EXPECT_EQ(a.rest, "chunk_classes_mb:[2,32],host_granularity_kb:64,log_level:error");
  EXPECT_EQ(a.needed, a.rest.size() + 1);

  // Later texts override earlier ones key by key; nothing: nothing changes.
  const dfa_optimizer_config before = c;
  const applied none = apply(c, nullptr);
  ASSERT_EQ(none.status, DFA_SUCCESS);
  EXPECT_EQ(none.rest, "");
  EXPECT_EQ(none.needed, 1u);
  EXPECT_EQ(apply(c, "").status, DFA_SUCCESS);
  EXPECT_TRUE(same(c, before));
  ASSERT_EQ(apply(c, "depth:5").status, DFA_SUCCESS);
  EXPECT_EQ(c.depth, 5);
  EXPECT_EQ(c.window_mb, 2u);
}

TEST(optimizer_settings, apply_text_errors_leave_the_config_unchanged) {
  dfa_optimizer_config c = initialized();
  const dfa_optimizer_config before = c;
  struct bad {
    const char* text;
    const char* says;
  };
  for (const bad& b : {bad{"window_mb:3,colour:blue", "unknown key 'colour'"}, bad{"tier:host,depth:-1", "depth"},
                       bad{"tier:disk", "disk"}, bad{"device:1024", "device"}, bad{"host_granularity_kb:12", "host_granularity_kb"},
                       bad{"window_mb:3,log_level", "missing ':'"}}) {
    EXPECT_EQ(apply(c, b.text).status, DFA_ERROR_INVALID_ARGUMENT) << b.text;
    const std::string w = dfa_opt_last_error();
    EXPECT_NE(w.find("dfa_opt_config_apply_text: "), std::string::npos) << w;
    EXPECT_NE(w.find(b.says), std::string::npos) << b.text << ": " << w;
    EXPECT_TRUE(same(c, before)) << b.text;
  }
  // The unknown key's message is dfa_opt_create's: both tables' keys.
  (void)apply(c, "colour:blue");
  const std::string w = dfa_opt_last_error();
  EXPECT_NE(w.find(settings_keys()), std::string::npos) << w;
  for (const std::string& k : table_keys()) EXPECT_NE(w.find(k), std::string::npos) << k << ": " << w;

  // A rest buffer too small (or none): the size it needs, the config untouched.
  const char* text = "tier:device,log_level:info,pool_cache_mb:32";
  const std::size_t want = std::string("log_level:info,pool_cache_mb:32").size() + 1;
  std::size_t needed = 0;
  EXPECT_EQ(dfa_opt_config_apply_text(&c, text, nullptr, 0, &needed), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(needed, want);
  EXPECT_NE(std::string(dfa_opt_last_error()).find("rest buffer too small: " + std::to_string(want) + " bytes needed"),
            std::string::npos) << dfa_opt_last_error();
  std::vector<char> small(want - 1, 'x');
  needed = 0;
  EXPECT_EQ(dfa_opt_config_apply_text(&c, text, small.data(), small.size(), &needed), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(needed, want);
  EXPECT_TRUE(same(c, before));
  EXPECT_EQ(std::string(small.begin(), small.end()), std::string(want - 1, 'x')) << "nothing written";
  std::vector<char> exact(want);
  ASSERT_EQ(dfa_opt_config_apply_text(&c, text, exact.data(), exact.size(), &needed), DFA_SUCCESS) << dfa_opt_last_error();
  EXPECT_STREQ(exact.data(), "log_level:info,pool_cache_mb:32");
  EXPECT_EQ(c.tier, DFA_TIER_DEVICE);
  EXPECT_EQ(dfa_opt_config_apply_text(&c, text, exact.data(), exact.size(), nullptr), DFA_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(dfa_opt_config_apply_text(nullptr, text, exact.data(), exact.size(), &needed), DFA_ERROR_INVALID_ARGUMENT);
}

// The Python face's order: DEFERALLOC_CONF's text, typed fields (never parsed), settings=,
// then create with the rests joined.  A directory holding ",tier:host" stays a directory.
TEST(optimizer_settings, a_typed_directory_with_a_comma_reaches_the_engine_unchanged) {
  const dfa_test::temp_dir tmp;
  const std::string dir = tmp.path + "/x,tier:host";
  std::filesystem::create_directories(dir);
  dfa_optimizer_config c = initialized();
  const applied env = apply(c, "driver:host,host_granularity_kb:64,tier:file");
  ASSERT_EQ(env.status, DFA_SUCCESS) << dfa_opt_last_error();
  c.directory = dir.c_str();
  c.window_mb = 1;
  const applied kw = apply(c, "log_level:error,depth:2");
  ASSERT_EQ(kw.status, DFA_SUCCESS) << dfa_opt_last_error();
  EXPECT_EQ(c.tier, DFA_TIER_FILE);
  EXPECT_EQ(c.directory, dir.c_str());
  const std::string joined = env.rest + "," + kw.rest + ",";  // empty items are allowed
  c.allocator_settings = joined.c_str();
  dfa_optimizer* o = nullptr;
  ASSERT_EQ(dfa_opt_create_with_config(&c, &o), DFA_SUCCESS) << dfa_opt_last_error();
  std::vector<float> p(1000, 0.5f);
  EXPECT_EQ(dfa_opt_add_shard(o, p.data(), p.size(), DFA_DTYPE_FP32, 0, nullptr, nullptr), DFA_SUCCESS);
  EXPECT_EQ(dfa_opt_initialize(o, nullptr), DFA_SUCCESS) << dfa_opt_last_error();
  EXPECT_TRUE(std::filesystem::exists(dir + "/deferalloc-rank0.state")) << "the file tier, in the directory with the comma";
  EXPECT_FALSE(std::filesystem::exists(tmp.path + "/x")) << "nothing split the directory's name";
  EXPECT_EQ(dfa_opt_destroy(o), DFA_SUCCESS);
}

// A window too small names what the user set (window_mb, depth when set) and what would
// fit, in MiB; a depth left at 0 is named as the tier's default.
TEST(optimizer_settings, a_window_too_small_names_what_the_user_set) {
  const dfa_test::temp_dir tmp;
  const std::string base = "driver:host,host_granularity_kb:2048,";  // pieces of 2 MiB granules: 6 MiB a slot
  const std::string file = "tier:file,directory:" + tmp.path + ",";
  struct bad {
    std::string text;
    const char* says;
  };
  const bad table[] = {
      {base + "tier:host,window_mb:4,depth:1",
       "window_mb 4 is too small: 1 piece in flight needs at least 6 MiB (raise window_mb)"},
      {base + "tier:host,window_mb:8,depth:2",
       "window_mb 8 is too small: 2 pieces in flight need at least 12 MiB (raise window_mb, or lower depth)"},
      {base + "tier:host,window_mb:4",
       "window_mb 4 is too small: 1 piece in flight needs at least 6 MiB (raise window_mb; depth 8, the host tier's "
       "default, takes as many pieces as it holds)"},
      {base + file + "window_mb:5",
       "window_mb 5 is too small: 1 piece in flight needs at least 6 MiB (raise window_mb; depth 3, the file tier's "
       "default, takes as many pieces as it holds)"},
  };
  for (const bad& b : table) {
    dfa_optimizer* o = nullptr;
    EXPECT_EQ(dfa_opt_create(b.text.c_str(), &o), DFA_ERROR_INVALID_ARGUMENT) << b.text;
    EXPECT_EQ(std::string(dfa_opt_last_error()), std::string("dfa_opt_create: streamed_adamw: ") + b.says) << b.text;
    EXPECT_EQ(o, nullptr);
  }
}

}  // namespace
