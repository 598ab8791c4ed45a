// The fault-injecting wrappers, for the tests (internal: not installed).
//
// One wrapper per half of the driver: fault_vmm forwards a vmm_ops and can fail the Nth
// call of a chosen primitive, fault_streams forwards a stream_ops and can fail the Nth
// copy; each overrides its own half's methods only.  fault_driver is a whole driver made
// of the two over one inner driver (driver's halves are virtual bases), for the parts that
// take a driver.  The tests fail every driver call site of materialize / release / reserve
// and the optimizer's copies in turn.  Exported from libdeferalloc for the test programs.
#pragma once
#include <deferalloc/core/driver.hpp>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace deferalloc {

/// A vmm_ops that forwards to `inner` and can fail chosen primitives.
class DFA_API fault_vmm : public virtual vmm_ops {
 public:
  explicit fault_vmm(std::shared_ptr<vmm_ops> inner);
  /// The `nth` (1-based, counted from now) call of `p` throws: out_of_memory for
  /// reserve/create/host_alloc, cuda_error for the others.  One armed fault per primitive.
  void fail_nth(primitive p, std::uint64_t nth);
  /// Disarms every fault.
  void clear();
  /// Number of faults fired so far.
  std::uint64_t fired() const { return fired_.load(); }

  std::size_t granularity() const override;
  memory_info get_memory_info() override;
  bool shareable() const override;

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

  std::shared_ptr<vmm_ops> inner_;
  std::array<std::atomic<std::uint64_t>, primitive_count> countdown_{};
  std::atomic<std::uint64_t> fired_{0};
};

/// A stream_ops that forwards to `inner` and can fail a chosen copy.
class DFA_API fault_streams : public virtual stream_ops {
 public:
  explicit fault_streams(std::shared_ptr<stream_ops> inner);
  /// The `nth` copy_async (1-based, counted from now) throws cuda_error (a copy that
  /// fails part-way through a pass).
  void fail_nth_copy(std::uint64_t nth);
  /// Disarms the fault.
  void clear();
  /// Number of faults fired so far.
  std::uint64_t fired() const { return fired_.load(); }

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
  std::shared_ptr<stream_ops> inner_;
  std::atomic<std::uint64_t> copy_countdown_{0};
  std::atomic<std::uint64_t> fired_{0};
};

/// A whole driver over `inner` whose halves are a fault_vmm and a fault_streams: it adds
/// only what identifies a driver (its name says it wraps `inner`; kind and device are the
/// inner driver's).
class DFA_API fault_driver final : public driver, public fault_vmm, public fault_streams {
 public:
  explicit fault_driver(std::shared_ptr<driver> inner);
  /// Disarms every fault of both halves.
  void clear();
  /// Faults fired so far by both halves.
  std::uint64_t fired() const { return fault_vmm::fired() + fault_streams::fired(); }
  driver& inner() { return *inner_; }

  std::string name() const override;
  driver_kind kind() const override;
  int device() const override;

 private:
  std::shared_ptr<driver> inner_;
};

}  // namespace deferalloc
