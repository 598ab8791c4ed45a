// The fault-injecting wrappers (allocator/core/driver/fault_driver.hpp).
//
// Each arms countdowns: the call that brings one to zero throws instead of reaching the
// inner half, which lets the tests fail every driver call site of materialize/release/
// reserve and the optimizer's copies in turn.
#include <deferalloc/core/errors.hpp>

#include "core/driver/fault_driver.hpp"

namespace deferalloc {

namespace {
/// Counts a call down; true for the armed one (which disarms it).
bool fires(std::atomic<std::uint64_t>& c) {
  std::uint64_t cur = c.load();
  while (cur != 0)
    if (c.compare_exchange_weak(cur, cur - 1)) return cur == 1;
  return false;
}
}  // namespace

// ---- fault_vmm ------------------------------------------------------------------------

fault_vmm::fault_vmm(std::shared_ptr<vmm_ops> inner) : inner_(std::move(inner)) {
  DFA_EXPECTS(inner_ != nullptr, "fault_vmm: inner vmm_ops is null");
}

void fault_vmm::fail_nth(primitive p, std::uint64_t nth) {
  DFA_EXPECTS(nth >= 1, "fault_vmm::fail_nth: nth is 1-based");
  countdown_[static_cast<int>(p)].store(nth);
}
void fault_vmm::clear() {
  for (auto& c : countdown_) c.store(0);
}

void fault_vmm::check(primitive p) {
  if (!fires(countdown_[static_cast<int>(p)])) return;
  fired_.fetch_add(1);
  const std::string what = std::string("injected fault in ") + to_string(p);
  if (p == primitive::reserve || p == primitive::create || p == primitive::host_alloc) throw out_of_memory(what);
  throw cuda_error(what);
}

std::size_t fault_vmm::granularity() const { return inner_->granularity(); }
memory_info fault_vmm::get_memory_info() { return inner_->get_memory_info(); }
bool fault_vmm::shareable() const { return inner_->shareable(); }

std::uintptr_t fault_vmm::do_reserve(std::size_t b, std::size_t a) {
  check(primitive::reserve);
  return inner_->reserve(b, a);
}
void fault_vmm::do_free_reservation(std::uintptr_t va, std::size_t b) {
  check(primitive::free_reservation);
  inner_->free_reservation(va, b);
}
chunk_handle fault_vmm::do_create(std::size_t b) {
  check(primitive::create);
  return inner_->create(b);
}
void fault_vmm::do_release(chunk_handle h) {
  check(primitive::release);
  inner_->release(h);
}
void fault_vmm::do_map(std::uintptr_t va, std::size_t b, chunk_handle h) {
  check(primitive::map);
  inner_->map(va, b, h);
}
void fault_vmm::do_unmap(std::uintptr_t va, std::size_t b) {
  check(primitive::unmap);
  inner_->unmap(va, b);
}
void fault_vmm::do_set_access(std::uintptr_t va, std::size_t b) {
  check(primitive::set_access);
  inner_->set_access(va, b);
}
void* fault_vmm::do_host_alloc(std::size_t b) {
  check(primitive::host_alloc);
  return inner_->host_alloc(b);
}
void fault_vmm::do_host_free(void* p) noexcept { inner_->host_free(p); }

// ---- fault_streams --------------------------------------------------------------------

fault_streams::fault_streams(std::shared_ptr<stream_ops> inner) : inner_(std::move(inner)) {
  DFA_EXPECTS(inner_ != nullptr, "fault_streams: inner stream_ops is null");
}

void fault_streams::fail_nth_copy(std::uint64_t nth) {
  DFA_EXPECTS(nth >= 1, "fault_streams::fail_nth_copy: nth is 1-based");
  copy_countdown_.store(nth);
}
void fault_streams::clear() { copy_countdown_.store(0); }

stream_t fault_streams::create_stream() { return inner_->create_stream(); }
stream_t fault_streams::create_priority_stream() { return inner_->create_priority_stream(); }
void fault_streams::destroy_stream(stream_t s) noexcept { inner_->destroy_stream(s); }
event_t fault_streams::create_event() { return inner_->create_event(); }
void fault_streams::destroy_event(event_t e) noexcept { inner_->destroy_event(e); }
void fault_streams::record(event_t e, stream_t s) { inner_->record(e, s); }
void fault_streams::stream_wait(stream_t s, event_t e) { inner_->stream_wait(s, e); }
void fault_streams::synchronize(event_t e) { inner_->synchronize(e); }
bool fault_streams::query(event_t e) { return inner_->query(e); }
void fault_streams::synchronize_stream(stream_t s) { inner_->synchronize_stream(s); }
void fault_streams::copy_async(void* d, const void* s, std::size_t n, stream_t st) {
  if (fires(copy_countdown_)) {
    fired_.fetch_add(1);
    throw cuda_error("injected fault in copy_async");
  }
  inner_->copy_async(d, s, n, st);
}
void fault_streams::zero_async(void* d, std::size_t n, stream_t st) { inner_->zero_async(d, n, st); }
bool fault_streams::asynchronous() const { return inner_->asynchronous(); }

// ---- fault_driver ---------------------------------------------------------------------

fault_driver::fault_driver(std::shared_ptr<driver> inner)
    : fault_vmm(inner), fault_streams(inner), inner_(std::move(inner)) {}

void fault_driver::clear() {
  fault_vmm::clear();
  fault_streams::clear();
}

std::string fault_driver::name() const { return "fault(" + inner_->name() + ")"; }
driver_kind fault_driver::kind() const { return inner_->kind(); }
int fault_driver::device() const { return inner_->device(); }

}  // namespace deferalloc
