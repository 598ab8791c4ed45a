// allocator/core/driver/no_toolkit's types and values against the toolkit's: the same
// enum values, struct sizes and field offsets (Note [Driver API without the toolkit]).
#include <cstddef>
#include <cuda.h>
#include <cuda_runtime_api.h>

#undef __cuda_cuda_h__
#undef __CUDA_RUNTIME_API_H__
#define DFA_NO_TOOLKIT_TYPES_ONLY  // the prototypes are prototypes.cpp's concern
namespace shim {
#include "core/driver/no_toolkit/cuda.h"
#include "core/driver/no_toolkit/cuda_runtime_api.h"
}  // namespace shim

#define DFA_SAME_VALUE(v) static_assert(static_cast<long long>(shim::v) == static_cast<long long>(v), #v);
DFA_SAME_VALUE(CUDA_SUCCESS)
DFA_SAME_VALUE(CUDA_ERROR_INVALID_VALUE)
DFA_SAME_VALUE(CUDA_ERROR_OUT_OF_MEMORY)
DFA_SAME_VALUE(CUDA_ERROR_NOT_READY)
DFA_SAME_VALUE(CUDA_ERROR_NOT_PERMITTED)
DFA_SAME_VALUE(CUDA_ERROR_NOT_SUPPORTED)
DFA_SAME_VALUE(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
DFA_SAME_VALUE(CU_MEM_HANDLE_TYPE_NONE)
DFA_SAME_VALUE(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
DFA_SAME_VALUE(CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
DFA_SAME_VALUE(CU_MEM_LOCATION_TYPE_DEVICE)
DFA_SAME_VALUE(CU_MEM_ALLOCATION_TYPE_PINNED)
DFA_SAME_VALUE(CU_MEM_ALLOC_GRANULARITY_MINIMUM)
DFA_SAME_VALUE(CU_GET_PROC_ADDRESS_DEFAULT)
DFA_SAME_VALUE(CU_GET_PROC_ADDRESS_SUCCESS)
DFA_SAME_VALUE(cudaSuccess)
DFA_SAME_VALUE(cudaErrorInvalidValue)
DFA_SAME_VALUE(cudaErrorMemoryAllocation)
DFA_SAME_VALUE(cudaErrorInitializationError)
DFA_SAME_VALUE(cudaErrorUnknown)
#undef DFA_SAME_VALUE
static_assert(CU_STREAM_NON_BLOCKING == 0x1 && CU_EVENT_DISABLE_TIMING == 0x2 && CU_MEMHOSTALLOC_PORTABLE == 0x1);

#define DFA_SAME_LAYOUT(T) static_assert(sizeof(shim::T) == sizeof(T) && alignof(shim::T) == alignof(T), #T);
DFA_SAME_LAYOUT(CUresult)
DFA_SAME_LAYOUT(CUdevice)
DFA_SAME_LAYOUT(CUdeviceptr)
DFA_SAME_LAYOUT(CUmemGenericAllocationHandle)
DFA_SAME_LAYOUT(cuuint64_t)
DFA_SAME_LAYOUT(CUmemLocation)
DFA_SAME_LAYOUT(CUmemAllocationProp)
DFA_SAME_LAYOUT(CUmemAccessDesc)
DFA_SAME_LAYOUT(cudaError_t)
#undef DFA_SAME_LAYOUT
#define DFA_SAME_OFFSET(T, f) static_assert(offsetof(shim::T, f) == offsetof(T, f), #T "." #f);
DFA_SAME_OFFSET(CUmemAllocationProp, type)
DFA_SAME_OFFSET(CUmemAllocationProp, requestedHandleTypes)
DFA_SAME_OFFSET(CUmemAllocationProp, location)
DFA_SAME_OFFSET(CUmemAllocationProp, win32HandleMetaData)
DFA_SAME_OFFSET(CUmemAllocationProp, allocFlags)
DFA_SAME_OFFSET(CUmemLocation, id)
DFA_SAME_OFFSET(CUmemAccessDesc, flags)
#undef DFA_SAME_OFFSET
