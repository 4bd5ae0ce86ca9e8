// A Llama target's decoder layers, and an EAGLE-3 head's draft level, on the CPU in one call each
// (DraftLevel: Eagle3Head.layer_in_pool and logits, the same way). The target's layers, for one
// sequence in a slot of its KV
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

namespace {

// y [1, n, out] = x W^T: packed GGUF blocks (type >= 0, quant_linear) or a dense matrix of x's
// dtype (skinny_linear), as models/linear.linear picks for these weights.
at::Tensor matmul(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t out) {
  at::Tensor y = at::empty({x.size(0), x.size(1), out}, x.options());
  if (type >= 0)
    quant_linear(x, w, type, out, y);
  else
    skinny_linear(x, w, y);
  return y;
}

// A slot of a pool [layers, slots, rows, Hkv, D] (contiguous, x's dtype): its rows at layer i.
struct Slot {
  const at::Tensor &k, &v;
  int64_t slot, S, R, Hkv, D;
  size_t row;  // bytes of one row
  Slot(const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t slot, int64_t layers,
       int64_t Hkv, int64_t D, const at::Tensor& x)
      : k(k_pool), v(v_pool), slot(slot), S(k_pool.size(1)), R(k_pool.size(2)), Hkv(Hkv), D(D),
        row(static_cast<size_t>(Hkv * D) * x.element_size()) {
    check_shape(k_pool, "k_pool", {layers, -1, -1, Hkv, D}, "[layers, slots, rows, Hkv, D]");
    check_shape(v_pool, "v_pool", {layers, S, R, Hkv, D},
                "[layers, slots, rows, Hkv, D] (k_pool's shape)");
    RHEO_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() &&
                   k_pool.scalar_type() == x.scalar_type() &&
                   v_pool.scalar_type() == x.scalar_type(),
               "k_pool and v_pool must be contiguous and of x's dtype");
    RHEO_CHECK(0 <= slot && slot < S, "slot=", slot, " must be in [0, ", S, ")");
  }
  size_t offset(int64_t layer, int64_t r) const {
    return static_cast<size_t>((layer * S + slot) * R + r) * row;
  }
  // Rows r0.. of layer ``layer`` = k [1, n, Hkv, D] (dense) and the v heads of qkv
  // [1, n, cols] at column v_col: the new rows' K and V, uncommitted.
  void write(int64_t layer, int64_t r0, int64_t n, const at::Tensor& k_new, const at::Tensor& qkv,
             int64_t v_col) const {
    std::memcpy(static_cast<char*>(k.data_ptr()) + offset(layer, r0), k_new.const_data_ptr(),
                n * row);
    const size_t elem = qkv.element_size(), cols = qkv.size(2);
    const char* src = static_cast<const char*>(qkv.const_data_ptr()) + v_col * elem;
    char* dst = static_cast<char*>(v.data_ptr()) + offset(layer, r0);
    for (int64_t r = 0; r < n; ++r) std::memcpy(dst + r * row, src + r * cols * elem, row);
  }
  // Tree attention of q [1, n, H, D] over the slot's first ``prefix`` rows and the T rows after
  // them that tree_mask [1, n, T] allows (tree_attention.h), into a new [1, n, H, D].
  at::Tensor attend(int64_t layer, const at::Tensor& q, int64_t prefix,
                    const at::Tensor& tree_mask) const {
    const int64_t n = q.size(1), H = q.size(2), T = tree_mask.size(2);
    RHEO_CHECK(0 <= prefix && prefix + T <= R, "prefix=", prefix, " and T=", T,
               " tree rows must fit the slot's ", R, " rows");
    at::Tensor out = at::empty_like(q);
    TreeAttentionArgs a;
    a.q = q.const_data_ptr();
    a.k = static_cast<const char*>(k.const_data_ptr()) + offset(layer, 0);
    a.v = static_cast<const char*>(v.const_data_ptr()) + offset(layer, 0);
    a.tree_mask = tree_mask.const_data_ptr<uint8_t>();
    a.out = out.mutable_data_ptr();
    a.dtype = dtype_of(q, "q", /*allow_float64=*/false);
    a.B = 1, a.N = n, a.H = H, a.Hkv = Hkv, a.D = D, a.T = T, a.prefix_len = prefix, a.S = 1;
    a.q_stride_b = n * H * D, a.q_stride_n = H * D, a.q_stride_h = D;
    a.kv_stride_b = R * Hkv * D, a.kv_stride_l = Hkv * D, a.kv_stride_h = D;
    a.scale = static_cast<float>(std::pow(static_cast<double>(D), -0.5));  // q.shape[-1] ** -0.5
    tree_attention_cpu(a);
    return out;
  }
};

// The norm of the residual x + delta (x alone while delta is undefined: the first layer),
// kernels.add_rms_norm's; x becomes the residual. Returns the normed state.
at::Tensor residual_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                         double eps) {
  at::Tensor normed = at::empty_like(x);
  if (!delta.defined()) {
    add_rms_norm(x, std::nullopt, weight, eps, std::nullopt, normed);
    return normed;
  }
  at::Tensor residual = at::empty_like(x);
  add_rms_norm(x, delta, weight, eps, residual, normed);
  x = residual;
  return normed;
}

}  // namespace

at::Tensor DecoderLayers::linear(const at::Tensor& x, size_t w) const {
  return matmul(x, weights_[w], types_[w], outs_[w]);
}

std::vector<at::Tensor> DecoderLayers::run(at::Tensor x, const at::Tensor& cos,
                                           const at::Tensor& sin, const at::Tensor& k_pool,
                                           const at::Tensor& v_pool, int64_t slot, int64_t lo,
                                           const at::Tensor& tree_mask,
                                           const std::vector<int64_t>& feature_layers) const {
  const int64_t L = static_cast<int64_t>(norms_.size() / 2), H = H_, Hkv = Hkv_, D = D_;
  check_shape(x, "x", {1, -1, -1}, "[1, n, hidden] (one sequence)");
  const int64_t n = x.size(1);
  const Slot cache(k_pool, v_pool, slot, L, Hkv, D, x);
  check_buffer(tree_mask, "tree_mask", at::kByte, {1, n, tree_mask.size(2)}, "[1, n, T]");
  RHEO_CHECK(tree_mask.size(2) == n, "tree_mask must be [1, n, n] for the target's tree, got ",
             shape_str(tree_mask.sizes()));
  RHEO_CHECK(0 <= lo && lo + n <= cache.R, "lo=", lo, " and n=", n, " new rows must fit the ",
             "slot's ", cache.R, " rows");
  std::vector<at::Tensor> captured(feature_layers.size());
  at::Tensor delta;  // the previous layer's MLP output, added to x by the next norm
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor normed = residual_norm(x, delta, norms_[2 * i], eps_);
    for (size_t j = 0; j < feature_layers.size(); ++j)
      if (feature_layers[j] == i) captured[j] = x;  // the residual entering layer i
    const at::Tensor qkv = linear(normed, 4 * i);  // [1, n, (H + 2 Hkv) D]
    at::Tensor q = at::empty({1, n, H, D}, x.options()), k = at::empty({1, n, Hkv, D}, x.options());
    rope_qk(qkv, cos, sin, H, Hkv, q, k);
    cache.write(i, lo, n, k, qkv, (H + Hkv) * D);
    const at::Tensor attn = cache.attend(i, q, lo, tree_mask);
    const at::Tensor o = linear(attn.view({1, n, H * D}), 4 * i + 1);
    const at::Tensor gate_up = linear(residual_norm(x, o, norms_[2 * i + 1], eps_), 4 * i + 2);
    at::Tensor act = at::empty({1, n, gate_up.size(2) / 2}, x.options());
    silu_mul(gate_up, act);
    delta = linear(act, 4 * i + 3);
  }
  const at::Tensor normed = residual_norm(x, delta, final_norm_, eps_);
  if (captured.empty()) return {normed};
  return {normed, at::cat(captured, -1)};
}

DraftLevel::DraftLevel(std::vector<at::Tensor> norms, std::vector<at::Tensor> weights,
                       std::vector<int64_t> types, std::vector<int64_t> outs, double eps,
                       int64_t H, int64_t Hkv, int64_t D)
    : norms_(std::move(norms)), weights_(std::move(weights)), types_(std::move(types)),
      outs_(std::move(outs)), eps_(eps), H_(H), Hkv_(Hkv), D_(D) {
  RHEO_CHECK(norms_.size() == 4 && weights_.size() == 5 && types_.size() == 5 && outs_.size() == 5,
             "DraftLevel needs 4 norms (input, hidden, post-attention, final) and 5 matrices "
             "(qkv, o, gate_up, down, lm_head) with a type and an out size each");
  RHEO_CHECK(H >= 1 && Hkv >= 1 && D >= 1 && H % Hkv == 0, "DraftLevel needs H % Hkv == 0 ",
             "and D >= 1, got H=", H, ", Hkv=", Hkv, ", D=", D);
  for (const at::Tensor& w : weights_)
    RHEO_CHECK(w.device().is_cpu(), "DraftLevel runs on the CPU; a matrix is on ", w.device());
}

std::vector<at::Tensor> DraftLevel::run(const at::Tensor& h, const at::Tensor& e,
                                        const at::Tensor& cos, const at::Tensor& sin,
                                        const at::Tensor& k_pool, const at::Tensor& v_pool,
                                        int64_t slot, int64_t row0, int64_t prefix,
                                        const at::Tensor& tree_mask, int64_t logit_rows) const {
  const int64_t H = H_, Hkv = Hkv_, D = D_;
  check_shape(h, "h", {1, -1, -1}, "[1, n, hidden] (one sequence)");
  const int64_t n = h.size(1);
  if (logit_rows == -1) logit_rows = n;
  RHEO_CHECK(1 <= logit_rows && logit_rows <= n, "logit_rows=", logit_rows, " must be in [1, ",
             n, "] (the level's rows), or -1 for all of them");
  check_shape(e, "e", {1, n, h.size(2)}, "[1, n, hidden] (h's shape)");
  const Slot cache(k_pool, v_pool, slot, 1, Hkv, D, h);
  check_buffer(tree_mask, "tree_mask", at::kByte, {1, n, tree_mask.size(2)}, "[1, n, T]");
  RHEO_CHECK(0 <= prefix && prefix <= row0 && row0 + n <= prefix + tree_mask.size(2),
             "the level's rows ", row0, "..", row0 + n, " must be tree rows of the mask (after ",
             "prefix=", prefix, ")");
  RHEO_CHECK(prefix + tree_mask.size(2) <= cache.R, "prefix=", prefix, " and T=",
             tree_mask.size(2), " tree rows must fit the slot's ", cache.R, " rows");
  // docs/eagle3_format.md §7: the embedding half first; the residual is the un-normed h.
  at::Tensor e_normed = at::empty_like(e), h_normed = at::empty_like(h);
  add_rms_norm(e, std::nullopt, norms_[0], eps_, std::nullopt, e_normed);
  add_rms_norm(h, std::nullopt, norms_[1], eps_, std::nullopt, h_normed);
  const at::Tensor qkv = matmul(at::cat({e_normed, h_normed}, -1), weights_[0], types_[0],
                                outs_[0]);
  at::Tensor q = at::empty({1, n, H, D}, h.options()), k = at::empty({1, n, Hkv, D}, h.options());
  rope_qk(qkv, cos, sin, H, Hkv, q, k);
  cache.write(0, row0, n, k, qkv, (H + Hkv) * D);
  const at::Tensor attn = cache.attend(0, q, prefix, tree_mask);
  const at::Tensor o = matmul(attn.view({1, n, H * D}), weights_[1], types_[1], outs_[1]);
  at::Tensor h1 = at::empty_like(h), y = at::empty_like(h);
  add_rms_norm(h, o, norms_[2], eps_, h1, y);
  const at::Tensor gate_up = matmul(y, weights_[2], types_[2], outs_[2]);
  at::Tensor act = at::empty({1, n, gate_up.size(2) / 2}, h.options());
  silu_mul(gate_up, act);
  const at::Tensor h2 = h1 + matmul(act, weights_[3], types_[3], outs_[3]);  // a torch add
  // the logits of the last logit_rows rows only (a row's bits do not depend on its neighbours)
  const at::Tensor last = h2.narrow(1, n - logit_rows, logit_rows);
  at::Tensor normed = at::empty_like(last);
  add_rms_norm(last, std::nullopt, norms_[3], eps_, std::nullopt, normed);
  return {h2, matmul(normed, weights_[4], types_[4], outs_[4]).to(at::kFloat)};
}

}  // namespace rheo::bind
