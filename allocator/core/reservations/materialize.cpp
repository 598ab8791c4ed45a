// materialize: the chunks for the unbacked runs of a batch of ranges, mapped, made
// accessible and filled (Note [Deferred reservations] in reservations.cpp).
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/reservations.hpp>

#include "core/mode_checks.hpp"
#include "core/reservations/state.hpp"
#include "log.hpp"

namespace deferalloc {

using detail::gaps;

// ---- chunk planning -----------------------------------------------------------------

// The classes that fit at `pos` inside [pos, end), at most `max_class`, largest first
// (the granularity when none does).
std::vector<std::size_t> reservation_manager::impl::classes_at(std::size_t pos, std::size_t end, std::size_t max_class) const {
  std::vector<std::size_t> fit;
  const auto& classes = pool_->classes();
  for (auto it = classes.rbegin(); it != classes.rend(); ++it)
    if (*it <= max_class && pos % *it == 0 && pos + *it <= end) fit.push_back(*it);
  if (fit.empty()) fit.push_back(granularity_);
  return fit;
}

// Covers [pos, end) with cached chunks only (at each position the largest cached class
// that fits), all or none: appends to `out` and returns true, or leaves `out` as it
// was.  No driver call.
bool reservation_manager::impl::reuse_cached(std::size_t pos, std::size_t end, placed_chunks& out) {
  const std::size_t mark = out.size();
  while (pos < end) {
    auto ch = pool_->try_reuse(classes_at(pos, end, end - pos));
    if (!ch) {
      for (std::size_t i = mark; i < out.size(); ++i) pool_->give_back(out[i].second);
      out.resize(mark);
      return false;
    }
    out.emplace_back(pos, *ch);
    pos += ch->bytes;
  }
  return true;
}

// Acquires chunks for [pos, end) (offsets in one reservation), piece by piece of the
// largest aligned class: a cached chunk of that class, else cached chunks of smaller
// classes that cover the whole piece (memory already held is used before more is
// created: Note [Physical memory policy] in chunk_pool.cpp), else a new chunk; a class
// the pool cannot give is replaced by smaller ones.  Smaller cached chunks are used
// only when they cover a whole piece, so one small cached chunk never breaks a large
// range into many small pieces.  With `whole_pieces`, a run that is not one class is one
// chunk of its exact size (any multiple of the granularity: cuMemCreate takes it) where
// one can be had, and a piece is one chunk whenever one of its class can be had (cached or
// new) before smaller cached chunks are tried: fewer mappings for a range paused and
// resumed often, at the cost of creating a chunk while smaller ones stay cached (within
// pool_cache_mb).  Appends to `out`; returns false when even
// a granule could not be had (what was appended stays there).
bool reservation_manager::impl::acquire_pieces(std::size_t pos, std::size_t end, std::size_t max_class,
                                         placed_chunks& out, bool whole_pieces) {
  const auto& classes = pool_->classes();
  if (whole_pieces && end - pos > classes_at(pos, end, max_class).front()) {
    // Not one class: one chunk of the run's exact size where the pool has or can make one.
    const std::size_t exact[1] = {end - pos};
    auto ch = pool_->try_reuse(exact);
    if (!ch) ch = pool_->try_acquire(end - pos);
    if (ch) {
      out.emplace_back(pos, *ch);
      return true;
    }
  }
  while (pos < end) {
    const std::size_t c = classes_at(pos, end, max_class).front();
    if (whole_pieces) {
      const std::size_t one[1] = {c};
      auto ch = pool_->try_reuse(one);
      if (!ch) ch = pool_->try_acquire(c);
      if (ch) {
        out.emplace_back(pos, *ch);
        pos += c;
        continue;
      }
    }
    if (reuse_cached(pos, pos + c, out)) {
      pos += c;
      continue;
    }
    if (auto ch = pool_->try_acquire(c)) {
      out.emplace_back(pos, *ch);
    } else {
      if (c == granularity_) return false;
      auto smaller = std::prev(std::lower_bound(classes.begin(), classes.end(), c));
      if (!acquire_pieces(pos, pos + c, *smaller, out, whole_pieces)) return false;
    }
    pos += c;
  }
  return true;
}

// Chunks for every run (begin, end): all or none.  @throws out_of_memory
reservation_manager::impl::placed_chunks reservation_manager::impl::plan_chunks(
    const std::vector<std::pair<std::size_t, std::size_t>>& runs, bool whole_pieces) {
  placed_chunks out;
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool ok = true;
    try {
      for (const auto& [b, e] : runs)
        if (!(ok = acquire_pieces(b, e, pool_->classes().back(), out, whole_pieces))) break;
    } catch (...) {
      for (auto& [pos, c] : out) pool_->give_back(c);
      throw;
    }
    if (ok) return out;
    for (auto& [pos, c] : out) pool_->give_back(c);
    out.clear();
    if (attempt == 0) pool_->trim();
  }
  std::size_t want = 0;
  for (const auto& [b, e] : runs) want += e - b;
  const pool_stats ps = pool_->stats();
  std::string dev;
  try {
    auto mi = vmm_.get_memory_info();
    dev = ", device free " + std::to_string(mi.free_bytes) + " of " + std::to_string(mi.total_bytes);
  } catch (...) {
    detail::log_current("out-of-memory report: device memory info", log_level::warn);
  }
  throw out_of_memory("out of memory backing " + std::to_string(want) + " bytes (pool: " +
                      std::to_string(ps.alive_bytes) + " bytes alive, " + std::to_string(ps.taken_bytes) + " mapped" + dev +
                      ")");
}

// ---- materialize --------------------------------------------------------------------

// An unbacked run of one reservation; `parts` are its pieces of the ranges asked for.
// Chunks are planned per part, so that no chunk crosses a boundary of the ranges (a later
// release of one range then never splits); set_access and fills go per run.
struct reservation_manager::impl::run {
  reservation* r;
  std::size_t begin, end;
  std::vector<std::pair<std::size_t, std::size_t>> parts;
};

void reservation_manager::impl::materialize(std::span<const range> ranges, fill_mode fill, stream_t stream,
                                            bool whole_pieces) {
  expect_valid(fill, "materialize");
  detail::log_after_unlock lk(mu_);
  reap_retired(false);
  const std::vector<run> runs = unbacked_runs(resolve(ranges), fill);
  if (runs.empty()) return;  // already backed: a no-op
  std::vector<placed_chunks> pieces = chunks_for(runs, whole_pieces);
  map_and_fill(runs, pieces, fill, stream);
  commit_backed(runs, pieces, stream);
}

// The unbacked runs of a batch, per reservation.  @throws invalid_state (restore of a
// granule without backup)
std::vector<reservation_manager::impl::run> reservation_manager::impl::unbacked_runs(const std::vector<work_item>& ws,
                                                                                    fill_mode fill) const {
  std::vector<run> runs;
  for (const auto& w : ws) {
    reservation& r = *w.r;
    for (const auto& [b, e] : gaps(r.chunks, w.begin, w.end)) {
      if (fill == fill_mode::restore) {
        const std::size_t miss = r.first_unsaved(b, e);
        if (miss < e)
          throw invalid_state("materialize(restore): granule at offset " + std::to_string(miss) + " of reservation " +
                              std::to_string(r.id) + " has no backup to restore (it was never released with keep=host)");
      }
      if (runs.empty() || runs.back().r != &r || runs.back().end != b) runs.push_back({&r, b, b, {}});
      runs.back().end = e;
      runs.back().parts.emplace_back(b, e);
    }
  }
  return runs;
}

// Chunks for all runs (offsets are per reservation, so planned run by run but all or
// nothing).  @throws out_of_memory
std::vector<reservation_manager::impl::placed_chunks> reservation_manager::impl::chunks_for(const std::vector<run>& runs,
                                                                                           bool whole_pieces) {
  std::vector<placed_chunks> pieces(runs.size());
  try {
    for (std::size_t i = 0; i < runs.size(); ++i) pieces[i] = plan_chunks(runs[i].parts, whole_pieces);
  } catch (...) {
    for (auto& ps : pieces)
      for (auto& [pos, c] : ps) pool_->give_back(c);
    throw;
  }
  return pieces;
}

// Maps the chunks, one set_access per run, then the fill.  On failure every mapping is
// removed and the chunks go back to the pool.
void reservation_manager::impl::map_and_fill(const std::vector<run>& runs, const std::vector<placed_chunks>& pieces,
                                             fill_mode fill, stream_t stream) {
  std::vector<std::pair<std::uintptr_t, std::size_t>> mapped;
  try {
    for (std::size_t i = 0; i < runs.size(); ++i)
      for (auto& [pos, c] : pieces[i]) {
        vmm_.map(runs[i].r->base + pos, c.bytes, c.handle);
        mapped.emplace_back(runs[i].r->base + pos, c.bytes);
      }
    for (const auto& rn : runs) vmm_.set_access(rn.r->base + rn.begin, rn.end - rn.begin);
    if (fill == fill_mode::zero) {
      for (const auto& rn : runs) streams_.zero_async(reinterpret_cast<void*>(rn.r->base + rn.begin), rn.end - rn.begin, stream);
    } else if (fill == fill_mode::restore) {
      restore_into(runs, stream);
    }
  } catch (...) {
    try {  // copies may be in flight into the ranges we are about to unmap
      streams_.synchronize_stream(copy_stream_);
      streams_.synchronize_stream(stream);
    } catch (...) {
      detail::log_current("materialize rollback: waiting for copies");
    }
    for (auto& [va, n] : mapped) unmap_quietly(va, n);
    for (auto& ps : pieces)
      for (auto& [pos, c] : ps) pool_->give_back(c);
    throw;
  }
}

// Copies the backups of the runs back on the copy stream; `stream` waits for them.
void reservation_manager::impl::restore_into(const std::vector<run>& runs, stream_t stream) {
  for (const auto& rn : runs) {
    reservation& r = *rn.r;
    for (auto it = r.saved_from(rn.begin); it != r.saved.end() && it->first < rn.end; ++it) {
      if (it->second.segment == 0) continue;  // no backup: left undefined (release_keeping)
      const std::size_t b = std::max(it->first, rn.begin), e = std::min(it->second.end, rn.end);
      const backup_segment& seg = r.backups.at(it->second.segment);
      streams_.copy_async(reinterpret_cast<void*>(r.base + b), static_cast<const char*>(seg.host) + (b - seg.offset), e - b,
                       copy_stream_);
    }
  }
  std::vector<event_t> done{events_.take()};
  try {
    streams_.record(done[0], copy_stream_);
    streams_.stream_wait(stream, done[0]);
  } catch (...) {
    events_.give(done);
    throw;
  }
  events_.give(done);
}

// The commit.  Backups restored (or overwritten) are dropped; their buffers go back to
// the pinned pool once the copies reading them are done.
void reservation_manager::impl::commit_backed(const std::vector<run>& runs, std::vector<placed_chunks>& pieces,
                                              stream_t stream) {
  buffers unused;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    reservation& r = *runs[i].r;
    for (auto& [pos, c] : pieces[i]) r.chunks.emplace(pos, c);
    drop_backup_granules(r, runs[i].begin, runs[i].end, unused);
    r.backed_granules += (runs[i].end - runs[i].begin) / granularity_;
    counts_.backed(runs[i].end - runs[i].begin);
    r.use(stream);
  }
  retire_buffers(unused);
}

}  // namespace deferalloc
