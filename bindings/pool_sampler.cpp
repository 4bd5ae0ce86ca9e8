// Binding of the pool sampler (csrc/include/rheo/pool_sampler.h): checks the tensors, fills
// PoolSamplerArgs and runs the CPU or CUDA kernel on the device of `logits`.
#include "rheo/pool_sampler.h"

#include <limits>

#include "binding_utils.h"
#include "bindings.h"

namespace rheo::bind {

namespace {

int32_t to_int32(int64_t v, const char* name) {
  RHEO_CHECK(v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(),
             name, "=", v, " does not fit in int32; pass a smaller value");
  return static_cast<int32_t>(v);
}

}  // namespace

void pool_sampler(const at::Tensor& logits, int64_t K, int64_t m, int64_t S, double T, int64_t kind,
                  uint64_t seed, uint64_t step, int64_t level,
                  const std::optional<at::Tensor>& forced_sample, at::Tensor& tokens,
                  at::Tensor& log_proxy, at::Tensor& sampled_slot, at::Tensor& q_tilde_ids,
                  at::Tensor& q_tilde, at::Tensor& q_sampled,
                  const std::optional<at::Tensor>& status, const std::optional<at::Tensor>& key) {
  check_shape(logits, "logits", {-1, -1}, "[n, V]");
  PoolSamplerArgs a;
  a.dtype = dtype_of(logits, "logits", /*allow_float64=*/true);
  a.n = logits.size(0);
  a.V = logits.size(1);
  RHEO_CHECK(a.V <= std::numeric_limits<int32_t>::max(), "V=", a.V,
             " does not fit the int32 token ids; split the vocabulary");
  RHEO_CHECK(logits.stride(1) == 1 || a.V == 1, "logits must have unit stride along V (got ",
             "strides ", shape_str(logits.strides()), "); call .contiguous() first");
  a.row_stride = a.n > 1 ? logits.stride(0) : a.V;
  a.K = to_int32(K, "K");
  a.m = to_int32(m, "m");
  a.S = to_int32(S, "S");
  a.T = T;
  RHEO_CHECK(kind == 0 || kind == 1, "kind=", kind, " must be 0 (topk) or 1 (rheo)");
  a.kind = static_cast<PoolKind>(kind);
  a.seed = seed;
  a.step = step;
  RHEO_CHECK(level >= 0 && level <= std::numeric_limits<uint32_t>::max(), "level=", level,
             " must be a draft level in [0, 2^32)");
  a.level = static_cast<uint32_t>(level);
  pool_sampler_check_args(a);  // bad K, m, S, T raise before any work

  const int64_t Se = std::min<int64_t>(a.S, a.V);
  const at::ScalarType acc = acc_dtype(a.dtype);
  check_buffer(tokens, "tokens", at::kInt, {a.n, a.K}, "[n, K]");
  check_buffer(log_proxy, "log_proxy", acc, {a.n, a.K}, "[n, K]");
  check_buffer(sampled_slot, "sampled_slot", at::kInt, {a.n}, "[n]");
  check_buffer(q_tilde_ids, "q_tilde_ids", at::kInt, {a.n, Se}, "[n, Se]");
  check_buffer(q_tilde, "q_tilde", acc, {a.n, Se}, "[n, Se]");
  check_buffer(q_sampled, "q_sampled", acc, {a.n}, "[n]");
  for (const at::Tensor* t :
       {&tokens, &log_proxy, &sampled_slot, &q_tilde_ids, &q_tilde, &q_sampled})
    check_same_device(*t, "every output", logits, "logits");
  if (forced_sample) {
    check_buffer(*forced_sample, "forced_sample", at::kInt, {a.n}, "[n]");
    check_same_device(*forced_sample, "forced_sample", logits, "logits");
    a.forced_sample = forced_sample->data_ptr<int32_t>();
  }

  a.logits = logits.data_ptr();
  a.tokens = tokens.data_ptr<int32_t>();
  a.log_proxy = log_proxy.data_ptr();
  a.sampled_slot = sampled_slot.data_ptr<int32_t>();
  a.q_tilde_ids = q_tilde_ids.data_ptr<int32_t>();
  a.q_tilde = q_tilde.data_ptr();
  a.q_sampled = q_sampled.data_ptr();
  a.status = status_ptr(status, logits, "logits");
  a.key = key_ptr(key, logits, "logits");
  if (a.n == 0) return;
  if (on_cuda(logits, "logits")) {
#ifdef RHEO_WITH_CUDA
    RHEO_CHECK(Se <= 2048, "support=", a.S, " gives Se=", Se, " > 2048, the largest ",
               "support the CUDA pool sampler ranks (pool_sampler.cu kMaxSupport); lower support");
    const DeviceGuard guard(logits.device());
    // No host check of the outputs (it would sync): a NaN/inf row or a forced token that
    // cannot be Y sets kStatusNonFiniteDraft / kStatusBadForced in *status instead.
    RHEO_CUDA_CHECK(pool_sampler_cuda(a, current_stream(logits)));
#endif
    return;
  }
  pool_sampler_cpu(a);
}

}  // namespace rheo::bind
