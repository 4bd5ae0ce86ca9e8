// Fused layer operators on CUDA (csrc/include/rheo/fused_ops.h), the CPU twins' bits.
// Work mapping:
//   add_rms_norm  one warp per row (grid = rows, 32 threads): lane t takes columns t, t + 32, ...
//                 in order, which is exactly the header's lane c % 32, sums their squares in
//                 double, and the xor butterfly (16, 8, 4, 2, 1) is the header's fold tree, so the
//                 variance has the CPU's bits; then each lane writes its own columns. Why a warp:
//                 a decode step has a few rows of a few thousand columns, one warp reads a row in
//                 a handful of coalesced passes, and a block-wide sum would change the order.
//   rope_qk       one thread per (row, q/k head, column pair c, c + D/2), grid-stride.
//   silu_mul      one thread per (row, column), grid-stride; exp is the header's sleef_expf.
// Built with -fmad=false: no a * b + c is fused except the explicit fmaf of sleef_expf, as on the
// CPU (-ffp-contract=off); division and sqrt are IEEE (no fast-math), so every op rounds as there.
#include <cstdint>

#include "device_utils.cuh"
#include "rheo/fused_ops.h"

namespace rheo {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond this

using cuda::from_float;
using cuda::to_float;

// v rounded to T and widened back: what a torch op in dtype T leaves.
template <typename T>
__device__ __forceinline__ float rounded(float v) {
  return to_float<T>(from_float<T>(v));
}

template <typename T>
__global__ void __launch_bounds__(32) add_rms_norm_kernel(AddRmsNormArgs a) {
  const int lane = threadIdx.x;
  const int64_t row = a.row_begin + blockIdx.x;
  const T* x = static_cast<const T*>(a.x) + row * a.x_stride;  // [hidden]
  const T* delta = a.delta ? static_cast<const T*>(a.delta) + row * a.delta_stride : nullptr;
  T* residual = a.delta ? static_cast<T*>(a.residual_out) + row * a.hidden : nullptr;
  T* normed = static_cast<T*>(a.normed_out) + row * a.hidden;  // [hidden]
  double sum = 0.0;  // lane `lane` of the variance sum
  for (int64_t c = lane; c < a.hidden; c += kNormLanes) {
    float r = to_float(x[c]);
    if (delta) {
      r = rounded<T>(r + to_float(delta[c]));
      residual[c] = from_float<T>(r);
    }
    const double v = r;
    sum += v * v;
  }
  for (int offset = kNormLanes / 2; offset > 0; offset >>= 1)
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
  const float var = static_cast<float>(sum / static_cast<double>(a.hidden));
  const float inv = 1.0f / sqrtf(var + a.eps);
  const T* weight = static_cast<const T*>(a.weight);
  for (int64_t c = lane; c < a.hidden; c += kNormLanes) {
    const float r = delta ? rounded<T>(to_float(x[c]) + to_float(delta[c])) : to_float(x[c]);
    normed[c] = from_float<T>(to_float(weight[c]) * rounded<T>(r * inv));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rope_qk_kernel(RopeQkArgs a) {
  const int64_t half = a.D / 2, heads = a.H + a.Hkv;
  const int64_t total = (a.row_end - a.row_begin) * heads * half;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % half, h = (i / half) % heads, row = a.row_begin + i / (half * heads);
    const T* x = static_cast<const T*>(a.qkv) + row * a.qkv_stride + h * a.D;  // [D]
    const float cs = to_float(static_cast<const T*>(a.cos)[row * half + c]);
    const float sn = to_float(static_cast<const T*>(a.sin)[row * half + c]);
    T* out = h < a.H ? static_cast<T*>(a.q_out) + (row * a.H + h) * a.D
                     : static_cast<T*>(a.k_out) + (row * a.Hkv + h - a.H) * a.D;
    const float lo = to_float(x[c]), hi = to_float(x[c + half]);
    out[c] = from_float<T>(rounded<T>(lo * cs) + rounded<T>(-hi * sn));
    out[c + half] = from_float<T>(rounded<T>(hi * cs) + rounded<T>(lo * sn));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) silu_mul_kernel(SiluMulArgs a) {
  const int64_t total = (a.row_end - a.row_begin) * a.I;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % a.I, row = a.row_begin + i / a.I;
    const T* gate = static_cast<const T*>(a.gate_up) + row * a.gu_stride;  // [2 I]
    const float silu = rounded<T>(silu_float(to_float(gate[c])));
    static_cast<T*>(a.out)[row * a.I + c] = from_float<T>(silu * to_float(gate[a.I + c]));
  }
}

unsigned grid_for(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks);
}

template <typename Args>
void check_rows(const Args& a, const char* what) {
  RHEO_CHECK(0 <= a.row_begin && a.row_begin <= a.row_end && a.row_end <= a.rows, what,
             " needs 0 <= row_begin <= row_end <= rows=", a.rows, ", got [", a.row_begin, ", ",
             a.row_end, ")");
}

}  // namespace

cudaError_t add_rms_norm_cuda(const AddRmsNormArgs& a, cudaStream_t stream) {
  RHEO_CHECK(a.rows >= 0 && a.hidden > 0, "add_rms_norm needs rows >= 0 and hidden > 0, got rows=",
             a.rows, ", hidden=", a.hidden);
  check_rows(a, "add_rms_norm");
  RHEO_CHECK(a.row_end - a.row_begin <= 0x7FFFFFFF, "add_rms_norm on CUDA takes < 2^31 rows a "
             "launch (one block a row), got ", a.row_end - a.row_begin, "; split the rows");
  if (a.row_begin == a.row_end) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(a.row_end - a.row_begin);
  switch (a.dtype) {
    case DType::kBFloat16:
      add_rms_norm_kernel<__nv_bfloat16> RHEO_LAUNCH(blocks, 32, 0, stream)(a);
      break;
    case DType::kFloat32: add_rms_norm_kernel<float> RHEO_LAUNCH(blocks, 32, 0, stream)(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t rope_qk_cuda(const RopeQkArgs& a, cudaStream_t stream) {
  RHEO_CHECK(a.rows >= 0 && a.H >= 0 && a.Hkv >= 0 && a.D > 0 && a.D % 2 == 0,
             "rope_qk needs rows, H, Hkv >= 0 and an even D > 0, got rows=", a.rows, ", H=", a.H,
             ", Hkv=", a.Hkv, ", D=", a.D);
  check_rows(a, "rope_qk");
  const int64_t total = (a.row_end - a.row_begin) * (a.H + a.Hkv) * (a.D / 2);
  if (total == 0) return cudaSuccess;
  switch (a.dtype) {
    case DType::kBFloat16:
      rope_qk_kernel<__nv_bfloat16> RHEO_LAUNCH(grid_for(total), kThreads, 0, stream)(a);
      break;
    case DType::kFloat32:
      rope_qk_kernel<float> RHEO_LAUNCH(grid_for(total), kThreads, 0, stream)(a);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t silu_mul_cuda(const SiluMulArgs& a, cudaStream_t stream) {
  RHEO_CHECK(a.rows >= 0 && a.I >= 0, "silu_mul needs rows, I >= 0, got rows=", a.rows, ", I=",
             a.I);
  check_rows(a, "silu_mul");
  const int64_t total = (a.row_end - a.row_begin) * a.I;
  if (total == 0) return cudaSuccess;
  switch (a.dtype) {
    case DType::kBFloat16:
      silu_mul_kernel<__nv_bfloat16> RHEO_LAUNCH(grid_for(total), kThreads, 0, stream)(a);
      break;
    case DType::kFloat32:
      silu_mul_kernel<float> RHEO_LAUNCH(grid_for(total), kThreads, 0, stream)(a);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace rheo
