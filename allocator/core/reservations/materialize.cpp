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
std::vector<std::size_t> reservation_manager::classes_at(std::size_t pos, std::size_t end, std::size_t max_class) const {
  std::vector<std::size_t> fit;
  const auto& classes = impl_->pool_->classes();
  for (auto it = classes.rbegin(); it != classes.rend(); ++it)
    if (*it <= max_class && pos % *it == 0 && pos + *it <= end) fit.push_back(*it);
  if (fit.empty()) fit.push_back(impl_->granularity_);
  return fit;
}

// Covers [pos, end) with cached chunks only (at each position the largest cached class
// that fits), all or none: appends to `out` and returns true, or leaves `out` as it
// was.  No driver call.
bool reservation_manager::reuse_cached(std::size_t pos, std::size_t end, std::vector<std::pair<std::size_t, chunk>>& out) {
  const std::size_t mark = out.size();
  while (pos < end) {
    auto ch = impl_->pool_->try_reuse(classes_at(pos, end, end - pos));
    if (!ch) {
      for (std::size_t i = mark; i < out.size(); ++i) impl_->pool_->give_back(out[i].second);
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
// range into many small pieces.  Appends to `out`; returns false when even a granule
// could not be had (what was appended stays there).
bool reservation_manager::acquire_pieces(std::size_t pos, std::size_t end, std::size_t max_class,
                                         std::vector<std::pair<std::size_t, chunk>>& out) {
  const auto& classes = impl_->pool_->classes();
  while (pos < end) {
    const std::size_t c = classes_at(pos, end, max_class).front();
    if (reuse_cached(pos, pos + c, out)) {
      pos += c;
      continue;
    }
    if (auto ch = impl_->pool_->try_acquire(c)) {
      out.emplace_back(pos, *ch);
    } else {
      if (c == impl_->granularity_) return false;
      auto smaller = std::prev(std::lower_bound(classes.begin(), classes.end(), c));
      if (!acquire_pieces(pos, pos + c, *smaller, out)) return false;
    }
    pos += c;
  }
  return true;
}

// Chunks for every run (begin, end): all or none.  @throws out_of_memory
std::vector<std::pair<std::size_t, chunk>> reservation_manager::plan_chunks(
    const std::vector<std::pair<std::size_t, std::size_t>>& runs) {
  std::vector<std::pair<std::size_t, chunk>> out;
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool ok = true;
    try {
      for (const auto& [b, e] : runs)
        if (!(ok = acquire_pieces(b, e, impl_->pool_->classes().back(), out))) break;
    } catch (...) {
      for (auto& [pos, c] : out) impl_->pool_->give_back(c);
      throw;
    }
    if (ok) return out;
    for (auto& [pos, c] : out) impl_->pool_->give_back(c);
    out.clear();
    if (attempt == 0) impl_->pool_->trim();
  }
  std::size_t want = 0;
  for (const auto& [b, e] : runs) want += e - b;
  const pool_stats ps = impl_->pool_->stats();
  std::string dev;
  try {
    auto mi = impl_->drv_->get_memory_info();
    dev = ", device free " + std::to_string(mi.free_bytes) + " of " + std::to_string(mi.total_bytes);
  } catch (...) {
    detail::log_current("out-of-memory report: device memory info", log_level::warn);
  }
  throw out_of_memory("out of memory backing " + std::to_string(want) + " bytes (pool: " +
                      std::to_string(ps.alive_bytes) + " bytes alive, " + std::to_string(ps.taken_bytes) + " mapped" + dev +
                      ")");
}

// ---- materialize --------------------------------------------------------------------

void reservation_manager::materialize(reservation_id id, std::size_t offset, std::size_t length, fill_mode fill,
                                      stream_t stream) {
  range r{id, offset, length};
  materialize(std::span<const range>(&r, 1), fill, stream);
}

void reservation_manager::materialize(std::span<const range> ranges, fill_mode fill, stream_t stream) {
  expect_valid(fill, "materialize");
  detail::log_after_unlock lk(impl_->mu_);
  reap_retired(false);
  const std::size_t g = impl_->granularity_;
  std::vector<work_item> ws = resolve(ranges);

  // Unbacked runs, per reservation; `parts` are the pieces of the ranges asked for.
  // Chunks are planned per part, so that no chunk crosses a boundary of the ranges (a
  // later release of one range then never splits); set_access and fills go per run.
  struct run {
    reservation* r;
    std::size_t begin, end;
    std::vector<std::pair<std::size_t, std::size_t>> parts;
  };
  std::vector<run> runs;
  for (const auto& w : ws) {
    auto& r = *static_cast<reservation*>(w.r);
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
  if (runs.empty()) return;  // already backed: a no-op

  // Chunks for all runs (offsets are per reservation, so plan run by run but all-or-nothing).
  std::vector<std::vector<std::pair<std::size_t, chunk>>> pieces(runs.size());
  auto give_back_all = [&] {
    for (auto& ps : pieces)
      for (auto& [pos, c] : ps) impl_->pool_->give_back(c);
  };
  try {
    for (std::size_t i = 0; i < runs.size(); ++i) pieces[i] = plan_chunks(runs[i].parts);
  } catch (...) {
    give_back_all();
    throw;
  }

  // Map, then one set_access per run.
  std::vector<std::pair<std::uintptr_t, std::size_t>> mapped;
  auto unmap_all = [&] {
    for (auto& [va, n] : mapped) unmap_quietly(va, n);
  };
  try {
    for (std::size_t i = 0; i < runs.size(); ++i)
      for (auto& [pos, c] : pieces[i]) {
        impl_->drv_->map(runs[i].r->base + pos, c.bytes, c.handle);
        mapped.emplace_back(runs[i].r->base + pos, c.bytes);
      }
    for (const auto& rn : runs) impl_->drv_->set_access(rn.r->base + rn.begin, rn.end - rn.begin);
    if (fill == fill_mode::zero) {
      for (const auto& rn : runs) impl_->drv_->zero_async(reinterpret_cast<void*>(rn.r->base + rn.begin), rn.end - rn.begin, stream);
    } else if (fill == fill_mode::restore) {
      for (const auto& rn : runs) {
        reservation& r = *rn.r;
        for (auto it = r.saved_from(rn.begin); it != r.saved.end() && it->first < rn.end; ++it) {
          const std::size_t b = std::max(it->first, rn.begin), e = std::min(it->second.end, rn.end);
          const backup_segment& seg = r.backups.at(it->second.segment);
          impl_->drv_->copy_async(reinterpret_cast<void*>(r.base + b), static_cast<const char*>(seg.host) + (b - seg.offset),
                           e - b, impl_->copy_stream_);
        }
      }
      std::vector<event_t> done{take_event()};
      try {
        impl_->drv_->record(done[0], impl_->copy_stream_);
        impl_->drv_->stream_wait(stream, done[0]);
      } catch (...) {
        give_events(done);
        throw;
      }
      give_events(done);
    }
  } catch (...) {
    try {  // copies may be in flight into the ranges we are about to unmap
      impl_->drv_->synchronize_stream(impl_->copy_stream_);
      impl_->drv_->synchronize_stream(stream);
    } catch (...) {
      detail::log_current("materialize rollback: waiting for copies");
    }
    unmap_all();
    give_back_all();
    throw;
  }

  // Commit.  Backups restored (or overwritten) are dropped; their buffers go back to
  // the pinned pool once the copies reading them are done.
  std::vector<std::pair<void*, std::size_t>> unused;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    reservation& r = *runs[i].r;
    for (auto& [pos, c] : pieces[i]) r.chunks.emplace(pos, c);
    drop_backup_granules(r, runs[i].begin, runs[i].end, unused);
    r.backed_granules += (runs[i].end - runs[i].begin) / g;
    impl_->backed_bytes_ += runs[i].end - runs[i].begin;
    r.use(stream);
  }
  impl_->peak_backed_ = std::max(impl_->peak_backed_, impl_->backed_bytes_);
  retire_buffers(unused);
}

}  // namespace deferalloc
