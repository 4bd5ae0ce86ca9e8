// Binding of the skinny linear layer (csrc/include/rheo/skinny_linear.h): checks x, w and y,
// fills SkinnyLinearArgs and calls the CUDA kernel, or the CPU kernel on blocks of output rows
// spread over torch's own thread pool (at::parallel_for: no second OpenMP team spins beside it).
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "binding_utils.h"
#include "bindings.h"
#include "rheo/skinny_linear.h"

namespace rheo::bind {
namespace {

// Threads take output rows in units of kRowBlock (a multiple of the CPU kernel's 3-, 4- and
// 6-row tiles), and at least kGrainBytes of W per task: a smaller task costs more to hand out
// than it saves. (Any split gives the same bits; this one keeps the tiles full.)
constexpr int64_t kRowBlock = 24;
constexpr int64_t kGrainBytes = 256 * 1024;

DType linear_dtype(const at::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16) return DType::kBFloat16;
  if (x.scalar_type() == at::kFloat) return DType::kFloat32;
  fail("x must be bfloat16 or float32, got ", at::toString(x.scalar_type()),
       "; convert it with .to(torch.bfloat16)");
}

// x [..., in] is read as n rows of `in` dense elements, one row stride apart: its leading dims
// must flatten into one (any contiguous tensor, a row slice of a wider one) and the rows must
// not overlap. Returns that row stride (elements).
int64_t row_stride(const at::Tensor& x, int64_t in) {
  bool ok = in <= 1 || x.stride(-1) == 1;
  int64_t stride = -1;    // of the innermost leading dim of size > 1: the row stride
  int64_t expected = -1;  // the stride the next outer dim of size > 1 must have to flatten
  for (int64_t d = x.dim() - 2; d >= 0; --d) {
    if (x.size(d) == 1) continue;  // a size-1 dim has no stride to follow
    if (stride < 0) {
      stride = x.stride(d);
      ok = ok && stride >= in;
    } else {
      ok = ok && x.stride(d) == expected;
    }
    expected = x.stride(d) * x.size(d);
  }
  RHEO_CHECK(ok, "x must have dense, non-overlapping rows that flatten into one stride (strides ",
             "[..., >= in, 1]), got strides ", shape_str(x.strides()), " for shape ",
             shape_str(x.sizes()), "; call .contiguous() first");
  return stride < 0 ? in : stride;
}

void check_inputs(const at::Tensor& x, const at::Tensor& w, const at::Tensor& y) {
  RHEO_CHECK(x.dim() >= 1, "x must be [..., in], got shape ", shape_str(x.sizes()));
  const int64_t in = x.size(-1);
  check_shape(w, "w", {-1, in}, "[out, in]");
  linear_dtype(x);
  check_dtype(w, "w", x.scalar_type());
  check_contiguous(w, "w");
  std::vector<int64_t> y_shape(x.sizes().begin(), x.sizes().end() - 1);
  y_shape.push_back(w.size(0));
  check_buffer(y, "y", x.scalar_type(), y_shape, "[..., out] (the leading dims of x)");
  check_same_device(w, "w", x, "x");
  check_same_device(y, "y", x, "x");
}

}  // namespace

void skinny_linear(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  check_inputs(x, w, y);
  const bool cuda = on_cuda(x, "x");
  SkinnyLinearArgs args;
  args.dtype = linear_dtype(x);
  args.in = x.size(-1);
  args.out = w.size(0);
  args.n = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) args.n *= x.size(d);
  if (args.n == 0 || args.out == 0) return;
  args.x = x.const_data_ptr();
  args.w = w.const_data_ptr();
  args.y = y.mutable_data_ptr();
  args.x_stride = row_stride(x, args.in);
  args.y_stride = args.out;
  args.o_begin = 0;
  args.o_end = args.out;
  if (cuda) {
#ifdef RHEO_WITH_CUDA
    const DeviceGuard guard(x.device());
    RHEO_CUDA_CHECK(skinny_linear_cuda(args, current_stream(x)));
#endif
    return;
  }
  const int64_t block_bytes = std::max<int64_t>(1, kRowBlock * args.in * w.element_size());
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / block_bytes);
  const int64_t blocks = (args.out + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    SkinnyLinearArgs part = args;
    part.o_begin = begin * kRowBlock;
    part.o_end = std::min(end * kRowBlock, args.out);
    skinny_linear_cpu(part);
  });
}

bool skinny_linear_bf16_dot() { return skinny_linear_bf16_dot_on(); }
bool set_skinny_linear_bf16_dot(bool on) { return skinny_linear_set_bf16_dot(on); }

}  // namespace rheo::bind
