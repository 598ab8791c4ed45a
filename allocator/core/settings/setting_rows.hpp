// The rows a settings table is made of (Note [Settings table] in allocator/core/config.cpp).
// Each library of the package keeps its own table of these rows: the allocator's in
// allocator/core/config.cpp, the optimizer's in optimizer/settings.cpp.  Internal (the
// deferalloc_setting_rows target), not installed; to_uint and scalar are exported from
// libdeferalloc for the optimizer's library.
#pragma once
#include <deferalloc/core/config.hpp>
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/export.hpp>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace deferalloc::detail {

/// Sizes in MB are capped at 16 TiB (Note [Settings ranges] in allocator/core/config.cpp).
inline constexpr std::uint64_t k_max_mb = std::uint64_t{1} << 24;
inline constexpr std::uint64_t k_max_int = 2147483647;
inline constexpr std::uint64_t k_any = ~std::uint64_t{0};

/// `v` as an unsigned integer in [lo, hi], checked before any scaling.
/// @throws invalid_argument naming `key` and the range.
DFA_API std::uint64_t to_uint(const std::string& key, const std::string& v, std::uint64_t lo, std::uint64_t hi);
/// The one item of a scalar value.  @throws invalid_argument for a list.
DFA_API const std::string& scalar(const std::string& key, const config_value& v);

/// One key of a table that sets fields of a `T`: its name, what a value looks like, its
/// range, its default and meaning (messages, the docs table), and the setter that checks
/// a value and stores it.  Numeric rows carry their range as numbers (lo, hi) and the
/// setter reads it from the row, so the range is written once.
template <class T>
struct setting_row {
  const char* key;
  const char* type;
  std::uint64_t lo, hi;  ///< numeric rows: the accepted range (before scaling)
  const char* values;    ///< other rows: the accepted values, as text
  const char* def;
  const char* doc;
  void (*set)(T& target, const setting_row& r, const config_value& v);
};

template <class T>
std::uint64_t num(const setting_row<T>& r, const config_value& v) {
  return to_uint(r.key, scalar(r.key, v), r.lo, r.hi);
}
template <class T>
std::size_t mb(const setting_row<T>& r, const config_value& v) {
  return static_cast<std::size_t>(num(r, v)) << 20;
}

/// A name-valued row: the value must be one of `names` (in the row's order for the message).
template <class E, class T>
E pick(const setting_row<T>& r, const config_value& v, std::initializer_list<std::pair<const char*, E>> names) {
  const auto& got = scalar(r.key, v);
  std::string list;
  for (const auto& [n, e] : names) {
    if (got == n) return e;
    list += (list.empty() ? "" : ", ") + std::string(n);
  }
  throw invalid_argument("DEFERALLOC_CONF: " + std::string(r.key) + " must be one of " + list + ", got '" + got + "'");
}

/// The row of `key`, or null.
template <class T, std::size_t N>
const setting_row<T>* find_row(const setting_row<T> (&table)[N], const std::string& key) {
  for (const auto& r : table)
    if (key == r.key) return &r;
  return nullptr;
}

/// The table's keys, comma-separated, for messages.
template <class T, std::size_t N>
std::string keys_of(const setting_row<T> (&table)[N]) {
  std::string s;
  for (const auto& r : table) s += (s.empty() ? "" : ", ") + std::string(r.key);
  return s;
}

/// The table as documentation rows.  The range text of numeric rows is made from their
/// numbers once per table (two tables of one row type and size keep their own), and lives
/// as long as the process.
template <class T, std::size_t N>
std::vector<setting_doc> docs_of(const setting_row<T> (&table)[N]) {
  static std::mutex mu;
  static std::map<const void*, std::vector<std::string>> texts;  // per table; map nodes do not move
  std::lock_guard lk(mu);
  auto it = texts.find(&table[0]);
  if (it == texts.end()) {
    std::vector<std::string> made;  // whole before it is kept: a throw leaves no half entry
    for (const auto& r : table)
      made.push_back(r.values ? r.values : "[" + std::to_string(r.lo) + ", " + std::to_string(r.hi) + "]");
    it = texts.emplace(&table[0], std::move(made)).first;  // the strings stay where they are
  }
  const std::vector<std::string>& ranges = it->second;
  std::vector<setting_doc> out;
  for (std::size_t i = 0; i < N; ++i)
    out.push_back({table[i].key, table[i].type, ranges[i].c_str(), table[i].def, table[i].doc});
  return out;
}

}  // namespace deferalloc::detail
