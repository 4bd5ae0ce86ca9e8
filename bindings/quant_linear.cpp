// Binding of the quantized linear layer (csrc/include/rheo/quant_linear.h): checks x, the packed
// W and y, quantizes x to Q8 blocks once (scratch tensors), then runs the CUDA kernel, or the CPU
// kernel on ranges of panels spread over torch's thread pool (at::parallel_for).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "binding_utils.h"
#include "bindings.h"
#include "rheo/quant_linear.h"

namespace rheo::bind {
namespace {

// At least kGrainBytes of W per task: a smaller task costs more to hand out than it saves.
constexpr int64_t kGrainBytes = 128 * 1024;

DType float_dtype(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kBFloat16) return DType::kBFloat16;
  if (t.scalar_type() == at::kFloat) return DType::kFloat32;
  fail(name, " must be bfloat16 or float32, got ", at::toString(t.scalar_type()),
       "; convert it with .to(torch.bfloat16)");
}

QuantType quant_type(int64_t type) {
  RHEO_CHECK(type >= 0 && type <= 2, "quant type must be 0 (Q8_0), 1 (Q4_0) or 2 (Q4_1), got ",
             type);
  return static_cast<QuantType>(type);
}

// x [n, in] contiguous; the four Q8 buffers of its rows.
QuantRowsArgs rows_args(const at::Tensor& x, const at::Tensor& xq, const at::Tensor& xd,
                        const at::Tensor& xs, const at::Tensor& xm) {
  RHEO_CHECK(x.dim() == 2, "x must be [n, in], got shape ", shape_str(x.sizes()));
  check_contiguous(x, "x");
  const int64_t n = x.size(0), in = x.size(1);
  RHEO_CHECK(in % kQuantBlock == 0, "x must have in % 32 == 0 (Q8 blocks of 32 columns), got in=",
             in, "; quantized weights need a multiple of 32 input features");
  check_buffer(xq, "xq", at::kChar, {n, in}, "[n, in]");
  check_buffer(xd, "xd", at::kFloat, {n, in / kQuantBlock}, "[n, in / 32]");
  check_buffer(xs, "xs", at::kInt, {n, in / kQuantBlock}, "[n, in / 32]");
  check_buffer(xm, "xm", at::kFloat, {n, in / kQuantBlock}, "[n, in / 32]");
  for (const auto* t : {&xq, &xd, &xs, &xm}) check_same_device(*t, "the Q8 buffers", x, "x");
  QuantRowsArgs a;
  a.x = x.const_data_ptr();
  a.dtype = float_dtype(x, "x");
  a.n = n, a.in = in, a.x_stride = in;
  a.xq = static_cast<int8_t*>(xq.mutable_data_ptr());
  a.xd = static_cast<float*>(xd.mutable_data_ptr());
  a.xs = static_cast<int32_t*>(xs.mutable_data_ptr());
  a.xm = static_cast<float*>(xm.mutable_data_ptr());
  return a;
}

}  // namespace

void quantize_rows_q8(const at::Tensor& x, at::Tensor& xq, at::Tensor& xd, at::Tensor& xs,
                      at::Tensor& xm) {
  const QuantRowsArgs a = rows_args(x, xq, xd, xs, xm);
  if (on_cuda(x, "x")) {
#ifdef RHEO_WITH_CUDA
    const DeviceGuard guard(x.device());
    RHEO_CUDA_CHECK(quantize_rows_q8_cuda(a, current_stream(x)));
#endif
    return;
  }
  quantize_rows_q8_cpu(a);
}

void quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t out,
                  at::Tensor& y) {
  const QuantType t = quant_type(type);
  RHEO_CHECK(x.dim() >= 1, "x must be [..., in], got shape ", shape_str(x.sizes()));
  check_contiguous(x, "x");
  const int64_t in = x.size(-1), nb = in / kQuantBlock;
  const int64_t n = in > 0 ? x.numel() / in : 0;  // the leading dims flattened
  const int64_t panels = (out + kQuantPanel - 1) / kQuantPanel;
  RHEO_CHECK(out >= 0, "out must be >= 0, got ", out);
  RHEO_CHECK(in % kQuantBlock == 0, "x must have in % 32 == 0 (Q8 blocks of 32 columns), got in=",
             in, "; quantized weights need a multiple of 32 input features");
  check_buffer(w, "w", at::kByte, {panels, nb, quant_record_bytes(t)},
               "[ceil(out / 16), in / 32, record bytes] (packed by rheo_engine.models.quant)");
  std::vector<int64_t> y_shape(x.sizes().begin(), x.sizes().end() - 1);
  y_shape.push_back(out);
  check_buffer(y, "y", x.scalar_type(), y_shape, "[..., out] (the leading dims of x)");
  check_same_device(w, "w", x, "x");
  check_same_device(y, "y", x, "x");
  if (n == 0 || out == 0) return;
  QuantLinearArgs a;
  a.w = static_cast<const uint8_t*>(w.const_data_ptr());
  a.type = t;
  a.y = y.mutable_data_ptr();
  a.dtype = float_dtype(y, "y");
  a.n = n, a.in = in, a.out = out, a.y_stride = out;
  a.p_begin = 0, a.p_end = panels;
  QuantRowsArgs r;
  r.x = x.const_data_ptr();
  r.dtype = float_dtype(x, "x");
  r.n = n, r.in = in, r.x_stride = in;
  if (on_cuda(x, "x")) {
#ifdef RHEO_WITH_CUDA
    const DeviceGuard guard(x.device());
    auto opts = x.options();
    at::Tensor xq = at::empty({n, in}, opts.dtype(at::kChar));
    at::Tensor xd = at::empty({n, nb}, opts.dtype(at::kFloat));
    at::Tensor xs = at::empty({n, nb}, opts.dtype(at::kInt));
    at::Tensor xm = at::empty({n, nb}, opts.dtype(at::kFloat));
    a.xq = r.xq = static_cast<int8_t*>(xq.mutable_data_ptr());
    r.xd = static_cast<float*>(xd.mutable_data_ptr()), a.xd = r.xd;
    r.xs = static_cast<int32_t*>(xs.mutable_data_ptr()), a.xs = r.xs;
    r.xm = static_cast<float*>(xm.mutable_data_ptr()), a.xm = r.xm;
    RHEO_CUDA_CHECK(quantize_rows_q8_cuda(r, current_stream(x)));
    RHEO_CUDA_CHECK(quant_linear_cuda(a, current_stream(x)));
#endif
    return;
  }
  // The Q8 rows of x in this thread's scratch (a decode step's matmuls reuse it: no allocation).
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xm;
  thread_local std::vector<int32_t> xs;
  xq.resize(n * in), xd.resize(n * nb), xs.resize(n * nb), xm.resize(n * nb);
  a.xq = r.xq = xq.data();
  a.xd = r.xd = xd.data();
  a.xs = r.xs = xs.data();
  a.xm = r.xm = xm.data();
  quantize_rows_q8_cpu(r);
  const int64_t panel_bytes = std::max<int64_t>(1, nb * quant_record_bytes(t));
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / panel_bytes);
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    QuantLinearArgs part = a;
    part.p_begin = begin, part.p_end = end;
    quant_linear_cpu(part);
  });
}

void quant_gather_rows(const at::Tensor& w, int64_t type, int64_t rows, const at::Tensor& ids,
                       at::Tensor& out) {
  const QuantType t = quant_type(type);
  RHEO_CHECK(out.dim() == 2, "out must be [n, in], got shape ", shape_str(out.sizes()));
  const int64_t n = out.size(0), in = out.size(1), nb = in / kQuantBlock;
  RHEO_CHECK(in % kQuantBlock == 0, "out must have in % 32 == 0 (blocks of 32 columns), got in=", in);
  RHEO_CHECK(rows >= 1, "rows must be >= 1 (W's rows), got ", rows);
  check_buffer(w, "w", at::kByte, {(rows + kQuantPanel - 1) / kQuantPanel, nb, quant_record_bytes(t)},
               "[ceil(rows / 16), in / 32, record bytes] (packed by rheo_engine.models.quant)");
  check_buffer(ids, "ids", at::kLong, {n}, "[n] int64");
  check_contiguous(out, "out");
  check_same_device(ids, "ids", w, "w");
  check_same_device(out, "out", w, "w");
  QuantGatherArgs a;
  a.w = static_cast<const uint8_t*>(w.const_data_ptr());
  a.type = t;
  a.rows = rows, a.in = in, a.n = n;
  a.ids = ids.const_data_ptr<int64_t>();
  a.out = out.mutable_data_ptr();
  a.dtype = float_dtype(out, "out");
  if (on_cuda(w, "w")) {
#ifdef RHEO_WITH_CUDA
    const DeviceGuard guard(w.device());
    RHEO_CUDA_CHECK(quant_gather_rows_cuda(a, current_stream(w)));
#endif
    return;
  }
  quant_gather_rows_cpu(a);
}

std::string quant_linear_amx() { return rheo::quant_linear_amx(); }
std::string set_quant_linear_amx(const std::string& mode) { return rheo::set_quant_linear_amx(mode); }
bool quant_linear_amx_self_check() { return rheo::quant_linear_amx_self_check(); }

}  // namespace rheo::bind
