// Verification on the CPU (csrc/include/rheo/verification.h): one tree per OpenMP iteration.
// Per visited node: the processed target p (temperature -> top-k -> top-p) into a dense buffer,
// then one layer of tests in verification order on the residual r = w / Z, where w starts as p
// and is only ever touched on the sparse support of q~ and at rejected children.
// Sampling mode (verification_cpu) and law mode (verification_law_cpu) share run_layer; they
// differ only in the `decide` callback (a Philox coin, or the exact probabilities).
// Steps 0 and 1 at a visited node (the processed target p) are in verification_target.cpp, the
// argument checks in verification_checks.cpp; verification_internal.h holds what they share.
#include "rheo/verification.h"

#include <algorithm>
#include <vector>

#include "verification_internal.h"

namespace rheo {
namespace verification_detail {
namespace {

// Below this the tracked normaliser Z has lost too many digits to cancellation (Z = 1 - sum of
// removed masses); it is re-summed from w, an O(V) pass reached with probability ~ Z.
constexpr double kResumBelow = 1e-6;

// Children of `node` in verification order (docs/algorithm.md §3, §6). Returns the count;
// *y_pos = position of the sampled child's min(1, r/q~) test, -1 if none (always -1 for kTopK).
int64_t verification_order(const VerificationArgs& a, const TreeView& t, int64_t node,
                           int32_t* order, int64_t* y_pos) {
  int64_t n = 0;
  *y_pos = -1;
  for (int64_t j = node + 1; j < a.N; ++j) {
    if (t.parents[j] != node) continue;
    if (a.method != VerifyMethod::kTopK && t.sampled_row[j] >= 0) *y_pos = n;
    order[n++] = static_cast<int32_t>(j);
  }
  if (a.method == VerifyMethod::kRheo && *y_pos > 0) {  // Algorithm 1: Y is tested first
    std::rotate(order, order + *y_pos, order + *y_pos + 1);
    *y_pos = 0;
  }
  return n;
}

void resum_if_cancelled(Residual& r) {
  if (r.Z >= kResumBelow * r.Z0) return;
  r.Z = 0.0;
  for (int64_t v = 0; v < r.V; ++v) r.Z += r.w[v];
}

// One layer at `node` (header "One layer"): tests the children in verification order.
// decide(j, child, num, den, forced) -> true to accept; the test's probability is
// min(1, num / den), or 1 when `forced` (rounding guard). Returns the accepted child or -1
// (every child rejected; r is then the residual to emit from).
template <typename Decide>
int32_t run_layer(const VerificationArgs& a, const TreeView& t, int64_t node, Residual& r,
                  int32_t* order, Decide&& decide) {
  int64_t y_pos;
  const int64_t n = verification_order(a, t, node, order, &y_pos);
  for (int64_t j = 0; j < n; ++j) {
    const int32_t child = order[j];
    const int32_t token = t.tokens[child];
    if (j != y_pos) {  // plain sequential-rejection test: accept with prob r(c)
      const double wc = r.w[token];
      if (decide(j, child, wc / r.Z, 1.0, wc > 0.0 && r.nnz == 1)) return child;
      if (wc > 0.0) {  // Algorithm 1 line 16: r(c) = 0, r = norm(r)
        r.w[token] = 0.0;
        r.Z -= wc;
        r.nnz -= 1;
        resum_if_cancelled(r);
      }
      continue;
    }
    // The sampled child Y: accept with prob min(1, r(Y) / q~(Y)); else r = norm(max(0, r - q~)).
    // With r = w / Z: max(0, w / Z - q~) = max(0, w - Z q~) / Z, so only the support changes.
    const int64_t row = t.sampled_row[child];
    const int32_t* ids = a.q_tilde_ids + row * a.Se;
    const auto q = [&](int64_t s) { return q_tilde_at(a, row * a.Se + s); };
    double q_y = 0.0, removed = 0.0;
    int64_t lost = 0;  // support entries whose weight the correction sets to zero
    for (int64_t s = 0; s < a.Se; ++s) {
      const double w = r.w[ids[s]], zq = r.Z * q(s);
      if (ids[s] == token) q_y = q(s);
      removed += std::min(w, zq);
      lost += w > 0.0 && w <= zq;
    }
    // Rounding guard: a rejection leaving r without mass accepts instead.
    if (decide(j, child, r.w[token] / r.Z, q_y, r.nnz == lost)) return child;
    for (int64_t s = 0; s < a.Se; ++s) r.w[ids[s]] = std::max(0.0, r.w[ids[s]] - r.Z * q(s));
    r.Z -= removed;
    r.nnz -= lost;
    resum_if_cancelled(r);
  }
  return -1;
}

// The inverse-CDF draw over the ids id(0) < id(1) < ... < id(n - 1) that hold every positive
// weight: the smallest id with cumsum w > coin * sum(w), the sums in id order.
template <typename Id>
int32_t inverse_cdf(const double* w, int64_t n, Id id, double coin) {
  double total = 0.0;
  for (int64_t j = 0; j < n; ++j) total += w[id(j)];
  const double target = coin * total;
  double cum = 0.0;
  int32_t last = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int32_t v = id(j);
    if (w[v] <= 0.0) continue;
    cum += w[v];
    last = v;
    if (cum > target) return last;
  }
  return last;  // coin * total rounded up to total
}

// Final draw: inverse CDF over ids in increasing order, the smallest v with
// cumsum_{u <= v} w(u) > coin * sum(w) (header "Coins").
int32_t draw_from(const Residual& r, double coin) {
  // One positive weight: every coin's inverse CDF lands on it (also where coin * total rounds
  // up to total: the loop returns the last positive id).
  if (r.nnz == 1 && r.one >= 0 && r.w[r.one] > 0.0) return static_cast<int32_t>(r.one);
  if (r.support != nullptr)  // the same sums: the weights off the support are zeros
    return inverse_cdf(r.w, r.support_n, [&](int64_t j) { return r.support[j]; }, coin);
  return inverse_cdf(r.w, r.V, [](int64_t j) { return static_cast<int32_t>(j); }, coin);
}

// The walk of tree b with Philox coins. False (and *bad filled) on a non-finite logit.
bool walk_tree(const VerificationArgs& a, int64_t b, Workspace& ws, BadLogit* bad) {
  const TreeView t = tree_of(a, b);
  int32_t* path = a.accept_path + b * a.path_capacity;
  std::fill(path, path + a.path_capacity, -1);
  path[0] = 0;
  int32_t len = 1, node = 0;
  const CoinKey key = coin_key(a.key, a.seed, a.step);
  const auto coin = [&](int64_t slot) {
    return verify_coin(key.seed, key.step, static_cast<uint32_t>(b), static_cast<uint32_t>(a.N),
                       static_cast<uint32_t>(node), static_cast<uint32_t>(slot));
  };
  while (true) {
    Residual r;
    if (!prepare_node(a, b, node, ws, r, bad)) return false;
    const int32_t child = run_layer(a, t, node, r, ws.order.get(a.N),
                                    [&](int64_t j, int32_t, double num, double den, bool forced) {
                                      return forced || coin(j) * den < num;
                                    });
    if (child < 0) {  // every child rejected, or a leaf (r = p): emit from r and stop
      a.accept_len[b] = len;
      a.bonus_token[b] = draw_from(r, coin(kResidualSlot));
      return true;
    }
    path[len++] = child;
    node = child;
  }
}

template <typename Acc>
bool law_tree(const VerificationArgs& a, int64_t b, Workspace& ws, BadLogit* bad) {
  const TreeView t = tree_of(a, b);
  Acc* accept = static_cast<Acc*>(a.accept_prob) + b * a.N;
  std::fill(accept, accept + a.N, Acc(0));
  accept[0] = Acc(1);
  for (int64_t node = 0; node < a.N; ++node) {
    Residual r;
    if (!prepare_node(a, b, node, ws, r, bad)) return false;
    double reach = 1.0;  // P(all tests so far rejected | node visited)
    const int32_t stop = run_layer(a, t, node, r, ws.order.get(a.N),
                                   [&](int64_t, int32_t child, double num, double den, bool forced) {
                                     const double acc =
                                         forced ? 1.0 : std::min(1.0, std::max(0.0, num / den));
                                     accept[child] = static_cast<Acc>(reach * acc);
                                     reach *= 1.0 - acc;
                                     return reach == 0.0;  // nothing left to reject into
                                   });
    Acc* emit = static_cast<Acc*>(a.emit_prob) + (b * a.N + node) * a.V;
    double total = 0.0;
    for (int64_t v = 0; v < a.V; ++v) total += r.w[v];
    for (int64_t v = 0; v < a.V; ++v)
      emit[v] = stop >= 0 ? Acc(0) : static_cast<Acc>(reach * (r.w[v] / total));
  }
  return true;
}

// Runs fn(b, ws, bad) over the trees in parallel; raises the first bad logit after the region.
template <typename Fn>
void for_each_tree(const VerificationArgs& a, Fn fn) {
  std::vector<BadLogit> bad(a.B);
  std::vector<char> failed(a.B, 0);
#pragma omp parallel if (a.B > 1)
  {
    Workspace& ws = workspace();
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < a.B; ++b) failed[b] = !fn(b, ws, &bad[b]);
  }
  for (int64_t b = 0; b < a.B; ++b)
    RHEO_CHECK(!failed[b], "logits[", b, ", ", bad[b].node, ", ", bad[b].token, "] = ",
               bad[b].value, " at visited node ", bad[b].node, ": target logits must be finite "
               "at every visited node; check the target model output (masked tokens must be "
               "large negative numbers, not -inf)");
}

}  // namespace

Workspace& workspace() {
  thread_local Workspace ws;
  return ws;
}

}  // namespace verification_detail

using verification_detail::BadLogit;
using verification_detail::for_each_tree;
using verification_detail::law_tree;
using verification_detail::walk_tree;
using verification_detail::Workspace;

void verification_cpu(const VerificationArgs& args) {
  verification_check_args(args);
  RHEO_CHECK(args.accept_path && args.accept_len && args.bonus_token,
             "verification_cpu needs accept_path, accept_len and bonus_token outputs");
  for_each_tree(args, [&](int64_t b, Workspace& ws, BadLogit* bad) {
    return walk_tree(args, b, ws, bad);
  });
}

void verification_law_cpu(const VerificationArgs& args) {
  verification_check_args(args);
  RHEO_CHECK(args.accept_prob && args.emit_prob,
             "verification_law_cpu needs accept_prob and emit_prob outputs");
  const bool f64 = args.dtype == DType::kFloat64;
  for_each_tree(args, [&](int64_t b, Workspace& ws, BadLogit* bad) {
    return f64 ? law_tree<double>(args, b, ws, bad) : law_tree<float>(args, b, ws, bad);
  });
}

}  // namespace rheo
