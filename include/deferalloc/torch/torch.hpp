// The LibTorch face (target deferalloc::torch, built with -DDEFERALLOC_WITH_TORCH=ON).
//
// Deferred tensors: at::Tensor objects whose storage is a deferalloc reservation of the
// process-wide instance (the C ABI's, so Python and C++ share it): the data_ptr never
// changes, physical memory is attached only between materialize and release, and
// freeing the last reference to the storage frees the reservation.  install() puts
// deferalloc's caching allocator under a C++ trainer.
//
// On the host driver (no GPU) tensors live on the CPU: the same code is tested in CI.
#pragma once
#include <deferalloc/core/export.hpp>
#include <deferalloc/core/reservations.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>

namespace deferalloc::torch {

/// A contiguous tensor of `sizes` and `options` (dtype, CUDA device; CPU on the host
/// driver) on a fresh reservation: stable data_ptr(), no physical memory.  Touching it
/// before materialize() faults.  Cost: one cuMemAddressReserve.
/// @throws invalid_argument (negative size, a device the driver does not serve), out_of_memory
DFA_API at::Tensor deferred_empty(at::IntArrayRef sizes, const at::TensorOptions& options = {});

/// Backs the tensor's whole reservation (already backed granules are left alone); the
/// fill runs on the current CUDA stream.  No host synchronisation.
/// @throws invalid_argument (not a deferred tensor), invalid_state (restore without backup), out_of_memory
DFA_API void materialize(const at::Tensor& t, fill_mode fill = fill_mode::zero);

/// Unbacks the tensor's reservation, address kept; keep_mode::host keeps the contents in
/// pinned host memory.  Waits (host) for the current stream's events only.
/// @throws invalid_argument (not a deferred tensor), out_of_memory (backup)
DFA_API void release(const at::Tensor& t, keep_mode keep = keep_mode::discard);

/// True when every granule of the tensor's reservation is backed.
/// @throws invalid_argument (not a deferred tensor)
DFA_API bool is_backed(const at::Tensor& t);

/// Replaces PyTorch's CUDA caching allocator by deferalloc's (CUDAPluggableAllocator on
/// dfa_malloc/dfa_free with every hook).  Call it first thing in main(), before any CUDA
/// allocation.  PyTorch's own memory stats are then not available: use memory_stats().
/// @throws invalid_state when PyTorch's allocator is already initialized (a CUDA tensor
///         was made) or deferalloc is already installed; the message says what to do.
DFA_API void install();
/// True after a successful install().
DFA_API bool installed() noexcept;

/// deferalloc's caching allocator statistics (PyTorch's key names), device -1 = default.
DFA_API std::map<std::string, std::int64_t> memory_stats(int device = -1);

}  // namespace deferalloc::torch
