// A free list of one driver's events, shared by the layers that record an event per use
// (the reservations' releases and restores, the caching allocator's cross-stream frees):
// an event given back is taken again before a new one is created.
#pragma once
#include <deferalloc/core/driver.hpp>

#include <vector>

namespace deferalloc::detail {

class event_pool {
 public:
  explicit event_pool(stream_ops& ops) noexcept : ops_(ops) {}
  /// Destroys the events given back (the driver must still be alive).
  ~event_pool() {
    for (event_t e : free_) ops_.destroy_event(e);
  }
  event_pool(const event_pool&) = delete;
  event_pool& operator=(const event_pool&) = delete;

  /// A given-back event, else a new one.  @throws cuda_error
  event_t take() {
    if (!free_.empty()) {
      event_t e = free_.back();
      free_.pop_back();
      return e;
    }
    return ops_.create_event();
  }
  /// Keeps `e` for the next take(); destroys it when it cannot be kept.  Never throws.
  void give(event_t e) noexcept {
    try {
      free_.push_back(e);
    } catch (...) {
      ops_.destroy_event(e);
    }
  }
  /// Gives back every event of `es` and empties it.
  void give(std::vector<event_t>& es) noexcept {
    for (event_t e : es) give(e);
    es.clear();
  }

 private:
  stream_ops& ops_;
  std::vector<event_t> free_;
};

}  // namespace deferalloc::detail
