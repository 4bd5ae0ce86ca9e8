// Binding of the fused layer operators (csrc/include/rheo/fused_ops.h): checks the tensors, fills
// the args structs and calls the CUDA kernels, or the CPU kernels on blocks of rows spread over
// torch's thread pool (at::parallel_for; a row's bits do not depend on which thread runs it).
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "binding_utils.h"
#include "bindings.h"
#include "rheo/fused_ops.h"

namespace rheo::bind {
namespace {

// Elements of work per CPU task: fewer rows than this run on the calling thread.
constexpr int64_t kGrainElements = 64 * 1024;

DType fused_dtype(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kBFloat16) return DType::kBFloat16;
  if (t.scalar_type() == at::kFloat) return DType::kFloat32;
  fail(name, " must be bfloat16 or float32, got ", at::toString(t.scalar_type()),
       "; convert it with .to(torch.bfloat16) or run the torch path");
}

// t [..., width] read as rows of `width` dense elements one stride apart: the last dim dense and
// the leading dims flattening into one (a contiguous tensor, a column slice or a row slice of
// one). Returns (rows, row stride).
std::pair<int64_t, int64_t> rows_of(const at::Tensor& t, const char* name, int64_t width) {
  RHEO_CHECK(t.dim() >= 1 && t.size(-1) == width, name, " must be [..., ", width, "], got ",
             shape_str(t.sizes()));
  bool ok = width <= 1 || t.stride(-1) == 1;
  int64_t rows = 1, stride = -1, expected = -1;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    rows *= t.size(d);
    if (t.size(d) == 1) continue;
    if (stride < 0) {
      stride = t.stride(d);
      ok = ok && stride >= width;
    } else {
      ok = ok && t.stride(d) == expected;
    }
    expected = t.stride(d) * t.size(d);
  }
  RHEO_CHECK(ok, name, " must have dense rows that flatten into one stride (strides [..., >= ",
             width, ", 1]), got strides ", shape_str(t.strides()), " for shape ",
             shape_str(t.sizes()), "; call .contiguous() first");
  return {rows, stride < 0 ? width : stride};
}

// An output [rows..., width] (the leading dims of `like`), contiguous, dtype and device of it.
void check_out(const at::Tensor& out, const char* name, const at::Tensor& like, int64_t width,
               const char* dims) {
  std::vector<int64_t> shape(like.sizes().begin(), like.sizes().end() - 1);
  shape.push_back(width);
  check_buffer(out, name, like.scalar_type(), shape, dims);
  check_same_device(out, name, like, "the input");
}

// Runs `cpu(part)` over rows [0, rows) in tasks of at least kGrainElements elements. The args
// come filled for every row, as the CUDA launchers take them; each task narrows its copy.
template <typename Args, typename Fn>
void cpu_rows(const Args& args, int64_t width, Fn cpu) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, width));
  if (args.rows <= grain) {
    Args part = args;
    part.row_begin = 0, part.row_end = args.rows;
    return cpu(part);
  }
  at::parallel_for(0, args.rows, grain, [&](int64_t begin, int64_t end) {
    Args part = args;
    part.row_begin = begin, part.row_end = end;
    cpu(part);
  });
}

}  // namespace

void add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                  const at::Tensor& weight, double eps,
                  const std::optional<at::Tensor>& residual_out, at::Tensor& normed_out) {
  const int64_t hidden = weight.size(-1);
  check_shape(weight, "weight", {-1}, "[hidden]");
  AddRmsNormArgs a;
  a.dtype = fused_dtype(x, "x");
  check_dtype(weight, "weight", x.scalar_type());
  check_contiguous(weight, "weight");
  check_same_device(weight, "weight", x, "x");
  std::tie(a.rows, a.x_stride) = rows_of(x, "x", hidden);
  a.row_begin = 0, a.row_end = a.rows;  // every row (the CPU path splits them over threads)
  check_out(normed_out, "normed_out", x, hidden, "[..., hidden] (the shape of x)");
  RHEO_CHECK(delta.has_value() == residual_out.has_value(),
             "delta and residual_out go together (the residual x + delta is written to "
             "residual_out); pass both or neither");
  if (delta) {
    RHEO_CHECK(delta->sizes() == x.sizes(), "delta must have the shape of x ",
               shape_str(x.sizes()), ", got ", shape_str(delta->sizes()));
    check_dtype(*delta, "delta", x.scalar_type());
    check_same_device(*delta, "delta", x, "x");
    a.delta_stride = rows_of(*delta, "delta", hidden).second;
    check_out(*residual_out, "residual_out", x, hidden, "[..., hidden] (the shape of x)");
    a.delta = delta->const_data_ptr();
    a.residual_out = residual_out->mutable_data_ptr();
  }
  a.hidden = hidden;
  a.eps = static_cast<float>(eps);
  if (a.rows == 0 || hidden == 0) return;
  a.x = x.const_data_ptr();
  a.weight = weight.const_data_ptr();
  a.normed_out = normed_out.mutable_data_ptr();
  if (on_cuda(x, "x")) {
#ifdef RHEO_WITH_CUDA
    const DeviceGuard guard(x.device());
    RHEO_CUDA_CHECK(add_rms_norm_cuda(a, current_stream(x)));
#endif
    return;
  }
  cpu_rows(a, hidden, add_rms_norm_cpu);
}

void rope_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H,
             int64_t Hkv, at::Tensor& q_out, at::Tensor& k_out) {
  RHEO_CHECK(H >= 0 && Hkv >= 0, "H and Hkv must be >= 0, got H=", H, ", Hkv=", Hkv);
  RHEO_CHECK(cos.dim() >= 1 && cos.size(-1) > 0, "cos must be [..., D / 2], got ",
             shape_str(cos.sizes()));
  const int64_t D = 2 * cos.size(-1);
  RopeQkArgs a;
  a.dtype = fused_dtype(qkv, "qkv");
  std::tie(a.rows, a.qkv_stride) = rows_of(qkv, "qkv", (H + 2 * Hkv) * D);
  a.row_begin = 0, a.row_end = a.rows;
  std::vector<int64_t> lead(qkv.sizes().begin(), qkv.sizes().end() - 1);
  for (const auto* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    std::vector<int64_t> shape = lead;
    shape.push_back(D / 2);
    check_buffer(*t, name, qkv.scalar_type(), shape, "[..., D / 2] (the leading dims of qkv)");
    check_same_device(*t, name, qkv, "qkv");
  }
  for (auto [t, name, heads] : {std::tuple{&q_out, "q_out", H}, std::tuple{&k_out, "k_out", Hkv}}) {
    std::vector<int64_t> shape = lead;
    shape.push_back(heads);
    shape.push_back(D);
    check_buffer(*t, name, qkv.scalar_type(), shape, "[..., heads, D] (the leading dims of qkv)");
    check_same_device(*t, name, qkv, "qkv");
  }
  a.H = H, a.Hkv = Hkv, a.D = D;
  if (a.rows == 0 || H + Hkv == 0) return;
  a.qkv = qkv.const_data_ptr();
  a.cos = cos.const_data_ptr();
  a.sin = sin.const_data_ptr();
  a.q_out = q_out.mutable_data_ptr();
  a.k_out = k_out.mutable_data_ptr();
  if (on_cuda(qkv, "qkv")) {
#ifdef RHEO_WITH_CUDA
    const DeviceGuard guard(qkv.device());
    RHEO_CUDA_CHECK(rope_qk_cuda(a, current_stream(qkv)));
#endif
    return;
  }
  cpu_rows(a, (H + Hkv) * D, rope_qk_cpu);
}

void silu_mul(const at::Tensor& gate_up, at::Tensor& out) {
  RHEO_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
             "gate_up must be [..., 2 I] (gate, then up), got ", shape_str(gate_up.sizes()));
  SiluMulArgs a;
  a.dtype = fused_dtype(gate_up, "gate_up");
  a.I = gate_up.size(-1) / 2;
  std::tie(a.rows, a.gu_stride) = rows_of(gate_up, "gate_up", 2 * a.I);
  a.row_begin = 0, a.row_end = a.rows;
  check_out(out, "out", gate_up, a.I, "[..., I] (the leading dims of gate_up)");
  if (a.rows == 0 || a.I == 0) return;
  a.gate_up = gate_up.const_data_ptr();
  a.out = out.mutable_data_ptr();
  if (on_cuda(gate_up, "gate_up")) {
#ifdef RHEO_WITH_CUDA
    const DeviceGuard guard(gate_up.device());
    RHEO_CUDA_CHECK(silu_mul_cuda(a, current_stream(gate_up)));
#endif
    return;
  }
  cpu_rows(a, 2 * a.I, silu_mul_cpu);
}

}  // namespace rheo::bind
