// Quantized linear layer: y = x W^T with W kept in llama.cpp's GGUF block formats (Q8_0, Q4_0,
// Q4_1), as llama.cpp computes it: each row of x is quantized once per matmul to Q8 blocks of 32
// (int8 codes + a float32 scale), each (W block, x block) pair gives an exact int32 dot product,
// and the float scale products are summed over the blocks in one fixed order. So a row's bits do
// not depend on the ISA path, the thread count or how many rows run with it (docs/kernels.md).
//
// Weight formats (GGUF, ggml-common.h), a block = 32 consecutive columns of one W row:
//   Q8_0  fp16 d, int8 q[32]               w = d * q
//   Q4_0  fp16 d, uint8 qs[16]             w = d * (q - 8), q in 0..15
//   Q4_1  fp16 d, fp16 m, uint8 qs[16]     w = d * q + m
//   (Q4: column j < 16 is the low nibble of qs[j], column j + 16 its high nibble.)
// Packed layout (what the kernels read; rheo_engine/models/quant.py repacks a GGUF tensor to it):
//   W rows in panels of kQuantPanel = 16 (the last padded with zero scales), each panel's blocks
//   in column order, one record of quant_record_bytes(type) bytes per (panel, block):
//     d[16] fp16 (row r of the panel at r), then for Q4_1 m[16] fp16, then the codes:
//     Q8_0  8 chunks c of [16 rows][4 bytes]: column 4c + j of row r at c * 64 + 4r + j
//     Q4    4 chunks c of [16 rows][4 bytes]: byte (c, r, j) = qs[4c + j] of row r, i.e. column
//           4c + j in its low nibble and column 16 + 4c + j in its high nibble
//   so 4 consecutive columns of 16 rows are one 64-byte vector: a broadcast of 4 bytes of x and
//   one vpdpbusd (or maddubs + madd) give 16 rows' partial dot products, one per 32-bit lane.
//   A record has exactly the bytes of its 16 GGUF blocks (Q8_0 544, Q4_0 288, Q4_1 320).
//
// Activation quantization (quantize_rows_q8), per row i and block b of 32 columns of x:
//   amax = max |x|; xd = amax / 127; id = amax != 0 ? 127 / amax : 0;
//   xq = nearbyint(x * id) (ties to even, clamped to [-127, 127]); xs = sum xq; xm = xd * xs.
// (llama.cpp's quantize_row_q8_0/q8_1 round the scale and the sum to fp16 and round ties away
// from zero in the reference path but to even in the AVX2 one; here they are float32, one rule.)
// The dot product of output row o and row i, over blocks b = 0, 1, ... in order (float32):
//   isum = sum_k q_w[k] * xq[k] exactly in int32, minus 8 * xs for Q4_0;
//   acc = fma(d_w * xd, float(isum), acc);   and for Q4_1 then   acc = fma(m_w, xm, acc);
//   y[i, o] = acc rounded once to y's dtype (bf16: to nearest even).
#pragma once

#include <cstdint>
#include <string>

#include "rheo/common.h"

#ifdef RHEO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace rheo {

enum class QuantType : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

constexpr int64_t kQuantBlock = 32;  // columns of one block
constexpr int64_t kQuantPanel = 16;  // W rows of one panel

// Bytes of one packed (panel, block) record: 16 rows' scales (and mins), then their codes.
RHEO_HOST_DEVICE int64_t quant_record_bytes(QuantType type) {
  return type == QuantType::kQ8_0 ? 32 + 512 : type == QuantType::kQ4_0 ? 32 + 256 : 64 + 256;
}

// Code of row r of its panel, column k of its block, in a record's code bytes (the layout above).
RHEO_HOST_DEVICE int32_t quant_code_at(const uint8_t* codes, QuantType type, int64_t r,
                                       int64_t k) {
  if (type == QuantType::kQ8_0) return static_cast<int8_t>(codes[(k / 4) * 64 + 4 * r + k % 4]);
  const uint8_t byte = codes[((k % 16) / 4) * 64 + 4 * r + k % 4];
  return k < 16 ? (byte & 0x0F) : (byte >> 4);
}

// A weight's value from its code q and its row's scale d and min m, as gguf.quants computes it in
// float32: Q8_0 d * q; Q4_0 d * (q - 8); Q4_1 d * q + m (a product, then a sum: the sources build
// without contraction, -ffp-contract=off and nvcc's -fmad=false).
RHEO_HOST_DEVICE float quant_value(QuantType type, int32_t code, float d, float m) {
  const float q = static_cast<float>(code);
  return type == QuantType::kQ8_0 ? d * q : type == QuantType::kQ4_0 ? d * (q - 8.0f) : d * q + m;
}

// x quantized to Q8 blocks: xq [n, in] int8, xd, xm [n, in / 32] float32, xs [n, in / 32] int32.
struct QuantRowsArgs {
  const void* x = nullptr;  // [n, in], row stride x_stride (elements), last dim dense
  DType dtype = DType::kBFloat16;  // of x: kBFloat16 or kFloat32
  int64_t n = 0, in = 0, x_stride = 0;
  int8_t* xq = nullptr;   // [n, in]
  float* xd = nullptr;    // [n, in / 32] scale of each block
  int32_t* xs = nullptr;  // [n, in / 32] sum of each block's codes
  float* xm = nullptr;    // [n, in / 32] xd * xs (Q4_1's m term)
};

struct QuantLinearArgs {
  const int8_t* xq = nullptr;   // [n, in]      (QuantRowsArgs' outputs)
  const float* xd = nullptr;    // [n, in / 32]
  const int32_t* xs = nullptr;  // [n, in / 32]
  const float* xm = nullptr;    // [n, in / 32]
  const uint8_t* w = nullptr;   // [ceil(out / 16), in / 32, quant_record_bytes(type)] packed W
  QuantType type = QuantType::kQ8_0;
  void* y = nullptr;  // [n, out], row stride y_stride (elements)
  DType dtype = DType::kBFloat16;  // of y: kBFloat16 or kFloat32
  int64_t n = 0, in = 0, out = 0, y_stride = 0;
  int64_t p_begin = 0, p_end = 0;  // the panels to compute (y's columns 16 p .. 16 p + 15 < out)
};
// Rules: in % 32 == 0, n >= 0, x_stride >= in, y_stride >= out,
// 0 <= p_begin <= p_end <= ceil(out / 16). A caller splits the work by giving each thread panels.

// QuantLinearArgs' rules (y's dtype apart), checked by both kernels before any work.
inline void check_quant_linear_args(const QuantLinearArgs& a) {
  RHEO_CHECK(a.n >= 0 && a.out >= 0 && a.in >= 0 && a.in % kQuantBlock == 0,
             "quant_linear needs n, out >= 0 and in a multiple of 32, got n=", a.n, ", in=", a.in,
             ", out=", a.out);
  const int64_t panels = (a.out + kQuantPanel - 1) / kQuantPanel;
  RHEO_CHECK(0 <= a.p_begin && a.p_begin <= a.p_end && a.p_end <= panels,
             "quant_linear needs 0 <= p_begin <= p_end <= ", panels, " panels, got [", a.p_begin,
             ", ", a.p_end, ")");
  RHEO_CHECK(a.y_stride >= a.out, "quant_linear needs y_stride >= out=", a.out, ", got ",
             a.y_stride);
}

// Rows of a packed W, dequantized (an embedding table kept quantized):
//   out[i, :] = W[ids[i], :], each value quant_value's (as gguf.quants computes it in float32),
//   then rounded once to out's dtype (bf16: to nearest even).
struct QuantGatherArgs {
  const uint8_t* w = nullptr;   // [ceil(rows / 16), in / 32, quant_record_bytes(type)] packed W
  QuantType type = QuantType::kQ8_0;
  int64_t rows = 0, in = 0;     // W's shape [rows, in]
  const int64_t* ids = nullptr;  // [n] row ids in [0, rows)
  int64_t n = 0;
  void* out = nullptr;          // [n, in] contiguous
  DType dtype = DType::kBFloat16;  // of out: kBFloat16 or kFloat32
};
// Rules: in % 32 == 0, n >= 0, 0 <= ids[i] < rows. ids are host memory for the CPU kernel, which
// checks each; device memory for the CUDA one, which clamps a bad id into range (no check without
// a sync: the result is then meaningless, as for tree_attention's arrays).

void quantize_rows_q8_cpu(const QuantRowsArgs& args);
void quant_gather_rows_cpu(const QuantGatherArgs& args);
void quant_linear_cpu(const QuantLinearArgs& args);
// The AMX-INT8 path of quant_linear_cpu (8+ rows; the same bits as every path): which tiles it runs
// on, "hardware", "emulated" (the instructions' semantics in C++, for tests) or "off"; the mode
// "auto" (hardware where granted and self-checked; RHEO_AMX=off at start: off), "off" or
// "emulate" (where the CPU has the VNNI path's AVX-512), returning the state after; and the
// self-check of the path's logic on emulated tiles (false without AVX-512 VNNI).
std::string quant_linear_amx();
std::string set_quant_linear_amx(const std::string& mode);
bool quant_linear_amx_self_check();
#ifdef RHEO_WITH_CUDA
cudaError_t quantize_rows_q8_cuda(const QuantRowsArgs& args, cudaStream_t stream);
cudaError_t quant_linear_cuda(const QuantLinearArgs& args, cudaStream_t stream);
cudaError_t quant_gather_rows_cuda(const QuantGatherArgs& args, cudaStream_t stream);
#endif

}  // namespace rheo
