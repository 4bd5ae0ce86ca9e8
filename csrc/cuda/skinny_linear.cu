// Skinny linear layer on CUDA: y = x W^T for a few rows of x (csrc/include/rheo/skinny_linear.h).
// Work mapping: one warp per output row o (kWarps warps per block, grid = the rows / kWarps).
// Why: W is read once and that read is the whole cost, so each warp streams one W row with
// coalesced 16-byte loads (kVec elements per lane, 32 lanes side by side) and multiplies every
// chunk with the same columns of up to kMaxRows rows of x, whose partial sums stay in registers;
// x (n * in elements) is shared by all warps through L1/L2. Beyond kMaxRows rows the W row is
// walked again per group of rows (from L2). A warp-shuffle sum then gives each dot product to
// every lane, and lane c writes y[c, o]. Same math as the CPU kernel: float32 products and
// sums, one rounding to the output dtype (bf16: to nearest even). Many rows (a prefill) belong to
// cuBLAS; this kernel is for the decode step and the draft tree.

#include <cstdint>

#include "device_utils.cuh"
#include "rheo/skinny_linear.h"

namespace rheo {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxRows = 8;  // rows of x per pass over a W row: kMaxRows float accumulators

using cuda::from_float;
using cuda::to_float;
using cuda::warp_sum;

// kVec consecutive elements, loaded in one instruction when aligned to their size (16 bytes for
// kVec = 16 / sizeof(T); plain element loads for kVec = 1).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Chunk {
  T v[kVec];
};

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) skinny_linear_kernel(SkinnyLinearArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t o = a.o_begin + static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (o >= a.o_end) return;  // warp-uniform: the whole warp leaves together
  const T* w_row = static_cast<const T*>(a.w) + o * a.in;  // [in]
  const T* x = static_cast<const T*>(a.x);                 // [n, in], row stride x_stride
  T* y = static_cast<T*>(a.y);                             // [n, out], row stride y_stride
  for (int64_t i0 = 0; i0 < a.n; i0 += kMaxRows) {
    const int rows = static_cast<int>(a.n - i0 < kMaxRows ? a.n - i0 : kMaxRows);
    float acc[kMaxRows] = {};  // acc[c]: this lane's part of <W row o, x row i0 + c>
    for (int64_t k = static_cast<int64_t>(lane) * kVec; k < a.in; k += 32 * kVec) {
      const Chunk<T, kVec> wv = *reinterpret_cast<const Chunk<T, kVec>*>(w_row + k);
#pragma unroll
      for (int c = 0; c < kMaxRows; ++c) {
        if (c >= rows) break;
        const Chunk<T, kVec> xv =
            *reinterpret_cast<const Chunk<T, kVec>*>(x + (i0 + c) * a.x_stride + k);
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[c] += to_float(wv.v[j]) * to_float(xv.v[j]);
      }
    }
#pragma unroll
    for (int c = 0; c < kMaxRows; ++c) {
      const float sum = warp_sum(acc[c]);  // every lane takes part, for every c
      if (lane == c && c < rows) y[(i0 + c) * a.y_stride + o] = from_float<T>(sum);
    }
  }
}

// 16-byte loads need in, x_stride and both base addresses to be multiples of 16 bytes.
template <typename T>
bool can_vectorize(const SkinnyLinearArgs& a) {
  constexpr int64_t kVec = 16 / sizeof(T);
  return a.in % kVec == 0 && a.x_stride % kVec == 0 &&
         reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && reinterpret_cast<uintptr_t>(a.w) % 16 == 0;
}

template <typename T>
cudaError_t launch(const SkinnyLinearArgs& args, cudaStream_t stream) {
  const int64_t blocks = (args.o_end - args.o_begin + kWarps - 1) / kWarps;
  if (can_vectorize<T>(args)) {
    skinny_linear_kernel<T, 16 / sizeof(T)>
         RHEO_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, stream)(args);
  } else {
    skinny_linear_kernel<T, 1> RHEO_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, stream)(args);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t skinny_linear_cuda(const SkinnyLinearArgs& args, cudaStream_t stream) {
  RHEO_CHECK(args.n >= 0 && args.in >= 0, "skinny_linear needs n, in >= 0, got n=", args.n,
             ", in=", args.in);
  RHEO_CHECK(0 <= args.o_begin && args.o_begin <= args.o_end && args.o_end <= args.out,
             "skinny_linear needs 0 <= o_begin <= o_end <= out=", args.out, ", got [",
             args.o_begin, ", ", args.o_end, ")");
  RHEO_CHECK((args.o_end - args.o_begin + kWarps - 1) / kWarps <= 0x7FFFFFFF,
             "skinny_linear on CUDA needs out <= 2^31 * ", kWarps, " rows (grid limit), got ",
             args.o_end - args.o_begin, "; split W");
  if (args.n == 0 || args.o_begin == args.o_end) return cudaSuccess;
  switch (args.dtype) {
    case DType::kBFloat16: return launch<__nv_bfloat16>(args, stream);
    case DType::kFloat32: return launch<float>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace rheo
