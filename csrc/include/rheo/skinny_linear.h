// Skinny linear layer: y = x W^T for the few rows of one decode step or draft tree (n ~ 1..16).
// torch pays per row there (its bf16 linear on an AVX2 CPU without AVX-512 costs n times one row,
// BENCHMARKS.md); this kernel streams each weight row once and multiplies it with all n rows of
// x held in cache, so its cost grows slowly with n (bench/bench_skinny_linear.py).
//
// x [n, in]    row stride x_stride (elements), last dim dense
// w [out, in]  contiguous, row-major (torch's nn.Linear weight layout)
// y [n, out]   row stride y_stride (elements), last dim dense
// dtype        kBFloat16 (x, w, y hold raw bf16 bits as uint16_t) or kFloat32, one for all three
// y[i, o] = sum_k x[i, k] * w[o, k] for i < n and o_begin <= o < o_end: products and sum in
// float32, then one rounding to the output dtype (bf16: to nearest even, as torch rounds the
// float32 result of a bf16 linear). Only the rows o_begin..o_end-1 of w are read and only those
// columns of y are written, so a caller splits the work by giving each thread its own range.
// Rules: n, in >= 0, 0 <= o_begin <= o_end <= out, x_stride >= in, y_stride >= out.
#pragma once

#include <cstdint>

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
#ifdef RHEO_WITH_CUDA
cudaError_t skinny_linear_cuda(const SkinnyLinearArgs& args, cudaStream_t stream);
#endif

}  // namespace rheo
