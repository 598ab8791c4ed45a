// Pinned host buffers for backups, cached by size.
//
// cuMemHostAlloc pins pages one by one (hundreds of milliseconds per GiB), so a
// pause/resume cycle must not pin again: buffers come back here after a restore and
// serve the next release of the same size, up to a bound (cache_limit; settings key
// pinned_cache_mb, a quarter of RAM by default): buffers given back beyond it are freed at
// once (See Note [Physical memory policy] in allocator/core/chunk_pool.cpp).
#pragma once
#include <deferalloc/core/driver.hpp>

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>

namespace deferalloc {

struct pinned_pool_stats {
  std::size_t in_use_bytes = 0;
  std::size_t cached_bytes = 0;
  std::size_t peak_bytes = 0;  ///< in use + cached
  std::uint64_t allocations = 0;  ///< host_alloc calls
  std::uint64_t reuses = 0;
};

class DFA_API pinned_pool {
 public:
  /// Default bound on cached bytes (settings key pinned_cache_mb).
  static constexpr std::size_t default_cache_limit = std::size_t{64} << 20;
  /// `cache_limit`: bytes kept cached after give_back; 0 = nothing is cached,
  /// SIZE_MAX = no limit.
  pinned_pool(std::shared_ptr<vmm_ops> vmm, std::size_t cache_limit = default_cache_limit);
  ~pinned_pool();
  pinned_pool(const pinned_pool&) = delete;
  pinned_pool& operator=(const pinned_pool&) = delete;

  /// A pinned buffer of at least `bytes` (rounded to 64 KiB): cached, else a new one;
  /// on out-of-memory the cache is trimmed and the allocation tried once more.
  /// @throws out_of_memory
  void* acquire(std::size_t bytes);
  /// Returns a buffer got from acquire with the same `bytes`: cached within the limit,
  /// freed (cuMemFreeHost) beyond it.  The caller makes sure no copy still uses it.
  void give_back(void* p, std::size_t bytes) noexcept;
  /// Frees cached buffers until at most `keep_bytes` stay cached.
  std::size_t trim(std::size_t keep_bytes = 0) noexcept;
  pinned_pool_stats stats() const;
  std::size_t cache_limit() const { return cache_limit_; }

 private:
  static std::size_t round(std::size_t bytes) { return (bytes + 0xFFFF) & ~std::size_t{0xFFFF}; }
  std::size_t trim_locked(std::size_t keep_bytes) noexcept;

  std::shared_ptr<vmm_ops> vmm_;
  std::size_t cache_limit_;
  mutable std::mutex mu_;
  std::multimap<std::size_t, void*> cache_;
  pinned_pool_stats stats_;
};

}  // namespace deferalloc
