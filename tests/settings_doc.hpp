// docs/SETTINGS.md's tables against the settings tables of the code: each library's table
// is documented under its own heading, row by row, in table order.
#pragma once
#include <deferalloc/core/config.hpp>
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

namespace dfa_test {

// Checks that the first table under `heading` in `path` lists exactly `table`.
inline void expect_documented(const char* path, const std::string& heading, const std::vector<deferalloc::setting_doc>& table) {
  std::ifstream in(path);
  ASSERT_TRUE(in) << "cannot read " << path;
  const std::string header = "| key | type | range | default | meaning |";
  std::vector<std::string> doc;
  bool under = false, inside = false;
  for (std::string line; std::getline(in, line);) {
    if (line == heading) under = true;
    if (under && !inside && line == header) {
      inside = true;
      continue;
    }
    if (!inside) continue;
    if (line.rfind("| ---", 0) == 0) continue;
    if (line.rfind("|", 0) != 0) break;
    doc.push_back(line);
  }
  ASSERT_TRUE(under) << path << " has no heading '" << heading << "'";
  std::vector<std::string> rows;
  std::string expected;
  for (const deferalloc::setting_doc& d : table) {
    rows.push_back(std::string("| `") + d.key + "` | " + d.type + " | " + d.range + " | " + d.def + " | " + d.doc + " |");
    expected += rows.back() + "\n";
  }
  EXPECT_EQ(doc, rows) << path << "'s table under '" << heading << "' should be:\n" << expected;
}

}  // namespace dfa_test
