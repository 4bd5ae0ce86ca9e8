// Proxy rerank and tree build on CUDA (docs/algorithm.md §5), mirroring csrc/cpu/proxy_rerank.cpp.
//
// Work mapping: one thread block per batch entry. B is small (1..~100) and each entry is an
// independent ranking of L <= ~2000 candidates, so one block keeps every step inside a block and
// needs only __syncthreads. Thread t handles candidates t, t + blockDim.x, ...: the rank of a
// candidate is the number of candidates that rank before it under rheo::ranks_before (the one tie
// rule, common.h), an O(L^2) count that needs no sort, no scratch buffer and agrees with the CPU
// partial sort exactly (ranks are distinct because flat indices break every tie). For L = 710
// that is ~0.5M compares per block. The entry's scores sit in dynamic shared memory when they fit
// (else they are read from global memory, L2-resident). A candidate of rank r < N-1 scatters to
// node r + 1; then one thread per node finds its parent node (the parent candidate's rank + 1)
// and walks its parent links for depth, mask and root-to-leaf path (depth <= max_depth, small).
//
// Errors: a kernel cannot raise without a sync, so an invalid entry (NaN score, parent out of
// range, prefix_len < 0, kept set not ancestor-closed or not topological, depth > max_depth) gets
// n_leaves[b] = -1 and a safe star layout, and select_expand writes expand[b, :] = 0..topk-1 for
// a row holding a NaN score; both set a status bit (common.h StatusBit) read once per step.

#include <cstdint>

#include "device_utils.cuh"
#include "rheo/common.h"
#include "rheo/proxy_rerank.h"

namespace rheo {
namespace {

constexpr int kThreads = 256;
constexpr size_t kSharedLimit = 48 * 1024;  // default dynamic shared memory per block

// Number of the n candidates that rank before candidate c: its 0-based rank.
__device__ int32_t rank_of(const float* scores, int32_t n, int32_t c) {
  const float s = scores[c];
  int32_t rank = 0;
  for (int32_t j = 0; j < n; ++j) rank += ranks_before(scores[j], j, s, c) ? 1 : 0;
  return rank;
}

// grid = B, block = kThreads; dynamic shared = M floats when `staged`.
__global__ void __launch_bounds__(kThreads) select_expand_kernel(SelectExpandArgs a, bool staged) {
  RHEO_DYNAMIC_SHARED(float, staged_scores);
  const int32_t M = static_cast<int32_t>(a.M);
  const float* row = a.scores + blockIdx.x * a.M;
  int32_t* expand = a.expand + blockIdx.x * static_cast<int64_t>(a.topk);
  bool nan = false;
  for (int32_t i = threadIdx.x; i < M; i += blockDim.x) {
    nan |= isnan(row[i]);
    if (staged) staged_scores[i] = row[i];
  }
  if (__syncthreads_or(nan)) {  // also the barrier after staging
    // In-range indices keep the step's gathers safe; the status word tells the host.
    for (int32_t r = threadIdx.x; r < a.topk; r += blockDim.x) expand[r] = r;
    if (threadIdx.x == 0) cuda::report_status(a.status, kStatusNanScore);
    return;
  }
  const float* scores = staged ? staged_scores : row;
  // Position r of the output is the candidate of rank r (best first).
  for (int32_t c = threadIdx.x; c < M; c += blockDim.x) {
    const int32_t rank = rank_of(scores, M, c);
    if (rank < a.topk) expand[rank] = c;
  }
}

// Steps 1-3: check the inputs, scatter the N-1 best candidates to nodes 1..N-1 in rank order,
// link each node to its parent node. Returns 0, or the status bit of the entry's defect
// (block-uniform).
__device__ int32_t prune_and_link(const BuildTreeArgs& a, const float* scores, uint8_t* is_leaf,
                                  float* staged_scores) {
  const int64_t b = blockIdx.x;
  const int32_t L = static_cast<int32_t>(a.L), N = a.N;
  const float* row_scores = a.cand_scores + b * a.L;
  const int32_t* cand_parents = a.cand_parents + b * a.L;
  // 1. Stage the scores; no NaN, parents earlier in flat order, a non-negative prefix.
  bool bad = threadIdx.x == 0 && a.prefix_len[b] < 0, nan = false;
  for (int32_t c = threadIdx.x; c < L; c += blockDim.x) {
    const float s = row_scores[c];
    if (staged_scores != nullptr) staged_scores[c] = s;
    const int32_t p = cand_parents[c];
    nan |= isnan(s);
    bad |= p < -1 || p >= c;
  }
  if (__syncthreads_or(nan)) return kStatusNanScore;
  if (__syncthreads_or(bad)) return kStatusBadTree;
  // 2. Global pruning: the candidate of rank r < N-1 becomes node r + 1; node 0 is the root.
  int32_t* cand_index = a.cand_index + b * N;
  for (int32_t c = threadIdx.x; c < L; c += blockDim.x) {
    const int32_t rank = rank_of(scores, L, c);
    if (rank >= N - 1) continue;
    cand_index[rank + 1] = c;
    a.tokens[b * N + rank + 1] = a.cand_tokens[b * a.L + c];
    a.sampled_row[b * N + rank + 1] = a.cand_sampled[b * a.L + c];
  }
  if (threadIdx.x == 0) {
    a.tokens[b * N] = a.root_tokens[b];
    a.sampled_row[b * N] = -1;
    cand_index[0] = -1;
    a.parents[b * N] = -1;
  }
  for (int32_t i = threadIdx.x; i < N; i += blockDim.x) is_leaf[i] = 1;
  __syncthreads();
  // 3. Parent node = rank of the parent candidate + 1; it must be kept (ancestor-closed) and
  // precede the child (topological), as rank order guarantees when log proxies are <= 0 (Lemma 5).
  for (int32_t i = 1 + threadIdx.x; i < N; i += blockDim.x) {
    const int32_t p = cand_parents[cand_index[i]];
    const int32_t parent = p < 0 ? 0 : rank_of(scores, L, p) + 1;
    const bool ok = parent < i;  // a pruned parent has rank >= N-1, so parent >= N > i
    bad |= !ok;
    a.parents[b * N + i] = ok ? parent : -1;
    if (ok) is_leaf[parent] = 0;
  }
  return __syncthreads_or(bad) ? kStatusBadTree : 0;
}

// Steps 4-6: depth and positions by walking parent links; ancestor mask; root-to-leaf paths.
// Returns true when a node is deeper than max_depth (block-uniform).
__device__ bool lay_out(const BuildTreeArgs& a, const uint8_t* is_leaf) {
  const int64_t b = blockIdx.x, N = a.N, W = a.max_depth + 1;
  const int32_t* parents = a.parents + b * N;
  uint8_t* mask = a.tree_mask + b * N * N;
  int32_t* paths = a.retrieve_indices + b * N * W;
  // 4. Depth = number of parent links up to the root; clear the mask and the paths.
  bool bad = false;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    int32_t d = 0;
    for (int32_t j = static_cast<int32_t>(i); j > 0; j = parents[j]) ++d;
    a.depth[b * N + i] = d;
    a.positions[b * N + i] = a.prefix_len[b] + d;
    bad |= d > a.max_depth;
  }
  for (int64_t k = threadIdx.x; k < N * N; k += blockDim.x) mask[k] = 0;
  for (int64_t k = threadIdx.x; k < N * W; k += blockDim.x) paths[k] = -1;
  if (__syncthreads_or(bad)) return true;
  // 5-6. Mask row i marks i and its ancestors; a leaf's row in retrieve_indices is its
  // root-to-leaf path, leaves in node order.
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    for (int32_t j = static_cast<int32_t>(i); j >= 0; j = parents[j]) mask[i * N + j] = 1;
    if (!is_leaf[i]) continue;
    int64_t leaf = 0;
    for (int64_t j = 0; j < i; ++j) leaf += is_leaf[j];
    int32_t d = a.depth[b * N + i];
    for (int32_t j = static_cast<int32_t>(i); j >= 0; j = parents[j]) paths[leaf * W + d--] = j;
  }
  if (threadIdx.x == 0) {
    int32_t leaves = 0;
    for (int64_t i = 0; i < N; ++i) leaves += is_leaf[i];
    a.n_leaves[b] = leaves;
  }
  return false;
}

// An invalid entry: n_leaves = -1 (the marker) and a layout the step's later kernels can use
// without leaving their buffers: every node a child of the root at depth 1 holding the root
// token, no sampled rows, one root-to-node path per node.
__device__ void safe_layout(const BuildTreeArgs& a) {
  const int64_t b = blockIdx.x, N = a.N, W = a.max_depth + 1;
  const int32_t prefix = a.prefix_len[b] < 0 ? 0 : a.prefix_len[b];
  const int32_t depth1 = a.max_depth >= 1 ? 1 : 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    a.tokens[b * N + i] = a.root_tokens[b];
    a.parents[b * N + i] = i == 0 ? -1 : 0;
    a.depth[b * N + i] = i == 0 ? 0 : depth1;
    a.positions[b * N + i] = prefix + (i == 0 ? 0 : depth1);
    a.sampled_row[b * N + i] = -1;
    a.cand_index[b * N + i] = -1;
  }
  for (int64_t k = threadIdx.x; k < N * N; k += blockDim.x) {
    const int64_t row = k / N, col = k % N;
    a.tree_mask[b * N * N + k] = col == row || col == 0;
  }
  for (int64_t k = threadIdx.x; k < N * W; k += blockDim.x) {
    const int64_t leaf = k / W, d = k % W;
    const int64_t node = N == 1 ? 0 : leaf + 1;
    const bool on_path = leaf < (N == 1 ? 1 : N - 1) && d <= (node == 0 ? 0 : depth1);
    a.retrieve_indices[b * N * W + k] = on_path ? static_cast<int32_t>(d == 0 ? 0 : node) : -1;
  }
  if (threadIdx.x == 0) a.n_leaves[b] = -1;
}

// grid = B, block = kThreads; dynamic shared = [L floats when `staged`] then N bytes (is_leaf).
__global__ void __launch_bounds__(kThreads) build_tree_kernel(BuildTreeArgs a, bool staged) {
  RHEO_DYNAMIC_SHARED(float, shared);
  float* staged_scores = staged ? shared : nullptr;
  uint8_t* is_leaf = reinterpret_cast<uint8_t*>(shared + (staged ? a.L : 0));
  const float* scores = staged ? shared : a.cand_scores + blockIdx.x * a.L;
  int32_t defect = prune_and_link(a, scores, is_leaf, staged_scores);
  if (defect == 0 && lay_out(a, is_leaf)) defect = kStatusBadTree;
  if (defect == 0) return;
  __syncthreads();  // lay_out / prune_and_link outputs are overwritten below
  safe_layout(a);
  if (threadIdx.x == 0) cuda::report_status(a.status, defect);
}

}  // namespace

cudaError_t select_expand_cuda(const SelectExpandArgs& args, cudaStream_t stream) {
  if (args.B == 0) return cudaSuccess;
  if (args.topk < 1 || args.topk > args.M || args.M > INT32_MAX) return cudaErrorInvalidValue;
  const size_t bytes = static_cast<size_t>(args.M) * sizeof(float);
  cuda::SharedFit fit;  // the kernel's static bytes (0 today) count toward the default too
  const cudaError_t err = cuda::fit_shared(select_expand_kernel, 0, &fit);
  if (err != cudaSuccess) return err;
  const bool staged = fit.static_bytes + bytes <= kSharedLimit;
  select_expand_kernel RHEO_LAUNCH(static_cast<unsigned>(args.B), kThreads, staged ? bytes : 0, stream)(
      args, staged);
  return cudaGetLastError();
}

cudaError_t build_tree_cuda(const BuildTreeArgs& args, cudaStream_t stream) {
  if (args.B == 0) return cudaSuccess;
  if (args.N < 1 || args.N - 1 > args.L || args.max_depth < 0 || args.L > INT32_MAX)
    return cudaErrorInvalidValue;
  const size_t leaf_bytes = static_cast<size_t>(args.N);
  const size_t score_bytes = static_cast<size_t>(args.L) * sizeof(float);
  cuda::SharedFit fit;  // the kernel's static bytes (0 today) count toward the default too
  const cudaError_t err = cuda::fit_shared(build_tree_kernel, 0, &fit);
  if (err != cudaSuccess) return err;
  const bool staged = fit.static_bytes + score_bytes + leaf_bytes <= kSharedLimit;
  if (fit.static_bytes + leaf_bytes > kSharedLimit) return cudaErrorInvalidValue;  // N > ~49152
  build_tree_kernel RHEO_LAUNCH(static_cast<unsigned>(args.B), kThreads,
                      staged ? score_bytes + leaf_bytes : leaf_bytes, stream)(args, staged);
  return cudaGetLastError();
}

}  // namespace rheo
