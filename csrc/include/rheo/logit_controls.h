// Logit controls: the history-dependent part of the target processing (docs/algorithm.md §8),
// applied in place to every node's row of target logits, each with that node's own history,
// before verification (verification.h then does temperature -> top-k -> top-p -> min-p).
//
// The history of node i of tree b is the sequence so far (the prompt and every emitted token,
// the root's token included: the host's history_* arrays) followed by the tokens of the nodes on
// the path from the root (excluded) to i (included): the tokens before the one node i's row
// draws. Losslessness needs exactly this (a node's p must be what plain sampling would use after
// that history); the root's history at every node is lossy.
//
// Inputs (B trees of N nodes; node 0 is the root; parents precede children, as build_tree lays
// them out):
//   logits          [B, N, V]  float32 or float64, modified in place
//   tokens          [B, N]     int32 node tokens (node 0 unused)
//   parents         [B, N]     int32 parent node, -1 for the root
//   history_ids     [B, H]     int32 distinct tokens of the sequence so far, strictly ascending
//                              in the first history_len[b] entries (the rest is not read)
//   history_counts  [B, H]     int32 times each was *generated* (0: in the prompt only)
//   history_len     [B]        int32 entries of row b in use (0 <= history_len[b] <= H)
//   suppress_ids    [E]        int32 distinct tokens banned at shallow nodes (min_new_tokens'
//                              EOS ids); suppress_below [B] int32: banned at nodes of depth
//                              < suppress_below[b] (root depth 0; 0 = never)
//
// At node i, for each token v of its history, with c(v) = its generated count plus its
// occurrences on the path (path tokens count as generated):
//   repetition (HF RepetitionPenaltyLogitsProcessor): l = l < 0 ? l * r : l / r, r > 0 (1 = off)
//   frequency and presence (OpenAI / vLLM): l -= frequency * c(v) + presence * (c(v) > 0)
// so repetition covers the prompt and the output, presence and frequency the output only (as in
// vLLM). Then a banned token gets the lowest finite value of the row's type: every path of the
// verification turns it into p = 0 exactly (exp underflows), as HF's -inf does, and the kernels'
// finiteness check (which rejects inf) still guards the model's own output. Arithmetic is in the
// row's type, with the penalties rounded to it (HF's fp32 processors: float32 rows agree bit
// for bit).
//
// logit_controls_cuda: one block per node row; a tree or history that breaks the rules sets
// kStatusBadControls in *status (common.h StatusBit) and that row is left as it was; the host
// raises logit_controls_cpu's error for it.
//
// Rules: B, N, V >= 1; H, E >= 0; r > 0 finite; presence, frequency finite; parents[b, 0] = -1
// and 0 <= parents[b, j] < j; tokens[b, j] in [0, V) for j >= 1; history ids in [0, V) strictly
// ascending; counts >= 0; suppress ids in [0, V) distinct and E < V; suppress_below >= 0.
#pragma once

#include <cstdint>

#include "rheo/common.h"

#ifdef RHEO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace rheo {

struct LogitControlsArgs {
  void* logits = nullptr;  // [B, N, V], in place
  DType dtype = DType::kFloat32;
  int64_t B = 0, N = 0, V = 0;
  const int32_t* tokens = nullptr;          // [B, N]
  const int32_t* parents = nullptr;         // [B, N]
  const int32_t* history_ids = nullptr;     // [B, H]
  const int32_t* history_counts = nullptr;  // [B, H]
  const int32_t* history_len = nullptr;     // [B]
  int64_t H = 0;
  const int32_t* suppress_ids = nullptr;    // [E]
  int64_t E = 0;
  const int32_t* suppress_below = nullptr;  // [B]
  double repetition_penalty = 1.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  int32_t* status = nullptr;  // [1] or null: CUDA status bits
};

// A product rounded on its own. nvcc contracts a * b - c into one fused multiply-add by default
// (--fmad=true), which rounds once and so differs from the CPU (and torch) in the last bit;
// __fmul_rn / __dmul_rn are never contracted. The emulator and the host compile plain a * b.
RHEO_HOST_DEVICE float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
RHEO_HOST_DEVICE double mul_rn(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// One token's penalised logit (the header's rule, in the row's type T; CPU and CUDA share it):
// count = c(v), the token is in the node's history. Each step rounds as torch's separate ops
// do (mul_rn); presence's product is exact (x 0 or x 1), so fusing it changes nothing.
template <typename T>
RHEO_HOST_DEVICE T penalised_logit(T l, int32_t count, T r, T presence, T frequency) {
  l = l < T(0) ? mul_rn(l, r) : l / r;
  l -= mul_rn(frequency, static_cast<T>(count));
  l -= presence * (count > 0 ? T(1) : T(0));
  return l;
}

// The lowest finite value of a row type: a banned token's logit.
template <typename T>
RHEO_HOST_DEVICE T banned_logit();
template <>
RHEO_HOST_DEVICE float banned_logit<float>() { return -3.40282347e+38f; }
template <>
RHEO_HOST_DEVICE double banned_logit<double>() { return -1.7976931348623157e+308; }

// The scalar rules (host values only), then logit_controls_check_args adds the buffer rules.
void logit_controls_check_scalars(const LogitControlsArgs& args);
void logit_controls_check_args(const LogitControlsArgs& args);
void logit_controls_cpu(const LogitControlsArgs& args);
#ifdef RHEO_WITH_CUDA
cudaError_t logit_controls_cuda(const LogitControlsArgs& args, cudaStream_t stream);
#endif

}  // namespace rheo
