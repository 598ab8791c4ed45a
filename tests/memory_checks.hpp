// Checks of the physical-memory policy (Note [Physical memory policy] in
// allocator/chunk_pool.cpp): what the process holds, measured by the driver itself
// (the host driver counts its chunks; the CUDA driver answers cuMemGetInfo), and the
// process's resident set.
#pragma once
#include <deferalloc/driver.hpp>

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
inline std::int64_t held_slack(deferalloc::driver& d) { return d.name() == "host" ? 0 : std::int64_t{8} << 20; }

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
