// GoogleTest main for the suites parameterised over drivers: with DFA_TEST_DRIVER=cuda
// on a machine without a usable device it prints why and exits 77, which ctest shows
// as "Skipped" (SKIP_RETURN_CODE), never as passed.
#include <deferalloc/core/driver.hpp>
#include <gtest/gtest.h>

#include <cstdio>

#include "common.hpp"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (dfa_test::driver_name() == "cuda" && !deferalloc::cuda_device_available()) {
    try {
      deferalloc::make_cuda_driver(0);
    } catch (const std::exception& e) {
      std::printf("SKIPPED: the CUDA suite needs a GPU: %s\n", e.what());
    }
    return 77;
  }
  std::printf("driver under test: %s\n", dfa_test::driver_name().c_str());
  return RUN_ALL_TESTS();
}
