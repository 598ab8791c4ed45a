// Range checks of fill_mode / keep_mode values that come from outside the type system:
// integers from the C ABI, Python or a static_cast in C++ code.
//
// Note [Enum values from callers]: an out-of-range value must be refused before it is
// used as an enumeration.  fill_mode and keep_mode are scoped enums (underlying type
// int), so any int converts to them with defined behaviour and is_valid() tells whether
// it names an enumerator.  The reservation layer calls expect_valid() on entry (the C++
// API's own check, Note [Arguments are checked where they enter] in docs/DESIGN.md); the
// C ABI's dfa_fill / dfa_keep are unscoped C enums whose valid range is only their
// enumerators' bits, so the ABI reads their raw integer (enum_from_c in abi_guard.hpp),
// converts it to the scoped enum and leaves the range check to that layer.
#pragma once
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/reservations.hpp>

#include <string>
#include <string_view>

namespace deferalloc {

/// True when `f` is fill_mode::undefined, zero or restore.  No cost.
constexpr bool is_valid(fill_mode f) noexcept {
  const int v = static_cast<int>(f);
  return v >= static_cast<int>(fill_mode::undefined) && v <= static_cast<int>(fill_mode::restore);
}
/// True when `k` is keep_mode::discard or host.  No cost.
constexpr bool is_valid(keep_mode k) noexcept {
  const int v = static_cast<int>(k);
  return v >= static_cast<int>(keep_mode::discard) && v <= static_cast<int>(keep_mode::host);
}

/// @throws invalid_argument "<call>: fill N is not a fill_mode ..." for an out-of-range value.
inline void expect_valid(fill_mode f, std::string_view call) {
  if (!is_valid(f))
    throw invalid_argument(std::string(call) + ": fill " + std::to_string(static_cast<int>(f)) +
                           " is not a fill mode (0 undefined, 1 zero, 2 restore)");
}
/// @throws invalid_argument "<call>: keep N is not a keep_mode ..." for an out-of-range value.
inline void expect_valid(keep_mode k, std::string_view call) {
  if (!is_valid(k))
    throw invalid_argument(std::string(call) + ": keep " + std::to_string(static_cast<int>(k)) +
                           " is not a keep mode (0 discard, 1 host)");
}

}  // namespace deferalloc
