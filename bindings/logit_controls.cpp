// Binding of logit controls (csrc/include/rheo/logit_controls.h): checks the logits, the tree and
// the history buffers, fills LogitControlsArgs and calls the CPU or CUDA kernel by device. On
// CUDA the host checks shapes, dtypes and scalars; the kernel checks the data (status bit).
#include "binding_utils.h"
#include "bindings.h"
#include "rheo/logit_controls.h"

namespace rheo::bind {

void logit_controls(at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
                    const at::Tensor& history_ids, const at::Tensor& history_counts,
                    const at::Tensor& history_len, const at::Tensor& suppress_ids,
                    const at::Tensor& suppress_below, double repetition_penalty,
                    double presence_penalty, double frequency_penalty,
                    const std::optional<at::Tensor>& status) {
  LogitControlsArgs a;
  check_tree_logits(logits, tokens, parents, a);
  check_buffer(history_ids, "history_ids", at::kInt, {a.B, -1}, "[B, H]");
  check_buffer(history_counts, "history_counts", at::kInt, {a.B, history_ids.size(1)},
               "[B, H] (the shape of history_ids)");
  check_buffer(history_len, "history_len", at::kInt, {a.B}, "[B]");
  check_buffer(suppress_ids, "suppress_ids", at::kInt, {-1}, "[E]");
  check_buffer(suppress_below, "suppress_below", at::kInt, {a.B}, "[B]");
  for (const auto& [t, name] :
       {std::pair{&history_ids, "history_ids"}, {&history_counts, "history_counts"},
        {&history_len, "history_len"},
        {&suppress_ids, "suppress_ids"}, {&suppress_below, "suppress_below"}})
    check_same_device(*t, name, logits, "logits");
  a.logits = logits.data_ptr();
  a.tokens = tokens.data_ptr<int32_t>();
  a.parents = parents.data_ptr<int32_t>();
  a.history_ids = history_ids.data_ptr<int32_t>();
  a.history_counts = history_counts.data_ptr<int32_t>();
  a.history_len = history_len.data_ptr<int32_t>();
  a.H = history_ids.size(1);
  a.suppress_ids = suppress_ids.data_ptr<int32_t>();
  a.E = suppress_ids.size(0);
  a.suppress_below = suppress_below.data_ptr<int32_t>();
  a.repetition_penalty = repetition_penalty;
  a.presence_penalty = presence_penalty;
  a.frequency_penalty = frequency_penalty;
  a.status = status_ptr(status, logits, "logits");
  if (!on_cuda(logits, "logits")) {
    logit_controls_cpu(a);
    return;
  }
#ifdef RHEO_WITH_CUDA
  const DeviceGuard guard(logits.device());
  RHEO_CUDA_CHECK(logit_controls_cuda(a, current_stream(logits)));
#endif
}

}  // namespace rheo::bind
