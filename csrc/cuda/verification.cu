// Verification on CUDA (csrc/include/rheo/verification.h), in two kernels.
//
// Work mapping:
//   node_stats_kernel  grid B*N, one 512-thread block per node row, every row at once (before the
//                      walk, so every SM is busy from B*N >= 132 rows): the O(V) part of the target
//                      processing, reduced to a 48-byte NodeStats per node: the non-finite flag,
//                      the max and the softmax sum Z0, #{p > 0}, the top-k threshold (the k-th
//                      largest logit) and the top-p cut (the threshold element and the last tie
//                      kept at it), or the argmax at T = 0.
//   walk_kernel        grid B, one 512-thread block per tree, sequential over the visited path (each
//                      layer needs the previous accept): at a visited node p(v) = e(v) / Z0 with
//                      e(v) = exp((x_v - m) / T) masked by the node's thresholds, evaluated only at
//                      the children's tokens and on the support of q~; the residual is p plus the
//                      entries the node's tests changed, kept in a shared-memory hash (token ->
//                      zeroed, or support slot s: w = max(0, e - Zc q~_s)) with the running Z and
//                      nnz; the final inverse-CDF draw is the walk's only pass over V.
// Why: the walk is latency-bound on one SM per tree, so it must do O(K + Se) per node; the O(V)
// work is independent per node and parallel over all B*N rows, most of which are never visited.
// Passes over V (reads of a logit row) per visited node, before -> after:
//   before: max, exp + sum, normalise, nnz count = 4 (+8 top-k radix, +11 top-p radix + ties +
//           kept sum + normalise) on one SM, and 2 for the final draw.
//   after:  walk: 0 per node; 1 per tree for the final draw (+1/16 for its second level), plus a
//           re-sum pass where Z cancelled below 1e-6 of Z0 (probability ~ that ratio). Prepass,
//           for all nodes in parallel, L = key bytes (2 for bf16/fp16, 4 fp32, 8 fp64): 1 (online
//           max + sum + count) plain; 1 + L top-k; 1 + L (+1 when the cut splits a tie) top-p;
//           1 + 2L - 1 (+1) both; 1 at T = 0.
// Workspace (args.workspace, [B, V] doubles): the NodeStats of row r = b * N + node at byte
// 48 r. When it does not fit (V < 6 N, small vocabularies), there is no prepass and the walk
// computes a visited node's stats itself with the same block function (row_stats).
// Semantics mirror csrc/cpu/verification.cpp step by step with the same Philox coins and the same
// tests in the same order; the sums add in another order (and fp32/bf16/fp16 use the float exp,
// like the CPU's float path), so a coin within rounding of a threshold may go the other way.
// Every sum is in a fixed order or in integers, so the result does not depend on the schedule.
// Top-p works on the order of the logit keys (ties at equal keys, lower id first): a key order
// and a p order can only disagree where two distinct logits round to the same p.
// Bad input cannot raise here (no host sync): a tree that breaks the tree / q~ rules, or holds a
// non-finite logit at a visited node, gets the verdict "root only, token 0" and a status bit
// (common.h StatusBit) the host reads once per step. The scalar rules are checked on the host.

#include <cstdint>

#include "device_utils.cuh"
#include "rheo/verification.h"
#include "verification_rows.cuh"

namespace rheo {
namespace {

// --- the walk --------------------------------------------------------------------------------------

struct WalkShared {
  RowShared row;  // reduction scratch, and the stats of a node without a prepass
  NodeStats st;   // the visited node's stats
  double Z;       // running normaliser of the residual r = w / Z
  double Zc;      // Z when the node's sampled correction was applied
  int64_t nnz;    // #{w > 0}
  int accepted, removed, n_children, y_pos, dirty;
};

// The node's changes to p (dynamic shared memory): ce[k] = e at child k's token, q[s] = q~ of the
// sampled child's support, order = children in verification order, and an open-addressing hash
// token -> kZeroed or support slot s (the smallest; kUnchanged: not in the table).
struct Residual {
  double* ce;
  double* q;
  int32_t* order;
  int32_t* hkey;
  int32_t* hval;
  int hash_bits;
};

__device__ __forceinline__ int hash_slot(int32_t id, int bits) {
  return static_cast<int>((static_cast<uint32_t>(id) * 2654435761u) >> (32 - bits));
}

__device__ void hash_insert(const Residual& r, int32_t id, int32_t val) {
  const int mask = (1 << r.hash_bits) - 1;
  for (int s = hash_slot(id, r.hash_bits);; s = (s + 1) & mask) {
    const int32_t prev = atomicCAS(&r.hkey[s], -1, id);
    if (prev == -1 || prev == id) {
      atomicMin(&r.hval[s], val);  // kZeroed < any slot: order-free
      return;
    }
  }
}

__device__ int32_t hash_find(const Residual& r, int32_t id) {
  const int mask = (1 << r.hash_bits) - 1;
  for (int s = hash_slot(id, r.hash_bits);; s = (s + 1) & mask) {
    const int32_t k = r.hkey[s];
    if (k == id) return r.hval[s];
    if (k == -1) return kUnchanged;
  }
}

// The residual weight w(v) given e = p's weight at v.
__device__ __forceinline__ double residual_at(const Residual& r, const WalkShared& sh, int32_t v,
                                              double e) {
  if (!sh.dirty) return e;
  const int32_t h = hash_find(r, v);
  if (h == kUnchanged) return e;
  if (h < 0) return 0.0;
  return fmax(0.0, e - sh.Zc * r.q[h]);  // max(0, w - Z q~): w = e, the node's first change
}

template <typename Row>
__device__ __forceinline__ const typename Row::Elem* row_of(const VerificationArgs& a, int64_t b,
                                                            int64_t node) {
  return static_cast<const typename Row::Elem*>(a.logits) + (b * a.N + node) * a.V;
}

// Entering visited node `node`: its stats, its children in verification order, e at their tokens,
// a clean hash and r = p.
template <typename Row>
__device__ void begin_node(const VerificationArgs& a, int64_t b, int64_t node,
                           const NodeStats* stats, const Residual& r, WalkShared& sh) {
  const int64_t row = b * a.N + node;
  if (stats != nullptr) {
    if (threadIdx.x == 0) sh.st = stats[row];
  } else {
    row_stats<Row>(a, row, sh.row);
    if (threadIdx.x == 0) sh.st = sh.row.st;
  }
  if (threadIdx.x == 0) sh.y_pos = -1;
  __syncthreads();
  if (sh.st.bad) return;
  const int32_t* parents = a.parents + b * a.N;
  const int32_t* sampled = a.sampled_row + b * a.N;
  int64_t n = 0;
  for (int64_t base = node + 1; base < a.N; base += kThreads) {  // uniform
    const int64_t j = base + threadIdx.x;
    const int64_t is = j < a.N && parents[j] == node;
    int64_t ex, in, total;
    block_scan(is, sh.row.red_i, &ex, &in, &total);
    if (is) {
      r.order[n + ex] = static_cast<int32_t>(j);
      if (a.method != VerifyMethod::kTopK && sampled[j] >= 0) sh.y_pos = static_cast<int>(n + ex);
    }
    n += total;
  }
  if (sh.dirty)
    for (int i = threadIdx.x; i < (1 << r.hash_bits); i += kThreads) r.hkey[i] = -1, r.hval[i] = kUnchanged;
  __syncthreads();
  if (threadIdx.x == 0) {
    sh.n_children = static_cast<int>(n);
    if (a.method == VerifyMethod::kRheo && sh.y_pos > 0) {  // Algorithm 1: Y is tested first
      const int32_t yc = r.order[sh.y_pos];
      for (int i = sh.y_pos; i > 0; --i) r.order[i] = r.order[i - 1];
      r.order[0] = yc;
      sh.y_pos = 0;
    }
    sh.Z = sh.st.z;
    sh.nnz = sh.st.nnz;
    sh.Zc = 0.0;
    sh.dirty = 0;
  }
  __syncthreads();
  const typename Row::Elem* x = row_of<Row>(a, b, node);
  const int32_t* tokens = a.tokens + b * a.N;
  const float inv_T = inv_temperature(a.T);
  for (int64_t k = threadIdx.x; k < n; k += kThreads)
    r.ce[k] = target_weight<Row>(sh.st, x, tokens[r.order[k]], a.T, inv_T, a.min_p);
  __syncthreads();
}

template <typename Row>
__device__ void resum_if_cancelled(const VerificationArgs& a, int64_t b, int64_t node,
                                   const Residual& r, WalkShared& sh) {
  if (sh.Z >= kResumBelow * sh.st.z) return;  // uniform: every thread reads the same value
  const typename Row::Elem* x = row_of<Row>(a, b, node);
  const float inv_T = inv_temperature(a.T);
  double z = 0.0;
  for (int64_t v = threadIdx.x; v < a.V; v += kThreads)
    z += residual_at(r, sh, static_cast<int32_t>(v), target_weight<Row>(sh.st, x, v, a.T, inv_T, a.min_p));
  z = block_sum(z, sh.row);
  if (threadIdx.x == 0) sh.Z = z;
  __syncthreads();
}

// The sampled child's test: min(1, r(Y) / q~(Y)); on rejection w = max(0, w - Z q~) on the
// support (r = norm(max(0, r - q~))), recorded as the support slots in the hash. True on accept.
// The coin of test j at `node` of tree b; the key from memory when the args point at one.
__device__ __forceinline__ double node_coin(const VerificationArgs& a, int64_t b, int64_t node,
                                            int64_t j) {
  const CoinKey key = coin_key(a.key, a.seed, a.step);
  return verify_coin(key.seed, key.step, uint32_t(b), uint32_t(a.N), uint32_t(node), uint32_t(j));
}

template <typename Row>
__device__ bool sampled_test(const VerificationArgs& a, int64_t b, int64_t node, int j,
                             int32_t token, int64_t row, const Residual& r, WalkShared& sh) {
  const int32_t* ids = a.q_tilde_ids + row * a.Se;
  const typename Row::Elem* x = row_of<Row>(a, b, node);
  const float inv_T = inv_temperature(a.T);
  const double Z = sh.Z;
  double removed = 0.0, q_y = 0.0;
  int64_t lost = 0;  // support entries whose weight the correction sets to zero
  for (int64_t s = threadIdx.x; s < a.Se; s += kThreads) {
    const int32_t id = ids[s];
    const double q = q_tilde_at(a, row * a.Se + s);
    r.q[s] = q;
    const double w = residual_at(r, sh, id, target_weight<Row>(sh.st, x, id, a.T, inv_T, a.min_p));
    const double zq = Z * q;
    if (id == token) q_y += q;
    removed += fmin(w, zq);
    lost += w > 0.0 && w <= zq;
  }
  removed = block_sum(removed, sh.row);
  lost = block_sum_i(lost, sh.row);
  q_y = block_sum(q_y, sh.row);
  if (threadIdx.x == 0) {
    const double w_y = residual_at(r, sh, token, r.ce[j]);
    const double coin = node_coin(a, b, node, j);
    sh.accepted = sh.nnz == lost || coin * q_y < w_y / Z;  // rounding guard first
  }
  __syncthreads();
  if (sh.accepted) return true;
  for (int64_t s = threadIdx.x; s < a.Se; s += kThreads) hash_insert(r, ids[s], static_cast<int32_t>(s));
  if (threadIdx.x == 0) sh.Zc = Z, sh.dirty = 1;
  __syncthreads();
  if (threadIdx.x == 0) sh.Z = Z - removed, sh.nnz -= lost;
  __syncthreads();
  resum_if_cancelled<Row>(a, b, node, r, sh);
  __syncthreads();  // sh is rewritten by the next test
  return false;
}

// One layer at `node` (after begin_node): returns the accepted child or -1 (every child rejected).
template <typename Row>
__device__ int32_t run_layer(const VerificationArgs& a, int64_t b, int64_t node, const Residual& r,
                             WalkShared& sh) {
  const int32_t* tokens = a.tokens + b * a.N;
  const int32_t* sampled = a.sampled_row + b * a.N;
  const int n = sh.n_children, y = sh.y_pos;
  for (int j = 0; j < n; ++j) {
    const int32_t child = r.order[j], token = tokens[child];
    if (j == y) {
      if (sampled_test<Row>(a, b, node, j, token, sampled[child], r, sh)) return child;
      continue;
    }
    if (threadIdx.x == 0) {  // plain test: accept with prob r(c); else r(c) = 0, r = norm(r)
      const double wc = residual_at(r, sh, token, r.ce[j]);
      const double coin = node_coin(a, b, node, j);
      sh.accepted = (wc > 0.0 && sh.nnz == 1) || coin < wc / sh.Z;
      sh.removed = !sh.accepted && wc > 0.0;
      if (sh.removed) {
        hash_insert(r, token, kZeroed);
        sh.dirty = 1, sh.Z -= wc, sh.nnz -= 1;
      }
    }
    __syncthreads();
    if (sh.accepted) return child;
    if (sh.removed) resum_if_cancelled<Row>(a, b, node, r, sh);  // only when r changed (defect 5)
    __syncthreads();  // sh is rewritten by the next test
  }
  return -1;
}

// Final draw: the smallest v with cumsum_{u <= v} w(u) > coin * sum(w); 0 without mass (the CPU).
template <typename Row>
__device__ int32_t draw_from(const VerificationArgs& a, int64_t b, int64_t node, double coin,
                             const Residual& r, WalkShared& sh) {
  if (a.T == 0.0) {  // one-hot: the argmax while it keeps weight (every other w is 0)
    const int32_t v = sh.st.argmax;
    return residual_at(r, sh, v, 1.0) > 0.0 ? v : 0;
  }
  const typename Row::Elem* x = row_of<Row>(a, b, node);
  const float inv_T = inv_temperature(a.T);
  const NodeStats st = sh.st;
  const int64_t hit = find_crossing(
      a.V,
      [&](int64_t v) {
        return residual_at(r, sh, static_cast<int32_t>(v), target_weight<Row>(st, x, v, a.T, inv_T, a.min_p));
      },
      [&](double total) { return coin * total; }, sh.row);
  return static_cast<int32_t>(hit < 0 ? 0 : hit);
}

// The tree and q~ rules of verification_check_args (csrc/cpu/verification_checks.cpp), checked
// on the device so that the host never reads the tree: true (block-uniform) when tree b breaks
// one. Same rules, same order of reasoning; the message is the host's job (status bit).
__device__ bool tree_is_bad(const VerificationArgs& a, int64_t b) {
  const int32_t* parents = a.parents + b * a.N;
  const int32_t* tokens = a.tokens + b * a.N;
  const int32_t* sampled = a.sampled_row + b * a.N;
  bool bad = threadIdx.x == 0 && parents[0] != -1;
  for (int64_t j = 1 + threadIdx.x; j < a.N; j += kThreads) {
    const int32_t par = parents[j], tok = tokens[j], row = sampled[j];
    bad |= par < 0 || par >= j || tok < 0 || tok >= a.V || row < -1 || row >= a.R;
  }
  if (__syncthreads_or(bad)) return true;  // the walks below need valid parents
  for (int64_t j = threadIdx.x; j < a.N; j += kThreads) {
    int64_t depth = 0;
    for (int64_t k = j; k > 0; k = parents[k]) ++depth;
    bad |= depth + 1 > a.path_capacity;
    const int32_t row = sampled[j];
    if (j == 0 || row < 0) continue;
    for (int64_t k = 1; k < j; ++k) bad |= parents[k] == parents[j] && sampled[k] >= 0;
    double q_tok = 0.0;
    for (int64_t s = 0; s < a.Se; ++s) {
      const int32_t id = a.q_tilde_ids[row * a.Se + s];
      const double q = q_tilde_at(a, row * a.Se + s);
      bad |= id < 0 || id >= a.V || !isfinite(q) || q < 0.0;
      if (id == tokens[j]) q_tok = q;
    }
    bad |= !(q_tok > 0.0);
  }
  return __syncthreads_or(bad);
}

// Bad input at tree b: the verdict "root only, token 0" keeps the step in range, and the status
// bit makes the host raise the CPU kernel's error before it uses the verdict.
__device__ void reject_tree(const VerificationArgs& a, int64_t b, int32_t* path, int32_t bit) {
  for (int64_t i = threadIdx.x; i < a.path_capacity; i += kThreads) path[i] = i == 0 ? 0 : -1;
  if (threadIdx.x == 0) {
    a.accept_len[b] = 1;
    a.bonus_token[b] = 0;
    cuda::report_status(a.status, bit);
  }
}

// The prepass: NodeStats of every row into the workspace.
template <typename Row>
__global__ void __launch_bounds__(kThreads, 2) node_stats_kernel(VerificationArgs a) {
  __shared__ RowShared sh;
  const int64_t row = blockIdx.x;
  row_stats<Row>(a, row, sh);
  if (threadIdx.x == 0) reinterpret_cast<NodeStats*>(a.workspace)[row] = sh.st;
}

// Dynamic shared memory of the walk: ce[N], q[Se] (doubles), order[N], hkey[H], hval[H] (int32).
__host__ __device__ inline size_t walk_smem_bytes(int64_t N, int64_t Se, int hash_bits) {
  return static_cast<size_t>(8 * N + 8 * Se + 4 * N) + (size_t{8} << hash_bits);
}

__device__ Residual carve_residual(double* dyn, const VerificationArgs& a, int hash_bits) {
  Residual r;
  r.ce = dyn;
  r.q = dyn + a.N;
  r.order = reinterpret_cast<int32_t*>(dyn + a.N + a.Se);
  r.hkey = r.order + a.N;
  r.hval = r.hkey + (1 << hash_bits);
  r.hash_bits = hash_bits;
  return r;
}

template <typename Row>
__global__ void __launch_bounds__(kThreads, 1) walk_kernel(VerificationArgs a, int stats_ready,
                                                        int hash_bits) {
  RHEO_DYNAMIC_SHARED(double, dyn);
  __shared__ WalkShared sh;
  const Residual r = carve_residual(dyn, a, hash_bits);
  const int64_t b = blockIdx.x;
  int32_t* path = a.accept_path + b * a.path_capacity;
  if (tree_is_bad(a, b)) return reject_tree(a, b, path, kStatusBadVerifyInput);
  for (int64_t i = threadIdx.x; i < a.path_capacity; i += kThreads) path[i] = i == 0 ? 0 : -1;
  if (threadIdx.x == 0) sh.dirty = 1;  // the hash starts as garbage: clear it at the root
  __syncthreads();
  const NodeStats* stats = stats_ready ? reinterpret_cast<const NodeStats*>(a.workspace) : nullptr;
  int32_t len = 1, node = 0;
  while (true) {
    begin_node<Row>(a, b, node, stats, r, sh);
    if (sh.st.bad) {  // a non-finite logit at a visited node
      __syncthreads();  // every thread has written its part of the path before it is reset
      return reject_tree(a, b, path, kStatusNonFiniteTarget);
    }
    const int32_t child = run_layer<Row>(a, b, node, r, sh);
    if (child < 0) {
      const double coin = node_coin(a, b, node, kResidualSlot);
      const int32_t token = draw_from<Row>(a, b, node, coin, r, sh);
      if (threadIdx.x == 0) a.accept_len[b] = len, a.bonus_token[b] = token;
      return;
    }
    if (threadIdx.x == 0) path[len] = child;
    ++len;
    node = child;
    __syncthreads();
  }
}

// RowShared (node_stats_kernel) and WalkShared (walk_kernel), the same for every row type.
RHEO_STATIC_SHARED(12016, node_stats_kernel<F32Row>);
RHEO_STATIC_SHARED(12016, node_stats_kernel<Bf16Row>);
RHEO_STATIC_SHARED(12016, node_stats_kernel<F16Row>);
RHEO_STATIC_SHARED(12016, node_stats_kernel<F64Row>);
RHEO_STATIC_SHARED(12112, walk_kernel<F32Row>);
RHEO_STATIC_SHARED(12112, walk_kernel<Bf16Row>);
RHEO_STATIC_SHARED(12112, walk_kernel<F16Row>);
RHEO_STATIC_SHARED(12112, walk_kernel<F64Row>);

int ceil_log2(int64_t n) {
  int bits = 0;
  while ((int64_t{1} << bits) < n) ++bits;
  return bits;
}

template <typename Row>
cudaError_t launch(const VerificationArgs& args, cudaStream_t stream) {
  // The stats of all B*N rows in the [B, V] double workspace: 6 doubles a node.
  const bool stats_fit = args.N * static_cast<int64_t>(sizeof(NodeStats)) <=
                         args.V * static_cast<int64_t>(sizeof(double));
  const int hash_bits = ceil_log2(2 * (args.N + args.Se)) < 5 ? 5 : ceil_log2(2 * (args.N + args.Se));
  const size_t smem = walk_smem_bytes(args.N, args.Se, hash_bits);
  cuda::SharedFit fit;
  const cudaError_t err = cuda::fit_shared(walk_kernel<Row>, smem, &fit);
  if (err != cudaSuccess) return err;
  RHEO_CHECK(fit.fits(), "verification on CUDA keeps a tree's nodes and the q~ support in "
             "shared memory: N=", args.N, " nodes and Se=", args.Se, " need ", fit.needed(),
             " bytes a block (", fit.static_bytes, " static + ", smem, " dynamic), over the ",
             fit.limit, " of GPU ", fit.device, " (cudaDevAttrMaxSharedMemoryPerBlockOptin); use "
             "fewer tree nodes or a smaller support (docs/kernels.md §7), or verify on the CPU");
  if (stats_fit) {
    node_stats_kernel<Row> RHEO_LAUNCH(static_cast<unsigned>(args.B * args.N), kThreads, 0, stream)(args);
  }
  walk_kernel<Row> RHEO_LAUNCH(static_cast<unsigned>(args.B), kThreads, smem, stream)(
      args, stats_fit ? 1 : 0, hash_bits);
  return cudaGetLastError();
}

}  // namespace

cudaError_t verification_cuda(const VerificationArgs& args, cudaStream_t stream) {
  verification_check_scalars(args);  // host values: no sync; the tree is checked on the device
  // The [B, V] workspace (the prepass's node stats) comes from the caller (the binding: torch's
  // caching allocator), not from a cudaMallocAsync per call (a review defect).
  if (args.workspace == nullptr || args.accept_path == nullptr || args.accept_len == nullptr ||
      args.bonus_token == nullptr)
    return cudaErrorInvalidValue;
  switch (args.dtype) {
    case DType::kFloat32: return launch<F32Row>(args, stream);
    case DType::kBFloat16: return launch<Bf16Row>(args, stream);
    case DType::kFloat16: return launch<F16Row>(args, stream);
    case DType::kFloat64: return launch<F64Row>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace rheo
