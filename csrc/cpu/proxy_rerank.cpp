// Proxy rerank and tree build on the CPU (docs/algorithm.md §5): one batch entry at a time, OpenMP
// over the batch. Both entry points rank candidates with rheo::ranks_before (score desc, then
// flat index asc), the one tie rule shared with the CUDA kernel and the draft.
#include "rheo/proxy_rerank.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <numeric>
#include <string>
#include <vector>

namespace rheo {
namespace {

// Flat indices of the best `count` of scores[0, n), best first by the tie rule.
std::vector<int32_t> best_first(const float* scores, int64_t n, int64_t count) {
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  const auto better = [scores](int32_t a, int32_t b) {
    return ranks_before(scores[a], a, scores[b], b);
  };
  std::partial_sort(order.begin(), order.begin() + count, order.end(), better);
  order.resize(static_cast<size_t>(count));
  return order;
}

// NaN has no place in the order (ranks_before would not be a strict weak order).
void check_no_nan(const float* scores, int64_t n, const char* name, int64_t b) {
  for (int64_t c = 0; c < n; ++c)
    RHEO_CHECK(!std::isnan(scores[c]), name, "[", b, ", ", c, "] is NaN; scores must be sums of "
               "log proxies (finite or -inf); check the draft's log_proxy");
}

// Runs row(b) for every batch entry, OpenMP over b; never throws inside the parallel region:
// the first failing entry's message is raised afterwards.
template <typename Row>
void for_each_row(int64_t B, const Row& row) {
  std::vector<std::string> errors(static_cast<size_t>(B));
#pragma omp parallel for schedule(dynamic, 1) if (B > 1)
  for (int64_t b = 0; b < B; ++b) {
    try {
      row(b);
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(b)] = e.what();
    }
  }
  for (const std::string& e : errors)
    if (!e.empty()) throw ValueError(e);
}

// Parent candidate of every candidate of one entry must come earlier in flat order (levels are
// concatenated root-side first), which also makes the parent walk below terminate.
void check_parents(const int32_t* cand_parents, int64_t L, int64_t b) {
  for (int64_t c = 0; c < L; ++c) {
    const int32_t p = cand_parents[c];
    RHEO_CHECK(p >= -1 && p < c, "cand_parents[", b, ", ", c, "] = ", p, " must be -1 (level 1) "
               "or a flat index in [0, ", c, ") (a parent precedes its children in flat order); "
               "concatenate the levels root-side first");
  }
}

// Node index of each kept candidate's parent; the root is node 0. Raises unless the kept set is
// ancestor-closed and in topological order, which rank order guarantees when every log proxy is
// <= 0 (Lemma 5: a child's score <= its parent's, and a tie puts the shallower, lower flat index,
// first; paper app. C.1).
void link_parents(const BuildTreeArgs& a, int64_t b, const std::vector<int32_t>& kept,
                  int32_t* parents) {
  const int32_t* cand_parents = a.cand_parents + b * a.L;
  std::vector<int32_t> node_of(static_cast<size_t>(a.L), -1);  // candidate -> node, -1 = pruned
  for (size_t r = 0; r < kept.size(); ++r) node_of[kept[r]] = static_cast<int32_t>(r + 1);
  parents[0] = -1;
  for (int32_t i = 1; i < a.N; ++i) {
    const int32_t c = kept[i - 1], p = cand_parents[c];
    const int32_t parent = p < 0 ? 0 : node_of[p];
    RHEO_CHECK(parent >= 0, "tree not ancestor-closed: candidate ", c, " kept but its parent ", p,
               " was pruned (batch entry ", b, "); scores must be sums of log proxies <= 0");
    RHEO_CHECK(parent < i, "tree not topological: candidate ", c, " (node ", i, ") ranks "
               "before its parent ", p, " (node ", parent, ", batch entry ", b, "); scores must "
               "be sums of log proxies <= 0, so that a child never outscores its parent");
    parents[i] = parent;
  }
}

// Per-node fields, ancestor mask and root-to-leaf paths of one entry from its parent links.
void lay_out(const BuildTreeArgs& a, int64_t b, const std::vector<int32_t>& kept) {
  const int64_t N = a.N, W = a.max_depth + 1;  // W: columns of retrieve_indices
  int32_t* parents = a.parents + b * N;
  int32_t* depth = a.depth + b * N;
  uint8_t* mask = a.tree_mask + b * N * N;
  int32_t* paths = a.retrieve_indices + b * N * W;
  // Node 0 is the root: the last emitted token, no candidate, no q~ row.
  a.tokens[b * N] = a.root_tokens[b];
  a.sampled_row[b * N] = -1;
  a.cand_index[b * N] = -1;
  depth[0] = 0;
  for (int64_t i = 1; i < N; ++i) {
    const int32_t c = kept[i - 1];
    depth[i] = depth[parents[i]] + 1;
    RHEO_CHECK(depth[i] <= a.max_depth, "candidate ", c, " of batch entry ", b, " is at depth ",
               depth[i], " > depth=", a.max_depth, " (retrieve_indices has depth + 1 columns); "
               "pass the number of levels drafted");
    a.tokens[b * N + i] = a.cand_tokens[b * a.L + c];
    a.sampled_row[b * N + i] = a.cand_sampled[b * a.L + c];
    a.cand_index[b * N + i] = c;
  }
  for (int64_t i = 0; i < N; ++i) a.positions[b * N + i] = a.prefix_len[b] + depth[i];
  // Mask row i = row of its parent plus itself (parents precede children).
  std::memset(mask, 0, static_cast<size_t>(N * N));
  for (int64_t i = 0; i < N; ++i) {
    if (parents[i] >= 0) std::memcpy(mask + i * N, mask + parents[i] * N, static_cast<size_t>(i));
    mask[i * N + i] = 1;
  }
  // Leaves (nodes with no children) in node order; each row is its root-to-leaf path.
  std::vector<uint8_t> has_child(static_cast<size_t>(N), 0);
  for (int64_t i = 1; i < N; ++i) has_child[parents[i]] = 1;
  std::fill(paths, paths + N * W, -1);
  int32_t leaves = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (has_child[i]) continue;
    int32_t* row = paths + leaves++ * W;
    for (int32_t node = static_cast<int32_t>(i), d = depth[i]; node >= 0; node = parents[node])
      row[d--] = node;
  }
  a.n_leaves[b] = leaves;
}

}  // namespace

void select_expand_cpu(const SelectExpandArgs& args) {
  RHEO_CHECK(args.topk >= 1 && args.topk <= args.M, "topk=", args.topk, " must be in [1, M=",
             args.M, "] (candidates at this level); lower topk");
  for_each_row(args.B, [&](int64_t b) {
    const float* scores = args.scores + b * args.M;
    check_no_nan(scores, args.M, "scores", b);
    // Best topk first; position j is the parent rank of the j-th expanded node next level.
    const std::vector<int32_t> best = best_first(scores, args.M, args.topk);
    std::copy(best.begin(), best.end(), args.expand + b * args.topk);
  });
}

void build_tree_cpu(const BuildTreeArgs& args) {
  RHEO_CHECK(args.N >= 1 && args.N - 1 <= args.L, "total_tokens=", args.N,
             " must be in [1, L + 1 = ", args.L + 1,
             "] (candidates drafted plus the root); lower total_tokens or draft more");
  RHEO_CHECK(args.max_depth >= 0, "depth=", args.max_depth, " must be >= 0");
  for_each_row(args.B, [&](int64_t b) {
    // 1. Inputs: no NaN score, parents earlier in flat order, a non-negative prefix.
    check_no_nan(args.cand_scores + b * args.L, args.L, "cand_scores", b);
    check_parents(args.cand_parents + b * args.L, args.L, b);
    RHEO_CHECK(args.prefix_len[b] >= 0, "prefix_len[", b, "] = ", args.prefix_len[b],
               " must be >= 0 (tokens already in the KV cache)");
    // 2. Global pruning: the N-1 best candidates of the whole unpruned tree, in rank order.
    const std::vector<int32_t> kept = best_first(args.cand_scores + b * args.L, args.L, args.N - 1);
    // 3. Parent links, checked ancestor-closed and topological; then the layout.
    link_parents(args, b, kept, args.parents + b * args.N);
    lay_out(args, b, kept);
  });
}

}  // namespace rheo
