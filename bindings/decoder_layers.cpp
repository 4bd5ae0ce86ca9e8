// A Llama target's decoder layers on the CPU in one call, for one sequence in a slot of its KV
// pool (a decode step, or a tree of n nodes): LlamaModel._fused_layers' loop with the same
// kernels, inputs and order, so the same bits. Each layer: add_rms_norm, the qkv matmul, rope_qk,
// the new K/V rows copied into the slot, tree attention, o, add_rms_norm, gate_up, silu_mul,
// down. The Python loop paid the interpreter, torch's dispatch and an allocation for each of
// its ~25 operators a layer (SmolLM2's 30 layers: about a fifth of a plain step); here a layer
// is 11 kernel calls and their outputs.
#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "binding_utils.h"
#include "bindings.h"
#include "rheo/tree_attention.h"

namespace rheo::bind {

DecoderLayers::DecoderLayers(std::vector<at::Tensor> norms, std::vector<at::Tensor> weights,
                             std::vector<int64_t> types, std::vector<int64_t> outs,
                             at::Tensor final_norm, double eps, int64_t H, int64_t Hkv,
                             int64_t D)
    : norms_(std::move(norms)), weights_(std::move(weights)), types_(std::move(types)),
      outs_(std::move(outs)), final_norm_(std::move(final_norm)), eps_(eps), H_(H), Hkv_(Hkv),
      D_(D) {
  const size_t L = norms_.size() / 2;
  RHEO_CHECK(norms_.size() == 2 * L && weights_.size() == 4 * L && types_.size() == 4 * L &&
                 outs_.size() == 4 * L,
             "DecoderLayers needs 2 norms and 4 matrices (qkv, o, gate_up, down) a layer, with a "
             "type and an out size each; got ", norms_.size(), " norms, ", weights_.size(),
             " matrices, ", types_.size(), " types, ", outs_.size(), " sizes");
  RHEO_CHECK(H >= 1 && Hkv >= 1 && D >= 1 && H % Hkv == 0, "DecoderLayers needs H % Hkv == 0 ",
             "and D >= 1, got H=", H, ", Hkv=", Hkv, ", D=", D);
  for (const at::Tensor& w : weights_)
    RHEO_CHECK(w.device().is_cpu(), "DecoderLayers runs on the CPU; a matrix is on ", w.device());
}

// y [1, n, out] = x W^T: packed GGUF blocks (type >= 0, quant_linear) or a dense matrix of x's
// dtype (skinny_linear), as models/linear.linear picks for these weights.
at::Tensor DecoderLayers::linear(const at::Tensor& x, size_t w) const {
  at::Tensor y = at::empty({x.size(0), x.size(1), outs_[w]}, x.options());
  if (types_[w] >= 0)
    quant_linear(x, weights_[w], types_[w], outs_[w], y);
  else
    skinny_linear(x, weights_[w], y);
  return y;
}

std::vector<at::Tensor> DecoderLayers::run(at::Tensor x, const at::Tensor& cos,
                                           const at::Tensor& sin, const at::Tensor& k_pool,
                                           const at::Tensor& v_pool, int64_t slot, int64_t lo,
                                           const at::Tensor& tree_mask,
                                           const std::vector<int64_t>& feature_layers) const {
  const int64_t L = static_cast<int64_t>(norms_.size() / 2), H = H_, Hkv = Hkv_, D = D_;
  check_shape(x, "x", {1, -1, -1}, "[1, n, hidden] (one sequence)");
  const int64_t n = x.size(1);
  check_shape(k_pool, "k_pool", {L, -1, -1, Hkv, D}, "[layers, slots, rows, Hkv, D]");
  check_shape(v_pool, "v_pool", {L, k_pool.size(1), k_pool.size(2), Hkv, D},
              "[layers, slots, rows, Hkv, D] (k_pool's shape)");
  RHEO_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() &&
                 k_pool.scalar_type() == x.scalar_type() && v_pool.scalar_type() == x.scalar_type(),
             "k_pool and v_pool must be contiguous and of x's dtype");
  const int64_t S = k_pool.size(1), R = k_pool.size(2);
  RHEO_CHECK(0 <= slot && slot < S, "slot=", slot, " must be in [0, ", S, ")");
  check_buffer(tree_mask, "tree_mask", at::kByte, {1, n, tree_mask.size(2)}, "[1, n, T]");
  const int64_t T = tree_mask.size(2);
  RHEO_CHECK(0 <= lo && lo + std::max(n, T) <= R, "lo=", lo, " with n=", n, " new rows and T=", T,
             " tree rows must fit the slot's ", R, " rows");
  const size_t elem = x.element_size(), row = static_cast<size_t>(Hkv * D) * elem;
  const int64_t qkv_cols = (H + 2 * Hkv) * D;
  std::vector<at::Tensor> captured(feature_layers.size());
  at::Tensor delta;  // the previous layer's MLP output, added to x by the next norm
  for (int64_t i = 0; i < L; ++i) {
    at::Tensor normed = at::empty_like(x);
    if (delta.defined()) {
      at::Tensor residual = at::empty_like(x);
      add_rms_norm(x, delta, norms_[2 * i], eps_, residual, normed);
      x = residual;
    } else {
      add_rms_norm(x, std::nullopt, norms_[2 * i], eps_, std::nullopt, normed);
    }
    for (size_t j = 0; j < feature_layers.size(); ++j)
      if (feature_layers[j] == i) captured[j] = x;  // the residual entering layer i
    const at::Tensor qkv = linear(normed, 4 * i);  // [1, n, (H + 2 Hkv) D]
    at::Tensor q = at::empty({1, n, H, D}, x.options()), k = at::empty({1, n, Hkv, D}, x.options());
    rope_qk(qkv, cos, sin, H, Hkv, q, k);
    // The new rows' K (rotated) and V (a slice of qkv) at rows lo.. of the slot, uncommitted.
    const size_t base = static_cast<size_t>((i * S + slot) * R + lo) * row;
    char* k_dst = static_cast<char*>(k_pool.data_ptr()) + base;
    char* v_dst = static_cast<char*>(v_pool.data_ptr()) + base;
    std::memcpy(k_dst, k.const_data_ptr(), n * row);
    const char* v_src = static_cast<const char*>(qkv.const_data_ptr()) + (H + Hkv) * D * elem;
    for (int64_t r = 0; r < n; ++r) std::memcpy(v_dst + r * row, v_src + r * qkv_cols * elem, row);
    at::Tensor attn = at::empty({1, n, H, D}, x.options());
    TreeAttentionArgs a;
    a.q = q.const_data_ptr();
    a.k = static_cast<const char*>(k_pool.const_data_ptr()) + (base - lo * row);
    a.v = static_cast<const char*>(v_pool.const_data_ptr()) + (base - lo * row);
    a.tree_mask = tree_mask.const_data_ptr<uint8_t>();
    a.out = attn.mutable_data_ptr();
    a.dtype = dtype_of(x, "x", /*allow_float64=*/false);
    a.B = 1, a.N = n, a.H = H, a.Hkv = Hkv, a.D = D, a.T = T, a.prefix_len = lo, a.S = 1;
    a.q_stride_b = n * H * D, a.q_stride_n = H * D, a.q_stride_h = D;
    a.kv_stride_b = R * Hkv * D, a.kv_stride_l = Hkv * D, a.kv_stride_h = D;
    a.scale = static_cast<float>(std::pow(static_cast<double>(D), -0.5));  // q.shape[-1] ** -0.5
    tree_attention_cpu(a);
    const at::Tensor o = linear(attn.view({1, n, H * D}), 4 * i + 1);
    at::Tensor residual = at::empty_like(x);
    normed = at::empty_like(x);
    add_rms_norm(x, o, norms_[2 * i + 1], eps_, residual, normed);
    x = residual;
    const at::Tensor gate_up = linear(normed, 4 * i + 2);
    at::Tensor act = at::empty({1, n, gate_up.size(2) / 2}, x.options());
    silu_mul(gate_up, act);
    delta = linear(act, 4 * i + 3);
  }
  at::Tensor normed = at::empty_like(x);
  if (delta.defined()) {
    at::Tensor residual = at::empty_like(x);
    add_rms_norm(x, delta, final_norm_, eps_, residual, normed);
  } else {
    add_rms_norm(x, std::nullopt, final_norm_, eps_, std::nullopt, normed);
  }
  if (captured.empty()) return {normed};
  return {normed, at::cat(captured, -1)};
}

}  // namespace rheo::bind
