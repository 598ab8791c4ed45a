// The C ABIs' boundary (include/deferalloc/deferalloc.h and optimizer.h): every entry
// point runs its body through abi_guard(), which maps each exception to a dfa_status and
// sets the library's thread-local message "<call>: <cause>".  Nothing throws past it.
// Internal header, shared by allocator/abi/c_api.cpp and optimizer/abi/c_api_optimizer.cpp.
#pragma once
#include <deferalloc/core/errors.hpp>
#include <deferalloc/deferalloc.h>

#include <cstring>
#include <new>
#include <string>
#include <type_traits>

namespace deferalloc::detail {

/// Runs `body`; returns DFA_SUCCESS and clears `last_error`, or the status of the
/// exception it threw with `last_error` = "<call>: <what>".  Never throws.
template <typename F>
dfa_status abi_guard(const char* call, std::string& last_error, F&& body) noexcept {
  try {
    body();
    last_error.clear();
    return DFA_SUCCESS;
  } catch (...) {
    const dfa_status st = status_of(std::current_exception());  // the one mapping (errors.hpp)
    try {
      last_error = std::string(call) + ": " + (st == DFA_ERROR_INTERNAL ? "internal error: " : "") +
                   message_of(std::current_exception());
    } catch (...) {  // no memory for the message: the status still says what happened
    }
    return st;
  }
}

/// @throws invalid_argument "<what> is null" for a null pointer argument.
inline void need(const void* p, const char* what) {
  if (p == nullptr) throw invalid_argument(std::string(what) + " is null");
}

/// The integer stored in an enumeration object, read from its bytes as the signed type of
/// its size (a C caller passes an int: -1 stays -1), never loaded as the enumeration, so
/// an out-of-range value of a C enum is no undefined behaviour.  The ABI converts it to
/// the C++ scoped enum (defined for any int) and the C++ call refuses a value that names
/// no enumerator (Note [Enum values from callers] in allocator/core/mode_checks.hpp).
template <typename E>
long long raw_enum_value(const E& e) noexcept {
  static_assert(std::is_enum_v<E>);
  std::make_signed_t<std::underlying_type_t<E>> v{};
  std::memcpy(&v, &e, sizeof v);
  return static_cast<long long>(v);
}

/// A C enumeration value as the C++ scoped enum `To`, converted without a range check: the
/// C++ call that takes it refuses a value that names no enumerator (Note [Arguments are
/// checked where they enter] in docs/DESIGN.md).
template <typename To, typename From>
To enum_from_c(const From& e) noexcept {
  static_assert(std::is_enum_v<To>);
  return static_cast<To>(raw_enum_value(e));
}

}  // namespace deferalloc::detail
