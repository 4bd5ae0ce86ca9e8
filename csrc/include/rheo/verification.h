// Verification: walk the draft tree with the target distribution p and emit the accepted path
// plus one token (docs/algorithm.md §2 step 3, §3 methods, §6 RheoVerification).
//
// Inputs (B trees of N nodes each; node 0 is the root; parents precede children and siblings
// appear in slot order, as build_tree lays them out):
//   logits      [B, N, V]   target logits at every node (row stride V; fp32/bf16/fp16/fp64)
//   tokens      [B, N]      int32 node tokens (target vocabulary; node 0 unused)
//   parents     [B, N]      int32 parent node, -1 for the root
//   sampled_row [B, N]      int32 row of the node's sparse q~ in the table below, -1 if the node
//                           is not a sampled child (at most one sampled child per parent)
//   q_tilde_ids [R, Se]     int32 support of each sampled node's q~ (target vocabulary ids)
//   q_tilde     [R, Se]     acc_t q~ on that support (acc_t = double for fp64 logits, else float)
//
// Target processing at a visited node (HF order): logits / T, then top-k (keep the logits >= the
// k-th largest; 0 = off), then top-p (sort by p descending, ties by lower id; keep a token when
// the mass strictly before it is < top_p; top_p = 1 = off), then min-p (of those, drop the
// tokens with p < min_p * max p; 0 = off), renormalise. T = 0 is greedy: p is one-hot on the
// argmax (lowest id on ties) for every method. History-dependent controls (repetition, presence
// and frequency penalties, min_new_tokens) are applied to each node's row before this kernel,
// by logit_controls (logit_controls.h), with that node's own history.
//
// One layer at visited node i with children c_0..c_{k-1} in node order (r is the residual):
//   kTopK : r = p; for each child: accept with prob r(c); else r(c) = 0, r = norm(r).
//   kRheo : if a sampled child Y exists: accept Y with prob min(1, p(Y)/q~(Y)); else
//           r = norm(max(0, p - q~)) and Y leaves the list; otherwise r = p. Then the remaining
//           children in node order as in kTopK. (Paper Algorithm 1.)
//   kRRSW : r = p; the children before Y (the leads) as in kTopK; then Y: accept with prob
//           min(1, r(Y)/q~(Y)), else r = norm(max(0, r - q~)); then the rest as in kTopK.
//           Without Y it is kTopK. (Paper app. D.2.)
//   On accepting child c: descend into c. If every child is rejected: emit a token drawn from r.
//   On reaching a node without children: emit a token drawn from p at that node.
// Coins: the j-th test at node i (j = position in the verification order above, Y first for
// kRheo) uses verify_coin(seed, step, b, N, i, j) and accepts when coin < probability
// (for Y: coin * q~(Y) < p(Y)). The final draw uses slot kResidualSlot and inverse CDF over
// token ids in increasing order: the smallest v with cumsum_{w <= v} r(w) > coin * sum(r).
// Rounding guard: a test whose rejection would leave r with zero mass accepts instead (only
// reachable through rounding when the accept probability is within an ulp of 1).
// The CPU computes the softmax only at the visited nodes; the CUDA kernel reduces every node's
// row in parallel first (verification.cu). Both keep the residual as p, the sparse correction
// over the support and a running normaliser, and materialise it over V at most once (the
// final draw).
//
// Outputs:
//   accept_path [B, P] int32  accepted node indices from the root (root first), -1 padded;
//                             P = path_capacity >= max depth + 1
//   accept_len  [B]    int32  number of accepted nodes including the root (>= 1)
//   bonus_token [B]    int32  the emitted token after the accepted path
// So a step emits tokens[path[1..accept_len-1]] followed by bonus_token.
// verification_cuda cannot raise without a sync: a tree whose visited node holds a NaN/inf logit
// (kStatusNonFiniteTarget), or whose tree / q~ table breaks the rules below
// (kStatusBadVerifyInput), gets accept_len 1, accept_path [0, -1, ...] and bonus_token 0, and the
// bit is ORed into *status (common.h StatusBit), which the host reads once per step. The scalar
// rules (B, N, V, T, top_p, top_k, method, path_capacity) are checked on the host before launch.
//
// verification_law_cpu computes the exact law of the walk instead of drawing coins (tests and
// analysis): accept_prob[b, i] = P(walk moves into node i | its parent is visited) (root: 1),
// emit_prob[b, i, v] = P(walk stops at node i and emits v | node i is visited). Both acc_t.
//
// Rules: B, N >= 1; V >= 1; T >= 0; 0 < top_p <= 1; top_k >= 0; 0 <= min_p < 1; logits finite at visited nodes
// (a NaN/inf raises); every sampled node's token must be in its support with q~ > 0.
#pragma once

#include <cstdint>

#include "rheo/common.h"

#ifdef RHEO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace rheo {

enum class VerifyMethod : int32_t { kTopK = 0, kRRSW = 1, kRheo = 2 };

struct VerificationArgs {
  // inputs
  const void* logits = nullptr;  // [B, N, V]
  DType dtype = DType::kFloat32;
  int64_t B = 0, N = 0, V = 0;
  const int32_t* tokens = nullptr;       // [B, N]
  const int32_t* parents = nullptr;      // [B, N]
  const int32_t* sampled_row = nullptr;  // [B, N]
  const int32_t* q_tilde_ids = nullptr;  // [R, Se]
  const void* q_tilde = nullptr;         // [R, Se] acc_t
  int64_t R = 0, Se = 0;
  VerifyMethod method = VerifyMethod::kRheo;
  double T = 1.0;
  double top_p = 1.0;
  int32_t top_k = 0;
  double min_p = 0.0;
  uint64_t seed = 0;
  uint64_t step = 0;
  const int64_t* key = nullptr;  // [2] (seed, step) in memory, or null: the scalars (coin_key)
  // outputs of verification_cpu / _cuda
  int32_t* accept_path = nullptr;  // [B, path_capacity]
  int64_t path_capacity = 0;
  int32_t* accept_len = nullptr;   // [B]
  int32_t* bonus_token = nullptr;  // [B]
  int32_t* status = nullptr;       // [1] or null: CUDA status bits (common.h StatusBit)
  double* workspace = nullptr;     // [B, V] doubles: verification_cuda only (its per-node
                                   // stats records, see verification.cu; the binding allocates
                                   // it through torch's caching allocator)
  // outputs of verification_law_cpu
  void* accept_prob = nullptr;  // [B, N] acc_t
  void* emit_prob = nullptr;    // [B, N, V] acc_t
};

// The scalar rules (host values only: no sync on CUDA), then verification_check_args adds the
// tree and q~ rules, which read the (device) buffers; verification_cuda checks those on the GPU.
void verification_check_scalars(const VerificationArgs& args);
void verification_check_args(const VerificationArgs& args);
void verification_cpu(const VerificationArgs& args);
void verification_law_cpu(const VerificationArgs& args);
#ifdef RHEO_WITH_CUDA
cudaError_t verification_cuda(const VerificationArgs& args, cudaStream_t stream);
#endif

}  // namespace rheo
