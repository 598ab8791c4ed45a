// The distributed optimizer: ZeRO-1 / Megatron-style sharding of the streamed AdamW
// state across data-parallel ranks, over NCCL.  See Note [Distributed step] in
// optimizer/distributed/distributed_adamw.cpp.
//
// The model's BF16 parameters and gradients live in one contiguous, padded buffer each
// per rank; rank r owns the contiguous shard [r * shard, (r + 1) * shard) of both, and
// keeps the FP32 main params and Adam moments of that shard only, deferred and streamed
// (any tier of streamed_adamw).  Per step:
//   reduce-scatter(grads) -> clip (the squared norm summed over ranks) -> streamed AdamW
//   step on the shard -> all-gather(BF16 params).
// NCCL is opened at run time (libnccl.so.2), as libcuda is: the library loads without it.
#pragma once
#include <deferalloc/core/driver.hpp>
#include <deferalloc/core/export.hpp>
#include <deferalloc/optim/optimizer.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace deferalloc::dist {

/// Element types the collectives move.
enum class dtype { bf16, fp32, fp64 };
DFA_API std::size_t size_of(dtype t) noexcept;

/// Where rank `rank`'s shard lies in a flat buffer of `numel` elements.
struct shard_layout {
  std::size_t numel = 0;         ///< model elements (unpadded)
  std::size_t padded_numel = 0;  ///< world * shard: the length of the flat buffers
  std::size_t shard = 0;         ///< elements per rank (a multiple of `align`)
  std::size_t begin = 0;         ///< rank * shard
  std::size_t valid = 0;         ///< elements of the shard below `numel` (the rest is padding)
  int world = 1;
  int rank = 0;
};

/// The layout of `numel` elements over `world` ranks, each shard a multiple of `align`
/// elements (so every shard starts aligned in both BF16 and FP32 buffers).  Pure
/// arithmetic.  @throws invalid_argument (numel 0, world < 1, rank outside [0, world), align 0)
DFA_API shard_layout make_layout(std::size_t numel, int world, int rank, std::size_t align = 1024);

/// A data-parallel group: the two collectives the distributed step needs, plus buffer
/// registration.  (The gradient norm needs no all-reduce: each rank's partial sum is
/// all-gathered and added in rank order, so every rank gets the same bits.)  Every
/// operation is stream-ordered on `s` (device memory of the driver's device);
/// implementations check every return code and throw cuda_error.
class DFA_API communicator {
 public:
  virtual ~communicator();
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  /// Sum over ranks of `send` (world * count elements); rank r receives block r in
  /// `recv` (count elements).  In place when recv == send + r * count.
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, dtype t, stream_t s) = 0;
  /// Concatenation over ranks of `send` (count elements each) into `recv`
  /// (world * count).  In place when send == recv + r * count.
  virtual void all_gather(const void* send, void* recv, std::size_t count, dtype t, stream_t s) = 0;
  /// Registers a buffer for zero-copy collectives (ncclCommRegister).  Returns an opaque
  /// handle (nullptr when the implementation has nothing to register).  The physical
  /// memory behind [ptr, ptr + bytes) must stay mapped until deregister_buffer.
  virtual void* register_buffer(void* ptr, std::size_t bytes) = 0;
  /// Undoes register_buffer.  nullptr is ignored.
  virtual void deregister_buffer(void* handle) = 0;
  /// Short name ("nccl", "local", ...).
  virtual std::string name() const = 0;

 protected:
  communicator() = default;
};

/// World size 1 without NCCL: the collectives are copies through `drv` (nothing when in
/// place).  Runs on the host driver, so the distributed step is tested in CI.
DFA_API std::shared_ptr<communicator> make_local_communicator(std::shared_ptr<driver> drv);

/// The opaque bytes of an ncclUniqueId.
using unique_id = std::array<char, 128>;

/// True when libnccl.so.2 can be opened (DEFERALLOC_NCCL_LIB, the default search path,
/// then the directory CMake found NCCL in).  Never throws.
DFA_API bool nccl_available() noexcept;
/// The loaded NCCL's version code (e.g. 22807).  @throws no_device when NCCL is absent.
DFA_API int nccl_version();
/// A fresh ncclUniqueId (rank 0 makes it and shares it, e.g. through a TCPStore).
/// @throws no_device (no NCCL), cuda_error
DFA_API unique_id nccl_unique_id();
/// Joins the communicator `id` as `rank` of `world` on the CUDA device of `drv`
/// (ncclCommInitRank; collective: every rank must call it).  Sets NCCL_NVLS_ENABLE=0 in
/// the process when unset: deferalloc never uses NVLink multicast.
/// @throws invalid_argument (driver not CUDA, bad rank), no_device, cuda_error
DFA_API std::shared_ptr<communicator> make_nccl_communicator(std::shared_ptr<driver> drv, const unique_id& id,
                                                             int world, int rank);

/// How the distributed optimizer runs.
struct dist_config {
  optim::optimizer_config optimizer;  ///< tier, window, depth, hyper-parameters (rank is set from the communicator)
  optim::grad_type grads = optim::grad_type::bf16;
  /// Global gradient-norm clipping (of the rank-averaged gradient); 0 = off.
  float max_grad_norm = 0.0f;
  /// Register the flat buffers with the communicator (ncclCommRegister).
  bool register_buffers = true;
  /// Shard alignment in elements (see make_layout).
  std::size_t align = 1024;
};

/// What one distributed step did.
struct dist_step_report {
  double grad_norm = 0;      ///< global norm of the averaged gradient, before clipping
  float grad_scale = 1.0f;   ///< 1 / world times the clip coefficient, given to streamed_adamw
  double seconds_reduce = 0; ///< reduce-scatter + norm (host-measured, includes the waits)
  double seconds_step = 0;   ///< the streamed AdamW step
  double seconds_gather = 0; ///< all-gather enqueue (stream-ordered: not waited for)
  optim::step_report optimizer;
};

class DFA_API distributed_adamw {
 public:
  /// `params` and `grads` are this rank's flat buffers of layout().padded_numel elements
  /// (BF16 params; grads of cfg.grads), device memory of the driver's device, identical
  /// on every rank at initialize().  Padding elements must be zero.  Registers the
  /// shard with a streamed_adamw (3 reservations, no HBM on streamed tiers) and, with
  /// cfg.register_buffers, both buffers with the communicator.
  /// @throws invalid_argument (null buffers, numel 0), what the communicator throws
  distributed_adamw(std::shared_ptr<driver> drv, std::shared_ptr<communicator> comm, std::size_t numel,
                    std::uint16_t* params, void* grads, dist_config cfg);
  /// Deregisters the buffers (errors logged, never thrown).
  ~distributed_adamw();
  distributed_adamw(const distributed_adamw&) = delete;
  distributed_adamw& operator=(const distributed_adamw&) = delete;

  /// The layout for `numel` elements on `comm` (size the flat buffers with it).
  static shard_layout layout_for(std::size_t numel, const communicator& comm, std::size_t align = 1024);
  const shard_layout& layout() const;

  /// FP32 main params of the shard := float(params shard), streamed to its home tier.
  /// Synchronous; no collective.  @throws what streamed_adamw::initialize throws
  void initialize(stream_t stream = nullptr);
  /// One step: reduce-scatter of the gradients (sum; the buffer's other blocks are
  /// clobbered), the squared norm summed over ranks when clipping (one host wait), the
  /// streamed step with grad_scale = clip / world, then the all-gather of the BF16
  /// params, in place, on `stream`.  Returns when the shard's state is home; the gather is queued.
  /// Every rank must call it.  @throws cuda_error, out_of_memory, io_error
  dist_step_report step(stream_t stream = nullptr);
  /// BF16(main) into the shard, then all-gather: the whole model matches the state
  /// (after load_checkpoint or a file-tier resume).  Collective.
  void sync_model_params(stream_t stream = nullptr);

  /// Saves a new generation `dir`/gen-<N>: this rank's shard in rank-<r> (streamed_adamw's
  /// format) and, from rank 0, distributed.txt (world, numel, shard), published by one
  /// rename once every rank's part is durable; older generations are pruned after.
  /// Collective: every rank calls it, it returns on every rank once the generation is
  /// published (three all-gathers of a number), and a failure on any rank throws io_error
  /// on all and leaves the previous generation the newest.  See Note [Distributed checkpoint].
  void save_checkpoint(const std::string& dir);
  /// Loads the newest generation save_checkpoint published at the same world size and
  /// layout (which writes this rank's BF16 shard), then all-gathers the model params.
  /// Collective; the ranks first agree on the generation.
  /// @throws io_error (no checkpoint, ranks see different ones), corrupt_data (another
  /// world size or layout, checksum)
  void load_checkpoint(const std::string& dir, stream_t stream = nullptr);

  /// Registers both flat buffers (ncclCommRegister) unless registered.  Call after the
  /// buffers' physical memory is back (resume).  Returns true when registered.
  bool register_buffers();
  /// Deregisters them: call before the buffers' physical memory is released (pause), so
  /// that no peer keeps a mapping of released memory.  Idempotent.
  void deregister_buffers();
  bool buffers_registered() const;

  std::uint64_t steps() const;
  optim::streamed_adamw& optimizer();
  communicator& comm();

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace deferalloc::dist
