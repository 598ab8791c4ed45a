// The compute backend of the optimizer: the CUDA kernels on the CUDA driver, their CPU
// twin (same arithmetic, adamw_math.hpp) on the host driver.
#pragma once
#include <deferalloc/core/driver.hpp>

#include <memory>
#include <vector>

#include "adamw_math.hpp"
#include "moment_format.hpp"

namespace deferalloc::optim::detail {

class compute {
 public:
  virtual ~compute() = default;
  /// AdamW over one piece, on `s`.
  virtual void adamw(const adamw_piece& p, const adamw_scalars& k, stream_t s) = 0;
  /// AdamW over one piece with compressed moments (Note [Moment formats]), on `s`.
  virtual void adamw_moments(const adamw_qpiece& p, const adamw_scalars& k, stream_t s) = 0;
  /// out[i] = float(in[i]) for n values of type `t`, on `s`.
  virtual void upcast(const void* in, value_type t, float* out, std::size_t n, stream_t s) = 0;
  /// out[i] = in[i] as type `t` (round to nearest even), on `s`.
  virtual void downcast(const float* in, void* out, value_type t, std::size_t n, stream_t s) = 0;
  /// Sum of squares of n gradient values, in a fixed order; waits for `s`.
  virtual double sq_norm(const void* grad, bool is_bf16, std::size_t n, stream_t s) = 0;
  /// Note [Edits of 16-bit parameters] (optimizer/streamed_adamw.cpp): the backend keeps
  /// k_edit_slots 64-bit values per shard on the device.  edit_slots(n) sizes them for n
  /// shards (zero); hash_param sets slot `which` of shard `s` to the edit hash of n 16-bit
  /// values at `param` (the wrapping sum of edit_term), on `st`; k_now also zeroes k_edited.
  virtual void edit_slots(std::size_t shards) = 0;
  virtual void hash_param(std::size_t s, int which, const void* param, std::size_t n, stream_t st) = 0;
  /// When shard s's slots k_written and k_now differ: main[i] = float(param[i]) for each
  /// of n values of type t where param[i] is not main[i]'s rounding, and slot k_edited = 1
  /// when one was; on `st`.
  virtual void adopt_if_edited(std::size_t s, const void* param, value_type t, float* main, std::size_t n,
                               stream_t st) = 0;
  /// Every shard's slots (k_edit_slots per shard, in shard order), after the work on `st`.
  virtual std::vector<std::uint64_t> read_edit_slots(stream_t st) = 0;
  static constexpr int k_written = 0, k_now = 1, k_edited = 2, k_edit_slots = 3;
  /// powf(base, e) as this backend's kernels compute it: the bias corrections of a step
  /// (Note [Torch's fused AdamW, bit for bit]).  The CPU twin uses the host's powf.
  virtual float pow(float base, float e) { return std::pow(base, e); }
};

std::unique_ptr<compute> make_cpu_compute();
/// @throws no_device when the library was built without the CUDA kernels.
std::unique_ptr<compute> make_cuda_compute(int device);
/// CUDA kernels when the driver is asynchronous (CUDA), the CPU twin otherwise.
std::unique_ptr<compute> make_compute(driver& d);

}  // namespace deferalloc::optim::detail
