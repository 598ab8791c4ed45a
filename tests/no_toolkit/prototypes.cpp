// allocator/core/driver/no_toolkit/cuda.h's prototypes, declared again after the toolkit's
// cuda.h: an extern "C" function declared twice with different types does not compile, so
// this file builds only while every prototype there is the toolkit's (cuda.h maps the
// names to the versioned entry points, cuMemGetInfo to cuMemGetInfo_v2, as cuda_driver.cpp
// sees them).  Built where the toolkit is found (tests/CMakeLists.txt).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "core/driver/no_toolkit/cuda.h"
#include "core/driver/no_toolkit/cuda_runtime_api.h"
