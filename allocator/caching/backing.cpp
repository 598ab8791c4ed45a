// The caching allocator's segments and their physical backing: a segment is a reservation
// of the manager; its granules are materialized in growth steps (Note [Growth steps] in
// caching_allocator.cpp) and given back only as whole free chunks (release_whole_chunks),
// so memory under a live block never moves.
#include <deferalloc/caching/caching_allocator.hpp>
#include <deferalloc/core/errors.hpp>

#include <algorithm>
#include <bit>
#include <string>
#include <vector>

#include "caching/allocator_state.hpp"
#include "log.hpp"

namespace deferalloc {

segment& caching_allocator::impl::add_segment(group& grp, std::size_t min_bytes) {
  const std::size_t bytes = std::max(segment_reserve, (min_bytes + g - 1) / g * g);
  auto seg = std::make_unique<segment>();
  seg->id = mgr.reserve(bytes);  // address space only; throws out_of_memory
  try {
    seg->base = reinterpret_cast<std::uintptr_t>(mgr.address(seg->id));
    seg->size = bytes;
    seg->backed.assign(bytes / g, 0);
    seg->grp = &grp;
    block* b = spare.take();
    b->addr = seg->base;
    b->size = bytes;
    b->seg = seg.get();
    b->owner = streams.fresh();
    seg->first = b;
    grp.bins_of(streams.fresh()).b.insert(b);
    grp.segments.push_back(std::move(seg));
  } catch (...) {
    if (seg->first != nullptr) {
      grp.bins_of(streams.fresh()).b.remove(seg->first);
      spare.give(seg->first);
    }
    mgr.free(seg->id);
    throw;
  }
  stat_set::add(st.segment, grp.small, 1);
  return *grp.segments.back();
}

void caching_allocator::impl::ensure_backed(block* b, stream_t stream) {
  if (b->backed) return;
  segment& s = *b->seg;
  const std::size_t first = first_granule(b), end = end_granule(b);
  std::size_t missing = 0;
  for (std::size_t i = first; i < end; ++i) missing += s.backed[i] == 0;
  if (missing == 0) {
    b->backed = true;
    return;
  }
  if (reserved + missing * g > limit) {
    fraction_refused = true;
    throw out_of_memory("memory fraction " + std::to_string(cfg.memory_fraction) + " allows " +
                        std::to_string(limit) + " bytes, " + std::to_string(reserved) + " are backed");
  }
  // Grow in steps (see Note [Growth steps] in caching_allocator.cpp): also back the
  // unbacked granules after the block (free space: allocated blocks are always backed)
  // up to the next multiple of the group's step, within the limit.
  std::size_t grow_end = end;
  const std::size_t granules = s.backed.size();
  const std::size_t step = growth_step(*s.grp) / g;
  const std::size_t target = std::min(granules, (end + step - 1) / step * step);
  while (grow_end < target && !s.backed[grow_end] && reserved + (missing + grow_end - end + 1) * g <= limit)
    ++grow_end;
  // Ranges cut at multiples of the largest chunk (Note [Growth steps]).
  const std::size_t cut = max_chunk() / g;
  auto unbacked_runs = [&](std::size_t stop) {
    std::vector<range> rs;
    for (std::size_t i = first; i < stop; ++i) {
      if (s.backed[i]) continue;
      if (!rs.empty() && rs.back().offset + rs.back().length == i * g && i % cut != 0) rs.back().length += g;
      else rs.push_back({s.id, i * g, g});
    }
    return rs;
  };
  std::vector<range> runs = unbacked_runs(grow_end);
  try {
    mgr.materialize(runs, fill_mode::undefined, stream);
  } catch (const out_of_memory&) {
    if (grow_end == end) throw;
    // The device cannot give the whole step: back the block alone (the step is an
    // optimisation, never a reason to fail a request that fits).
    grow_end = end;
    runs = unbacked_runs(end);
    mgr.materialize(runs, fill_mode::undefined, stream);
  }
  for (std::size_t i = first; i < grow_end; ++i) s.backed[i] = 1;
  if (history.on()) record_runs(trace_action::segment_map, s, runs);
  b->backed = true;
  missing += grow_end - end;
  note_backed(*s.grp, static_cast<std::int64_t>(missing * g));
  st.num_device_alloc += static_cast<std::int64_t>(runs.size());
}

std::size_t caching_allocator::impl::growth_step(const group& grp) const {
  const std::size_t cap = std::bit_floor(std::max(cfg.grow_bytes / g, std::size_t{1}));
  const std::size_t low = grp.small ? 1 : std::min(cap, std::bit_floor(std::max((std::size_t{16} << 20) / g, std::size_t{1})));
  return std::bit_floor(std::clamp(grp.backed / 8 / g, low, cap)) * g;
}

std::size_t caching_allocator::impl::max_chunk() const {
  return std::max(std::bit_floor(std::max(cfg.grow_bytes, g)), std::max(std::size_t{16} << 20, g));
}

caching_allocator::impl::granule_plan caching_allocator::impl::plan(segment& s) const {
  std::vector<std::uint8_t> use(s.backed.size(), 0);  // 1 used, 2 resident
  for (block* b = s.first; b != nullptr; b = b->next) {
    if (b->bin >= 0) continue;
    const std::uint8_t v = b->resident ? 2 : 1;
    for (std::size_t i = first_granule(b); i < end_granule(b); ++i) use[i] = std::max(use[i], v);
  }
  granule_plan p;
  auto add = [&](std::vector<range>& rs, std::size_t i) {
    if (!rs.empty() && rs.back().offset + rs.back().length == i * g) rs.back().length += g;
    else rs.push_back({s.id, i * g, g});
  };
  for (std::size_t i = 0; i < use.size(); ++i) {
    if (!s.backed[i]) continue;
    if (use[i] == 0) add(p.free_runs, i);
    else if (use[i] == 1) add(p.used_runs, i);
    if (use[i] != 2) add(p.unpinned_runs, i);
  }
  return p;
}

void caching_allocator::impl::mark_unbacked(segment& s, const std::vector<range>& rs) {
  std::int64_t bytes = 0;
  for (const range& r : rs)
    for (std::size_t i = r.offset / g; r.id == s.id && i < (r.offset + r.length) / g; ++i) {
      s.backed[i] = 0;
      bytes += static_cast<std::int64_t>(g);
    }
  if (bytes != 0) {
    if (history.on()) record_runs(trace_action::segment_unmap, s, rs);
    for (block* b = s.first; b != nullptr; b = b->next)
      if (b->backed)
        for (std::size_t i = first_granule(b); i < end_granule(b); ++i)
          if (!s.backed[i]) {
            b->backed = false;
            break;
          }
    note_backed(*s.grp, -bytes);
    st.num_device_free += static_cast<std::int64_t>(rs.size());
  }
  s.streams.clear();  // the manager forgets streams of fully released reservations
}

std::size_t caching_allocator::impl::release_free_granules() {
  std::size_t bytes = 0;
  auto run = [&](group& grp) {
    if (grp.tag != nullptr && grp.tag->paused) return;
    for (auto& s : grp.segments) {
      granule_plan p = plan(*s);
      if (p.free_runs.empty()) continue;
      try {
        const std::vector<range> done = mgr.release_whole_chunks(p.free_runs, keep_mode::discard, nullptr);
        for (const range& r : done) bytes += r.length;
        mark_unbacked(*s, done);
      } catch (const std::exception& e) {
        detail::log(log_level::warn, std::string("caching_allocator: releasing cached granules: ") + e.what());
      }
    }
  };
  run(small_grp);
  run(large_grp);
  for (auto& t : tags) run(*t->grp);
  return bytes;
}

std::size_t caching_allocator::impl::free_cached() {
  const std::size_t alive = mgr.pool().stats().alive_bytes;
  try {
    sync_all();
  } catch (const std::exception& e) {
    detail::log(log_level::warn, std::string("caching_allocator: waiting for pending frees: ") + e.what());
  }
  release_free_granules();
  mgr.pool().trim(0);
  try {
    mgr.trim_backup_cache(0);
  } catch (const std::exception& e) {
    detail::log(log_level::warn, std::string("caching_allocator: freeing pinned buffers: ") + e.what());
  }
  const std::size_t now = mgr.pool().stats().alive_bytes;
  return alive > now ? alive - now : 0;
}

void caching_allocator::impl::drop_segment_if_unused(segment* seg) noexcept {
  group& grp = *seg->grp;
  for (block* b = seg->first; b != nullptr; b = b->next)
    if (b->bin < 0) return;
  if (std::find(seg->backed.begin(), seg->backed.end(), 1) != seg->backed.end()) return;
  for (block* b = seg->first; b != nullptr;) {
    block* n = b->next;
    grp.bins_of(b->owner).b.remove(b);
    spare.give(b);
    b = n;
  }
  seg->first = nullptr;
  try {
    mgr.free(seg->id);
  } catch (const std::exception& e) {
    detail::log(log_level::error, std::string("caching_allocator: freeing an unused segment: ") + e.what());
  }
  std::erase_if(grp.segments, [&](const std::unique_ptr<segment>& p) { return p.get() == seg; });
  stat_set::sub(st.segment, grp.small, 1);
}

void caching_allocator::impl::free_group(group& grp) noexcept {
  for (auto& s : grp.segments) {
    for (block* b = s->first; b != nullptr;) {
      block* n = b->next;
      delete b->users;
      delete b;
      b = n;
    }
    try {
      mgr.free(s->id);
    } catch (const std::exception& e) {
      detail::log(log_level::error, std::string("caching_allocator: freeing a segment: ") + e.what());
    }
  }
  grp.segments.clear();
}

}  // namespace deferalloc
