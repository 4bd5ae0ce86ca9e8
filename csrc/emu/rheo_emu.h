// rheo_emu: runs the project's CUDA sources (csrc/cuda/*.cu) on a CPU, for tests.
//
// A .cu file compiles as host C++ with -DRHEO_CUDA_EMU -Icsrc/emu/include (this directory's
// cuda_runtime.h / cuda_fp16.h / cuda_bf16.h stand in for the toolkit's). The sources adopt two
// macros that are plain CUDA under nvcc (csrc/cuda/device_utils.cuh):
//   kernel RHEO_LAUNCH(grid, block, smem, stream)(args...);   // kernel<<<grid, block, smem, stream>>>
//   RHEO_DYNAMIC_SHARED(float, name);                          // extern __shared__ float name[];
// Everything else is the real CUDA spelling: __global__/__device__, static __shared__, threadIdx,
// __syncthreads(_or/_and/_count), __shfl_xor/up/down/_sync, __ballot_sync, __any/__all_sync,
// __match_any_sync, __syncwarp, __popc, atomicAdd/Or/Max/Min, bit casts, __half/__nv_bfloat16.
//
// Execution model (rheo_emu.cpp): a launch runs its blocks one at a time (in a seeded random
// order); a block runs one fiber per CUDA thread on the calling OS thread, with a hand-written
// context switch. A fiber runs until it reaches a barrier or a warp operation, or returns; the
// scheduler then picks the next runnable fiber at random (seeded), so two seeds give two
// interleavings between barriers and a missing barrier shows up as a difference. Shared memory
// (static __shared__ variables, collected by csrc/emu/emu_shared.ld, and the dynamic buffer) is
// filled with a seed-dependent poison byte when each block starts, as real shared memory starts
// as garbage. Checked and reported (the launch fails; last_error_message() says why):
//   a barrier reached by part of the block (some threads exited or wait elsewhere), threads
//   waiting at two different barriers, a warp operation whose mask does not match the lanes that
//   reach it (or names an exited / absent lane, or reads a lane outside it), deadlock, and the
//   launch limits: block > 1024 threads (x, y <= 1024, z <= 64), grid.x < 2^31, grid.y/z <= 65535,
//   and shared memory as a GPU counts it: a kernel's static __shared__ bytes plus the launch's
//   dynamic bytes, over 48 KB without cudaFuncSetAttribute, or past the device's opt-in ceiling.
// Devices: the emulated machine holds one GPU of each class (kDevices: H100/H200, A100, Ada);
// cudaSetDevice picks one (device 0 by default) and cudaDeviceGetAttribute reports its limits.
// Static shared memory: the emulator cannot see a kernel's __shared__ variables before it runs,
// so each .cu file states nvcc's figure per kernel (RHEO_STATIC_SHARED, csrc/cuda/device_utils.cuh;
// 0 when absent) and tests/test_cuda_emu.py checks the figures against nvcc --resource-usage.
// Not modelled: registers, memory ordering between blocks (blocks run one after another), timing.
// Arithmetic is the host's IEEE arithmetic with contraction off, as the CUDA build's -fmad=false;
// exp, log and the other library functions are the C library's, not CUDA's (docs/kernels.md §7).
#pragma once

#include <math.h>  // the C++ <math.h>: float overloads of exp, log, ... in the global namespace

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// --- CUDA keywords ---------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static  // one block runs at a time; poisoned per block (emu_shared.ld)
#define __constant__ static

// --- vector types, launch and error API ---------------------------------------------------------
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
struct CUstream_st;
typedef CUstream_st* cudaStream_t;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr {
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
struct cudaFuncAttributes {
  size_t sharedSizeBytes = 0;         // static __shared__ bytes (RHEO_STATIC_SHARED's figure)
  int maxDynamicSharedSizeBytes = 0;  // what a launch may ask: 48 KB - static, or the opt-in
  int maxThreadsPerBlock = 1024;
  int numRegs = 0;                    // not modelled
};

const char* cudaGetErrorString(cudaError_t err);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);

namespace rheo_emu {

// The schedule: 0 = in order (thread 0 first, blocks in order, poison 0xFF); any other value = a
// seeded random interleaving, block order and poison byte.
void set_schedule_seed(uint64_t seed);
uint64_t schedule_seed();
// Why the last failed launch failed (empty when it did not).
const std::string& last_error_message();
// Counters since the last reset (for tests and for the cost of emulation).
struct Counters {
  uint64_t launches = 0, blocks = 0, threads = 0, switches = 0;
  uint64_t allocations = 0;      // cudaMallocAsync calls
  uint64_t attribute_sets = 0;   // cudaFuncSetAttribute calls
  uint64_t attribute_reads = 0;  // cudaFuncGetAttributes and cudaDeviceGetAttribute calls
};

// The GPU classes the emulator models, as devices 0, 1, 2 of one machine. Every class grants
// 48 KB of shared memory a block by default; shared_optin is its
// cudaDevAttrMaxSharedMemoryPerBlockOptin, the most a kernel may opt in to, static included.
struct DeviceModel {
  const char* name;
  size_t shared_default;  // cudaDevAttrMaxSharedMemoryPerBlock
  size_t shared_optin;    // cudaDevAttrMaxSharedMemoryPerBlockOptin
};
inline constexpr DeviceModel kDevices[] = {
    {"H100/H200 (sm_90)", 48 * 1024, 227 * 1024},
    {"A100 (sm_80)", 48 * 1024, 163 * 1024},
    {"Ada, RTX 4090/L4 (sm_89)", 48 * 1024, 99 * 1024},
};
inline constexpr int kDeviceCount = static_cast<int>(sizeof(kDevices) / sizeof(kDevices[0]));

// The static shared memory figures the .cu files state (RHEO_STATIC_SHARED), by kernel name as
// written there, e.g. "walk_kernel<F32Row>"; for the test that checks them against nvcc.
struct StaticShared {
  std::string kernel;
  size_t bytes;
};
std::vector<StaticShared> static_shared_figures();
Counters counters();
void reset_counters();

namespace detail {

struct Fiber;
extern Fiber* current;  // the running CUDA thread
extern uint3 block_idx;
extern dim3 block_dim, grid_dim;
uint3 thread_idx();
unsigned lane_id();

// A type-erased kernel invocation: every fiber of every block calls run(ctx).
struct Invocation {
  void (*run)(const void* ctx);
  const void* ctx;
  const void* kernel;  // identity, for the per-kernel attributes
};
cudaError_t launch(const Invocation& inv, dim3 grid, dim3 block, size_t dynamic_smem,
                   const char* file, int line);
void* dynamic_shared();

enum class WarpOp : int {
  kShflIdx, kShflXor, kShflUp, kShflDown, kBallot, kAny, kAll, kSync, kMatchAny,
};
// Rendezvous of the lanes in `mask` at a warp operation; returns this lane's 64-bit result.
uint64_t warp_op(const char* file, int line, WarpOp op, unsigned mask, uint64_t value, int arg,
                 int width);
enum class Barrier : int { kPlain, kOr, kAnd, kCount };
int barrier(const char* file, int line, Barrier kind, int pred);
[[noreturn]] void fail_in_kernel(const std::string& message);

template <typename T>
uint64_t to_bits(const T& v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                "warp shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}
template <typename T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

template <typename... A>
struct Pending {
  dim3 grid, block;
  size_t smem;
  const char* file;
  int line;
  std::tuple<A...> args;
};

template <typename... P, typename... A>
cudaError_t run_launch(void (*kernel)(P...), Pending<A...>& p) {
  struct Ctx {
    void (*kernel)(P...);
    std::tuple<A...>* args;
  } ctx{kernel, &p.args};
  Invocation inv;
  inv.run = [](const void* c) {
    const Ctx* x = static_cast<const Ctx*>(c);
    std::apply([x](const A&... a) { x->kernel(a...); }, *x->args);
  };
  inv.ctx = &ctx;
  inv.kernel = reinterpret_cast<const void*>(kernel);
  return launch(inv, p.grid, p.block, p.smem, p.file, p.line);
}

}  // namespace detail

struct LaunchConfig {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;  // streams are no-ops: a launch runs to completion before it returns
  const char* file;
  int line;
  template <typename... A>
  detail::Pending<std::decay_t<A>...> operator()(A&&... args) const {
    return {grid, block, smem, file, line, std::tuple<std::decay_t<A>...>(std::forward<A>(args)...)};
  }
};

}  // namespace rheo_emu

// kernel % config(args...): the emulated kernel<<<...>>>(args...).
template <typename... P, typename... A>
void operator%(void (*kernel)(P...), rheo_emu::detail::Pending<A...>&& p) {
  rheo_emu::detail::run_launch(kernel, p);
}

namespace rheo_emu::detail {
cudaError_t set_attribute(const void* kernel, cudaFuncAttribute attr, int value);
cudaError_t get_attributes(cudaFuncAttributes* attr, const void* kernel);
bool register_static_shared(const void* kernel, size_t bytes, const char* name);
}  // namespace rheo_emu::detail
template <typename T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  return rheo_emu::detail::set_attribute(reinterpret_cast<const void*>(kernel), attr, value);
}
template <typename T>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, T* kernel) {
  return rheo_emu::detail::get_attributes(attr, reinterpret_cast<const void*>(kernel));
}

// RHEO_STATIC_SHARED(bytes, kernel): nvcc's static shared memory of `kernel` (one instantiation),
// which cudaFuncGetAttributes reports and every launch counts (see the header comment).
#define RHEO_EMU_CAT2(a, b) a##b
#define RHEO_EMU_CAT(a, b) RHEO_EMU_CAT2(a, b)
#define RHEO_STATIC_SHARED(bytes, ...)                                                  \
  [[maybe_unused]] const bool RHEO_EMU_CAT(rheo_static_shared_, __LINE__) =             \
      ::rheo_emu::detail::register_static_shared(reinterpret_cast<const void*>(&__VA_ARGS__), \
                                                 (bytes), #__VA_ARGS__)

#define RHEO_LAUNCH(grid, block, smem, stream) \
  % ::rheo_emu::LaunchConfig{dim3(grid), dim3(block), static_cast<size_t>(smem), (stream), \
                            __FILE__, __LINE__}
#define RHEO_DYNAMIC_SHARED(type, name) \
  type* const name = static_cast<type*>(::rheo_emu::detail::dynamic_shared())

// --- built-in variables ------------------------------------------------------------------------
#define threadIdx (::rheo_emu::detail::thread_idx())
#define blockIdx (::rheo_emu::detail::block_idx)
#define blockDim (::rheo_emu::detail::block_dim)
#define gridDim (::rheo_emu::detail::grid_dim)
constexpr int warpSize = 32;

// --- barriers ------------------------------------------------------------------------------------
#define __syncthreads() \
  ((void)::rheo_emu::detail::barrier(__FILE__, __LINE__, ::rheo_emu::detail::Barrier::kPlain, 0))
#define __syncthreads_or(p) \
  ::rheo_emu::detail::barrier(__FILE__, __LINE__, ::rheo_emu::detail::Barrier::kOr, (p) ? 1 : 0)
#define __syncthreads_and(p) \
  ::rheo_emu::detail::barrier(__FILE__, __LINE__, ::rheo_emu::detail::Barrier::kAnd, (p) ? 1 : 0)
#define __syncthreads_count(p) \
  ::rheo_emu::detail::barrier(__FILE__, __LINE__, ::rheo_emu::detail::Barrier::kCount, (p) ? 1 : 0)

// --- warp operations ---------------------------------------------------------------------------
namespace rheo_emu::detail {
template <typename T>
T shfl(const char* f, int l, WarpOp op, unsigned mask, T v, int arg, int width) {
  return from_bits<T>(warp_op(f, l, op, mask, to_bits(v), arg, width));
}
}  // namespace rheo_emu::detail
#define RHEO_EMU_SHFL(op, mask, v, arg, ...) \
  ::rheo_emu::detail::shfl(__FILE__, __LINE__, ::rheo_emu::detail::WarpOp::op, mask, v, arg, \
                           (__VA_ARGS__ + 0) == 0 ? 32 : (__VA_ARGS__ + 0))
#define __shfl_sync(mask, v, lane, ...) RHEO_EMU_SHFL(kShflIdx, mask, v, lane, __VA_ARGS__)
#define __shfl_xor_sync(mask, v, lm, ...) RHEO_EMU_SHFL(kShflXor, mask, v, lm, __VA_ARGS__)
#define __shfl_up_sync(mask, v, d, ...) RHEO_EMU_SHFL(kShflUp, mask, v, d, __VA_ARGS__)
#define __shfl_down_sync(mask, v, d, ...) RHEO_EMU_SHFL(kShflDown, mask, v, d, __VA_ARGS__)
#define __ballot_sync(mask, p)                                                             \
  static_cast<unsigned>(::rheo_emu::detail::warp_op(                                       \
      __FILE__, __LINE__, ::rheo_emu::detail::WarpOp::kBallot, mask, (p) ? 1 : 0, 0, 32))
#define __any_sync(mask, p)                                                                   \
  static_cast<int>(::rheo_emu::detail::warp_op(__FILE__, __LINE__,                            \
                                               ::rheo_emu::detail::WarpOp::kAny, mask,        \
                                               (p) ? 1 : 0, 0, 32))
#define __all_sync(mask, p)                                                                   \
  static_cast<int>(::rheo_emu::detail::warp_op(__FILE__, __LINE__,                            \
                                               ::rheo_emu::detail::WarpOp::kAll, mask,        \
                                               (p) ? 1 : 0, 0, 32))
#define __match_any_sync(mask, v)                                                          \
  static_cast<unsigned>(::rheo_emu::detail::warp_op(                                       \
      __FILE__, __LINE__, ::rheo_emu::detail::WarpOp::kMatchAny, mask,                     \
      ::rheo_emu::detail::to_bits(v), 0, 32))
#define __syncwarp(...)                                                                    \
  ((void)::rheo_emu::detail::warp_op(__FILE__, __LINE__, ::rheo_emu::detail::WarpOp::kSync, \
                                     (__VA_ARGS__ + 0) == 0 ? 0xFFFFFFFFu : (__VA_ARGS__ + 0), \
                                     0, 0, 32))

// --- integer and bit-cast intrinsics -----------------------------------------------------------
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned int __float_as_uint(float x) { return rheo_emu::detail::from_bits<unsigned>(rheo_emu::detail::to_bits(x)); }
inline int __float_as_int(float x) { return rheo_emu::detail::from_bits<int>(rheo_emu::detail::to_bits(x)); }
inline float __uint_as_float(unsigned int x) { return rheo_emu::detail::from_bits<float>(x); }
inline float __int_as_float(int x) { return rheo_emu::detail::from_bits<float>(static_cast<uint32_t>(x)); }
inline long long __double_as_longlong(double x) { return rheo_emu::detail::from_bits<long long>(rheo_emu::detail::to_bits(x)); }
inline double __longlong_as_double(long long x) { return rheo_emu::detail::from_bits<double>(static_cast<uint64_t>(x)); }

// --- atomics: fibers of a block share one OS thread and switch only at barriers and warp
// operations, so a read-modify-write is indivisible, as an atomic is.
template <typename T>
inline T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}
template <typename T>
inline T atomicOr(T* address, T value) {
  const T old = *address;
  *address = old | value;
  return old;
}
template <typename T>
inline T atomicMax(T* address, T value) {
  const T old = *address;
  *address = old < value ? value : old;
  return old;
}
template <typename T>
inline T atomicMin(T* address, T value) {
  const T old = *address;
  *address = value < old ? value : old;
  return old;
}
template <typename T>
inline T atomicExch(T* address, T value) {
  const T old = *address;
  *address = value;
  return old;
}
template <typename T>
inline T atomicCAS(T* address, T compare, T value) {
  const T old = *address;
  if (old == compare) *address = value;
  return old;
}

// --- float intrinsics CUDA spells differently ---------------------------------------------------
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
