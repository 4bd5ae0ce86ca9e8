// Tree attention over a cached prefix plus N tree nodes (DESIGN.md §1 step 2).
//
// q   [B, N, H, D]          queries of the tree nodes (strided: q_stride_b/n/h, last dim dense)
// k,v [B, Lc, Hkv, D]       the KV cache; rows 0..prefix_len-1 hold the prefix, rows
//                           prefix_len..prefix_len+N-1 the tree nodes (strided, last dim dense)
// tree_mask [B, N, N] uint8 1 = node i may attend to node j (itself and its ancestors)
// out [B, N, H, D]          contiguous, same dtype as q
// Node i attends to every prefix row and to the tree rows j with tree_mask[b, i, j] = 1.
// Query head h reads KV head h / (H / Hkv) (GQA; H % Hkv == 0). Softmax in float32 with
// scale `scale` (usually 1/sqrt(D)); accumulation in float32 for every dtype.
// A node that sees no row (prefix_len = 0 and an all-zero mask row) gets a zero output.
// Rules: prefix_len + N <= Lc, H % Hkv == 0, D >= 1, dtypes of q, k, v equal.
#pragma once

#include <cstddef>
#include <cstdint>

#include "rheo/common.h"

#ifdef RHEO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace rheo {

struct TreeAttentionArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const uint8_t* tree_mask = nullptr;  // [B, N, N]
  void* out = nullptr;                 // [B, N, H, D]
  DType dtype = DType::kFloat32;       // kFloat32, kFloat16 or kBFloat16
  int64_t B = 0, N = 0, H = 0, Hkv = 0, D = 0;
  int64_t prefix_len = 0;
  int64_t q_stride_b = 0, q_stride_n = 0, q_stride_h = 0;    // elements
  int64_t kv_stride_b = 0, kv_stride_l = 0, kv_stride_h = 0;  // elements, shared by k and v
  float scale = 1.0f;
  // tree_attention_cuda only: float32 scratch for the split-KV partials, of
  // tree_attention_workspace_floats(args) floats on the device (null when that is 0). The binding
  // allocates it through torch's caching allocator; the CPU kernel ignores it.
  float* workspace = nullptr;
};

void tree_attention_cpu(const TreeAttentionArgs& args);
#ifdef RHEO_WITH_CUDA
// Floats of args.workspace that tree_attention_cuda needs for these sizes (0: none, the keys are
// not split). Depends on B, N, H, Hkv, D and prefix_len only; checks them like the kernel.
size_t tree_attention_workspace_floats(const TreeAttentionArgs& args);
cudaError_t tree_attention_cuda(const TreeAttentionArgs& args, cudaStream_t stream);
#endif

}  // namespace rheo
