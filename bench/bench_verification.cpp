// Microbenchmark of verification_cpu (torch-free): one realistic tree of N = 60 nodes, depth 8,
// fp32 logits [60, V], tokens chosen so the walk accepts a few levels. Prints the median
// microseconds per call over seeds and the bandwidth over the visited rows.
// Build: g++ -std=c++17 -O3 -fopenmp -Icsrc/include bench/bench_verification.cpp
//        csrc/cpu/verification.cpp -o bench_verification
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "rheo/verification.h"

namespace {

// A tree in build_tree layout: level sizes 1, 4, 8, ..., each node's first child carries the
// boosted (likely) token of its parent, its second child is the sampled child Y.
struct Bench {
  int64_t N = 60, V, Se = 128;
  std::vector<float> logits;
  std::vector<int32_t> tokens, parents, sampled, ids;
  std::vector<float> q;
};

Bench make_tree(int64_t V, float boost) {
  Bench t;
  t.V = V;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(V - 1));
  t.logits.resize(t.N * V);
  std::vector<int32_t> likely(t.N);
  for (int64_t i = 0; i < t.N; ++i) {
    for (int64_t v = 0; v < V; ++v) t.logits[i * V + v] = normal(rng);
    likely[i] = token(rng);
    t.logits[i * V + likely[i]] += boost;
  }
  const int sizes[] = {1, 4, 8, 8, 8, 8, 8, 8, 7};
  t.tokens.assign(t.N, 0);
  t.parents.assign(t.N, -1);
  t.sampled.assign(t.N, -1);
  int64_t level_start = 0, j = 1;
  for (int d = 1; d < 9; ++d) {
    const int64_t prev = level_start, prev_n = sizes[d - 1];
    level_start = j;
    int64_t slot = 0;  // position among the parent's children
    for (int s = 0; s < sizes[d]; ++s, ++j) {
      const int64_t par = prev + std::min<int64_t>(s / 2, prev_n - 1);
      slot = (s > 0 && t.parents[j - 1] == par) ? slot + 1 : 0;
      t.parents[j] = static_cast<int32_t>(par);
      t.tokens[j] = slot == 0 ? likely[par] : token(rng);
      if (slot != 1) continue;
      t.sampled[j] = static_cast<int32_t>(t.ids.size() / t.Se);  // Y: support = lead, Y, rest
      for (int64_t k = 0; k < t.Se; ++k) {
        t.ids.push_back(k == 0 ? t.tokens[j - 1] : k == 1 ? t.tokens[j] : token(rng));
        t.q.push_back(k == 0 ? 0.0f : 1.0f / static_cast<float>(t.Se - 1));
      }
    }
  }
  return t;
}

double median_us(const rheo::VerificationArgs& base, int reps) {
  std::vector<double> us;
  rheo::VerificationArgs a = base;
  for (int r = 0; r < reps; ++r) {
    a.step = static_cast<uint64_t>(r);
    const auto t0 = std::chrono::steady_clock::now();
    rheo::verification_cpu(a);
    const auto t1 = std::chrono::steady_clock::now();
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main() {
  std::printf("kernel,method,N,V,us_per_call,mean_accept_len,GB_per_s_visited_rows\n");
  for (const int64_t V : {32000, 128256}) {
    Bench t = make_tree(V, V > 64000 ? 13.5f : 12.0f);
    int32_t path[9], len = 0, bonus = 0;
    rheo::VerificationArgs a;
    a.logits = t.logits.data();
    a.B = 1, a.N = t.N, a.V = V;
    a.tokens = t.tokens.data(), a.parents = t.parents.data(), a.sampled_row = t.sampled.data();
    a.q_tilde_ids = t.ids.data(), a.q_tilde = t.q.data();
    a.R = static_cast<int64_t>(t.ids.size()) / t.Se, a.Se = t.Se;
    a.accept_path = path, a.path_capacity = 9, a.accept_len = &len, a.bonus_token = &bonus;
    for (const auto method : {rheo::VerifyMethod::kTopK, rheo::VerifyMethod::kRheo}) {
      a.method = method;
      double total_len = 0;
      for (int r = 0; r < 50; ++r) {
        a.step = static_cast<uint64_t>(r);
        rheo::verification_cpu(a);
        total_len += len;
      }
      const double us = median_us(a, 50), mean_len = total_len / 50;
      const double bytes = mean_len * static_cast<double>(V) * sizeof(float);
      std::printf("verification_cpu,%s,%lld,%lld,%.1f,%.2f,%.2f\n",
                  method == rheo::VerifyMethod::kTopK ? "topk" : "rheo",
                  static_cast<long long>(t.N), static_cast<long long>(V), us, mean_len,
                  bytes / us * 1e-3);
    }
  }
  return 0;
}
