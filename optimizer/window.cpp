#include "window.hpp"

#include <algorithm>

namespace deferalloc::optim {

stream_set::stream_set(stream_ops& drv) : drv_(drv) {
  h2d_ = drv_.create_stream();
  d2h_ = drv_.create_stream();
  exec_ = drv_.create_priority_stream();
}

stream_set::~stream_set() {
  for (event_t e : events_) drv_.destroy_event(e);
  drv_.destroy_stream(h2d_);
  drv_.destroy_stream(d2h_);
  drv_.destroy_stream(exec_);
}

event_t stream_set::event(std::size_t i) {
  while (events_.size() <= i) events_.push_back(drv_.create_event());
  return events_[i];
}

void stream_set::after(stream_t waiter, stream_t producer) {
  event_t e = event(0);
  drv_.record(e, producer);
  drv_.stream_wait(waiter, e);
}

void stream_set::synchronize() {
  drv_.synchronize_stream(h2d_);
  drv_.synchronize_stream(exec_);
  drv_.synchronize_stream(d2h_);
}

window::window(reservation_manager& mgr, std::size_t depth, std::size_t piece_bytes) : mgr_(mgr), slots_(depth) {
  for (auto& sl : slots_)
    for (state_array a : k_state_arrays) {
      sl.res[a] = mgr_.reserve(piece_bytes);
      sl.dev[a] = static_cast<float*>(mgr_.address(sl.res[a]));
    }
}

bool window::back(std::size_t count, std::span<const state_array> arrays, std::size_t bytes, stream_t s) {
  std::vector<range> rs;
  for (std::size_t k = 0; k < count; ++k)
    for (state_array a : arrays)
      if (slots_[k].backed[a] < bytes) rs.push_back({slots_[k].res[a], slots_[k].backed[a], bytes - slots_[k].backed[a]});
  if (rs.empty()) return false;
  mgr_.materialize(rs, fill_mode::undefined, s);
  for (std::size_t k = 0; k < count; ++k)
    for (state_array a : arrays) slots_[k].backed[a] = std::max(slots_[k].backed[a], bytes);
  return true;
}

void window::release(stream_t s) {
  std::vector<range> rs;
  for (auto& sl : slots_)
    for (state_array a : k_state_arrays)
      if (sl.backed[a] > 0) rs.push_back({sl.res[a], 0, sl.backed[a]});
  if (!rs.empty()) mgr_.release(rs, keep_mode::discard, s);
  for (auto& sl : slots_) sl.backed = {};
}

}  // namespace deferalloc::optim
