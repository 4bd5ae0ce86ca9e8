// Quantized linear layer on the CPU (csrc/include/rheo/quant_linear.h): y = x W^T with W in
// packed Q8_0 / Q4_0 / Q4_1 panels, x quantized once per matmul to Q8 blocks.
//
// Work split: the caller hands each thread whole panels (16 W rows). Within a panel the blocks
// run in column order; for each block, the rows of x pass kGroup at a time over the block's record
// (288-544 bytes, in L1), each row's 16 int32 dot products held in vector lanes (lane r = W row r
// of the panel), so W is read from memory once for all n rows. The float step of each (row,
// block) is the header's: acc = fma(d_w * xd, float(isum), acc) (+ fma(m_w, xm, acc) for Q4_1),
// lane by lane, with acc kept per (row, W row) in `acc` [n, 16] across the blocks.
//
// Three paths, one arithmetic: the integer dot products are exact whatever instruction computes
// them (AVX-512 VNNI vpdpbusd, AVX2 maddubs + madd, or the portable loop), and the float steps
// are the same IEEE operations in the same order lane by lane, so every path, thread count and
// row count gives the same bits (tests/test_quant_linear.py). The VNNI path runs where the
// dispatch level (rheo/common.h cpu::active_isa) is AVX-512 and the CPU has AVX-512 BW + VNNI; the
// AVX2 path where the level is AVX2 or above and the CPU has FMA and F16C; else the portable one.
// At 8+ rows on such a CPU with AMX-INT8 that the OS grants (and that passes a self-check), the
// AMX path computes the same exact integer dot products with tile products (tdpbssd) 16 x rows
// at a time and does the VNNI path's float steps on them (docs/kernels.md §11).
#include "rheo/quant_linear.h"

#include "cpu_math.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RHEO_HAVE_X86_PATHS 1
#endif

#if defined(RHEO_HAVE_X86_PATHS) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#define RHEO_HAVE_AMX_PATH 1
#endif

namespace rheo {
namespace {

using cpu::bf16_to_float;
using cpu::float_to_bf16;
using cpu::half_to_float;

constexpr int64_t kChunks = 8;  // 4-column chunks per block

inline float load_x(const void* x, DType dtype, int64_t i) {
  return dtype == DType::kBFloat16 ? bf16_to_float(static_cast<const uint16_t*>(x)[i])
                                   : static_cast<const float*>(x)[i];
}

inline void store_y(const QuantLinearArgs& a, int64_t i, int64_t o, float v) {
  if (a.dtype == DType::kBFloat16)
    static_cast<uint16_t*>(a.y)[i * a.y_stride + o] = float_to_bf16(v);
  else
    static_cast<float*>(a.y)[i * a.y_stride + o] = v;
}

// y's columns of panel p from its sums acc [n, 16], each rounded once to y's dtype.
void store_portable(const QuantLinearArgs& a, int64_t p, const float* acc) {
  const int64_t rows = std::min(kQuantPanel, a.out - p * kQuantPanel);
  for (int64_t i = 0; i < a.n; ++i)
    for (int64_t r = 0; r < rows; ++r) store_y(a, i, p * kQuantPanel + r, acc[i * kQuantPanel + r]);
}

// The float step of one (row, block) for one lane, as the header defines it.
inline float block_step(float acc, float d_w, float m_w, float xd, float xm, int32_t isum,
                        bool has_m) {
  acc = std::fma(d_w * xd, static_cast<float>(isum), acc);
  return has_m ? std::fma(m_w, xm, acc) : acc;
}

// --- portable path -----------------------------------------------------------------------------

// wq[r][k] = the code of panel row r, block column k (the header's layout), read byte by byte in
// order: chunk c, row r, byte j holds column 4c + j (Q8_0), or 4c + j and 16 + 4c + j (Q4).
void unpack_codes(const uint8_t* codes, QuantType type, int16_t wq[][kQuantBlock]) {
  const int chunks = type == QuantType::kQ8_0 ? 8 : 4;
  for (int c = 0; c < chunks; ++c)
    for (int r = 0; r < kQuantPanel; ++r)
      for (int j = 0; j < 4; ++j) {
        const uint8_t byte = codes[c * 64 + 4 * r + j];
        if (type == QuantType::kQ8_0) {
          wq[r][4 * c + j] = static_cast<int8_t>(byte);
        } else {
          wq[r][4 * c + j] = byte & 0x0F;
          wq[r][16 + 4 * c + j] = byte >> 4;
        }
      }
}

void panel_portable(const QuantLinearArgs& a, int64_t p, float* acc /* [n, 16] */) {
  const int64_t nb = a.in / kQuantBlock, rec = quant_record_bytes(a.type);
  const bool has_m = a.type == QuantType::kQ4_1;
  const uint8_t* panel = a.w + p * nb * rec;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* record = panel + b * rec;
    const uint16_t* d = reinterpret_cast<const uint16_t*>(record);   // [16] fp16
    const uint16_t* m = d + kQuantPanel;                             // [16] fp16 (Q4_1)
    const uint8_t* codes = record + (has_m ? 64 : 32);
    int16_t wq[kQuantPanel][kQuantBlock];  // the record's codes, unpacked once for all rows
    unpack_codes(codes, a.type, wq);
    for (int64_t i = 0; i < a.n; ++i) {
      const int8_t* xq = a.xq + i * a.in + b * kQuantBlock;  // [32]
      const int64_t ib = i * nb + b;
      for (int r = 0; r < kQuantPanel; ++r) {
        int32_t isum = 0;
        for (int k = 0; k < kQuantBlock; ++k) isum += wq[r][k] * xq[k];
        if (a.type == QuantType::kQ4_0) isum -= 8 * a.xs[ib];
        float& s = acc[i * kQuantPanel + r];
        s = block_step(s, half_to_float(d[r]), has_m ? half_to_float(m[r]) : 0.0f, a.xd[ib],
                       a.xm[ib], isum, has_m);
      }
    }
  }
  store_portable(a, p, acc);
}

#ifdef RHEO_HAVE_X86_PATHS
// --- AVX2 path: 8 lanes = 8 W rows, two halves per panel ---------------------------------------

#define RHEO_AVX2 __attribute__((target("avx2,fma,f16c")))
#define RHEO_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

constexpr int kGroup2 = 4;  // x rows per pass: 2 x 4 int32 accumulators + 4 broadcasts in ymm

RHEO_AVX2_INLINE __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// The 4 bytes of x at p, in every 32-bit lane.
RHEO_AVX2_INLINE __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Lane-wise sum of 4 products u8 * s8 (u <= 128 or s8 small enough for maddubs not to saturate:
// |u * s| * 2 <= 128 * 127 * 2 < 2^15).
RHEO_AVX2_INLINE __m256i dot4(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Exact int32 dot products of the panel's 16 W rows (half h: rows 8h..8h+7) with x rows
// xq[0..G-1] over one block, into isum[g][h].
template <int G>
RHEO_AVX2_INLINE void block_dots_avx2(QuantType type, const uint8_t* codes,
                                      const int8_t* const* xq, __m256i isum[][2]) {
  for (int g = 0; g < G; ++g) isum[g][0] = isum[g][1] = _mm256_setzero_si256();
  if (type == QuantType::kQ8_0) {
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) {
      __m256i xb[G];
      for (int g = 0; g < G; ++g) xb[g] = broadcast4(xq[g] + 4 * c);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        // maddubs wants u8 * s8: |w| * (x with w's sign), exact (|w| <= 128).
        const __m256i w = load32(codes + c * 64 + 32 * h);
        const __m256i aw = _mm256_abs_epi8(w);
        for (int g = 0; g < G; ++g)
          isum[g][h] = _mm256_add_epi32(isum[g][h], dot4(aw, _mm256_sign_epi8(xb[g], w)));
      }
    }
    return;
  }
  // Q4: the int16 pair sums of maddubs (|.| <= 2 * 15 * 127 = 3810) of all 8 chunk halves of the
  // block add up exactly in int16 (|.| <= 30480 < 2^15), so one madd per block widens them.
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i s16[G][2];
  for (int g = 0; g < G; ++g) s16[g][0] = s16[g][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i v = load32(codes + c * 64 + 32 * h);
      const __m256i lo = _mm256_and_si256(v, low4);                         // columns 4c + j
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);   // columns 16 + 4c + j
      for (int g = 0; g < G; ++g) {
        const __m256i pl = _mm256_maddubs_epi16(lo, broadcast4(xq[g] + 4 * c));
        const __m256i ph = _mm256_maddubs_epi16(hi, broadcast4(xq[g] + 16 + 4 * c));
        const __m256i s = _mm256_add_epi16(pl, ph);
        s16[g][h] = _mm256_add_epi16(s16[g][h], s);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int h = 0; h < 2; ++h) isum[g][h] = _mm256_madd_epi16(s16[g][h], _mm256_set1_epi16(1));
}

template <int G>
RHEO_AVX2_INLINE void group_avx2(const QuantLinearArgs& a, const uint8_t* record, int64_t b,
                                 int64_t i0, __m256 accv[][2]) {
  const int64_t nb = a.in / kQuantBlock;
  const bool has_m = a.type == QuantType::kQ4_1;
  const int8_t* xq[G];
  for (int g = 0; g < G; ++g) xq[g] = a.xq + (i0 + g) * a.in + b * kQuantBlock;
  __m256i isum[G][2];
  block_dots_avx2<G>(a.type, record + (has_m ? 64 : 32), xq, isum);
  for (int h = 0; h < 2; ++h) {
    const __m128i* halves = reinterpret_cast<const __m128i*>(record);  // 8 fp16 each
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(halves + h));
    const __m256 m = has_m ? _mm256_cvtph_ps(_mm_loadu_si128(halves + 2 + h)) : _mm256_setzero_ps();
    for (int g = 0; g < G; ++g) {
      const int64_t ib = (i0 + g) * nb + b;
      __m256i is = isum[g][h];
      if (a.type == QuantType::kQ4_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(8 * a.xs[ib]));
      __m256 v = accv[g][h];
      v = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a.xd[ib])), _mm256_cvtepi32_ps(is), v);
      if (has_m) v = _mm256_fmadd_ps(m, _mm256_set1_ps(a.xm[ib]), v);
      accv[g][h] = v;
    }
  }
}

// x rows i0..i0+G-1 against every block of the panel, their sums kept in registers (as rows_vnni).
template <int G>
RHEO_AVX2_INLINE void rows_avx2(const QuantLinearArgs& a, const uint8_t* panel, int64_t i0,
                                float* acc) {
  const int64_t nb = a.in / kQuantBlock, rec = quant_record_bytes(a.type);
  __m256 accv[G][2];
  for (int g = 0; g < G; ++g)
    for (int h = 0; h < 2; ++h) accv[g][h] = _mm256_loadu_ps(acc + (i0 + g) * kQuantPanel + 8 * h);
  for (int64_t b = 0; b < nb; ++b) group_avx2<G>(a, panel + b * rec, b, i0, accv);
  for (int g = 0; g < G; ++g)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + (i0 + g) * kQuantPanel + 8 * h, accv[g][h]);
}

// 8 floats rounded to bf16 as cpu::float_to_bf16 (to nearest even; NaN kept quiet), in 8 lanes.
RHEO_AVX2_INLINE __m128i bf16_of8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i round = _mm256_add_epi32(
      _mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)),
      _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1)));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  const __m256i quiet = _mm256_or_si256(x, _mm256_set1_epi32(0x400000));  // bit 6 of the bf16
  const __m256i h = _mm256_srli_epi32(_mm256_blendv_epi8(round, quiet, nan), 16);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8));
}

// store_portable, a full panel's 16 columns as 2 vectors per row.
RHEO_AVX2_INLINE void store_avx2(const QuantLinearArgs& a, int64_t p, const float* acc) {
  if (a.out - p * kQuantPanel < kQuantPanel) return store_portable(a, p, acc);
  for (int64_t i = 0; i < a.n; ++i) {
    const float* s = acc + i * kQuantPanel;
    const int64_t o = i * a.y_stride + p * kQuantPanel;
    if (a.dtype == DType::kFloat32) {
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_ps(static_cast<float*>(a.y) + o + 8 * h, _mm256_loadu_ps(s + 8 * h));
    } else {
      for (int h = 0; h < 2; ++h)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.y) + o + 8 * h),
                         bf16_of8(_mm256_loadu_ps(s + 8 * h)));
    }
  }
}

RHEO_AVX2 void panel_avx2(const QuantLinearArgs& a, int64_t p, float* acc) {
  const int64_t nb = a.in / kQuantBlock, rec = quant_record_bytes(a.type);
  const uint8_t* panel = a.w + p * nb * rec;
  int64_t i0 = 0;
  for (; i0 + kGroup2 <= a.n; i0 += kGroup2) rows_avx2<kGroup2>(a, panel, i0, acc);
  for (; i0 + 2 <= a.n; i0 += 2) rows_avx2<2>(a, panel, i0, acc);
  for (; i0 < a.n; ++i0) rows_avx2<1>(a, panel, i0, acc);
  store_avx2(a, p, acc);
}

// GCC 12 flags the AVX-512 intrinsics' own _mm512_undefined_* passthroughs as maybe-uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// --- AVX-512 VNNI path: 16 lanes = the whole panel ---------------------------------------------

#define RHEO_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))
#define RHEO_VNNI_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512vnni,f16c"), always_inline)) inline

constexpr int kGroup512 = 6;  // x rows per pass (6 measured 4-8% faster than 8 at 16-64 rows)

RHEO_VNNI_INLINE __m512i broadcast4_512(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// A Q4 code vector's low and high nibbles as bytes (of chunk c: columns 4c + j, 16 + 4c + j).
RHEO_VNNI_INLINE void nibbles_512(__m512i v, __m512i& lo, __m512i& hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(v, low4);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
}

// The header's float steps of one block for x rows i0..i0+G-1, lane by lane (16 lanes = the
// panel's W rows): from their exact dot products isum[g] less offset * xs into accv[g]. Every
// 16-lane path (VNNI, AMX) runs this one copy, so they round alike.
template <int G>
RHEO_VNNI_INLINE void block_steps_512(const QuantLinearArgs& a, const uint8_t* record, int64_t b,
                                      int64_t i0, const __m512i* isum, int32_t offset,
                                      __m512* accv) {
  const int64_t nb = a.in / kQuantBlock;
  const bool has_m = a.type == QuantType::kQ4_1;
  const __m256i* halves = reinterpret_cast<const __m256i*>(record);  // 16 fp16 each
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(halves));
  const __m512 m = has_m ? _mm512_cvtph_ps(_mm256_loadu_si256(halves + 1)) : _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    const int64_t ib = (i0 + g) * nb + b;
    __m512i is = isum[g];
    if (offset != 0) is = _mm512_sub_epi32(is, _mm512_set1_epi32(offset * a.xs[ib]));
    __m512 v = accv[g];
    v = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.xd[ib])), _mm512_cvtepi32_ps(is), v);
    if (has_m) v = _mm512_fmadd_ps(m, _mm512_set1_ps(a.xm[ib]), v);
    accv[g] = v;
  }
}

// One block of the panel for x rows i0..i0+G-1: their sums accv[g] (16 lanes) updated in place.
template <int G>
RHEO_VNNI_INLINE void group_vnni(const QuantLinearArgs& a, const uint8_t* record, int64_t b,
                                 int64_t i0, __m512* accv) {
  const uint8_t* codes = record + (a.type == QuantType::kQ4_1 ? 64 : 32);
  const int8_t* xq[G];
  for (int g = 0; g < G; ++g) xq[g] = a.xq + (i0 + g) * a.in + b * kQuantBlock;
  __m512i isum[G];
  for (int g = 0; g < G; ++g) isum[g] = _mm512_setzero_si512();
  if (a.type == QuantType::kQ8_0) {
    // vpdpbusd multiplies u8 by s8: w + 128 (w xor 0x80) times x, exact; 128 * xs taken off below.
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) {
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(codes + c * 64), flip);
      for (int g = 0; g < G; ++g)
        isum[g] = _mm512_dpbusd_epi32(isum[g], w, broadcast4_512(xq[g] + 4 * c));
    }
  } else {
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i lo, hi;
      nibbles_512(_mm512_loadu_si512(codes + c * 64), lo, hi);
      for (int g = 0; g < G; ++g) {
        isum[g] = _mm512_dpbusd_epi32(isum[g], lo, broadcast4_512(xq[g] + 4 * c));
        isum[g] = _mm512_dpbusd_epi32(isum[g], hi, broadcast4_512(xq[g] + 16 + 4 * c));
      }
    }
  }
  const int32_t offset = a.type == QuantType::kQ8_0 ? 128 : a.type == QuantType::kQ4_0 ? 8 : 0;
  block_steps_512<G>(a, record, b, i0, isum, offset, accv);
}

// x rows i0..i0+G-1 against every block of the panel, their sums kept in registers; the panel
// (nb records, 5-15 KiB for SmolLM2) comes from memory for the first group and from L1/L2 after.
template <int G>
RHEO_VNNI_INLINE void rows_vnni(const QuantLinearArgs& a, const uint8_t* panel, int64_t i0,
                                float* acc) {
  const int64_t nb = a.in / kQuantBlock, rec = quant_record_bytes(a.type);
  __m512 accv[G];
  for (int g = 0; g < G; ++g) accv[g] = _mm512_loadu_ps(acc + (i0 + g) * kQuantPanel);
  for (int64_t b = 0; b < nb; ++b) group_vnni<G>(a, panel + b * rec, b, i0, accv);
  for (int g = 0; g < G; ++g) _mm512_storeu_ps(acc + (i0 + g) * kQuantPanel, accv[g]);
}

// store_portable in 16 lanes: a row's columns of the panel in one (masked) store.
RHEO_VNNI_INLINE void store_vnni(const QuantLinearArgs& a, int64_t p, const float* acc) {
  const int64_t rows = std::min(kQuantPanel, a.out - p * kQuantPanel);
  const __mmask16 k = static_cast<__mmask16>((1u << rows) - 1);
  for (int64_t i = 0; i < a.n; ++i) {
    const __m512 v = _mm512_loadu_ps(acc + i * kQuantPanel);
    const int64_t o = i * a.y_stride + p * kQuantPanel;
    if (a.dtype == DType::kFloat32) {
      _mm512_mask_storeu_ps(static_cast<float*>(a.y) + o, k, v);
      continue;
    }
    // as cpu::float_to_bf16: to nearest even, a NaN kept with its quiet bit set
    const __m512i x = _mm512_castps_si512(v);
    const __m512i round = _mm512_add_epi32(
        _mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)),
        _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1)));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(x, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    const __m512i quiet = _mm512_or_si512(x, _mm512_set1_epi32(0x400000));
    const __m512i h = _mm512_srli_epi32(_mm512_mask_mov_epi32(round, nan, quiet), 16);
    _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(a.y) + o, k, h);
  }
}

RHEO_VNNI void panel_vnni(const QuantLinearArgs& a, int64_t p, float* acc) {
  const int64_t nb = a.in / kQuantBlock, rec = quant_record_bytes(a.type);
  const uint8_t* panel = a.w + p * nb * rec;
  int64_t i0 = 0;
  for (; i0 + kGroup512 <= a.n; i0 += kGroup512) rows_vnni<kGroup512>(a, panel, i0, acc);
  for (; i0 + 4 <= a.n; i0 += 4) rows_vnni<4>(a, panel, i0, acc);
  for (; i0 + 2 <= a.n; i0 += 2) rows_vnni<2>(a, panel, i0, acc);
  for (; i0 < a.n; ++i0) rows_vnni<1>(a, panel, i0, acc);
  store_vnni(a, p, acc);
}

#ifdef RHEO_HAVE_AMX_PATH
// --- AMX-INT8 path: tile products of 16 W rows x up to 16 x rows, the VNNI path's float steps ---
//
// Per block, tile A (tmm1) holds R x rows' 32 codes as stored (xq's rows, one stride apart), tile
// B (tmm2) the panel's codes as signed bytes in the record's own order (chunk c: 16 W rows x 4
// columns = B's row c; Q4 nibbles unpacked into 8 such rows, low then high: columns 0..31), and
// tdpbssd gives C (tmm0) [R x rows][16 W rows] = the exact int32 dot products, in the lanes
// group_vnni holds them in. Stored, each x row's 16 sums take the same float steps as there.
// A tile product is exact integer arithmetic, so the bits are the other paths'; x rows past the
// last full group of R run the VNNI path. Tiles: tmm0 C, tmm1 A, tmm2 B (the intrinsics take the
// tile as a literal). AmxTiles runs the instructions; AmxEmulated is their documented semantics in
// plain C++ (Intel SDM: TILELOADD, TILESTORED, TILEZERO, TDPBSSD), which the tests run on any
// AVX-512 CPU to check this path's logic where no AMX exists.

#define RHEO_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni,f16c")))
#define RHEO_AMX_INLINE \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni,f16c"), always_inline)) inline

constexpr int kAmxRows = 16;     // x rows a tile product takes
constexpr int kAmxMinRows = 8;   // fewer rows run the VNNI path (a tile product's fixed cost)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The configuration for R x rows: C [R][16 int32], A [R][32 bytes], B [8][64 bytes].
inline TileConfig tile_config(int r) {
  TileConfig c;
  c.rows[0] = static_cast<uint8_t>(r), c.colsb[0] = 64;
  c.rows[1] = static_cast<uint8_t>(r), c.colsb[1] = kQuantBlock;
  c.rows[2] = kChunks, c.colsb[2] = 64;
  return c;
}

struct AmxTiles {
  static RHEO_AMX_INLINE void configure(const TileConfig& c) { _tile_loadconfig(&c); }
  static RHEO_AMX_INLINE void release() { _tile_release(); }
  static RHEO_AMX_INLINE void load_a(const void* p, int64_t stride) { _tile_loadd(1, p, stride); }
  static RHEO_AMX_INLINE void load_b(const void* p) { _tile_loadd(2, p, 64); }
  static RHEO_AMX_INLINE void product() {
    _tile_zero(0);
    _tile_dpbssd(0, 1, 2);
  }
  static RHEO_AMX_INLINE void store_c(int32_t* p) { _tile_stored(0, p, 64); }
};

struct AmxEmulated {
  struct Tile {
    int rows = 0, colsb = 0;
    uint8_t data[16][64] = {};
  };
  static Tile* tiles() {
    thread_local Tile t[3];
    return t;
  }
  static void configure(const TileConfig& c) {
    for (int t = 0; t < 3; ++t) tiles()[t] = Tile{c.rows[t], c.colsb[t], {}};  // zeroed
  }
  static void release() { configure(TileConfig{}); }
  static void load(Tile& t, const void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r)
      for (int j = 0; j < 64; ++j)
        t.data[r][j] = r < t.rows && j < t.colsb
                           ? static_cast<const uint8_t*>(p)[r * stride + j] : uint8_t{0};
  }
  static void load_a(const void* p, int64_t stride) { load(tiles()[1], p, stride); }
  static void load_b(const void* p) { load(tiles()[2], p, 64); }
  static void product() {  // TILEZERO tmm0; TDPBSSD tmm0, tmm1, tmm2
    Tile &c = tiles()[0], &a = tiles()[1], &b = tiles()[2];
    for (int m = 0; m < c.rows; ++m)
      for (int n = 0; n < c.colsb / 4; ++n) {
        int32_t sum = 0;
        for (int k = 0; k < a.colsb / 4; ++k)
          for (int i = 0; i < 4; ++i)
            sum += static_cast<int8_t>(a.data[m][4 * k + i]) *
                   static_cast<int8_t>(b.data[k][4 * n + i]);
        std::memcpy(&c.data[m][4 * n], &sum, 4);
      }
  }
  static void store_c(int32_t* p) {
    const Tile& c = tiles()[0];
    for (int m = 0; m < c.rows; ++m) std::memcpy(p + m * 16, c.data[m], c.colsb);
  }
};

// One block of the panel for the R x rows i0..: their sums accv[g] updated as group_vnni does.
template <class Tiles, int R>
RHEO_AMX_INLINE void group_amx(const QuantLinearArgs& a, const uint8_t* record, int64_t b,
                               int64_t i0, __m512* accv) {
  const uint8_t* codes = record + (a.type == QuantType::kQ4_1 ? 64 : 32);
  alignas(64) uint8_t unpacked[kChunks * 64];
  const uint8_t* wb = codes;
  if (a.type != QuantType::kQ8_0) {  // nibbles to bytes: chunks 0-3 low (columns 0-15), 4-7 high
    for (int c = 0; c < 4; ++c) {
      __m512i lo, hi;
      nibbles_512(_mm512_loadu_si512(codes + c * 64), lo, hi);
      _mm512_store_si512(unpacked + c * 64, lo);
      _mm512_store_si512(unpacked + (4 + c) * 64, hi);
    }
    wb = unpacked;
  }
  alignas(64) int32_t sums[kAmxRows * 16];
  Tiles::load_a(a.xq + i0 * a.in + b * kQuantBlock, a.in);
  Tiles::load_b(wb);
  Tiles::product();
  Tiles::store_c(sums);
  __m512i isum[R];
  for (int g = 0; g < R; ++g) isum[g] = _mm512_load_si512(sums + g * 16);
  const int32_t offset = a.type == QuantType::kQ4_0 ? 8 : 0;  // (tdpbssd takes Q8_0 as signed)
  block_steps_512<R>(a, record, b, i0, isum, offset, accv);
}

template <class Tiles, int R>
RHEO_AMX_INLINE void rows_amx(const QuantLinearArgs& a, const uint8_t* panel, int64_t i0,
                              float* acc) {
  const int64_t nb = a.in / kQuantBlock, rec = quant_record_bytes(a.type);
  __m512 accv[R];
  for (int g = 0; g < R; ++g) accv[g] = _mm512_loadu_ps(acc + (i0 + g) * kQuantPanel);
  for (int64_t b = 0; b < nb; ++b) group_amx<Tiles, R>(a, panel + b * rec, b, i0, accv);
  for (int g = 0; g < R; ++g) _mm512_storeu_ps(acc + (i0 + g) * kQuantPanel, accv[g]);
}

// Panels p_begin..p_end: x rows in tile products of R = min(16, n) (configured once per call),
// the rows past the last full one by the VNNI path.
template <class Tiles, int R>
RHEO_AMX void panels_amx(const QuantLinearArgs& a, float* acc) {
  const int64_t nb = a.in / kQuantBlock, rec = quant_record_bytes(a.type);
  Tiles::configure(tile_config(R));
  for (int64_t p = a.p_begin; p < a.p_end; ++p) {
    std::fill(acc, acc + a.n * kQuantPanel, 0.0f);
    const uint8_t* panel = a.w + p * nb * rec;
    int64_t i0 = 0;
    for (; i0 + R <= a.n; i0 += R) rows_amx<Tiles, R>(a, panel, i0, acc);
    for (; i0 + 4 <= a.n; i0 += 4) rows_vnni<4>(a, panel, i0, acc);
    for (; i0 < a.n; ++i0) rows_vnni<1>(a, panel, i0, acc);
    store_vnni(a, p, acc);
  }
  Tiles::release();
}

template <class Tiles>
void run_amx(const QuantLinearArgs& a, float* acc) {
  switch (std::min<int64_t>(a.n, kAmxRows)) {  // R as a constant: the sums stay in registers
    case 8: return panels_amx<Tiles, 8>(a, acc);
    case 9: return panels_amx<Tiles, 9>(a, acc);
    case 10: return panels_amx<Tiles, 10>(a, acc);
    case 11: return panels_amx<Tiles, 11>(a, acc);
    case 12: return panels_amx<Tiles, 12>(a, acc);
    case 13: return panels_amx<Tiles, 13>(a, acc);
    case 14: return panels_amx<Tiles, 14>(a, acc);
    case 15: return panels_amx<Tiles, 15>(a, acc);
    default: return panels_amx<Tiles, 16>(a, acc);
  }
}
#endif  // RHEO_HAVE_AMX_PATH
#pragma GCC diagnostic pop
#endif  // RHEO_HAVE_X86_PATHS

#ifdef RHEO_HAVE_X86_PATHS
// What the VNNI path (and the AMX path's float steps) need of the CPU.
bool vnni_listed() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
}
#endif

// A panel: its sums into acc [n, 16] (zeroed by the caller), then y's 16 columns from them.
using PanelFn = void (*)(const QuantLinearArgs&, int64_t, float*);

PanelFn panel_fn() {
#ifdef RHEO_HAVE_X86_PATHS
  static const bool vnni = vnni_listed();
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  const cpu::Isa level = cpu::active_isa();
  if (vnni && level >= cpu::Isa::kAvx512) return &panel_vnni;
  if (avx2 && level >= cpu::Isa::kAvx2) return &panel_avx2;
#endif
  return &panel_portable;
}

#ifdef RHEO_HAVE_AMX_PATH
// --- when the AMX path runs --------------------------------------------------------------------
//
// AMX faults where the CPU lists it but the OS has not granted this process its tile state (Linux
// enables XTILEDATA per process on request), and some virtual machines list it and fault all the
// same. So it runs only after: CPUID lists AMX-TILE and AMX-INT8 (and the VNNI path's AVX-512 BW,
// VNNI, F16C), XCR0 has the tile state enabled, arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) grants
// it, a tile product in a forked child (a fault kills the child only) gives the right sums, and
// this path equals the portable one bit for bit on random panels of every type (amx_self_check).
// Any failure: the VNNI path, as on a CPU without AMX. RHEO_AMX=off turns it off.

enum AmxMode : int { kAmxOff = 0, kAmxAuto = 1, kAmxEmulate = 2 };

int amx_mode_from_env() {
  const char* v = std::getenv("RHEO_AMX");
  if (v == nullptr || *v == '\0' || std::string(v) == "auto") return kAmxAuto;
  if (std::string(v) == "off") return kAmxOff;
  fail("RHEO_AMX='", v, "' is not an AMX setting; use auto (the default: AMX-INT8 tiles where ",
       "the CPU and the OS grant them) or off");
}

std::atomic<int>& amx_mode() {
  static std::atomic<int> mode{amx_mode_from_env()};
  return mode;
}

bool amx_listed() {
  unsigned eax, ebx, ecx, edx;
  if (!vnni_listed() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return false;  // AMX-TILE, AMX-INT8
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return false;  // OSXSAVE
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & (3u << 17)) == (3u << 17);  // XTILECFG and XTILEDATA enabled by the OS
}

bool amx_granted() {
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // asm/prctl.h, the kernel's xfeature
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

// One tile product in a forked child: true when it exited normally with the right sums.
RHEO_AMX bool amx_probe() {
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    alignas(64) int8_t x[16 * kQuantBlock];
    alignas(64) uint8_t w[kChunks * 64];
    alignas(64) int32_t c[16 * 16];
    for (int i = 0; i < 16 * kQuantBlock; ++i) x[i] = static_cast<int8_t>(i * 37 - 100);
    for (int i = 0; i < kChunks * 64; ++i) w[i] = static_cast<uint8_t>(i * 59 + 3);
    AmxTiles::configure(tile_config(16));
    AmxTiles::load_a(x, kQuantBlock);
    AmxTiles::load_b(w);
    AmxTiles::product();
    AmxTiles::store_c(c);
    AmxTiles::release();
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        int32_t want = 0;
        for (int k = 0; k < kQuantBlock; ++k)
          want += x[m * kQuantBlock + k] * static_cast<int8_t>(w[(k / 4) * 64 + 4 * n + k % 4]);
        if (c[m * 16 + n] != want) _exit(1);
      }
    _exit(0);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return false;
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// The AMX path (with Tiles) against the portable one on random panels of each type, at row counts
// of one tile product of 8, 11 and 16 rows, and several with a VNNI tail: true when every y bit
// agrees.
template <class Tiles>
bool amx_self_check() {
  uint64_t state = 0x2545F4914F6CDD1Dull;
  auto next = [&]() {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state;
  };
  constexpr int64_t kIn = 3 * kQuantBlock, kOut = 40, kNb = kIn / kQuantBlock;
  for (QuantType type : {QuantType::kQ8_0, QuantType::kQ4_0, QuantType::kQ4_1}) {
    const int64_t rec = quant_record_bytes(type), panels = (kOut + kQuantPanel - 1) / kQuantPanel;
    std::vector<uint8_t> w(panels * kNb * rec);
    for (int64_t r = 0; r < panels * kNb; ++r) {
      uint8_t* record = w.data() + r * rec;
      const int scales = type == QuantType::kQ4_1 ? 32 : 16;
      for (int j = 0; j < scales; ++j) {  // fp16 scales and mins of any sign, 2^-14 .. 2^5
        const uint16_t h = static_cast<uint16_t>((next() & 0x83FF) | ((1 + next() % 20) << 10));
        std::memcpy(record + 2 * j, &h, 2);
      }
      for (int64_t j = 2 * scales; j < rec; ++j) record[j] = static_cast<uint8_t>(next());
    }
    for (int64_t n : {8, 11, 16, 37}) {
      std::vector<int8_t> xq(n * kIn);
      std::vector<float> xd(n * kNb), xm(n * kNb), want(n * kOut), got(n * kOut), acc(n * 16);
      std::vector<int32_t> xs(n * kNb);
      for (auto& v : xq) v = static_cast<int8_t>(static_cast<int>(next() % 255) - 127);
      for (int64_t ib = 0; ib < n * kNb; ++ib) {  // xs, xm as quantize_rows_q8 makes them
        xd[ib] = static_cast<float>(next() % 100000) * 1e-7f;
        xs[ib] = 0;
        for (int k = 0; k < kQuantBlock; ++k) xs[ib] += xq[ib * kQuantBlock + k];
        xm[ib] = xd[ib] * static_cast<float>(xs[ib]);
      }
      QuantLinearArgs a;
      a.xq = xq.data(), a.xd = xd.data(), a.xs = xs.data(), a.xm = xm.data(), a.w = w.data();
      a.type = type, a.dtype = DType::kFloat32, a.n = n, a.in = kIn, a.out = kOut;
      a.y_stride = kOut, a.p_begin = 0, a.p_end = panels;
      a.y = want.data();
      for (int64_t p = 0; p < panels; ++p) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        panel_portable(a, p, acc.data());
      }
      a.y = got.data();
      run_amx<Tiles>(a, acc.data());
      if (std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) != 0) return false;
    }
  }
  return true;
}

bool amx_available() {
  static const bool ok =
      amx_listed() && amx_granted() && amx_probe() && amx_self_check<AmxTiles>();
  return ok;
}

// Which tiles a call of n rows runs on: hardware, emulated (tests), or none (another path).
enum class AmxRun { kNone, kHardware, kEmulated };

AmxRun amx_run(int64_t n) {
  const int mode = amx_mode().load(std::memory_order_relaxed);
  if (mode == kAmxOff || n < kAmxMinRows || cpu::active_isa() < cpu::Isa::kAvx512)
    return AmxRun::kNone;
  if (mode == kAmxEmulate) return vnni_listed() ? AmxRun::kEmulated : AmxRun::kNone;
  return amx_available() ? AmxRun::kHardware : AmxRun::kNone;
}
#endif  // RHEO_HAVE_AMX_PATH

// --- activation quantization (the header's rule; every path gives the same bits) ---------------
//
// amax is a max over |x| (NaN skipped: `av > amax` is false for it), exact in any order; the
// codes are elementwise IEEE steps (v * id, round to nearest even, NaN -> 0, clamp) and their sum
// is an int32, so the vector paths below give the portable loop's bits.

// The block's scale, sum and Q4_1 term from amax and the sum of its codes.
inline void block_scales(const QuantRowsArgs& a, int64_t ib, float amax, int32_t sum) {
  const float d = amax / 127.0f;
  a.xd[ib] = d;
  a.xs[ib] = sum;
  a.xm[ib] = d * static_cast<float>(sum);
}

inline float inverse_scale(float amax) { return amax != 0.0f ? 127.0f / amax : 0.0f; }

void quantize_portable(const QuantRowsArgs& a) {
  const int64_t nb = a.in / kQuantBlock;
  for (int64_t i = 0; i < a.n; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      float v[kQuantBlock];  // x row i, block b, as float
      float amax = 0.0f;
      for (int k = 0; k < kQuantBlock; ++k) {
        v[k] = load_x(a.x, a.dtype, i * a.x_stride + b * kQuantBlock + k);
        const float av = std::fabs(v[k]);
        amax = av > amax ? av : amax;
      }
      const float id = inverse_scale(amax);
      int32_t sum = 0;
      for (int k = 0; k < kQuantBlock; ++k) {
        float q = std::nearbyint(v[k] * id);  // ties to even (the default rounding mode)
        q = q == q ? std::min(127.0f, std::max(-127.0f, q)) : 0.0f;  // NaN x -> 0
        const int32_t qi = static_cast<int32_t>(q);
        a.xq[i * a.in + b * kQuantBlock + k] = static_cast<int8_t>(qi);
        sum += qi;
      }
      block_scales(a, i * nb + b, amax, sum);
    }
  }
}

#ifdef RHEO_HAVE_X86_PATHS
// AVX2: a block is 4 vectors of 8 floats.
RHEO_AVX2_INLINE __m256 load8_x(const QuantRowsArgs& a, int64_t e) {
  if (a.dtype == DType::kFloat32) return _mm256_loadu_ps(static_cast<const float*>(a.x) + e);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
      static_cast<const uint16_t*>(a.x) + e));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

RHEO_AVX2 void quantize_avx2(const QuantRowsArgs& a) {
  const int64_t nb = a.in / kQuantBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f);
  const __m256 lo = _mm256_set1_ps(-127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < a.n; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      __m256 v[4];
      __m256 m = _mm256_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        v[c] = load8_x(a, i * a.x_stride + b * kQuantBlock + 8 * c);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v[c]), m);  // |v| > m ? |v| : m (NaN: m)
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      const float amax = _mm_cvtss_f32(m4);
      const __m256 id = _mm256_set1_ps(inverse_scale(amax));
      __m256i q[4];
      __m256i sum = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(v[c], id),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));  // NaN -> 0
        r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        q[c] = _mm256_cvtps_epi32(r);
        sum = _mm256_add_epi32(sum, q[c]);
      }
      // int32 -> int8 (in range: no saturation), back into column order
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                               _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.xq + i * a.in + b * kQuantBlock),
                          _mm256_permutevar8x32_epi32(bytes, order));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      block_scales(a, i * nb + b, amax, _mm_cvtsi128_si32(s4));
    }
  }
}

// AVX-512: a block is 2 vectors of 16 floats.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
RHEO_VNNI_INLINE __m512 load16_x(const QuantRowsArgs& a, int64_t e) {
  if (a.dtype == DType::kFloat32) return _mm512_loadu_ps(static_cast<const float*>(a.x) + e);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
      static_cast<const uint16_t*>(a.x) + e));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

RHEO_VNNI void quantize_avx512(const QuantRowsArgs& a) {
  const int64_t nb = a.in / kQuantBlock;
  const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
  for (int64_t i = 0; i < a.n; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t e = i * a.x_stride + b * kQuantBlock;
      const __m512 v0 = load16_x(a, e), v1 = load16_x(a, e + 16);
      __m512 m = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps());  // NaN: 0
      m = _mm512_max_ps(_mm512_abs_ps(v1), m);
      __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(m),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m), 1)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      const float amax = _mm_cvtss_f32(m4);
      const __m512 id = _mm512_set1_ps(inverse_scale(amax));
      __m512i q[2];
      const __m512 v[2] = {v0, v1};
      for (int c = 0; c < 2; ++c) {
        __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v[c], id),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q), r);  // NaN -> 0
        r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
        q[c] = _mm512_cvtps_epi32(r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a.xq + i * a.in + b * kQuantBlock + 16 * c),
                         _mm512_cvtepi32_epi8(q[c]));
      }
      block_scales(a, i * nb + b, amax, _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1])));
    }
  }
}
#pragma GCC diagnostic pop
#endif  // RHEO_HAVE_X86_PATHS

using QuantizeFn = void (*)(const QuantRowsArgs&);

QuantizeFn quantize_fn() {
#ifdef RHEO_HAVE_X86_PATHS
  static const bool avx512 = __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  const cpu::Isa level = cpu::active_isa();
  if (avx512 && level >= cpu::Isa::kAvx512) return &quantize_avx512;
  if (avx2 && level >= cpu::Isa::kAvx2) return &quantize_avx2;
#endif
  return &quantize_portable;
}

}  // namespace

void quantize_rows_q8_cpu(const QuantRowsArgs& a) {
  RHEO_CHECK(a.n >= 0 && a.in >= 0 && a.in % kQuantBlock == 0,
             "quantize_rows_q8 needs n >= 0 and in a multiple of 32, got n=", a.n, ", in=", a.in);
  RHEO_CHECK(a.x_stride >= a.in, "quantize_rows_q8 needs x_stride >= in=", a.in, ", got ",
             a.x_stride);
  RHEO_CHECK(a.dtype == DType::kBFloat16 || a.dtype == DType::kFloat32,
             "quantize_rows_q8 takes bfloat16 or float32 x; convert x");
  quantize_fn()(a);
}

void quant_linear_cpu(const QuantLinearArgs& a) {
  check_quant_linear_args(a);
  RHEO_CHECK(a.dtype == DType::kBFloat16 || a.dtype == DType::kFloat32,
             "quant_linear writes bfloat16 or float32 y; pick one");
  if (a.n == 0) return;
  std::vector<float> acc(a.n * kQuantPanel);  // [n, 16] running sums of one panel
#ifdef RHEO_HAVE_AMX_PATH
  switch (amx_run(a.n)) {
    case AmxRun::kHardware: return run_amx<AmxTiles>(a, acc.data());
    case AmxRun::kEmulated: return run_amx<AmxEmulated>(a, acc.data());
    case AmxRun::kNone: break;
  }
#endif
  const PanelFn fn = panel_fn();
  for (int64_t p = a.p_begin; p < a.p_end; ++p) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    fn(a, p, acc.data());  // and y's columns of panel p
  }
}

std::string quant_linear_amx() {
#ifdef RHEO_HAVE_AMX_PATH
  switch (amx_run(kAmxMinRows)) {
    case AmxRun::kHardware: return "hardware";
    case AmxRun::kEmulated: return "emulated";
    case AmxRun::kNone: break;
  }
#endif
  return "off";
}

std::string set_quant_linear_amx(const std::string& mode) {
#ifdef RHEO_HAVE_AMX_PATH
  if (mode == "auto") amx_mode().store(kAmxAuto);
  else if (mode == "off") amx_mode().store(kAmxOff);
  else if (mode == "emulate") amx_mode().store(kAmxEmulate);
  else fail("quant_linear AMX mode '", mode, "' is not one of auto, off, emulate");
#else
  RHEO_CHECK(mode == "auto" || mode == "off" || mode == "emulate", "quant_linear AMX mode '",
             mode, "' is not one of auto, off, emulate");
#endif
  return quant_linear_amx();
}

bool quant_linear_amx_self_check() {
#ifdef RHEO_HAVE_AMX_PATH
  return vnni_listed() && amx_self_check<AmxEmulated>();
#else
  return false;
#endif
}

void quant_gather_rows_cpu(const QuantGatherArgs& a) {
  RHEO_CHECK(a.n >= 0 && a.rows >= 0 && a.in >= 0 && a.in % kQuantBlock == 0,
             "quant_gather_rows needs n, rows >= 0 and in a multiple of 32, got n=", a.n,
             ", rows=", a.rows, ", in=", a.in);
  for (int64_t i = 0; i < a.n; ++i)
    RHEO_CHECK(a.ids[i] >= 0 && a.ids[i] < a.rows, "row id ", a.ids[i], " (index ", i,
               ") must be in [0, ", a.rows, "): a token id past the table");
  const int64_t nb = a.in / kQuantBlock, rec = quant_record_bytes(a.type);
  const bool has_m = a.type == QuantType::kQ4_1;
  for (int64_t i = 0; i < a.n; ++i) {
    const int64_t id = a.ids[i], r = id % kQuantPanel;
    const uint8_t* panel = a.w + (id / kQuantPanel) * nb * rec;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* record = panel + b * rec;
      const uint16_t* scales = reinterpret_cast<const uint16_t*>(record);
      const float d = half_to_float(scales[r]);
      const float m = has_m ? half_to_float(scales[kQuantPanel + r]) : 0.0f;
      const uint8_t* codes = record + (has_m ? 64 : 32);
      for (int64_t k = 0; k < kQuantBlock; ++k) {
        const float v = quant_value(a.type, quant_code_at(codes, a.type, r, k), d, m);
        const int64_t at = i * a.in + b * kQuantBlock + k;
        if (a.dtype == DType::kBFloat16)
          static_cast<uint16_t*>(a.out)[at] = float_to_bf16(v);
        else
          static_cast<float*>(a.out)[at] = v;
      }
    }
  }
}

}  // namespace rheo
