// Chunk pool: size-class cache of physical chunks with a byte budget.
//
// Approach: one free list per exact chunk size.  try_acquire takes from the list or
// creates (budget permitting; a device OOM is returned as nullopt so the caller can
// fall back to smaller classes that may be cached); acquire adds one trim-and-retry.
// Limits: one mutex; creation happens under it (tens of microseconds at most).
//
// Note [Physical memory policy]
// Released memory goes back to the device: the point of releasing is that someone
// else (this process or another) can use it.  So the pool caches at most cache_limit
// bytes (pool_cache_mb, 64 MiB by default) for churn, and give_back releases chunks
// beyond it to the driver at once; pause, empty_cache and every release therefore
// leave at most that much cached, and physical bytes held <= bytes mapped behind
// reservations + cache_limit (tests assert it on the host driver, which counts its
// chunks, and with cuMemGetInfo on the GPU).  Users that cycle a fixed window of
// chunks (the streamed optimizer) set the limit to their window.  Pinned backup
// buffers are host memory and cost far more to make than to use (pinning 16 GiB took
// 8 s on the H200 machine, the copy 0.3 s), so they are kept for the next pause up to
// pinned_pool's cache_limit (pinned_cache_mb, a quarter of RAM by default) and freed by
// empty_cache and trim.
#include <deferalloc/core/chunk_pool.hpp>
#include <deferalloc/core/errors.hpp>

#include <algorithm>

#include "log.hpp"

namespace deferalloc {

chunk_pool::chunk_pool(std::shared_ptr<vmm_ops> vmm, chunk_pool_config cfg)
    : vmm_(std::move(vmm)), granularity_(0), budget_(cfg.budget), cache_limit_(cfg.cache_limit) {
  DFA_EXPECTS(vmm_ != nullptr, "chunk_pool: driver is null");
  granularity_ = vmm_->granularity();
  classes_ = std::move(cfg.classes);
  if (classes_.empty())
    for (std::size_t c = granularity_; c <= (std::size_t{1} << 30); c *= 2) classes_.push_back(c);
  for (std::size_t c : classes_)
    DFA_EXPECTS(c > 0 && c % granularity_ == 0,
                "chunk_pool: chunk class " + std::to_string(c) + " is not a multiple of the granularity " +
                    std::to_string(granularity_));
  classes_.push_back(granularity_);
  std::sort(classes_.begin(), classes_.end());
  classes_.erase(std::unique(classes_.begin(), classes_.end()), classes_.end());
}

chunk_pool::~chunk_pool() {
  detail::log_after_unlock lk(mu_);
  trim_locked(0);
  if (stats_.taken_bytes != 0)
    detail::log(log_level::warn, "chunk_pool destroyed with " + std::to_string(stats_.taken_bytes) + " bytes still taken");
}

std::optional<chunk> chunk_pool::take_locked(std::size_t bytes) {
  auto it = cache_.find(bytes);
  if (it != cache_.end() && !it->second.empty()) {
    chunk c{it->second.back(), bytes};
    it->second.pop_back();
    stats_.cached_bytes -= bytes;
    stats_.taken_bytes += bytes;
    ++stats_.chunks_reused;
    return c;
  }
  if (budget_ != 0 && stats_.alive_bytes + bytes > budget_) return std::nullopt;
  chunk c{0, bytes};
  try {
    c.handle = vmm().create(bytes);
  } catch (const out_of_memory&) {
    return std::nullopt;
  }
  stats_.alive_bytes += bytes;
  stats_.taken_bytes += bytes;
  stats_.peak_alive_bytes = std::max(stats_.peak_alive_bytes, stats_.alive_bytes);
  ++stats_.chunks_created;
  return c;
}

std::optional<chunk> chunk_pool::try_acquire(std::size_t bytes) {
  DFA_EXPECTS(bytes > 0 && bytes % granularity_ == 0, "chunk_pool: chunk size must be a positive multiple of the granularity");
  detail::log_after_unlock lk(mu_);
  return take_locked(bytes);
}

std::optional<chunk> chunk_pool::try_reuse(std::span<const std::size_t> sizes) {
  detail::log_after_unlock lk(mu_);
  for (std::size_t bytes : sizes) {
    auto it = cache_.find(bytes);
    if (it != cache_.end() && !it->second.empty()) return take_locked(bytes);
  }
  return std::nullopt;
}

chunk chunk_pool::acquire(std::size_t bytes) {
  DFA_EXPECTS(bytes > 0 && bytes % granularity_ == 0, "chunk_pool: chunk size must be a positive multiple of the granularity");
  detail::log_after_unlock lk(mu_);
  if (auto c = take_locked(bytes)) return *c;
  if (trim_locked(0) > 0)
    if (auto c = take_locked(bytes)) return *c;
  throw out_of_memory("chunk_pool: cannot get a chunk of " + std::to_string(bytes) + " bytes (" +
                      std::to_string(stats_.alive_bytes) + " alive" +
                      (budget_ ? ", budget " + std::to_string(budget_) : std::string()) + ")");
}

void chunk_pool::give_back(const chunk& c) noexcept {
  detail::log_after_unlock lk(mu_);
  try {
    cache_[c.bytes].push_back(c.handle);
  } catch (...) {  // no memory for the list: release the chunk instead of losing it
    try {
      vmm().release(c.handle);
    } catch (...) {
      detail::log_current("chunk_pool::give_back: releasing a chunk");
    }
    stats_.taken_bytes -= c.bytes;
    stats_.alive_bytes -= c.bytes;
    ++stats_.chunks_released;
    return;
  }
  stats_.taken_bytes -= c.bytes;
  stats_.cached_bytes += c.bytes;
  if (stats_.cached_bytes > cache_limit_) trim_locked(cache_limit_);
}

std::size_t chunk_pool::trim_locked(std::size_t keep_bytes) noexcept {
  std::size_t released = 0;
  // Largest first: frees the most memory per driver call.
  for (auto it = cache_.rbegin(); it != cache_.rend() && stats_.cached_bytes > keep_bytes; ++it) {
    auto& list = it->second;
    while (!list.empty() && stats_.cached_bytes > keep_bytes) {
      try {
        vmm().release(list.back());
      } catch (const std::exception& e) {
        detail::log(log_level::error, std::string("chunk_pool::trim: ") + e.what());
      }
      list.pop_back();
      stats_.cached_bytes -= it->first;
      stats_.alive_bytes -= it->first;
      ++stats_.chunks_released;
      released += it->first;
    }
  }
  return released;
}

std::size_t chunk_pool::trim(std::size_t keep_bytes) noexcept {
  detail::log_after_unlock lk(mu_);
  return trim_locked(keep_bytes);
}

pool_stats chunk_pool::stats() const {
  detail::log_after_unlock lk(mu_);
  pool_stats s = stats_;
  s.driver_calls = vmm().call_counts();
  return s;
}

void chunk_pool::reset_peak() noexcept {
  detail::log_after_unlock lk(mu_);
  stats_.peak_alive_bytes = stats_.alive_bytes;
}

}  // namespace deferalloc
