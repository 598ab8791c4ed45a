// Run under LD_PRELOAD=libdeferalloc_preload.so with DEFERALLOC_CONF=driver:host: the
// program's cudaMalloc/cudaFree (dynamically linked libcudart) must be served by
// deferalloc.  Without the preload the same calls fail on a machine without a GPU,
// and on one with a GPU the memory would not be a deferalloc reservation.
#include <cuda_runtime_api.h>
#include <deferalloc/deferalloc.h>

#include <cstdio>
#include <cstring>

#include "probe_check.hpp"

int main() {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, 5 << 20) == cudaSuccess);
  CHECK(p != nullptr);
  dfa_reservation r = 0;
  CHECK(dfa_find(p, &r) == DFA_SUCCESS);  // a deferalloc reservation
  int backed = 0;
  CHECK(dfa_is_backed(r, 0, DFA_WHOLE, &backed) == DFA_SUCCESS && backed == 1);
  std::memset(p, 0x3C, 5 << 20);  // the host driver's memory is host memory
  CHECK(cudaFree(static_cast<char*>(p) + 4096) == cudaErrorInvalidValue);  // interior pointer
  CHECK(cudaFree(p) == cudaSuccess);
  CHECK(dfa_find(p, &r) != DFA_SUCCESS);
  dfa_stats st{};
  CHECK(dfa_get_stats(&st) == DFA_SUCCESS && st.pool_cached_bytes >= (5u << 20));  // chunks back in the pool
  void* q = nullptr;
  CHECK(cudaMalloc(&q, 5 << 20) == cudaSuccess);
  CHECK(dfa_get_stats(&st) == DFA_SUCCESS && st.chunks_reused >= 1);  // served from the pool
  CHECK(cudaFree(q) == cudaSuccess);
  std::printf("preload_probe: cudaMalloc/cudaFree served by deferalloc (%llu chunks reused)\n",
              static_cast<unsigned long long>(st.chunks_reused));
  return 0;
}
