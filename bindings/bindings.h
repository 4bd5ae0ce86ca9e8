// The functions bindings/<kernel>.cpp export to Python (registered in module.cpp). Each checks
// its tensors (device, dtype, contiguity, shape), fills the kernel's args struct and calls the
// _cpu or _cuda implementation by device. Outputs are allocated by rheo_engine/kernels.py.
// `status` (None or a [1] int32 device word, common.h StatusBit) is where a CUDA kernel reports
// bad input without a host sync; the CPU kernels raise instead.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace rheo::bind {

// fused layer operators (csrc/include/rheo/fused_ops.h); delta and residual_out: both or None
void add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                  const at::Tensor& weight, double eps,
                  const std::optional<at::Tensor>& residual_out, at::Tensor& normed_out);
void rope_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H,
             int64_t Hkv, at::Tensor& q_out, at::Tensor& k_out);
void silu_mul(const at::Tensor& gate_up, at::Tensor& out);

// A Llama target's decoder layers on the CPU in one call for one sequence in a KV slot
// (bindings/decoder_layers.cpp): the weights are held once, run() takes a step's tensors.
class DecoderLayers {
 public:
  // norms: attn_norm, mlp_norm per layer; weights: qkv, o, gate_up, down per layer, each packed
  // GGUF blocks (types[i] = its QuantType) or a dense matrix (types[i] = -1), outs[i] its rows.
  DecoderLayers(std::vector<at::Tensor> norms, std::vector<at::Tensor> weights,
                std::vector<int64_t> types, std::vector<int64_t> outs, at::Tensor final_norm,
                double eps, int64_t H, int64_t Hkv, int64_t D);
  // x [1, n, hidden] embeddings; cos, sin [1, n, D/2]; k_pool, v_pool [layers, slots, rows, Hkv,
  // D]: the n new rows go to rows lo.. of ``slot``, which holds lo committed rows; tree_mask
  // [1, n, T] uint8. Returns {the final normed state [1, n, hidden]} and, with feature_layers,
  // the residuals entering those layers concatenated [1, n, len * hidden].
  std::vector<at::Tensor> run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t slot,
                              int64_t lo, const at::Tensor& tree_mask,
                              const std::vector<int64_t>& feature_layers) const;

 private:
  at::Tensor linear(const at::Tensor& x, size_t w) const;
  std::vector<at::Tensor> norms_, weights_;
  std::vector<int64_t> types_, outs_;
  at::Tensor final_norm_;
  double eps_;
  int64_t H_, Hkv_, D_;
};

// An EAGLE-3 head's draft level on the CPU in one call for one sequence in a slot of its KV pool
// (Eagle3Head.layer_in_pool, then logits).
class DraftLevel {
 public:
  // norms: input_layernorm, hidden_norm, post_attention_layernorm, norm; weights: qkv (stacked),
  // o, gate_up (stacked), down, lm_head, as DecoderLayers takes them.
  DraftLevel(std::vector<at::Tensor> norms, std::vector<at::Tensor> weights,
             std::vector<int64_t> types, std::vector<int64_t> outs, double eps, int64_t H,
             int64_t Hkv, int64_t D);
  // h, e [1, n, hidden]: the parents' states and the nodes' embeddings; cos, sin [1, n, D/2];
  // k_pool, v_pool [1, slots, rows, Hkv, D]: the n nodes' K/V go to rows row0.. of ``slot``,
  // which they attend after its first ``prefix`` rows as tree_mask [1, n, T] allows. Returns
  // {h2 [1, n, hidden], logits [1, r, Vd] float32} of the last r = logit_rows rows (-1: all n;
  // a prefill of the head's waiting pairs needs only its last row's).
  std::vector<at::Tensor> run(const at::Tensor& h, const at::Tensor& e, const at::Tensor& cos,
                              const at::Tensor& sin, const at::Tensor& k_pool,
                              const at::Tensor& v_pool, int64_t slot, int64_t row0,
                              int64_t prefix, const at::Tensor& tree_mask,
                              int64_t logit_rows) const;

 private:
  std::vector<at::Tensor> norms_, weights_;
  std::vector<int64_t> types_, outs_;
  double eps_;
  int64_t H_, Hkv_, D_;
};

// logit controls (csrc/include/rheo/logit_controls.h): penalties and bans per node, in place
void logit_controls(at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
                    const at::Tensor& history_ids, const at::Tensor& history_counts,
                    const at::Tensor& history_len, const at::Tensor& suppress_ids,
                    const at::Tensor& suppress_below, double repetition_penalty,
                    double presence_penalty, double frequency_penalty,
                    const std::optional<at::Tensor>& status);

// pool sampler (csrc/include/rheo/pool_sampler.h); kind: 0 = topk, 1 = rheo
void pool_sampler(const at::Tensor& logits, int64_t K, int64_t m, int64_t S, double T, int64_t kind,
                  uint64_t seed, uint64_t step, int64_t level,
                  const std::optional<at::Tensor>& forced_sample, at::Tensor& tokens,
                  at::Tensor& log_proxy, at::Tensor& sampled_slot, at::Tensor& q_tilde_ids,
                  at::Tensor& q_tilde, at::Tensor& q_sampled,
                  const std::optional<at::Tensor>& status, const std::optional<at::Tensor>& key);

// proxy rerank (csrc/include/rheo/proxy_rerank.h)
void select_expand(const at::Tensor& scores, at::Tensor& expand,
                   const std::optional<at::Tensor>& status);
void build_tree(const at::Tensor& cand_scores, const at::Tensor& cand_tokens,
                const at::Tensor& cand_parents, const at::Tensor& cand_sampled,
                const at::Tensor& root_tokens, const at::Tensor& prefix_len, at::Tensor& tokens,
                at::Tensor& parents, at::Tensor& depth, at::Tensor& positions,
                at::Tensor& sampled_row, at::Tensor& cand_index, at::Tensor& tree_mask,
                at::Tensor& retrieve_indices, at::Tensor& n_leaves,
                const std::optional<at::Tensor>& status);

// quantized linear (csrc/include/rheo/quant_linear.h); type: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1
void quantize_rows_q8(const at::Tensor& x, at::Tensor& xq, at::Tensor& xd, at::Tensor& xs,
                      at::Tensor& xm);
void quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t out,
                  at::Tensor& y);
void quant_gather_rows(const at::Tensor& w, int64_t type, int64_t rows, const at::Tensor& ids,
                       at::Tensor& out);
std::string quant_linear_amx();
std::string set_quant_linear_amx(const std::string& mode);
bool quant_linear_amx_self_check();

// skinny linear (csrc/include/rheo/skinny_linear.h)
void skinny_linear(const at::Tensor& x, const at::Tensor& w, at::Tensor& y);
bool skinny_linear_bf16_dot();
bool set_skinny_linear_bf16_dot(bool on);

// tree attention (csrc/include/rheo/tree_attention.h); prefix_lens, kv_slots: None or [B] int32
void tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& tree_mask, int64_t prefix_len,
                    const std::optional<at::Tensor>& prefix_lens,
                    const std::optional<at::Tensor>& kv_slots, double scale, at::Tensor& out);
int64_t tree_attention_exp_check(int64_t first, int64_t last, int64_t stride);

// verification (csrc/include/rheo/verification.h); method: 0 = topk, 1 = rrsw, 2 = rheo
void verification(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
                  const at::Tensor& sampled_row, const at::Tensor& q_tilde_ids,
                  const at::Tensor& q_tilde, int64_t method, double T, double top_p,
                  int64_t top_k, double min_p, uint64_t seed, uint64_t step,
                  at::Tensor& accept_path,
                  at::Tensor& accept_len, at::Tensor& bonus_token,
                  const std::optional<at::Tensor>& status, const std::optional<at::Tensor>& key,
                  const std::optional<at::Tensor>& depth, const std::optional<at::Tensor>& packed);
void verification_law(const at::Tensor& logits, const at::Tensor& tokens,
                      const at::Tensor& parents, const at::Tensor& sampled_row,
                      const at::Tensor& q_tilde_ids, const at::Tensor& q_tilde, int64_t method,
                      double T, double top_p, int64_t top_k, double min_p,
                      at::Tensor& accept_prob,
                      at::Tensor& emit_prob);

}  // namespace rheo::bind
