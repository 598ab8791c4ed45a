// The driver's interfaces: vmm_ops' counting, and the destructors of the three bases.
//
// Counting lives in vmm_ops' non-virtual public functions, so every implementation and
// wrapper is counted the same way.
#include <deferalloc/core/driver.hpp>

namespace deferalloc {

const char* to_string(primitive p) noexcept {
  switch (p) {
    case primitive::reserve: return "reserve";
    case primitive::free_reservation: return "free_reservation";
    case primitive::create: return "create";
    case primitive::release: return "release";
    case primitive::map: return "map";
    case primitive::unmap: return "unmap";
    case primitive::set_access: return "set_access";
    case primitive::host_alloc: return "host_alloc";
    default: return "unknown";
  }
}

vmm_ops::~vmm_ops() = default;
stream_ops::~stream_ops() = default;
driver::~driver() = default;

std::uintptr_t vmm_ops::reserve(std::size_t bytes, std::size_t alignment) {
  count(primitive::reserve);
  return do_reserve(bytes, alignment);
}
void vmm_ops::free_reservation(std::uintptr_t va, std::size_t bytes) {
  count(primitive::free_reservation);
  do_free_reservation(va, bytes);
}
chunk_handle vmm_ops::create(std::size_t bytes) {
  count(primitive::create);
  return do_create(bytes);
}
void vmm_ops::release(chunk_handle h) {
  count(primitive::release);
  do_release(h);
}
void vmm_ops::map(std::uintptr_t va, std::size_t bytes, chunk_handle h) {
  count(primitive::map);
  do_map(va, bytes, h);
}
void vmm_ops::unmap(std::uintptr_t va, std::size_t bytes) {
  count(primitive::unmap);
  do_unmap(va, bytes);
}
void vmm_ops::set_access(std::uintptr_t va, std::size_t bytes) {
  count(primitive::set_access);
  do_set_access(va, bytes);
}
void* vmm_ops::host_alloc(std::size_t bytes) {
  count(primitive::host_alloc);
  return do_host_alloc(bytes);
}
void vmm_ops::host_free(void* p) noexcept { do_host_free(p); }

driver_call_counts vmm_ops::call_counts() const {
  driver_call_counts c;
  for (int i = 0; i < primitive_count; ++i) c.calls[i] = calls_[i].load(std::memory_order_relaxed);
  return c;
}

}  // namespace deferalloc
