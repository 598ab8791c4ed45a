// Splitting a chunk that a release cuts through (Note [Splitting chunks]).
#include <deferalloc/core/errors.hpp>
#include <deferalloc/core/reservations.hpp>

#include <algorithm>

#include "core/reservations/state.hpp"
#include "log.hpp"

namespace deferalloc {

// Note [Splitting chunks]
// cuMemUnmap takes whole mappings only, so a release that cuts through a chunk first
// replaces the chunk by smaller ones with the same contents: the new chunks are mapped
// at a scratch range, the old chunk's bytes copied there (after the streams that use
// it), the old chunk unmapped and the new ones mapped in its place.  Rare by design:
// materialize cuts ranges at their own boundaries, so only a release of a sub-range
// of what was materialized splits.
//
// A split moves the bytes of the chunk outside the released range, so it is safe only
// when nothing else touches them meanwhile: the manager's mutex orders it against every
// other call of the manager, and the copy waits for the streams recorded on the
// reservation, but a host thread (or a kernel on a stream not recorded) writing those
// bytes during the split loses its writes or faults.  Hence the rule: only an explicit
// release of a range by the reservation's owner may split, and the owner must not use
// the rest of the cut chunks during that call.  Nothing inside the library splits: the
// caching allocator (empty_cache, the out-of-memory retry, pause) gives memory back with
// release_whole_chunks, which releases only chunks that lie wholly inside its ranges and
// so needs no new chunk (freeing cache works when memory is full) and moves nothing.
// The scratch range is reserved at the first split, of the largest class's bytes, and
// reserved again larger for a chunk above it (an exact chunk of materialize_whole_pieces).
void reservation_manager::impl::split_at(reservation& r, std::size_t cut, stream_t stream, event_t after) {
  auto it = r.chunks.upper_bound(cut);
  if (it == r.chunks.begin()) return;
  --it;
  const std::size_t a = it->first;
  const chunk old = it->second;
  if (!(a < cut && cut < a + old.bytes)) return;

  auto pieces = plan_chunks({{a, cut}, {cut, a + old.bytes}});
  std::vector<std::pair<std::uintptr_t, std::size_t>> at_scratch, at_home;
  bool old_unmapped = false;
  std::vector<event_t> users;
  try {
    if (scratch_bytes_ < old.bytes) {
      // The largest class, or an exact chunk's own bytes (dfa_materialize_whole_pieces makes
      // chunks of any size): the range grows to the largest chunk split so far.
      const std::size_t largest = pool_->classes().back();
      const std::size_t bytes = std::max(largest, old.bytes);
      const std::uintptr_t va = vmm_.reserve(bytes, largest);
      if (scratch_ != 0) vmm_.free_reservation(scratch_, scratch_bytes_);
      scratch_ = va;
      scratch_bytes_ = bytes;
    }
    for (auto& [pos, c] : pieces) {
      vmm_.map(scratch_ + (pos - a), c.bytes, c.handle);
      at_scratch.emplace_back(scratch_ + (pos - a), c.bytes);
    }
    vmm_.set_access(scratch_, old.bytes);
    std::vector<reservation*> rs{&r};
    if (after == nullptr) users = record_users(rs, stream);
    for (event_t e : users) streams_.stream_wait(copy_stream_, e);
    if (after != nullptr) streams_.stream_wait(copy_stream_, after);
    streams_.copy_async(reinterpret_cast<void*>(scratch_), reinterpret_cast<const void*>(r.base + a), old.bytes, copy_stream_);
    streams_.synchronize_stream(copy_stream_);
    events_.give(users);
    while (!at_scratch.empty()) {
      vmm_.unmap(at_scratch.back().first, at_scratch.back().second);
      at_scratch.pop_back();
    }
    vmm_.unmap(r.base + a, old.bytes);
    old_unmapped = true;
    for (auto& [pos, c] : pieces) {
      vmm_.map(r.base + pos, c.bytes, c.handle);
      at_home.emplace_back(r.base + pos, c.bytes);
    }
    vmm_.set_access(r.base + a, old.bytes);
  } catch (...) {
    events_.give(users);
    for (auto& [va, n] : at_scratch) unmap_quietly(va, n);
    for (auto& [va, n] : at_home) unmap_quietly(va, n);
    if (old_unmapped) {
      try {
        vmm_.map(r.base + a, old.bytes, old.handle);
        vmm_.set_access(r.base + a, old.bytes);
      } catch (const std::exception& e) {
        detail::log(log_level::error, std::string("split rollback could not remap a chunk: ") + e.what());
      }
    }
    for (auto& [pos, c] : pieces) pool_->give_back(c);
    throw;
  }
  r.chunks.erase(it);
  for (auto& [pos, c] : pieces) r.chunks.emplace(pos, c);
  pool_->give_back(old);
  counts_.split();
}

}  // namespace deferalloc
