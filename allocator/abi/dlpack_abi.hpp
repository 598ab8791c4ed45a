// DLPack's legacy (unversioned) structs, laid out exactly as in dlpack.h (v0.6 to v1.x),
// so the C ABI can build a DLManagedTensor without depending on a dlpack header.
#pragma once
#include <cstdint>

extern "C" {
typedef struct {
  int32_t device_type;  // DLDeviceType: kDLCPU = 1, kDLCUDA = 2
  int32_t device_id;
} DLDevice;
typedef struct {
  uint8_t code;  // kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6
  uint8_t bits;
  uint16_t lanes;
} DLDataType;
typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
} DLTensor;
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensor* self);
};
}

namespace deferalloc::detail {
inline constexpr int32_t k_dl_cpu = 1;
inline constexpr int32_t k_dl_cuda = 2;
}  // namespace deferalloc::detail
