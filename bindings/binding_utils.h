// Tensor checks shared by the bindings: each turns a wrong tensor into a ValueError that names
// the argument, the rule, what was received and the fix (docs/kernels.md §5).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "rheo/common.h"

#if defined(RHEO_WITH_CUDA) && !defined(RHEO_CUDA_EMU)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#elif defined(RHEO_CUDA_EMU)
#include <cuda_runtime.h>  // csrc/emu's: the CUDA branches below run on the emulator (tests)
#endif

namespace rheo::bind {

inline std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

// Shape check; -1 in `expected` matches any size. `dims` names the dimensions, e.g. "[n, V]".
inline void check_shape(const at::Tensor& t, const char* name, const std::vector<int64_t>& expected,
                        const char* dims) {
  bool ok = t.dim() == static_cast<int64_t>(expected.size());
  for (size_t i = 0; ok && i < expected.size(); ++i)
    ok = expected[i] < 0 || t.size(static_cast<int64_t>(i)) == expected[i];
  if (!ok) {
    std::string want = "[";
    for (size_t i = 0; i < expected.size(); ++i)
      want += (i ? ", " : "") + (expected[i] < 0 ? std::string("*") : std::to_string(expected[i]));
    want += "]";
    fail(name, " must be ", dims, " = ", want, ", got ", shape_str(t.sizes()));
  }
}

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType want) {
  RHEO_CHECK(t.scalar_type() == want, name, " must have dtype ", at::toString(want), ", got ",
             at::toString(t.scalar_type()), "; convert it with .to(", at::toString(want), ")");
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  RHEO_CHECK(t.is_contiguous(), name, " must be contiguous (got strides ",
             shape_str(t.strides()), "); call .contiguous() first");
}

// A contiguous tensor of the given dtype and shape: the usual check for outputs and int inputs.
inline void check_buffer(const at::Tensor& t, const char* name, at::ScalarType dtype,
                         const std::vector<int64_t>& shape, const char* dims) {
  check_shape(t, name, shape, dims);
  check_dtype(t, name, dtype);
  check_contiguous(t, name);
}

inline void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                              const char* ref_name) {
  RHEO_CHECK(t.device() == ref.device(), name, " is on ", t.device().str(), " but ", ref_name,
             " is on ", ref.device().str(), "; move both to the same device");
}

// The pointer of an optional status word (common.h StatusBit): a [1] int32 tensor on the device of
// `ref`, or null for None. A CUDA kernel ORs a bit into it on bad input instead of raising (which
// would need a host sync); the CPU kernels raise at once and ignore it. The caller zeroes it and
// reads it once per step (rheo_engine.verify.read_outcome), so nothing here reads it.
inline int32_t* status_ptr(const std::optional<at::Tensor>& status, const at::Tensor& ref,
                           const char* ref_name) {
  if (!status) return nullptr;
  check_buffer(*status, "status", at::kInt, {1}, "[1]");
  check_same_device(*status, "status", ref, ref_name);
  return status->data_ptr<int32_t>();
}

// The coins' key [2] int64 (seed, step) on the device of `ref`, or null (rheo/common.h coin_key).
inline const int64_t* key_ptr(const std::optional<at::Tensor>& key, const at::Tensor& ref,
                              const char* ref_name) {
  if (!key) return nullptr;
  check_buffer(*key, "key", at::kLong, {2}, "[2] (seed, step)");
  check_same_device(*key, "key", ref, ref_name);
  return key->data_ptr<int64_t>();
}

// Floating dtype of a logits / activation tensor.
inline DType dtype_of(const at::Tensor& t, const char* name, bool allow_float64) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kDouble:
      if (allow_float64) return DType::kFloat64;
      break;
    default: break;
  }
  fail(name, " must be float32, float16 or bfloat16", allow_float64 ? " (or float64)" : "",
       ", got ", at::toString(t.scalar_type()));
}

// The first inputs of the kernels that walk B trees of N nodes (verification, logit controls):
// the target logits [B, N, V] (contiguous; fp32 / bf16 / fp16 / fp64) into args.dtype, B, N, V,
// and the trees' tokens and parents [B, N] int32 on the logits' device.
template <typename Args>
void check_tree_logits(const at::Tensor& logits, const at::Tensor& tokens,
                       const at::Tensor& parents, Args& a) {
  check_shape(logits, "logits", {-1, -1, -1}, "[B, N, V]");
  a.dtype = dtype_of(logits, "logits", /*allow_float64=*/true);
  check_contiguous(logits, "logits");
  a.B = logits.size(0);
  a.N = logits.size(1);
  a.V = logits.size(2);
  check_buffer(tokens, "tokens", at::kInt, {a.B, a.N}, "[B, N]");
  check_buffer(parents, "parents", at::kInt, {a.B, a.N}, "[B, N]");
  check_same_device(tokens, "tokens", logits, "logits");
  check_same_device(parents, "parents", logits, "logits");
}

// The accumulation dtype of the probability outputs: float64 for float64 logits, else float32.
inline at::ScalarType acc_dtype(DType dtype) {
  return dtype == DType::kFloat64 ? at::kDouble : at::kFloat;
}

// True when `t` lives on a CUDA device; raises a clear error on a CPU-only build. In the
// emulator's build of the bindings (RHEO_CUDA_EMU: tests/test_cuda_bindings.py) every CPU
// tensor stands for a device one, so each call takes the CUDA branch a GPU user's call takes,
// with the emulator running the .cu kernels on host memory.
inline bool on_cuda(const at::Tensor& t, const char* name) {
  if (!t.is_cuda()) {
    RHEO_CHECK(t.device().is_cpu(), name, " is on ", t.device().str(),
               "; rheo_engine kernels run on cpu or cuda tensors only");
#ifdef RHEO_CUDA_EMU
    return true;
#else
    return false;
#endif
  }
#ifdef RHEO_WITH_CUDA
  return true;
#else
  fail(name, " is a CUDA tensor but rheo_engine._C was built without CUDA kernels; rebuild with "
       "nvcc on PATH (or FORCE_CUDA=1): pip install --no-build-isolation -e .");
#endif
}

#ifdef RHEO_WITH_CUDA
#define RHEO_CUDA_CHECK(expr)                                                          \
  do {                                                                                 \
    const cudaError_t err_ = (expr);                                                   \
    if (err_ != cudaSuccess)                                                           \
      throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorString(err_) + \
                               " at " + __FILE__ + ":" + std::to_string(__LINE__));    \
  } while (0)

#ifdef RHEO_CUDA_EMU
struct DeviceGuard {  // one emulated device: nothing to switch
  explicit DeviceGuard(const c10::Device&) {}
};
inline cudaStream_t current_stream(const at::Tensor&) { return nullptr; }  // launches run inline
#else
using DeviceGuard = c10::cuda::CUDAGuard;  // the tensor's device for the launch
inline cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}
#endif
#endif

}  // namespace rheo::bind
