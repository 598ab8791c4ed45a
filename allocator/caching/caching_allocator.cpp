// Note [Caching allocator]
//
// Rationale: PyTorch (and any process) allocates and frees millions of blocks; each
// must cost a few tens of nanoseconds when cached, must respect stream order, and the
// physical memory behind free blocks must be returnable (empty_cache, pause) without
// moving the blocks that stay.
//
// Approach
//  - Memory comes in segments: one reservation each (address space only, twice the
//    device's memory by default), materialized granule by granule as blocks need it
//    (expandable: a segment never has to be copied to grow, so large blocks do not
//    fragment physical memory).  Groups of segments: the small pool (requests up to
//    1 MiB), the large pool, and one group per tag, so that a tag's granules hold only
//    its own blocks and can be released without touching anyone else's.
//  - A segment starts as one free block owned by the "fresh" pseudo-stream.  Blocks
//    are split on allocation (remainder >= 512 bytes) and coalesced on free with free
//    neighbours of the same stream.  Free blocks sit in TLSF bins per (group, stream)
//    (see caching/blocks.hpp); allocated blocks in an open-addressing map.
//  - allocate(stream T): T's own bins (no event: stream order covers it), else a block
//    of another stream whose free is known complete (Note [Cross-stream reuse]), else
//    fresh address space, else a new segment.  Then the block's unbacked granules are
//    materialized (chunks from the pool, cached ones of any fitting class first).  On
//    out-of-memory (device, pool budget or memory fraction): wait for every pending
//    free, give back every whole free chunk, trim the pool and the pinned cache, retry
//    once (num_alloc_retries); then num_ooms and out_of_memory.  A failed request
//    leaves nothing behind: a segment added for it is freed again.
//  - deallocate: the block goes to the bins of the stream it is freed on; if
//    record_stream added other streams, an event is recorded on each and the block
//    waits in a pending list until they complete (checked at the next allocate).
//  - empty_cache / the retry / pause release whole chunks only
//    (reservation_manager::release_whole_chunks): a chunk is released when no allocated
//    or pending block (of another tag: impossible by construction; resident blocks at
//    pause) overlaps any of its granules.  Memory in use is never copied, unmapped or
//    remapped, and giving memory back needs no new chunk, so it works exactly when
//    memory is full (a split would need chunks first: Note [Splitting chunks]).  The
//    reservation manager waits for the streams recorded on the segment (each stream
//    that allocated or freed in it) before unmapping.  What the pool then caches beyond
//    its bound goes back to the device at once (Note [Physical memory policy]):
//    physical bytes held <= backed bytes + pool_cache_mb, tested on both drivers.
//
// Note [Cross-stream reuse]
// Recording an event at every free would cost a microsecond per free.  Instead each
// stream has a generation: a free stamps the current generation into the block; when
// another stream wants that stream's blocks, one event is recorded (covering every free
// made so far) and the generation advances; once the event has completed, blocks freed
// before it are free for any stream.  So a block freed on S is reused by T only after an
// event recorded on S after the free completed, and the hot path records nothing.  The
// event is recorded when T first looks and only used at a later look (on a GPU): a
// block that S keeps allocating and freeing is never eligible, so streams do not pass
// one block round (measured on H200: 2 us per alloc/free pair on four streams when the
// event was queried at once), each keeps its own as with PyTorch.
//
// Note [Growth steps]
// A heap that grows block by block pays a cuMemCreate, a cuMemMap and a cuMemSetAccess
// (26 us alone on H200) per block, and the chunks under a block that starts at an odd
// granule are small (the pool's classes are aligned powers of two).  So a block that
// needs memory also backs the free space after it up to the next multiple of the
// group's step, a power of two: the heap's end stays step-aligned and each growth is
// one chunk, one map, one set_access.  The step is an eighth of what the group holds,
// at least one granule in the small pool and 16 MiB elsewhere (PyTorch's large segments
// are 20 MiB), at most cfg.grow_bytes (64 MiB): a heap holds at most one step unused at
// its end, 12.5% of it when small, 64 MiB when large.  Chunks are cut at multiples of
// max(grow_bytes, 16 MiB) (max_chunk), also for blocks larger than that: since only
// whole free chunks are given back, a live block keeps backed at most the chunks it
// touches, so this bounds the free memory one block can strand.  When the device cannot
// give a whole step, the block alone is backed (a step never makes a fitting request fail).
//
// Limits: one mutex per allocator; a block is never moved; free space that shares a
// chunk with a live block stays backed until the block is freed (at most max_chunk per
// side of a block); chunks shared by a resident block and other blocks of a tag stay
// backed at pause; blocks of different streams next to each other are not coalesced.
#include <deferalloc/caching/caching_allocator.hpp>
#include <deferalloc/core/errors.hpp>

#include <algorithm>

#include "caching/allocator_state.hpp"

namespace deferalloc {

// ---- block reuse: take a block for a stream, split, coalesce, pending frees ----------

void caching_allocator::impl::split(block* b, std::size_t size, owner_bins& home) {
  if (b->size - size < k_block_unit) return;
  block* r = spare.take();
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

void caching_allocator::impl::poll(stream_state* s) {
  if (s->event != nullptr && ops.query(s->event)) {
    s->safe_gen = std::max(s->safe_gen, s->event_gen + 1);
    free_events.give(s->event);
    s->event = nullptr;
  }
  if (s->event == nullptr && s->dirty) {
    event_t e = free_events.take();
    try {
      ops.record(e, s->stream);
    } catch (...) {
      free_events.give(e);
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
    if (!ops.asynchronous() && ops.query(e)) {  // the host driver completes at once
      s->safe_gen = s->event_gen + 1;
      free_events.give(e);
      s->event = nullptr;
    }
  }
}

block* caching_allocator::impl::find_eligible(owner_bins& ob, std::size_t size) {
  int c = bins::class_down(size);
  int checked = 0;
  while ((c = ob.b.first_at_least(c)) >= 0 && checked < 256) {
    for (block* b = ob.b.head(c); b != nullptr && checked < 256; b = b->free_next, ++checked)
      if (b->size >= size && b->free_gen < ob.st->safe_gen) return b;
    ++c;
  }
  return nullptr;
}

block* caching_allocator::impl::take(group& grp, stream_state* s, std::size_t size) {
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
  owner_bins& fr = grp.bins_of(streams.fresh());
  block* b = fr.b.find(size);
  if (b == nullptr) {
    added = &add_segment(grp, size);
    b = fr.b.find(size);
  }
  fr.b.remove(b);
  split(b, size, fr);
  return b;
}

block* caching_allocator::impl::absorb_next(block* l) noexcept {
  block* r = l->next;
  l->size += r->size;
  l->next = r->next;
  if (r->next != nullptr) r->next->prev = l;
  l->free_gen = std::max(l->free_gen, r->free_gen);
  l->backed = l->backed && r->backed;
  spare.give(r);
  return l;
}

void caching_allocator::impl::free_block(block* b) {
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

void caching_allocator::impl::finish_free(block* b) {
  if (history.on()) record(trace_action::free_completed, b->addr, b->size, b->owner->stream, b->seg->grp);
  stat_set::sub(st.active_bytes, b->small, static_cast<std::int64_t>(b->size));
  stat_set::sub(st.active, b->small, 1);
  free_block(b);
}

void caching_allocator::impl::process_pending(bool wait) {
  for (std::size_t i = 0; i < pending.size();) {
    auto& pf = pending[i];
    bool done = true;
    for (event_t e : pf.events) {
      if (wait) ops.synchronize(e);
      else if (!ops.query(e)) {
        done = false;
        break;
      }
    }
    if (!done) {
      ++i;
      continue;
    }
    for (event_t e : pf.events) free_events.give(e);
    block* b = pf.b;
    pending[i] = std::move(pending.back());
    pending.pop_back();
    finish_free(b);
  }
}

void caching_allocator::impl::sync_all() {
  process_pending(true);
  for (auto& s : streams) {
    poll(s.get());
    if (s->event != nullptr) {
      ops.synchronize(s->event);
      poll(s.get());
    }
  }
  ++st.num_sync_all_streams;
}

block* caching_allocator::impl::find_containing(std::uintptr_t p) const {
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

// ---- construction ---------------------------------------------------------------------

caching_allocator::impl::impl(reservation_manager& m, const caching_allocator_config& c)
    : mgr(m), vmm(m.vmm()), ops(m.streams()), cfg(c), free_events(ops) {
  DFA_EXPECTS(cfg.memory_fraction > 0.0 && cfg.memory_fraction <= 1.0,
              "caching_allocator: memory_fraction must be in (0, 1], got " + std::to_string(cfg.memory_fraction));
  DFA_EXPECTS(cfg.small_size >= k_block_unit && cfg.small_size <= (std::size_t{1} << 30),
              "caching_allocator: small_size must be in [512 B, 1 GiB]");
  g = mgr.granularity();
  total = vmm.get_memory_info().total_bytes;
  limit = static_cast<std::size_t>(static_cast<double>(total) * cfg.memory_fraction);
  segment_reserve = cfg.segment_reserve != 0 ? cfg.segment_reserve : 2 * total;
  segment_reserve = (segment_reserve + g - 1) / g * g;
  small_grp.name = "small";
  small_grp.small = true;
  large_grp.name = "large";
  large_grp.index = 1;
}

caching_allocator::impl::~impl() {
  log_after_unlock lk(mu);
  if (allocated.size() != 0)
    detail::log(log_level::warn, "caching_allocator destroyed with " + std::to_string(allocated.size()) +
                                     " blocks still allocated (their memory is released)");
  try {
    process_pending(true);
  } catch (...) {
    detail::log_current("~caching_allocator: finishing pending frees");
  }
  for (auto& s : streams)
    if (s->event != nullptr) {
      try {
        ops.synchronize(s->event);
      } catch (...) {
        detail::log_current("~caching_allocator: waiting for a stream's event");
      }
      ops.destroy_event(s->event);
    }
  for (auto& pf : pending)
    for (event_t e : pf.events) ops.destroy_event(e);
  free_group(small_grp);
  free_group(large_grp);
  for (auto& t : tags) free_group(*t->grp);
}

// ---- the public class: it forwards (Note [Allocator state] in allocator_state.hpp) ----

caching_allocator::caching_allocator(reservation_manager& mgr, caching_allocator_config cfg)
    : mgr_(mgr), impl_(std::make_unique<impl>(mgr, cfg)) {}
caching_allocator::~caching_allocator() { erase_regions_of(this); }
void* caching_allocator::allocate(std::size_t bytes, stream_t stream) {
  return impl_->allocate(bytes, stream, region_tag(this));
}
void* caching_allocator::allocate(std::size_t bytes, stream_t stream, tag_id tag) {
  return impl_->allocate(bytes, stream, tag);
}
void caching_allocator::deallocate(void* ptr, std::size_t bytes, stream_t stream) {
  impl_->deallocate(ptr, bytes, stream);
}
void caching_allocator::record_stream(void* ptr, stream_t stream) { impl_->record_stream(ptr, stream); }
std::size_t caching_allocator::empty_cache() { return impl_->empty_cache(); }
void caching_allocator::set_memory_fraction(double fraction) { impl_->set_memory_fraction(fraction); }
caching_allocator_config caching_allocator::config() const { return impl_->config(); }
double caching_allocator::memory_fraction() const { return impl_->memory_fraction(); }
bool caching_allocator::owns(const void* ptr) const { return impl_->owns(ptr); }
void* caching_allocator::base_allocation(const void* ptr, std::size_t* size) const {
  return impl_->base_allocation(ptr, size);
}
std::size_t caching_allocator::allocation_size(const void* ptr) const { return impl_->allocation_size(ptr); }

// ---- allocate / deallocate ------------------------------------------------------------

void* caching_allocator::impl::allocate(std::size_t bytes, stream_t stream, tag_id tag) {
  if (bytes == 0 || bytes > k_max_request) {
    log_after_unlock lk(mu);
    throw refuse<invalid_argument>(bytes, nullptr, bytes == 0 ? "the size is zero" : "the size is above 64 TiB, the most one request may ask",
                                   "check how the size is computed (a negative size cast to unsigned?)");
  }
  const std::size_t size = (bytes + k_block_unit - 1) / k_block_unit * k_block_unit;
  log_after_unlock lk(mu);
  if (!pending.empty()) process_pending(false);
  group* grp = size <= cfg.small_size ? &small_grp : &large_grp;
  if (tag != tag_id::none) {
    tag_state* t = tags.tag_of(tag);
    if (t->paused)
      throw refuse<invalid_state>(bytes, t, "the tag '" + t->name + "' is paused (pause gave its memory back)",
                                  "resume('" + t->name + "') before allocating in it, or allocate outside its region");
    grp = t->grp.get();
  }
  stream_state* s = streams.state_of(stream);
  block* b = nullptr;
  // A failed request leaves nothing behind: the block goes back to the bins and a
  // segment added for it (address space and bookkeeping) is freed again.
  auto undo = [&] {
    if (b != nullptr) {
      b->owner = s;
      free_block(b);
      b = nullptr;
    }
    if (added != nullptr) drop_segment_if_unused(added);
    added = nullptr;
  };
  fraction_refused = false;
  for (int attempt = 0;; ++attempt) {
    added = nullptr;
    try {
      b = take(*grp, s, size);
      ensure_backed(b, stream);
      seg_use(b->seg, stream);
      added = nullptr;
      break;
    } catch (const out_of_memory& e) {
      undo();
      if (attempt == 1) {
        ++st.num_ooms;
        throw refuse_oom(bytes, size, grp->tag, e.what(), stream);
      }
      ++st.num_alloc_retries;
      fraction_refused = false;
      free_cached();
    } catch (...) {
      undo();
      throw;
    }
  }
  b->allocated = true;
  b->owner = s;
  b->requested = bytes;
  b->small = size <= cfg.small_size;
  allocated.insert(b->addr, b);
  stat_set::add(st.allocation, b->small, 1);
  stat_set::add(st.active, b->small, 1);
  stat_set::add(st.allocated_bytes, b->small, static_cast<std::int64_t>(b->size));
  stat_set::add(st.active_bytes, b->small, static_cast<std::int64_t>(b->size));
  stat_set::add(st.requested_bytes, b->small, static_cast<std::int64_t>(bytes));
  if (history.on()) record(trace_action::alloc, b->addr, b->size, stream, grp);
  return reinterpret_cast<void*>(b->addr);
}

void caching_allocator::impl::deallocate(void* ptr, std::size_t bytes, stream_t stream) {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  log_after_unlock lk(mu);
  block* b = allocated.find(p);
  if (b == nullptr)
    throw invalid_argument("deallocate: pointer " + hex(p) + " was not returned by this allocator (or is already freed)");
  if (bytes != 0 && bytes != b->requested && bytes != b->size)
    throw invalid_argument("deallocate: pointer " + hex(p) + " was allocated with " + std::to_string(b->requested) +
                           " bytes, not " + std::to_string(bytes));
  stream_state* s = streams.state_of(stream);
  if (b->users == nullptr && b->owner == s) {  // the common case: no other stream to wait for
    if (history.on()) record(trace_action::free_requested, b->addr, b->size, stream, b->seg->grp);
    allocated.erase(p);
    stat_set::sub(st.allocation, b->small, 1);
    stat_set::sub(st.allocated_bytes, b->small, static_cast<std::int64_t>(b->size));
    stat_set::sub(st.requested_bytes, b->small, static_cast<std::int64_t>(b->requested));
    b->allocated = false;
    finish_free(b);
    return;
  }
  std::vector<stream_t> others;
  if (b->users != nullptr)
    for (stream_t u : *b->users)
      if (u != stream) others.push_back(u);
  if (b->owner != s) {
    others.push_back(b->owner->stream);
    seg_use(b->seg, stream);
  }
  std::vector<event_t> events;
  try {
    for (stream_t u : others) {
      events.push_back(free_events.take());
      ops.record(events.back(), u);
    }
    if (!events.empty()) pending.reserve(pending.size() + 1);
  } catch (...) {
    for (event_t e : events) free_events.give(e);
    throw;
  }
  if (history.on()) record(trace_action::free_requested, b->addr, b->size, stream, b->seg->grp);
  allocated.erase(p);
  stat_set::sub(st.allocation, b->small, 1);
  stat_set::sub(st.allocated_bytes, b->small, static_cast<std::int64_t>(b->size));
  stat_set::sub(st.requested_bytes, b->small, static_cast<std::int64_t>(b->requested));
  b->owner = s;
  b->allocated = false;
  if (events.empty()) {
    finish_free(b);
  } else {
    b->pending = true;
    pending.push_back({b, std::move(events)});
  }
}

void caching_allocator::impl::record_stream(void* ptr, stream_t stream) {
  log_after_unlock lk(mu);
  block* b = allocated.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (b == nullptr) b = find_containing(reinterpret_cast<std::uintptr_t>(ptr));
  if (b == nullptr)
    throw invalid_argument("record_stream: pointer " + hex(reinterpret_cast<std::uintptr_t>(ptr)) +
                           " is not an allocation of this allocator");
  if (b->owner->stream == stream) return;
  if (b->users == nullptr) b->users = new std::vector<stream_t>();
  if (std::find(b->users->begin(), b->users->end(), stream) == b->users->end()) b->users->push_back(stream);
  seg_use(b->seg, stream);
}

// ---- cache ------------------------------------------------------------------------------

std::size_t caching_allocator::impl::empty_cache() {
  log_after_unlock lk(mu);
  return free_cached();
}

void caching_allocator::impl::set_memory_fraction(double fraction) {
  DFA_EXPECTS(fraction > 0.0 && fraction <= 1.0,
              "set_memory_fraction: fraction must be in (0, 1], got " + std::to_string(fraction));
  log_after_unlock lk(mu);
  cfg.memory_fraction = fraction;
  limit = static_cast<std::size_t>(static_cast<double>(total) * fraction);
}

caching_allocator_config caching_allocator::impl::config() const {
  log_after_unlock lk(mu);
  return cfg;
}

double caching_allocator::impl::memory_fraction() const {
  log_after_unlock lk(mu);
  return cfg.memory_fraction;
}

bool caching_allocator::impl::owns(const void* ptr) const {
  log_after_unlock lk(mu);
  return find_containing(reinterpret_cast<std::uintptr_t>(ptr)) != nullptr;
}

void* caching_allocator::impl::base_allocation(const void* ptr, std::size_t* size) const {
  log_after_unlock lk(mu);
  block* b = find_containing(reinterpret_cast<std::uintptr_t>(ptr));
  if (b == nullptr)
    throw invalid_argument("base_allocation: pointer " + hex(reinterpret_cast<std::uintptr_t>(ptr)) +
                           " is not inside an allocation of this allocator");
  if (size != nullptr) *size = b->size;
  return reinterpret_cast<void*>(b->addr);
}

std::size_t caching_allocator::impl::allocation_size(const void* ptr) const {
  log_after_unlock lk(mu);
  block* b = allocated.find(reinterpret_cast<std::uintptr_t>(ptr));
  return b == nullptr ? 0 : b->size;
}

}  // namespace deferalloc
