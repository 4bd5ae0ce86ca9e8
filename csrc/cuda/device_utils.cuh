// Device helpers shared by the .cu files, and the two macros that let the same sources run on the
// CPU emulator (csrc/emu/rheo_emu.h, tests only):
//   kernel RHEO_LAUNCH(grid, block, smem, stream)(args...);   kernel<<<grid, block, smem, stream>>>
//   RHEO_DYNAMIC_SHARED(type, name);                          extern __shared__ type name[]
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "rheo/common.h"

#ifndef RHEO_CUDA_EMU
#define RHEO_LAUNCH(grid, block, smem, stream) <<<grid, block, smem, stream>>>
#define RHEO_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

namespace rheo::cuda {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Sum over the 32 lanes in a fixed order (xor butterfly): every lane gets the same total.
template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, offset);
  return x;
}

// Reports bad input without a host sync (common.h StatusBit): ORs `bit` into *status if given.
__device__ __forceinline__ void report_status(int32_t* status, int32_t bit) {
  if (status != nullptr) atomicOr(status, bit);
}

}  // namespace rheo::cuda
