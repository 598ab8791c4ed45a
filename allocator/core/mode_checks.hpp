// Range checks of fill_mode / keep_mode values that come from outside the type system:
// integers from the C ABI, Python or a static_cast in C++ code.
//
// Note [Enum values from callers]: an out-of-range value must be refused before it is
// used as an enumeration.  fill_mode and keep_mode are scoped enums (underlying type
// int), so any int converts to them with defined behaviour and is_valid() tells whether
// it names an enumerator; the C ABI's dfa_fill / dfa_keep are unscoped C enums whose
// valid range is only their enumerators' bits, so the ABI reads their raw integer
// (raw_enum_value) and converts with fill_from_int / keep_from_int.  The reservation
// layer should call expect_valid() on entry (it is the C++ API's own check).
#pragma once
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/reservations.hpp>

#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

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

/// The integer stored in an enumeration object, read from its bytes as the signed type of
/// its size (a C caller passes an int: -1 stays -1), never loaded as the enumeration, so
/// an out-of-range value of a C enum is no undefined behaviour.
template <typename E>
long long raw_enum_value(const E& e) noexcept {
  static_assert(std::is_enum_v<E>);
  std::make_signed_t<std::underlying_type_t<E>> v{};
  std::memcpy(&v, &e, sizeof v);
  return static_cast<long long>(v);
}

/// fill_mode from an integer; @throws invalid_argument outside [0, 2].
inline fill_mode fill_from_int(long long raw) {
  if (raw < 0 || raw > static_cast<int>(fill_mode::restore))
    throw invalid_argument("fill " + std::to_string(raw) +
                           " is not DFA_FILL_UNDEFINED (0), DFA_FILL_ZERO (1) or DFA_FILL_RESTORE (2)");
  return static_cast<fill_mode>(raw);
}
/// keep_mode from an integer; @throws invalid_argument outside [0, 1].
inline keep_mode keep_from_int(long long raw) {
  if (raw < 0 || raw > static_cast<int>(keep_mode::host))
    throw invalid_argument("keep " + std::to_string(raw) + " is not DFA_KEEP_DISCARD (0) or DFA_KEEP_HOST (1)");
  return static_cast<keep_mode>(raw);
}

}  // namespace deferalloc
