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

void reservation_manager::impl::release(std::span<const range> ranges, keep_mode keep, stream_t stream, event_t after,
                                        const std::span<const range>* kept) {
  detail::log_after_unlock lk(mu_);
  release_locked(ranges, keep, stream, after, kept);
}

// What a release unmaps: the chunks inside its ranges (`victims`), in runs of adjacent
// chunks (`runs`), what it backs up (`copies`: one pinned buffer each; the runs
// themselves, or with release_keeping their parts inside the kept ranges), and the
// reservations it touches.
struct reservation_manager::impl::release_plan {
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
  std::vector<run> runs, copies;
  std::vector<reservation*> touched;
};

void reservation_manager::impl::release_locked(std::span<const range> ranges, keep_mode keep, stream_t stream,
                                               event_t after, const std::span<const range>* kept) {
  expect_valid(keep, "release");
  reap_retired(false);
  const std::vector<work_item> ws = resolve(ranges);
  // Chunks cut by a range are split first; the contents stay as they were, so a
  // failure later leaves the reservation equivalent to before.
  for (const auto& w : ws) {
    split_at(*w.r, w.begin, stream, after);
    split_at(*w.r, w.end, stream, after);
  }
  release_plan plan = plan_release(ws);
  if (kept != nullptr) plan_copies(plan, *kept);
  else if (keep == keep_mode::host) plan.copies = plan.runs;
  if (!plan.victims.empty()) {
    back_up_and_wait(plan, keep, stream, after);
    unmap_chunks(plan);
  }
  commit_released(ws, plan, keep);
}

reservation_manager::impl::release_plan reservation_manager::impl::plan_release(const std::vector<work_item>& ws) const {
  release_plan plan;
  for (const auto& w : ws) {
    reservation& r = *w.r;
    for (auto it = r.chunks.lower_bound(w.begin); it != r.chunks.end() && it->first < w.end; ++it) {
      plan.victims.push_back({&r, it->first, it->second});
      if (!plan.runs.empty() && plan.runs.back().r == &r && plan.runs.back().end == it->first)
        plan.runs.back().end += it->second.bytes;
      else plan.runs.push_back({&r, it->first, it->first + it->second.bytes});
    }
    if (std::find(plan.touched.begin(), plan.touched.end(), &r) == plan.touched.end()) plan.touched.push_back(&r);
  }
  return plan;
}

// The parts of the runs inside `kept`, adjacent ones merged (kept ranges may be given in
// any order and may touch; they must not overlap, as a batch's ranges must not).
void reservation_manager::impl::plan_copies(release_plan& plan, std::span<const range> kept) {
  const std::vector<work_item> ks = resolve(kept);  // sorted by reservation, then offset
  std::size_t k = 0;
  for (const auto& rn : plan.runs) {  // sorted the same way
    const auto before = [&](const work_item& w) {
      return w.r != rn.r ? std::less<reservation*>()(w.r, rn.r) : w.end <= rn.begin;
    };
    while (k < ks.size() && before(ks[k])) ++k;
    for (std::size_t i = k; i < ks.size() && ks[i].r == rn.r && ks[i].begin < rn.end; ++i) {
      const std::size_t b = std::max(ks[i].begin, rn.begin), e = std::min(ks[i].end, rn.end);
      if (!plan.copies.empty() && plan.copies.back().r == rn.r && plan.copies.back().end == b) plan.copies.back().end = e;
      else plan.copies.push_back({rn.r, b, e});
    }
  }
}

// Backs the copies up (keep_mode::host: into pinned buffers, on the copy stream after the
// users' events) and waits for the users: the caller's event `after`, or events recorded
// now on every stream that used the ranges.  On failure the buffers go back.
void reservation_manager::impl::back_up_and_wait(release_plan& plan, keep_mode keep, stream_t stream, event_t after) {
  std::vector<event_t> users;
  try {
    if (keep == keep_mode::host)
      for (auto& rn : plan.copies) rn.host = pinned_->acquire(rn.end - rn.begin);
    if (after == nullptr) users = record_users(plan.touched, stream);
    std::vector<event_t> waits = users;
    if (after != nullptr) waits.push_back(after);
    if (keep == keep_mode::host) {
      for (event_t e : waits) streams_.stream_wait(copy_stream_, e);
      for (auto& rn : plan.copies)
        streams_.copy_async(rn.host, reinterpret_cast<const void*>(rn.r->base + rn.begin), rn.end - rn.begin, copy_stream_);
      streams_.synchronize_stream(copy_stream_);
    } else {
      for (event_t e : waits) streams_.synchronize(e);
    }
    events_.give(users);
  } catch (...) {
    events_.give(users);
    try {
      streams_.synchronize_stream(copy_stream_);
    } catch (...) {
      detail::log_current("release rollback: waiting for backup copies");
    }
    give_back_hosts(plan);
    throw;
  }
}

void reservation_manager::impl::give_back_hosts(release_plan& plan) noexcept {
  for (auto& rn : plan.copies) {
    if (rn.host == nullptr) continue;
    pinned_->give_back(rn.host, rn.end - rn.begin);
    rn.host = nullptr;
  }
}

// Unmaps the chunks; on failure maps back what was unmapped and gives the buffers back.
void reservation_manager::impl::unmap_chunks(release_plan& plan) {
  const auto& vs = plan.victims;
  std::size_t done = 0;
  try {
    for (; done < vs.size(); ++done) vmm_.unmap(vs[done].r->base + vs[done].pos, vs[done].c.bytes);
  } catch (...) {
    try {
      for (std::size_t i = 0; i < done; ++i) {
        vmm_.map(vs[i].r->base + vs[i].pos, vs[i].c.bytes, vs[i].c.handle);
        vmm_.set_access(vs[i].r->base + vs[i].pos, vs[i].c.bytes);
      }
    } catch (const std::exception& e) {
      detail::log(log_level::error, std::string("release rollback could not remap a chunk: ") + e.what());
    }
    give_back_hosts(plan);
    throw;
  }
}

// The commit: chunks back to the pool, backups recorded (host) or dropped (discard).
void reservation_manager::impl::commit_released(const std::vector<work_item>& ws, const release_plan& plan,
                                                keep_mode keep) {
  const std::size_t g = granularity_;
  buffers unused;
  if (keep == keep_mode::discard)
    for (const auto& w : ws) drop_backup_granules(*w.r, w.begin, w.end, unused);
  for (const auto& v : plan.victims) {
    v.r->chunks.erase(v.pos);
    pool_->give_back(v.c);
  }
  std::size_t c = 0;  // plan.copies lie inside plan.runs, in the same order
  for (const auto& rn : plan.runs) {
    reservation& r = *rn.r;
    if (keep == keep_mode::host) {
      std::size_t pos = rn.begin;  // what lies outside the copies is saved without a backup
      for (; c < plan.copies.size() && plan.copies[c].r == &r && plan.copies[c].begin < rn.end; ++c) {
        const auto& cp = plan.copies[c];
        if (cp.begin > pos) r.saved.emplace(pos, reservation::saved_run{cp.begin, 0});
        const std::uint64_t sid = r.next_segment++;
        r.backups.emplace(sid, backup_segment{cp.begin, cp.end - cp.begin, cp.host, (cp.end - cp.begin) / g});
        r.saved.emplace(cp.begin, reservation::saved_run{cp.end, sid});
        r.saved_granules += (cp.end - cp.begin) / g;
        counts_.saved(cp.end - cp.begin);
        pos = cp.end;
      }
      if (pos < rn.end) r.saved.emplace(pos, reservation::saved_run{rn.end, 0});
    }
    r.backed_granules -= (rn.end - rn.begin) / g;
    counts_.unbacked(rn.end - rn.begin);
  }
  for (reservation* r : plan.touched)
    if (r->backed_granules == 0) r->streams.clear();
  retire_buffers(unused);
}

std::vector<range> reservation_manager::impl::release_whole_chunks(std::span<const range> ranges, keep_mode keep,
                                                                   stream_t stream) {
  expect_valid(keep, "release_whole_chunks");
  detail::log_after_unlock lk(mu_);
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
