// Device helpers shared by the .cu files, and the two macros that let the same sources run on the
// CPU emulator (csrc/emu/rheo_emu.h, tests only):
//   kernel RHEO_LAUNCH(grid, block, smem, stream)(args...);   kernel<<<grid, block, smem, stream>>>
//   RHEO_DYNAMIC_SHARED(type, name);                          extern __shared__ type name[]
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "rheo/common.h"

#ifndef RHEO_CUDA_EMU
#define RHEO_LAUNCH(grid, block, smem, stream) <<<grid, block, smem, stream>>>
#define RHEO_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
// RHEO_STATIC_SHARED(bytes, kernel): for the emulator only, which cannot see a kernel's static
// __shared__ bytes before it runs; a GPU reports them (cudaFuncGetAttributes). The figure is
// nvcc's (--resource-usage, sm_90), and tests/test_cuda_emu.py keeps it true.
#define RHEO_STATIC_SHARED(bytes, ...) static_assert(true, "")
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

// --- shared memory of a launch ---------------------------------------------------------------
// A block's shared memory is its kernel's static __shared__ bytes plus the launch's dynamic bytes.
// Every GPU grants 48 KB a block by default; past that the kernel must opt in
// (cudaFuncAttributeMaxDynamicSharedMemorySize), up to the device's own ceiling,
// cudaDevAttrMaxSharedMemoryPerBlockOptin: 227 KB on H100/H200, 163 KB on A100, 99 KB on Ada and
// consumer Ampere (docs/kernels.md §7 gives each kernel's admitted range per class).
struct SharedFit {
  int device = 0;
  size_t static_bytes = 0;   // the kernel's __shared__ variables (cudaFuncGetAttributes)
  size_t dynamic_bytes = 0;  // asked for by this launch
  size_t limit = 0;          // the device's opt-in ceiling a block, static bytes included
  size_t needed() const { return static_bytes + dynamic_bytes; }
  bool fits() const { return needed() <= limit; }
};

// Fills `fit` for a launch of `kernel` with `dynamic_bytes` on the current device and, when it
// fits but passes the 48 KB default, opts the kernel in to the device's whole ceiling. The
// attributes are read, and the opt-in set, once per (device, kernel) for the process; a launch
// that does not fit touches nothing, so the caller can refuse it before anything launches.
struct SharedEntry {
  size_t static_bytes = 0, limit = 0;
  bool opted_in = false;
};
// At namespace scope, not function-local statics: the emulator treats every function-local
// static of a .cu file as a static __shared__ variable (csrc/emu/emu_shared.ld).
inline std::mutex shared_mutex;
inline std::map<std::pair<int, const void*>, SharedEntry> shared_known;  // by (device, kernel)

inline cudaError_t fit_shared(const void* kernel, size_t dynamic_bytes, SharedFit* fit) {
  constexpr size_t kDefaultShared = 48 * 1024;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const std::lock_guard<std::mutex> lock(shared_mutex);
  const auto key = std::make_pair(device, kernel);
  auto it = shared_known.find(key);
  if (it == shared_known.end()) {
    cudaFuncAttributes attr;
    int optin = 0;
    err = cudaFuncGetAttributes(&attr, kernel);
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;
    it = shared_known.emplace(key, SharedEntry{attr.sharedSizeBytes, static_cast<size_t>(optin)})
             .first;
  }
  SharedEntry& e = it->second;
  *fit = SharedFit{device, e.static_bytes, dynamic_bytes, e.limit};
  if (!fit->fits() || fit->needed() <= kDefaultShared || e.opted_in) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(e.limit - e.static_bytes));
  e.opted_in = err == cudaSuccess;
  return err;
}

template <typename... P>
cudaError_t fit_shared(void (*kernel)(P...), size_t dynamic_bytes, SharedFit* fit) {
  return fit_shared(reinterpret_cast<const void*>(kernel), dynamic_bytes, fit);
}

}  // namespace rheo::cuda
