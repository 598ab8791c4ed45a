// CUDA kernels of the optimizer: the fused AdamW step (BF16 / FP16 / FP32 model
// parameters and gradients), the upcast of the initializer and the downcast of a
// checkpoint load, and a deterministic sum of squares for gradient clipping.
//
// Memory-bound by design (28 bytes per parameter for the step with BF16 parameters and gradients: FP32 p, m,
// v read and written, the gradient read, the model parameter written), so the kernels
// move 16-byte vectors when every pointer allows it and fall back to scalars
// otherwise.  The arithmetic is adamw_math.hpp's, with explicit rounding, so the
// results equal the CPU twin's bit for bit.
#include <cuda_runtime.h>
#include <deferalloc/core/errors.hpp>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "compute.hpp"

namespace deferalloc::optim::detail {
namespace {

#define DFA_CUDA_TRY(call)                                                                  \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) throw cuda_error(std::string(#call) + ": " + cudaGetErrorString(e_)); \
  } while (0)
// After every launch: a bad configuration is reported here, a fault at the next sync.
#define DFA_CUDA_CHECK_LAUNCH() DFA_CUDA_TRY(cudaGetLastError())

constexpr int k_threads = 256;

// Four gradient values (BF16 / FP16: one 8-byte load; FP32: one 16-byte load).
template <value_type GradT>
__device__ __forceinline__ void load_grad4(const void* g, std::size_t i, float out[4]) {
  if constexpr (GradT == value_type::fp32) {
    const float4 raw = __ldcs(reinterpret_cast<const float4*>(g) + i);
    out[0] = raw.x, out[1] = raw.y, out[2] = raw.z, out[3] = raw.w;
  } else {
    const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(g) + i);
    const std::uint16_t h[4] = {static_cast<std::uint16_t>(raw.x & 0xFFFF), static_cast<std::uint16_t>(raw.x >> 16),
                                static_cast<std::uint16_t>(raw.y & 0xFFFF), static_cast<std::uint16_t>(raw.y >> 16)};
    for (int j = 0; j < 4; ++j) out[j] = GradT == value_type::bf16 ? from_bf16(h[j]) : from_fp16(h[j]);
  }
}
// Four model values (BF16 / FP16: one 8-byte store; FP32: one 16-byte store).
template <value_type ModelT>
__device__ __forceinline__ void store_model4(void* out, std::size_t i, const float4& p) {
  if constexpr (ModelT == value_type::fp32) {
    __stcs(reinterpret_cast<float4*>(out) + i, p);
  } else {
    auto cv = [](float x) -> std::uint32_t { return ModelT == value_type::bf16 ? to_bf16(x) : to_fp16(x); };
    __stcs(reinterpret_cast<uint2*>(out) + i, make_uint2(cv(p.x) | (cv(p.y) << 16), cv(p.z) | (cv(p.w) << 16)));
  }
}

template <value_type ModelT, value_type GradT>
__global__ void adamw_vec4(adamw_piece p, adamw_scalars k) {
  const std::size_t n4 = p.n / 4;
  auto* P = reinterpret_cast<float4*>(p.param);
  auto* M = reinterpret_cast<float4*>(p.exp_avg);
  auto* V = reinterpret_cast<float4*>(p.exp_avg_sq);
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n4; i += std::size_t(gridDim.x) * blockDim.x) {
    float4 pv = __ldcs(P + i), mv = __ldcs(M + i), vv = __ldcs(V + i);
    float g[4];
    load_grad4<GradT>(p.grad, i, g);
    adamw_update(pv.x, mv.x, vv.x, g[0], k);
    adamw_update(pv.y, mv.y, vv.y, g[1], k);
    adamw_update(pv.z, mv.z, vv.z, g[2], k);
    adamw_update(pv.w, mv.w, vv.w, g[3], k);
    __stcs(P + i, pv);
    __stcs(M + i, mv);
    __stcs(V + i, vv);
    store_model4<ModelT>(p.model, i, pv);
  }
  // The last n % 4 elements.
  if (blockIdx.x == 0 && threadIdx.x < p.n % 4) {
    const std::size_t j = n4 * 4 + threadIdx.x;
    adamw_update(p.param[j], p.exp_avg[j], p.exp_avg_sq[j], load_as_float(p.grad, GradT, j), k);
    store_from_float(p.model, ModelT, j, p.param[j]);
  }
}

__global__ void adamw_scalar(adamw_piece p, adamw_scalars k) {
  for (std::size_t j = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; j < p.n; j += std::size_t(gridDim.x) * blockDim.x) {
    adamw_update(p.param[j], p.exp_avg[j], p.exp_avg_sq[j], load_as_float(p.grad, p.grad_type, j), k);
    store_from_float(p.model, p.model_type, j, p.param[j]);
  }
}

// The vector kernel for a (model, gradient) type pair.
template <value_type ModelT>
void (*vec_kernel_for(value_type grad_t))(adamw_piece, adamw_scalars) {
  if (grad_t == value_type::bf16) return adamw_vec4<ModelT, value_type::bf16>;
  if (grad_t == value_type::fp16) return adamw_vec4<ModelT, value_type::fp16>;
  return adamw_vec4<ModelT, value_type::fp32>;
}

// BF16 -> FP32, four values per thread (an 8-byte load, a 16-byte store) when both
// pointers allow it: a warp's stores then cover one contiguous 512-byte span.  (Eight
// values per thread, with two 16-byte stores 32 bytes apart, ran the one-shot
// initializer at 0.63x of a D2D copy on H200: half-filled sectors per store.)
template <bool Vec>
__global__ void upcast_kernel(const std::uint16_t* in, float* out, std::size_t n) {
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  std::size_t j = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  if constexpr (Vec) {
    for (; j < n / 4; j += stride) {
      const uint2 r = __ldcs(reinterpret_cast<const uint2*>(in) + j);
      __stcs(reinterpret_cast<float4*>(out) + j,
             make_float4(from_bf16(r.x & 0xFFFF), from_bf16(r.x >> 16), from_bf16(r.y & 0xFFFF), from_bf16(r.y >> 16)));
    }
    if (blockIdx.x == 0 && threadIdx.x < n % 4) out[n / 4 * 4 + threadIdx.x] = from_bf16(in[n / 4 * 4 + threadIdx.x]);
  } else {
    for (; j < n; j += stride) out[j] = from_bf16(in[j]);
  }
}

// FP32 -> BF16, eight values per thread (two 16-byte loads, one 16-byte store).
__device__ __forceinline__ std::uint32_t pack_bf16(float a, float b) {
  return to_bf16(a) | (std::uint32_t(to_bf16(b)) << 16);
}

template <bool Vec>
__global__ void downcast_kernel(const float* in, std::uint16_t* out, std::size_t n) {
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  std::size_t j = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  if constexpr (Vec) {
    for (; j < n / 8; j += stride) {
      const float4 a = __ldcs(reinterpret_cast<const float4*>(in) + 2 * j);
      const float4 b = __ldcs(reinterpret_cast<const float4*>(in) + 2 * j + 1);
      __stcs(reinterpret_cast<uint4*>(out) + j,
             make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y), pack_bf16(b.z, b.w)));
    }
    if (blockIdx.x == 0 && threadIdx.x < n % 8) out[n / 8 * 8 + threadIdx.x] = to_bf16(in[n / 8 * 8 + threadIdx.x]);
  } else {
    for (; j < n; j += stride) out[j] = to_bf16(in[j]);
  }
}

// FP16 / FP32 model parameters (not on the BF16 fast path): one value per thread.
__global__ void upcast_any(const void* in, value_type t, float* out, std::size_t n) {
  for (std::size_t j = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; j < n; j += std::size_t(gridDim.x) * blockDim.x)
    out[j] = load_as_float(in, t, j);
}
__global__ void downcast_any(const float* in, void* out, value_type t, std::size_t n) {
  for (std::size_t j = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; j < n; j += std::size_t(gridDim.x) * blockDim.x)
    store_from_float(out, t, j, in[j]);
}

constexpr int k_norm_blocks = 1024;

// Pass 1: one partial sum per block, each over a fixed set of elements (grid-stride
// with a fixed grid), reduced in a fixed tree order: the result does not depend on
// timing.
__global__ void sq_norm_partial(const void* g, bool bf16, std::size_t n, double* partial) {
  __shared__ double sh[k_threads];
  double s = 0;
  for (std::size_t j = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; j < n; j += std::size_t(gridDim.x) * blockDim.x) {
    const double x = load_grad(g, bf16, j);
    s += x * x;
  }
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int w = k_threads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}
__global__ void sq_norm_final(const double* partial, double* out) {
  __shared__ double sh[k_norm_blocks];
  for (int i = threadIdx.x; i < k_norm_blocks; i += blockDim.x) sh[i] = partial[i];
  __syncthreads();
  for (int w = k_norm_blocks / 2; w > 0; w /= 2) {
    for (int i = threadIdx.x; i < w; i += blockDim.x) sh[i] += sh[i + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = sh[0];
}

// powf(base, first + i) for i < n: the device's powf (libdevice), as torch's fused AdamW
// evaluates its bias corrections.
__global__ void pow_table(float base, std::uint64_t first, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = powf(base, static_cast<float>(first + i));
}

__global__ void pow_any(float base, float e, float* out) { *out = powf(base, e); }

// Note [Edits of 16-bit parameters]: out += the edit terms of n 16-bit values (a warp's
// sum, then one atomic add per warp; the sum wraps, so the order does not matter).  Eight
// values per 16-byte load where `p` is aligned to it, the tail one by one.
__global__ void edit_hash(const std::uint16_t* p, std::size_t n, unsigned long long* out) {
  unsigned long long h = 0;
  const std::size_t first = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  const std::size_t n8 = reinterpret_cast<std::uintptr_t>(p) % 16 == 0 ? n / 8 : 0;
  for (std::size_t v = first; v < n8; v += stride) {
    const uint4 q = reinterpret_cast<const uint4*>(p)[v];
    const std::uint32_t words[4] = {q.x, q.y, q.z, q.w};
    for (int k = 0; k < 4; ++k) {  // little-endian: element 2k is the word's low half
      h += edit_term(static_cast<std::uint16_t>(words[k] & 0xFFFFu), 8 * v + 2 * k);
      h += edit_term(static_cast<std::uint16_t>(words[k] >> 16), 8 * v + 2 * k + 1);
    }
  }
  for (std::size_t j = 8 * n8 + first; j < n; j += stride) h += edit_term(p[j], j);
  for (int o = 16; o > 0; o /= 2) h += __shfl_down_sync(0xffffffffu, h, o);
  if (threadIdx.x % 32 == 0) atomicAdd(out, h);
}
// out[i] = in[i] for i < n: the edit slots into mapped pinned memory (read_edit_slots).
__global__ void slots_to_host(const unsigned long long* in, unsigned long long* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x)
    out[i] = in[i];
}

// When slots[k_written] != slots[k_now]: main = float(param) where param is not main's
// rounding, and slots[k_edited] = 1 when an element was taken.
__global__ void adopt_edit(const void* param, value_type t, float* main, std::size_t n, unsigned long long* slots) {
  if (slots[compute::k_written] == slots[compute::k_now]) return;
  bool took = false;
  for (std::size_t j = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; j < n; j += std::size_t(gridDim.x) * blockDim.x)
    if (!is_rounding_of(main[j], param, t, j)) {
      main[j] = load_as_float(param, t, j);
      took = true;
    }
  if (took) slots[compute::k_edited] = 1;
}

bool aligned(const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

class cuda_compute final : public compute {
 public:
  explicit cuda_compute(int device) : device_(device) {
    DFA_CUDA_TRY(cudaSetDevice(device_));
    DFA_CUDA_TRY(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device_));
  }
  ~cuda_compute() override {
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (pow_dev_ != nullptr) cudaFree(pow_dev_);
    if (edit_dev_ != nullptr) cudaFree(edit_dev_);
    if (edit_host_ != nullptr) cudaFreeHost(edit_host_);
  }

  // The device's powf for integral steps, from a table per (base, block of k_pow_block
  // steps) filled by one kernel and one synchronous copy on a miss: a step costs a lookup.
  float pow(float base, float e) override {
    const auto t = static_cast<std::uint64_t>(e);
    if (e < 1.0f || static_cast<float>(t) != e) return device_pow(base, e);
    std::uint32_t bits;
    std::memcpy(&bits, &base, sizeof bits);
    const std::uint64_t block = (t - 1) / k_pow_block;
    const std::lock_guard<std::mutex> lock(pow_mu_);
    auto& table = pow_cache_[{bits, block}];
    if (table.empty()) {
      table.resize(k_pow_block);
      fill_pow(base, block * k_pow_block + 1, table.data(), k_pow_block);
    }
    return table[(t - 1) % k_pow_block];
  }

  void adamw(const adamw_piece& p, const adamw_scalars& k, stream_t s) override {
    if (p.n == 0) return;
    DFA_CUDA_TRY(cudaSetDevice(device_));
    auto st = static_cast<cudaStream_t>(s.get());
    const bool vec = aligned(p.param, 16) && aligned(p.exp_avg, 16) && aligned(p.exp_avg_sq, 16) &&
                     aligned(p.model, p.model_type == value_type::fp32 ? 16 : 8) &&
                     aligned(p.grad, p.grad_type == value_type::fp32 ? 16 : 8);
    const int blocks = grid(vec ? p.n / 4 + 1 : p.n);
    if (!vec) adamw_scalar<<<blocks, k_threads, 0, st>>>(p, k);
    else {
      auto* kern = p.model_type == value_type::bf16   ? vec_kernel_for<value_type::bf16>(p.grad_type)
                   : p.model_type == value_type::fp16 ? vec_kernel_for<value_type::fp16>(p.grad_type)
                                                      : vec_kernel_for<value_type::fp32>(p.grad_type);
      kern<<<blocks, k_threads, 0, st>>>(p, k);
    }
    DFA_CUDA_CHECK_LAUNCH();
  }

  void adamw_moments(const adamw_qpiece& p, const adamw_scalars& k, stream_t s) override {
    cuda_adamw_moments(p, k, s.get(), device_, sms_);
  }

  void upcast(const void* in, value_type t, float* out, std::size_t n, stream_t s) override {
    if (t == value_type::bf16) {
      auto* b = static_cast<const std::uint16_t*>(in);
      launch_cast(upcast_kernel<true>, upcast_kernel<false>, aligned(in, 8) && aligned(out, 16), 4, b, out, n, s);
      return;
    }
    if (n == 0) return;
    DFA_CUDA_TRY(cudaSetDevice(device_));
    upcast_any<<<grid(n), k_threads, 0, static_cast<cudaStream_t>(s.get())>>>(in, t, out, n);
    DFA_CUDA_CHECK_LAUNCH();
  }

  void downcast(const float* in, void* out, value_type t, std::size_t n, stream_t s) override {
    if (t == value_type::bf16) {
      auto* b = static_cast<std::uint16_t*>(out);
      launch_cast(downcast_kernel<true>, downcast_kernel<false>, aligned(in, 16) && aligned(out, 16), 8, in, b, n, s);
      return;
    }
    if (n == 0) return;
    DFA_CUDA_TRY(cudaSetDevice(device_));
    downcast_any<<<grid(n), k_threads, 0, static_cast<cudaStream_t>(s.get())>>>(in, out, t, n);
    DFA_CUDA_CHECK_LAUNCH();
  }

  double sq_norm(const void* grad, bool is_bf16, std::size_t n, stream_t s) override {
    DFA_CUDA_TRY(cudaSetDevice(device_));
    if (scratch_ == nullptr) DFA_CUDA_TRY(cudaMalloc(&scratch_, (k_norm_blocks + 1) * sizeof(double)));
    auto st = static_cast<cudaStream_t>(s.get());
    sq_norm_partial<<<k_norm_blocks, k_threads, 0, st>>>(grad, is_bf16, n, scratch_);
    DFA_CUDA_CHECK_LAUNCH();
    sq_norm_final<<<1, 1024, 0, st>>>(scratch_, scratch_ + k_norm_blocks);
    DFA_CUDA_CHECK_LAUNCH();
    double out = 0;
    DFA_CUDA_TRY(cudaMemcpyAsync(&out, scratch_ + k_norm_blocks, sizeof(double), cudaMemcpyDeviceToHost, st));
    DFA_CUDA_TRY(cudaStreamSynchronize(st));
    return out;
  }

  void edit_slots(std::size_t shards) override {
    DFA_CUDA_TRY(cudaSetDevice(device_));
    if (edit_dev_ != nullptr) DFA_CUDA_TRY(cudaFree(edit_dev_));
    if (edit_host_ != nullptr) DFA_CUDA_TRY(cudaFreeHost(edit_host_));
    edit_dev_ = edit_host_ = edit_host_dev_ = nullptr;
    edit_count_ = shards * k_edit_slots;
    if (edit_count_ == 0) return;
    DFA_CUDA_TRY(cudaMalloc(&edit_dev_, edit_count_ * sizeof(unsigned long long)));
    DFA_CUDA_TRY(cudaMemset(edit_dev_, 0, edit_count_ * sizeof(unsigned long long)));
    DFA_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&edit_host_), edit_count_ * sizeof(unsigned long long),
                               cudaHostAllocMapped | cudaHostAllocPortable));
    DFA_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&edit_host_dev_), edit_host_, 0));
  }
  void hash_param(std::size_t s, int which, const void* param, std::size_t n, stream_t st) override {
    DFA_CUDA_TRY(cudaSetDevice(device_));
    auto cs = static_cast<cudaStream_t>(st.get());
    unsigned long long* out = edit_dev_ + s * k_edit_slots + which;
    static_assert(k_edited == k_now + 1);  // k_now zeroes both
    DFA_CUDA_TRY(cudaMemsetAsync(out, 0, (which == k_now ? 2 : 1) * sizeof *out, cs));
    if (n == 0) return;
    edit_hash<<<grid(n / 8 + 1), k_threads, 0, cs>>>(static_cast<const std::uint16_t*>(param), n, out);
    DFA_CUDA_CHECK_LAUNCH();
  }
  void adopt_if_edited(std::size_t s, const void* param, value_type t, float* main, std::size_t n, stream_t st) override {
    DFA_CUDA_TRY(cudaSetDevice(device_));
    adopt_edit<<<grid(n == 0 ? 1 : n), k_threads, 0, static_cast<cudaStream_t>(st.get())>>>(param, t, main, n,
                                                                                           edit_dev_ + s * k_edit_slots);
    DFA_CUDA_CHECK_LAUNCH();
  }
  std::vector<std::uint64_t> read_edit_slots(stream_t st) override {
    DFA_CUDA_TRY(cudaSetDevice(device_));
    std::vector<std::uint64_t> out(edit_count_);
    auto cs = static_cast<cudaStream_t>(st.get());
    // A kernel writes them to mapped pinned memory: a D2H copy would queue on the copy
    // engine behind the pass's write-backs (Note [Edits of 16-bit parameters]).
    if (!out.empty()) {
      slots_to_host<<<grid(out.size()), k_threads, 0, cs>>>(edit_dev_, edit_host_dev_, out.size());
      DFA_CUDA_CHECK_LAUNCH();
    }
    DFA_CUDA_TRY(cudaStreamSynchronize(cs));
    std::copy(edit_host_, edit_host_ + out.size(), out.begin());
    return out;
  }

 private:
  static constexpr int k_pow_block = 4096;
  float device_pow(float base, float e) {
    const std::lock_guard<std::mutex> lock(pow_mu_);
    float out = 0;
    fill_pow(base, 0, &out, 1, e);
    return out;
  }
  // out[i] = device powf(base, first + i) for i < n (or powf(base, e) when n == 1 and e is
  // given); on the legacy default stream, synchronously.  Caller holds pow_mu_.
  void fill_pow(float base, std::uint64_t first, float* out, int n, float e = -1.0f) {
    DFA_CUDA_TRY(cudaSetDevice(device_));
    if (pow_dev_ == nullptr) DFA_CUDA_TRY(cudaMalloc(&pow_dev_, k_pow_block * sizeof(float)));
    if (e >= 0.0f || first == 0) pow_any<<<1, 1>>>(base, e, pow_dev_);
    else pow_table<<<(n + k_threads - 1) / k_threads, k_threads>>>(base, first, pow_dev_, n);
    DFA_CUDA_CHECK_LAUNCH();
    DFA_CUDA_TRY(cudaMemcpy(out, pow_dev_, n * sizeof(float), cudaMemcpyDeviceToHost));
  }
  // A cast kernel's vector instantiation (`per_thread` values per thread) when `vec`, else
  // its scalar one.
  template <typename In, typename Out>
  void launch_cast(void (*vec_kernel)(const In*, Out*, std::size_t), void (*scalar_kernel)(const In*, Out*, std::size_t),
                   bool vec, std::size_t per_thread, const In* in, Out* out, std::size_t n, stream_t s) {
    if (n == 0) return;
    DFA_CUDA_TRY(cudaSetDevice(device_));
    const int blocks = grid(vec ? n / per_thread + 1 : n);
    (vec ? vec_kernel : scalar_kernel)<<<blocks, k_threads, 0, static_cast<cudaStream_t>(s.get())>>>(in, out, n);
    DFA_CUDA_CHECK_LAUNCH();
  }
  // Enough blocks for `work` items, at most 16 per multiprocessor (grid-stride beyond).
  int grid(std::size_t work) const {
    return static_cast<int>(std::min<std::size_t>((work + k_threads - 1) / k_threads, std::size_t(sms_) * 16));
  }
  int device_;
  int sms_ = 0;
  double* scratch_ = nullptr;
  struct pow_key {
    std::uint32_t bits;
    std::uint64_t block;
    bool operator==(const pow_key& o) const { return bits == o.bits && block == o.block; }
  };
  struct pow_key_hash {
    std::size_t operator()(const pow_key& k) const { return std::hash<std::uint64_t>{}(k.block * 0x9E3779B97F4A7C15ull ^ k.bits); }
  };
  std::mutex pow_mu_;
  std::unordered_map<pow_key, std::vector<float>, pow_key_hash> pow_cache_;
  float* pow_dev_ = nullptr;
  unsigned long long* edit_dev_ = nullptr;  // Note [Edits of 16-bit parameters]
  unsigned long long* edit_host_ = nullptr;      // mapped pinned memory: read_edit_slots's
  unsigned long long* edit_host_dev_ = nullptr;  // (its device address)
  std::size_t edit_count_ = 0;
};

}  // namespace

std::unique_ptr<compute> make_cuda_compute(int device) { return std::make_unique<cuda_compute>(device); }

}  // namespace deferalloc::optim::detail
