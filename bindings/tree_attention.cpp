// Binding of tree attention (csrc/include/rheo/tree_attention.h): checks q, k, v, tree_mask, out
// and the optional prefix_lens / kv_slots, fills TreeAttentionArgs and calls the CPU or CUDA
// kernel by device. The values of prefix_lens and kv_slots are checked by tree_attention_cpu on
// the CPU; on CUDA they stay unchecked on the device (reading them here would sync every layer).
#include "binding_utils.h"
#include "bindings.h"
#include "rheo/tree_attention.h"

#ifdef RHEO_WITH_CUDA
#include <ATen/ops/empty.h>
#endif

namespace rheo::bind {
namespace {

// The kernel reads rows of D elements: the last dim must be dense; the others may be strided.
void check_dense_last_dim(const at::Tensor& t, const char* name) {
  RHEO_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name,
             " must have a dense last dim (stride 1), got strides ", shape_str(t.strides()),
             "; call .contiguous() first");
}

// k and v are read with one set of strides; sizes of 1 make a stride irrelevant.
void check_same_strides(const at::Tensor& k, const at::Tensor& v) {
  bool same = true;
  for (int64_t i = 0; i < k.dim(); ++i)
    same = same && (k.size(i) <= 1 || k.stride(i) == v.stride(i));
  RHEO_CHECK(same, "k and v must have the same strides (one layout for the KV cache), got k ",
             shape_str(k.strides()), " and v ", shape_str(v.strides()),
             "; call .contiguous() on both");
}

// An optional [B] int32 array of the batch (prefix_lens, kv_slots) on the device of q.
void check_per_sequence(const std::optional<at::Tensor>& t, const char* name, int64_t B,
                        const at::Tensor& q) {
  if (!t) return;
  check_buffer(*t, name, at::kInt, {B}, "[B]");
  check_same_device(*t, name, q, "q");
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& tree_mask, int64_t prefix_len,
                  const std::optional<at::Tensor>& prefix_lens,
                  const std::optional<at::Tensor>& kv_slots, const at::Tensor& out) {
  check_shape(q, "q", {-1, -1, -1, -1}, "[B, N, H, D]");
  const int64_t B = q.size(0), N = q.size(1), H = q.size(2), D = q.size(3);
  const char* kv_dims = kv_slots ? "[S, Lc, Hkv, D]" : "[B, Lc, Hkv, D]";
  check_shape(k, "k", {-1, -1, -1, D}, kv_dims);
  RHEO_CHECK(kv_slots || k.size(0) == B, "k must be [B, Lc, Hkv, D] with B=", B,
             " (q's batch) when kv_slots is None, got ", shape_str(k.sizes()),
             "; pass kv_slots [B] to read the sequences from slots of a KV pool");
  check_shape(v, "v", {k.size(0), k.size(1), k.size(2), D},
              kv_slots ? "[S, Lc, Hkv, D] (the shape of k)" : "[B, Lc, Hkv, D] (the shape of k)");
  check_per_sequence(prefix_lens, "prefix_lens", B, q);
  check_per_sequence(kv_slots, "kv_slots", B, q);
  RHEO_CHECK(!kv_slots || B == 0 || k.size(0) >= 1, "kv_slots needs k and v with S >= 1 slots, ",
             "got k ", shape_str(k.sizes()), "; pass the KV pool");
  dtype_of(q, "q", /*allow_float64=*/false);
  check_dtype(k, "k", q.scalar_type());
  check_dtype(v, "v", q.scalar_type());
  check_shape(tree_mask, "tree_mask", {B, N, -1}, "[B, N, T] (T tree rows; N for a target's tree)");
  check_buffer(tree_mask, "tree_mask", at::kByte, {B, N, tree_mask.size(2)}, "[B, N, T]");
  check_buffer(out, "out", q.scalar_type(), {B, N, H, D}, "[B, N, H, D]");
  check_same_device(k, "k", q, "q");
  check_same_device(v, "v", q, "q");
  check_same_device(tree_mask, "tree_mask", q, "q");
  check_same_device(out, "out", q, "q");
  check_dense_last_dim(q, "q");
  check_dense_last_dim(k, "k");
  check_dense_last_dim(v, "v");
  check_same_strides(k, v);
  const int64_t Hkv = k.size(2), Lc = k.size(1);
  RHEO_CHECK(D >= 1 && Hkv >= 1, "q and k need D >= 1 and Hkv >= 1, got D=", D, ", Hkv=", Hkv);
  RHEO_CHECK(H % Hkv == 0, "H=", H, " heads is not a multiple of Hkv=", Hkv,
             " KV heads (GQA needs H % Hkv == 0)");
  RHEO_CHECK(prefix_len >= 0, "prefix_len must be >= 0, got ", prefix_len);
  const int64_t T = tree_mask.size(2);
  RHEO_CHECK(prefix_len + T <= Lc, "prefix_len + T must be <= Lc (the cache holds the prefix, ",
             "then the T tree rows of tree_mask [B, N, T]), got prefix_len=", prefix_len, ", T=", T,
             ", Lc=", Lc, "; write the tree's K/V into the cache first");
}

}  // namespace

void tree_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& tree_mask, int64_t prefix_len,
                    const std::optional<at::Tensor>& prefix_lens,
                    const std::optional<at::Tensor>& kv_slots, double scale, at::Tensor& out) {
  check_inputs(q, k, v, tree_mask, prefix_len, prefix_lens, kv_slots, out);
  TreeAttentionArgs args;
  args.q = q.const_data_ptr();
  args.k = k.const_data_ptr();
  args.v = v.const_data_ptr();
  args.tree_mask = tree_mask.const_data_ptr<uint8_t>();
  args.out = out.mutable_data_ptr();
  args.dtype = dtype_of(q, "q", /*allow_float64=*/false);
  args.B = q.size(0);
  args.N = q.size(1);
  args.H = q.size(2);
  args.D = q.size(3);
  args.T = tree_mask.size(2);
  args.Hkv = k.size(2);
  args.prefix_len = prefix_len;
  if (prefix_lens) args.prefix_lens = prefix_lens->const_data_ptr<int32_t>();
  if (kv_slots) args.kv_slots = kv_slots->const_data_ptr<int32_t>();
  args.S = k.size(0);
  args.q_stride_b = q.stride(0);
  args.q_stride_n = q.stride(1);
  args.q_stride_h = q.stride(2);
  args.kv_stride_b = k.stride(0);
  args.kv_stride_l = k.stride(1);
  args.kv_stride_h = k.stride(2);
  args.scale = static_cast<float>(scale);
  if (on_cuda(q, "q")) {
#ifdef RHEO_WITH_CUDA
    const DeviceGuard guard(q.device());
    // Split-KV partials (float32) from torch's caching allocator (no cudaMalloc per call). Its
    // blocks are stream-ordered: freed when this returns, reused only by later work on the same
    // stream, so the kernels still running on it are safe.
    const int64_t ws_floats = static_cast<int64_t>(tree_attention_workspace_floats(args));
    at::Tensor workspace;
    if (ws_floats > 0) {
      workspace = at::empty({ws_floats}, q.options().dtype(at::kFloat));
      args.workspace = workspace.data_ptr<float>();
    }
    RHEO_CUDA_CHECK(tree_attention_cuda(args, current_stream(q)));
#endif
    return;
  }
  tree_attention_cpu(args);
}

int64_t tree_attention_exp_check(int64_t first, int64_t last, int64_t stride) {
  return tree_attention_exp_mismatches(first, last, stride);
}

}  // namespace rheo::bind
