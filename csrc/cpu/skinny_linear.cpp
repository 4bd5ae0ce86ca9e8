// Skinny linear layer on the CPU: y = x W^T for a few rows of x (csrc/include/rheo/skinny_linear.h).
//
// Why not torch's linear: on an AVX2 CPU without AVX-512 its bf16 linear costs n times one row,
// and fp32 MKL nearly so for 2..8 rows (bench/bench_skinny_linear.py), while the work is bound by
// reading W once (2 bytes a weight at ~18 GB/s per core) up to n ~ 5 (2 x 8 FMAs per cycle).
//
// Work split: x is taken kSweepRows rows at a time (a sweep), converted once to float32; in each
// sweep the output rows are taken kRows at a time (a block of W rows), and each block meets the
// sweep's rows kCols at a time, with kRows x kCols float32 vector accumulators in registers. A
// block of W (kRows * in * 2 bytes, 16 KiB for bf16 at in = 2048) stays in L1/L2 while the groups
// of x rows pass over it, so W comes from memory once per sweep (once for n <= 16), and the
// sweep's x (128 KiB at in = 2048) stays in L2. Each output is one dot product summed in the same
// order whatever block, group or thread computes it, so a split of [o_begin, o_end) changes no bit.
// The AVX2 + FMA path runs where the dispatch level (rheo/common.h cpu::active_isa) is AVX2 or
// above and the CPU has FMA (the build passes no -march); the portable path below does the same
// arithmetic one lane at a time, so the two give the same bits (RHEO_CPU_ISA=default picks it).
#include "rheo/skinny_linear.h"

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RHEO_HAVE_AVX2_PATH 1
#endif

namespace rheo {
namespace {

using cpu::bf16_to_float;
using cpu::float_to_bf16;

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_to_float(v); }
inline void store(float* dst, float v) { *dst = v; }
inline void store(uint16_t* dst, float v) { *dst = float_to_bf16(v); }  // nearest even, as torch

// --- portable path: one dot product per (row of x, row of W), as the AVX2 path computes it ---

// The column of a 16-column step that lane j of half h reads (load8 below): bf16 halves take the
// even and the odd columns, float32 halves the first and the last 8.
template <typename Elem>
constexpr int64_t lane_column(int h, int j) {
  return std::is_same_v<Elem, uint16_t> ? 2 * j + h : 8 * h + j;
}

// <w_row, x_row> [in] with the AVX2 path's roundings: 8 lanes of fused multiply-adds over the
// first in16 columns, folded as horizontal_sum folds them, then the last in % 16 one by one.
template <typename Elem>
float dot(const Elem* w_row, const Elem* x_row, int64_t in) {
  float lane[8] = {};
  const int64_t in16 = in - in % 16;
  for (int64_t k = 0; k < in16; k += 16)
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 8; ++j) {
        const int64_t c = k + lane_column<Elem>(h, j);
        lane[j] = std::fma(to_float(w_row[c]), to_float(x_row[c]), lane[j]);
      }
  float sum =
      ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
  for (int64_t k = in16; k < in; ++k) sum += to_float(w_row[k]) * to_float(x_row[k]);
  return sum;
}

template <typename Elem>
void skinny_linear_scalar(const SkinnyLinearArgs& a) {
  const Elem* x = static_cast<const Elem*>(a.x);
  const Elem* w = static_cast<const Elem*>(a.w);
  Elem* y = static_cast<Elem*>(a.y);
  for (int64_t o = a.o_begin; o < a.o_end; ++o) {
    const Elem* w_row = w + o * a.in;  // [in]
    for (int64_t i = 0; i < a.n; ++i)
      store(y + i * a.y_stride + o, dot(w_row, x + i * a.x_stride, a.in));  // x row [in]
  }
}

#ifdef RHEO_HAVE_AVX2_PATH
// --- AVX2 + FMA path ---

#define RHEO_AVX2 __attribute__((target("avx2,fma")))
#define RHEO_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

// Register tile: kRows W rows x kCols x rows = 12 float32 accumulators, + kCols x vectors + 1 W
// vector = the 16 ymm registers. FMA latency (4) x throughput (2 per cycle) asks for >= 8
// independent accumulators. Timed on a Zen 3 EPYC against 4x2, 5x2, 6x2 and 3x3 tiles (a C++
// harness, variants interleaved, W [8192, 2048] and [2048, 8192]): all within noise for bf16,
// 4x3 the fastest for float32 from n = 4 on (up to 1.3x).
constexpr int kRows = 4;
constexpr int kCols = 3;
// x rows per sweep over W: their float32 copy (kSweepRows * in * 4 bytes, 128 KiB at in = 2048)
// stays in L2 while W streams past once per sweep.
constexpr int64_t kSweepRows = 16;

// Half h of the 16 elements at p as 8 floats. bf16: one 32-byte load read as 8 pairs of bf16;
// h = 0 gives the even elements (the low halves shifted up), h = 1 the odd ones (the high halves
// masked): exact, one integer op per 8 elements. float32: elements 8h..8h+7. x is stored in the
// same order (pack_x), so lane j of x meets lane j of W; dot() above follows the same order.
RHEO_AVX2_INLINE __m256 load8(const uint16_t* p, int h) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (h == 0) return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
RHEO_AVX2_INLINE __m256 load8(const float* p, int h) { return _mm256_loadu_ps(p + 8 * h); }

RHEO_AVX2_INLINE float horizontal_sum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// y_rows[c][o0 + r] = <W row o0 + r, x row c> for the R rows of w_block [R, in] and the C rows
// x_rows[c] [in] (float32, in load8's order).
template <typename Elem, int R, int C>
RHEO_AVX2 void block_avx2(const Elem* w_block, int64_t in, const float* const* x_rows,
                          Elem* const* y_rows, int64_t o0) {
  __m256 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  // Step 1: 16 columns at a time, 8 per half: the C x vectors stay in registers while each W
  // row's 8 elements are loaded once and multiplied with all of them.
  const int64_t in16 = in - in % 16;
  for (int64_t k = 0; k < in16; k += 16) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 xv[C];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(x_rows[c] + k + 8 * h);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m256 wv = load8(w_block + r * in + k, h);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
      }
    }
  }
  // Step 2: fold the 8 lanes, add the last in % 16 columns one by one, round once.
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float sum = horizontal_sum(acc[r][c]);
      for (int64_t k = in16; k < in; ++k) sum += to_float(w_block[r * in + k]) * x_rows[c][k];
      store(y_rows[c] + o0 + r, sum);
    }
  }
}

template <typename Elem>
using BlockFn = void (*)(const Elem*, int64_t, const float* const*, Elem* const*, int64_t);

// The tile for R W rows and `cols` x rows, cols = 1..C (fewer for the last group of a sweep).
template <typename Elem, int R, int C = kCols>
BlockFn<Elem> block_for(int cols) {
  if constexpr (C == 1) {
    return &block_avx2<Elem, R, 1>;
  } else {
    return cols == C ? &block_avx2<Elem, R, C> : block_for<Elem, R, C - 1>(cols);
  }
}

// x rows i0..i0+m-1 as float32 in load8's order: bf16 rows are converted into `packed`
// [m, in] (the last in % 16 columns in plain order); float32 rows are used in place.
RHEO_AVX2 void pack_x(const SkinnyLinearArgs& a, const uint16_t* x, int64_t i0, int64_t m,
                      std::vector<float>& packed, const float** rows) {
  packed.resize(m * a.in);
  const int64_t in16 = a.in - a.in % 16;
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t* src = x + (i0 + i) * a.x_stride;  // [in]
    float* dst = packed.data() + i * a.in;            // [in]
    for (int64_t k = 0; k < in16; k += 16) {
      _mm256_storeu_ps(dst + k, load8(src + k, 0));
      _mm256_storeu_ps(dst + k + 8, load8(src + k, 1));
    }
    for (int64_t k = in16; k < a.in; ++k) dst[k] = bf16_to_float(src[k]);
    rows[i] = dst;
  }
}
void pack_x(const SkinnyLinearArgs& a, const float* x, int64_t i0, int64_t m, std::vector<float>&,
            const float** rows) {
  for (int64_t i = 0; i < m; ++i) rows[i] = x + (i0 + i) * a.x_stride;
}

template <typename Elem>
RHEO_AVX2 void skinny_linear_avx2(const SkinnyLinearArgs& a) {
  const Elem* w = static_cast<const Elem*>(a.w);
  Elem* y = static_cast<Elem*>(a.y);
  std::vector<float> packed;  // [m, in] float32 copy of bf16 x rows
  for (int64_t i0 = 0; i0 < a.n; i0 += kSweepRows) {
    // One sweep: W rows o_begin..o_end-1 in blocks of kRows against x rows i0..i0+m-1.
    const int64_t m = std::min(kSweepRows, a.n - i0);
    const float* x_rows[kSweepRows];  // [m] rows of x, [in] each
    Elem* y_rows[kSweepRows];         // [m] rows of y, [out] each
    pack_x(a, static_cast<const Elem*>(a.x), i0, m, packed, x_rows);
    for (int64_t i = 0; i < m; ++i) y_rows[i] = y + (i0 + i) * a.y_stride;
    for (int64_t o0 = a.o_begin; o0 < a.o_end; o0 += kRows) {
      const bool full = o0 + kRows <= a.o_end;  // else the last rows of the range, one at a time
      for (int64_t c0 = 0; c0 < m; c0 += kCols) {
        const int cols = static_cast<int>(std::min<int64_t>(kCols, m - c0));
        if (full) {
          block_for<Elem, kRows>(cols)(w + o0 * a.in, a.in, x_rows + c0, y_rows + c0, o0);
          continue;
        }
        for (int64_t o = o0; o < a.o_end; ++o)
          block_for<Elem, 1>(cols)(w + o * a.in, a.in, x_rows + c0, y_rows + c0, o);
      }
    }
  }
}

bool avx2_path_on() {
  static const bool has_fma = __builtin_cpu_supports("fma");
  return has_fma && cpu::active_isa() >= cpu::Isa::kAvx2;
}
#endif  // RHEO_HAVE_AVX2_PATH

template <typename Elem>
void run(const SkinnyLinearArgs& a) {
#ifdef RHEO_HAVE_AVX2_PATH
  if (avx2_path_on()) return skinny_linear_avx2<Elem>(a);
#endif
  skinny_linear_scalar<Elem>(a);
}

}  // namespace

void skinny_linear_cpu(const SkinnyLinearArgs& args) {
  RHEO_CHECK(args.n >= 0 && args.in >= 0 && args.out >= 0, "skinny_linear needs n, in, out >= 0, ",
             "got n=", args.n, ", in=", args.in, ", out=", args.out);
  RHEO_CHECK(0 <= args.o_begin && args.o_begin <= args.o_end && args.o_end <= args.out,
             "skinny_linear needs 0 <= o_begin <= o_end <= out=", args.out, ", got [",
             args.o_begin, ", ", args.o_end, ")");
  RHEO_CHECK(args.x_stride >= args.in && args.y_stride >= args.out,
             "skinny_linear needs x_stride >= in and y_stride >= out, got x_stride=",
             args.x_stride, " (in=", args.in, "), y_stride=", args.y_stride, " (out=", args.out,
             ")");
  switch (args.dtype) {
    case DType::kBFloat16: return run<uint16_t>(args);
    case DType::kFloat32: return run<float>(args);
    default: fail("skinny_linear takes bfloat16 or float32, got another dtype; convert x and w");
  }
}

}  // namespace rheo
