// Typed exceptions of the C++ API (rmm's detail/error.hpp is the model).
//
// Every failure the library can report is one of these; the C ABI maps each to a
// dfa_status code.  Library code never calls exit/abort, and destructors never throw.
// The mapping both ways is written once, here (status_of / throw_status): the C ABIs
// (allocator/abi/abi_guard.hpp), the LibTorch face and, mirrored class for class,
// python/deferalloc/errors.py use it.
#pragma once
#include <deferalloc/core/export.hpp>
#include <deferalloc/deferalloc.h>

#include <exception>
#include <stdexcept>
#include <string>

namespace deferalloc {

/// Base of every deferalloc exception.
class DFA_API error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
/// A caller broke a precondition: null, zero or absurd size, unknown handle, a range
/// outside the reservation, misalignment, an unknown config key.  Nothing was changed.
class DFA_API invalid_argument : public error {
 public:
  using error::error;
};
/// The object is in the wrong state for the call (restore without a backup, ...).
/// Nothing was changed.
class DFA_API invalid_state : public error {
 public:
  using error::error;
};
/// Physical memory (device chunks, the pool budget, pinned host memory) ran out.
/// The operation was rolled back.
class DFA_API out_of_memory : public error {
 public:
  using error::error;
};
/// A CUDA driver call failed for a reason other than out-of-memory.
class DFA_API cuda_error : public error {
 public:
  using error::error;
};
/// No usable CUDA driver or device on this machine.
class DFA_API no_device : public cuda_error {
 public:
  using cuda_error::cuda_error;
};
/// A file or other I/O operation failed (ENOSPC, EIO, short read, ...).
class DFA_API io_error : public error {
 public:
  using error::error;
};
/// Stored data failed verification (checksum, layout, version).
class DFA_API corrupt_data : public error {
 public:
  using error::error;
};

/// The dfa_status that names the type of `e`: DFA_SUCCESS for a null pointer, the
/// status of each class above (the most derived one: no_device, not cuda_error),
/// DFA_ERROR_OUT_OF_MEMORY for std::bad_alloc, DFA_ERROR_INTERNAL for anything else.
/// Costs one rethrow.
DFA_API dfa_status status_of(const std::exception_ptr& e) noexcept;

/// The what() of `e` ("host memory exhausted" for std::bad_alloc, "unknown exception"
/// for one that is not a std::exception, "" for null).  May throw std::bad_alloc.
DFA_API std::string message_of(const std::exception_ptr& e);

/// Throws the class of `st` with message `msg` (DFA_ERROR_INTERNAL and unknown codes:
/// the base `error`; DFA_SUCCESS is refused as invalid_argument).
[[noreturn]] DFA_API void throw_status(dfa_status st, const std::string& msg);

/// Throws the deferalloc class of `e` (status_of; by default the exception being
/// handled) with the message "<context>: <its what()>" and `e` nested in it
/// (std::throw_with_nested): the type survives and the context is added.
[[noreturn]] DFA_API void rethrow_with_context(const std::string& context,
                                               const std::exception_ptr& e = std::current_exception());

}  // namespace deferalloc

/// Throws `ex_type(msg)` (default invalid_argument) when `cond` is false.
#define DFA_EXPECTS(cond, msg, ...) \
  do {                              \
    if (!(cond)) ::deferalloc::detail::throw_expects<__VA_ARGS__>(msg); \
  } while (0)

namespace deferalloc::detail {
template <typename E = invalid_argument>
[[noreturn]] inline void throw_expects(const std::string& msg) {
  throw E(msg);
}
}  // namespace deferalloc::detail
