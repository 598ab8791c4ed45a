// CHECK for the probe programs without GoogleTest (those run under LD_PRELOAD): prints the
// failed condition and returns 1 from the enclosing function.
#pragma once

#include <cstdio>

#define CHECK(cond)                                                 \
  do {                                                              \
    if (!(cond)) {                                                  \
      std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);  \
      return 1;                                                     \
    }                                                               \
  } while (0)
