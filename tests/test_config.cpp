// The settings grammar (PYTORCH_CUDA_ALLOC_CONF's) and its errors.
#include <deferalloc/config.hpp>
#include <deferalloc/errors.hpp>
#include <gtest/gtest.h>

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
