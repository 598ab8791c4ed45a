// LibTorch face on the GPU (labels torch, gpu; exit 77 = Skipped without one):
//  - a deferred tensor keeps data_ptr() and its TensorImpl across 100 materialize/release
//    cycles, and uses zero bytes of HBM (cudaMemGetInfo) while released;
//  - a CUDA graph captured over a deferred tensor replays correctly after a
//    release(keep=host)/materialize(restore) cycle;
//  - install() after PyTorch's allocator was initialized fails with a clear message.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <deferalloc/core/errors.hpp>
#include <deferalloc/deferalloc.h>
#include <deferalloc/torch/torch.hpp>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>

using namespace deferalloc;

namespace {
std::size_t free_hbm() {
  size_t f = 0, t = 0;
  const cudaError_t e = cudaMemGetInfo(&f, &t);
  EXPECT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
  return f;
}
void device_sync() {
  const cudaError_t e = cudaDeviceSynchronize();
  ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
}
const auto cuda_f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
}  // namespace

TEST(torch_gpu, deferred_tensor_100_cycles_stable_and_zero_hbm_while_released) {
  constexpr int64_t n = 256ll << 20;  // 1 GiB of float
  {  // warm-up: kernels loaded, context allocations made, before measuring
    at::Tensor w = deferalloc::torch::deferred_empty({4 << 20}, cuda_f32);
    deferalloc::torch::materialize(w, fill_mode::zero);
    w.fill_(1.0f);
    w.sum().item<float>();
  }
  device_sync();
  ASSERT_EQ(dfa_trim(0, nullptr), DFA_SUCCESS);
  const std::size_t free0 = free_hbm();
  at::Tensor t = deferalloc::torch::deferred_empty({n}, cuda_f32);
  const void* ptr = t.data_ptr();
  const auto* impl = t.unsafeGetTensorImpl();
  EXPECT_EQ(free_hbm(), free0) << "reserving used HBM";
  std::size_t free_released = 0;
  for (int i = 0; i < 100; ++i) {
    deferalloc::torch::materialize(t, i == 0 ? fill_mode::zero : fill_mode::restore);
    if (i == 0) EXPECT_EQ(free0 - free_hbm(), static_cast<std::size_t>(n) * 4) << "materialize backs exactly the tensor";
    if (i > 0) ASSERT_EQ(t[n - 1].item<float>(), static_cast<float>(i - 1)) << "restore lost the contents, cycle " << i;
    t.fill_(static_cast<float>(i));
    deferalloc::torch::release(t, keep_mode::host);
    ASSERT_EQ(dfa_trim(0, nullptr), DFA_SUCCESS);
    if (i == 0) {
      // The first release pins a 1 GiB host backup, which the driver maps into the GPU's
      // address space: its page tables take HBM once (2 MiB per GiB of 4 KiB host pages,
      // seen on the H200), for as long as the pinned buffer is cached.  The tensor's own
      // bytes must take none, in every cycle.
      free_released = free_hbm();
      EXPECT_LE(free0 - free_released, static_cast<std::size_t>(n) * 4 / 256) << "more than page tables held";
    }
    ASSERT_EQ(free_hbm(), free_released) << "HBM used while released, cycle " << i;
    ASSERT_EQ(t.data_ptr(), ptr);
    ASSERT_EQ(t.unsafeGetTensorImpl(), impl);
  }
  std::printf("deferred tensor: 100 cycles of 1 GiB, data_ptr and TensorImpl unchanged, 0 bytes of HBM while released\n");
}

TEST(torch_gpu, cuda_graph_replays_after_release_and_restore) {
  constexpr int64_t n = 8ll << 20;
  at::Tensor x = deferalloc::torch::deferred_empty({n}, cuda_f32);
  deferalloc::torch::materialize(x, fill_mode::zero);
  at::manual_seed(3);
  x.copy_(at::randn({n}, cuda_f32));
  at::Tensor out = at::empty({n}, cuda_f32);
  device_sync();
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard guard(at::cuda::getStreamFromPool());
    graph.capture_begin();
    out.copy_(x * 2 + 1);
    graph.capture_end();
  }
  const at::Tensor before = x.clone();
  out.fill_(-7.0f);
  graph.replay();
  device_sync();
  ASSERT_TRUE(at::equal(out, before * 2 + 1));
  deferalloc::torch::release(x, keep_mode::host);
  ASSERT_FALSE(deferalloc::torch::is_backed(x));
  deferalloc::torch::materialize(x, fill_mode::restore);
  ASSERT_TRUE(at::equal(x, before)) << "restore changed the contents";
  out.fill_(-7.0f);
  x.add_(1.0f);
  graph.replay();
  device_sync();
  EXPECT_TRUE(at::equal(out, (before + 1) * 2 + 1)) << "the graph did not read the restored tensor at its address";
  std::printf("CUDA graph over a deferred tensor replayed correctly after release/materialize(restore)\n");
}

TEST(torch_gpu, install_after_initialization_fails_with_a_clear_message) {
  at::Tensor t = at::ones({16}, cuda_f32);  // PyTorch's allocator is now initialized
  try {
    deferalloc::torch::install();
    FAIL() << "install() after initialization must fail";
  } catch (const invalid_state& e) {
    EXPECT_NE(std::string(e.what()).find("already initialized"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("first thing in main()"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(deferalloc::torch::installed());
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!::torch::cuda::is_available()) {
    std::printf("SKIPPED: needs a GPU\n");
    return 77;
  }
  return RUN_ALL_TESTS();
}
