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
void reservation_manager::impl::drop_backup_granules(reservation& r, std::size_t begin, std::size_t end,
                                                     buffers& unused) {
  if (r.saved.empty()) return;
  r.cut_saved(begin);
  r.cut_saved(end);
  const std::size_t g = granularity_;
  for (auto it = r.saved.lower_bound(begin); it != r.saved.end() && it->first < end;) {
    if (it->second.segment == 0) {  // released outside release_keeping's kept ranges: no backup
      it = r.saved.erase(it);
      continue;
    }
    const std::size_t n = (it->second.end - it->first) / g;
    auto seg = r.backups.find(it->second.segment);
    r.saved_granules -= n;
    counts_.unsaved(n * g);
    seg->second.live -= n;
    if (seg->second.live == 0) {
      unused.emplace_back(seg->second.host, seg->second.bytes);
      r.backups.erase(seg);
    }
    it = r.saved.erase(it);
  }
}

// Hands `bufs` back to the pinned pool after the copies enqueued so far on the copy
// stream (an event; on the host driver at once).  Never throws: when no event can be
// recorded, the copy stream is waited for instead.
void reservation_manager::impl::retire_buffers(buffers& bufs) noexcept {
  if (bufs.empty()) return;
  event_t e = nullptr;
  try {
    e = events_.take();
    streams_.record(e, copy_stream_);
    retired_.push_back({e, std::move(bufs)});
  } catch (const std::exception& ex) {
    if (e != nullptr) events_.give(e);
    try {
      streams_.synchronize_stream(copy_stream_);
    } catch (const std::exception& ex2) {
      detail::log(log_level::error, std::string("reservation_manager: waiting for restores: ") + ex2.what());
    }
    for (auto& [p, n] : bufs) pinned_->give_back(p, n);
  }
  bufs.clear();
  reap_retired(false);
}

void reservation_manager::impl::reap_retired(bool wait) noexcept {
  for (std::size_t i = 0; i < retired_.size();) {
    bool done = false;
    try {
      if (wait) streams_.synchronize(retired_[i].done);
      done = wait || streams_.query(retired_[i].done);
    } catch (const std::exception& e) {
      detail::log(log_level::error, std::string("reservation_manager: backup buffers: ") + e.what());
      done = wait;
    }
    if (!done) {
      ++i;
      continue;
    }
    for (auto& [p, n] : retired_[i].bufs) pinned_->give_back(p, n);
    events_.give(retired_[i].done);
    retired_[i] = std::move(retired_.back());
    retired_.pop_back();
  }
}

std::size_t reservation_manager::impl::trim_backup_cache(std::size_t keep_bytes) {
  detail::log_after_unlock lk(mu_);
  reap_retired(true);
  return pinned_->trim(keep_bytes);
}

}  // namespace deferalloc
