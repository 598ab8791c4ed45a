// deferalloc::torch from an installed tree: a deferred tensor (CPU on the host driver,
// from DEFERALLOC_CONF) keeps its address and contents through release and restore.
#include <deferalloc/torch/torch.hpp>

#include <cstdio>

int main() {
  at::Tensor t = deferalloc::torch::deferred_empty({1 << 20}, at::TensorOptions().dtype(at::kFloat));
  const void* address = t.data_ptr();
  deferalloc::torch::materialize(t, deferalloc::fill_mode::zero);
  t.fill_(3.0f);
  deferalloc::torch::release(t, deferalloc::keep_mode::host);
  const bool released = !deferalloc::torch::is_backed(t);
  deferalloc::torch::materialize(t, deferalloc::fill_mode::restore);
  const bool ok = released && t.data_ptr() == address && t.sum().item<double>() == 3.0 * (1 << 20);
  std::printf("consumer_torch: %s\n", ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
