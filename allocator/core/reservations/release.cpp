// release: unback a batch of ranges, their contents backed up or discarded; and
// release_whole_chunks, which never splits (Note [Deferred reservations] in
// reservations.cpp).
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/reservations.hpp>

#include "core/mode_checks.hpp"
#include "core/reservations/state.hpp"
#include "log.hpp"

namespace deferalloc {

// ---- release ------------------------------------------------------------------------

void reservation_manager::release(reservation_id id, std::size_t offset, std::size_t length, keep_mode keep,
                                  stream_t stream) {
  range r{id, offset, length};
  release(std::span<const range>(&r, 1), keep, stream);
}

void reservation_manager::release(std::span<const range> ranges, keep_mode keep, stream_t stream) {
  detail::log_after_unlock lk(impl_->mu_);
  release_locked(ranges, keep, stream, nullptr);
}

void reservation_manager::release_after(std::span<const range> ranges, keep_mode keep, event_t last_use) {
  DFA_EXPECTS(last_use != nullptr, "release_after: last_use is null");
  detail::log_after_unlock lk(impl_->mu_);
  release_locked(ranges, keep, nullptr, last_use);
}

void reservation_manager::release_locked(std::span<const range> ranges, keep_mode keep, stream_t stream, event_t after) {
  expect_valid(keep, "release");
  reap_retired(false);
  const std::size_t g = impl_->granularity_;
  std::vector<work_item> ws = resolve(ranges);

  // Chunks cut by a range are split first; the contents stay as they were, so a
  // failure later leaves the reservation equivalent to before.
  for (const auto& w : ws) {
    auto& r = *w.r;
    split_at(r, w.begin, stream, after);
    split_at(r, w.end, stream, after);
  }

  // The chunks to unmap, in runs of adjacent chunks (one backup buffer per run).
  struct victim {
    reservation* r;
    std::size_t pos;
    chunk c;
  };
  struct run {
    reservation* r;
    std::size_t begin, end;
    void* host = nullptr;
  };
  std::vector<victim> victims;
  std::vector<run> runs;
  std::vector<reservation*> touched;
  for (const auto& w : ws) {
    auto& r = *w.r;
    for (auto it = r.chunks.lower_bound(w.begin); it != r.chunks.end() && it->first < w.end; ++it) {
      victims.push_back({&r, it->first, it->second});
      if (!runs.empty() && runs.back().r == &r && runs.back().end == it->first) runs.back().end += it->second.bytes;
      else runs.push_back({&r, it->first, it->first + it->second.bytes});
    }
    if (std::find(touched.begin(), touched.end(), &r) == touched.end()) touched.push_back(&r);
  }

  std::vector<event_t> users;
  auto give_back_hosts = [&] {
    for (auto& rn : runs) {
      impl_->pinned_->give_back(rn.host, rn.end - rn.begin);
      rn.host = nullptr;
    }
  };
  if (!victims.empty()) {
    try {
      if (keep == keep_mode::host)
        for (auto& rn : runs) rn.host = impl_->pinned_->acquire(rn.end - rn.begin);
      // The events to wait for: the caller's, or ones recorded now on every user stream.
      if (after == nullptr) users = record_users(touched, stream);
      std::vector<event_t> waits = users;
      if (after != nullptr) waits.push_back(after);
      if (keep == keep_mode::host) {
        for (event_t e : waits) impl_->drv_->stream_wait(impl_->copy_stream_, e);
        for (auto& rn : runs)
          impl_->drv_->copy_async(rn.host, reinterpret_cast<const void*>(rn.r->base + rn.begin), rn.end - rn.begin, impl_->copy_stream_);
        impl_->drv_->synchronize_stream(impl_->copy_stream_);
      } else {
        for (event_t e : waits) impl_->drv_->synchronize(e);
      }
      give_events(users);
    } catch (...) {
      give_events(users);
      try {
        impl_->drv_->synchronize_stream(impl_->copy_stream_);
      } catch (...) {
        detail::log_current("release rollback: waiting for backup copies");
      }
      give_back_hosts();
      throw;
    }

    // Unmap; on failure map back what was unmapped.
    std::size_t done = 0;
    try {
      for (; done < victims.size(); ++done) impl_->drv_->unmap(victims[done].r->base + victims[done].pos, victims[done].c.bytes);
    } catch (...) {
      try {
        for (std::size_t i = 0; i < done; ++i) {
          impl_->drv_->map(victims[i].r->base + victims[i].pos, victims[i].c.bytes, victims[i].c.handle);
          impl_->drv_->set_access(victims[i].r->base + victims[i].pos, victims[i].c.bytes);
        }
      } catch (const std::exception& e) {
        detail::log(log_level::error, std::string("release rollback could not remap a chunk: ") + e.what());
      }
      give_back_hosts();
      throw;
    }
  }

  // Commit.
  std::vector<std::pair<void*, std::size_t>> unused;
  for (const auto& w : ws) {
    auto& r = *w.r;
    if (keep == keep_mode::discard) drop_backup_granules(r, w.begin, w.end, unused);
  }
  for (const auto& v : victims) {
    v.r->chunks.erase(v.pos);
    impl_->pool_->give_back(v.c);
  }
  for (const auto& rn : runs) {
    reservation& r = *rn.r;
    std::uint64_t sid = 0;
    if (keep == keep_mode::host) {
      sid = r.next_segment++;
      r.backups.emplace(sid, backup_segment{rn.begin, rn.end - rn.begin, rn.host, (rn.end - rn.begin) / g});
      r.saved.emplace(rn.begin, reservation::saved_run{rn.end, sid});
      r.saved_granules += (rn.end - rn.begin) / g;
      impl_->backup_bytes_ += rn.end - rn.begin;
    }
    r.backed_granules -= (rn.end - rn.begin) / g;
    impl_->backed_bytes_ -= rn.end - rn.begin;
  }
  for (reservation* r : touched)
    if (r->backed_granules == 0) r->streams.clear();
  retire_buffers(unused);
}

std::vector<range> reservation_manager::release_whole_chunks(std::span<const range> ranges, keep_mode keep,
                                                             stream_t stream) {
  expect_valid(keep, "release_whole_chunks");
  detail::log_after_unlock lk(impl_->mu_);
  std::vector<range> inner;
  for (const auto& w : resolve(ranges)) {
    auto& r = *w.r;
    for (auto it = r.chunks.lower_bound(w.begin); it != r.chunks.end() && it->first < w.end; ++it) {
      if (it->first + it->second.bytes > w.end) break;
      if (!inner.empty() && inner.back().id == r.id && inner.back().offset + inner.back().length == it->first)
        inner.back().length += it->second.bytes;
      else inner.push_back({r.id, it->first, it->second.bytes});
    }
  }
  if (!inner.empty()) release_locked(inner, keep, stream, nullptr);
  return inner;
}

}  // namespace deferalloc
