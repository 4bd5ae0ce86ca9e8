// Standalone microbenchmark of the torch-free CPU tree attention kernel: random inputs, median
// of reps with std::chrono, µs per call and GB/s of K/V read.
// Built by CMake as the executable bench_tree_attention.
//   usage: bench_tree_attention [reps]
#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "rheo/tree_attention.h"

namespace {

constexpr int64_t kB = 1, kN = 60, kH = 32, kHkv = 8, kD = 128;

uint16_t to_bf16(float f) {  // truncation is fine for random inputs
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>(u >> 16);
}

// [B, N, N] ancestor mask of the tree whose node i has parent (i - 1) / 3.
std::vector<uint8_t> tree_mask() {
  std::vector<uint8_t> mask(kB * kN * kN, 0);
  for (int64_t i = 0; i < kN; ++i) {
    mask[i * kN + i] = 1;
    if (i > 0)
      for (int64_t j = 0; j < kN; ++j) mask[i * kN + j] |= mask[(i - 1) / 3 * kN + j];
  }
  return mask;
}

double run_case(int64_t prefix_len, rheo::DType dtype, int reps) {
  const int64_t L = prefix_len + kN;
  const size_t elem = dtype == rheo::DType::kFloat32 ? 4 : 2;
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  auto fill = [&](std::vector<uint8_t>& buf, int64_t count) {
    buf.resize(count * elem);
    for (int64_t i = 0; i < count; ++i) {
      const float x = normal(rng);
      if (elem == 4) std::memcpy(buf.data() + 4 * i, &x, 4);
      else { const uint16_t b = to_bf16(x); std::memcpy(buf.data() + 2 * i, &b, 2); }
    }
  };
  std::vector<uint8_t> q, k, v, out(kB * kN * kH * kD * elem);
  fill(q, kB * kN * kH * kD);
  fill(k, kB * L * kHkv * kD);
  fill(v, kB * L * kHkv * kD);
  const std::vector<uint8_t> mask = tree_mask();
  rheo::TreeAttentionArgs args;
  args.q = q.data(); args.k = k.data(); args.v = v.data();
  args.tree_mask = mask.data(); args.out = out.data(); args.dtype = dtype;
  args.B = kB; args.N = kN; args.H = kH; args.Hkv = kHkv; args.D = kD; args.prefix_len = prefix_len;
  args.q_stride_h = kD; args.q_stride_n = kH * kD; args.q_stride_b = kN * kH * kD;
  args.kv_stride_h = kD; args.kv_stride_l = kHkv * kD; args.kv_stride_b = L * kHkv * kD;
  args.scale = 1.0f / std::sqrt(static_cast<float>(kD));
  rheo::tree_attention_cpu(args);  // warm-up
  std::vector<double> us;
  for (int rep = 0; rep < reps; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    rheo::tree_attention_cpu(args);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
                     .count());
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 20;
  std::printf("# tree_attention_cpu: B=%lld N=%lld H=%lld Hkv=%lld D=%lld, median of %d reps\n",
              static_cast<long long>(kB), static_cast<long long>(kN), static_cast<long long>(kH),
              static_cast<long long>(kHkv), static_cast<long long>(kD), reps);
  std::printf("dtype,prefix_len,us_per_call,kv_GB_per_s\n");
  for (const rheo::DType dtype : {rheo::DType::kFloat32, rheo::DType::kBFloat16}) {
    for (const int64_t prefix_len : {128, 1024, 4096}) {
      const double us = run_case(prefix_len, dtype, reps);
      const double elem = dtype == rheo::DType::kFloat32 ? 4.0 : 2.0;
      const double bytes = 2.0 * kB * (prefix_len + kN) * kHkv * kD * elem;
      std::printf("%s,%lld,%.1f,%.2f\n", dtype == rheo::DType::kFloat32 ? "float32" : "bfloat16",
                  static_cast<long long>(prefix_len), us, bytes / (us * 1e-6) / 1e9);
    }
  }
  return 0;
}
