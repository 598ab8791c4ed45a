// The settings grammar (PYTORCH_CUDA_ALLOC_CONF's) and its errors.
#include <deferalloc/core/config.hpp>
#include <deferalloc/core/errors.hpp>
#include <gtest/gtest.h>

#include <algorithm>
#include <string_view>

#include "settings_doc.hpp"

using namespace deferalloc;

TEST(config, parses_scalars_and_lists) {
  auto m = parse_config_text(" driver:host , chunk_classes_mb:[2, 64,1024],log_level:debug");
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m["driver"].items, std::vector<std::string>{"host"});
  EXPECT_FALSE(m["driver"].is_list);
  EXPECT_TRUE(m["chunk_classes_mb"].is_list);
  EXPECT_EQ(m["chunk_classes_mb"].items, (std::vector<std::string>{"2", "64", "1024"}));
  EXPECT_TRUE(parse_config_text("").empty());
}

TEST(config, settings_from_text) {
  auto s = parse_settings("driver:host,device:0,chunk_classes_mb:[2,32],pool_budget_mb:512,host_capacity_mb:256,"
                          "host_granularity_kb:64,pinned_cache_mb:128,log_level:error");
  EXPECT_EQ(s.driver, driver_kind::host);
  EXPECT_EQ(s.chunk_classes, (std::vector<std::size_t>{2u << 20, 32u << 20}));
  EXPECT_EQ(s.pool_budget, 512u << 20);
  EXPECT_EQ(s.host_capacity, 256u << 20);
  EXPECT_EQ(s.host_granularity, 64u << 10);
  EXPECT_EQ(s.pinned_cache, 128u << 20);
  EXPECT_EQ(s.level, log_level::error);
}

TEST(config, unknown_key_lists_the_valid_keys) {
  try {
    parse_settings("driver:host,expandable_segments:True");
    FAIL() << "no error";
  } catch (const invalid_argument& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("unknown key 'expandable_segments'"), std::string::npos) << w;
    EXPECT_NE(w.find(settings_keys()), std::string::npos) << w;
    for (const std::string& k : other_libraries_keys()) EXPECT_NE(w.find(k), std::string::npos) << k << ": " << w;
  }
}

TEST(config, bad_values_and_syntax_are_errors) {
  EXPECT_THROW(parse_settings("driver:gpu"), invalid_argument);
  EXPECT_THROW(parse_settings("pool_budget_mb:-1"), invalid_argument);
  EXPECT_THROW(parse_settings("pool_budget_mb:12x"), invalid_argument);
  EXPECT_THROW(parse_settings("chunk_classes_mb:[2,0]"), invalid_argument);
  EXPECT_THROW(parse_settings("log_level:[info]"), invalid_argument);
  EXPECT_THROW(parse_config_text("driver"), invalid_argument);
  EXPECT_THROW(parse_config_text("a:[1,2"), invalid_argument);
  EXPECT_THROW(parse_config_text(":1"), invalid_argument);
  EXPECT_THROW(parse_config_text("a:"), invalid_argument);
  EXPECT_THROW(parse_config_text("a:[1,,2]"), invalid_argument);
}

// Every number is range-checked before it is scaled; the error names the key and range.
TEST(config, numbers_are_range_checked_and_never_wrap) {
  struct bad {
    const char* text;
    const char* key;
  };
  const bad table[] = {
      {"device:4294967296", "device"},
      {"device:18446744073709551616", "device"},
      {"device:1024", "device"},
      {"pool_budget_mb:17592186044416", "pool_budget_mb"},  // 2^44 MB: << 20 would wrap to 0
      {"pool_budget_mb:18446744073709551615", "pool_budget_mb"},
      {"host_capacity_mb:16777217", "host_capacity_mb"},
      {"pinned_cache_mb:99999999999999999999", "pinned_cache_mb"},
      {"chunk_classes_mb:[2,17592186044416]", "chunk_classes_mb"},
      {"host_granularity_kb:12", "host_granularity_kb"},
      {"host_granularity_kb:2", "host_granularity_kb"},
      {"host_granularity_kb:2097152", "host_granularity_kb"},
      {"host_granularity_kb:18014398509481984", "host_granularity_kb"},
  };
  for (const auto& b : table) {
    try {
      const settings s = parse_settings(b.text);
      ADD_FAILURE() << b.text << " was accepted: device " << s.device << ", pool_budget " << s.pool_budget;
    } catch (const invalid_argument& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find(b.key), std::string::npos) << b.text << ": " << w;
      EXPECT_NE(w.find('['), std::string::npos) << b.text << ": the error does not give the valid range: " << w;
    }
  }
  const settings s = parse_settings("device:1023,pool_budget_mb:16777216,host_granularity_kb:4,chunk_classes_mb:[1]");
  EXPECT_EQ(s.device, 1023);
  EXPECT_EQ(s.pool_budget, std::size_t{1} << 44);
  EXPECT_EQ(s.host_granularity, 4096u);
}

// The caching allocator's knobs are rows of the allocator's table; the optimizer's keys
// (its own table, Note [Keys other libraries own]) are accepted and passed over.
TEST(config, caching_keys_and_keys_other_libraries_own) {
  const settings d = parse_settings("");
  const caching_allocator_config c0;
  EXPECT_EQ(d.caching.small_size, c0.small_size);
  EXPECT_EQ(d.caching.grow_bytes, c0.grow_bytes);
  EXPECT_EQ(d.caching.memory_fraction, c0.memory_fraction);

  const settings s = parse_settings("small_size_kb:256,segment_reserve_mb:4096,memory_fraction:0.5,grow_mb:0,"
                                    "tier:file,directory:/tmp/x,window_mb:64,depth:4,resume:1,rank:3,io_threads:2,"
                                    "io_request_mb:16,keep_window:7,resident_mb:128,moments:bf16,progress_line:0");
  EXPECT_EQ(s.caching.small_size, 256u << 10);
  EXPECT_EQ(s.caching.segment_reserve, std::size_t{4096} << 20);
  EXPECT_EQ(s.caching.memory_fraction, 0.5);
  EXPECT_EQ(s.caching.grow_bytes, 0u);
  for (const std::string& k : other_libraries_keys())
    EXPECT_NO_THROW(parse_settings(k + ":anything")) << k << " is the optimizer's to check";

  for (const char* bad : {"memory_fraction:0", "memory_fraction:1.5", "memory_fraction:nan", "memory_fraction:x",
                          "memory_fraction:[0.5]", "small_size_kb:0", "small_size_kb:1048577", "grow_mb:16777217",
                          "segment_reserve_mb:-1"}) {
    const std::string key(bad, std::string_view(bad).find(':'));
    try {
      (void)parse_settings(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << bad << ": " << e.what();
    }
  }
}

// docs/SETTINGS.md's allocator table lists exactly the allocator's table, row by row, in its
// order (the optimizer's table: tests/test_optimizer_settings.cpp).
TEST(config, docs_list_the_settings_table) {
  dfa_test::expect_documented(DFA_SETTINGS_DOC, "## The allocator's keys", settings_table());
  const std::string keys = settings_keys();
  EXPECT_EQ(settings_table().size(), static_cast<std::size_t>(std::count(keys.begin(), keys.end(), ',') + 1));
  for (const setting_doc& d : settings_table())
    for (const std::string& k : other_libraries_keys()) EXPECT_NE(k, d.key) << "a key of two tables";
}
