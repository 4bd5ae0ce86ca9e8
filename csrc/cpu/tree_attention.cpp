// Tree attention on the CPU (docs/algorithm.md §2, step 2): every tree node attends to the whole
// cached prefix plus the tree rows its mask allows, with GQA.
//
// Work split: one task per (b, KV head, block of nodes). A task reads only its own sequence: the
// slot kv_slots[b] (or b) and rows 0..P_b+N-1 of it, P_b its prefix length, so a sequence's
// output is the same bits whatever else is in the batch (the tiles start at row 0 for every b).
// A task holds the M = nodes * G query rows (G = H / Hkv heads share the KV head), so each K/V row
// is loaded (and converted from bf16/fp16) once per task and used by all M queries. The rows a
// query sees are walked in tiles of kTileRows with an online softmax (running max and sum per
// query, as in FlashAttention), which keeps the per-thread workspace small whatever the prefix
// length; the tiles count the rows each query sees, not the slot's (run_task). Everything is
// float32: loads are converted, scores, softmax and the V accumulation too.
//
// A score is the sum over d in order of q[d] * k[d] (each product and sum rounded), computed
// with the vector lanes over a tile's cache rows (K converted and transposed 8 x 8): a plain
// step's task has only G = 1-4 queries, which lanes over queries padded to 16 (widened 1B's
// layer at one node, 300 cached rows: 507 -> 255 us on a Zen 4, one thread; same bits). On the
// AVX-512 level (and for the scores of a small task on AVX2) register-blocked loops compute the
// same sums in the same order with the transposed rows kept in registers (score_rows_avx512,
// value_rows_avx512): SmolLM2's layer at one node after 1500 cached rows, 180 -> 92 us.
#include "rheo/tree_attention.h"

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RHEO_HAVE_X86_EXP 1  // (also guards the register-blocked AVX-512 / AVX2 loops)
#endif

namespace rheo {
namespace {

constexpr int64_t kTileRows = 64;    // cache rows per online-softmax step
constexpr int64_t kTargetRows = 64;  // query rows per task (nodes * G), for K/V reuse
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using cpu::bf16_to_float;
using cpu::float_to_bf16;
using cpu::float_to_half;
using cpu::half_to_float;

// D elements at `base + offset` (elements) as float32: fp32 rows are used in place, others are
// converted into `buf` [D].
const float* load_row(const void* base, int64_t offset, int64_t D, DType dtype, float* buf) {
  if (dtype == DType::kFloat32) return static_cast<const float*>(base) + offset;
  const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
  if (dtype == DType::kBFloat16) {
    for (int64_t d = 0; d < D; ++d) buf[d] = bf16_to_float(src[d]);
  } else {
    for (int64_t d = 0; d < D; ++d) buf[d] = half_to_float(src[d]);
  }
  return buf;
}

void store_row(void* base, int64_t offset, const float* src, int64_t D, DType dtype) {
  if (dtype == DType::kFloat32) {
    std::memcpy(static_cast<float*>(base) + offset, src, D * sizeof(float));
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(base) + offset;
  for (int64_t d = 0; d < D; ++d)
    dst[d] = dtype == DType::kBFloat16 ? float_to_bf16(src[d]) : float_to_half(src[d]);
}

// --- register-blocked inner loops. Eight floats per vector through the GCC/Clang vector
// extension (two SSE registers, or one AVX register in the AVX2 and AVX-512 copies of the hot
// loops below; plain loops here were vectorised across the wrong axis). The accumulators stay in
// registers, so each load feeds several multiply-adds. Loads go through memcpy: no alignment is
// assumed. ---

typedef float f32x8 __attribute__((vector_size(32)));
constexpr int kRowVecs = kTileRows / 8;  // vectors of cache rows in a tile
// head-dim columns per V block (D is padded to it): pv_block's 2 queries x 4 vectors are 8
// independent sums (2 x 2 waited on the adds' latency)
constexpr int kDimBlock = 32;
constexpr int kDimVecs = kDimBlock / 8;

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// 8 elements at src as float32: bf16 widened by a shift (the bits as they are, as bf16_to_float),
// float32 loaded.
RHEO_ALWAYS_INLINE f32x8 load8(const void* src, DType dtype) {
  f32x8 v;
  if (dtype == DType::kFloat32) {
    std::memcpy(&v, src, sizeof v);
  } else {
    u16x8 h;
    std::memcpy(&h, src, sizeof h);
    const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    std::memcpy(&v, &w, sizeof v);
  }
  return v;
}

// r[0..7] (8 rows of 8) transposed in place: r[j][i] = old r[i][j].
RHEO_ALWAYS_INLINE void transpose8(f32x8 r[8]) {
  f32x8 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shuffle(r[i], r[i + 1], i32x8{0, 8, 1, 9, 4, 12, 5, 13});
    t[i + 1] = __builtin_shuffle(r[i], r[i + 1], i32x8{2, 10, 3, 11, 6, 14, 7, 15});
  }
  for (int i = 0; i < 8; i += 4)
    for (int h = 0; h < 2; ++h) {
      u[i + 2 * h] = __builtin_shuffle(t[i + h], t[i + 2 + h], i32x8{0, 1, 8, 9, 4, 5, 12, 13});
      u[i + 2 * h + 1] =
          __builtin_shuffle(t[i + h], t[i + 2 + h], i32x8{2, 3, 10, 11, 6, 7, 14, 15});
    }
  for (int j = 0; j < 4; ++j) {
    r[j] = __builtin_shuffle(u[j], u[4 + j], i32x8{0, 1, 2, 3, 8, 9, 10, 11});
    r[4 + j] = __builtin_shuffle(u[j], u[4 + j], i32x8{4, 5, 6, 7, 12, 13, 14, 15});
  }
}

// s0[r] = <q0, k_r>, s1[r] = <q1, k_r> for the first 8 * V cache rows stored as columns of k_t
// [D, kTileRows] (the lanes run over cache rows: each query's score is the sum over d in order,
// and a short task wastes no lane, where lanes over queries padded 2-3 queries to 16). V is a
// template argument so the accumulators stay in registers; a tile's last rows need only
// ceil(rows / 8) vectors (a plain step's last tile holds ~half of kTileRows on average).
template <int V>
RHEO_ALWAYS_INLINE void qk_rows(const float* k_t, const float* q0, const float* q1, int64_t D,
                                float* s0, float* s1) {
  if constexpr (V > 4) {  // in passes of 4 vectors: 8 sums and their operands fit 16 registers
    qk_rows<4>(k_t, q0, q1, D, s0, s1);                  // (AVX-512F without VL has 16 ymm)
    qk_rows<V - 4>(k_t + 32, q0, q1, D, s0 + 32, s1 + 32);
    return;
  }
  f32x8 acc0[V] = {}, acc1[V] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* k = k_t + d * kTileRows;
    const float b0 = q0[d], b1 = q1[d];
    for (int i = 0; i < V; ++i) {
      f32x8 ki;
      std::memcpy(&ki, k + 8 * i, sizeof ki);
      acc0[i] += ki * b0;
      acc1[i] += ki * b1;
    }
  }
  std::memcpy(s0, acc0, sizeof acc0);
  std::memcpy(s1, acc1, sizeof acc1);
}

// qk_rows over the vectors that hold ``rows`` cache rows (1 <= rows <= kTileRows).
RHEO_ALWAYS_INLINE void qk_rows_n(int64_t rows, const float* k_t, const float* q0,
                                  const float* q1, int64_t D, float* s0, float* s1) {
  static_assert(kRowVecs == 8, "qk_rows_n dispatches 1..8 vectors");
  switch ((rows + 7) / 8) {
    case 1: return qk_rows<1>(k_t, q0, q1, D, s0, s1);
    case 2: return qk_rows<2>(k_t, q0, q1, D, s0, s1);
    case 3: return qk_rows<3>(k_t, q0, q1, D, s0, s1);
    case 4: return qk_rows<4>(k_t, q0, q1, D, s0, s1);
    case 5: return qk_rows<5>(k_t, q0, q1, D, s0, s1);
    case 6: return qk_rows<6>(k_t, q0, q1, D, s0, s1);
    case 7: return qk_rows<7>(k_t, q0, q1, D, s0, s1);
    default: return qk_rows<8>(k_t, q0, q1, D, s0, s1);
  }
}

// out0 += sum_r w0[r] * v[r, :], out1 += sum_r w1[r] * v[r, :] over kDimBlock columns;
// w0, w1 [rows] hold the weights of two neighbouring queries, v [rows, ld_v] the V rows.
RHEO_ALWAYS_INLINE void pv_block(const float* w0, const float* w1, const float* v, int64_t ld_v,
                                 int64_t rows, float* out0, float* out1) {
  f32x8 acc0[kDimVecs], acc1[kDimVecs];
  std::memcpy(acc0, out0, sizeof acc0);
  std::memcpy(acc1, out1, sizeof acc1);
  for (int64_t r = 0; r < rows; ++r) {
    const float* vr = v + r * ld_v;
    for (int i = 0; i < kDimVecs; ++i) {
      f32x8 vi;
      std::memcpy(&vi, vr + 8 * i, sizeof vi);
      acc0[i] += vi * w0[r];
      acc1[i] += vi * w1[r];
    }
  }
  std::memcpy(out0, acc0, sizeof acc0);
  std::memcpy(out1, acc1, sizeof acc1);
}

// --- the softmax's exponentials: std::exp's bits, 8 at a time ---
//
// The C library's expf is the definition (cpu_math.h). glibc >= 2.27 computes it by ARM's
// optimized-routines algorithm in double precision, and on a CPU with FMA runs its FMA build
// (__expf_fma), whose compiled code fuses exactly these steps (read from glibc 2.36's libm):
//   kd0 = fma(N/ln2, x, 0x1.8p52); ki = bits(kd0); kd = kd0 - 0x1.8p52; r = fma(N/ln2, x, -kd);
//   s = double(T[ki % 32] + (ki << 47)); y = fma(fma(r, C0, C1), r * r, fma(r, C2, 1)) * s;
//   expf(x) = float(y)                      (N = 32; T, C0..C2 the library's own constants)
// for |x| < 88 (the top 12 bits of x, sign off, at most 0x42a); larger |x|, infinities and NaN
// take the library's own special cases. The vector paths compute those lanes with AVX2 + FMA or
// AVX-512 and hand every other lane to std::exp; each path runs only where a check at first
// use found it gives this machine's std::exp bits (a library or build computing otherwise keeps
// std::exp), and tests/test_tree_attention.py compares every non-positive float, all 2^31 that
// a softmax can pass. Widened 1B's layer at 16 nodes after 300 cached rows (Zen 4, one thread):
// see BENCHMARKS.md, "Issue 40 on an AVX-512-BF16 EPYC".

#ifdef RHEO_HAVE_X86_EXP
alignas(64) constexpr uint64_t kExpTable[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540};
constexpr double kInvLn2N = 0x1.71547652b82fep+5, kExpShift = 0x1.8p+52;
constexpr double kC0 = 0x1.c6af84b912394p-5 / 32 / 32 / 32, kC1 = 0x1.ebfce50fac4f3p-3 / 32 / 32,
                 kC2 = 0x1.62e42ff0c52d6p-1 / 32;

// The lanes of x the vector paths leave to std::exp (top 12 bits, sign off, above 0x42a), a bit
// each.
__attribute__((target("avx2"), always_inline)) inline int lanes_outside(__m256 x) {
  const __m256i abstop =
      _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20), _mm256_set1_epi32(0x7FF));
  return _mm256_movemask_ps(
      _mm256_castsi256_ps(_mm256_cmpgt_epi32(abstop, _mm256_set1_epi32(0x42A))));
}

// p[i] = std::exp(in[i]) for the lanes i of `outside` (lanes_outside of in).
inline void exp_outside(float* p, const float* in, int outside) {
  for (int i = 0; outside && i < 8; ++i)
    if (outside >> i & 1) p[i] = std::exp(in[i]);
}

// p[r] = std::exp(p[r]) for r < n, in place: 8 lanes at a time, each lane the vector path does
// not compute (and the last n % 8) by std::exp.
__attribute__((target("avx2,fma"))) void exp_row_avx2(float* p, int64_t n) {
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) {
    const __m256 xf = _mm256_loadu_ps(p + r);
    const int outside = lanes_outside(xf);
    float in[8];
    _mm256_storeu_ps(in, xf);
    for (int h = 0; h < 2; ++h) {
      const __m128 half = h ? _mm256_extractf128_ps(xf, 1) : _mm256_castps256_ps128(xf);
      const __m256d xd = _mm256_cvtps_pd(half);
      const __m256d kd0 = _mm256_fmadd_pd(_mm256_set1_pd(kInvLn2N), xd, _mm256_set1_pd(kExpShift));
      const __m256i ki = _mm256_castpd_si256(kd0);
      const __m256d kd = _mm256_sub_pd(kd0, _mm256_set1_pd(kExpShift));
      const __m256d rr = _mm256_fmsub_pd(_mm256_set1_pd(kInvLn2N), xd, kd);
      const __m256i t = _mm256_add_epi64(
          _mm256_i64gather_epi64(reinterpret_cast<const long long*>(kExpTable),
                                 _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8),
          _mm256_slli_epi64(ki, 47));
      const __m256d z = _mm256_fmadd_pd(rr, _mm256_set1_pd(kC0), _mm256_set1_pd(kC1));
      const __m256d r2 = _mm256_mul_pd(rr, rr);
      __m256d v = _mm256_fmadd_pd(rr, _mm256_set1_pd(kC2), _mm256_set1_pd(1.0));
      v = _mm256_mul_pd(_mm256_fmadd_pd(z, r2, v), _mm256_castsi256_pd(t));
      _mm_storeu_ps(p + r + 4 * h, _mm256_cvtpd_ps(v));
    }
    exp_outside(p + r, in, outside);
  }
  for (; r < n; ++r) p[r] = std::exp(p[r]);
}

__attribute__((target("avx512f"))) void exp_row_avx512(float* p, int64_t n) {
  // The table in four registers: entry i is lane i % 8 of tab[i / 8].
  __m512i tab[4];
  for (int i = 0; i < 4; ++i) tab[i] = _mm512_load_si512(kExpTable + 8 * i);
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) {
    const __m256 xf = _mm256_loadu_ps(p + r);
    const int outside = lanes_outside(xf);
    float in[8];
    _mm256_storeu_ps(in, xf);
    const __m512d xd = _mm512_cvtps_pd(xf);
    const __m512d kd0 = _mm512_fmadd_pd(_mm512_set1_pd(kInvLn2N), xd, _mm512_set1_pd(kExpShift));
    const __m512i ki = _mm512_castpd_si512(kd0);
    const __m512d kd = _mm512_sub_pd(kd0, _mm512_set1_pd(kExpShift));
    const __m512d rr = _mm512_fmsub_pd(_mm512_set1_pd(kInvLn2N), xd, kd);
    // tab[ki % 32]: entries 0..15 and 16..31 by two two-table permutes, then bit 4 picks.
    const __m512i low = _mm512_permutex2var_epi64(tab[0], ki, tab[1]);
    const __m512i high = _mm512_permutex2var_epi64(tab[2], ki, tab[3]);
    const __mmask8 upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
    const __m512i t = _mm512_add_epi64(_mm512_mask_blend_epi64(upper, low, high),
                                       _mm512_slli_epi64(ki, 47));
    const __m512d z = _mm512_fmadd_pd(rr, _mm512_set1_pd(kC0), _mm512_set1_pd(kC1));
    const __m512d r2 = _mm512_mul_pd(rr, rr);
    __m512d v = _mm512_fmadd_pd(rr, _mm512_set1_pd(kC2), _mm512_set1_pd(1.0));
    v = _mm512_mul_pd(_mm512_fmadd_pd(z, r2, v), _mm512_castsi512_pd(t));
    _mm256_storeu_ps(p + r, _mm512_cvtpd_ps(v));
    exp_outside(p + r, in, outside);
  }
  for (; r < n; ++r) p[r] = std::exp(p[r]);
}
#endif  // RHEO_HAVE_X86_EXP

using ExpRow = void (*)(float* p, int64_t n);

// Mismatches of exp_row against std::exp over the float bit patterns first, first + stride, ...
// <= last.
int64_t exp_row_mismatches(ExpRow exp_row, uint64_t first, uint64_t last, uint64_t stride) {
  constexpr int kChunk = 4096;
  int64_t bad = 0;
  float x[kChunk], y[kChunk];
  for (uint64_t u = first; u <= last;) {
    int n = 0;
    for (; n < kChunk && u <= last; ++n, u += stride) {
      const uint32_t bits = static_cast<uint32_t>(u);
      std::memcpy(&x[n], &bits, sizeof bits);
    }
    std::memcpy(y, x, n * sizeof(float));
    exp_row(y, n);
    for (int i = 0; i < n; ++i) {
      const float want = std::exp(x[i]);
      const bool nans = std::isnan(want) && std::isnan(y[i]);
      bad += std::memcmp(&want, &y[i], sizeof want) != 0 && !nans;
    }
  }
  return bad;
}

// The vector exp of the active level, or null (std::exp): checked once per path against
// std::exp on every 4099th float bit pattern (~1M values, a few ms).
ExpRow vector_exp() {
#ifdef RHEO_HAVE_X86_EXP
  auto checked = [](ExpRow f) {
    return exp_row_mismatches(f, 0, 0xFFFFFFFFull, 4099) == 0 ? f : nullptr;
  };
  switch (cpu::active_isa()) {
    case cpu::Isa::kAvx512: {
      static const ExpRow f = checked(&exp_row_avx512);
      return f;
    }
    case cpu::Isa::kAvx2: {
      static const ExpRow f = __builtin_cpu_supports("fma") ? checked(&exp_row_avx2) : nullptr;
      return f;
    }
    default: return nullptr;
  }
#else
  return nullptr;
#endif
}

// p[r] = std::exp(p[r]) for r < n, in place: by exp_row where vector_exp() gave one.
void exp_in_place(ExpRow exp_row, float* p, int64_t n) {
  if (exp_row != nullptr) return exp_row(p, n);
  for (int64_t r = 0; r < n; ++r) p[r] = std::exp(p[r]);
}

// --- one task: queries of nodes n0..n0+nodes-1, heads kvh*G..kvh*G+G-1 of batch entry b ---

struct Task {
  int64_t b, kvh, n0, nodes, M;  // query row m = (n - n0) * G + g, head h = kvh * G + g
  int64_t prefix, slot;          // P_b (prefix_lens[b] or prefix_len) and the k/v slot of b
};

// Per-thread scratch, sized for the largest task: Mp = M rounded up to 2 (queries go in pairs),
// Dp = D rounded up to kDimBlock, ld_p = the widest softmax tile (kTileRows, or the prefix's last
// partial tile plus every tree row: see run_task). A padded query is zero and gets weight 0.
struct Workspace {
  int64_t Mp, Dp, ld_p;
  std::vector<float> q;        // [Mp, D]  queries as rows
  std::vector<float> row;      // [D]      one converted K row
  std::vector<float> k_t;      // [D, kTileRows]  the tile's K rows as columns, zero-padded
  std::vector<float> v_tile;   // [kTileRows, Dp]  converted V rows, zero-padded
  std::vector<float> p;        // [Mp, ld_p]  scores of a tile, then exp weights
  std::vector<float> run_max;  // [Mp]  running max of the scores seen so far
  std::vector<float> run_sum;  // [Mp]  running sum of exp(score - run_max)
  std::vector<float> acc;      // [Mp, Dp]  running sum of exp(score - run_max) * v
  std::vector<int32_t> tile;   // [nodes, T]  the softmax tile of each node's tree row, -1: unseen
  std::vector<int64_t> tile_lo, tile_hi;  // [tiles]  the slot rows a task's tile k spans
  std::vector<int64_t> tile_seen;         // [tiles]  the (node, tree row) pairs in tile k
  Workspace(int64_t D, int64_t M, int64_t nodes, int64_t T)
      : Mp(round_up(M, 2)), Dp(round_up(D, kDimBlock)),
        ld_p(round_up(kTileRows - 1 + T, kTileRows)), q(Mp * D), row(D), k_t(D * kTileRows),
        v_tile(kTileRows * Dp), p(Mp * ld_p), run_max(Mp), run_sum(Mp), acc(Mp * Dp),
        tile(nodes * T), tile_lo(ld_p / kTileRows + 1), tile_hi(ld_p / kTileRows + 1),
        tile_seen(ld_p / kTileRows + 1) {}
};

void gather_queries(const TreeAttentionArgs& a, const Task& t, int64_t G, Workspace& ws) {
  std::fill(ws.q.begin(), ws.q.end(), 0.0f);
  for (int64_t i = 0; i < t.nodes; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = i * G + g, h = t.kvh * G + g;
      const int64_t off = t.b * a.q_stride_b + (t.n0 + i) * a.q_stride_n + h * a.q_stride_h;
      const float* q = load_row(a.q, off, a.D, a.dtype, ws.row.data());
      std::copy(q, q + a.D, ws.q.data() + m * a.D);
    }
  }
  std::fill(ws.run_max.begin(), ws.run_max.end(), kNegInf);
  std::fill(ws.run_sum.begin(), ws.run_sum.end(), 0.0f);
  std::fill(ws.acc.begin(), ws.acc.end(), 0.0f);
}

inline int64_t kv_offset(const TreeAttentionArgs& a, const Task& t, int64_t j) {
  return t.slot * a.kv_stride_b + j * a.kv_stride_l + t.kvh * a.kv_stride_h;
}

// The task's cache rows j0, j0 + 1, ... of K or V (base: a.k or a.v) as bytes: the first, the
// step from one row to the next, and an element's size (2 for bf16 and fp16, 4 for float32).
struct CacheRows {
  const char* first;
  int64_t step, elem;
};
inline CacheRows cache_rows(const TreeAttentionArgs& a, const Task& t, const void* base,
                            int64_t j0) {
  const int64_t elem = a.dtype == DType::kFloat32 ? 4 : 2;
  return {static_cast<const char*>(base) + kv_offset(a, t, j0) * elem, a.kv_stride_l * elem, elem};
}

// Step 1: p[m, col + r] = scale * <q_m, k_{j0+r}> for r < rows <= kTileRows (the caller masks);
// a padded query (m = M when M is odd) gets 0 and is never softmaxed, so its weights stay 0.
// Compiled per ISA level (cpu_math.h RHEO_ISA_COPIES), as is accumulate_tile: the two hot loops.
RHEO_ALWAYS_INLINE void score_tile_loop(const TreeAttentionArgs& a, const Task& t, int64_t j0,
                                        int64_t rows, int64_t col, Workspace& ws) {
  const int64_t D = a.D, ld = ws.ld_p;
  float* k_t = ws.k_t.data();
  int64_t r = 0;
  if (a.dtype != DType::kFloat16 && D % 8 == 0) {  // 8 x 8 blocks, converted and transposed
    const int64_t elem = a.dtype == DType::kFloat32 ? 4 : 2;
    for (; r + 8 <= rows; r += 8)
      for (int64_t d = 0; d < D; d += 8) {
        f32x8 block[8];
        for (int i = 0; i < 8; ++i)
          block[i] = load8(static_cast<const char*>(a.k) +
                               (kv_offset(a, t, j0 + r + i) + d) * elem, a.dtype);
        transpose8(block);
        for (int j = 0; j < 8; ++j) std::memcpy(k_t + (d + j) * kTileRows + r, &block[j], 32);
      }
  }
  for (; r < rows; ++r) {
    const float* k = load_row(a.k, kv_offset(a, t, j0 + r), D, a.dtype, ws.row.data());
    for (int64_t d = 0; d < D; ++d) k_t[d * kTileRows + r] = k[d];
  }
  const int64_t lanes = round_up(rows, 8);  // the vectors qk_rows_n reads
  if (rows < lanes)  // the last vector's rows past the tile score 0 and are never read
    for (int64_t d = 0; d < D; ++d) std::fill_n(k_t + d * kTileRows + rows, lanes - rows, 0.0f);
  for (int64_t m = 0; m < t.M; m += 2)  // Mp is even, so m + 1 is a real or padded query
    qk_rows_n(rows, k_t, ws.q.data() + m * D, ws.q.data() + (m + 1) * D, D,
              ws.p.data() + m * ld + col, ws.p.data() + (m + 1) * ld + col);
  for (int64_t m = 0; m < t.M; ++m) {
    float* s = ws.p.data() + m * ld + col;
    for (int64_t r = 0; r < rows; ++r) s[r] *= a.scale;
  }
  if (t.M % 2) std::fill_n(ws.p.data() + t.M * ld + col, kTileRows, 0.0f);  // the padded query
}
RHEO_ISA_COPIES(void, score_tile, score_tile_loop,
                (const TreeAttentionArgs& a, const Task& t, int64_t j0, int64_t rows, int64_t col,
                 Workspace& ws),
                (a, t, j0, rows, col, ws))

// The largest of p[0..n-1] (-inf when n = 0; NaNs ignored, as std::max(max, p) ignores them). A
// max is exact in any order, so 8 lanes at a time.
RHEO_ALWAYS_INLINE float row_max(const float* p, int64_t n) {
  const float ninf = kNegInf;
  f32x8 best = {ninf, ninf, ninf, ninf, ninf, ninf, ninf, ninf};
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) {
    f32x8 v;
    std::memcpy(&v, p + r, sizeof v);
    best = v > best ? v : best;
  }
  float out = kNegInf;
  for (int i = 0; i < 8; ++i) out = std::max(out, best[i]);
  for (; r < n; ++r) out = std::max(out, p[r]);
  return out;
}

// Step 2: online softmax. Raise each running max to cover the tile, rescale what was summed
// under the old max by exp(old - new), and turn the tile's scores into weights exp(s - max).
// Each query's weights are summed in row order (the tile's sum, then added to run_sum): eight
// queries at a time, one per lane (8 x 8 blocks transposed), where one query's sum alone waits
// on each add's latency (a 16-node tree: ~30% of the kernel).
RHEO_ALWAYS_INLINE void softmax_update_loop(const Task& t, int64_t rows, Workspace& ws,
                                            ExpRow exp_row) {
  const int64_t Dp = ws.Dp, ld = ws.ld_p;
  for (int64_t m = 0; m < t.M; ++m) {
    float* p = ws.p.data() + m * ld;
    const float new_max = std::max(ws.run_max[m], row_max(p, rows));
    if (new_max == kNegInf) {  // nothing visible yet: every weight of the tile is 0
      std::fill(p, p + rows, 0.0f);  // (its sum, 0, leaves run_sum as it is)
      continue;
    }
    const float correction = std::exp(ws.run_max[m] - new_max);  // exp(-inf) = 0 at the start
    if (correction != 1.0f) {
      ws.run_sum[m] *= correction;
      for (int64_t d = 0; d < Dp; ++d) ws.acc[m * Dp + d] *= correction;
    }
    for (int64_t r = 0; r < rows; ++r) p[r] -= new_max;
    exp_in_place(exp_row, p, rows);  // a masked score -inf gives weight 0
    ws.run_max[m] = new_max;
  }
  int64_t m = 0;
  for (; m + 8 <= t.M; m += 8) {
    f32x8 sum = {};
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8) {
      f32x8 block[8];
      for (int i = 0; i < 8; ++i) std::memcpy(&block[i], ws.p.data() + (m + i) * ld + r, 32);
      transpose8(block);  // block[j] = row r + j of the 8 queries
      for (int j = 0; j < 8; ++j) sum += block[j];
    }
    for (; r < rows; ++r) {
      f32x8 v;
      for (int i = 0; i < 8; ++i) v[i] = ws.p[(m + i) * ld + r];
      sum += v;
    }
    for (int i = 0; i < 8; ++i) ws.run_sum[m + i] += sum[i];
  }
  for (; m < t.M; ++m) {
    const float* p = ws.p.data() + m * ld;
    float sum = 0.0f;
    for (int64_t r = 0; r < rows; ++r) sum += p[r];
    ws.run_sum[m] += sum;
  }
}
RHEO_ISA_COPIES(void, softmax_update, softmax_update_loop,
                (const Task& t, int64_t rows, Workspace& ws, ExpRow exp_row),
                (t, rows, ws, exp_row))

// Step 3: acc[m] += sum_r p[m, col + r] * v_{j0+r} for r < rows <= kTileRows, two queries and
// kDimBlock columns at a time.
RHEO_ALWAYS_INLINE void accumulate_tile_loop(const TreeAttentionArgs& a, const Task& t,
                                             int64_t j0, int64_t rows, int64_t col,
                                             Workspace& ws) {
  const int64_t Dp = ws.Dp, D = a.D;
  const bool vector = a.dtype != DType::kFloat16 && D % 8 == 0;
  const int64_t elem = a.dtype == DType::kFloat32 ? 4 : 2;
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = ws.v_tile.data() + r * Dp;
    if (vector) {
      const char* src = static_cast<const char*>(a.v) + kv_offset(a, t, j0 + r) * elem;
      for (int64_t d = 0; d < D; d += 8) {
        const f32x8 v = load8(src + d * elem, a.dtype);
        std::memcpy(dst + d, &v, sizeof v);
      }
      continue;
    }
    const float* v = load_row(a.v, kv_offset(a, t, j0 + r), D, a.dtype, dst);
    if (v != dst) std::memcpy(dst, v, D * sizeof(float));  // fp32: copy into the padded tile
  }
  for (int64_t m = 0; m < t.M; m += 2) {  // Mp is even, so m + 1 is a real or padded query
    float* out0 = ws.acc.data() + m * Dp;
    const float* w0 = ws.p.data() + m * ws.ld_p + col;
    for (int64_t d0 = 0; d0 < Dp; d0 += kDimBlock)
      pv_block(w0, w0 + ws.ld_p, ws.v_tile.data() + d0, Dp, rows, out0 + d0, out0 + Dp + d0);
  }
}
RHEO_ISA_COPIES(void, accumulate_tile, accumulate_tile_loop,
                (const TreeAttentionArgs& a, const Task& t, int64_t j0, int64_t rows, int64_t col,
                 Workspace& ws),
                (a, t, j0, rows, col, ws))

// --- the AVX-512 level's score and V loops: 16 lanes, no scratch round trip ---
//
// The same sums in the same order as score_tile_loop and accumulate_tile_loop, so the same bits
// (tests/test_cpu_isa.py): a score is still the sum over d in order of q[d] * k[d], each product
// and sum rounded, then times the scale; acc[m, d] still adds w[m, r] * v[r, d] over the rows in
// order. What changes is where the operands live. Scores: 16 cache rows x 16 head dims are
// loaded (bf16 widened by a shift), transposed in registers (lanes over rows) and multiplied into
// the accumulators of up to kScoreGroup queries at once, where the 8-lane loops stored the
// transposed K to scratch and read it back per pair of queries. V: each row is widened once per
// group of queries and added into accumulators that stay in registers for the whole tile, where
// the 8-lane loops converted the tile to scratch and walked it per pair of queries and 32
// columns. A plain step's task (G = 1-4 queries) ran ~3x as many instructions the old way.
#ifdef RHEO_HAVE_X86_EXP
constexpr int kScoreGroup = 8;  // queries a score pass holds: 8 sums + 16 rows + a broadcast

#define RHEO_AVX512 __attribute__((target("avx512f"), always_inline)) inline

// 16 elements at src as float32 (bf16 widened by a shift, as load8).
RHEO_AVX512 __m512 load16(const char* src, DType dtype) {
  if (dtype == DType::kFloat32) return _mm512_loadu_ps(src);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// r[0..15] (16 rows of 16) transposed in place: r[j][i] = old r[i][j].
RHEO_AVX512 void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0x88);
      t[h + 4 + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0xDD);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
  }
}

// p[g * ld + r] = scale * <q_g, k_{j0+r}> for the Q queries q [Q, D] and r < rows.
template <int Q>
__attribute__((target("avx512f"))) void score_rows_avx512(const TreeAttentionArgs& a,
                                                          const Task& t, int64_t j0,
                                                          int64_t rows, const float* q,
                                                          float* p, int64_t ld) {
  const int64_t D = a.D;
  const auto [k, step, elem] = cache_rows(a, t, a.k, j0);
  for (int64_t r = 0; r < rows; r += 16) {
    const int64_t n = std::min<int64_t>(16, rows - r);
    const char* rows16 = k + r * step;
    __m512 acc[Q];
    for (int g = 0; g < Q; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m512 b[16];
      if (n == 16) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) b[i] = load16(rows16 + i * step + d * elem, a.dtype);
      } else {
        for (int i = 0; i < 16; ++i)
          b[i] = i < n ? load16(rows16 + i * step + d * elem, a.dtype) : _mm512_setzero_ps();
      }
      transpose16(b);  // b[j] = dim d + j of the 16 rows
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
#pragma GCC unroll 8
        for (int g = 0; g < Q; ++g)
          acc[g] = _mm512_add_ps(acc[g], _mm512_mul_ps(b[j], _mm512_set1_ps(q[g * D + d + j])));
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < Q; ++g)
      _mm512_mask_storeu_ps(p + g * ld + r, keep, _mm512_mul_ps(acc[g], _mm512_set1_ps(a.scale)));
  }
}

// acc[g * Dp + d] += sum_r w[g * ld + r] * v_r[d] for the Q queries, D = 16 * V; row r of V at
// src + r * step bytes, in dtype.
template <int V, int Q>
__attribute__((target("avx512f"))) void value_rows_avx512(const char* src, int64_t step,
                                                          DType dtype, int64_t rows,
                                                          const float* w, int64_t ld, float* acc,
                                                          int64_t Dp) {
  const int64_t elem = dtype == DType::kFloat32 ? 4 : 2;
  __m512 s[Q][V];
  for (int g = 0; g < Q; ++g)
    for (int i = 0; i < V; ++i) s[g][i] = _mm512_loadu_ps(acc + g * Dp + 16 * i);
  for (int64_t r = 0; r < rows; ++r, src += step) {
    __m512 x[V];
    for (int i = 0; i < V; ++i) x[i] = load16(src + 16 * i * elem, dtype);
    for (int g = 0; g < Q; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * ld + r]);
      for (int i = 0; i < V; ++i) s[g][i] = _mm512_add_ps(s[g][i], _mm512_mul_ps(x[i], wg));
    }
  }
  for (int g = 0; g < Q; ++g)
    for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc + g * Dp + 16 * i, s[g][i]);
}

// k_t [D, kTileRows] = the tile's rows j0..j0+rows-1 transposed (16 x 16 blocks), rows past
// ``rows`` in the last block zero: for a task of several score groups, transposed once.
__attribute__((target("avx512f"))) void transpose_tile_avx512(const TreeAttentionArgs& a,
                                                              const Task& t, int64_t j0,
                                                              int64_t rows, float* k_t) {
  const int64_t D = a.D;
  const auto [k, step, elem] = cache_rows(a, t, a.k, j0);
  for (int64_t r = 0; r < rows; r += 16) {
    const int64_t n = std::min<int64_t>(16, rows - r);
    for (int64_t d = 0; d < D; d += 16) {
      __m512 b[16];
      for (int i = 0; i < 16; ++i)
        b[i] = i < n ? load16(k + (r + i) * step + d * elem, a.dtype) : _mm512_setzero_ps();
      transpose16(b);
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(k_t + (d + j) * kTileRows + r, b[j]);
    }
  }
}

// score_rows_avx512 from a transposed tile k_t [D, kTileRows] (transpose_tile_avx512).
template <int Q>
__attribute__((target("avx512f"))) void score_transposed_avx512(const float* k_t, int64_t D,
                                                                int64_t rows, const float* q,
                                                                float scale, float* p,
                                                                int64_t ld) {
  for (int64_t r = 0; r < rows; r += 16) {
    const int64_t n = std::min<int64_t>(16, rows - r);
    __m512 acc[Q];
    for (int g = 0; g < Q; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 kd = _mm512_loadu_ps(k_t + d * kTileRows + r);
#pragma GCC unroll 8
      for (int g = 0; g < Q; ++g)
        acc[g] = _mm512_add_ps(acc[g], _mm512_mul_ps(kd, _mm512_set1_ps(q[g * D + d])));
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < Q; ++g)
      _mm512_mask_storeu_ps(p + g * ld + r, keep, _mm512_mul_ps(acc[g], _mm512_set1_ps(scale)));
  }
}

// ws.v_tile [rows, Dp] = the tile's V rows j0..j0+rows-1 as float32 (converted once for a task of
// several value groups).
__attribute__((target("avx512f"))) void convert_values_avx512(const TreeAttentionArgs& a,
                                                              const Task& t, int64_t j0,
                                                              int64_t rows, float* v_tile,
                                                              int64_t Dp) {
  const auto [first, step, elem] = cache_rows(a, t, a.v, j0);
  const char* src = first;
  for (int64_t r = 0; r < rows; ++r, src += step)
    for (int64_t d = 0; d < a.D; d += 16)
      _mm512_storeu_ps(v_tile + r * Dp + d, load16(src + d * elem, a.dtype));
}

// score_rows_avx512 on the AVX2 level: 8 cache rows x 8 head dims transposed in registers.
template <int Q>
__attribute__((target("avx2"))) void score_rows_avx2(const TreeAttentionArgs& a, const Task& t,
                                                     int64_t j0, int64_t rows, const float* q,
                                                     float* p, int64_t ld) {
  const int64_t D = a.D;
  const auto [k, step, elem] = cache_rows(a, t, a.k, j0);
  for (int64_t r = 0; r < rows; r += 8) {
    const int64_t n = std::min<int64_t>(8, rows - r);
    const char* rows8 = k + r * step;
    f32x8 acc[Q] = {};
    for (int64_t d = 0; d < D; d += 8) {
      f32x8 b[8];
      if (n == 8) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) b[i] = load8(rows8 + i * step + d * elem, a.dtype);
      } else {
        for (int i = 0; i < 8; ++i)
          b[i] = i < n ? load8(rows8 + i * step + d * elem, a.dtype) : f32x8{};
      }
      transpose8(b);  // b[j] = dim d + j of the 8 rows
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
#pragma GCC unroll 8
        for (int g = 0; g < Q; ++g) acc[g] += b[j] * q[g * D + d + j];
    }
    for (int g = 0; g < Q; ++g)
      for (int64_t i = 0; i < n; ++i) p[g * ld + r + i] = acc[g][i] * a.scale;
  }
}

// Which loops run this call's scores and V sums: the 16-lane ones on the AVX-512 level, the
// 8-lane register-blocked scores on the AVX2 level (its V sums stay accumulate_tile's), for bf16
// or float32 with D a multiple of 16 up to 128 (AVX-512: value_rows_avx512's accumulators stay in
// registers) or of 8 (AVX2); else the ISA copies of score_tile and accumulate_tile.
enum class Loops { kCopies, kAvx2, kAvx512 };
Loops loops_for(const TreeAttentionArgs& a) {
  if (a.dtype == DType::kFloat16) return Loops::kCopies;
  const cpu::Isa isa = cpu::active_isa();
  if (isa == cpu::Isa::kAvx512 && a.D % 16 == 0 && a.D <= 128) return Loops::kAvx512;
  if (isa >= cpu::Isa::kAvx2 && a.D % 8 == 0) return Loops::kAvx2;
  return Loops::kCopies;
}

// Calls f.template operator()<N>() for N = n in [1, 8] (templates for register-held arrays).
template <typename F>
void with_count(int64_t n, F&& f) {
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// score_tile by the register-blocked loops, the queries in as few balanced groups as the level's
// registers allow (8 on AVX-512, 6 on AVX2).
void score_tile_blocked(const TreeAttentionArgs& a, const Task& t, int64_t j0, int64_t rows,
                        int64_t col, Workspace& ws, Loops loops) {
  const int64_t most = loops == Loops::kAvx512 ? 8 : 6;
  const int64_t groups = (t.M + most - 1) / most;
  const int64_t size = (t.M + groups - 1) / groups;
  // several groups on AVX-512: the tile transposed once into k_t, which each group reads
  const bool once = loops == Loops::kAvx512 && groups > 1;
  if (once) transpose_tile_avx512(a, t, j0, rows, ws.k_t.data());
  for (int64_t m = 0; m < t.M; m += size) {
    const float* q = ws.q.data() + m * a.D;
    float* p = ws.p.data() + m * ws.ld_p + col;
    with_count(std::min(size, t.M - m), [&](auto Q) {
      if (once) return score_transposed_avx512<Q>(ws.k_t.data(), a.D, rows, q, a.scale, p, ws.ld_p);
      if (loops == Loops::kAvx512) return score_rows_avx512<Q>(a, t, j0, rows, q, p, ws.ld_p);
      if constexpr (Q <= 6) score_rows_avx2<Q>(a, t, j0, rows, q, p, ws.ld_p);
    });
  }
  if (t.M % 2) std::fill_n(ws.p.data() + t.M * ws.ld_p + col, kTileRows, 0.0f);  // as score_tile
}

// accumulate_tile by value_rows_avx512 (the AVX-512 level): 24 / (D / 16) queries at a time, at
// most 8 (their sums, a row's V and a broadcast in 32 registers; 16 / (D / 16) was ~4% slower).
void accumulate_tile_blocked(const TreeAttentionArgs& a, const Task& t, int64_t j0, int64_t rows,
                             int64_t col, Workspace& ws) {
  const int64_t vecs = a.D / 16, per = std::min<int64_t>(8, 24 / vecs);
  const CacheRows v = cache_rows(a, t, a.v, j0);
  const char* src = v.first;  // (not structured bindings: the lambdas below read them)
  int64_t step = v.step;
  DType dtype = a.dtype;
  if (t.M > per) {  // several groups: the tile's V rows converted once, read by each group
    convert_values_avx512(a, t, j0, rows, ws.v_tile.data(), ws.Dp);
    src = reinterpret_cast<const char*>(ws.v_tile.data());
    step = ws.Dp * 4;
    dtype = DType::kFloat32;
  }
  for (int64_t m = 0; m < t.M; m += per) {
    const int64_t q = std::min(per, t.M - m);
    with_count(vecs, [&](auto V) {
      with_count(q, [&](auto Q) {
        if constexpr (V * Q <= 24)
          value_rows_avx512<V, Q>(src, step, dtype, rows, ws.p.data() + m * ws.ld_p + col,
                                  ws.ld_p, ws.acc.data() + m * ws.Dp, ws.Dp);
      });
    });
  }
}
#undef RHEO_AVX512
#endif  // RHEO_HAVE_X86_EXP

// The score and V steps of a tile: the register-blocked loops where loops_for allows, else the
// ISA copies.
void scores(const TreeAttentionArgs& a, const Task& t, int64_t j0, int64_t rows, int64_t col,
            Workspace& ws) {
#ifdef RHEO_HAVE_X86_EXP
  // On AVX2 only for a task of one group: with more, each group transposes K again, where
  // score_tile transposes it once into scratch (a 16-node tree's 48 queries: 1.8x its time).
  const Loops loops = loops_for(a);
  if (loops == Loops::kAvx512 || (loops == Loops::kAvx2 && t.M <= 6))
    return score_tile_blocked(a, t, j0, rows, col, ws, loops);
#endif
  score_tile(a, t, j0, rows, col, ws);
}

void accumulate(const TreeAttentionArgs& a, const Task& t, int64_t j0, int64_t rows, int64_t col,
                Workspace& ws) {
#ifdef RHEO_HAVE_X86_EXP
  if (loops_for(a) == Loops::kAvx512) return accumulate_tile_blocked(a, t, j0, rows, col, ws);
#endif
  accumulate_tile(a, t, j0, rows, col, ws);
}

// Step 4: out = acc / run_sum. A node that sees no row at all (P_b = 0 and an empty
// mask row) gets zeros, as the header states.
void write_outputs(const TreeAttentionArgs& a, const Task& t, int64_t G, Workspace& ws) {
  for (int64_t m = 0; m < t.M; ++m) {
    float* row = ws.acc.data() + m * ws.Dp;
    const float inv = ws.run_sum[m] > 0.0f ? 1.0f / ws.run_sum[m] : 0.0f;
    for (int64_t d = 0; d < a.D; ++d) row[d] *= inv;
    const int64_t n = t.n0 + m / G, h = t.kvh * G + m % G;
    store_row(a.out, ((t.b * a.N + n) * a.H + h) * a.D, row, a.D, a.dtype);
  }
}

// One softmax tile over the cache rows [lo, hi) (hi - lo <= ws.ld_p): scores in chunks of
// kTileRows, then the rows query m does not see set to -inf (with ``tile``, a tree row j >= P
// that node m / G does not place in tile k: tile[(m / G) * T + j - P] != k; the prefix's rows
// are seen by all), one online-softmax update over the whole width, and the V rows in the same
// chunks.
void run_tile(const TreeAttentionArgs& a, const Task& t, int64_t lo, int64_t hi, Workspace& ws,
              ExpRow exp_row, const int32_t* tile = nullptr, int64_t G = 1, int64_t k = 0) {
  for (int64_t j0 = lo; j0 < hi; j0 += kTileRows)
    scores(a, t, j0, std::min(kTileRows, hi - j0), j0 - lo, ws);
  const int64_t P = t.prefix, T = tree_rows(a), first = std::max(lo, P);
  for (int64_t m = 0; tile != nullptr && m < t.M; ++m) {
    float* s = ws.p.data() + m * ws.ld_p - lo;
    const int32_t* seen = tile + (m / G) * T - P;  // seen[j]: the tile of tree row j
    for (int64_t j = first; j < hi; ++j) s[j] = seen[j] == k ? s[j] : kNegInf;
  }
  softmax_update(t, hi - lo, ws, exp_row);
  for (int64_t j0 = lo; j0 < hi; j0 += kTileRows)
    accumulate(a, t, j0, std::min(kTileRows, hi - j0), j0 - lo, ws);
}

// The tiles follow each query's visible rows, not the slot's: node n sees the prefix and then its
// visible tree rows in order (its ancestors and itself, as a token generated one at a time saw
// them), and its k-th visible row has rank P + k. The online softmax groups ranks into tiles of
// kTileRows from rank 0, so a node's output is bit for bit a single query's over the same rows
// laid out contiguously: greedy `rheo` equals greedy `ar`. Grouping the slot's rows instead put a
// deep node's own row in the next tile whenever the siblings before it crossed a tile boundary
// (another order of float sums). The prefix's whole tiles are shared by every query; then tile k
// of the rest holds, per query, the ranks [P0 + k kTileRows, P0 + (k + 1) kTileRows), P0 the
// prefix rounded down to kTileRows: run over the rows any query places there, each query masked
// to its own.
void run_task(const TreeAttentionArgs& a, const Task& t, int64_t G, Workspace& ws, ExpRow exp_row) {
  gather_queries(a, t, G, ws);
  const int64_t P = t.prefix, T = tree_rows(a);
  const int64_t P0 = P / kTileRows * kTileRows;
  for (int64_t j0 = 0; j0 < P0; j0 += kTileRows)
    run_tile(a, t, j0, j0 + kTileRows, ws, exp_row);
  // tile[i, c]: the tile of node i's tree row c; [lo[k], hi[k]): the rows any query places in
  // tile k (tile 0 starts with the prefix's last rows); seen[k]: the (node, tree row) pairs in
  // tile k. One pass over the mask, 8 columns at a time where they are all hidden or all seen
  // within one tile (a prefill's rows: thousands of columns).
  int32_t* tile = ws.tile.data();
  int64_t *lo = ws.tile_lo.data(), *hi = ws.tile_hi.data(), *seen = ws.tile_seen.data();
  for (size_t k = 0; k < ws.tile_lo.size(); ++k) {
    lo[k] = k == 0 ? P0 : P + T;
    hi[k] = P;
    seen[k] = 0;
  }
  int64_t last = 0;
  for (int64_t i = 0; i < t.nodes; ++i) {
    const uint8_t* mask = a.tree_mask + (t.b * a.N + t.n0 + i) * T;
    int32_t* row = tile + i * T;
    int64_t rank = P - P0, cur = -1, first = 0, end = 0, run = 0;  // the tile k the node is in
    const auto close = [&] {  // the node's columns [first, end) in tile cur, run of them seen
      if (cur < 0) return;
      lo[cur] = std::min(lo[cur], P + first);
      hi[cur] = std::max(hi[cur], P + end);
      seen[cur] += run;
      last = std::max(last, cur);
    };
    const auto one = [&](int64_t c) {
      if (!mask[c]) {
        row[c] = -1;
        return;
      }
      const int64_t k = rank++ / kTileRows;
      if (k != cur) {
        close();
        cur = k, first = c, run = 0;
      }
      row[c] = static_cast<int32_t>(k);
      end = c + 1;
      ++run;
    };
    int64_t c = 0;
    for (; c + 8 <= T; c += 8) {
      uint64_t bytes;
      std::memcpy(&bytes, mask + c, sizeof bytes);
      const int64_t k = rank / kTileRows;
      if (bytes == 0) {
        std::fill_n(row + c, 8, -1);
      } else if (bytes == 0x0101010101010101ull && k == (rank + 7) / kTileRows && k == cur) {
        std::fill_n(row + c, 8, static_cast<int32_t>(k));
        rank += 8, end = c + 8, run += 8;
      } else {
        for (int64_t j = c; j < c + 8; ++j) one(j);
      }
    }
    for (; c < T; ++c) one(c);
    close();
  }
  for (int64_t k = 0; k <= last; ++k) {
    if (lo[k] >= hi[k]) continue;
    // every node sees every tree row of the tile: nothing to mask
    const bool all = seen[k] == t.nodes * (hi[k] - std::max(lo[k], P));
    run_tile(a, t, lo[k], hi[k], ws, exp_row, all ? nullptr : tile, G, k);
  }
  write_outputs(a, t, G, ws);
}

}  // namespace

int64_t tree_attention_exp_mismatches(int64_t first, int64_t last, int64_t stride) {
  RHEO_CHECK(0 <= first && first <= last && last <= 0xFFFFFFFFll && stride >= 1,
             "tree_attention_exp_mismatches needs 0 <= first <= last <= 2^32 - 1 and stride >= 1, ",
             "got first=", first, ", last=", last, ", stride=", stride);
  const ExpRow exp_row = vector_exp();
  return exp_row == nullptr ? -1 : exp_row_mismatches(exp_row, first, last, stride);
}

void tree_attention_cpu(const TreeAttentionArgs& args) {
  RHEO_CHECK(args.D >= 1 && args.H >= 1 && args.Hkv >= 1, "tree_attention needs D, H, Hkv >= 1, ",
             "got D=", args.D, ", H=", args.H, ", Hkv=", args.Hkv);
  RHEO_CHECK(args.H % args.Hkv == 0, "H=", args.H, " heads is not a multiple of Hkv=", args.Hkv,
             " KV heads (GQA needs H % Hkv == 0)");
  RHEO_CHECK(args.prefix_len >= 0, "prefix_len must be >= 0, got ", args.prefix_len);
  RHEO_CHECK(args.dtype != DType::kFloat64, "tree_attention takes float32, float16 or bfloat16, ",
             "got float64; convert q, k, v with .float()");
  // prefix_lens and kv_slots are host memory here: check every value before any work.
  for (int64_t b = 0; args.prefix_lens && b < args.B; ++b)
    RHEO_CHECK(args.prefix_lens[b] >= 0 && args.prefix_lens[b] <= args.prefix_len, "prefix_lens[",
               b, "]=", args.prefix_lens[b], " must be in [0, prefix_len=", args.prefix_len,
               "]; pass prefix_len = max(prefix_lens)");
  if (args.kv_slots && args.B > 0)
    RHEO_CHECK(args.S >= 1, "kv_slots needs S >= 1, the slots of k and v (their first dim), ",
               "got S=", args.S, "; set args.S");
  for (int64_t b = 0; args.kv_slots && b < args.B; ++b)
    RHEO_CHECK(args.kv_slots[b] >= 0 && args.kv_slots[b] < args.S, "kv_slots[", b, "]=",
               args.kv_slots[b], " must be a slot of k and v, in [0, S=", args.S,
               "); pass the slot that holds sequence ", b);
  if (args.B == 0 || args.N == 0) return;
  const int64_t G = args.H / args.Hkv;
  const int64_t nodes = std::clamp<int64_t>(kTargetRows / G, 1, args.N);
  const int64_t blocks = (args.N + nodes - 1) / nodes;
  const int64_t n_tasks = args.B * args.Hkv * blocks;
#ifdef _OPENMP
  const int n_threads = omp_get_max_threads();
#else
  const int n_threads = 1;
#endif
  const ExpRow exp_row = vector_exp();  // (its first call checks it, outside the parallel region)
  // One workspace per thread, allocated here: nothing may throw inside the parallel region. The
  // calling thread's are kept for its next call of the same sizes (every layer of a step, every
  // step), rather than ~40 KB allocated and zeroed a call.
  const int64_t T = tree_rows(args);
  thread_local std::vector<Workspace> kept;
  thread_local int64_t kept_sizes[4] = {-1, -1, -1, -1};
  const int64_t sizes[4] = {args.D, nodes * G, nodes, T};
  if (static_cast<int>(kept.size()) != n_threads || !std::equal(sizes, sizes + 4, kept_sizes)) {
    kept.assign(n_threads, Workspace(args.D, nodes * G, nodes, T));
    std::copy(sizes, sizes + 4, kept_sizes);
  }
  std::vector<Workspace>& spaces = kept;
#pragma omp parallel for schedule(dynamic) if (n_threads > 1 && n_tasks > 1)
  for (int64_t task = 0; task < n_tasks; ++task) {
#ifdef _OPENMP
    Workspace& ws = spaces[omp_get_thread_num()];
#else
    Workspace& ws = spaces[0];
#endif
    Task t;
    t.b = task / (args.Hkv * blocks);
    t.kvh = (task / blocks) % args.Hkv;
    t.n0 = (task % blocks) * nodes;
    t.nodes = std::min(nodes, args.N - t.n0);
    t.M = t.nodes * G;
    t.prefix = args.prefix_lens ? args.prefix_lens[t.b] : args.prefix_len;
    t.slot = args.kv_slots ? args.kv_slots[t.b] : t.b;
    run_task(args, t, G, ws, exp_row);
  }
}

}  // namespace rheo
