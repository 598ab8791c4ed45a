// Tags (pause/resume) and statistics of the caching allocator.
//
// A tag is a group of its own segments (See Note [Caching allocator]), so its granules
// hold only its blocks.  pause, in two batched releases of whole chunks (never a
// split: a resident block's bytes never move): first the chunks that hold no allocated
// block are discarded; then every chunk that holds no resident block is released with
// the caller's keep mode (all backup copies enqueued before one wait; free granules
// that share a chunk with an allocated block are kept with it).  Chunks under resident
// blocks stay backed.  The second step's ranges are remembered; resume materializes
// exactly them (restore or undefined) in one batched call, cached chunks first.  Blocks
// freed while paused are simply free at resume.  Chunks given back beyond the pool's
// cache bound go to the driver at once (Note [Physical memory policy]).
// Limits: a tag's memory is paused as a whole; allocating in a paused tag is an error.
#include <cstdio>
#include <limits>

#include "caching/allocator_state.hpp"
#include "core/mode_checks.hpp"

namespace deferalloc {

// ---- the tag registry and the C++ face's tagged regions ----------------------------------

namespace detail {
namespace {
/// The tagged regions of this thread: (allocator, tag), innermost last.
thread_local std::vector<std::pair<const caching_allocator*, tag_id>> t_regions;
/// Regions open in all threads: when 0, allocate skips the thread-local lookup.
std::atomic<long> g_open_regions{0};
}  // namespace

tag_id region_tag(const caching_allocator* owner) noexcept {
  if (g_open_regions.load(std::memory_order_relaxed) == 0) return tag_id::none;
  for (auto it = t_regions.rbegin(); it != t_regions.rend(); ++it)
    if (it->first == owner) return it->second;
  return tag_id::none;
}

void erase_regions_of(const caching_allocator* owner) noexcept {
  g_open_regions.fetch_sub(static_cast<long>(std::erase_if(t_regions, [&](const auto& r) { return r.first == owner; })));
}
}  // namespace detail

void caching_allocator::check_tag_name(std::string_view call, std::string_view tag) {
  const std::string where(call);
  DFA_EXPECTS(!tag.empty(), where + ": the tag is empty");
  DFA_EXPECTS(tag.size() <= 256, where + ": the tag is longer than 256 characters");
  for (std::size_t i = 0; i < tag.size(); ++i) {
    const auto c = static_cast<unsigned char>(tag[i]);
    if (c >= 0x20 && c != 0x7f) continue;
    std::string shown;  // the name with its control characters escaped
    for (char x : tag) {
      const auto u = static_cast<unsigned char>(x);
      char buf[8];
      if (u == '\n') shown += "\\n";
      else if (u == '\t') shown += "\\t";
      else if (u < 0x20 || u == 0x7f) {
        std::snprintf(buf, sizeof buf, "\\x%02x", u);
        shown += buf;
      } else shown += x;
    }
    char code[8];
    std::snprintf(code, sizeof code, "0x%02x", c);
    throw invalid_argument(where + ": the tag '" + shown + "' contains the control character " + code +
                           " at offset " + std::to_string(i) +
                           "; a tag name is printable text (a newline would split the list of tags, a NUL cut the name)");
  }
}

tag_id caching_allocator::impl::register_tag(std::string_view tag) {
  log_after_unlock lk(mu);
  // A known tag's name was checked when it was registered: the C ABI's tagged malloc,
  // which looks its tag up each time, pays for the check once.
  if (tag_state* t = tags.find(tag)) return tags.id_of(t);
  check_tag_name("register_tag", tag);
  auto t = std::make_unique<tag_state>();
  t->name = std::string(tag);
  t->grp = std::make_unique<group>();
  t->grp->name = t->name;
  t->grp->index = tags.next_group_index();
  t->grp->tag = t.get();
  return tags.add(std::move(t));
}

tag_scope::tag_scope(caching_allocator& a, std::string_view tag) : a_(a) { a_.begin_tag(tag); }

tag_scope::~tag_scope() {
  try {
    a_.end_tag();
  } catch (const std::exception& e) {
    detail::log(log_level::error, std::string("tag_scope: ") + e.what());
  }
}

void caching_allocator::begin_tag(std::string_view tag) {
  const tag_id id = register_tag(tag);  // checks a new tag's name
  detail::t_regions.emplace_back(this, id);
  detail::g_open_regions.fetch_add(1);
}

void caching_allocator::end_tag() {
  for (auto it = detail::t_regions.rbegin(); it != detail::t_regions.rend(); ++it)
    if (it->first == this) {
      detail::t_regions.erase(std::next(it).base());
      detail::g_open_regions.fetch_sub(1);
      return;
    }
  throw invalid_state("end_tag: this thread is not inside a tagged region of this allocator");
}

std::string caching_allocator::current_tag() const {
  const tag_id id = region_tag(this);
  if (id == tag_id::none) return std::string();
  return impl_->tag_name(id);
}

std::string caching_allocator::impl::tag_name(tag_id id) const {
  log_after_unlock lk(mu);
  return tags.tag_of(id)->name;
}

// ---- pause / resume -----------------------------------------------------------------------

void caching_allocator::pause(std::string_view tag, keep_mode keep, stream_t stream) {
  expect_valid(keep, "pause");
  if (region_tag(this) != tag_id::none)
    throw invalid_state("pause('" + std::string(tag) + "'): called inside the tagged region '" + current_tag() +
                        "' (leave the region first)");
  impl_->pause(tag, keep, stream);
}

void caching_allocator::impl::pause(std::string_view tag, keep_mode keep, stream_t stream) {
  log_after_unlock lk(mu);
  tag_state* t = tags.find(tag);
  if (t == nullptr) throw invalid_argument("pause: unknown tag '" + std::string(tag) + "'");
  if (t->paused) throw invalid_state("pause: tag '" + t->name + "' is already paused");
  process_pending(false);

  // Step 1: whole free chunks, discarded.
  std::vector<range> runs;
  for (auto& s : t->grp->segments) {
    granule_plan p = plan(*s);
    runs.insert(runs.end(), p.free_runs.begin(), p.free_runs.end());
  }
  if (!runs.empty()) {
    const std::vector<range> done = mgr.release_whole_chunks(runs, keep_mode::discard, stream);
    for (auto& s : t->grp->segments) mark_unbacked(*s, done);
  }
  // Step 2: every chunk under no resident block, with the caller's keep mode.
  runs.clear();
  for (auto& s : t->grp->segments) {
    granule_plan p = plan(*s);
    runs.insert(runs.end(), p.unpinned_runs.begin(), p.unpinned_runs.end());
  }
  std::vector<range> saved;
  if (!runs.empty()) {
    saved = mgr.release_whole_chunks(runs, keep, stream);
    for (auto& s : t->grp->segments) mark_unbacked(*s, saved);
  }
  t->saved = std::move(saved);
  t->keep = keep;
  t->paused = true;
}

void caching_allocator::impl::resume(std::string_view tag, stream_t stream) {
  log_after_unlock lk(mu);
  tag_state* t = tags.find(tag);
  if (t == nullptr) throw invalid_argument("resume: unknown tag '" + std::string(tag) + "'");
  if (!t->paused) throw invalid_state("resume: tag '" + t->name + "' is not paused");
  std::size_t bytes = 0;
  for (const range& r : t->saved) bytes += r.length;
  if (reserved + bytes > limit) free_cached();
  if (reserved + bytes > limit)
    throw out_of_memory("resume('" + t->name + "'): " + std::to_string(bytes) + " bytes would exceed the memory fraction (" +
                        std::to_string(reserved) + " of " + std::to_string(limit) + " bytes backed)");
  if (!t->saved.empty()) {
    const fill_mode fill = t->keep == keep_mode::host ? fill_mode::restore : fill_mode::undefined;
    try {
      mgr.materialize(t->saved, fill, stream);
    } catch (const out_of_memory&) {
      ++st.num_alloc_retries;
      free_cached();
      mgr.materialize(t->saved, fill, stream);
    }
  }
  for (auto& s : t->grp->segments) {
    std::int64_t added = 0;
    for (const range& r : t->saved) {
      if (r.id != s->id) continue;
      for (std::size_t i = r.offset / g; i < (r.offset + r.length) / g; ++i) {
        s->backed[i] = 1;
        added += static_cast<std::int64_t>(g);
      }
    }
    if (history.on()) record_runs(trace_action::segment_map, *s, t->saved);
    if (added != 0) note_backed(*t->grp, added);
    seg_use(s.get(), stream);
  }
  st.num_device_alloc += static_cast<std::int64_t>(t->saved.size());
  t->saved.clear();
  t->paused = false;
}

bool caching_allocator::impl::is_paused(std::string_view tag) const {
  log_after_unlock lk(mu);
  tag_state* t = tags.find(tag);
  if (t == nullptr) throw invalid_argument("is_paused: unknown tag '" + std::string(tag) + "'");
  return t->paused;
}

void caching_allocator::impl::set_resident(void* ptr, bool resident) {
  log_after_unlock lk(mu);
  block* b = find_containing(reinterpret_cast<std::uintptr_t>(ptr));
  if (b == nullptr)
    throw invalid_argument("set_resident: pointer " + hex(reinterpret_cast<std::uintptr_t>(ptr)) +
                           " is not an allocation of this allocator");
  if (b->seg->grp->tag != nullptr && b->seg->grp->tag->paused)
    throw invalid_state("set_resident: the allocation's tag '" + b->seg->grp->tag->name + "' is paused");
  b->resident = resident;
}

std::vector<std::string> caching_allocator::impl::tag_names() const {
  log_after_unlock lk(mu);
  std::vector<std::string> out;
  for (auto& t : tags) out.push_back(t->name);
  return out;
}

// ---- statistics ---------------------------------------------------------------------------

std::map<std::string, std::int64_t> caching_allocator::impl::stats() const {
  std::map<std::string, std::int64_t> m;
  log_after_unlock lk(mu);
  const char* pools[3] = {"all", "small_pool", "large_pool"};
  auto put = [&](const char* name, const stat_array& a) {
    for (int p = 0; p < 3; ++p) {
      const std::string k = std::string(name) + "." + pools[p] + ".";
      m[k + "current"] = a[p].current;
      m[k + "peak"] = a[p].peak;
      m[k + "allocated"] = a[p].allocated;
      m[k + "freed"] = a[p].freed;
    }
  };
  put("allocation", st.allocation);
  put("segment", st.segment);
  put("active", st.active);
  put("allocated_bytes", st.allocated_bytes);
  put("reserved_bytes", st.reserved_bytes);
  put("active_bytes", st.active_bytes);
  put("requested_bytes", st.requested_bytes);
  m["num_alloc_retries"] = st.num_alloc_retries;
  m["num_ooms"] = st.num_ooms;
  m["num_sync_all_streams"] = st.num_sync_all_streams;
  m["num_device_alloc"] = st.num_device_alloc;
  m["num_device_free"] = st.num_device_free;
  m["max_split_size"] = -1;

  std::int64_t address = 0, paused_tags = 0, paused_bytes = 0;
  auto seg_bytes = [&](const group& grp) {
    for (auto& s : grp.segments) address += static_cast<std::int64_t>(s->size);
  };
  seg_bytes(small_grp);
  seg_bytes(large_grp);
  for (auto& t : tags) {
    seg_bytes(*t->grp);
    if (t->paused) {
      ++paused_tags;
      for (const range& r : t->saved) paused_bytes += static_cast<std::int64_t>(r.length);
    }
  }
  const reservation_stats rs = mgr.stats();
  m["deferalloc.address_bytes"] = address;
  m["deferalloc.backed_bytes"] = static_cast<std::int64_t>(reserved);
  m["deferalloc.memory_limit_bytes"] = static_cast<std::int64_t>(limit);
  m["deferalloc.tags"] = static_cast<std::int64_t>(tags.size());
  m["deferalloc.paused_tags"] = paused_tags;
  m["deferalloc.paused_bytes"] = paused_bytes;
  m["deferalloc.pending_frees"] = static_cast<std::int64_t>(pending.size());
  m["deferalloc.streams"] = static_cast<std::int64_t>(streams.size());
  m["deferalloc.cross_stream_reuses"] = st.cross_stream_reuses;
  m["deferalloc.stream_events"] = st.stream_events;
  m["deferalloc.manager.reserved_bytes"] = static_cast<std::int64_t>(rs.reserved_bytes);
  m["deferalloc.manager.backed_bytes"] = static_cast<std::int64_t>(rs.backed_bytes);
  m["deferalloc.manager.backup_bytes"] = static_cast<std::int64_t>(rs.backup_bytes);
  m["deferalloc.pool.alive_bytes"] = static_cast<std::int64_t>(rs.pool.alive_bytes);
  m["deferalloc.pool.cached_bytes"] = static_cast<std::int64_t>(rs.pool.cached_bytes);
  m["deferalloc.pool.cache_limit_bytes"] = static_cast<std::int64_t>(
      std::min<std::size_t>(mgr.pool().cache_limit(), std::numeric_limits<std::int64_t>::max()));
  m["deferalloc.manager.splits"] = static_cast<std::int64_t>(rs.splits);
  m["deferalloc.pool.chunks_created"] = static_cast<std::int64_t>(rs.pool.chunks_created);
  m["deferalloc.pool.chunks_reused"] = static_cast<std::int64_t>(rs.pool.chunks_reused);
  m["deferalloc.pinned_bytes"] = static_cast<std::int64_t>(rs.pinned.in_use_bytes + rs.pinned.cached_bytes);
  for (int p = 0; p < primitive_count; ++p)
    m[std::string("deferalloc.driver_calls.") + to_string(static_cast<primitive>(p))] =
        static_cast<std::int64_t>(rs.pool.driver_calls.calls[p]);
  return m;
}

std::int64_t caching_allocator::stat(std::string_view key) const {
  auto m = stats();
  auto it = m.find(std::string(key));
  if (it == m.end()) throw invalid_argument("stat: unknown key '" + std::string(key) + "'");
  return it->second;
}

void caching_allocator::impl::reset_peak_stats() {
  log_after_unlock lk(mu);
  for (stat_array* a : {&st.allocation, &st.segment, &st.active, &st.allocated_bytes, &st.reserved_bytes,
                        &st.active_bytes, &st.requested_bytes})
    for (auto& s : *a) s.peak = s.current;
}

void caching_allocator::impl::reset_accumulated_stats() {
  log_after_unlock lk(mu);
  for (stat_array* a : {&st.allocation, &st.segment, &st.active, &st.allocated_bytes, &st.reserved_bytes,
                        &st.active_bytes, &st.requested_bytes})
    for (auto& s : *a) s.allocated = s.freed = 0;
  st.num_alloc_retries = st.num_ooms = st.num_sync_all_streams = 0;
  st.num_device_alloc = st.num_device_free = 0;
  st.cross_stream_reuses = st.stream_events = 0;
}

// ---- the public class: it forwards (Note [Allocator state] in allocator_state.hpp) ----

tag_id caching_allocator::register_tag(std::string_view tag) { return impl_->register_tag(tag); }
void caching_allocator::resume(std::string_view tag, stream_t stream) { impl_->resume(tag, stream); }
bool caching_allocator::is_paused(std::string_view tag) const { return impl_->is_paused(tag); }
void caching_allocator::set_resident(void* ptr, bool resident) { impl_->set_resident(ptr, resident); }
std::vector<std::string> caching_allocator::tags() const { return impl_->tag_names(); }
std::map<std::string, std::int64_t> caching_allocator::stats() const { return impl_->stats(); }
void caching_allocator::reset_peak_stats() { impl_->reset_peak_stats(); }
void caching_allocator::reset_accumulated_stats() { impl_->reset_accumulated_stats(); }

}  // namespace deferalloc
