// Tree attention on the CPU (docs/algorithm.md §2, step 2): every tree node attends to the whole
// cached prefix plus the tree rows its mask allows, with GQA.
//
// Work split: one task per (b, KV head, block of nodes). A task reads only its own sequence: the
// slot kv_slots[b] (or b) and rows 0..P_b+N-1 of it, P_b its prefix length, so a sequence's output
// is the same bits whatever else is in the batch (the tiles start at row 0 for every b). A task holds the M = nodes * G query
// rows (G = H / Hkv heads share the KV head) as one small matrix, so each K/V row is loaded
// (and converted from bf16/fp16) once per task and used by all M queries. The rows of the cache
// are walked in tiles of kTileRows with an online softmax (running max and sum per query, as in
// FlashAttention), which keeps the per-thread workspace small whatever the prefix length.
// Everything is float32: loads are converted, scores, softmax and the V accumulation too.
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
// registers, so each load of q or v feeds several multiply-adds. Loads go through memcpy: no
// alignment is assumed. ---

typedef float f32x8 __attribute__((vector_size(32)));
constexpr int kQueryBlock = 16;  // queries per score block; M is padded to a multiple of it
constexpr int kDimBlock = 16;    // head-dim columns per V block; D is padded to a multiple of it
constexpr int kVecs = kQueryBlock / 8;
static_assert(kQueryBlock == kDimBlock, "qk_block and pv_block share kVecs");

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// s0[i] = <q_i, k0>, s1[i] = <q_i, k1> for the kQueryBlock queries stored as columns of q_t
// [D, ld] (one query per column, so the vector lanes run over queries, not over a reduction).
RHEO_ALWAYS_INLINE void qk_block(const float* q_t, int64_t ld, const float* k0, const float* k1,
                                 int64_t D, float* s0, float* s1) {
  f32x8 acc0[kVecs] = {}, acc1[kVecs] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* q = q_t + d * ld;
    const float b0 = k0[d], b1 = k1[d];
    for (int i = 0; i < kVecs; ++i) {
      f32x8 qi;
      std::memcpy(&qi, q + 8 * i, sizeof qi);
      acc0[i] += qi * b0;
      acc1[i] += qi * b1;
    }
  }
  std::memcpy(s0, acc0, sizeof acc0);
  std::memcpy(s1, acc1, sizeof acc1);
}

// out0 += sum_r w[r, 0] * v[r, :], out1 += sum_r w[r, 1] * v[r, :] over kDimBlock columns;
// w [rows, ld_w] holds the weights of two neighbouring queries, v [rows, ld_v] the V rows.
RHEO_ALWAYS_INLINE void pv_block(const float* w, int64_t ld_w, const float* v, int64_t ld_v,
                                 int64_t rows, float* out0, float* out1) {
  f32x8 acc0[kVecs], acc1[kVecs];
  std::memcpy(acc0, out0, sizeof acc0);
  std::memcpy(acc1, out1, sizeof acc1);
  for (int64_t r = 0; r < rows; ++r) {
    const float w0 = w[r * ld_w], w1 = w[r * ld_w + 1];
    const float* vr = v + r * ld_v;
    for (int i = 0; i < kVecs; ++i) {
      f32x8 vi;
      std::memcpy(&vi, vr + 8 * i, sizeof vi);
      acc0[i] += vi * w0;
      acc1[i] += vi * w1;
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

// Per-thread scratch, sized for the largest task: Mp = M rounded up to kQueryBlock, Dp = D
// rounded up to kDimBlock. Padding columns stay zero, so padded queries get weight 0.
struct Workspace {
  int64_t Mp, Dp;
  std::vector<float> q_t;      // [D, Mp]  queries as columns
  std::vector<float> k_tile;   // [kTileRows + 1, D]  converted K rows; the last stays zero
  std::vector<float> v_tile;   // [kTileRows, Dp]     converted V rows, zero-padded
  std::vector<float> p;        // [kTileRows, Mp]     scores of a tile, then exp weights
  std::vector<float> run_max;  // [Mp]  running max of the scores seen so far
  std::vector<float> run_sum;  // [Mp]  running sum of exp(score - run_max)
  std::vector<float> acc;      // [Mp, Dp]  running sum of exp(score - run_max) * v
  Workspace(int64_t D, int64_t M)
      : Mp(round_up(M, kQueryBlock)), Dp(round_up(D, kDimBlock)), q_t(D * Mp),
        k_tile((kTileRows + 1) * D), v_tile(kTileRows * Dp), p(kTileRows * Mp), run_max(Mp),
        run_sum(Mp), acc(Mp * Dp) {}
};

void gather_queries(const TreeAttentionArgs& a, const Task& t, int64_t G, Workspace& ws) {
  std::fill(ws.q_t.begin(), ws.q_t.end(), 0.0f);
  for (int64_t i = 0; i < t.nodes; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = i * G + g, h = t.kvh * G + g;
      const int64_t off = t.b * a.q_stride_b + (t.n0 + i) * a.q_stride_n + h * a.q_stride_h;
      const float* q = load_row(a.q, off, a.D, a.dtype, ws.k_tile.data());
      for (int64_t d = 0; d < a.D; ++d) ws.q_t[d * ws.Mp + m] = q[d];
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

// Step 1: p[r, m] = scale * <q_m, k_{j0+r}>, or -inf where the mask forbids the pair; padded
// queries (m >= M) get 0 and are never softmaxed, so their weights stay 0. Compiled per ISA
// level (cpu_math.h RHEO_ISA_COPIES), as is accumulate_tile: the two hot loops.
RHEO_ALWAYS_INLINE void score_tile_loop(const TreeAttentionArgs& a, const Task& t, int64_t G,
                                        int64_t j0, int64_t rows, Workspace& ws) {
  const int64_t Mp = ws.Mp, D = a.D;
  const float* k_rows[kTileRows + 1];
  for (int64_t r = 0; r < rows; ++r)
    k_rows[r] = load_row(a.k, kv_offset(a, t, j0 + r), D, a.dtype, ws.k_tile.data() + r * D);
  k_rows[rows] = ws.k_tile.data() + kTileRows * D;  // zero row pairing an odd last row
  float discard[kQueryBlock];
  for (int64_t r = 0; r < rows; r += 2) {
    float* s1 = r + 1 < rows ? ws.p.data() + (r + 1) * Mp : nullptr;
    for (int64_t mb = 0; mb < Mp; mb += kQueryBlock) {
      qk_block(ws.q_t.data() + mb, Mp, k_rows[r], k_rows[r + 1], D, ws.p.data() + r * Mp + mb,
               s1 ? s1 + mb : discard);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* s = ws.p.data() + r * Mp;
    for (int64_t m = 0; m < t.M; ++m) s[m] = allowed(a, t, G, m, j0 + r) ? s[m] * a.scale : kNegInf;
    std::fill(s + t.M, s + Mp, 0.0f);
  }
}
RHEO_ISA_COPIES(void, score_tile, score_tile_loop,
                (const TreeAttentionArgs& a, const Task& t, int64_t G, int64_t j0, int64_t rows,
                 Workspace& ws),
                (a, t, G, j0, rows, ws))

// Step 2: online softmax. Raise each running max to cover the tile, rescale what was summed
// under the old max by exp(old - new), and turn the tile's scores into weights exp(s - max).
void softmax_update(const Task& t, int64_t rows, Workspace& ws) {
  const int64_t Mp = ws.Mp, Dp = ws.Dp;
  for (int64_t m = 0; m < t.M; ++m) {
    float tile_max = kNegInf;
    for (int64_t r = 0; r < rows; ++r) tile_max = std::max(tile_max, ws.p[r * Mp + m]);
    const float new_max = std::max(ws.run_max[m], tile_max);
    if (new_max == kNegInf) {  // nothing visible yet: every weight of the tile is 0
      for (int64_t r = 0; r < rows; ++r) ws.p[r * Mp + m] = 0.0f;
      continue;
    }
    const float correction = std::exp(ws.run_max[m] - new_max);  // exp(-inf) = 0 at the start
    if (correction != 1.0f) {
      ws.run_sum[m] *= correction;
      for (int64_t d = 0; d < Dp; ++d) ws.acc[m * Dp + d] *= correction;
    }
    float sum = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      float& w = ws.p[r * Mp + m];
      w = std::exp(w - new_max);  // a masked score -inf gives weight 0
      sum += w;
    }
    ws.run_sum[m] += sum;
    ws.run_max[m] = new_max;
  }
}

// Step 3: acc[m] += sum_r p[r, m] * v_{j0+r}, two queries and kDimBlock columns at a time.
RHEO_ALWAYS_INLINE void accumulate_tile_loop(const TreeAttentionArgs& a, const Task& t,
                                             int64_t j0, int64_t rows, Workspace& ws) {
  const int64_t Mp = ws.Mp, Dp = ws.Dp, D = a.D;
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = ws.v_tile.data() + r * Dp;
    const float* v = load_row(a.v, kv_offset(a, t, j0 + r), D, a.dtype, dst);
    if (v != dst) std::memcpy(dst, v, D * sizeof(float));  // fp32: copy into the padded tile
  }
  for (int64_t m = 0; m < t.M; m += 2) {  // Mp is even, so m + 1 is a real or padded query
    float* out0 = ws.acc.data() + m * Dp;
    for (int64_t d0 = 0; d0 < Dp; d0 += kDimBlock)
      pv_block(ws.p.data() + m, Mp, ws.v_tile.data() + d0, Dp, rows, out0 + d0, out0 + Dp + d0);
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
