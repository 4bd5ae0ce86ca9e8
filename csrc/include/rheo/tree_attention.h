// Tree attention over a cached prefix plus T tree rows (docs/algorithm.md §2, step 2), for a
// batch of B sequences, each with its own prefix length and its own slot of a KV pool.
//
// q   [B, N, H, D]          queries of N tree nodes (strided: q_stride_b/n/h, last dim dense)
// k,v [S, Lc, Hkv, D]       the KV cache (strided, last dim dense); S = B and slot b = sequence b
//                           unless kv_slots is given. In the slot of sequence b, rows
//                           0..P_b-1 hold its prefix and rows P_b..P_b+T-1 its tree rows, with
//                           P_b = prefix_lens[b], or prefix_len for every b when prefix_lens is null
// tree_mask [B, N, T] uint8 1 = node i may attend to tree row j; column c is cache row P_b + c.
//                           T = N (args.T < 0) for a target's tree, whose rows are its nodes
//                           (each sees itself and its ancestors); a draft head's level has more
//                           rows than queries (its earlier levels' nodes, then its own)
// out [B, N, H, D]          contiguous, same dtype as q
// Node i of sequence b attends to rows 0..P_b-1 and to the tree rows P_b + j with
// tree_mask[b, i, j] = 1; no other row of the slot is read. Query head h reads KV head
// h / (H / Hkv) (GQA; H % Hkv == 0). Softmax in float32 with scale `scale` (usually 1/sqrt(D));
// accumulation in float32 for every dtype.
// A node that sees no row (P_b = 0 and an all-zero mask row) gets a zero output.
// Rules: prefix_len + T <= Lc, H % Hkv == 0, D >= 1, dtypes of q, k, v equal;
//   prefix_lens (null or [B]): 0 <= prefix_lens[b] <= prefix_len. prefix_len is then the host-side
//     bound (usually the max): the CUDA split plan and workspace are sized from it alone, so the
//     arrays can stay on the device and change between calls without a sync;
//   kv_slots (null or [B]): 0 <= kv_slots[b] < S (the slots need not be distinct or in order).
// Both arrays are host memory for tree_attention_cpu, which checks every value (RHEO_CHECK), and
// device memory for tree_attention_cuda, which cannot check them without a sync: there a value
// out of range is clamped into range (no read outside the cache) and the result is meaningless.
// Row invariance: on the CPU a node's output is bit for bit the one its token gets decoded alone
// (N = T = 1 after a prefix of P_b + its visible tree rows, copied in order): the float32 sums
// follow the rows a node sees, whichever other tree rows lie between them in the slot, so greedy
// speculative decoding equals greedy decoding. CUDA keeps the float32 tolerance only.
// Batch invariance: on the CPU a sequence's output does not depend on the other sequences, B or
// prefix_len (bit for bit the same as running it alone with prefix_len = P_b); on CUDA the split
// plan depends on B and prefix_len, so only the float32 tolerance holds across batches.
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
  const uint8_t* tree_mask = nullptr;  // [B, N, T]
  void* out = nullptr;                 // [B, N, H, D]
  DType dtype = DType::kFloat32;       // kFloat32, kFloat16 or kBFloat16
  int64_t B = 0, N = 0, H = 0, Hkv = 0, D = 0;
  int64_t T = -1;                         // tree rows (tree_mask's last dim); < 0: T = N
  int64_t prefix_len = 0;                 // P_b for all b, or the bound of prefix_lens
  const int32_t* prefix_lens = nullptr;   // [B] P_b of each sequence; null: prefix_len for all
  const int32_t* kv_slots = nullptr;      // [B] slot of k/v holding sequence b; null: slot b
  int64_t S = 0;                          // slots of k/v (their first dim); used with kv_slots
  int64_t q_stride_b = 0, q_stride_n = 0, q_stride_h = 0;    // elements
  int64_t kv_stride_b = 0, kv_stride_l = 0, kv_stride_h = 0;  // elements, shared by k and v;
                                                              // kv_stride_b steps one slot
  float scale = 1.0f;
  // tree_attention_cuda only: float32 scratch for the split-KV partials, of
  // tree_attention_workspace_floats(args) floats on the device (null when that is 0). The binding
  // allocates it through torch's caching allocator; the CPU kernel ignores it.
  float* workspace = nullptr;
};

// The tree rows of args: T, or N where T < 0.
RHEO_HOST_DEVICE int64_t tree_rows(const TreeAttentionArgs& args) { return args.T < 0 ? args.N : args.T; }

void tree_attention_cpu(const TreeAttentionArgs& args);
// The CPU kernel's softmax exponentials at the active dispatch level, 8 at a time (AVX2 + FMA or
// AVX-512; std::exp's bits, csrc/cpu/tree_attention.cpp), against std::exp over the float bit
// patterns first, first + stride, ... <= last: the values that differ, or -1 where the level
// runs std::exp itself (the baseline level, no FMA, or a C library its first-use check refused).
int64_t tree_attention_exp_mismatches(int64_t first, int64_t last, int64_t stride);
#ifdef RHEO_WITH_CUDA
// Floats of args.workspace that tree_attention_cuda needs for these sizes (0: none, the keys are
// not split). Depends on B, N, T, H, Hkv, D and prefix_len only (not on prefix_lens or kv_slots, which
// live on the device); checks them like the kernel.
size_t tree_attention_workspace_floats(const TreeAttentionArgs& args);
cudaError_t tree_attention_cuda(const TreeAttentionArgs& args, cudaStream_t stream);
#endif

}  // namespace rheo
