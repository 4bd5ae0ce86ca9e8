// Fused operators of a Llama decoder layer (docs/kernels.md, "Fused layer operators"): the
// RMSNorm with its residual add, RoPE where q and k come out of the fused qkv matmul, and
// SiLU(gate) * up. Eager torch spends ~20 operators a layer on these (six for each bf16 RMSNorm);
// each is one pass over a row here. Every output element depends on its own row only, in a fixed
// order, so a row's bits do not depend on how many rows run, on the thread count or on the ISA
// path; the CUDA twins (csrc/cuda/fused_ops.cu) give the same bits.
//
// dtype: kBFloat16 (raw bf16 bits as uint16_t) or kFloat32, one for all tensors of a call.
// "round" below is the rounding to dtype (bf16: nearest even; float32: none), applied where
// torch rounds a bf16 op's float32 result, so the fused op equals the torch sequence it replaces.
//
// add_rms_norm (HF LlamaRMSNorm after the residual add `x = x + delta`):
//   x      [rows, hidden]  row stride x_stride       the residual stream
//   delta  [rows, hidden]  row stride delta_stride   added to x first, or null (no add)
//   weight [hidden]
//   residual_out [rows, hidden] dense  r = round(x + delta) (float32 sum, as a bf16 add); not
//                                      written when delta is null (r = x)
//   normed_out   [rows, hidden] dense  round(weight * round(r * inv)), inv = 1 / sqrt(var + eps)
//   var: the mean of r^2 summed in double, element c into lane c % 32 in column order, the 32
//   lanes folded as a tree (lane t += lane t + o for o = 16, 8, 4, 2, 1), divided by hidden in
//   double, rounded once to float; eps is added in float. torch sums r^2 in float in its own
//   order: the variance agrees to about 1 ulp, so an output differs from torch's by at most one
//   unit of its last place, rarely (tests/test_fused_ops.py measures it).
// rope_qk (HF apply_rotary_pos_emb, rotate_half convention, on the q and k heads of qkv):
//   qkv [rows, (H + 2 Hkv) D]  row stride qkv_stride: q heads, then k heads, then v heads
//   cos, sin [rows, D / 2]     dense, in dtype (HF casts its float32 tables to the dtype)
//   q_out [rows, H, D], k_out [rows, Hkv, D] dense
//   out[c] = round(round(x[c] cos[c]) + round(-x[c + D/2] sin[c]))        for c < D/2
//   out[c] = round(round(x[c] cos[c - D/2]) + round(x[c - D/2] sin[c - D/2]))  for c >= D/2
//   (HF's q * cos + rotate_half(q) * sin, each bf16 op rounded: bit for bit).
// silu_mul (F.silu(gate) * up on the fused gate_up matmul's output):
//   gate_up [rows, 2 I] row stride gu_stride: gate in columns 0..I-1, up in I..2I-1
//   out     [rows, I]   dense   out = round(round(silu(gate)) * up)
//   silu(g) = g / (1 + exp(-g)) in float, exp as SLEEF's expf_u10 (sleef_expf below), which
//   torch's vectorised silu calls (Vectorized<float>::exp): bit for bit torch's vector path.
//   (torch's scalar tail, the last < 2 vectors of a tensor, uses std::exp and may differ by 1 ulp.)
// Rules: rows, hidden, H, Hkv, I >= 0; D even and > 0; strides >= the row widths.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "rheo/common.h"

#ifdef RHEO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace rheo {

struct AddRmsNormArgs {
  const void* x = nullptr;       // [rows, hidden]
  const void* delta = nullptr;   // [rows, hidden] or null
  const void* weight = nullptr;  // [hidden]
  void* residual_out = nullptr;  // [rows, hidden], written only with delta
  void* normed_out = nullptr;    // [rows, hidden]
  DType dtype = DType::kBFloat16;
  int64_t rows = 0, hidden = 0;
  int64_t x_stride = 0, delta_stride = 0;  // elements between rows
  float eps = 1e-5f;
  int64_t row_begin = 0, row_end = 0;  // the rows to compute (a thread's share)
};

struct RopeQkArgs {
  const void* qkv = nullptr;  // [rows, (H + 2 Hkv) D]
  const void* cos = nullptr;  // [rows, D / 2]
  const void* sin = nullptr;  // [rows, D / 2]
  void* q_out = nullptr;      // [rows, H, D]
  void* k_out = nullptr;      // [rows, Hkv, D]
  DType dtype = DType::kBFloat16;
  int64_t rows = 0, H = 0, Hkv = 0, D = 0;
  int64_t qkv_stride = 0;
  int64_t row_begin = 0, row_end = 0;
};

struct SiluMulArgs {
  const void* gate_up = nullptr;  // [rows, 2 I]
  void* out = nullptr;            // [rows, I]
  DType dtype = DType::kBFloat16;
  int64_t rows = 0, I = 0;
  int64_t gu_stride = 0;
  int64_t row_begin = 0, row_end = 0;
};

void add_rms_norm_cpu(const AddRmsNormArgs& args);
void rope_qk_cpu(const RopeQkArgs& args);
void silu_mul_cpu(const SiluMulArgs& args);
#ifdef RHEO_WITH_CUDA
cudaError_t add_rms_norm_cuda(const AddRmsNormArgs& args, cudaStream_t stream);
cudaError_t rope_qk_cuda(const RopeQkArgs& args, cudaStream_t stream);
cudaError_t silu_mul_cuda(const SiluMulArgs& args, cudaStream_t stream);
#endif

// --- shared by the CPU and CUDA twins ---------------------------------------------------------

// The lanes of the variance sum (see add_rms_norm above).
constexpr int kNormLanes = 32;

// 2^q as a float for -127 < q < 128 (the exponent bits); other q give junk the caller discards.
RHEO_HOST_DEVICE float pow2i_float(int32_t q) {
  const uint32_t bits = static_cast<uint32_t>(q + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp(d) as SLEEF's expf_u10 computes it (Naoki Shibata, Boost Software License): d = q ln2 + s
// with q = rint(d / ln2) (nearest even) and ln2 in two parts, a degree-6 polynomial in s with
// fused multiply-adds (SLEEF's AVX2 and AVX-512 builds use FMA; torch calls those), then 2^q
// applied as two factors; exp(d < -104) = 0, exp(d > 100) = inf, NaN stays NaN.
RHEO_HOST_DEVICE float sleef_expf(float d) {
  constexpr float kLog2e = 1.442695040888963407359924681001892137426645954152985934135449406931f;
  constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187045e-06f;
  float t = d * kLog2e;
  // Clamped (and NaN sent to 0) only so the conversion to int is defined: such d are replaced
  // below. |t| < 2^22, so adding and removing 1.5 * 2^23 rounds it to the nearest even integer.
  t = t > 256.0f ? 256.0f : (t < -256.0f ? -256.0f : (t == t ? t : 0.0f));
  const float qf = (t + 12582912.0f) - 12582912.0f;
  const int32_t q = static_cast<int32_t>(qf);
  float s = fmaf(qf, -kLn2Hi, d);
  s = fmaf(qf, -kLn2Lo, s);
  float u = 0.000198527617612853646278381f;
  u = fmaf(u, s, 0.00139304355252534151077271f);
  u = fmaf(u, s, 0.00833336077630519866943359f);
  u = fmaf(u, s, 0.0416664853692054748535156f);
  u = fmaf(u, s, 0.166666671633720397949219f);
  u = fmaf(u, s, 0.5f);
  u = 1.0f + fmaf(s * s, u, s);
  const int32_t half = q >> 1;
  u = (u * pow2i_float(half)) * pow2i_float(q - half);
  if (d < -104.0f) u = 0.0f;
  if (100.0f < d) u = INFINITY;
  return u;
}

// silu(g) = g / (1 + exp(-g)), torch's formula and roundings (float32).
RHEO_HOST_DEVICE float silu_float(float g) { return g / (1.0f + sleef_expf(-g)); }

}  // namespace rheo
