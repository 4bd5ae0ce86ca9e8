// Tree attention on the CPU (docs/algorithm.md §2, step 2): every tree node attends to the whole
// cached prefix plus the tree rows its mask allows, with GQA.
//
// Work split: one task per (b, KV head, block of nodes). A task reads only its own sequence: the
// slot kv_slots[b] (or b) and rows 0..P_b+N-1 of it, P_b its prefix length, so a sequence's
// output is the same bits whatever else is in the batch (the tiles start at row 0 for every b).
// A task holds the M = nodes * G query rows (G = H / Hkv heads share the KV head), so each K/V row
// is loaded (and converted from bf16/fp16) once per task and used by all M queries. The rows of
// the cache are walked in tiles of kTileRows with an online softmax (running max and sum per
// query, as in FlashAttention), which keeps the per-thread workspace small whatever the prefix
// length. Everything is float32: loads are converted, scores, softmax and the V accumulation too.
//
// A score is the sum over d in order of q[d] * k[d] (each product and sum rounded), computed
// with the vector lanes over a tile's cache rows (K converted and transposed 8 x 8): a plain
// step's task has only G = 1-4 queries, which lanes over queries padded to 16 (widened 1B's
// layer at one node, 300 cached rows: 507 -> 255 us on a Zen 4, one thread; same bits).
#include "rheo/tree_attention.h"

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
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
constexpr int kDimBlock = 16;            // head-dim columns per V block; D is padded to it
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

// s0[r] = <q0, k_r>, s1[r] = <q1, k_r> for the kTileRows cache rows stored as columns of k_t
// [D, kTileRows] (the lanes run over cache rows: each query's score is the sum over d in order,
// and a short task wastes no lane, where lanes over queries padded 2-3 queries to 16).
RHEO_ALWAYS_INLINE void qk_rows(const float* k_t, const float* q0, const float* q1, int64_t D,
                                float* s0, float* s1) {
  f32x8 acc0[kRowVecs] = {}, acc1[kRowVecs] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* k = k_t + d * kTileRows;
    const float b0 = q0[d], b1 = q1[d];
    for (int i = 0; i < kRowVecs; ++i) {
      f32x8 ki;
      std::memcpy(&ki, k + 8 * i, sizeof ki);
      acc0[i] += ki * b0;
      acc1[i] += ki * b1;
    }
  }
  std::memcpy(s0, acc0, sizeof acc0);
  std::memcpy(s1, acc1, sizeof acc1);
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

// --- one task: queries of nodes n0..n0+nodes-1, heads kvh*G..kvh*G+G-1 of batch entry b ---

struct Task {
  int64_t b, kvh, n0, nodes, M;  // query row m = (n - n0) * G + g, head h = kvh * G + g
  int64_t prefix, slot;          // P_b (prefix_lens[b] or prefix_len) and the k/v slot of b
};

// Per-thread scratch, sized for the largest task: Mp = M rounded up to 2 (queries go in pairs),
// Dp = D rounded up to kDimBlock. A padded query is zero and gets weight 0.
struct Workspace {
  int64_t Mp, Dp;
  std::vector<float> q;        // [Mp, D]  queries as rows
  std::vector<float> row;      // [D]      one converted K row
  std::vector<float> k_t;      // [D, kTileRows]  the tile's K rows as columns, zero-padded
  std::vector<float> v_tile;   // [kTileRows, Dp]  converted V rows, zero-padded
  std::vector<float> p;        // [Mp, kTileRows]  scores of a tile, then exp weights
  std::vector<float> run_max;  // [Mp]  running max of the scores seen so far
  std::vector<float> run_sum;  // [Mp]  running sum of exp(score - run_max)
  std::vector<float> acc;      // [Mp, Dp]  running sum of exp(score - run_max) * v
  Workspace(int64_t D, int64_t M)
      : Mp(round_up(M, 2)), Dp(round_up(D, kDimBlock)), q(Mp * D), row(D), k_t(D * kTileRows),
        v_tile(kTileRows * Dp), p(Mp * kTileRows), run_max(Mp), run_sum(Mp), acc(Mp * Dp) {}
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

// May query row m see cache row j? Every prefix row; tree row P_b + c if tree_mask allows.
inline bool allowed(const TreeAttentionArgs& a, const Task& t, int64_t G, int64_t m, int64_t j) {
  if (j < t.prefix) return true;
  const int64_t n = t.n0 + m / G;
  return a.tree_mask[(t.b * a.N + n) * a.N + (j - t.prefix)] != 0;
}

inline int64_t kv_offset(const TreeAttentionArgs& a, const Task& t, int64_t j) {
  return t.slot * a.kv_stride_b + j * a.kv_stride_l + t.kvh * a.kv_stride_h;
}

// Step 1: p[m, r] = scale * <q_m, k_{j0+r}>, or -inf where the mask forbids the pair; a padded
// query (m = M when M is odd) gets 0 and is never softmaxed, so its weights stay 0. Compiled per
// ISA level (cpu_math.h RHEO_ISA_COPIES), as is accumulate_tile: the two hot loops.
RHEO_ALWAYS_INLINE void score_tile_loop(const TreeAttentionArgs& a, const Task& t, int64_t G,
                                        int64_t j0, int64_t rows, Workspace& ws) {
  const int64_t D = a.D;
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
  if (rows < kTileRows)  // the last tile: rows past it score 0 and are never read
    for (int64_t d = 0; d < D; ++d) std::fill_n(k_t + d * kTileRows + rows, kTileRows - rows, 0.0f);
  for (int64_t m = 0; m < t.M; m += 2)  // Mp is even, so m + 1 is a real or padded query
    qk_rows(k_t, ws.q.data() + m * D, ws.q.data() + (m + 1) * D, D,
            ws.p.data() + m * kTileRows, ws.p.data() + (m + 1) * kTileRows);
  for (int64_t m = 0; m < t.M; ++m) {
    float* s = ws.p.data() + m * kTileRows;
    for (int64_t r = 0; r < rows; ++r)
      s[r] = allowed(a, t, G, m, j0 + r) ? s[r] * a.scale : kNegInf;
  }
  if (t.M % 2) std::fill_n(ws.p.data() + t.M * kTileRows, kTileRows, 0.0f);  // the padded query
}
RHEO_ISA_COPIES(void, score_tile, score_tile_loop,
                (const TreeAttentionArgs& a, const Task& t, int64_t G, int64_t j0, int64_t rows,
                 Workspace& ws),
                (a, t, G, j0, rows, ws))

// Step 2: online softmax. Raise each running max to cover the tile, rescale what was summed
// under the old max by exp(old - new), and turn the tile's scores into weights exp(s - max).
void softmax_update(const Task& t, int64_t rows, Workspace& ws) {
  const int64_t Dp = ws.Dp;
  for (int64_t m = 0; m < t.M; ++m) {
    float* p = ws.p.data() + m * kTileRows;
    float tile_max = kNegInf;
    for (int64_t r = 0; r < rows; ++r) tile_max = std::max(tile_max, p[r]);
    const float new_max = std::max(ws.run_max[m], tile_max);
    if (new_max == kNegInf) {  // nothing visible yet: every weight of the tile is 0
      std::fill(p, p + rows, 0.0f);
      continue;
    }
    const float correction = std::exp(ws.run_max[m] - new_max);  // exp(-inf) = 0 at the start
    if (correction != 1.0f) {
      ws.run_sum[m] *= correction;
      for (int64_t d = 0; d < Dp; ++d) ws.acc[m * Dp + d] *= correction;
    }
    float sum = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      p[r] = std::exp(p[r] - new_max);  // a masked score -inf gives weight 0
      sum += p[r];
    }
    ws.run_sum[m] += sum;
    ws.run_max[m] = new_max;
  }
}

// Step 3: acc[m] += sum_r p[r, m] * v_{j0+r}, two queries and kDimBlock columns at a time.
RHEO_ALWAYS_INLINE void accumulate_tile_loop(const TreeAttentionArgs& a, const Task& t,
                                             int64_t j0, int64_t rows, Workspace& ws) {
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
    const float* w0 = ws.p.data() + m * kTileRows;
    for (int64_t d0 = 0; d0 < Dp; d0 += kDimBlock)
      pv_block(w0, w0 + kTileRows, ws.v_tile.data() + d0, Dp, rows, out0 + d0, out0 + Dp + d0);
  }
}
RHEO_ISA_COPIES(void, accumulate_tile, accumulate_tile_loop,
                (const TreeAttentionArgs& a, const Task& t, int64_t j0, int64_t rows,
                 Workspace& ws),
                (a, t, j0, rows, ws))

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

void run_task(const TreeAttentionArgs& a, const Task& t, int64_t G, Workspace& ws) {
  gather_queries(a, t, G, ws);
  const int64_t L = t.prefix + a.N;  // cache rows any node of sequence b may see
  for (int64_t j0 = 0; j0 < L; j0 += kTileRows) {
    const int64_t rows = std::min(kTileRows, L - j0);
    score_tile(a, t, G, j0, rows, ws);
    softmax_update(t, rows, ws);
    accumulate_tile(a, t, j0, rows, ws);
  }
  write_outputs(a, t, G, ws);
}

}  // namespace

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
  // One workspace per thread, allocated here: nothing may throw inside the parallel region.
  std::vector<Workspace> spaces(n_threads, Workspace(args.D, nodes * G));
#pragma omp parallel for schedule(dynamic)
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
    run_task(args, t, G, ws);
  }
}

}  // namespace rheo
