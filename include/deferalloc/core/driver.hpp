// The driver layer, as two narrow interfaces in the style of rmm's resources:
//   vmm_ops     the seven VMM primitives (reserve, create, map, set access, unmap,
//               release, free the reservation), pinned host memory, the granularity and
//               free/total memory; every primitive is counted (the statistics layer);
//   stream_ops  the few stream/event/copy operations the layers above need to be
//               stream-ordered (not counted).
// A `driver` is both, plus what identifies it (name, kind, device).  A part that calls one
// half takes that half: the chunk pool and the pinned pool a vmm_ops, the reservation
// manager the pool's vmm_ops and a stream_ops, the event pool, the optimizer's stream set,
// window pass and homes their halves.  The whole `driver` is taken where one object is
// handed on to parts that call both halves (streamed_adamw, distributed_adamw, the
// communicators' factories, context) or its identity is read (the kernels' backend).
// `driver` derives from its halves virtually, so a driver can be put together from one
// implementation of each half (the fault-injecting driver is a fault_vmm and a
// fault_streams).
//
// Two real implementations: cuda_driver (libcuda resolved at run time) and
// host_driver (the same semantics on host memory: PROT_NONE reservations, memfd
// chunks, MAP_FIXED|MAP_SHARED mappings, mprotect for access).  A fault-injecting
// wrapper of each half for the tests fails the Nth call of a chosen primitive or copy
// (internal: allocator/core/driver/fault_driver.hpp).
//
// The counting is vmm_ops' non-virtual public functions (rmm's allocate / do_allocate
// pattern), so the statistics live in one place; budgets are the chunk pool's.
#pragma once
#include <deferalloc/core/export.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace deferalloc {

/// A native handle with a type of its own: a stream and an event are distinct types,
/// so arguments given in the wrong order do not compile.  Built from nullptr (no
/// handle) or explicitly from the native pointer; get() gives that pointer back (for
/// the driver, kernels and NCCL).  C++17 (the .cu files include this header).
template <class Tag>
class typed_handle {
 public:
  constexpr typed_handle() noexcept = default;
  constexpr typed_handle(std::nullptr_t) noexcept {}
  constexpr explicit typed_handle(void* native) noexcept : h_(native) {}
  constexpr void* get() const noexcept { return h_; }
  constexpr explicit operator bool() const noexcept { return h_ != nullptr; }
  friend constexpr bool operator==(typed_handle a, typed_handle b) noexcept { return a.h_ == b.h_; }
  friend constexpr bool operator!=(typed_handle a, typed_handle b) noexcept { return a.h_ != b.h_; }
  friend constexpr bool operator<(typed_handle a, typed_handle b) noexcept { return std::less<void*>{}(a.h_, b.h_); }

 private:
  void* h_ = nullptr;
};
struct stream_tag;
struct event_tag;
/// A CUDA stream (cudaStream_t / CUstream); nullptr is the legacy default stream.
using stream_t = typed_handle<stream_tag>;
/// An event of the driver (CUevent on CUDA, unused on the host driver).
using event_t = typed_handle<event_tag>;
/// A physical chunk (CUmemGenericAllocationHandle on CUDA, a memfd on the host).
using chunk_handle = std::uint64_t;

/// Which implementation a driver is (wrappers report their inner driver's kind).
/// `automatic` is only a setting (cuda when a device is present, else host); no
/// driver object has it.
enum class driver_kind { automatic, cuda, host };

/// What handle type a CUDA driver's chunks are created with (setting shareable_handles):
/// `automatic` asks for POSIX file descriptors where the device supports them (NCCL
/// exports them to register buffers for other processes), `none` for no shareable
/// handle, `posix_fd` requires them (make_cuda_driver throws invalid_argument where the
/// device does not support them).
enum class shareable_handle { automatic, none, posix_fd };

/// The counted, fault-injectable primitives.
enum class primitive : int {
  reserve = 0,
  free_reservation,
  create,
  release,
  map,
  unmap,
  set_access,
  host_alloc,  ///< pinned host memory for backups
  count_
};
inline constexpr int primitive_count = static_cast<int>(primitive::count_);
DFA_API const char* to_string(primitive p) noexcept;

struct memory_info {
  std::size_t free_bytes{};
  std::size_t total_bytes{};
};

/// Calls made through a driver, by primitive.
struct driver_call_counts {
  std::array<std::uint64_t, primitive_count> calls{};
  std::uint64_t operator[](primitive p) const { return calls[static_cast<int>(p)]; }
};

/// The VMM primitives and pinned host memory (counted), with the granularity and the
/// device's free/total memory.
class DFA_API vmm_ops {
 public:
  virtual ~vmm_ops();
  vmm_ops(const vmm_ops&) = delete;
  vmm_ops& operator=(const vmm_ops&) = delete;

  /// The mapping granularity in bytes (2 MiB on H200).  No driver call.
  virtual std::size_t granularity() const = 0;
  /// Free and total physical memory (cuMemGetInfo; the capacity on the host).
  virtual memory_info get_memory_info() = 0;
  /// True when chunks are created with a handle type other processes can import
  /// (cuMemExportToShareableHandle), which NCCL needs to register them.  Host: false.
  virtual bool shareable() const { return false; }

  // ---- the seven VMM primitives (counted) ----
  /// Reserves `bytes` of address space aligned to `alignment`; no physical memory.
  /// Cost: one cuMemAddressReserve.  @throws out_of_memory, cuda_error
  std::uintptr_t reserve(std::size_t bytes, std::size_t alignment);
  /// Returns a reservation's address range.  Must be fully unmapped.
  void free_reservation(std::uintptr_t va, std::size_t bytes);
  /// Creates one physical chunk of `bytes` (a multiple of granularity()).
  /// Cost: one cuMemCreate (8.8 us for 2 MiB, 48 us for 1 GiB on H200).  @throws out_of_memory
  chunk_handle create(std::size_t bytes);
  /// Releases a chunk (its memory goes back once it is unmapped everywhere).
  void release(chunk_handle h);
  /// Maps a whole chunk at `va` (no access yet).  Cost: one cuMemMap.
  void map(std::uintptr_t va, std::size_t bytes, chunk_handle h);
  /// Unmaps a range made of whole mappings.  Does not wait for kernels: callers wait first.
  void unmap(std::uintptr_t va, std::size_t bytes);
  /// Grants read/write access to a mapped, contiguous range.  Cost: one cuMemSetAccess.
  void set_access(std::uintptr_t va, std::size_t bytes);

  // ---- pinned host memory (counted as host_alloc) ----
  /// Page-locked host memory for backups (cuMemHostAlloc; plain pages on the host driver).
  void* host_alloc(std::size_t bytes);
  void host_free(void* p) noexcept;

  /// Calls made so far, by primitive.  No driver call.
  driver_call_counts call_counts() const;

 protected:
  vmm_ops() = default;

 private:
  virtual std::uintptr_t do_reserve(std::size_t bytes, std::size_t alignment) = 0;
  virtual void do_free_reservation(std::uintptr_t va, std::size_t bytes) = 0;
  virtual chunk_handle do_create(std::size_t bytes) = 0;
  virtual void do_release(chunk_handle h) = 0;
  virtual void do_map(std::uintptr_t va, std::size_t bytes, chunk_handle h) = 0;
  virtual void do_unmap(std::uintptr_t va, std::size_t bytes) = 0;
  virtual void do_set_access(std::uintptr_t va, std::size_t bytes) = 0;
  virtual void* do_host_alloc(std::size_t bytes) = 0;
  virtual void do_host_free(void* p) noexcept = 0;

  void count(primitive p) noexcept { calls_[static_cast<int>(p)].fetch_add(1, std::memory_order_relaxed); }
  std::array<std::atomic<std::uint64_t>, primitive_count> calls_{};
};

/// Streams, events and copies: what makes the layers above stream-ordered (not counted).
class DFA_API stream_ops {
 public:
  virtual ~stream_ops();
  stream_ops(const stream_ops&) = delete;
  stream_ops& operator=(const stream_ops&) = delete;

  virtual stream_t create_stream() = 0;
  /// A stream whose kernels the GPU schedules ahead of other streams' waiting blocks (the
  /// greatest CUDA stream priority): short kernels that run beside long ones, as the
  /// optimizer's during backward, are not starved.  create_stream() where there are none.
  virtual stream_t create_priority_stream() { return create_stream(); }
  virtual void destroy_stream(stream_t s) noexcept = 0;
  virtual event_t create_event() = 0;
  virtual void destroy_event(event_t e) noexcept = 0;
  /// Records `e` on `s`.
  virtual void record(event_t e, stream_t s) = 0;
  /// Makes `s` wait for `e` (no host wait).
  virtual void stream_wait(stream_t s, event_t e) = 0;
  /// Host waits for `e`.
  virtual void synchronize(event_t e) = 0;
  /// True when the work before `e` has completed (no wait).
  virtual bool query(event_t e) = 0;
  /// Host waits for all work on `s`.
  virtual void synchronize_stream(stream_t s) = 0;
  /// Copies `bytes` on `s` (any direction: unified addressing).
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, stream_t s) = 0;
  /// Sets `bytes` at `dst` to zero on `s`.
  virtual void zero_async(void* dst, std::size_t bytes, stream_t s) = 0;
  /// True when device work is asynchronous (CUDA); false when every operation has
  /// completed on return (host driver).
  virtual bool asynchronous() const = 0;

 protected:
  stream_ops() = default;
};

/// One device's driver: its VMM primitives and its streams, and what it is.  The halves are
/// virtual bases: a class may take each half's overriders from a different base (one
/// subobject of each half either way).
class DFA_API driver : public virtual vmm_ops, public virtual stream_ops {
 public:
  ~driver() override;

  /// Short name: "cuda" or "host" (wrappers prefix theirs).
  virtual std::string name() const = 0;
  /// cuda or host: what the driver really is, also under a wrapper (fault(host) is
  /// host).  Decide behaviour by this, never by name().
  virtual driver_kind kind() const = 0;
  /// The device ordinal this driver serves.
  virtual int device() const { return 0; }

 protected:
  driver() = default;
};

/// Host-driver settings.
struct host_driver_config {
  /// Granularity in bytes: a multiple of the page size (default 2 MiB, as on H200).
  std::size_t granularity = std::size_t{2} << 20;
  /// Physical capacity in bytes; create() beyond it throws out_of_memory.  0 = 1/4 of RAM.
  std::size_t capacity = 0;
};

/// A driver on host memory with the same semantics as the GPU's.  Always available.
DFA_API std::shared_ptr<driver> make_host_driver(const host_driver_config& cfg = {});

/// The CUDA driver for `device`.  libcuda.so.1 is opened at run time.
/// @throws no_device when no driver or device is present (the message says which).
/// Chunks get a shareable handle type as `share` says (Note [Shareable chunks]).
DFA_API std::shared_ptr<driver> make_cuda_driver(int device = 0, shareable_handle share = shareable_handle::automatic);

/// True when libcuda loads and reports at least one device.  Never throws.
DFA_API bool cuda_device_available() noexcept;

}  // namespace deferalloc

namespace std {
template <class Tag>
struct hash<deferalloc::typed_handle<Tag>> {
  std::size_t operator()(deferalloc::typed_handle<Tag> h) const noexcept { return std::hash<void*>{}(h.get()); }
};
}  // namespace std
