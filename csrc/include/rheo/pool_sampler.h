// Pool sampler: the K children of each expanded draft node (docs/algorithm.md §4).
//
// logits [n, V] (row stride `row_stride` elements) -> per row r:
//   tokens       [n, K] int32   child token ids in slot order
//   log_proxy    [n, K] acc_t   log of the proxy probability used by every tree-construction score
//   sampled_slot [n]    int32   slot of the sampled child Y, or -1 (no sampled child in this row)
//   q_tilde_ids  [n, Se] int32  the sparse support: the Se = min(S, V) highest logits of the row,
//                               in descending logit order (ties: lower token id first)
//   q_tilde      [n, Se] acc_t  q~ on that support (0 on the leads; all 0 when sampled_slot = -1)
//   q_sampled    [n]    acc_t   q~(Y), the TRUE probability used by verification (0 if no Y)
// acc_t is double for kFloat64 logits and float otherwise.
//
// Definitions (q untempered over the whole vocabulary, qT tempered over the support):
//   q(v)  = softmax(logits)(v)
//   qT(v) = softmax(logits[support] / T)(v) for v in the support, 0 outside it
//   leads x1..xm = the m highest logits (= highest q); z = 1 - sum_i q(x_i)
//   q~(v) = qT(v) / z_T on support minus leads, z_T = tempered mass outside the leads;
//           computed stably as exp((l_v - l_{x_{m+1}}) / T) / sum over support minus leads.
//
// Pool kinds:
//   kTopK (method topk, and every method at T = 0): slots = the K highest logits, log q each.
//   kRheo (methods rrsw and rheo at T > 0):
//     slots 0..m-1  leads, log q(x_i)
//     slot  m       Y ~ q~ with the coin u = pool_coin(seed, step, level, row): inverse CDF in
//                   support order (descending logit, leads skipped): the first v whose running
//                   sum of q~ weights exceeds u * (total weight); proxy
//                   q_proxy = min(q(x_m), z)         (m >= 1)
//                   q_proxy = min(1, q(x_1) + kProxyEpsilon)   (m = 0)
//                   Lemma 4: q_proxy >= q(x_{m+1}) >= q(any fill), so Y always ranks at slot m+1
//                   whatever it is. The kernel also takes max(., q(x_{m+1})) so that rounding can
//                   never break the inequality. Never use q(Y) here: that breaks losslessness.
//     slots m+1..K-1 fills: the highest-logit tokens of the support without the leads and Y,
//                   log q each.
//   Degenerate: when z_T underflows (z_T < the smallest normal acc_t), slot m holds x_{m+1} as an
//   ordinary deterministic child with log q(x_{m+1}), and sampled_slot = -1 (docs/algorithm.md §4).
//
// Rules (checked by the caller-facing binding; RHEO_CHECK messages name value, rule and fix):
//   1 <= K <= V, 0 <= m < K, K <= S, T >= 0, every logit finite.
// forced_sample (optional, [n] int32, -1 = draw): pins Y to a given token (exact enumeration in
// tests). The token must lie in the support, not be a lead, and have q~ > 0.
// Single pass over V per row for the selection (bounded heap of size Se), plus one pass for
// the log-sum-exp; never a full sort of V.
#pragma once

#include <cstdint>

#include "rheo/common.h"

#ifdef RHEO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace rheo {

constexpr double kProxyEpsilon = 1e-6;

enum class PoolKind : int32_t { kTopK = 0, kRheo = 1 };

struct PoolSamplerArgs {
  // inputs
  const void* logits = nullptr;  // [n, V] of `dtype`
  DType dtype = DType::kFloat32;
  int64_t n = 0;                 // rows (expanded nodes)
  int64_t V = 0;                 // draft vocabulary
  int64_t row_stride = 0;        // elements between rows (>= V)
  int32_t K = 0;                 // slots per pool
  int32_t m = 1;                 // leads (rheostat)
  int32_t S = 128;               // sparse support requested; Se = min(S, V) is used
  double T = 1.0;                // temperature of q~ (0 = greedy: forces kTopK)
  PoolKind kind = PoolKind::kRheo;
  uint64_t seed = 0;
  uint64_t step = 0;
  const int64_t* key = nullptr;  // [2] (seed, step) in memory, or null: the scalars (coin_key)
  uint32_t level = 0;            // draft level, part of the Philox stream
  const int32_t* forced_sample = nullptr;  // [n] or null
  // outputs (acc_t = double for kFloat64 logits, float otherwise)
  int32_t* tokens = nullptr;        // [n, K]
  void* log_proxy = nullptr;        // [n, K] acc_t
  int32_t* sampled_slot = nullptr;  // [n]
  int32_t* q_tilde_ids = nullptr;   // [n, Se]
  void* q_tilde = nullptr;          // [n, Se] acc_t
  void* q_sampled = nullptr;        // [n] acc_t
  int32_t* status = nullptr;        // [1] or null: CUDA status bits (common.h StatusBit)
};

// Validates the scalar arguments (K, m, S, T, V) with messages that say how to fix them.
void pool_sampler_check_args(const PoolSamplerArgs& args);

void pool_sampler_cpu(const PoolSamplerArgs& args);
#ifdef RHEO_WITH_CUDA
cudaError_t pool_sampler_cuda(const PoolSamplerArgs& args, cudaStream_t stream);
#endif

}  // namespace rheo
