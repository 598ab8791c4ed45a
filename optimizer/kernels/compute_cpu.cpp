// The CPU twin of the optimizer kernels (host driver): the same per-element arithmetic
// as the CUDA kernel (adamw_math.hpp), so CI exercises the whole optimizer and the
// GPU results can be checked against it bit for bit.
#include <deferalloc/core/errors.hpp>

#include <deferalloc/optim/optimizer.hpp>

#include "compute.hpp"

namespace deferalloc::optim::detail {
namespace {

class cpu_compute final : public compute {
 public:
  void adamw(const adamw_piece& p, const adamw_scalars& k, stream_t) override {
    for (std::size_t i = 0; i < p.n; ++i) {
      adamw_update(p.param[i], p.exp_avg[i], p.exp_avg_sq[i], load_as_float(p.grad, p.grad_type, i), k);
      store_from_float(p.model, p.model_type, i, p.param[i]);
    }
  }
  void adamw_moments(const adamw_qpiece& p, const adamw_scalars& k, stream_t) override { cpu_adamw_moments(p, k); }
  void upcast(const void* in, value_type t, float* out, std::size_t n, stream_t) override {
    for (std::size_t i = 0; i < n; ++i) out[i] = load_as_float(in, t, i);
  }
  void downcast(const float* in, void* out, value_type t, std::size_t n, stream_t) override {
    for (std::size_t i = 0; i < n; ++i) store_from_float(out, t, i, in[i]);
  }
  double sq_norm(const void* grad, bool is_bf16, std::size_t n, stream_t) override {
    double s = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double g = load_grad(grad, is_bf16, i);
      s += g * g;
    }
    return s;
  }
  void edit_slots(std::size_t shards) override { slots_.assign(shards * k_edit_slots, 0); }
  void hash_param(std::size_t s, int which, const void* param, std::size_t n, stream_t) override {
    std::uint64_t h = 0;
    for (std::size_t i = 0; i < n; ++i) h += edit_term(static_cast<const std::uint16_t*>(param)[i], i);
    slots_[s * k_edit_slots + which] = h;
    if (which == k_now) slots_[s * k_edit_slots + k_edited] = 0;
  }
  void adopt_if_edited(std::size_t s, const void* param, value_type t, float* main, std::size_t n, stream_t) override {
    std::uint64_t* h = slots_.data() + s * k_edit_slots;
    if (h[k_written] == h[k_now]) return;
    for (std::size_t i = 0; i < n; ++i)
      if (!is_rounding_of(main[i], param, t, i)) {
        main[i] = load_as_float(param, t, i);
        h[k_edited] = 1;
      }
  }
  std::vector<std::uint64_t> read_edit_slots(stream_t) override { return slots_; }

 private:
  std::vector<std::uint64_t> slots_;
};

}  // namespace

std::unique_ptr<compute> make_cpu_compute() { return std::make_unique<cpu_compute>(); }

std::unique_ptr<compute> make_compute(driver& d) {
  if (d.asynchronous()) return make_cuda_compute(d.device());
  return make_cpu_compute();
}

}  // namespace deferalloc::optim::detail

namespace deferalloc::optim {
float backend_pow(driver& d, float base, float e) { return detail::make_compute(d)->pow(base, e); }
}  // namespace deferalloc::optim
