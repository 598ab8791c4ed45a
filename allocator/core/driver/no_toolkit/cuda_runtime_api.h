/* The part of the CUDA runtime API (cuda_runtime_api.h) that the LD_PRELOAD library
 * (allocator/abi/preload.cpp) uses, for a build without the CUDA toolkit: the error type
 * and the values it returns (Note [Driver API without the toolkit] in cuda.h beside this
 * file).  preload.cpp finds the real runtime's functions with dlsym(RTLD_NEXT). */
#pragma once
#include <stddef.h>

#ifndef __CUDA_RUNTIME_API_H__
typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorUnknown = 999
} cudaError_t;
#endif
