// Skinny linear layer on CUDA: y = x W^T (csrc/include/rheo/skinny_linear.h), with the CPU twin's
// bits: every output is skinny::dot's sum in skinny::dot's order.
// Work mapping: one warp per output row o (kWarps warps per block, grid = the rows / kWarps).
// The 16 lanes of skinny::dot are the 16 threads of a half-warp: thread t holds lane t % 16 and
// walks the columns in steps of 32 (bf16: it reads columns 2j + 1 then 2j of each step, 4 bytes)
// or 16 (float32: column j), adding into one accumulator per row of x it owns; the two half-warps
// own the even and the odd rows of a group of kMaxRows rows of x, so W row o is read once per
// group (the half-warps read the same bytes: one transaction). The lanes then fold with
// shuffles as skinny::dot folds them (l[j] += l[j + s], s = 8, 4, 2, 1), and thread 0 of each
// half adds the last in % step columns in order and writes y. Sums use skinny::fma/add (bf16:
// vdpbf16ps's denormal rule in software), never the device's own FTZ. Many rows (a prefill)
// re-read W per group from L2; cuBLAS would be faster there but sums in its own order.

#include <cstdint>

#include "device_utils.cuh"
#include "rheo/skinny_linear.h"

namespace rheo {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxRows = 8;  // rows of x per pass over a W row: kMaxRows / 2 accumulators a thread

using cuda::from_float;

template <typename Elem>
__device__ __forceinline__ void store(Elem* dst, float v);
template <>
__device__ __forceinline__ void store<float>(float* dst, float v) { *dst = v; }
template <>
__device__ __forceinline__ void store<uint16_t>(uint16_t* dst, float v) {
  *reinterpret_cast<__nv_bfloat16*>(dst) = from_float<__nv_bfloat16>(v);
}

// Elem: uint16_t (bf16 bits) or float.
template <typename Elem>
__global__ void __launch_bounds__(kThreads) skinny_linear_kernel(SkinnyLinearArgs a) {
  constexpr bool kBf16 = sizeof(Elem) == 2;
  constexpr int64_t kStep = kBf16 ? 2 * skinny::kLanes : skinny::kLanes;
  const int lane = threadIdx.x % 32;
  const int j = lane % 16;     // skinny::dot's lane
  const int half = lane / 16;  // owns rows i0 + half, i0 + half + 2, ...
  const int64_t o = a.o_begin + static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (o >= a.o_end) return;  // warp-uniform: the whole warp leaves together
  const Elem* w_row = static_cast<const Elem*>(a.w) + o * a.in;  // [in]
  const Elem* x = static_cast<const Elem*>(a.x);                 // [n, in], row stride x_stride
  Elem* y = static_cast<Elem*>(a.y);                             // [n, out], row stride y_stride
  const int64_t steps = a.in - a.in % kStep;
  for (int64_t i0 = 0; i0 < a.n; i0 += kMaxRows) {
    const int rows = static_cast<int>(a.n - i0 < kMaxRows ? a.n - i0 : kMaxRows);
    float acc[kMaxRows / 2] = {};  // acc[r]: lane j of <W row o, x row i0 + 2r + half>
    for (int64_t k = 0; k < steps; k += kStep) {
      if constexpr (kBf16) {
        const float w_odd = skinny::to_float(w_row[k + 2 * j + 1]);
        const float w_even = skinny::to_float(w_row[k + 2 * j]);
#pragma unroll
        for (int r = 0; r < kMaxRows / 2; ++r) {
          const int c = 2 * r + half;
          if (c >= rows) break;
          const Elem* x_row = x + (i0 + c) * a.x_stride;
          acc[r] = skinny::fma<kBf16>(w_odd, skinny::to_float(x_row[k + 2 * j + 1]), acc[r]);
          acc[r] = skinny::fma<kBf16>(w_even, skinny::to_float(x_row[k + 2 * j]), acc[r]);
        }
      } else {
        const float wv = skinny::to_float(w_row[k + j]);
#pragma unroll
        for (int r = 0; r < kMaxRows / 2; ++r) {
          const int c = 2 * r + half;
          if (c >= rows) break;
          const float xv = skinny::to_float(x[(i0 + c) * a.x_stride + k + j]);
          acc[r] = skinny::fma<kBf16>(wv, xv, acc[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kMaxRows / 2; ++r) {
      float v = acc[r];
      for (int s = skinny::kLanes / 2; s > 0; s /= 2)  // every thread takes part, for every r
        v = skinny::add<kBf16>(v, __shfl_down_sync(0xFFFFFFFFu, v, s, 16));
      const int c = 2 * r + half;
      if (j == 0 && c < rows) {
        const Elem* x_row = x + (i0 + c) * a.x_stride;
        for (int64_t k = steps; k < a.in; ++k)
          v = skinny::fma<kBf16>(skinny::to_float(w_row[k]), skinny::to_float(x_row[k]), v);
        store(y + (i0 + c) * a.y_stride + o, v);
      }
    }
  }
}

template <typename Elem>
cudaError_t launch(const SkinnyLinearArgs& args, cudaStream_t stream) {
  const int64_t blocks = (args.o_end - args.o_begin + kWarps - 1) / kWarps;
  skinny_linear_kernel<Elem> RHEO_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, stream)(args);
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
    case DType::kBFloat16: return launch<uint16_t>(args, stream);
    case DType::kFloat32: return launch<float>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace rheo
