// Quantized linear layer on CUDA (csrc/include/rheo/quant_linear.h): x quantized to Q8 blocks by
// quantize_rows_q8_kernel (one thread per (row, block)), then quant_linear_kernel.
// Work mapping: one thread per (W row o, group of up to kMaxRows x rows); a warp's 32 threads take
// 32 consecutive W rows, i.e. two packed panels, so in each record a warp reads the scales and each
// 4-byte code word of its rows side by side (16 rows x 4 bytes = 64 contiguous bytes: coalesced),
// and all lanes read the same x codes (a broadcast from L1). Each thread keeps kMaxRows float sums
// and adds the blocks in order, with the CPU kernel's operations (exact int32 dot, then
// fmaf(d_w * xd, isum, acc), then fmaf(m_w, xm, acc) for Q4_1), so the two agree bit for bit
// (tests/cuda_emu). The int dot is written out byte by byte: __dp4a would give the same integers.
#include <cmath>
#include <cstdint>

#include "device_utils.cuh"
#include "rheo/quant_linear.h"

namespace rheo {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxRows = 8;  // x rows per pass over the blocks

__device__ __forceinline__ float half_bits_to_float(uint16_t h) {
  __half v;
  memcpy(&v, &h, sizeof v);
  return __half2float(v);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) quantize_rows_q8_kernel(QuantRowsArgs a) {
  const int64_t nb = a.in / kQuantBlock;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= a.n * nb) return;
  const int64_t i = t / nb, b = t % nb;
  const T* x = static_cast<const T*>(a.x) + i * a.x_stride + b * kQuantBlock;  // [32]
  float amax = 0.0f;
  for (int k = 0; k < kQuantBlock; ++k) {
    const float av = fabsf(cuda::to_float(x[k]));
    amax = av > amax ? av : amax;
  }
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int k = 0; k < kQuantBlock; ++k) {
    float q = rintf(cuda::to_float(x[k]) * id);  // ties to even, as the CPU's nearbyint
    q = q == q ? fminf(127.0f, fmaxf(-127.0f, q)) : 0.0f;
    const int32_t qi = static_cast<int32_t>(q);
    a.xq[i * a.in + b * kQuantBlock + k] = static_cast<int8_t>(qi);
    sum += qi;
  }
  const float d = amax / 127.0f;
  a.xd[t] = d;
  a.xs[t] = sum;
  a.xm[t] = d * static_cast<float>(sum);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) quant_linear_kernel(QuantLinearArgs a) {
  const int64_t o =
      a.p_begin * kQuantPanel + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (o >= a.p_end * kQuantPanel || o >= a.out) return;
  const int64_t nb = a.in / kQuantBlock, rec = quant_record_bytes(a.type);
  const bool has_m = a.type == QuantType::kQ4_1;
  const int r = static_cast<int>(o % kQuantPanel);
  const uint8_t* panel = a.w + (o / kQuantPanel) * nb * rec;
  T* y = static_cast<T*>(a.y);
  for (int64_t i0 = 0; i0 < a.n; i0 += kMaxRows) {
    const int rows = static_cast<int>(a.n - i0 < kMaxRows ? a.n - i0 : kMaxRows);
    float acc[kMaxRows] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* record = panel + b * rec;
      const uint16_t* scales = reinterpret_cast<const uint16_t*>(record);
      const float d_w = half_bits_to_float(scales[r]);
      const float m_w = has_m ? half_bits_to_float(scales[kQuantPanel + r]) : 0.0f;
      const uint8_t* codes = record + (has_m ? 64 : 32);
      int32_t w[kQuantBlock];  // this row's 32 codes of block b
      for (int k = 0; k < kQuantBlock; ++k) w[k] = quant_code_at(codes, a.type, r, k);
#pragma unroll
      for (int c = 0; c < kMaxRows; ++c) {
        if (c >= rows) break;
        const int64_t ib = (i0 + c) * nb + b;
        const int8_t* xq = a.xq + (i0 + c) * a.in + b * kQuantBlock;
        int32_t isum = 0;
        for (int k = 0; k < kQuantBlock; ++k) isum += w[k] * xq[k];
        if (a.type == QuantType::kQ4_0) isum -= 8 * a.xs[ib];
        acc[c] = fmaf(d_w * a.xd[ib], static_cast<float>(isum), acc[c]);
        if (has_m) acc[c] = fmaf(m_w, a.xm[ib], acc[c]);
      }
    }
    for (int c = 0; c < rows; ++c) y[(i0 + c) * a.y_stride + o] = cuda::from_float<T>(acc[c]);
  }
}

// One thread per (row i, block b): its 32 values. -fmad=false keeps Q4_1's d * q + m two roundings.
template <typename T>
__global__ void __launch_bounds__(kThreads) quant_gather_rows_kernel(QuantGatherArgs a) {
  const int64_t nb = a.in / kQuantBlock;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= a.n * nb) return;
  const int64_t i = t / nb, b = t % nb;
  int64_t id = a.ids[i];
  id = id < 0 ? 0 : id < a.rows ? id : a.rows - 1;  // unchecked on the device: clamped
  const int r = static_cast<int>(id % kQuantPanel);
  const bool has_m = a.type == QuantType::kQ4_1;
  const uint8_t* record = a.w + ((id / kQuantPanel) * nb + b) * quant_record_bytes(a.type);
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(record);
  const float d = half_bits_to_float(scales[r]);
  const float m = has_m ? half_bits_to_float(scales[kQuantPanel + r]) : 0.0f;
  const uint8_t* codes = record + (has_m ? 64 : 32);
  T* out = static_cast<T*>(a.out) + i * a.in + b * kQuantBlock;
  for (int k = 0; k < kQuantBlock; ++k)
    out[k] = cuda::from_float<T>(quant_value(a.type, quant_code_at(codes, a.type, r, k), d, m));
}

}  // namespace

cudaError_t quant_gather_rows_cuda(const QuantGatherArgs& a, cudaStream_t stream) {
  RHEO_CHECK(a.n >= 0 && a.rows >= 1 && a.in >= 0 && a.in % kQuantBlock == 0,
             "quant_gather_rows needs n >= 0, rows >= 1 and in a multiple of 32, got n=", a.n,
             ", rows=", a.rows, ", in=", a.in);
  const int64_t work = a.n * (a.in / kQuantBlock);
  if (work == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((work + kThreads - 1) / kThreads);
  switch (a.dtype) {
    case DType::kBFloat16:
      quant_gather_rows_kernel<__nv_bfloat16> RHEO_LAUNCH(blocks, kThreads, 0, stream)(a);
      break;
    case DType::kFloat32:
      quant_gather_rows_kernel<float> RHEO_LAUNCH(blocks, kThreads, 0, stream)(a);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t quantize_rows_q8_cuda(const QuantRowsArgs& a, cudaStream_t stream) {
  RHEO_CHECK(a.n >= 0 && a.in >= 0 && a.in % kQuantBlock == 0,
             "quantize_rows_q8 needs n >= 0 and in a multiple of 32, got n=", a.n, ", in=", a.in);
  RHEO_CHECK(a.x_stride >= a.in, "quantize_rows_q8 needs x_stride >= in=", a.in, ", got ",
             a.x_stride);
  const int64_t work = a.n * (a.in / kQuantBlock);
  if (work == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((work + kThreads - 1) / kThreads);
  switch (a.dtype) {
    case DType::kBFloat16:
      quantize_rows_q8_kernel<__nv_bfloat16> RHEO_LAUNCH(blocks, kThreads, 0, stream)(a);
      break;
    case DType::kFloat32:
      quantize_rows_q8_kernel<float> RHEO_LAUNCH(blocks, kThreads, 0, stream)(a);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t quant_linear_cuda(const QuantLinearArgs& a, cudaStream_t stream) {
  check_quant_linear_args(a);
  const int64_t rows = (a.p_end - a.p_begin) * kQuantPanel;
  if (a.n == 0 || rows == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  switch (a.dtype) {
    case DType::kBFloat16:
      quant_linear_kernel<__nv_bfloat16> RHEO_LAUNCH(blocks, kThreads, 0, stream)(a);
      break;
    case DType::kFloat32:
      quant_linear_kernel<float> RHEO_LAUNCH(blocks, kThreads, 0, stream)(a);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace rheo
