// Standalone microbenchmark of pool_sampler_cpu (no torch): random logits [n, V], median time of
// `reps` calls, µs per call and the logits bandwidth reached (bytes read once / time).
//   bench_pool_sampler [n] [V] [reps]      defaults: 60 128256 20
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "rheo/pool_sampler.h"

namespace {

double median_us(const rheo::PoolSamplerArgs& args, int reps) {
  std::vector<double> times;
  rheo::pool_sampler_cpu(args);  // warm-up
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    rheo::pool_sampler_cpu(args);
    const auto t1 = std::chrono::steady_clock::now();
    times.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 60;
  const int64_t V = argc > 2 ? std::atoll(argv[2]) : 128256;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 20;
  const int32_t K = 10, m = 1, S = 128;
  const int64_t Se = std::min<int64_t>(S, V);
  std::vector<float> logits(n * V);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& x : logits) x = normal(rng);
  std::vector<int32_t> tokens(n * K), sampled_slot(n), ids(n * Se);
  std::vector<float> log_proxy(n * K), q_tilde(n * Se), q_sampled(n);

  rheo::PoolSamplerArgs args;
  args.logits = logits.data();
  args.dtype = rheo::DType::kFloat32;
  args.n = n;
  args.V = V;
  args.row_stride = V;
  args.K = K;
  args.m = m;
  args.S = S;
  args.T = 1.0;
  args.tokens = tokens.data();
  args.log_proxy = log_proxy.data();
  args.sampled_slot = sampled_slot.data();
  args.q_tilde_ids = ids.data();
  args.q_tilde = q_tilde.data();
  args.q_sampled = q_sampled.data();
  for (const auto kind : {rheo::PoolKind::kTopK, rheo::PoolKind::kRheo}) {
    args.kind = kind;
    const double us = median_us(args, reps);
    const double gbps = static_cast<double>(n * V * sizeof(float)) / (us * 1e-6) / 1e9;
    std::printf("pool_sampler_cpu kind=%s n=%lld V=%lld K=%d m=%d S=%d fp32: %.1f us/call, "
                "%.2f GB/s\n",
                kind == rheo::PoolKind::kTopK ? "topk" : "rheo", static_cast<long long>(n),
                static_cast<long long>(V), K, m, S, us, gbps);
  }
  return 0;
}
