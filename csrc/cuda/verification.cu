// Verification on CUDA (csrc/include/rheo/verification.h). One thread block per tree (grid B):
// the walk is sequential by nature (each layer needs the previous accept), so the parallelism is
// inside a visited node, over the V tokens: the max, the top-k radix select, the softmax sums,
// the top-p radix select over the mass and the inverse-CDF scan are block-wide passes; the
// O(1) tests run on thread 0 and the sparse q~ correction runs over the support in parallel.
// The residual weights w live in a [B, V] double workspace the caller passes (args.workspace).
// Semantics mirror csrc/cpu/verification.cpp step by step with the same Philox coins; block
// sums add in another order, so a coin within rounding of a threshold may go the other way.
// Bad input cannot raise here (no host sync): a tree that breaks the tree / q~ rules, or holds a
// non-finite logit at a visited node, gets the verdict "root only, token 0" and a status bit
// (common.h StatusBit) the host reads once per step. The scalar rules are checked on the host.

#include <cstdint>

#include "device_utils.cuh"
#include "rheo/verification.h"

namespace rheo {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr double kResumBelow = 1e-6;  // as in the CPU kernel

struct Shared {
  double red[kWarps];        // reduction scratch
  int64_t red_i[kWarps];     // reduction scratch (indices / counts)
  unsigned hist[256];        // top-k radix histogram
  double hist_mass[256];     // top-p radix histogram (mass per bin)
  uint64_t prefix;           // radix state
  int64_t remaining;
  double above;
  int found;
  double Z;                  // residual normaliser
  int64_t nnz;               // #{w > 0}
  int accepted;              // 1 when the current test accepted
  int removed;               // 1 when a rejected plain test took weight out of r
  int n_children, y_pos;
};

__device__ double load_logit(const VerificationArgs& a, int64_t i) {
  switch (a.dtype) {
    case DType::kFloat32: return static_cast<const float*>(a.logits)[i];
    case DType::kFloat64: return static_cast<const double*>(a.logits)[i];
    case DType::kFloat16: return __half2float(static_cast<const __half*>(a.logits)[i]);
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(a.logits)[i]);
  }
  return 0.0;
}

__device__ double q_tilde_at(const VerificationArgs& a, int64_t i) {
  return a.dtype == DType::kFloat64 ? static_cast<const double*>(a.q_tilde)[i]
                                    : static_cast<const float*>(a.q_tilde)[i];
}

// Block-wide reductions: every thread gets the result.
template <typename T, typename Op>
__device__ T block_reduce(T val, Op op, T* scratch) {
  for (int o = 16; o > 0; o >>= 1) val = op(val, __shfl_xor_sync(0xFFFFFFFFu, val, o));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = val;
  __syncthreads();
  T total = scratch[0];
  for (int i = 1; i < kWarps; ++i) total = op(total, scratch[i]);
  __syncthreads();
  return total;
}

__device__ double block_sum(double v, Shared& sh) {
  return block_reduce(v, [](double x, double y) { return x + y; }, sh.red);
}
__device__ int64_t block_sum_i(int64_t v, Shared& sh) {
  return block_reduce(v, [](int64_t x, int64_t y) { return x + y; }, sh.red_i);
}
__device__ int64_t block_min_i(int64_t v, Shared& sh) {
  return block_reduce(v, [](int64_t x, int64_t y) { return x < y ? x : y; }, sh.red_i);
}
__device__ int64_t block_max_i(int64_t v, Shared& sh) {
  return block_reduce(v, [](int64_t x, int64_t y) { return x > y ? x : y; }, sh.red_i);
}

// Exclusive prefix sum over threads (in thread order) of one value per thread.
template <typename T>
__device__ T block_exclusive_scan(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const T up = __shfl_up_sync(0xFFFFFFFFu, incl, o);
    if (lane >= o) incl += up;
  }
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  T offset = 0;
  for (int i = 0; i < warp; ++i) offset += scratch[i];
  __syncthreads();
  return offset + incl - v;
}

// Each thread owns the contiguous segment [lo, hi) of the vocabulary (for ordered scans).
__device__ void segment(int64_t V, int64_t* lo, int64_t* hi) {
  const int64_t len = (V + kThreads - 1) / kThreads;
  const int64_t start = static_cast<int64_t>(threadIdx.x) * len;
  *lo = start < V ? start : V;
  *hi = *lo + len < V ? *lo + len : V;
}

__device__ uint64_t ordered_key(double d) {  // monotone map of doubles to unsigned keys
  const uint64_t u = static_cast<uint64_t>(__double_as_longlong(d));
  return (u >> 63) ? ~u : (u | (1ull << 63));
}
__device__ double key_double(uint64_t k) {
  const uint64_t u = (k >> 63) ? (k & ~(1ull << 63)) : ~k;
  return __longlong_as_double(static_cast<long long>(u));
}

// Top-k threshold: the k-th largest x = logits / T (MSB-first radix select, 8 bits a pass).
__device__ double kth_largest(const VerificationArgs& a, int64_t off, Shared& sh) {
  uint64_t prefix = 0, mask = 0;
  if (threadIdx.x == 0) sh.remaining = a.top_k;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kThreads) sh.hist[i] = 0;
    __syncthreads();
    for (int64_t v = threadIdx.x; v < a.V; v += kThreads) {
      const uint64_t key = ordered_key(load_logit(a, off + v) / a.T);
      if ((key & mask) == prefix) atomicAdd(&sh.hist[(key >> shift) & 255], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int bin = 255;
      for (; bin > 0 && sh.hist[bin] < sh.remaining; --bin) sh.remaining -= sh.hist[bin];
      sh.prefix = static_cast<uint64_t>(bin) << shift;
    }
    __syncthreads();
    prefix |= sh.prefix;
    mask |= 255ull << shift;
    __syncthreads();
  }
  return key_double(prefix);
}

// Top-p (header rule) on the normalised p in w: finds the element e* whose inclusive mass in
// (p desc, id asc) order first reaches top_p by a radix descent over the mass, keeps e* and
// everything before it, and renormalises.
__device__ void apply_top_p(const VerificationArgs& a, double* w, Shared& sh) {
  uint64_t prefix = 0, mask = 0;  // p >= 0: its bits are already an ordered key
  if (threadIdx.x == 0) sh.above = 0.0, sh.found = 1;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kThreads) sh.hist_mass[i] = 0.0;
    __syncthreads();
    for (int64_t v = threadIdx.x; v < a.V; v += kThreads) {
      const uint64_t key = static_cast<uint64_t>(__double_as_longlong(w[v]));
      if (w[v] > 0.0 && (key & mask) == prefix) atomicAdd(&sh.hist_mass[(key >> shift) & 255], w[v]);
    }
    __syncthreads();
    if (threadIdx.x == 0 && sh.found) {
      int bin = 255, lowest = -1;
      double above_lowest = 0.0;
      while (bin >= 0 && sh.above + sh.hist_mass[bin] < a.top_p) {
        if (sh.hist_mass[bin] > 0.0) lowest = bin, above_lowest = sh.above;
        sh.above += sh.hist_mass[bin--];
      }
      // The sub-bins, summed in another order, can come to a few ulps less than their parent bin
      // (or the whole mass to a few ulps less than top_p): then no bin reaches top_p, and the
      // answer lies in the lowest non-empty one (issue 10 defect 4: top-p used to switch off).
      if (bin < 0 && lowest >= 0) bin = lowest, sh.above = above_lowest;
      sh.found = bin >= 0;
      sh.prefix = static_cast<uint64_t>(bin < 0 ? 0 : bin) << shift;
    }
    __syncthreads();
    prefix |= sh.prefix;
    mask |= 255ull << shift;
    __syncthreads();
  }
  const bool found = sh.found;
  const double tau = __longlong_as_double(static_cast<long long>(prefix));
  int64_t lo, hi, ties = 0;  // ties at tau are kept in id order while the mass is short
  segment(a.V, &lo, &hi);
  for (int64_t v = lo; v < hi; ++v) ties += found && w[v] == tau;
  const int64_t before = block_exclusive_scan(ties, sh.red_i);
  const double need = found ? ceil((a.top_p - sh.above) / tau) : 0.0;
  const int64_t keep_ties = need < 1.0 ? 1 : static_cast<int64_t>(need);
  double kept = 0.0;
  for (int64_t v = lo, rank = before; v < hi; ++v) {
    const bool tie = found && w[v] == tau;
    if (found && (w[v] < tau || (tie && rank >= keep_ties))) w[v] = 0.0;
    rank += tie;
    kept += w[v];
  }
  kept = block_sum(kept, sh);
  for (int64_t v = threadIdx.x; v < a.V; v += kThreads) w[v] /= kept;
  __syncthreads();
}

// Step 1: the processed target p at `node` into w; false on a non-finite logit.
__device__ bool process_target(const VerificationArgs& a, int64_t b, int64_t node, double* w,
                               Shared& sh) {
  const int64_t off = (b * a.N + node) * a.V;
  double m = -INFINITY;
  int64_t best = a.V, bad = a.V;
  for (int64_t v = threadIdx.x; v < a.V; v += kThreads) {
    const double l = load_logit(a, off + v);
    if (!isfinite(l) && v < bad) bad = v;
    const double x = a.T > 0.0 ? l / a.T : l;
    if (x > m) m = x, best = v;  // strided order: v increases, so ties keep the lowest id
  }
  if (block_min_i(bad, sh) < a.V) return false;
  const double m_all = block_reduce(m, [](double x, double y) { return x > y ? x : y; }, sh.red);
  if (a.T == 0.0) {  // greedy: one-hot on the argmax, lowest id on ties
    const int64_t arg = block_min_i(m == m_all ? best : a.V, sh);
    for (int64_t v = threadIdx.x; v < a.V; v += kThreads) w[v] = v == arg ? 1.0 : 0.0;
    if (threadIdx.x == 0) sh.Z = 1.0, sh.nnz = 1;
    __syncthreads();
    return true;
  }
  const double kth = (a.top_k > 0 && a.top_k < a.V) ? kth_largest(a, off, sh) : -INFINITY;
  double sum = 0.0;
  for (int64_t v = threadIdx.x; v < a.V; v += kThreads) {
    const double x = load_logit(a, off + v) / a.T;
    w[v] = x >= kth ? exp(x - m_all) : 0.0;
    sum += w[v];
  }
  sum = block_sum(sum, sh);
  for (int64_t v = threadIdx.x; v < a.V; v += kThreads) w[v] /= sum;
  __syncthreads();
  if (a.top_p < 1.0) apply_top_p(a, w, sh);
  int64_t nnz = 0;
  for (int64_t v = threadIdx.x; v < a.V; v += kThreads) nnz += w[v] > 0.0;
  nnz = block_sum_i(nnz, sh);
  if (threadIdx.x == 0) sh.Z = 1.0, sh.nnz = nnz;
  __syncthreads();
  return true;
}

// Children of `node` in verification order (thread 0; DESIGN.md §2 method table).
__device__ void verification_order(const VerificationArgs& a, const int32_t* parents,
                                   const int32_t* sampled, int64_t node, int32_t* order,
                                   Shared& sh) {
  if (threadIdx.x != 0) return;
  int n = 0, y = -1;
  for (int64_t j = node + 1; j < a.N; ++j) {
    if (parents[j] != node) continue;
    if (a.method != VerifyMethod::kTopK && sampled[j] >= 0) y = n;
    order[n++] = static_cast<int32_t>(j);
  }
  if (a.method == VerifyMethod::kRheo && y > 0) {  // Algorithm 1: Y is tested first
    const int32_t yc = order[y];
    for (int i = y; i > 0; --i) order[i] = order[i - 1];
    order[0] = yc;
    y = 0;
  }
  sh.n_children = n;
  sh.y_pos = y;
}

__device__ void resum_if_cancelled(const VerificationArgs& a, const double* w, Shared& sh) {
  if (sh.Z >= kResumBelow) return;  // uniform: every thread reads the same shared value
  double z = 0.0;
  for (int64_t v = threadIdx.x; v < a.V; v += kThreads) z += w[v];
  z = block_sum(z, sh);
  if (threadIdx.x == 0) sh.Z = z;
  __syncthreads();
}

// The sampled child's test: min(1, r(Y) / q~(Y)); on rejection w = max(0, w - Z q~) on the
// support (r = norm(max(0, r - q~))). Returns true on accept.
__device__ bool sampled_test(const VerificationArgs& a, int64_t b, int64_t node, int j,
                             int32_t token, int64_t row, double* w, Shared& sh) {
  const int32_t* ids = a.q_tilde_ids + row * a.Se;
  const double Z = sh.Z;
  double removed = 0.0, q_y = 0.0;
  int64_t lost = 0;
  for (int64_t s = threadIdx.x; s < a.Se; s += kThreads) {
    const double q = q_tilde_at(a, row * a.Se + s), ws = w[ids[s]], zq = Z * q;
    if (ids[s] == token) q_y = q;
    removed += fmin(ws, zq);
    lost += ws > 0.0 && ws <= zq;
  }
  removed = block_sum(removed, sh);
  lost = block_sum_i(lost, sh);
  q_y = block_sum(q_y, sh);
  if (threadIdx.x == 0) {
    const double coin = verify_coin(a.seed, a.step, b, a.N, node, j);
    sh.accepted = sh.nnz == lost || coin * q_y < w[token] / Z;  // rounding guard first
  }
  __syncthreads();
  if (sh.accepted) return true;
  for (int64_t s = threadIdx.x; s < a.Se; s += kThreads)
    w[ids[s]] = fmax(0.0, w[ids[s]] - Z * q_tilde_at(a, row * a.Se + s));
  __syncthreads();
  if (threadIdx.x == 0) sh.Z = Z - removed, sh.nnz -= lost;
  __syncthreads();
  resum_if_cancelled(a, w, sh);
  return false;
}

// One layer at `node`: returns the accepted child or -1 (every child rejected).
__device__ int32_t run_layer(const VerificationArgs& a, int64_t b, int64_t node, double* w,
                             int32_t* order, Shared& sh) {
  const int32_t* tokens = a.tokens + b * a.N;
  const int32_t* sampled = a.sampled_row + b * a.N;
  verification_order(a, a.parents + b * a.N, sampled, node, order, sh);
  __syncthreads();
  for (int j = 0; j < sh.n_children; ++j) {
    const int32_t child = order[j], token = tokens[child];
    if (j == sh.y_pos) {
      if (sampled_test(a, b, node, j, token, sampled[child], w, sh)) return child;
      __syncthreads();  // sh is rewritten by the next test
      continue;
    }
    if (threadIdx.x == 0) {  // plain test: accept with prob r(c); else r(c) = 0, r = norm(r)
      const double wc = w[token];
      const double coin = verify_coin(a.seed, a.step, b, a.N, node, j);
      sh.accepted = (wc > 0.0 && sh.nnz == 1) || coin < wc / sh.Z;
      sh.removed = !sh.accepted && wc > 0.0;
      if (sh.removed) w[token] = 0.0, sh.Z -= wc, sh.nnz -= 1;
    }
    __syncthreads();
    if (sh.accepted) return child;
    if (sh.removed) resum_if_cancelled(a, w, sh);  // as the CPU: only when r changed (defect 5)
    __syncthreads();  // sh is rewritten by the next test
  }
  return -1;
}

// Final draw: the smallest v with cumsum_{u <= v} w(u) > coin * sum(w).
__device__ int32_t draw_from(const VerificationArgs& a, const double* w, double coin, Shared& sh) {
  int64_t lo, hi, last = -1;
  segment(a.V, &lo, &hi);
  double mine = 0.0;
  for (int64_t v = lo; v < hi; ++v) {
    mine += w[v];
    if (w[v] > 0.0) last = v;
  }
  const double before = block_exclusive_scan(mine, sh.red);
  const double target = coin * block_sum(mine, sh);
  int64_t hit = a.V;
  double cum = before;
  for (int64_t v = lo; v < hi && hit == a.V; ++v) {
    if (w[v] <= 0.0) continue;
    cum += w[v];
    if (cum > target) hit = v;
  }
  hit = block_min_i(hit, sh);
  last = block_max_i(last, sh);
  return static_cast<int32_t>(hit < a.V ? hit : (last < 0 ? 0 : last));  // CPU: 0 without mass
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

__global__ void __launch_bounds__(kThreads) verification_kernel(VerificationArgs a) {
  RHEO_DYNAMIC_SHARED(int32_t, order);  // [N] children in verification order
  __shared__ Shared sh;
  const int64_t b = blockIdx.x;
  double* w = a.workspace + b * a.V;
  int32_t* path = a.accept_path + b * a.path_capacity;
  if (tree_is_bad(a, b)) return reject_tree(a, b, path, kStatusBadVerifyInput);
  for (int64_t i = threadIdx.x; i < a.path_capacity; i += kThreads) path[i] = i == 0 ? 0 : -1;
  __syncthreads();
  int32_t len = 1, node = 0;
  while (true) {
    if (!process_target(a, b, node, w, sh)) {
      __syncthreads();  // every thread has written its part of the path before it is reset
      return reject_tree(a, b, path, kStatusNonFiniteTarget);
    }
    const int32_t child = run_layer(a, b, node, w, order, sh);
    if (child < 0) {
      const double coin = verify_coin(a.seed, a.step, b, a.N, node, kResidualSlot);
      const int32_t token = draw_from(a, w, coin, sh);
      if (threadIdx.x == 0) a.accept_len[b] = len, a.bonus_token[b] = token;
      return;
    }
    if (threadIdx.x == 0) path[len] = child;
    ++len;
    node = child;
    __syncthreads();
  }
}

}  // namespace

cudaError_t verification_cuda(const VerificationArgs& args, cudaStream_t stream) {
  verification_check_scalars(args);  // host values: no sync; the tree is checked on the device
  const size_t order_bytes = static_cast<size_t>(args.N) * sizeof(int32_t);
  if (order_bytes > 32 * 1024) return cudaErrorInvalidValue;  // N > 8192 nodes
  // The [B, V] residual workspace comes from the caller (the binding: torch's caching
  // allocator), not from a cudaMallocAsync per call (issue 10 defect 6).
  if (args.workspace == nullptr || args.accept_path == nullptr || args.accept_len == nullptr ||
      args.bonus_token == nullptr)
    return cudaErrorInvalidValue;
  verification_kernel RHEO_LAUNCH(static_cast<unsigned>(args.B), kThreads, order_bytes, stream)(args);
  return cudaGetLastError();
}

}  // namespace rheo
