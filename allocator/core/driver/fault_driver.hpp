// The fault-injecting driver wrapper, for the tests (internal: not installed).
//
// It forwards every call to its inner driver, and can fail the Nth call of a chosen
// primitive (or copy), so the tests fail every driver call site of materialize / release /
// reserve in turn.  Exported from libdeferalloc for the test programs.
#pragma once
#include <deferalloc/core/driver.hpp>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace deferalloc {

/// A wrapper that forwards to `inner` and can fail chosen calls.
class DFA_API fault_driver : public driver {
 public:
  explicit fault_driver(std::shared_ptr<driver> inner);
  /// The `nth` (1-based, counted from now) call of `p` throws: out_of_memory for
  /// reserve/create/host_alloc, cuda_error for the others.  One armed fault per primitive.
  void fail_nth(primitive p, std::uint64_t nth);
  /// The `nth` copy_async (1-based, counted from now) throws cuda_error (a copy that
  /// fails part-way through a pass).
  void fail_nth_copy(std::uint64_t nth);
  /// Disarms every fault.
  void clear();
  /// Number of faults fired so far.
  std::uint64_t fired() const { return fired_.load(); }
  driver& inner() { return *inner_; }

  std::string name() const override;
  driver_kind kind() const override;
  bool shareable() const override;
  std::size_t granularity() const override;
  memory_info get_memory_info() override;
  int device() const override;
  stream_t create_stream() override;
  stream_t create_priority_stream() override;
  void destroy_stream(stream_t s) noexcept override;
  event_t create_event() override;
  void destroy_event(event_t e) noexcept override;
  void record(event_t e, stream_t s) override;
  void stream_wait(stream_t s, event_t e) override;
  void synchronize(event_t e) override;
  bool query(event_t e) override;
  void synchronize_stream(stream_t s) override;
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_t s) override;
  void zero_async(void* dst, std::size_t bytes, stream_t s) override;
  bool asynchronous() const override;

 private:
  void check(primitive p);
  std::uintptr_t do_reserve(std::size_t bytes, std::size_t alignment) override;
  void do_free_reservation(std::uintptr_t va, std::size_t bytes) override;
  chunk_handle do_create(std::size_t bytes) override;
  void do_release(chunk_handle h) override;
  void do_map(std::uintptr_t va, std::size_t bytes, chunk_handle h) override;
  void do_unmap(std::uintptr_t va, std::size_t bytes) override;
  void do_set_access(std::uintptr_t va, std::size_t bytes) override;
  void* do_host_alloc(std::size_t bytes) override;
  void do_host_free(void* p) noexcept override;

  std::shared_ptr<driver> inner_;
  std::array<std::atomic<std::uint64_t>, primitive_count> countdown_{};
  std::atomic<std::uint64_t> copy_countdown_{0};
  std::atomic<std::uint64_t> fired_{0};
};

}  // namespace deferalloc
