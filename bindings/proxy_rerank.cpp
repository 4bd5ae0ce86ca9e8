// Bindings of the proxy rerank kernels (csrc/include/rheo/proxy_rerank.h): check the tensors,
// fill the args struct, call the _cpu or _cuda version by device.
#include "binding_utils.h"
#include "bindings.h"
#include "rheo/proxy_rerank.h"

#include <utility>

namespace rheo::bind {

void select_expand(const at::Tensor& scores, at::Tensor& expand,
                   const std::optional<at::Tensor>& status) {
  check_shape(scores, "scores", {-1, -1}, "[B, M]");
  check_dtype(scores, "scores", at::kFloat);
  check_contiguous(scores, "scores");
  const int64_t B = scores.size(0), M = scores.size(1);
  check_shape(expand, "expand", {B, -1}, "[B, topk]");
  const int64_t topk = expand.size(1);
  RHEO_CHECK(topk >= 1 && topk <= M, "topk=", topk, " (expand.size(1)) must be in [1, M=", M,
             "] (candidates at this level); lower topk");
  check_buffer(expand, "expand", at::kInt, {B, topk}, "[B, topk]");
  check_same_device(expand, "expand", scores, "scores");

  SelectExpandArgs args;
  args.scores = scores.data_ptr<float>();
  args.B = B;
  args.M = M;
  args.topk = static_cast<int32_t>(topk);
  args.expand = expand.data_ptr<int32_t>();
  args.status = status_ptr(status, scores, "scores");  // CUDA: a NaN score -> kStatusNanScore
  if (on_cuda(scores, "scores")) {
#ifdef RHEO_WITH_CUDA
    const DeviceGuard guard(scores.device());
    RHEO_CUDA_CHECK(select_expand_cuda(args, current_stream(scores)));
#endif
    return;
  }
  select_expand_cpu(args);
}

void build_tree(const at::Tensor& cand_scores, const at::Tensor& cand_tokens,
                const at::Tensor& cand_parents, const at::Tensor& cand_sampled,
                const at::Tensor& root_tokens, const at::Tensor& prefix_len, at::Tensor& tokens,
                at::Tensor& parents, at::Tensor& depth, at::Tensor& positions,
                at::Tensor& sampled_row, at::Tensor& cand_index, at::Tensor& tree_mask,
                at::Tensor& retrieve_indices, at::Tensor& n_leaves,
                const std::optional<at::Tensor>& status) {
  // Inputs: candidates [B, L] in flat order, per-entry root token and prefix length [B].
  check_shape(cand_scores, "cand_scores", {-1, -1}, "[B, L]");
  check_dtype(cand_scores, "cand_scores", at::kFloat);
  check_contiguous(cand_scores, "cand_scores");
  const int64_t B = cand_scores.size(0), L = cand_scores.size(1);
  check_buffer(cand_tokens, "cand_tokens", at::kInt, {B, L}, "[B, L]");
  check_buffer(cand_parents, "cand_parents", at::kInt, {B, L}, "[B, L]");
  check_buffer(cand_sampled, "cand_sampled", at::kInt, {B, L}, "[B, L]");
  check_buffer(root_tokens, "root_tokens", at::kInt, {B}, "[B]");
  check_buffer(prefix_len, "prefix_len", at::kInt, {B}, "[B]");
  // Outputs: N (total_tokens) from tokens, max_depth from retrieve_indices' last dimension.
  check_shape(tokens, "tokens", {B, -1}, "[B, N]");
  const int64_t N = tokens.size(1);
  RHEO_CHECK(N >= 1 && N <= L + 1, "total_tokens=", N, " (tokens.size(1)) must be in [1, L + 1 = ",
             L + 1, "] (candidates drafted plus the root); lower total_tokens or draft more");
  check_shape(retrieve_indices, "retrieve_indices", {B, N, -1}, "[B, N, depth + 1]");
  const int64_t W = retrieve_indices.size(2);
  RHEO_CHECK(W >= 1, "retrieve_indices must have depth + 1 >= 1 columns, got ", W);
  const std::pair<const at::Tensor*, const char*> node_outputs[] = {
      {&tokens, "tokens"},       {&parents, "parents"},         {&depth, "depth"},
      {&positions, "positions"}, {&sampled_row, "sampled_row"}, {&cand_index, "cand_index"}};
  for (const auto& [t, name] : node_outputs) check_buffer(*t, name, at::kInt, {B, N}, "[B, N]");
  check_buffer(tree_mask, "tree_mask", at::kByte, {B, N, N}, "[B, N, N]");
  check_buffer(retrieve_indices, "retrieve_indices", at::kInt, {B, N, W}, "[B, N, depth + 1]");
  check_buffer(n_leaves, "n_leaves", at::kInt, {B}, "[B]");
  const std::pair<const at::Tensor*, const char*> others[] = {
      {&cand_tokens, "cand_tokens"}, {&cand_parents, "cand_parents"},
      {&cand_sampled, "cand_sampled"}, {&root_tokens, "root_tokens"},
      {&prefix_len, "prefix_len"}, {&tree_mask, "tree_mask"},
      {&retrieve_indices, "retrieve_indices"}, {&n_leaves, "n_leaves"}};
  for (const auto& [t, name] : node_outputs)
    check_same_device(*t, name, cand_scores, "cand_scores");
  for (const auto& [t, name] : others) check_same_device(*t, name, cand_scores, "cand_scores");

  BuildTreeArgs args;
  args.cand_scores = cand_scores.data_ptr<float>();
  args.cand_tokens = cand_tokens.data_ptr<int32_t>();
  args.cand_parents = cand_parents.data_ptr<int32_t>();
  args.cand_sampled = cand_sampled.data_ptr<int32_t>();
  args.root_tokens = root_tokens.data_ptr<int32_t>();
  args.prefix_len = prefix_len.data_ptr<int32_t>();
  args.B = B;
  args.L = L;
  args.N = static_cast<int32_t>(N);
  args.max_depth = static_cast<int32_t>(W - 1);
  args.tokens = tokens.data_ptr<int32_t>();
  args.parents = parents.data_ptr<int32_t>();
  args.depth = depth.data_ptr<int32_t>();
  args.positions = positions.data_ptr<int32_t>();
  args.sampled_row = sampled_row.data_ptr<int32_t>();
  args.cand_index = cand_index.data_ptr<int32_t>();
  args.tree_mask = tree_mask.data_ptr<uint8_t>();
  args.retrieve_indices = retrieve_indices.data_ptr<int32_t>();
  args.n_leaves = n_leaves.data_ptr<int32_t>();
  // CUDA: an invalid entry gets n_leaves = -1 and kStatusNanScore or kStatusBadTree here.
  args.status = status_ptr(status, cand_scores, "cand_scores");
  if (on_cuda(cand_scores, "cand_scores")) {
#ifdef RHEO_WITH_CUDA
    const DeviceGuard guard(cand_scores.device());
    RHEO_CUDA_CHECK(build_tree_cuda(args, current_stream(cand_scores)));
#endif
    return;
  }
  build_tree_cpu(args);
}

}  // namespace rheo::bind
