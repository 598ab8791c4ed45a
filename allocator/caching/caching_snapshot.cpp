// Note [Memory snapshots]
//
// Rationale: PyTorch users look at memory with torch.cuda.memory._snapshot() and
// torch.cuda._memory_viz (segment and trace plots, the online viewer).  Under full
// replacement PyTorch's snapshot is empty, and in every mode PyTorch cannot see what
// only deferalloc knows: which granules are backed, which tag a block belongs to,
// what a paused tag gave back.
//
// Approach: snapshot_text() writes the allocator's state under its mutex as text, one
// record a line, and the Python face (deferalloc.memory_snapshot) turns it into
// PyTorch's format.  The lines:
//   A <granularity> <limit> <backed bytes> <refusals>
//   G <group index> <small 0/1> <paused 0/1> <keep 0/1> <name>      (0 small, 1 large, 2.. tags)
//   S <group index> <reservation id> <base> <size>                  a segment (a reservation)
//   R <offset> <length>                                             a backed run of the segment above
//   B <addr> <size> <requested> <state a|p|f> <stream> <resident>   a block of the segment above
//   P <group index> <addr> <length>                                 a range a paused tag gave back
//   E <action> <addr> <size> <stream> <time_us> <group index> <aux> a recorded event
// A segment of PyTorch's format is one backed run, as PyTorch shows an expandable
// segment by its mapped ranges: a reservation is far larger than what is backed in it.
// record_history keeps the newest events in a ring (PyTorch's max_entries): alloc,
// free_requested / free_completed (at once, or when a record_stream free's events
// complete), segment_map / segment_unmap for every backed or released run (growth,
// empty_cache, pause, resume), oom (aux: the device's free bytes).  The events are
// recorded under the allocator's mutex where the state changes, so that replaying them
// backwards from the snapshot (as MemoryViz.js does) meets every block inside a mapped
// range.
// Limits: no stack frames (the allocator is below Python; a MemPool region's PyTorch
// snapshot has them); one line per block, so a snapshot of a million blocks is tens of
// megabytes of text; the blocks of a paused tag are listed, not drawn as memory.
#include <chrono>
#include <cinttypes>

#include "caching/allocator_state.hpp"

namespace deferalloc {

void caching_allocator::impl::record(trace_action a, std::uintptr_t addr, std::size_t size, stream_t s,
                                     const group* grp, std::size_t aux) noexcept {
  trace_event e;
  e.action = a;
  e.addr = addr;
  e.size = size;
  e.stream = s;
  e.time_us = std::chrono::duration_cast<std::chrono::microseconds>(
                  std::chrono::system_clock::now().time_since_epoch()).count();
  e.group = grp != nullptr ? grp->index : -1;
  e.aux = aux;
  try {
    history.push(e);
  } catch (...) {  // no memory for the event: the trace loses it, the allocator goes on
  }
}

void caching_allocator::impl::record_runs(trace_action a, const segment& seg, const std::vector<range>& rs) noexcept {
  for (const range& r : rs)
    if (r.id == seg.id) record(a, seg.base + r.offset, r.length, nullptr, seg.grp);
}

void caching_allocator::impl::record_history(std::size_t max_entries) {
  log_after_unlock lk(mu);
  history.set_max(max_entries);
}

std::string caching_allocator::impl::snapshot_text() const {
  log_after_unlock lk(mu);
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "A %zu %zu %zu %" PRId64 "\n", g, limit, reserved, refusals);
  out += line;
  auto stream_no = [](stream_t s) { return static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(s.get())); };
  auto put_group = [&](const group& grp) {
    const tag_state* t = grp.tag;
    std::snprintf(line, sizeof line, "G %d %d %d %d ", grp.index, grp.small ? 1 : 0, t != nullptr && t->paused ? 1 : 0,
                  t != nullptr && t->keep == keep_mode::host ? 1 : 0);
    out += line;
    out += grp.name;
    out += '\n';
    for (const auto& s : grp.segments) {
      std::snprintf(line, sizeof line, "S %d %llu %" PRIuPTR " %zu\n", grp.index, static_cast<unsigned long long>(s->id),
                    s->base, s->size);
      out += line;
      for (std::size_t i = 0; i < s->backed.size();) {
        if (!s->backed[i]) {
          ++i;
          continue;
        }
        std::size_t j = i;
        while (j < s->backed.size() && s->backed[j]) ++j;
        std::snprintf(line, sizeof line, "R %zu %zu\n", i * g, (j - i) * g);
        out += line;
        i = j;
      }
      for (const block* b = s->first; b != nullptr; b = b->next) {
        const char state = b->allocated ? 'a' : b->pending ? 'p' : 'f';
        std::snprintf(line, sizeof line, "B %" PRIuPTR " %zu %zu %c %llu %d\n", b->addr, b->size,
                      b->allocated || b->pending ? b->requested : b->size, state, stream_no(b->owner->stream),
                      b->resident ? 1 : 0);
        out += line;
      }
    }
    if (t != nullptr && t->paused)
      for (const range& r : t->saved)
        for (const auto& s : grp.segments)
          if (s->id == r.id) {
            std::snprintf(line, sizeof line, "P %d %" PRIuPTR " %zu\n", grp.index, s->base + r.offset, r.length);
            out += line;
          }
  };
  put_group(small_grp);
  put_group(large_grp);
  for (const auto& t : tags) put_group(*t->grp);
  const char* names[] = {"alloc", "free_requested", "free_completed", "segment_map", "segment_unmap", "oom"};
  for (std::size_t k = 0; k < history.size(); ++k) {
    const trace_event& e = history.at(k);
    std::snprintf(line, sizeof line, "E %s %" PRIuPTR " %zu %llu %" PRId64 " %d %zu\n", names[static_cast<int>(e.action)],
                  e.addr, e.size, stream_no(e.stream), e.time_us, e.group, e.aux);
    out += line;
  }
  return out;
}

void caching_allocator::record_history(std::size_t max_entries) { impl_->record_history(max_entries); }
std::string caching_allocator::snapshot_text() const { return impl_->snapshot_text(); }

}  // namespace deferalloc
