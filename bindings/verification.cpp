// Binding of verification (csrc/include/rheo/verification.h): checks the logits, the tree, the
// q~ table and the outputs, fills VerificationArgs and calls the CPU or CUDA kernel by device.
// On CUDA only what the host knows is checked here (shapes, dtypes, scalars): the tree and q~
// rules need the data, so the kernel checks them on the device and reports in *status.
#include "binding_utils.h"
#include "bindings.h"
#include "rheo/verification.h"

#include <ATen/ops/empty.h>

#include <algorithm>


namespace rheo::bind {
namespace {

// Checks the inputs shared by both entry points and fills their part of the args.
VerificationArgs inputs(const at::Tensor& logits, const at::Tensor& tokens,
                        const at::Tensor& parents, const at::Tensor& sampled_row,
                        const at::Tensor& q_tilde_ids, const at::Tensor& q_tilde, int64_t method,
                        double T, double top_p, int64_t top_k, double min_p) {
  VerificationArgs a;
  check_tree_logits(logits, tokens, parents, a);
  check_buffer(sampled_row, "sampled_row", at::kInt, {a.B, a.N}, "[B, N]");
  check_buffer(q_tilde_ids, "q_tilde_ids", at::kInt, {-1, -1}, "[R, Se]");
  const at::ScalarType acc = acc_dtype(a.dtype);
  const char* acc_name = acc == at::kDouble ? "torch.float64" : "torch.float32";
  RHEO_CHECK(q_tilde.scalar_type() == acc, "q_tilde must have dtype ", acc_name, " (float64 for "
             "float64 logits, else float32), got ", at::toString(q_tilde.scalar_type()),
             "; convert it with .to(", acc_name, ")");
  check_buffer(q_tilde, "q_tilde", acc, {q_tilde_ids.size(0), q_tilde_ids.size(1)},
               "[R, Se] (the shape of q_tilde_ids)");
  for (const auto& [t, name] : {std::pair{&sampled_row, "sampled_row"},
                                {&q_tilde_ids, "q_tilde_ids"}, {&q_tilde, "q_tilde"}})
    check_same_device(*t, name, logits, "logits");
  RHEO_CHECK(top_k <= INT32_MAX, "top_k=", top_k, " must fit int32; use 0 to disable");
  a.logits = logits.data_ptr();
  a.tokens = tokens.data_ptr<int32_t>();
  a.parents = parents.data_ptr<int32_t>();
  a.sampled_row = sampled_row.data_ptr<int32_t>();
  a.q_tilde_ids = q_tilde_ids.data_ptr<int32_t>();
  a.q_tilde = q_tilde.data_ptr();
  a.R = q_tilde_ids.size(0);
  a.Se = q_tilde_ids.size(1);
  a.method = static_cast<VerifyMethod>(method);
  a.T = T;
  a.top_p = top_p;
  a.top_k = static_cast<int32_t>(top_k);
  a.min_p = min_p;
  return a;
}

// verify.read_outcome's row of each tree, written where the verdict is (the CPU): accept_len,
// bonus_token, the status word, the accepted path, its tokens (a -1 of the padding reads the
// root's) and the tree's depths; the step then reads it with one copy to Python.
void pack_outcome(const VerificationArgs& a, const int32_t* depth, int32_t* packed) {
  const int64_t P = a.path_capacity, N = a.N, width = 3 + 2 * P + N;
  const int32_t word = a.status != nullptr ? *a.status : 0;
  for (int64_t b = 0; b < a.B; ++b) {
    int32_t* row = packed + b * width;
    const int32_t* path = a.accept_path + b * P;
    row[0] = a.accept_len[b];
    row[1] = a.bonus_token[b];
    row[2] = word;
    for (int64_t j = 0; j < P; ++j) {
      row[3 + j] = path[j];
      row[3 + P + j] = a.tokens[b * N + std::max(path[j], 0)];
    }
    for (int64_t j = 0; j < N; ++j) row[3 + 2 * P + j] = depth[b * N + j];
  }
}

}  // namespace

void verification(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
                  const at::Tensor& sampled_row, const at::Tensor& q_tilde_ids,
                  const at::Tensor& q_tilde, int64_t method, double T, double top_p,
                  int64_t top_k, double min_p, uint64_t seed, uint64_t step,
                  at::Tensor& accept_path,
                  at::Tensor& accept_len, at::Tensor& bonus_token,
                  const std::optional<at::Tensor>& status, const std::optional<at::Tensor>& key,
                  const std::optional<at::Tensor>& depth, const std::optional<at::Tensor>& packed) {
  const bool cuda = on_cuda(logits, "logits");
  VerificationArgs a =
      inputs(logits, tokens, parents, sampled_row, q_tilde_ids, q_tilde, method, T, top_p, top_k,
             min_p);
  check_buffer(accept_path, "accept_path", at::kInt, {a.B, -1}, "[B, P]");
  check_buffer(accept_len, "accept_len", at::kInt, {a.B}, "[B]");
  check_buffer(bonus_token, "bonus_token", at::kInt, {a.B}, "[B]");
  check_same_device(accept_path, "accept_path", logits, "logits");
  check_same_device(accept_len, "accept_len", logits, "logits");
  check_same_device(bonus_token, "bonus_token", logits, "logits");
  a.seed = seed;
  a.step = step;
  a.key = key_ptr(key, logits, "logits");
  a.accept_path = accept_path.data_ptr<int32_t>();
  a.path_capacity = accept_path.size(1);
  a.accept_len = accept_len.data_ptr<int32_t>();
  a.bonus_token = bonus_token.data_ptr<int32_t>();
  a.status = status_ptr(status, logits, "logits");
  if (packed) {
    RHEO_CHECK(!cuda, "packed (the step's read, filled by the binding) is for CPU tensors; on "
               "CUDA read the verdict with verify.read_outcome's one copy");
    RHEO_CHECK(depth, "packed needs the tree's depth [B, N] (its last N columns)");
    check_buffer(*depth, "depth", at::kInt, {a.B, a.N}, "[B, N]");
    check_buffer(*packed, "packed", at::kInt, {a.B, 3 + 2 * a.path_capacity + a.N},
                 "[B, 3 + 2 P + N] (verify.read_outcome's row)");
  }
  if (!cuda) {
    verification_cpu(a);
    if (packed) pack_outcome(a, depth->data_ptr<int32_t>(), packed->data_ptr<int32_t>());
    return;
  }
#ifdef RHEO_WITH_CUDA
  // No host copy of the inputs (it would drain the stream and prevent CUDA-graph capture): a
  // tree or q~ table that breaks the rules sets kStatusBadVerifyInput, a non-finite target
  // logit at a visited node kStatusNonFiniteTarget, and that tree gets accept_len 1.
  verification_check_scalars(a);  // host values only (verification_cuda checks them too)
  const DeviceGuard guard(logits.device());
  // The [B, V] float64 workspace (the nodes' stats records; see verification.cu) from torch's
  // caching allocator (no cudaMalloc per call).
  // Its blocks are stream-ordered: freed when this returns, reused only by later work on the
  // same stream, so the kernel still running on it is safe.
  const at::Tensor workspace = at::empty({a.B, a.V}, logits.options().dtype(at::kDouble));
  a.workspace = workspace.data_ptr<double>();
  RHEO_CUDA_CHECK(verification_cuda(a, current_stream(logits)));
#endif
}

void verification_law(const at::Tensor& logits, const at::Tensor& tokens,
                      const at::Tensor& parents, const at::Tensor& sampled_row,
                      const at::Tensor& q_tilde_ids, const at::Tensor& q_tilde, int64_t method,
                      double T, double top_p, int64_t top_k, double min_p,
                      at::Tensor& accept_prob,
                      at::Tensor& emit_prob) {
  RHEO_CHECK(!on_cuda(logits, "logits"), "verification_law runs on the CPU only (tests and "
             "analysis); move the inputs with .cpu()");
  VerificationArgs a =
      inputs(logits, tokens, parents, sampled_row, q_tilde_ids, q_tilde, method, T, top_p, top_k,
             min_p);
  const at::ScalarType acc = acc_dtype(a.dtype);
  check_buffer(accept_prob, "accept_prob", acc, {a.B, a.N}, "[B, N]");
  check_buffer(emit_prob, "emit_prob", acc, {a.B, a.N, a.V}, "[B, N, V]");
  check_same_device(accept_prob, "accept_prob", logits, "logits");
  check_same_device(emit_prob, "emit_prob", logits, "logits");
  a.accept_prob = accept_prob.data_ptr();
  a.emit_prob = emit_prob.data_ptr();
  verification_law_cpu(a);
}

}  // namespace rheo::bind
