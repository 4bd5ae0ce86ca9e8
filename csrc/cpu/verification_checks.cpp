// Verification on the CPU: the argument and tree-structure checks of the contract in
// csrc/include/rheo/verification.h, run before any work; each message says how to fix the call.
#include <algorithm>
#include <cmath>
#include <vector>

#include "verification_internal.h"

namespace rheo {
namespace {

using verification_detail::q_tilde_at;
using verification_detail::tree_of;
using verification_detail::TreeView;

// Tree structure rules of one tree b (parents, tokens, sampled rows and their q~).
void check_tree(const VerificationArgs& a, int64_t b, std::vector<int32_t>& depth,
                std::vector<int32_t>& sampled_children) {
  const TreeView t = tree_of(a, b);
  RHEO_CHECK(t.parents[0] == -1, "parents[", b, ", 0] = ", t.parents[0],
             ": node 0 is the root and must have parent -1");
  depth[0] = 0;
  std::fill(sampled_children.begin(), sampled_children.end(), 0);
  for (int64_t j = 1; j < a.N; ++j) {
    const int32_t par = t.parents[j], tok = t.tokens[j], row = t.sampled_row[j];
    RHEO_CHECK(par >= 0 && par < j, "parents[", b, ", ", j, "] = ", par, ": a node's parent must "
               "precede it (0 <= parent < node); lay the tree out with build_tree");
    RHEO_CHECK(tok >= 0 && tok < a.V, "tokens[", b, ", ", j, "] = ", tok, " is outside the "
               "vocabulary [0, V = ", a.V, ")");
    RHEO_CHECK(row >= -1 && row < a.R, "sampled_row[", b, ", ", j, "] = ", row, " must be -1 or "
               "a row of q_tilde in [0, R = ", a.R, ")");
    depth[j] = depth[par] + 1;
    if (row < 0) continue;
    RHEO_CHECK(++sampled_children[par] == 1, "node ", par, " of tree ", b, " has more than one "
               "sampled child (second: node ", j, "); at most one child per parent has "
               "sampled_row >= 0");
    double q_tok = 0.0;
    for (int64_t s = 0; s < a.Se; ++s) {
      const int32_t id = a.q_tilde_ids[row * a.Se + s];
      const double q = q_tilde_at(a, row * a.Se + s);
      RHEO_CHECK(id >= 0 && id < a.V, "q_tilde_ids[", row, ", ", s, "] = ", id, " is outside "
                 "the vocabulary [0, V = ", a.V, ")");
      RHEO_CHECK(std::isfinite(q) && q >= 0.0, "q_tilde[", row, ", ", s, "] = ", q, " must be "
                 "a finite probability >= 0");
      if (id == tok) q_tok = q;
    }
    RHEO_CHECK(q_tok > 0.0, "sampled node ", j, " of tree ", b, " has token ", tok, " with q~ = "
               "0 in q_tilde row ", row, ": a sampled token must be in its support with "
               "q~ > 0 (was it drawn from that row?)");
  }
  if (a.accept_path == nullptr) return;  // law mode has no path
  const int32_t max_depth = *std::max_element(depth.begin(), depth.end());
  RHEO_CHECK(a.path_capacity >= max_depth + 1, "path_capacity = ", a.path_capacity, " but tree ",
             b, " has depth ", max_depth, "; path_capacity must be >= depth + 1 = ",
             max_depth + 1);
}

}  // namespace

void verification_check_scalars(const VerificationArgs& a) {
  RHEO_CHECK(a.B >= 1 && a.N >= 1 && a.V >= 1, "logits must be [B, N, V] with B, N, V >= 1, got "
             "[", a.B, ", ", a.N, ", ", a.V, "]");
  RHEO_CHECK(std::isfinite(a.T) && a.T >= 0.0, "T=", a.T, " must be a finite temperature >= 0 "
             "(0 = greedy)");
  RHEO_CHECK(a.top_p > 0.0 && a.top_p <= 1.0, "top_p=", a.top_p, " must be in (0, 1]; use 1.0 "
             "to disable");
  RHEO_CHECK(a.top_k >= 0, "top_k=", a.top_k, " must be >= 0; use 0 to disable");
  RHEO_CHECK(a.min_p >= 0.0 && a.min_p < 1.0, "min_p=", a.min_p, " must be in [0, 1); use 0 to "
             "disable");
  const int32_t m = static_cast<int32_t>(a.method);
  RHEO_CHECK(m >= 0 && m <= 2, "method=", m, " must be 0 (topk), 1 (rrsw) or 2 (rheo)");
  RHEO_CHECK(a.R >= 0 && a.Se >= 0, "q_tilde must be [R, Se] with R, Se >= 0, got [", a.R, ", ",
             a.Se, "]");
  RHEO_CHECK(a.accept_path == nullptr || a.path_capacity >= 1, "path_capacity = ",
             a.path_capacity, " must be >= 1 (the root)");
  RHEO_CHECK(a.N <= (int64_t{1} << 31) / a.B, "B * N = ", a.B * a.N, " must fit the 32-bit coin "
             "index; verify fewer trees per call");
}

void verification_check_args(const VerificationArgs& a) {
  verification_check_scalars(a);
  std::vector<int32_t> depth(a.N), sampled_children(a.N);
  for (int64_t b = 0; b < a.B; ++b) check_tree(a, b, depth, sampled_children);
}

}  // namespace rheo
