// What the CPU verification files share (CPU-private, not part of the kernel contract in
// csrc/include/rheo/verification.h):
//   verification.cpp         the walk: one layer of tests per visited node, the final draw, the
//                            sampling and law entry points;
//   verification_target.cpp  steps 0 and 1 at a visited node: its logits into the processed
//                            target p (temperature -> top-k -> top-p) as the residual r = w / Z;
//   verification_checks.cpp  argument and tree-structure checks.
#pragma once

#include <cstdint>
#include <memory>

#include "rheo/verification.h"

namespace rheo {
namespace verification_detail {

// One tree's int inputs and the per-thread workspace.
struct TreeView {
  const int32_t* tokens;       // [N]
  const int32_t* parents;      // [N]
  const int32_t* sampled_row;  // [N]
};

struct Workspace {  // uninitialised buffers: every use writes before it reads
  std::unique_ptr<double[]> x;       // [V] logits / T of the visited node
  std::unique_ptr<double[]> w;       // [V] residual weights, r = w / Z
  std::unique_ptr<double[]> sorted;  // [V] top-k selection scratch
  std::unique_ptr<int32_t[]> ids;    // [V] top-p candidate ids
  std::unique_ptr<int32_t[]> order;  // [N] children in verification order
  Workspace(int64_t V, int64_t N)
      : x(new double[V]), w(new double[V]), sorted(new double[V]), ids(new int32_t[V]),
        order(new int32_t[N]) {}
};

// The residual r = w / Z of one layer (Algorithm 1's r).
struct Residual {
  double* w;     // [V] unnormalised weights, starts as p
  double Z;      // sum(w), tracked through the sparse updates
  int64_t nnz;   // #{v : w[v] > 0}, exact: the rounding guard reads it
  int64_t V;
  double Z0;     // sum(w) of p itself: 1 when p is normalised (fp64), else the softmax sum
};

// First non-finite logit of a visited node, reported after the parallel region.
struct BadLogit {
  int64_t node = -1, token = -1;
  double value = 0.0;
};

inline TreeView tree_of(const VerificationArgs& a, int64_t b) {
  return {a.tokens + b * a.N, a.parents + b * a.N, a.sampled_row + b * a.N};
}

inline double q_tilde_at(const VerificationArgs& a, int64_t i) {
  return a.dtype == DType::kFloat64 ? static_cast<const double*>(a.q_tilde)[i]
                                    : static_cast<const float*>(a.q_tilde)[i];
}

// Steps 0 and 1 at `node` of tree b (verification_target.cpp): the processed target p into r
// (r.w = ws.w). False, with *bad filled, on a non-finite logit.
bool prepare_node(const VerificationArgs& a, int64_t b, int64_t node, Workspace& ws, Residual& r,
                  BadLogit* bad);

}  // namespace verification_detail
}  // namespace rheo
