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

// A top-p candidate: its probability and id, compared in place (not through p[id]).
struct Candidate {
  double p;
  int32_t id;
};

// A buffer grown on first use to the largest size asked, never shrunk, uninitialised: every use
// writes before it reads.
template <typename T>
class Buffer {
 public:
  T* get(int64_t n) {
    if (size_ < n) data_.reset(new T[n]), size_ = n;
    return data_.get();
  }

 private:
  std::unique_ptr<T[]> data_;
  int64_t size_ = 0;
};

// One per thread, kept between calls (workspace()): at a 49k-token vocabulary a buffer of V
// doubles is 393 KB, which each call allocated and faulted in anew before. Each buffer is made
// where a call first needs it (w always; x for float64 logits, sorted for top-k, cands and
// support for top-p), so a greedy fp32 step holds w alone.
struct Workspace {
  Buffer<double> x;             // [V] logits / T of the visited node
  Buffer<double> w;             // [V] residual weights, r = w / Z
  Buffer<double> sorted;        // [V] top-k selection scratch
  Buffer<Candidate> cands;      // [V] top-p candidates above the threshold
  Buffer<int32_t> support;      // [V] the ids top-p kept, in id order
  Buffer<int32_t> order;        // [N] children in verification order
  // What a greedy call left in w: zeros in [0, zeroed_n) of the buffer at `zeroed` but at
  // zeroed_one (-1: none); the next one-hot clears that one entry instead of writing V zeros
  // (one_hot). Calls that write w otherwise forget it (zeroed = nullptr).
  double* zeroed = nullptr;
  int64_t zeroed_n = 0, zeroed_one = -1;
};

// p one-hot on `best` in ws.w, as a zero-filled [V] buffer with a 1 there.
double* one_hot(Workspace& ws, int64_t V, int64_t best);

// This thread's workspace (its buffers sized by each use: Buffer::get).
Workspace& workspace();

// The residual r = w / Z of one layer (Algorithm 1's r).
struct Residual {
  double* w;     // [V] unnormalised weights, starts as p
  double Z;      // sum(w), tracked through the sparse updates
  int64_t nnz;   // #{v : w[v] > 0}, exact: the rounding guard reads it
  int64_t V;
  double Z0;     // sum(w) of p itself: 1 when p is normalised (fp64), else the softmax sum
  // Where p is one-hot (T = 0): its token. While nnz == 1 and w[one] > 0 it is the only
  // positive weight (the layer's updates never make another), so the final draw needs no pass.
  int64_t one = -1;
  // Where top-p cut p: the ids it kept, in id order (support_n of them), a superset of the
  // positive weights (the layer's updates only lower weights), so the final draw reads only
  // them (nullptr: all of [0, V)).
  const int32_t* support = nullptr;
  int64_t support_n = 0;
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
