// Skinny linear layer: y = x W^T for the few rows of a decode step or draft tree, and the many
// rows of a prefill, with one arithmetic: a row's output bits do not depend on how many rows run
// with it, on the thread count, nor on the ISA path (CPU) or the device (CUDA).
// W is streamed once per sweep of x rows and each block of W rows meets the rows of x in
// register tiles, so the cost grows slowly with n (bench/bench_skinny_linear.py).
//
// x [n, in]    row stride x_stride (elements), last dim dense
// w [out, in]  contiguous, row-major (torch's nn.Linear weight layout)
// y [n, out]   row stride y_stride (elements), last dim dense
// dtype        kBFloat16 (x, w, y hold raw bf16 bits as uint16_t) or kFloat32, one for all three
// y[i, o] = <x row i, W row o> for i < n and o_begin <= o < o_end, summed in this fixed order
// (skinny::dot below is the reference every path reproduces bit for bit):
//   16 float32 lanes; bf16 takes the columns 32 at a time, lane j adding the product of column
//   2j + 1 and then of column 2j (the order of AVX-512-BF16's vdpbf16ps); float32 takes them 16
//   at a time, lane j adding column j. Each add is one fused multiply-add (exact product, one
//   rounding). The lanes fold as l[j] += l[j + s] for s = 8, 4, 2, 1; the last in % 32 (bf16) or
//   in % 16 (float32) columns are then added one by one in column order; one rounding to the
//   output dtype (bf16: to nearest even, as torch rounds the float32 result of a bf16 linear).
//   bf16 runs with vdpbf16ps's denormal rule everywhere: a denormal input counts as zero of its
//   sign, and a result below FLT_MIN in magnitude (tiny after rounding, as x86 detects it) is
//   flushed to zero of its sign. float32 is plain IEEE.
// Only the rows o_begin..o_end-1 of w are read and only those columns of y are written, so a
// caller splits the work by giving each thread its own range.
// Rules: n, in >= 0, 0 <= o_begin <= o_end <= out, x_stride >= in, y_stride >= out.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "rheo/common.h"

#ifdef RHEO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace rheo {

struct SkinnyLinearArgs {
  const void* x = nullptr;  // [n, in]
  const void* w = nullptr;  // [out, in]
  void* y = nullptr;        // [n, out]
  DType dtype = DType::kBFloat16;
  int64_t n = 0, in = 0, out = 0;
  int64_t x_stride = 0, y_stride = 0;  // elements between rows of x and of y
  int64_t o_begin = 0, o_end = 0;      // the output rows (rows of w, columns of y) to compute
};

void skinny_linear_cpu(const SkinnyLinearArgs& args);
// Whether the CPU kernel's bf16 path may use AVX-512-BF16 (vdpbf16ps) when the dispatch level is
// AVX-512 and the CPU has it: on by default; its bits are checked against skinny::dot once, at the
// first bf16 call, and it stays off on a CPU where they differ. Returns the setting now in force
// (false where the CPU lacks the instruction or failed the check). For tests and benches.
bool skinny_linear_set_bf16_dot(bool on);
bool skinny_linear_bf16_dot_on();
#ifdef RHEO_WITH_CUDA
cudaError_t skinny_linear_cuda(const SkinnyLinearArgs& args, cudaStream_t stream);
#endif

// --- the arithmetic (host and device): every path computes what skinny::dot computes ---
namespace skinny {

constexpr int kLanes = 16;
constexpr float kFloatMin = 1.17549435e-38f;  // FLT_MIN: the smallest normal float

RHEO_HOST_DEVICE float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
// bf16 bits as float32, a denormal read as zero of its sign (vdpbf16ps's DAZ).
RHEO_HOST_DEVICE float bf16_daz(uint16_t b) {
  return bits_to_float((b & 0x7F80u) == 0 ? uint32_t(b & 0x8000u) << 16 : uint32_t(b) << 16);
}
RHEO_HOST_DEVICE float to_float(float v) { return v; }
RHEO_HOST_DEVICE float to_float(uint16_t v) { return bf16_daz(v); }
// a * b + c rounded once; for bf16 (Ftz) a result tiny after rounding becomes zero of its sign
// (x86's FTZ: tininess is detected after rounding to 24 bits with an unbounded exponent, so a
// value just below FLT_MIN that rounds up to it still flushes; the float64 FMA decides that case).
template <bool Ftz>
RHEO_HOST_DEVICE float fma(float a, float b, float c) {
  const float r = fmaf(a, b, c);
  if (!Ftz || fabsf(r) > kFloatMin) return r;
  if (fabsf(r) < kFloatMin) return copysignf(0.0f, r);
  const double exact = ::fma(double(a), double(b), double(c));  // a * b exact in float64
  return fabs(exact) < 0x1p-126 - 0x1p-151 ? copysignf(0.0f, r) : r;
}
template <bool Ftz>
RHEO_HOST_DEVICE float add(float a, float b) {
  return fma<Ftz>(a, 1.0f, b);
}

// <w_row, x_row> [in] in the order above: the reference the CPU paths and the CUDA twin follow.
template <typename Elem>
RHEO_HOST_DEVICE float dot(const Elem* w_row, const Elem* x_row, int64_t in) {
  constexpr bool kBf16 = sizeof(Elem) == 2;
  constexpr int64_t kStep = kBf16 ? 2 * kLanes : kLanes;
  float lane[kLanes] = {};
  const int64_t in_steps = in - in % kStep;
  for (int64_t k = 0; k < in_steps; k += kStep)
    for (int j = 0; j < kLanes; ++j) {
      if (kBf16) {
        const int64_t odd = k + 2 * j + 1, even = k + 2 * j;
        lane[j] = fma<kBf16>(to_float(w_row[odd]), to_float(x_row[odd]), lane[j]);
        lane[j] = fma<kBf16>(to_float(w_row[even]), to_float(x_row[even]), lane[j]);
      } else {
        lane[j] = fma<kBf16>(to_float(w_row[k + j]), to_float(x_row[k + j]), lane[j]);
      }
    }
  for (int s = kLanes / 2; s > 0; s /= 2)
    for (int j = 0; j < s; ++j) lane[j] = add<kBf16>(lane[j], lane[j + s]);
  float sum = lane[0];
  for (int64_t k = in_steps; k < in; ++k)
    sum = fma<kBf16>(to_float(w_row[k]), to_float(x_row[k]), sum);
  return sum;
}

}  // namespace skinny
}  // namespace rheo
