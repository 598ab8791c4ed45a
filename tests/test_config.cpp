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
