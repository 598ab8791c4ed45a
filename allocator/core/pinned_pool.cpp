// Pinned host buffer cache: exact-size free lists (sizes rounded to 64 KiB).
// A buffer larger than asked is never handed out, so a small backup cannot pin a
// large buffer for long.  Limits: one mutex.
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/pinned_pool.hpp>

#include <algorithm>

#include "log.hpp"

namespace deferalloc {

pinned_pool::pinned_pool(std::shared_ptr<vmm_ops> vmm, std::size_t cache_limit)
    : vmm_(std::move(vmm)), cache_limit_(cache_limit) {
  DFA_EXPECTS(vmm_ != nullptr, "pinned_pool: driver is null");
}

pinned_pool::~pinned_pool() {
  std::lock_guard lk(mu_);
  trim_locked(0);
}

void* pinned_pool::acquire(std::size_t bytes) {
  DFA_EXPECTS(bytes > 0, "pinned_pool::acquire: size is zero");
  const std::size_t n = round(bytes);
  std::lock_guard lk(mu_);
  auto it = cache_.find(n);
  if (it != cache_.end()) {
    void* p = it->second;
    cache_.erase(it);
    stats_.cached_bytes -= n;
    stats_.in_use_bytes += n;
    ++stats_.reuses;
    return p;
  }
  void* p = nullptr;
  try {
    p = vmm_->host_alloc(n);
  } catch (const out_of_memory&) {
    if (trim_locked(0) == 0) throw;
    p = vmm_->host_alloc(n);
  }
  ++stats_.allocations;
  stats_.in_use_bytes += n;
  stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.in_use_bytes + stats_.cached_bytes);
  return p;
}

void pinned_pool::give_back(void* p, std::size_t bytes) noexcept {
  if (p == nullptr) return;
  const std::size_t n = round(bytes);
  std::lock_guard lk(mu_);
  stats_.in_use_bytes -= n;
  if (stats_.cached_bytes + n > cache_limit_) {
    vmm_->host_free(p);
    return;
  }
  try {
    cache_.emplace(n, p);
    stats_.cached_bytes += n;
  } catch (...) {
    vmm_->host_free(p);
  }
}

std::size_t pinned_pool::trim_locked(std::size_t keep_bytes) noexcept {
  std::size_t freed = 0;
  while (!cache_.empty() && stats_.cached_bytes > keep_bytes) {
    auto it = std::prev(cache_.end());
    vmm_->host_free(it->second);
    stats_.cached_bytes -= it->first;
    freed += it->first;
    cache_.erase(it);
  }
  return freed;
}

std::size_t pinned_pool::trim(std::size_t keep_bytes) noexcept {
  std::lock_guard lk(mu_);
  return trim_locked(keep_bytes);
}

pinned_pool_stats pinned_pool::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}

}  // namespace deferalloc
