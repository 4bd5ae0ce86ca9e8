// Proxy rerank and tree build (docs/algorithm.md §5). Two entry points:
//
// 1. select_expand: per draft level, which `topk` candidates to expand next.
//    scores [B, M] float32 (path scores of the level's candidates, in flat order) ->
//    expand   [B, topk] int32  indices into the M candidates, best first (ranks_before order);
//    position j of the output is the "parent rank" of that node for the next level.
//    Rule: topk <= M.
//
// 2. build_tree: after `depth` levels, keep the global top-(N-1) candidates and lay out the tree.
//    Candidates of all levels are concatenated in EAGLE's flat order (level 1 first; inside a
//    level, parent rank * K + slot), L of them per batch entry:
//      cand_scores  [B, L] float32  path score (sum of log proxies)
//      cand_tokens  [B, L] int32    token id
//      cand_parents [B, L] int32    flat index of the parent candidate, -1 for level 1 (root)
//      cand_sampled [B, L] int32    row of the candidate's sparse q~ table if it is a sampled
//                                   child, else -1 (passed through to the tree)
//      root_tokens  [B]    int32    the root (last emitted token)
//      prefix_len   [B]    int32    tokens already in the KV cache before the tree
//    Keeps the N-1 best by ranks_before (score desc, then flat index asc). Rule: N - 1 <= L.
//    Tree node 0 is the root; nodes 1..N-1 are the kept candidates IN RANK ORDER. Rank order is
//    topological (Lemma 5: a child's score <= its parent's, and a tie puts the shallower first)
//    and puts siblings in slot order, so parents precede children and verification can take
//    children in node order. build_tree_cpu raises if the kept set is not ancestor-closed or a
//    kept child ranks before its parent (neither happens when every proxy is <= 1, i.e. log
//    proxy <= 0; anything else is a caller bug), on a NaN score, on cand_parents[c] outside
//    [-1, c), on prefix_len < 0 and on a node deeper than max_depth. The CUDA kernels cannot
//    raise without a sync: such an entry gets n_leaves[b] = -1 and a safe layout (every node a
//    child of the root, in-range indices), select_expand_cuda writes expand[b, :] = 0..topk-1 for
//    a row holding a NaN (the CPU one raises), and both OR a bit into *status (common.h).
//    Outputs:
//      tokens           [B, N]          int32   node token (root_tokens at node 0)
//      parents          [B, N]          int32   parent node index, -1 for the root
//      depth            [B, N]          int32   0 for the root
//      positions        [B, N]          int32   prefix_len + depth
//      sampled_row      [B, N]          int32   cand_sampled of the node, -1 for the root
//      cand_index       [B, N]          int32   flat candidate index of the node, -1 for the root
//      tree_mask        [B, N, N]       uint8   1 where column is the row node or its ancestor
//      retrieve_indices [B, N, Dmax+1]  int32   root-to-leaf paths of node indices, one row per
//                                               leaf in node order, padded with -1; rows past
//                                               n_leaves are all -1. Dmax = the `depth` arg.
//      n_leaves         [B]             int32
#pragma once

#include <cstdint>

#include "rheo/common.h"

#ifdef RHEO_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace rheo {

struct SelectExpandArgs {
  const float* scores = nullptr;  // [B, M]
  int64_t B = 0;
  int64_t M = 0;
  int32_t topk = 0;
  int32_t* expand = nullptr;  // [B, topk]
  int32_t* status = nullptr;  // [1] or null: CUDA status bits (common.h StatusBit)
};

struct BuildTreeArgs {
  // inputs
  const float* cand_scores = nullptr;     // [B, L]
  const int32_t* cand_tokens = nullptr;   // [B, L]
  const int32_t* cand_parents = nullptr;  // [B, L]
  const int32_t* cand_sampled = nullptr;  // [B, L]
  const int32_t* root_tokens = nullptr;   // [B]
  const int32_t* prefix_len = nullptr;    // [B]
  int64_t B = 0;
  int64_t L = 0;
  int32_t N = 0;          // total_tokens, root included
  int32_t max_depth = 0;  // levels drafted; retrieve_indices has max_depth + 1 columns
  // outputs
  int32_t* tokens = nullptr;            // [B, N]
  int32_t* parents = nullptr;           // [B, N]
  int32_t* depth = nullptr;             // [B, N]
  int32_t* positions = nullptr;         // [B, N]
  int32_t* sampled_row = nullptr;       // [B, N]
  int32_t* cand_index = nullptr;        // [B, N]
  uint8_t* tree_mask = nullptr;         // [B, N, N]
  int32_t* retrieve_indices = nullptr;  // [B, N, max_depth + 1]
  int32_t* n_leaves = nullptr;          // [B]
  int32_t* status = nullptr;            // [1] or null: CUDA status bits (common.h StatusBit)
};

void select_expand_cpu(const SelectExpandArgs& args);
void build_tree_cpu(const BuildTreeArgs& args);
#ifdef RHEO_WITH_CUDA
cudaError_t select_expand_cuda(const SelectExpandArgs& args, cudaStream_t stream);
cudaError_t build_tree_cuda(const BuildTreeArgs& args, cudaStream_t stream);
#endif

}  // namespace rheo
