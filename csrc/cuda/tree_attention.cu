// Tree attention on CUDA. Work mapping: one block of kThreads (4 warps) per query row
// (node n, head h, batch entry b) = grid (N, H, B). Why: the tree is small (N ~ 60) and the
// prefix is read from L2 by the H / Hkv heads of a group, so one simple row per block already
// gives B * N * H blocks (thousands) to fill the GPU, with no cross-block reduction.
// Inside a block, warp w takes cache rows j = w, w + 4, ...: its 32 lanes split the D elements
// (d = lane, lane + 32, ...), reduce the dot product with shuffles, and keep an online softmax
// (running max, sum, and a float32 accumulator over D in shared memory, each lane owning its d's).
// At the end the 4 warps' partial softmaxes are merged. Same math as the CPU kernel: float32
// scores, softmax and V sum for every dtype; masked pairs get weight 0; a node that sees no row
// gets zeros. Faster designs (all G heads of a KV head and a tile of nodes per block, tensor
// cores, split-KV for long prefixes, as in flashinfer) would cut the L2 traffic by G.

#include <cmath>
#include <cstdint>

#include "device_utils.cuh"
#include "rheo/tree_attention.h"

namespace rheo {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxHeadDim = 2048;  // shared memory: (kWarps + 1) * D floats <= 40 KiB

using cuda::from_float;
using cuda::to_float;
using cuda::warp_sum;

// One warp's online softmax over its rows: returns its running max and sum; acc [D] (shared,
// this warp's slice) holds sum_j exp(s_j - max) * v_j.
template <typename T>
__device__ void attend_rows(const TreeAttentionArgs& a, const float* q, float* acc,
                            float* run_max, float* run_sum) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t n = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t kvh = h / (a.H / a.Hkv);
  const uint8_t* mask_row = a.tree_mask + (b * a.N + n) * a.N;
  const T* k = static_cast<const T*>(a.k) + b * a.kv_stride_b + kvh * a.kv_stride_h;
  const T* v = static_cast<const T*>(a.v) + b * a.kv_stride_b + kvh * a.kv_stride_h;
  float m = -INFINITY, sum = 0.0f;
  for (int64_t j = warp; j < a.prefix_len + a.N; j += kWarps) {
    // Every prefix row is visible; tree row prefix_len + c only where tree_mask[b, n, c] = 1.
    if (j >= a.prefix_len && mask_row[j - a.prefix_len] == 0) continue;  // warp-uniform
    const T* k_row = k + j * a.kv_stride_l;
    float dot = 0.0f;
    for (int64_t d = lane; d < a.D; d += 32) dot += q[d] * to_float(k_row[d]);
    const float s = warp_sum(dot) * a.scale;
    // Online softmax: rescale what was summed under the old max by exp(old - new).
    const float new_max = fmaxf(m, s);
    const float correction = expf(m - new_max);  // exp(-inf) = 0 on the first visible row
    const float w = expf(s - new_max);
    sum = sum * correction + w;
    m = new_max;
    const T* v_row = v + j * a.kv_stride_l;
    for (int64_t d = lane; d < a.D; d += 32) acc[d] = acc[d] * correction + w * to_float(v_row[d]);
  }
  *run_max = m;
  *run_sum = sum;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) tree_attention_kernel(TreeAttentionArgs a) {
  RHEO_DYNAMIC_SHARED(float, smem);
  float* q = smem;                     // [D]          the query row, float32
  float* acc = smem + a.D;             // [kWarps, D]  each warp's V accumulator
  __shared__ float warp_max[kWarps], warp_sum_exp[kWarps];
  const int64_t n = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const T* q_row =
      static_cast<const T*>(a.q) + b * a.q_stride_b + n * a.q_stride_n + h * a.q_stride_h;
  for (int64_t d = threadIdx.x; d < a.D; d += kThreads) q[d] = to_float(q_row[d]);
  for (int64_t i = threadIdx.x; i < kWarps * a.D; i += kThreads) acc[i] = 0.0f;
  __syncthreads();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float m, sum;
  attend_rows<T>(a, q, acc + warp * a.D, &m, &sum);
  if (lane == 0) {
    warp_max[warp] = m;
    warp_sum_exp[warp] = sum;
  }
  __syncthreads();

  // Merge the warps: scale each partial by exp(max_w - max), then out = acc / sum.
  float block_max = -INFINITY;
  for (int w = 0; w < kWarps; ++w) block_max = fmaxf(block_max, warp_max[w]);
  float total = 0.0f, factor[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    factor[w] = warp_max[w] == -INFINITY ? 0.0f : expf(warp_max[w] - block_max);
    total += warp_sum_exp[w] * factor[w];
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;  // a node that sees nothing: zeros
  T* out = static_cast<T*>(a.out) + ((b * a.N + n) * a.H + h) * a.D;
  for (int64_t d = threadIdx.x; d < a.D; d += kThreads) {
    float o = 0.0f;
    for (int w = 0; w < kWarps; ++w) o += acc[w * a.D + d] * factor[w];
    out[d] = from_float<T>(o * inv);
  }
}

template <typename T>
cudaError_t launch(const TreeAttentionArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(args.N), static_cast<unsigned>(args.H),
                  static_cast<unsigned>(args.B));
  const size_t smem = static_cast<size_t>(kWarps + 1) * args.D * sizeof(float);
  tree_attention_kernel<T> RHEO_LAUNCH(grid, kThreads, smem, stream)(args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t tree_attention_cuda(const TreeAttentionArgs& args, cudaStream_t stream) {
  RHEO_CHECK(args.D >= 1 && args.D <= kMaxHeadDim, "tree_attention on CUDA needs 1 <= D <= ",
             kMaxHeadDim, " (shared memory), got D=", args.D, "; run it on the CPU");
  RHEO_CHECK(args.H >= 1 && args.Hkv >= 1 && args.H % args.Hkv == 0, "H=", args.H,
             " heads is not a multiple of Hkv=", args.Hkv, " KV heads (GQA needs H % Hkv == 0)");
  RHEO_CHECK(args.H <= 65535 && args.B <= 65535, "tree_attention on CUDA needs H, B <= 65535 ",
             "(grid limit), got H=", args.H, ", B=", args.B, "; split the batch");
  if (args.B == 0 || args.N == 0) return cudaSuccess;
  switch (args.dtype) {
    case DType::kFloat32: return launch<float>(args, stream);
    case DType::kFloat16: return launch<__half>(args, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace rheo
