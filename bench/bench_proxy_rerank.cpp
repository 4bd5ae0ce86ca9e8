// Microbenchmark of the CPU proxy rerank kernels (no torch): select_expand on [B, topk * K] and
// build_tree on a draft of topk = K = 10, depth 8 (L = 10 + 7 * 100 = 710), N = 60.
// Candidates are grown like a real draft: each level expands the topk best of the previous one,
// K children each, log proxies <= 0 (a third from a small set so that scores tie exactly).
// Prints µs per call (median of reps) and the bytes moved per µs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "rheo/proxy_rerank.h"

namespace {

struct Draft {
  int64_t B = 0, L = 0;
  std::vector<float> scores;          // [B, L]
  std::vector<int32_t> tokens;        // [B, L]
  std::vector<int32_t> parents;       // [B, L] entry-local flat index, -1 at level 1
  std::vector<int32_t> sampled;       // [B, L]
  std::vector<int32_t> root, prefix;  // [B]
};

// The flat candidate lists of one batch entry, level by level.
void grow_entry(int topk, int K, int depth, std::mt19937& rng, Draft& d) {
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  const float ties[] = {0.f, std::log(0.5f), std::log(0.25f), -INFINITY};
  std::vector<int32_t> level = {-1};  // flat indices of the nodes to expand (-1 = root)
  for (int lev = 1; lev <= depth; ++lev) {
    const int64_t begin = static_cast<int64_t>(d.scores.size());
    for (int32_t parent : level) {
      const float base = parent < 0 ? 0.f : d.scores[parent];
      for (int slot = 0; slot < K; ++slot) {
        const float lp = unit(rng) < 0.33f ? ties[rng() % 4] : -4.f * unit(rng);
        d.scores.push_back(base + lp);
        d.parents.push_back(parent);
        d.tokens.push_back(static_cast<int32_t>(rng() % 32000));
        d.sampled.push_back(unit(rng) < 0.1f ? static_cast<int32_t>(d.sampled.size()) : -1);
      }
    }
    // Next level expands the topk best of this one (ranks_before order).
    std::vector<int32_t> order(d.scores.size() - begin);
    std::iota(order.begin(), order.end(), static_cast<int32_t>(begin));
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return rheo::ranks_before(d.scores[a], a, d.scores[b], b);
    });
    order.resize(std::min<size_t>(order.size(), topk));
    level = order;
  }
}

// Entries are grown one after another into one buffer; parents are made entry-local.
Draft make_draft(int64_t B, int topk, int K, int depth, unsigned seed) {
  std::mt19937 rng(seed);
  Draft d;
  d.B = B;
  for (int64_t b = 0; b < B; ++b) {
    Draft one;
    grow_entry(topk, K, depth, rng, one);
    d.L = static_cast<int64_t>(one.scores.size());
    d.scores.insert(d.scores.end(), one.scores.begin(), one.scores.end());
    d.tokens.insert(d.tokens.end(), one.tokens.begin(), one.tokens.end());
    d.parents.insert(d.parents.end(), one.parents.begin(), one.parents.end());
    d.sampled.insert(d.sampled.end(), one.sampled.begin(), one.sampled.end());
    d.root.push_back(static_cast<int32_t>(rng() % 32000));
    d.prefix.push_back(static_cast<int32_t>(rng() % 500));
  }
  return d;
}

template <typename Fn>
double median_us(Fn fn, int reps) {
  for (int i = 0; i < 10; ++i) fn();
  std::vector<double> t(reps);
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    t[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[reps / 2];
}

void bench(int64_t B, int reps) {
  const int topk = 10, K = 10, depth = 8, N = 60, W = depth + 1;
  Draft d = make_draft(B, topk, K, depth, 1234u + static_cast<unsigned>(B));
  const int64_t M = topk * K;
  // select_expand on the last level's scores.
  std::vector<float> last(B * M);
  for (int64_t b = 0; b < B; ++b)
    std::copy_n(d.scores.begin() + b * d.L + d.L - M, M, last.begin() + b * M);
  std::vector<int32_t> expand(B * topk);
  rheo::SelectExpandArgs se;
  se.scores = last.data();
  se.B = B;
  se.M = M;
  se.topk = topk;
  se.expand = expand.data();
  double us = median_us([&] { rheo::select_expand_cpu(se); }, reps);
  double bytes = static_cast<double>(B) * (M * 4 + topk * 4);
  std::printf("select_expand B=%lld M=%lld topk=%d: %.2f us/call, %.3f GB/s\n",
              static_cast<long long>(B), static_cast<long long>(M), topk, us, bytes / us / 1e3);
  // build_tree on the whole draft.
  std::vector<int32_t> tok(B * N), par(B * N), dep(B * N), pos(B * N), srow(B * N), cidx(B * N);
  std::vector<uint8_t> mask(B * N * N);
  std::vector<int32_t> paths(B * N * W), leaves(B);
  rheo::BuildTreeArgs bt;
  bt.cand_scores = d.scores.data();
  bt.cand_tokens = d.tokens.data();
  bt.cand_parents = d.parents.data();
  bt.cand_sampled = d.sampled.data();
  bt.root_tokens = d.root.data();
  bt.prefix_len = d.prefix.data();
  bt.B = B;
  bt.L = d.L;
  bt.N = N;
  bt.max_depth = depth;
  bt.tokens = tok.data();
  bt.parents = par.data();
  bt.depth = dep.data();
  bt.positions = pos.data();
  bt.sampled_row = srow.data();
  bt.cand_index = cidx.data();
  bt.tree_mask = mask.data();
  bt.retrieve_indices = paths.data();
  bt.n_leaves = leaves.data();
  us = median_us([&] { rheo::build_tree_cpu(bt); }, reps);
  bytes = static_cast<double>(B) * (d.L * 16 + 8 + N * 24 + N * N + N * W * 4 + 4);
  std::printf("build_tree B=%lld L=%lld N=%d depth=%d: %.2f us/call, %.3f GB/s (n_leaves[0]=%d)\n",
              static_cast<long long>(B), static_cast<long long>(d.L), N, depth, us,
              bytes / us / 1e3, leaves[0]);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 500;
  for (int64_t B : {1, 8}) bench(B, reps);
  return 0;
}
