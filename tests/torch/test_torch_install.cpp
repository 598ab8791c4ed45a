// install() without a GPU (ctest label torch): the swap works once, and a second call
// is an invalid_state error that says so.  (After the native allocator was initialized
// it must fail too: tests/torch/test_torch_gpu.cpp checks that on the GPU.)
#include <deferalloc/core/errors.hpp>
#include <deferalloc/torch/torch.hpp>
#include <gtest/gtest.h>

TEST(torch_install, installs_once) {
  EXPECT_FALSE(deferalloc::torch::installed());
  ASSERT_NO_THROW(deferalloc::torch::install());
  EXPECT_TRUE(deferalloc::torch::installed());
  try {
    deferalloc::torch::install();
    FAIL() << "a second install must fail";
  } catch (const deferalloc::invalid_state& e) {
    EXPECT_NE(std::string(e.what()).find("already installed"), std::string::npos) << e.what();
  }
}
