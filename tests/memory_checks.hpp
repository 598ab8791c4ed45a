// Checks of the physical-memory policy (Note [Physical memory policy] in
// allocator/core/chunk_pool.cpp): what the process holds, measured by the driver itself
// (the host driver counts its chunks; the CUDA driver answers cuMemGetInfo), and the
// process's resident set.
#pragma once
#include <deferalloc/core/driver.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <unistd.h>

namespace dfa_test {

/// Physical device bytes held now beyond `baseline` (a get_memory_info taken earlier).
inline std::int64_t held_since(deferalloc::driver& d, const deferalloc::memory_info& baseline) {
  return static_cast<std::int64_t>(baseline.free_bytes) - static_cast<std::int64_t>(d.get_memory_info().free_bytes);
}

/// Slack allowed on top of "held <= backed + cache bound": none on the host driver (it
/// counts exactly); on a GPU cuMemGetInfo also sees the runtime's own small allocations
/// (events, streams, the copy engines' staging), so 8 MiB.
inline std::int64_t held_slack(deferalloc::driver& d) { return d.kind() == deferalloc::driver_kind::host ? 0 : std::int64_t{8} << 20; }
/// The same while `pinned_bytes` of pinned host memory (host backups) are alive: on a GPU
/// the driver keeps page tables for pinned host memory in HBM, 2 MiB per GiB pinned
/// (measured on H200); they are no chunk of ours and come back when the buffers are freed.
inline std::int64_t held_slack(deferalloc::driver& d, std::size_t pinned_bytes) {
  if (d.kind() == deferalloc::driver_kind::host) return 0;
  const std::int64_t gib = static_cast<std::int64_t>((pinned_bytes + (std::size_t{1} << 30) - 1) >> 30);
  return held_slack(d) + gib * (std::int64_t{2} << 20);
}

/// The resident set size of this process in bytes (/proc/self/statm).
inline std::size_t rss_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long size = 0, resident = 0;
  const int n = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)) : 0;
}

}  // namespace dfa_test
