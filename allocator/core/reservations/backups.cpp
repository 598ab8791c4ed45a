// Backups: the pinned buffers that hold released contents, dropped when their granules
// are restored or discarded, and retired to the pinned pool in stream order
// (Note [Deferred reservations] in reservations.cpp, its Limits).
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/reservations.hpp>

#include "core/reservations/state.hpp"
#include "log.hpp"

namespace deferalloc {

// Forgets the backups of [begin, end); buffers left with no live granule are appended
// to `unused` (for retire_buffers: a restore may still read them).
void reservation_manager::drop_backup_granules(reservation& r, std::size_t begin, std::size_t end,
                                               std::vector<std::pair<void*, std::size_t>>& unused) {
  if (r.saved.empty()) return;
  r.cut_saved(begin);
  r.cut_saved(end);
  const std::size_t g = impl_->granularity_;
  for (auto it = r.saved.lower_bound(begin); it != r.saved.end() && it->first < end;) {
    const std::size_t n = (it->second.end - it->first) / g;
    auto seg = r.backups.find(it->second.segment);
    r.saved_granules -= n;
    impl_->backup_bytes_ -= n * g;
    seg->second.live -= n;
    if (seg->second.live == 0) {
      unused.emplace_back(seg->second.host, seg->second.bytes);
      r.backups.erase(seg);
    }
    it = r.saved.erase(it);
  }
}

// Hands `buffers` back to the pinned pool after the copies enqueued so far on the copy
// stream (an event; on the host driver at once).  Never throws: when no event can be
// recorded, the copy stream is waited for instead.
void reservation_manager::retire_buffers(std::vector<std::pair<void*, std::size_t>>& buffers) noexcept {
  if (buffers.empty()) return;
  event_t e = nullptr;
  try {
    e = take_event();
    impl_->drv_->record(e, impl_->copy_stream_);
    impl_->retired_.push_back({e, std::move(buffers)});
  } catch (const std::exception& ex) {
    if (e != nullptr) impl_->free_events_.push_back(e);
    try {
      impl_->drv_->synchronize_stream(impl_->copy_stream_);
    } catch (const std::exception& ex2) {
      detail::log(log_level::error, std::string("reservation_manager: waiting for restores: ") + ex2.what());
    }
    for (auto& [p, n] : buffers) impl_->pinned_->give_back(p, n);
  }
  buffers.clear();
  reap_retired(false);
}

void reservation_manager::reap_retired(bool wait) noexcept {
  for (std::size_t i = 0; i < impl_->retired_.size();) {
    bool done = false;
    try {
      if (wait) impl_->drv_->synchronize(impl_->retired_[i].done);
      done = wait || impl_->drv_->query(impl_->retired_[i].done);
    } catch (const std::exception& e) {
      detail::log(log_level::error, std::string("reservation_manager: backup buffers: ") + e.what());
      done = wait;
    }
    if (!done) {
      ++i;
      continue;
    }
    for (auto& [p, n] : impl_->retired_[i].buffers) impl_->pinned_->give_back(p, n);
    try {
      impl_->free_events_.push_back(impl_->retired_[i].done);
    } catch (...) {
      impl_->drv_->destroy_event(impl_->retired_[i].done);
    }
    impl_->retired_[i] = std::move(impl_->retired_.back());
    impl_->retired_.pop_back();
  }
}

std::size_t reservation_manager::trim_backup_cache(std::size_t keep_bytes) {
  detail::log_after_unlock lk(impl_->mu_);
  reap_retired(true);
  return impl_->pinned_->trim(keep_bytes);
}

}  // namespace deferalloc
