// The chunk pool: physical chunks in size classes, recycled instead of re-created.
//
// cuMemCreate costs 8.8 us (2 MiB) to 48 us (1 GiB) on H200 and map + access cost
// per chunk, so large ranges use large chunks and released chunks are cached by
// size for the next materialize (no cuMemCreate per resume).  The cache is bounded
// (cache_limit, 64 MiB by default: Note [Physical memory policy] in chunk_pool.cpp):
// chunks given back beyond it go back to the driver at once.  A byte budget bounds
// the chunks alive (taken + cached); trim() gives cached chunks back to the driver.
#pragma once
#include <deferalloc/core/driver.hpp>

#include <cstddef>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

namespace deferalloc {

/// Default bound on the bytes a chunk pool keeps cached (settings key pool_cache_mb).
inline constexpr std::size_t k_default_pool_cache = std::size_t{64} << 20;
/// A cache limit meaning "keep every chunk given back" (a window that recycles its chunks).
inline constexpr std::size_t no_cache_limit = std::numeric_limits<std::size_t>::max();

struct chunk_pool_config {
  /// Chunk sizes in bytes, each a multiple of the granularity; the granularity is
  /// always added.  Empty: every power of two from the granularity up to 1 GiB.
  std::vector<std::size_t> classes;
  /// Bytes of chunks alive at once (taken + cached); 0 = no limit but the device's.
  std::size_t budget = 0;
  /// Bytes of chunks kept cached for reuse; chunks given back beyond it are released
  /// to the driver at once.  0 = cache nothing; no_cache_limit = keep everything.
  std::size_t cache_limit = k_default_pool_cache;
};

/// One physical chunk.
struct chunk {
  chunk_handle handle{};
  std::size_t bytes{};
};

struct pool_stats {
  std::size_t alive_bytes = 0;   ///< created and not yet released to the driver
  std::size_t taken_bytes = 0;   ///< handed out (mapped behind a reservation)
  std::size_t cached_bytes = 0;  ///< kept for reuse
  std::size_t peak_alive_bytes = 0;
  std::uint64_t chunks_created = 0;
  std::uint64_t chunks_reused = 0;
  std::uint64_t chunks_released = 0;
  driver_call_counts driver_calls;
};

class DFA_API chunk_pool {
 public:
  /// @throws invalid_argument for a class that is not a multiple of the granularity.
  chunk_pool(std::shared_ptr<vmm_ops> vmm, chunk_pool_config cfg = {});
  /// Releases every cached chunk.  Taken chunks belong to their users.
  ~chunk_pool();
  chunk_pool(const chunk_pool&) = delete;
  chunk_pool& operator=(const chunk_pool&) = delete;

  /// The half of the driver the pool calls (create, release, granularity, counts).
  vmm_ops& vmm() const { return *vmm_; }
  /// The same, shared: the reservation manager built on the pool builds its pinned pool on it.
  const std::shared_ptr<vmm_ops>& vmm_ptr() const { return vmm_; }
  std::size_t granularity() const { return granularity_; }
  /// The size classes, ascending.
  const std::vector<std::size_t>& classes() const { return classes_; }

  /// A chunk of exactly `bytes` (a class): a cached one, else a new one if the
  /// budget and the device allow; std::nullopt otherwise.  Never trims.
  /// Cost: none when cached, one cuMemCreate otherwise.
  std::optional<chunk> try_acquire(std::size_t bytes);
  /// A cached chunk of the first size in `sizes` that has one, or std::nullopt.  Never
  /// creates.  No driver call.
  std::optional<chunk> try_reuse(std::span<const std::size_t> sizes);
  /// As try_acquire, but on failure trims the cache and tries once more.
  /// @throws out_of_memory
  chunk acquire(std::size_t bytes);
  /// Returns a chunk (not mapped anywhere any more) to the cache; when the cache then
  /// holds more than cache_limit, cached chunks are released (largest first) until it
  /// does not.  Cost: no driver call within the limit, one cuMemRelease per chunk beyond.
  void give_back(const chunk& c) noexcept;
  /// Releases cached chunks until at most `keep_bytes` stay cached.  Returns the bytes
  /// released.  Cost: one cuMemRelease per chunk.
  std::size_t trim(std::size_t keep_bytes = 0) noexcept;
  pool_stats stats() const;
  /// The bound on cached bytes.
  std::size_t cache_limit() const { return cache_limit_; }
  /// The bound on alive bytes (pool_budget_mb; 0: none).
  std::size_t budget() const { return budget_; }
  /// Forgets peak values.
  void reset_peak() noexcept;

 private:
  std::optional<chunk> take_locked(std::size_t bytes);
  std::size_t trim_locked(std::size_t keep_bytes) noexcept;

  std::shared_ptr<vmm_ops> vmm_;
  std::size_t granularity_;
  std::size_t budget_;
  std::size_t cache_limit_;
  std::vector<std::size_t> classes_;
  mutable std::mutex mu_;
  std::map<std::size_t, std::vector<chunk_handle>> cache_;
  pool_stats stats_;
};

}  // namespace deferalloc
