// The LibTorch face on the host driver (CPU tensors, no GPU; ctest label torch):
// deferred tensors keep their data_ptr across cycles, restore their contents, free
// their reservation with the last reference, and reject bad input.
#include <deferalloc/core/errors.hpp>
#include <deferalloc/deferalloc.h>
#include <deferalloc/torch/torch.hpp>
#include <gtest/gtest.h>

using namespace deferalloc;

namespace {
std::size_t reservations() {
  dfa_stats s{};
  EXPECT_EQ(dfa_get_stats(&s), DFA_SUCCESS);
  return s.reservations;
}
}  // namespace

TEST(torch_face, deferred_tensor_cycles_keep_address_and_contents) {
  at::Tensor t = deferalloc::torch::deferred_empty({512, 1024}, at::TensorOptions().dtype(at::kFloat));
  const void* ptr = t.data_ptr();
  const auto* impl = t.unsafeGetTensorImpl();
  EXPECT_FALSE(deferalloc::torch::is_backed(t));
  deferalloc::torch::materialize(t, fill_mode::zero);
  EXPECT_TRUE(deferalloc::torch::is_backed(t));
  EXPECT_EQ(t.abs().sum().item<float>(), 0.0f);
  at::manual_seed(1);
  const at::Tensor ref = at::randn({512, 1024});
  for (int i = 0; i < 25; ++i) {
    t.copy_(ref);
    deferalloc::torch::release(t, keep_mode::host);
    ASSERT_FALSE(deferalloc::torch::is_backed(t));
    deferalloc::torch::materialize(t, fill_mode::restore);
    ASSERT_TRUE(at::equal(t, ref)) << "cycle " << i;
    deferalloc::torch::release(t, keep_mode::discard);
    deferalloc::torch::materialize(t, fill_mode::undefined);
    ASSERT_EQ(t.data_ptr(), ptr);
    ASSERT_EQ(t.unsafeGetTensorImpl(), impl);
  }
}

TEST(torch_face, last_reference_frees_the_reservation) {
  const std::size_t before = reservations();
  {
    at::Tensor t = deferalloc::torch::deferred_empty({1000}, at::TensorOptions().dtype(at::kDouble));
    at::Tensor view = t.view({10, 100});
    EXPECT_EQ(reservations(), before + 1);
    t.reset();
    EXPECT_EQ(reservations(), before + 1) << "a view still holds the storage";
  }
  EXPECT_EQ(reservations(), before);
}

TEST(torch_face, bad_input_is_a_typed_error) {
  EXPECT_THROW(deferalloc::torch::deferred_empty({4, -1}, at::TensorOptions()), invalid_argument);
  EXPECT_THROW(deferalloc::torch::deferred_empty({4}, at::TensorOptions().device(at::kCUDA)), invalid_argument)
      << "the host driver serves CPU tensors";
  EXPECT_THROW(deferalloc::torch::materialize(at::zeros({3})), invalid_argument) << "not a deferred tensor";
  EXPECT_THROW(deferalloc::torch::is_backed(at::Tensor()), invalid_argument);
  at::Tensor t = deferalloc::torch::deferred_empty({4}, at::TensorOptions());
  EXPECT_THROW(deferalloc::torch::materialize(t, fill_mode::restore), invalid_state) << "nothing to restore";
  EXPECT_FALSE(deferalloc::torch::is_backed(t));
}

TEST(torch_face, memory_stats_have_pytorch_keys) {
  auto m = deferalloc::torch::memory_stats();
  EXPECT_TRUE(m.count("allocated_bytes.all.current"));
  EXPECT_TRUE(m.count("reserved_bytes.all.peak"));
  EXPECT_TRUE(m.count("num_ooms"));
}
