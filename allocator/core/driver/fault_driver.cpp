// The fault-injecting wrapper (allocator/core/driver/fault_driver.hpp).
//
// It arms a countdown per primitive: the call that brings it to zero throws instead of
// reaching the inner driver, which lets the tests fail every driver call site of
// materialize/release/reserve in turn.
#include <deferalloc/core/errors.hpp>

#include "core/driver/fault_driver.hpp"

namespace deferalloc {

fault_driver::fault_driver(std::shared_ptr<driver> inner) : inner_(std::move(inner)) {
  DFA_EXPECTS(inner_ != nullptr, "fault_driver: inner driver is null");
}

void fault_driver::fail_nth(primitive p, std::uint64_t nth) {
  DFA_EXPECTS(nth >= 1, "fault_driver::fail_nth: nth is 1-based");
  countdown_[static_cast<int>(p)].store(nth);
}
void fault_driver::fail_nth_copy(std::uint64_t nth) {
  DFA_EXPECTS(nth >= 1, "fault_driver::fail_nth_copy: nth is 1-based");
  copy_countdown_.store(nth);
}
void fault_driver::clear() {
  for (auto& c : countdown_) c.store(0);
  copy_countdown_.store(0);
}

namespace {
/// Counts a call down; true for the armed one (which disarms it).
bool fires(std::atomic<std::uint64_t>& c) {
  std::uint64_t cur = c.load();
  while (cur != 0)
    if (c.compare_exchange_weak(cur, cur - 1)) return cur == 1;
  return false;
}
}  // namespace

void fault_driver::check(primitive p) {
  if (!fires(countdown_[static_cast<int>(p)])) return;
  fired_.fetch_add(1);
  const std::string what = std::string("injected fault in ") + to_string(p);
  if (p == primitive::reserve || p == primitive::create || p == primitive::host_alloc) throw out_of_memory(what);
  throw cuda_error(what);
}

std::string fault_driver::name() const { return "fault(" + inner_->name() + ")"; }
driver_kind fault_driver::kind() const { return inner_->kind(); }
bool fault_driver::shareable() const { return inner_->shareable(); }
std::size_t fault_driver::granularity() const { return inner_->granularity(); }
memory_info fault_driver::get_memory_info() { return inner_->get_memory_info(); }
int fault_driver::device() const { return inner_->device(); }
stream_t fault_driver::create_stream() { return inner_->create_stream(); }
stream_t fault_driver::create_priority_stream() { return inner_->create_priority_stream(); }
void fault_driver::destroy_stream(stream_t s) noexcept { inner_->destroy_stream(s); }
event_t fault_driver::create_event() { return inner_->create_event(); }
void fault_driver::destroy_event(event_t e) noexcept { inner_->destroy_event(e); }
void fault_driver::record(event_t e, stream_t s) { inner_->record(e, s); }
void fault_driver::stream_wait(stream_t s, event_t e) { inner_->stream_wait(s, e); }
void fault_driver::synchronize(event_t e) { inner_->synchronize(e); }
bool fault_driver::query(event_t e) { return inner_->query(e); }
void fault_driver::synchronize_stream(stream_t s) { inner_->synchronize_stream(s); }
void fault_driver::copy_async(void* d, const void* s, std::size_t n, stream_t st) {
  if (fires(copy_countdown_)) {
    fired_.fetch_add(1);
    throw cuda_error("injected fault in copy_async");
  }
  inner_->copy_async(d, s, n, st);
}
void fault_driver::zero_async(void* d, std::size_t n, stream_t st) { inner_->zero_async(d, n, st); }
bool fault_driver::asynchronous() const { return inner_->asynchronous(); }

std::uintptr_t fault_driver::do_reserve(std::size_t b, std::size_t a) {
  check(primitive::reserve);
  return inner_->reserve(b, a);
}
void fault_driver::do_free_reservation(std::uintptr_t va, std::size_t b) {
  check(primitive::free_reservation);
  inner_->free_reservation(va, b);
}
chunk_handle fault_driver::do_create(std::size_t b) {
  check(primitive::create);
  return inner_->create(b);
}
void fault_driver::do_release(chunk_handle h) {
  check(primitive::release);
  inner_->release(h);
}
void fault_driver::do_map(std::uintptr_t va, std::size_t b, chunk_handle h) {
  check(primitive::map);
  inner_->map(va, b, h);
}
void fault_driver::do_unmap(std::uintptr_t va, std::size_t b) {
  check(primitive::unmap);
  inner_->unmap(va, b);
}
void fault_driver::do_set_access(std::uintptr_t va, std::size_t b) {
  check(primitive::set_access);
  inner_->set_access(va, b);
}
void* fault_driver::do_host_alloc(std::size_t b) {
  check(primitive::host_alloc);
  return inner_->host_alloc(b);
}
void fault_driver::do_host_free(void* p) noexcept { inner_->host_free(p); }

}  // namespace deferalloc
