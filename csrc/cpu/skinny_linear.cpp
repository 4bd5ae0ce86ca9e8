// Skinny linear layer on the CPU: y = x W^T (csrc/include/rheo/skinny_linear.h), for the few rows
// of a decode step or a draft tree and the many of a prefill, with the same bits for a row
// whatever else runs with it.
//
// Work split: x is taken 32-64 rows at a time (a sweep, sweep_rows()); in each sweep the output
// rows are taken R at a time (a block of W rows, R * in elements, kept in L1), and each block meets
// the sweep's rows C at a time, with R x C vector accumulators in registers. W comes from memory
// once per sweep (once for n up to the sweep); the sweep's x stays in L1/L2. Every accumulator
// holds the 16 lanes of skinny::dot for one (W row, x row), so the tile shape, the sweep, the split
// of [o_begin, o_end) over threads and the number of rows change no bit.
//
// Paths, by the dispatch level (rheo/common.h cpu::active_isa(); RHEO_CPU_ISA picks one):
//   avx512  bf16: vdpbf16ps on W and x as stored (16 lanes = 32 columns, odd column then even,
//           exact products, denormals in and out flushed: skinny::dot's bf16 rule), if the CPU
//           has AVX-512-BF16 and its bits passed a self-check at the first call: tiles of 6 W
//           rows x 4 x rows (24 accumulators + 4 x + 1 W of the 32 zmm registers; timed on a Zen 4
//           EPYC against 4x4, 8x2, 4x6, 8x3 and 5x5 over SmolLM2's matrices at 1-64 rows: 6x4 as
//           fast or faster everywhere, up to 1.4x over 4x4 at 4 and 64 rows). Else, and for
//           float32, one zmm of 16 lanes with FMA, tiles 4 x 4 (bf16 holds 8 x vectors).
//   avx2    two ymm of 8 lanes per (W row, x row), both in one pass over the block's columns
//           (two passes, one per half, doubled the L1/L2 traffic: 1.3-1.6x slower at in = 1536).
//           Tiles 4 x 3: 24 accumulators, more than the 16 ymm registers, yet timed as fast as
//           2 x 2, 2 x 3 and 3 x 2 or faster on a Zen 4 at the avx2 level (noisy, loaded machine).
//   default skinny::dot, one output at a time.
// The FMA paths run bf16 with MXCSR's FTZ and DAZ set (restored on return): x86 then flushes
// exactly as vdpbf16ps does (checked on an AMD EPYC Zen 4 over 32M random and edge lanes, and by
// tests/test_skinny_linear.py against skinny::dot); bf16 is widened by a shift (even columns)
// and a mask (odd ones), and x is widened once per sweep into the lanes' order.
#include "rheo/skinny_linear.h"

#include "cpu_math.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RHEO_HAVE_X86_PATHS 1
#endif

namespace rheo {
namespace {

using cpu::float_to_bf16;
using skinny::kLanes;

inline void store(float* dst, float v) { *dst = v; }
inline void store(uint16_t* dst, float v) { *dst = float_to_bf16(v); }  // nearest even, as torch

// x rows per sweep over W: as many as keep the sweep's x within kSweepBytes (half of a Zen 4 or
// Sapphire Rapids core's L2, so W's stream keeps the other half), 32 to 64. W is read from memory
// once a sweep: one sweep of 64 rows against two of 32 took SmolLM2's lm_head [49152, 576] at 64
// rows from 0.73x to 0.93x F.linear on a Zen 4 EPYC (BENCHMARKS.md).
constexpr int64_t kMinSweepRows = 32, kMaxSweepRows = 64, kSweepBytes = 512 * 1024;

int64_t sweep_rows(int64_t in, int64_t x_bytes) {
  return std::clamp(kSweepBytes / std::max<int64_t>(1, in * x_bytes), kMinSweepRows,
                    kMaxSweepRows);
}

// --- portable path: skinny::dot per output ---

template <typename Elem>
void skinny_linear_portable(const SkinnyLinearArgs& a) {
  const Elem* x = static_cast<const Elem*>(a.x);
  const Elem* w = static_cast<const Elem*>(a.w);
  Elem* y = static_cast<Elem*>(a.y);
  for (int64_t o = a.o_begin; o < a.o_end; ++o) {
    const Elem* w_row = w + o * a.in;  // [in]
    for (int64_t i = 0; i < a.n; ++i)
      store(y + i * a.y_stride + o, skinny::dot(w_row, x + i * a.x_stride, a.in));
  }
}

#ifdef RHEO_HAVE_X86_PATHS

#define RHEO_AVX2 __attribute__((target("avx2,fma")))
#define RHEO_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline
#define RHEO_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define RHEO_AVX512_INLINE __attribute__((target("avx512f,avx2,fma"), always_inline)) inline
#define RHEO_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma")))

template <typename Elem>
constexpr int64_t kStep = sizeof(Elem) == 2 ? 2 * kLanes : kLanes;  // columns per lane step

// bf16 runs with MXCSR's FTZ (bit 15) and DAZ (bit 6) set, as vdpbf16ps always does.
class DenormalsFlushed {
 public:
  explicit DenormalsFlushed(bool on) : saved_(_mm_getcsr()) {
    if (on) _mm_setcsr(saved_ | 0x8040u);
  }
  ~DenormalsFlushed() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

// One scalar FMA under the MXCSR set above (so it flushes as the vector lanes do).
RHEO_AVX2_INLINE float fma_ss(float a, float b, float c) {
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}
RHEO_AVX2_INLINE float widen(float v) { return v; }
RHEO_AVX2_INLINE float widen(uint16_t v) {  // the bits as they are: DAZ reads a denormal as 0
  return skinny::bits_to_float(uint32_t(v) << 16);
}

// The 8 lanes folded as skinny::dot folds lanes 0..7 (l[j] += l[j + s], s = 4, 2, 1).
RHEO_AVX2_INLINE float fold8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// The last in % kStep columns, in order, then the store.
template <typename Elem, typename XElem>
RHEO_AVX2_INLINE void finish(float sum, const Elem* w_row, const XElem* x_row, int64_t k0,
                             int64_t in, Elem* dst) {
  for (int64_t k = k0; k < in; ++k) sum = fma_ss(widen(w_row[k]), widen(x_row[k]), sum);
  store(dst, sum);
}

// x rows i0..i0+m-1 as float32 in the lanes' order: per step of 32 bf16 columns, the 16 odd
// columns (lane j: 2j + 1) then the 16 even ones; the last in % 32 columns in plain order, as
// bits (DAZ applies in the FMA). float32 rows are used in place.
RHEO_AVX2 void pack_x(const SkinnyLinearArgs& a, const uint16_t* x, int64_t i0, int64_t m,
                      std::vector<float>& packed, const float** rows) {
  packed.resize(m * a.in);
  const int64_t steps = a.in - a.in % 32;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t* src = x + (i0 + i) * a.x_stride;  // [in]
    float* dst = packed.data() + i * a.in;            // [in]
    for (int64_t k = 0; k < steps; k += 32)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k + 16 * h));
        _mm256_storeu_ps(dst + k + 8 * h, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
        _mm256_storeu_ps(dst + k + 16 + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      }
    for (int64_t k = steps; k < a.in; ++k) dst[k] = widen(src[k]);
    rows[i] = dst;
  }
}
void pack_x(const SkinnyLinearArgs& a, const float* x, int64_t i0, int64_t m, std::vector<float>&,
            const float** rows) {
  for (int64_t i = 0; i < m; ++i) rows[i] = x + (i0 + i) * a.x_stride;
}

// --- AVX2 + FMA: lanes 0..7 and 8..15 as two ymm accumulators per (W row, x row) ---

template <typename Elem, int R, int C>
RHEO_AVX2 void block_avx2(const Elem* w_block, int64_t in, const float* const* x_rows,
                          Elem* const* y_rows, int64_t o0) {
  constexpr int64_t step = kStep<Elem>;
  const int64_t steps = in - in % step;
  __m256 acc[R][C][2];  // [.][.][h]: lanes 8h..8h+7
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < steps; k += step) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      if constexpr (sizeof(Elem) == 2) {
        // Lanes 8h..8h+7 cover columns k + 16h .. k + 16h + 15: odd ones, then even ones.
        __m256 x_odd[C], x_even[C];
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) {
          x_odd[c] = _mm256_loadu_ps(x_rows[c] + k + 8 * h);
          x_even[c] = _mm256_loadu_ps(x_rows[c] + k + 16 + 8 * h);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w_block + r * in + k + 16 * h));
          const __m256 w_odd = _mm256_castsi256_ps(
              _mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
          const __m256 w_even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c)
            acc[r][c][h] = _mm256_fmadd_ps(w_odd, x_odd[c], acc[r][c][h]);
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c)
            acc[r][c][h] = _mm256_fmadd_ps(w_even, x_even[c], acc[r][c][h]);
        }
      } else {
        __m256 xv[C];
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(x_rows[c] + k + 8 * h);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m256 wv = _mm256_loadu_ps(reinterpret_cast<const float*>(w_block) + r * in +
                                            k + 8 * h);
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c) acc[r][c][h] = _mm256_fmadd_ps(wv, xv[c], acc[r][c][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const __m256 s8 = _mm256_add_ps(acc[r][c][0], acc[r][c][1]);  // l[j] + l[j + 8]
      finish(fold8(s8), w_block + r * in, x_rows[c], steps, in, y_rows[c] + o0 + r);
    }
}

// --- AVX-512F: one zmm of 16 lanes per (W row, x row) ---

RHEO_AVX512_INLINE float fold16(__m512 v) {  // l[j] + l[j + 8], then fold8
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return fold8(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

template <typename Elem, int R, int C>
RHEO_AVX512 void block_avx512(const Elem* w_block, int64_t in, const float* const* x_rows,
                              Elem* const* y_rows, int64_t o0) {
  constexpr int64_t step = kStep<Elem>;
  const int64_t steps = in - in % step;
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < steps; k += step) {
    if constexpr (sizeof(Elem) == 2) {
      __m512 x_odd[C], x_even[C];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        x_odd[c] = _mm512_loadu_ps(x_rows[c] + k);
        x_even[c] = _mm512_loadu_ps(x_rows[c] + k + 16);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512i v = _mm512_loadu_si512(w_block + r * in + k);
        const __m512 w_odd = _mm512_castsi512_ps(
            _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
        const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w_odd, x_odd[c], acc[r][c]);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w_even, x_even[c], acc[r][c]);
      }
    } else {
      __m512 xv[C];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_ps(x_rows[c] + k);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 wv = _mm512_loadu_ps(reinterpret_cast<const float*>(w_block) + r * in + k);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      finish(fold16(acc[r][c]), w_block + r * in, x_rows[c], steps, in, y_rows[c] + o0 + r);
}

// --- AVX-512-BF16: vdpbf16ps on W and x as stored ---

template <int R, int C>
RHEO_AVX512_BF16 void block_bf16_dot(const uint16_t* w_block, int64_t in,
                                     const uint16_t* const* x_rows, uint16_t* const* y_rows,
                                     int64_t o0) {
  const int64_t steps = in - in % 32;
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < steps; k += 32) {
    __m512i xv[C];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_si512(x_rows[c] + k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_loadu_si512(w_block + r * in + k);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)wv, (__m512bh)xv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      finish(fold16(acc[r][c]), w_block + r * in, x_rows[c], steps, in, y_rows[c] + o0 + r);
}

// --- the sweep, shared by the vector paths ---

enum class Path { kPortable, kAvx2, kAvx512, kBf16Dot };

template <Path P, typename Elem, int R, int C>
constexpr auto block_ptr() {
  if constexpr (P == Path::kAvx2) return &block_avx2<Elem, R, C>;
  else if constexpr (P == Path::kAvx512) return &block_avx512<Elem, R, C>;
  else return &block_bf16_dot<R, C>;
}

// The tile for R W rows and `cols` x rows, cols = 1..C (fewer for the last group of a sweep).
template <Path P, typename Elem, int R, int C>
auto block_for(int cols) {
  if constexpr (C == 1) {
    return block_ptr<P, Elem, R, 1>();
  } else {
    return cols == C ? block_ptr<P, Elem, R, C>() : block_for<P, Elem, R, C - 1>(cols);
  }
}

template <Path P, typename Elem, int R, int C>
void sweep(const SkinnyLinearArgs& a) {
  constexpr bool kRaw = P == Path::kBf16Dot;  // vdpbf16ps reads x as stored
  using XElem = std::conditional_t<kRaw, Elem, float>;
  const DenormalsFlushed flushed(sizeof(Elem) == 2);
  const Elem* w = static_cast<const Elem*>(a.w);
  const Elem* x = static_cast<const Elem*>(a.x);
  Elem* y = static_cast<Elem*>(a.y);
  std::vector<float> packed;  // [m, in] float32 copy of bf16 x rows (FMA paths)
  const int64_t rows = sweep_rows(a.in, sizeof(XElem));
  const int64_t w_bytes = (a.o_end - a.o_begin) * a.in * sizeof(Elem);
  cpu::prefetch_range(w + a.o_begin * a.in, std::min(w_bytes, cpu::kPrefetchBytes));
  for (int64_t i0 = 0; i0 < a.n; i0 += rows) {
    const int64_t m = std::min(rows, a.n - i0);
    const XElem* x_rows[kMaxSweepRows];  // [m] rows of x, [in] each
    Elem* y_rows[kMaxSweepRows];         // [m] rows of y, [out] each
    if constexpr (kRaw) {
      for (int64_t i = 0; i < m; ++i) x_rows[i] = x + (i0 + i) * a.x_stride;
    } else {
      pack_x(a, x, i0, m, packed, x_rows);
    }
    for (int64_t i = 0; i < m; ++i) y_rows[i] = y + (i0 + i) * a.y_stride;
    for (int64_t o0 = a.o_begin; o0 < a.o_end; o0 += R) {
      const bool full = o0 + R <= a.o_end;  // else the last rows of the range, one at a time
      if (i0 == 0)  // W's rows come from memory in the first sweep: ask ahead for them
        cpu::prefetch_range(reinterpret_cast<const char*>(w + o0 * a.in) + cpu::kPrefetchBytes,
                            std::min<int64_t>(R, a.o_end - o0) * a.in * sizeof(Elem));
      for (int64_t c0 = 0; c0 < m; c0 += C) {
        const int cols = static_cast<int>(std::min<int64_t>(C, m - c0));
        if (full) {
          block_for<P, Elem, R, C>(cols)(w + o0 * a.in, a.in, x_rows + c0, y_rows + c0, o0);
          continue;
        }
        for (int64_t o = o0; o < a.o_end; ++o)
          block_for<P, Elem, 1, C>(cols)(w + o * a.in, a.in, x_rows + c0, y_rows + c0, o);
      }
    }
  }
}

// --- the vdpbf16ps self-check ---

// True when vdpbf16ps gives skinny::dot's bits on this CPU: random rows of every magnitude class
// (around 1, huge, tiny products, denormal inputs, sums that cancel to tiny), and the case that
// tells tininess after rounding from before (FLT_MIN minus a product of 2^-152).
bool bf16_dot_self_check() {
  constexpr int64_t kIn = 96 + 7, kOut = 16, kN = 5;  // three steps and a tail
  std::vector<uint16_t> w(kOut * kIn), x(kN * kIn), y(kN * kOut);
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&]() {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state;
  };
  auto value = [&](int kind) -> uint16_t {
    const uint64_t r = next();
    int e = 127 + static_cast<int>(r % 8) - 4;  // kind 0: around 1
    if (kind == 1) e = static_cast<int>((r >> 8) % 255);  // any exponent
    if (kind == 2) e = (r >> 8) % 2 ? 0 : 1 + static_cast<int>((r >> 9) % 70);  // tiny, denormal
    return static_cast<uint16_t>(((r >> 40) & 1) << 15 | e << 7 | ((r >> 20) & 0x7F));
  };
  for (int trial = 0; trial < 12; ++trial) {
    const int kind = trial % 3;
    for (auto& v : w) v = value(kind);
    for (auto& v : x) v = value(kind);
    if (trial == 0) {  // x row 0 against W rows 0 and 1: 1 x 2^-126 (odd column, first), then
      // 2^-76 x -2^-76 = -2^-152 (rounds back up to 2^-126: kept) or 1.5 x 2^-75 x -2^-76
      // (rounds to 2^-126 - 2^-150: tiny, flushed) in the even column.
      std::fill(w.begin(), w.begin() + 2 * kIn, 0), std::fill(x.begin(), x.begin() + kIn, 0);
      x[1] = 0x0080, x[0] = 0x9980;
      w[1] = 0x3F80, w[0] = 0x1980;
      w[kIn + 1] = 0x3F80, w[kIn] = 0x1A40;
    }
    SkinnyLinearArgs a;
    a.x = x.data(), a.w = w.data(), a.y = y.data(), a.dtype = DType::kBFloat16;
    a.n = kN, a.in = kIn, a.out = kOut, a.x_stride = kIn, a.y_stride = kOut;
    a.o_begin = 0, a.o_end = kOut;
    sweep<Path::kBf16Dot, uint16_t, 6, 4>(a);
    for (int64_t i = 0; i < kN; ++i)
      for (int64_t o = 0; o < kOut; ++o) {
        uint16_t want;
        store(&want, skinny::dot(w.data() + o * kIn, x.data() + i * kIn, kIn));
        const bool nan = (want & 0x7FFF) > 0x7F80 && (y[i * kOut + o] & 0x7FFF) > 0x7F80;
        if (!nan && want != y[i * kOut + o]) return false;
      }
  }
  return true;
}

std::atomic<bool> bf16_dot_wanted{true};

bool bf16_dot_available() {
  static const bool ok = __builtin_cpu_supports("avx512bf16") && bf16_dot_self_check();
  return ok;
}

Path path_for(DType dtype) {
  static const bool has_fma = __builtin_cpu_supports("fma");
  const cpu::Isa isa = cpu::active_isa();
  if (isa >= cpu::Isa::kAvx512 && __builtin_cpu_supports("avx512f")) {
    if (dtype == DType::kBFloat16 && bf16_dot_wanted.load() && bf16_dot_available())
      return Path::kBf16Dot;
    return Path::kAvx512;
  }
  if (isa >= cpu::Isa::kAvx2 && has_fma) return Path::kAvx2;
  return Path::kPortable;
}
#endif  // RHEO_HAVE_X86_PATHS

template <typename Elem>
void run(const SkinnyLinearArgs& a) {
#ifdef RHEO_HAVE_X86_PATHS
  switch (path_for(a.dtype)) {
    case Path::kBf16Dot:
      if constexpr (sizeof(Elem) == 2) return sweep<Path::kBf16Dot, Elem, 6, 4>(a);
      break;
    case Path::kAvx512: return sweep<Path::kAvx512, Elem, 4, 4>(a);
    case Path::kAvx2: return sweep<Path::kAvx2, Elem, 4, 3>(a);
    case Path::kPortable: break;
  }
#endif
  skinny_linear_portable<Elem>(a);
}

}  // namespace

bool skinny_linear_set_bf16_dot(bool on) {
#ifdef RHEO_HAVE_X86_PATHS
  bf16_dot_wanted.store(on);
#endif
  return skinny_linear_bf16_dot_on();
}

bool skinny_linear_bf16_dot_on() {
#ifdef RHEO_HAVE_X86_PATHS
  return bf16_dot_wanted.load() && bf16_dot_available();
#else
  return false;
#endif
}

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
