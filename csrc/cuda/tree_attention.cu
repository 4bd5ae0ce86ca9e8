// Tree attention on CUDA (csrc/include/rheo/tree_attention.h), flash-decoding style.
//
// Work mapping: the query rows of one KV head kvh of one batch entry b are the M = N * G pairs
// (node n, head-in-group g), row m = n * G + g, head h = kvh * G + g (G = H / Hkv). One block of
// kThreads (8 warps) takes a tile of kRows = 64 of those rows and one split of the keys:
// grid = (row tiles * splits, Hkv, B). The block keeps its Q tile in shared memory (float32,
// d-major), walks its keys in tiles of kKeys = 32 (K d-major and V row-major in shared memory,
// converted to float32 once per tile), and for every tile computes the 64 x 32 scores, applies
// the tree mask inside the tile (prefix rows always visible, tree row P_b + c to node n only
// where tree_mask[b, n, c] = 1; P_b = prefix_lens[b] or prefix_len, read from the slot
// kv_slots[b] or b), and updates an online softmax per query row (running max,
// running sum, float32 accumulator over D). Thread t = (ty, tx) = (t / 16, t % 16) owns rows
// 4 ty .. 4 ty + 3 in both products: scores for keys tx and tx + 16 (a 4 x 2 register tile),
// output columns 4 tx + 64 c .. +3 (a 4 x 4 kVec register tile). The 16 threads of a row set are
// one half-warp, so the row max is a 4-step shuffle and the scores go to the accumulators
// through shared memory with only a __syncwarp.
// Long prefixes are split over blocks (splits chosen from the prefix length: about one per
// kKeysPerSplit keys, capped so that the grid is about kTargetBlocks blocks; a constant, not the
// device's SM count, so every GPU adds the same partials): a split writes its
// (max, sum, unnormalised accumulator) per row to a float32 workspace, and merge_kernel adds the
// splits in split order with a log-sum-exp merge, so the result does not depend on the schedule.
// One split (short prefix or a full grid) writes the output directly and needs no workspace.
// Ragged batches (prefix_lens): the plan is made on the host from prefix_len, the bound of every
// P_b, since the P_b live on the device. A block clips its key range to its own P_b + T; a block
// whose range starts past it runs no tile and writes the empty partial (max -inf, sum 0, acc 0),
// which the merge skips (weight exactly 0), so such a block costs a launch and nothing else.
//
// Why: the old kernel (one block per (node, head)) read each K/V row N * G times. Here a K/V row
// is read by ceil(N * G / 64) blocks, which run side by side and share it through L2. At the
// paper's sizes (Llama-3.1-8B: H = 32, Hkv = 8, D = 128, N = 60, B = 1, bf16; 512 B of K + V
// per key row and KV head):
//   prefix 1024: K/V 4.4 MB; old 1920 blocks read 1.07 GB; new 4 row tiles x 8 KV heads x 5
//                splits = 160 blocks read 17.8 MB (4x), + 5.0 MB of partials written and merged;
//   prefix 8192: K/V 33.8 MB; old 1920 blocks read 8.1 GB; new 4 x 8 x 8 = 256 blocks read
//                135 MB (4x), + 8.0 MB of partials.
// The traffic is then far below the L2 bandwidth and the kernel is bound by its float32 FMAs
// (4 * D FLOP per (query row, key) pair: 8.1 GFLOP per layer at prefix 8192); the next step is
// tensor cores (bf16 mma), which this file does not use so that the emulator can run it.
// Resources (ptxas, sm_90): 124 registers at D <= 128 (95 at D <= 64, 154 at D <= 256), no spills;
// shared memory 76.8 KB at D = 128 (opted in past 48 KB, fit_shared): 2 blocks (16 warps) per SM.
// Same math as the CPU kernel: float32 scores, softmax and V sums for every dtype; masked pairs
// get weight 0; a row that sees nothing gets zeros; one rounding to the dtype at the end.

#include <cmath>
#include <cstdint>

#include "device_utils.cuh"
#include "rheo/tree_attention.h"

namespace rheo {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 64;              // query rows per block
constexpr int kKeys = 32;              // keys per shared-memory tile
constexpr int kRowsPerThread = 4;      // rows 4 ty .. 4 ty + 3
constexpr int kKeysPerThread = 2;      // keys tx, tx + 16 of a tile
constexpr int kQStride = kRows + 4;    // q_t [D][kQStride]: 16-byte rows for vector loads
constexpr int kPStride = kRows + 4;    // p   [kKeys][kPStride]: conflict-free 16-byte stores
constexpr int kKStride = kKeys + 1;    // k_t [D][kKStride]: conflict-free transposed stores
constexpr int kColsPerVec = 64;        // output columns per kVec step (16 threads x 4)
constexpr int kMaxVec = 4;             // accumulators 4 x 4 kMaxVec per thread: D <= 256
constexpr int64_t kMaxHeadDim = kColsPerVec * kMaxVec;
constexpr int64_t kKeysPerSplit = 256;  // about one split per this many keys
constexpr int64_t kTargetBlocks = 264;  // ~2 blocks per SM on 132 SMs (H100 / H200)
constexpr int kMergeThreads = 256;
static_assert(kThreads == 16 * (kRows / kRowsPerThread), "a half-warp per 4 rows");
static_assert(kKeys == 16 * kKeysPerThread, "16 threads per row cover a key tile");

using cuda::from_float;
using cuda::to_float;

// Four floats moved in one 16-byte shared-memory instruction (the address is 16-byte aligned).
struct alignas(16) Vec4 {
  float v[4];
};
__device__ __forceinline__ void load4(const float* p, float (&out)[4]) {
  const Vec4 x = *reinterpret_cast<const Vec4*>(p);
  for (int e = 0; e < 4; ++e) out[e] = x.v[e];
}

// The launch geometry, computed once on the host for the kernel, the merge and the workspace.
struct Plan {
  int64_t G = 1, M = 0;           // heads per KV head; query rows per (b, kvh)
  int64_t row_tiles = 0;          // ceil(M / kRows)
  int64_t tiles_per_split = 0;    // key tiles per split
  int64_t splits = 1;             // key splits (all non-empty)
  int vec = 1;                    // kVec: ceil(D / 64) column groups per thread
};

// Floats of dynamic shared memory: q_t [D][kQStride], v [kKeys][64 kVec], p [kKeys][kPStride],
// k_t [D][kKStride] (the vector-loaded arrays first, at multiples of 4 floats).
size_t shared_floats(int64_t D, int vec) {
  return static_cast<size_t>(D) * kQStride + static_cast<size_t>(kKeys) * kColsPerVec * vec +
         static_cast<size_t>(kKeys) * kPStride + static_cast<size_t>(D) * kKStride;
}

void check_args(const TreeAttentionArgs& a) {
  RHEO_CHECK(a.D >= 1 && a.D <= kMaxHeadDim, "tree_attention on CUDA needs 1 <= D <= ",
             kMaxHeadDim, " (4 x 4 ceil(D / 64) float32 accumulators per thread, and ~",
             (kQStride + kKStride + kKeys) * 4, " B of shared memory per unit of D), got D=", a.D,
             "; run it on the CPU");
  RHEO_CHECK(a.H >= 1 && a.Hkv >= 1 && a.H % a.Hkv == 0, "H=", a.H,
             " heads is not a multiple of Hkv=", a.Hkv, " KV heads (GQA needs H % Hkv == 0)");
  RHEO_CHECK(a.prefix_len >= 0, "prefix_len must be >= 0, got ", a.prefix_len);
  RHEO_CHECK(a.B >= 0 && a.N >= 0, "B and N must be >= 0, got B=", a.B, ", N=", a.N);
  RHEO_CHECK(a.Hkv <= 65535 && a.B <= 65535, "tree_attention on CUDA needs Hkv, B <= 65535 ",
             "(grid y and z), got Hkv=", a.Hkv, ", B=", a.B, "; split the batch");
  RHEO_CHECK(a.dtype != DType::kFloat64, "tree_attention takes float32, float16 or bfloat16, ",
             "got float64; convert q, k, v with .float()");
  RHEO_CHECK(a.kv_slots == nullptr || a.B == 0 || a.S >= 1, "kv_slots needs S >= 1, the slots ",
             "of k and v (their first dim), got S=", a.S, "; set args.S");
}

Plan make_plan(const TreeAttentionArgs& a) {
  Plan p;
  p.G = a.H / a.Hkv;
  p.M = a.N * p.G;
  p.row_tiles = (p.M + kRows - 1) / kRows;
  p.vec = static_cast<int>((a.D + kColsPerVec - 1) / kColsPerVec);
  const int64_t L = a.prefix_len + tree_rows(a);  // keys any row may see
  const int64_t key_tiles = (L + kKeys - 1) / kKeys;
  const int64_t blocks = a.B * a.Hkv * p.row_tiles;  // per split
  const int64_t by_length = (L + kKeysPerSplit - 1) / kKeysPerSplit;
  const int64_t by_grid = blocks >= kTargetBlocks ? 1 : kTargetBlocks / blocks;
  int64_t splits = by_length < by_grid ? by_length : by_grid;
  if (splits < 1) splits = 1;
  p.tiles_per_split = (key_tiles + splits - 1) / splits;
  p.splits = (key_tiles + p.tiles_per_split - 1) / p.tiles_per_split;  // no empty split
  RHEO_CHECK(p.row_tiles * p.splits <= 0x7FFFFFFF, "tree_attention on CUDA needs ",
             "ceil(N * H / Hkv / ", kRows, ") * splits < 2^31 blocks (grid x), got N=", a.N,
             ", H/Hkv=", p.G, "; split the tree");
  RHEO_CHECK(a.B * a.N * a.H * a.D / kMergeThreads < 0x7FFFFFFF, "tree_attention on CUDA needs ",
             "B * N * H * D / ", kMergeThreads, " < 2^31 (merge grid), got B=", a.B, ", N=", a.N,
             ", H=", a.H, ", D=", a.D, "; split the batch");
  return p;
}

// grid = (row_tiles * splits, Hkv, B), block = kThreads, dynamic shared = shared_floats(D, kVec).
template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) tree_attention_kernel(TreeAttentionArgs a, Plan p) {
  RHEO_DYNAMIC_SHARED(Vec4, smem4);
  constexpr int kDp = kColsPerVec * kVec;  // padded head dim of the V tile
  const int D = static_cast<int>(a.D);
  float* const q_t = reinterpret_cast<float*>(smem4);  // [D][kQStride]   Q tile, d-major
  float* const v_s = q_t + D * kQStride;               // [kKeys][kDp]    V tile, zero-padded
  float* const p_s = v_s + kKeys * kDp;                // [kKeys][kPStride]  softmax weights
  float* const k_t = p_s + kKeys * kPStride;           // [D][kKStride]   K tile, d-major

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int ty = tid / 16, tx = tid % 16;
  const int64_t row_tile = blockIdx.x % p.row_tiles, split = blockIdx.x / p.row_tiles;
  const int64_t kvh = blockIdx.y, b = blockIdx.z;
  const int64_t m0 = row_tile * kRows;
  // This sequence's prefix and slot. They are device memory, unchecked (the header): a value out
  // of range is clamped, so that no read leaves the cache rows the host checked.
  int64_t prefix = a.prefix_len, slot = b;
  if (a.prefix_lens) {
    const int64_t p_b = a.prefix_lens[b];
    prefix = p_b < 0 ? 0 : p_b < prefix ? p_b : prefix;
  }
  if (a.kv_slots) {
    const int64_t s_b = a.kv_slots[b];
    slot = s_b < 0 ? 0 : s_b < a.S ? s_b : a.S - 1;
  }
  const int64_t L = prefix + tree_rows(a);  // keys this sequence's rows may see
  const int64_t j_begin = split * p.tiles_per_split * kKeys;
  const int64_t j_end = j_begin + p.tiles_per_split * kKeys < L
                            ? j_begin + p.tiles_per_split * kKeys
                            : L;
  const T* const k_head = static_cast<const T*>(a.k) + slot * a.kv_stride_b + kvh * a.kv_stride_h;
  const T* const v_head = static_cast<const T*>(a.v) + slot * a.kv_stride_b + kvh * a.kv_stride_h;

  // The Q tile, float32; rows past M are zeros (they are masked everywhere and never written).
  for (int r = warp; r < kRows; r += kWarps) {
    const int64_t m = m0 + r;
    const T* q_row = nullptr;
    if (m < p.M) {
      const int64_t n = m / p.G, h = kvh * p.G + m % p.G;
      q_row = static_cast<const T*>(a.q) + b * a.q_stride_b + n * a.q_stride_n + h * a.q_stride_h;
    }
    for (int d = lane; d < D; d += 32) q_t[d * kQStride + r] = q_row ? to_float(q_row[d]) : 0.0f;
  }

  // This thread's rows: whether they exist, and their node's mask row.
  bool row_ok[kRowsPerThread];
  const uint8_t* mask_row[kRowsPerThread];
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t m = m0 + ty * kRowsPerThread + i;
    row_ok[i] = m < p.M;
    mask_row[i] = a.tree_mask + (b * a.N + (row_ok[i] ? m / p.G : 0)) * tree_rows(a);
  }

  // Online softmax state. run_sum is this thread's share (its keys); the 16 threads of a row
  // rescale theirs by the same factors and add them up at the end.
  float run_max[kRowsPerThread], run_sum[kRowsPerThread], acc[kRowsPerThread][4 * kVec];
  for (int i = 0; i < kRowsPerThread; ++i) {
    run_max[i] = -INFINITY;
    run_sum[i] = 0.0f;
    for (int c = 0; c < 4 * kVec; ++c) acc[i][c] = 0.0f;
  }

  for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeys) {
    __syncthreads();  // the previous tile is consumed (first time: the Q tile is written)
    // K and V rows j0 .. j0 + kKeys - 1 as float32: warp w loads rows w, w + 8, ...; rows past
    // j_end and V columns past D are zeros (weight 0 times a finite value).
    for (int key = warp; key < kKeys; key += kWarps) {
      const int64_t j = j0 + key;
      const bool in = j < j_end;
      const T* k_row = k_head + j * a.kv_stride_l;
      const T* v_row = v_head + j * a.kv_stride_l;
      for (int d = lane; d < kDp; d += 32) {
        const bool load = in && d < D;
        if (d < D) k_t[d * kKStride + key] = load ? to_float(k_row[d]) : 0.0f;
        v_s[key * kDp + d] = load ? to_float(v_row[d]) : 0.0f;
      }
    }
    __syncthreads();

    // Scores of rows 4 ty + i against keys tx + 16 j.
    float s[kRowsPerThread][kKeysPerThread];
    for (int i = 0; i < kRowsPerThread; ++i)
      for (int j = 0; j < kKeysPerThread; ++j) s[i][j] = 0.0f;
    const float* q_d = q_t + ty * kRowsPerThread;
    const float* k_d = k_t + tx;
    for (int d = 0; d < D; ++d, q_d += kQStride, k_d += kKStride) {
      float qv[kRowsPerThread], kv[kKeysPerThread];
      load4(q_d, qv);
      for (int j = 0; j < kKeysPerThread; ++j) kv[j] = k_d[16 * j];
      for (int i = 0; i < kRowsPerThread; ++i)
        for (int j = 0; j < kKeysPerThread; ++j) s[i][j] += qv[i] * kv[j];
    }
    // Scale, and -inf where the pair is masked: every prefix row is visible; tree row
    // P_b + c only where tree_mask[b, n, c] = 1; keys past j_end and rows past M never.
    const bool all_prefix = j0 + kKeys <= prefix;  // block-uniform
    for (int j = 0; j < kKeysPerThread; ++j) {
      const int64_t key = j0 + tx + 16 * j;
      for (int i = 0; i < kRowsPerThread; ++i) {
        bool visible = row_ok[i];
        if (!all_prefix)
          visible = visible && key < j_end &&
                    (key < prefix || mask_row[i][key - prefix] != 0);
        s[i][j] = visible ? s[i][j] * a.scale : -INFINITY;
      }
    }

    // Online softmax: raise each row's max to cover the tile (max over the half-warp), rescale
    // what was summed under the old max by exp(old - new), weights exp(s - new max).
    for (int i = 0; i < kRowsPerThread; ++i) {
      float tile_max = s[i][0];
      for (int j = 1; j < kKeysPerThread; ++j) tile_max = fmaxf(tile_max, s[i][j]);
      for (int offset = 8; offset > 0; offset >>= 1)
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xFFFFFFFFu, tile_max, offset));
      const float new_max = fmaxf(run_max[i], tile_max);  // equal in the row's 16 threads
      if (new_max == -INFINITY) {  // nothing visible yet: every weight of the tile is 0
        for (int j = 0; j < kKeysPerThread; ++j) s[i][j] = 0.0f;
        continue;
      }
      const float correction = expf(run_max[i] - new_max);  // exp(-inf) = 0 at the start
      float sum = 0.0f;
      for (int j = 0; j < kKeysPerThread; ++j) {
        s[i][j] = expf(s[i][j] - new_max);  // a masked score -inf gives weight 0
        sum += s[i][j];
      }
      run_sum[i] = run_sum[i] * correction + sum;
      run_max[i] = new_max;
      for (int c = 0; c < 4 * kVec; ++c) acc[i][c] *= correction;
    }
    for (int j = 0; j < kKeysPerThread; ++j) {
      Vec4 w;
      for (int i = 0; i < kRowsPerThread; ++i) w.v[i] = s[i][j];
      *reinterpret_cast<Vec4*>(p_s + (tx + 16 * j) * kPStride + ty * kRowsPerThread) = w;
    }
    __syncwarp();  // a row's weights come from its own half-warp

    // acc[i] += sum_key p[key, 4 ty + i] * v[key, 4 tx + 64 c + e]
    const int keys = static_cast<int>(j_end - j0 < kKeys ? j_end - j0 : kKeys);
    for (int key = 0; key < keys; ++key) {
      float w[kRowsPerThread];
      load4(p_s + key * kPStride + ty * kRowsPerThread, w);
      for (int c = 0; c < kVec; ++c) {
        float v[4];
        load4(v_s + key * kDp + kColsPerVec * c + 4 * tx, v);
        for (int i = 0; i < kRowsPerThread; ++i)
          for (int e = 0; e < 4; ++e) acc[i][4 * c + e] += w[i] * v[e];
      }
    }
  }

  // Row sums: add the 16 shares (butterfly: every thread of the row gets the same sum).
  for (int i = 0; i < kRowsPerThread; ++i)
    for (int offset = 8; offset > 0; offset >>= 1)
      run_sum[i] += __shfl_xor_sync(0xFFFFFFFFu, run_sum[i], offset);

  const int64_t rows_total = a.B * a.N * a.H;
  for (int i = 0; i < kRowsPerThread; ++i) {
    if (!row_ok[i]) continue;
    const int64_t m = m0 + ty * kRowsPerThread + i;
    const int64_t row = (b * a.N + m / p.G) * a.H + kvh * p.G + m % p.G;  // out row (b, n, h)
    if (p.splits == 1) {
      // out = acc / sum; a row that sees nothing (sum 0) gets zeros.
      const float inv = run_sum[i] > 0.0f ? 1.0f / run_sum[i] : 0.0f;
      T* out = static_cast<T*>(a.out) + row * a.D;
      for (int c = 0; c < 4 * kVec; ++c) {
        const int d = kColsPerVec * (c / 4) + 4 * tx + c % 4;
        if (d < D) out[d] = from_float<T>(acc[i][c] * inv);
      }
    } else {
      // This split's partial: acc [splits, rows, D], then (max, sum) [splits, rows, 2]. Written by
      // every block, also one whose key range lies past P_b + T (max -inf: the merge skips it).
      float* ws_acc = a.workspace + (split * rows_total + row) * a.D;
      for (int c = 0; c < 4 * kVec; ++c) {
        const int d = kColsPerVec * (c / 4) + 4 * tx + c % 4;
        if (d < D) ws_acc[d] = acc[i][c];
      }
      if (tx == 0) {
        float* ws_ml = a.workspace + p.splits * rows_total * a.D + (split * rows_total + row) * 2;
        ws_ml[0] = run_max[i];
        ws_ml[1] = run_sum[i];
      }
    }
  }
}

// grid = ceil(rows * D / kMergeThreads): one thread per output element. out = sum_s acc_s f_s /
// sum_s sum_s f_s with f_s = exp(max_s - top), splits added in order s = 0, 1, ...; a split that
// saw nothing (max_s = -inf: all its keys masked, or its range past the sequence's P_b + T) adds
// nothing, exactly; a row that saw nothing in any split (top = -inf) gets zeros.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(TreeAttentionArgs a, Plan p) {
  const int64_t rows_total = a.B * a.N * a.H;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kMergeThreads + threadIdx.x;
  if (idx >= rows_total * a.D) return;
  const int64_t row = idx / a.D, d = idx % a.D;
  const float* ml = a.workspace + p.splits * rows_total * a.D;
  float top = -INFINITY;
  for (int64_t s = 0; s < p.splits; ++s) top = fmaxf(top, ml[(s * rows_total + row) * 2]);
  float total = 0.0f, o = 0.0f;
  for (int64_t s = 0; s < p.splits; ++s) {
    const float m_s = ml[(s * rows_total + row) * 2];
    if (m_s == -INFINITY) continue;
    const float f = expf(m_s - top);
    total += ml[(s * rows_total + row) * 2 + 1] * f;
    o += a.workspace[(s * rows_total + row) * a.D + d] * f;
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  static_cast<T*>(a.out)[idx] = from_float<T>(o * inv);
}

template <typename T, int kVec>
cudaError_t launch(const TreeAttentionArgs& a, const Plan& p, cudaStream_t stream) {
  const size_t smem = shared_floats(a.D, kVec) * sizeof(float);
  cuda::SharedFit fit;  // D = 256 needs 145 KB: every H100/A100, but Ada stops at D = 168
  cudaError_t err = cuda::fit_shared(tree_attention_kernel<T, kVec>, smem, &fit);
  if (err != cudaSuccess) return err;
  RHEO_CHECK(fit.fits(), "tree_attention on CUDA holds its tiles in shared memory: D=", a.D,
             " needs ", fit.needed(), " bytes a block, over the ", fit.limit, " of GPU ",
             fit.device, " (cudaDevAttrMaxSharedMemoryPerBlockOptin); run it on the CPU");
  const dim3 grid(static_cast<unsigned>(p.row_tiles * p.splits), static_cast<unsigned>(a.Hkv),
                  static_cast<unsigned>(a.B));
  tree_attention_kernel<T, kVec> RHEO_LAUNCH(grid, kThreads, smem, stream)(a, p);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.splits == 1) return err;
  const int64_t elements = a.B * a.N * a.H * a.D;
  const unsigned blocks = static_cast<unsigned>((elements + kMergeThreads - 1) / kMergeThreads);
  merge_kernel<T> RHEO_LAUNCH(blocks, kMergeThreads, 0, stream)(a, p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dtype(const TreeAttentionArgs& a, const Plan& p, cudaStream_t stream) {
  switch (p.vec) {
    case 1: return launch<T, 1>(a, p, stream);
    case 2: return launch<T, 2>(a, p, stream);
    case 3: return launch<T, 3>(a, p, stream);
    case 4: return launch<T, 4>(a, p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

size_t tree_attention_workspace_floats(const TreeAttentionArgs& args) {
  check_args(args);
  if (args.B == 0 || args.N == 0) return 0;
  const Plan p = make_plan(args);
  if (p.splits == 1) return 0;
  return static_cast<size_t>(p.splits * args.B * args.N * args.H * (args.D + 2));
}

cudaError_t tree_attention_cuda(const TreeAttentionArgs& args, cudaStream_t stream) {
  check_args(args);
  if (args.B == 0 || args.N == 0) return cudaSuccess;
  const Plan p = make_plan(args);
  RHEO_CHECK(p.splits == 1 || args.workspace != nullptr, "tree_attention on CUDA splits this ",
             "prefix over ", p.splits, " blocks per row tile and needs a float32 workspace of ",
             "tree_attention_workspace_floats(args) = ", p.splits * args.B * args.N * args.H *
             (args.D + 2), " floats in args.workspace, got null");
  switch (args.dtype) {
    case DType::kFloat32: return launch_dtype<float>(args, p, stream);
    case DType::kFloat16: return launch_dtype<__half>(args, p, stream);
    case DType::kBFloat16: return launch_dtype<__nv_bfloat16>(args, p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace rheo
