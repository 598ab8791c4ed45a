// The caching allocator's state and its internal operations, shared by
// caching_allocator.cpp (allocate, free, cache) and caching_tags.cpp (tags, stats).
// See Note [Caching allocator] in allocator/caching/caching_allocator.cpp.
#pragma once
#include <deferalloc/caching_allocator.hpp>
#include <deferalloc/errors.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cinttypes>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "caching/state.hpp"
#include "log.hpp"

namespace deferalloc {
namespace detail {

inline constexpr std::size_t k_max_request = std::size_t{1} << 46;  // 64 TiB

inline std::string hex(std::uintptr_t p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, p);
  return buf;
}

// The tagged regions of a thread (tag_scope, begin_tag/end_tag: the C++ face's
// current tag) live in caching_tags.cpp; the registry of tags is impl::tags.
/// The innermost region's tag of `owner` on this thread (tag_id::none outside any).
tag_id region_tag(const caching_allocator* owner) noexcept;
/// Leaves every region of `owner` on this thread.
void erase_regions_of(const caching_allocator* owner) noexcept;

/// `bytes` for a person: "68.99 GiB", "512 B".
inline std::string human_bytes(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[48];
  if (u == 0) std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace detail

using namespace detail;

struct caching_allocator::impl {
  impl(reservation_manager& m, const caching_allocator_config& c) : mgr(m), drv(m.drv()), cfg(c) {}

  reservation_manager& mgr;
  driver& drv;
  caching_allocator_config cfg;
  std::size_t g = 0;
  std::size_t total = 0;
  std::size_t limit = 0;
  std::size_t segment_reserve = 0;

  // Taken as log_after_unlock: lines logged under it are delivered after the unlock
  // (Note [Logging outside locks] in log.hpp).
  mutable std::mutex mu;
  std::vector<std::unique_ptr<stream_state>> streams;
  stream_state* last_stream = nullptr;
  stream_state fresh;
  group small_grp, large_grp;
  std::vector<std::unique_ptr<tag_state>> tags;
  ptr_map allocated;
  std::vector<block*> spare;
  struct pending_free {
    block* b;
    std::vector<event_t> events;
  };
  std::vector<pending_free> pending;
  std::vector<event_t> free_events;
  stat_set st;
  std::size_t reserved = 0;  // backed bytes of our segments
  segment* added = nullptr;  // the segment the current allocate added (dropped if it fails)
  bool fraction_refused = false;  // the last ensure_backed failed on the memory fraction
  std::int64_t refusals = 0;      // allocations refused (paused tag, fraction, budget, device)
  // Note [Memory snapshots]: recorded events (record_history), a ring of at most history_max.
  std::vector<trace_event> history;
  std::size_t history_max = 0, history_next = 0;
  void record(trace_action a, std::uintptr_t addr, std::size_t size, stream_t s, const group* grp,
              std::size_t aux = 0) noexcept;
  void record_runs(trace_action a, const segment& seg, const std::vector<range>& rs) noexcept;

  // ---- small helpers ----
  block* new_block() {
    if (!spare.empty()) {
      block* b = spare.back();
      spare.pop_back();
      *b = block{};
      return b;
    }
    return new block{};
  }
  void recycle(block* b) noexcept {
    delete b->users;
    b->users = nullptr;
    try {
      spare.push_back(b);
    } catch (...) {
      delete b;
    }
  }
  stream_state* state_of(stream_t s) {
    if (last_stream != nullptr && last_stream->stream == s) return last_stream;
    for (auto& p : streams)
      if (p->stream == s) return last_stream = p.get();
    streams.push_back(std::make_unique<stream_state>());
    streams.back()->stream = s;
    return last_stream = streams.back().get();
  }
  event_t take_event() {
    if (!free_events.empty()) {
      event_t e = free_events.back();
      free_events.pop_back();
      return e;
    }
    return drv.create_event();
  }
  void give_event(event_t e) noexcept {
    try {
      free_events.push_back(e);
    } catch (...) {
      drv.destroy_event(e);
    }
  }
  tag_state* find_tag(std::string_view name) const {
    for (auto& t : tags)
      if (t->name == name) return t.get();
    return nullptr;
  }
  // Tag ids are 1 + the index in `tags` (tags are never removed).
  tag_id id_of(const tag_state* t) const {
    for (std::size_t i = 0; i < tags.size(); ++i)
      if (tags[i].get() == t) return static_cast<tag_id>(i + 1);
    return tag_id::none;
  }
  tag_state* tag_of(tag_id id) const {
    const auto i = static_cast<std::size_t>(id);
    if (i == 0 || i > tags.size()) throw invalid_argument("caching_allocator: unknown tag id " + std::to_string(i));
    return tags[i - 1].get();
  }
  std::size_t first_granule(const block* b) const { return (b->addr - b->seg->base) / g; }
  std::size_t end_granule(const block* b) const { return (b->addr + b->size - b->seg->base + g - 1) / g; }
  void seg_use(segment* s, stream_t stream) {
    for (stream_t x : s->streams)
      if (x == stream) return;
    mgr.record_stream(s->id, stream);
    s->streams.push_back(stream);
  }

  // ---- segments and blocks ----
  segment& add_segment(group& grp, std::size_t min_bytes) {
    const std::size_t bytes = std::max(segment_reserve, (min_bytes + g - 1) / g * g);
    auto seg = std::make_unique<segment>();
    seg->id = mgr.reserve(bytes);  // address space only; throws out_of_memory
    try {
      seg->base = reinterpret_cast<std::uintptr_t>(mgr.address(seg->id));
      seg->size = bytes;
      seg->backed.assign(bytes / g, 0);
      seg->grp = &grp;
      block* b = new_block();
      b->addr = seg->base;
      b->size = bytes;
      b->seg = seg.get();
      b->owner = &fresh;
      seg->first = b;
      grp.bins_of(&fresh).b.insert(b);
      grp.segments.push_back(std::move(seg));
    } catch (...) {
      if (seg->first != nullptr) {
        grp.bins_of(&fresh).b.remove(seg->first);
        recycle(seg->first);
      }
      mgr.free(seg->id);
      throw;
    }
    stat_set::add(st.segment, grp.small, 1);
    return *grp.segments.back();
  }

  // Cuts `b` (detached from the bins) to `size`; the rest goes to `home` with b's owner.
  void split(block* b, std::size_t size, owner_bins& home) {
    if (b->size - size < k_block_unit) return;
    block* r = new_block();
    r->addr = b->addr + size;
    r->size = b->size - size;
    r->seg = b->seg;
    r->owner = b->owner;
    r->free_gen = b->free_gen;
    r->backed = b->backed;
    r->prev = b;
    r->next = b->next;
    if (b->next != nullptr) b->next->prev = r;
    b->next = r;
    b->size = size;
    home.b.insert(r);
  }

  // Refreshes a stream's lazy free event; records one when frees are not yet covered.
  void poll(stream_state* s) {
    if (s->event != nullptr && drv.query(s->event)) {
      s->safe_gen = std::max(s->safe_gen, s->event_gen + 1);
      give_event(s->event);
      s->event = nullptr;
    }
    if (s->event == nullptr && s->dirty) {
      event_t e = take_event();
      try {
        drv.record(e, s->stream);
      } catch (...) {
        give_event(e);
        throw;
      }
      s->event = e;
      ++st.stream_events;
      s->event_gen = s->gen++;
      s->dirty = false;
      // Not queried at once on a GPU: the event covers the frees made so far, and it is
      // used at a later poll.  Querying now would let streams pass one block round and
      // round (each allocation stealing the block the previous stream just freed, a
      // record + query, 2 us, per pair); this way each stream keeps its own blocks.
      if (!drv.asynchronous() && drv.query(e)) {  // the host driver completes at once
        s->safe_gen = s->event_gen + 1;
        give_event(e);
        s->event = nullptr;
      }
    }
  }

  block* find_eligible(owner_bins& ob, std::size_t size) {
    int c = bins::class_down(size);
    int checked = 0;
    while ((c = ob.b.first_at_least(c)) >= 0 && checked < 256) {
      for (block* b = ob.b.head(c); b != nullptr && checked < 256; b = b->free_next, ++checked)
        if (b->size >= size && b->free_gen < ob.st->safe_gen) return b;
      ++c;
    }
    return nullptr;
  }

  // A detached block of at least `size` for stream `s` in `grp`.
  block* take(group& grp, stream_state* s, std::size_t size) {
    owner_bins& own = grp.bins_of(s);
    if (block* b = own.b.find(size)) {
      own.b.remove(b);
      split(b, size, own);
      return b;
    }
    for (std::size_t i = 0; i < grp.owners.size(); ++i) {
      owner_bins& ob = *grp.owners[i];
      if (ob.st == s || ob.st->fresh || ob.b.empty()) continue;
      poll(ob.st);
      if (block* b = find_eligible(ob, size)) {
        ++st.cross_stream_reuses;
        ob.b.remove(b);
        split(b, size, ob);
        return b;
      }
    }
    owner_bins& fr = grp.bins_of(&fresh);
    block* b = fr.b.find(size);
    if (b == nullptr) {
      added = &add_segment(grp, size);
      b = fr.b.find(size);
    }
    fr.b.remove(b);
    split(b, size, fr);
    return b;
  }

  // Materializes the unbacked granules under `b`.  @throws out_of_memory
  void ensure_backed(block* b, stream_t stream) {
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
    if (history_max != 0) record_runs(trace_action::segment_map, s, runs);
    b->backed = true;
    missing += grow_end - end;
    note_backed(*s.grp, static_cast<std::int64_t>(missing * g));
    st.num_device_alloc += static_cast<std::int64_t>(runs.size());
  }
  // The growth step of `grp` (Note [Growth steps]): a power of two number of granules,
  // an eighth of what the group holds backed, at least one granule (small pool) or
  // 16 MiB (large pool and tags, as PyTorch's 20 MiB large segments), at most
  // cfg.grow_bytes; 0 = block by block.
  std::size_t growth_step(const group& grp) const {
    const std::size_t cap = std::bit_floor(std::max(cfg.grow_bytes / g, std::size_t{1}));
    const std::size_t low = grp.small ? 1 : std::min(cap, std::bit_floor(std::max((std::size_t{16} << 20) / g, std::size_t{1})));
    return std::bit_floor(std::clamp(grp.backed / 8 / g, low, cap)) * g;
  }
  // The largest chunk behind a block: the largest growth step, at least 16 MiB.  A
  // live block keeps at most the chunks it touches backed, so this bounds what one
  // small block can hold beyond itself (whole-chunk release, Note [Splitting chunks]).
  std::size_t max_chunk() const {
    return std::max(std::bit_floor(std::max(cfg.grow_bytes, g)), std::max(std::size_t{16} << 20, g));
  }
  void note_backed(group& grp, std::int64_t bytes) {
    reserved = static_cast<std::size_t>(static_cast<std::int64_t>(reserved) + bytes);
    grp.backed = static_cast<std::size_t>(static_cast<std::int64_t>(grp.backed) + bytes);
    if (bytes > 0) stat_set::add(st.reserved_bytes, grp.small, bytes);
    else stat_set::sub(st.reserved_bytes, grp.small, -bytes);
  }

  // Merges the free block after `l` (out of the bins) into `l`; returns `l`.
  block* absorb_next(block* l) noexcept {
    block* r = l->next;
    l->size += r->size;
    l->next = r->next;
    if (r->next != nullptr) r->next->prev = l;
    l->free_gen = std::max(l->free_gen, r->free_gen);
    l->backed = l->backed && r->backed;
    recycle(r);
    return l;
  }

  // Puts a detached or freed block into its owner's bins, coalescing.
  void free_block(block* b) {
    b->allocated = false;
    b->pending = false;
    b->resident = false;
    delete b->users;
    b->users = nullptr;
    b->free_gen = b->owner->gen;
    b->owner->dirty = true;
    owner_bins& ob = b->seg->grp->bins_of(b->owner);
    auto mergeable = [&](block* n) { return n != nullptr && n->bin >= 0 && n->owner == b->owner; };
    if (mergeable(b->prev)) {
      ob.b.remove(b->prev);
      b = absorb_next(b->prev);
    }
    if (mergeable(b->next)) {
      ob.b.remove(b->next);
      absorb_next(b);
    }
    ob.b.insert(b);
  }

  void finish_free(block* b) {
    if (history_max != 0) record(trace_action::free_completed, b->addr, b->size, b->owner->stream, b->seg->grp);
    stat_set::sub(st.active_bytes, b->small, static_cast<std::int64_t>(b->size));
    stat_set::sub(st.active, b->small, 1);
    free_block(b);
  }

  void process_pending(bool wait) {
    for (std::size_t i = 0; i < pending.size();) {
      auto& pf = pending[i];
      bool done = true;
      for (event_t e : pf.events) {
        if (wait) drv.synchronize(e);
        else if (!drv.query(e)) {
          done = false;
          break;
        }
      }
      if (!done) {
        ++i;
        continue;
      }
      for (event_t e : pf.events) give_event(e);
      block* b = pf.b;
      pending[i] = std::move(pending.back());
      pending.pop_back();
      finish_free(b);
    }
  }

  // Waits for every pending free and every stream's lazy event: all free blocks
  // become free for any stream.
  void sync_all() {
    process_pending(true);
    for (auto& s : streams) {
      poll(s.get());
      if (s->event != nullptr) {
        drv.synchronize(s->event);
        poll(s.get());
      }
    }
    ++st.num_sync_all_streams;
  }

  // The backed granules of `seg` in runs: free_runs hold no allocated or pending
  // block, used_runs hold some but no resident one.  Releasing them goes through
  // release_whole_chunks, which gives back only the chunks wholly inside a run (Note
  // [Splitting chunks] in reservations.cpp): memory under a live block never moves.
  struct granule_plan {
    std::vector<range> free_runs, used_runs;
    std::vector<range> unpinned_runs;  // free or used: every backed granule under no resident block
  };
  granule_plan plan(segment& s) const {
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
  // Marks the ranges of `rs` that belong to `s` unbacked.
  void mark_unbacked(segment& s, const std::vector<range>& rs) {
    std::int64_t bytes = 0;
    for (const range& r : rs)
      for (std::size_t i = r.offset / g; r.id == s.id && i < (r.offset + r.length) / g; ++i) {
        s.backed[i] = 0;
        bytes += static_cast<std::int64_t>(g);
      }
    if (bytes != 0) {
      if (history_max != 0) record_runs(trace_action::segment_unmap, s, rs);
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

  // Releases every whole free chunk of the groups that are not paused (a chunk that
  // also holds an allocated or pending block stays).  Never throws: a segment whose
  // release fails keeps its granules (logged).
  std::size_t release_free_granules() {
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

  // Gives every whole free chunk and every cached chunk and pinned buffer back; returns
  // the physical bytes given back to the driver.
  std::size_t free_cached() {
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

  // Note [Refusals]: every allocation refused leaves one warn line and an exception with
  // the same text: "deferalloc refused <N> bytes (<human>)[ in tag 'T']: <reason>. Fix:
  // <what to do>."  The C ABI keeps it for dfa_last_refusal (PyTorch's allocator
  // interface drops our message: the Python face shows it as an exception note).
  std::string refusal_text(std::size_t bytes, const tag_state* t, const std::string& reason, const std::string& fix) const {
    return "deferalloc refused " + std::to_string(bytes) + " bytes (" + human_bytes(bytes) + ")" +
           (t != nullptr ? " in tag '" + t->name + "'" : std::string()) + ": " + reason + ". Fix: " + fix + ".";
  }
  template <typename E>
  E refuse(std::size_t bytes, const tag_state* t, const std::string& reason, const std::string& fix) {
    ++refusals;
    std::string msg = refusal_text(bytes, t, reason, fix);
    detail::log(log_level::warn, msg);
    return E(std::move(msg));
  }
  // The out-of-memory refusal after the retry: the memory fraction, the pool's budget or
  // the device, with the numbers.
  out_of_memory refuse_oom(std::size_t bytes, std::size_t size, const tag_state* t, const std::string& cause, stream_t stream) {
    const pool_stats ps = mgr.pool().stats();
    const std::size_t budget = mgr.pool().budget();
    std::size_t dev_free = 0;
    std::string reason, fix;
    if (fraction_refused) {
      reason = "the memory fraction " + std::to_string(cfg.memory_fraction) + " allows " + std::to_string(limit) +
               " bytes (" + human_bytes(limit) + ") and " + std::to_string(reserved) + " (" + human_bytes(reserved) +
               ") are backed";
      fix = "free tensors, pause a tag, or raise the fraction (torch.cuda.set_per_process_memory_fraction, or "
            "memory_fraction in DEFERALLOC_CONF)";
    } else if (budget != 0 && ps.alive_bytes + size > budget) {
      reason = "the chunk pool's budget of " + std::to_string(budget) + " bytes (" + human_bytes(budget) + ") is reached (" +
               std::to_string(ps.alive_bytes) + " bytes alive)";
      fix = "free tensors, pause a tag, or raise pool_budget_mb in DEFERALLOC_CONF";
    } else {
      std::string dev = "the device's free memory is unknown";
      try {
        const auto mi = drv.get_memory_info();
        dev_free = mi.free_bytes;
        dev = std::to_string(mi.free_bytes) + " of " + std::to_string(mi.total_bytes) + " bytes (" +
              human_bytes(mi.free_bytes) + " of " + human_bytes(mi.total_bytes) + ") are free";
      } catch (...) {
        detail::log_current("out-of-memory report: device memory info", log_level::warn);
      }
      reason = "the device is out of memory: " + dev + "; deferalloc holds " + std::to_string(reserved) + " bytes backed, " +
               std::to_string(st.allocated_bytes[pool_all].current) + " of them allocated";
      fix = "free tensors, pause a tag (deferalloc.pause), or make the other users of the device give memory back";
    }
    if (history_max != 0) record(trace_action::oom, 0, bytes, stream, nullptr, dev_free);
    return refuse<out_of_memory>(bytes, t, fraction_refused ? reason : reason + " (" + cause + ")", fix);
  }

  // Removes `seg` when no block in it is allocated or pending and nothing is backed
  // (the segment added for a request that then failed): its address space and
  // bookkeeping go away.  Never throws.
  void drop_segment_if_unused(segment* seg) noexcept {
    group& grp = *seg->grp;
    for (block* b = seg->first; b != nullptr; b = b->next)
      if (b->bin < 0) return;
    if (std::find(seg->backed.begin(), seg->backed.end(), 1) != seg->backed.end()) return;
    for (block* b = seg->first; b != nullptr;) {
      block* n = b->next;
      grp.bins_of(b->owner).b.remove(b);
      recycle(b);
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

  block* find_containing(std::uintptr_t p) const {
    if (block* b = allocated.find(p)) return b;
    auto look = [&](const group& grp) -> block* {
      for (auto& s : grp.segments) {
        if (p < s->base || p >= s->base + s->size) continue;
        for (block* b = s->first; b != nullptr; b = b->next)
          if (p >= b->addr && p < b->addr + b->size) return b->allocated ? b : nullptr;
      }
      return nullptr;
    };
    if (block* b = look(small_grp)) return b;
    if (block* b = look(large_grp)) return b;
    for (auto& t : tags)
      if (block* b = look(*t->grp)) return b;
    return nullptr;
  }

  void free_group(group& grp) noexcept {
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
};

}  // namespace deferalloc
