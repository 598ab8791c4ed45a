// The C ABI's disk spills (dfa_spill_save, dfa_spill_load, dfa_spill_check_dir): device
// ranges to one checksummed file and back, on the driver of the device's caching
// allocator (Note [Disk spills] in core/files/spill.cpp).
#include <deferalloc/core/errors.hpp>
#include <deferalloc/deferalloc.h>

#include <string>
#include <vector>

#include "core/files/spill.hpp"
#include "process_state.hpp"

using namespace deferalloc;
using namespace deferalloc::abi;

namespace {

std::vector<detail::spill_range> ranges_of(size_t n, void* const* ptrs, const size_t* sizes) {
  if (n != 0) {
    need(ptrs, "ptrs");
    need(sizes, "sizes");
  }
  std::vector<detail::spill_range> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = {ptrs[i], sizes[i]};
  return out;
}

template <class Op>
dfa_status on_device(const char* call, const char* path, int device, Op op) {
  return guard(call, [&] {
    need(path, "path");
    std::shared_lock<std::shared_mutex> lk;
    reservation_manager& m = allocator_for(device, lk).reservations();
    op(std::string(path), m.vmm(), m.streams());
  });
}

}  // namespace

extern "C" {

dfa_status dfa_spill_save(const char* path, int device, size_t n, void* const* ptrs, const size_t* sizes,
                          size_t chunk_bytes, void* stream) {
  return on_device("dfa_spill_save", path, device, [&](const std::string& p, vmm_ops& v, stream_ops& s) {
    detail::spill_save(p, ranges_of(n, ptrs, sizes), chunk_bytes, v, s, stream_t{stream});
  });
}

dfa_status dfa_spill_load(const char* path, int device, size_t n, void* const* ptrs, const size_t* sizes,
                          size_t chunk_bytes, void* stream) {
  return on_device("dfa_spill_load", path, device, [&](const std::string& p, vmm_ops& v, stream_ops& s) {
    detail::spill_load(p, ranges_of(n, ptrs, sizes), chunk_bytes, v, s, stream_t{stream});
  });
}

dfa_status dfa_spill_check_dir(const char* dir, int* in_memory) {
  return guard("dfa_spill_check_dir", [&] {
    need(dir, "dir");
    const bool mem = detail::spill_check_dir(dir);
    if (in_memory) *in_memory = mem ? 1 : 0;
  });
}

}  // extern "C"
