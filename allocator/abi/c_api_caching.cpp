// The C ABI of the caching allocator: PyTorch's allocator interface (dfa_malloc / dfa_free
// and the hooks), tags, statistics and memory snapshots.
#include <deferalloc/caching/caching_allocator.hpp>
#include <deferalloc/core/errors.hpp>
#include <deferalloc/deferalloc.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "fault_report.hpp"
#include "log.hpp"
#include "process_state.hpp"

using namespace deferalloc;
using namespace deferalloc::abi;

extern "C" {

void* dfa_malloc(size_t size, int device, void* stream) {
  void* out = nullptr;
  if (size == 0) {  // PyTorch asks for 0 bytes for empty tensors: a null pointer, no error
    t_last_error.clear();
    t_last_refusal.clear();
    return nullptr;
  }
  if (guard("dfa_malloc", [&] {
    std::shared_lock<std::shared_mutex> lk;
    caching_allocator& a = allocator_for(device, lk);
    const std::vector<std::string>& tags = thread_tags();
    // The C ABI's current tag is this thread's (thread_tags); the allocator takes its id.
    if (tags.empty()) out = a.allocate(size, stream_t{stream});
    else out = a.allocate(size, stream_t{stream}, a.register_tag(tags.back()));
    try {
      note_segment(a, out);
    } catch (...) {  // the block is the caller's: a failure here must not report it failed
      detail::log_current("dfa_malloc: listing the segment for fault reports", log_level::warn);
    }
  }) == DFA_SUCCESS) {
    t_last_refusal.clear();
  } else {
    // The refusal's own text (the warn line), without guard's "dfa_malloc: ".
    constexpr std::string_view prefix = "dfa_malloc: ";
    t_last_refusal = t_last_error.starts_with(prefix) ? t_last_error.substr(prefix.size()) : t_last_error;
  }
  return out;
}

void dfa_free(void* ptr, size_t size, int device, void* stream) {
  if (ptr == nullptr) return;
  if (guard("dfa_free", [&] {
        std::shared_lock<std::shared_mutex> lk;
        allocator_for(device, lk).deallocate(ptr, size, stream_t{stream});
      }) != DFA_SUCCESS)
    log_hook_error("dfa_free");
}

void dfa_init_hook(int device_count) {
  if (guard("dfa_init_hook", [&] {
        if (device_count < 0) throw invalid_argument("device_count is negative");
        std::shared_lock<std::shared_mutex> lk;
        allocator_for(-1, lk);
      }) != DFA_SUCCESS)
    log_hook_error("dfa_init_hook");
}

void dfa_empty_cache_hook(void) {
  if (guard("dfa_empty_cache_hook", [&] {
        std::shared_lock<std::shared_mutex> lk;
        allocator_for(-1, lk);
        for (caching_allocator* a : all_allocators()) a->empty_cache();
      }) != DFA_SUCCESS)
    log_hook_error("dfa_empty_cache_hook");
}

void dfa_memory_fraction_hook(double fraction, int device) {
  if (dfa_set_memory_fraction(fraction, device) != DFA_SUCCESS) log_hook_error("dfa_memory_fraction_hook");
}

void* dfa_base_alloc_hook(void* ptr, size_t* size) {
  void* out = nullptr;
  if (guard("dfa_base_alloc_hook", [&] {
        for_owner(ptr, [&](caching_allocator& a) { out = a.base_allocation(ptr, size); });
      }) != DFA_SUCCESS)
    log_hook_error("dfa_base_alloc_hook");
  return out;
}

void dfa_record_stream_hook(void* ptr, void* stream) {
  if (guard("dfa_record_stream_hook", [&] {
        for_owner(ptr, [&](caching_allocator& a) { a.record_stream(ptr, stream_t{stream}); });
      }) != DFA_SUCCESS)
    log_hook_error("dfa_record_stream_hook");
}

dfa_status dfa_empty_cache(int device, size_t* released) {
  return guard("dfa_empty_cache", [&] {
    std::shared_lock<std::shared_mutex> lk;
    size_t n = allocator_for(device, lk).empty_cache();
    if (released) *released = n;
  });
}

dfa_status dfa_set_memory_fraction(double fraction, int device) {
  return guard("dfa_set_memory_fraction", [&] {
    std::shared_lock<std::shared_mutex> lk;
    allocator_for(device, lk).set_memory_fraction(fraction);
  });
}

dfa_status dfa_set_resident(void* ptr, int resident) {
  return guard("dfa_set_resident", [&] {
    for_owner(ptr, [&](caching_allocator& a) { a.set_resident(ptr, resident != 0); });
  });
}

dfa_status dfa_tag_begin(const char* tag) {
  return guard("dfa_tag_begin", [&] {
    need(tag, "tag");
    std::shared_lock<std::shared_mutex> lk;
    caching_allocator& a = allocator_for(-1, lk);
    a.register_tag(tag);  // checks the name; pause/resume know it from now on
    thread_tags().emplace_back(tag);
  });
}

dfa_status dfa_tag_end(void) {
  return guard("dfa_tag_end", [&] {
    std::vector<std::string>& tags = thread_tags();
    if (tags.empty()) throw invalid_state("no tagged region is open on this thread");
    tags.pop_back();
  });
}

dfa_status dfa_tag_pause(const char* tag, dfa_keep keep, void* stream) {
  return guard("dfa_tag_pause", [&] {
    const auto k = detail::enum_from_c<keep_mode>(keep);  // range-checked by pause
    const std::vector<std::string>& tags = thread_tags();
    if (!tags.empty())
      throw invalid_state("called inside the tagged region '" + tags.back() + "' (dfa_tag_end first)");
    for_tag("pause", tag, [&](caching_allocator& a) { a.pause(tag, k, stream_t{stream}); });
  });
}

dfa_status dfa_tag_resume(const char* tag, void* stream) {
  return guard("dfa_tag_resume", [&] { for_tag("resume", tag, [&](caching_allocator& a) { a.resume(tag, stream_t{stream}); }); });
}

dfa_status dfa_tag_is_paused(const char* tag, int* out) {
  return guard("dfa_tag_is_paused", [&] {
    need(out, "out");
    int paused = 0;
    for_tag("is_paused", tag, [&](caching_allocator& a) { paused |= a.is_paused(tag) ? 1 : 0; });
    *out = paused;
  });
}

dfa_status dfa_tag_names(char* buf, size_t cap, size_t* needed) {
  return guard("dfa_tag_names", [&] {
    std::shared_lock<std::shared_mutex> lk;
    allocator_for(-1, lk);
    std::vector<std::string> names;
    for (caching_allocator* a : all_allocators())
      for (std::string& t : a->tags())
        if (std::find(names.begin(), names.end(), t) == names.end()) names.push_back(std::move(t));
    std::string text;
    for (const std::string& t : names) text += t + "\n";
    copy_text(text, buf, cap, needed);
  });
}

dfa_status dfa_memory_stats(int device, char* buf, size_t cap, size_t* needed) {
  return guard("dfa_memory_stats", [&] {
    std::shared_lock<std::shared_mutex> lk;
    std::string text;
    for (auto& [k, v] : allocator_for(device, lk).stats()) text += k + " " + std::to_string(v) + "\n";
    copy_text(text, buf, cap, needed);
  });
}

dfa_status dfa_memory_snapshot(char* buf, size_t cap, size_t* needed) {
  return guard("dfa_memory_snapshot", [&] {
    std::shared_lock<std::shared_mutex> lk;
    allocator_for(-1, lk);
    std::string text;
    for (auto& [dev, d] : g_allocs) text += "D " + std::to_string(dev) + "\n" + d->alloc->snapshot_text();
    // The reservations of dfa_reserve (deferred tensors): "Q <id> <address> <reserved>
    // <backed> <backup>", then their backed runs as "R <offset> <length>".
    reservation_manager& m = *g_ctx->reservations;
    std::vector<dfa_reservation> ids;
    {
      std::lock_guard idl(g_ids_mu);
      ids.assign(g_ids.begin(), g_ids.end());
    }
    std::sort(ids.begin(), ids.end());
    for (dfa_reservation r : ids) {
      reservation_info info;
      try {
        info = m.info(r);
      } catch (const invalid_argument&) {
        continue;  // freed since the list was taken
      }
      text += "Q " + std::to_string(r) + " " + std::to_string(info.address) + " " + std::to_string(info.reserved_bytes) +
              " " + std::to_string(info.backed_bytes) + " " + std::to_string(info.backup_bytes) + "\n";
      if (info.backed_bytes == 0) continue;
      try {  // one pass over the chunks (a 16 GiB reservation has 8192 granules of 2 MiB)
        for (const range& run : m.backed_ranges(r))
          text += "R " + std::to_string(run.offset) + " " + std::to_string(run.length) + "\n";
      } catch (const invalid_argument&) {  // freed meanwhile: its runs are left out
      }
    }
    copy_text(text, buf, cap, needed);
  });
}

dfa_status dfa_record_memory_history(size_t max_entries) {
  return guard("dfa_record_memory_history", [&] {
    std::shared_lock<std::shared_mutex> lk;
    allocator_for(-1, lk);
    g_history.store(max_entries);
    for (caching_allocator* a : all_allocators()) a->record_history(max_entries);
  });
}

dfa_status dfa_memory_stat(int device, const char* key, int64_t* out) {
  return guard("dfa_memory_stat", [&] {
    need(key, "key");
    need(out, "out");
    std::shared_lock<std::shared_mutex> lk;
    *out = allocator_for(device, lk).stat(key);
  });
}

dfa_status dfa_reset_peak_stats(int device) {
  return guard("dfa_reset_peak_stats", [&] {
    std::shared_lock<std::shared_mutex> lk;
    allocator_for(device, lk).reset_peak_stats();
  });
}

}  // extern "C"
