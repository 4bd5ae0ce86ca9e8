// Logit controls on the CPU (contract in csrc/include/rheo/logit_controls.h): for each node row,
// walk its path to the root, then penalise the tokens of its history once each, then ban the
// suppressed tokens at shallow nodes. Work per row is O(H log H + depth^2): the row itself is
// only touched at those tokens.
#include <algorithm>
#include <cmath>
#include <vector>

#include "rheo/logit_controls.h"

namespace rheo {
namespace {

// The path tokens of node i (root excluded, deepest first) and its depth.
int64_t path_of(const LogitControlsArgs& a, int64_t b, int64_t i, std::vector<int32_t>& path) {
  path.clear();
  const int32_t* tokens = a.tokens + b * a.N;
  const int32_t* parents = a.parents + b * a.N;
  for (int64_t j = i; j > 0; j = parents[j]) path.push_back(tokens[j]);
  return static_cast<int64_t>(path.size());
}

template <typename T>
void control_row(const LogitControlsArgs& a, int64_t b, int64_t i, std::vector<int32_t>& path) {
  T* row = static_cast<T*>(a.logits) + (b * a.N + i) * a.V;
  const int64_t depth = path_of(a, b, i, path);
  const int32_t* ids = a.history_ids + b * a.H;
  const int32_t* counts = a.history_counts + b * a.H;
  const int64_t n = a.history_len[b];
  const T r = static_cast<T>(a.repetition_penalty), pres = static_cast<T>(a.presence_penalty),
          freq = static_cast<T>(a.frequency_penalty);
  const auto on_path = [&](int32_t v, int64_t end) {  // occurrences of v in path[0, end)
    return static_cast<int32_t>(std::count(path.begin(), path.begin() + end, v));
  };
  // The sequence's tokens: generated count plus their occurrences on the path.
  for (int64_t h = 0; h < n; ++h)
    row[ids[h]] = penalised_logit(row[ids[h]], counts[h] + on_path(ids[h], depth), r, pres, freq);
  // Path tokens new to the sequence, each once (at its first occurrence).
  for (int64_t j = 0; j < depth; ++j) {
    const int32_t v = path[j];
    if (on_path(v, j) > 0 || std::binary_search(ids, ids + n, v)) continue;
    row[v] = penalised_logit(row[v], on_path(v, depth), r, pres, freq);
  }
  if (depth < a.suppress_below[b])
    for (int64_t e = 0; e < a.E; ++e) row[a.suppress_ids[e]] = banned_logit<T>();
}

bool penalties_on(const LogitControlsArgs& a) {
  return a.repetition_penalty != 1.0 || a.presence_penalty != 0.0 || a.frequency_penalty != 0.0;
}

}  // namespace

void logit_controls_check_scalars(const LogitControlsArgs& a) {
  RHEO_CHECK(a.B >= 1 && a.N >= 1 && a.V >= 1, "logits must be [B, N, V] with B, N, V >= 1, got [",
             a.B, ", ", a.N, ", ", a.V, "]");
  RHEO_CHECK(a.dtype == DType::kFloat32 || a.dtype == DType::kFloat64, "logit controls run on "
             "float32 or float64 logits; convert bf16/fp16 rows with .float() first");
  RHEO_CHECK(a.H >= 0 && a.E >= 0, "history [B, H] and suppress_ids [E] need H, E >= 0");
  RHEO_CHECK(std::isfinite(a.repetition_penalty) && a.repetition_penalty > 0.0,
             "repetition_penalty=", a.repetition_penalty, " must be a finite number > 0 (1 = off)");
  RHEO_CHECK(std::isfinite(a.presence_penalty), "presence_penalty=", a.presence_penalty,
             " must be finite (0 = off)");
  RHEO_CHECK(std::isfinite(a.frequency_penalty), "frequency_penalty=", a.frequency_penalty,
             " must be finite (0 = off)");
  RHEO_CHECK(a.E < a.V, "suppress_ids has ", a.E, " tokens but V = ", a.V, ": at least one token "
             "must stay possible");
}

void logit_controls_check_args(const LogitControlsArgs& a) {
  logit_controls_check_scalars(a);
  for (int64_t b = 0; b < a.B; ++b) {
    const int32_t* parents = a.parents + b * a.N;
    const int32_t* tokens = a.tokens + b * a.N;
    RHEO_CHECK(parents[0] == -1, "parents[", b, ", 0] = ", parents[0], ": node 0 is the root and "
               "must have parent -1");
    for (int64_t j = 1; j < a.N; ++j) {
      RHEO_CHECK(parents[j] >= 0 && parents[j] < j, "parents[", b, ", ", j, "] = ", parents[j],
                 ": a node's parent must precede it (0 <= parent < node); lay the tree out with "
                 "build_tree");
      RHEO_CHECK(tokens[j] >= 0 && tokens[j] < a.V, "tokens[", b, ", ", j, "] = ", tokens[j],
                 " is outside the vocabulary [0, V = ", a.V, ")");
    }
    const int32_t n = a.history_len[b];
    RHEO_CHECK(n >= 0 && n <= a.H, "history_len[", b, "] = ", n, " must be in [0, H = ", a.H, "]");
    for (int64_t h = 0; h < n; ++h) {
      const int32_t v = a.history_ids[b * a.H + h], c = a.history_counts[b * a.H + h];
      RHEO_CHECK(v >= 0 && v < a.V, "history_ids[", b, ", ", h, "] = ", v, " is outside the "
                 "vocabulary [0, V = ", a.V, ")");
      RHEO_CHECK(h == 0 || a.history_ids[b * a.H + h - 1] < v, "history_ids[", b, "] must be "
                 "strictly ascending (distinct tokens, sorted); entry ", h, " is ", v, " after ",
                 a.history_ids[b * a.H + h - 1]);
      RHEO_CHECK(c >= 0, "history_counts[", b, ", ", h, "] = ", c, " must be >= 0");
    }
    RHEO_CHECK(a.suppress_below[b] >= 0, "suppress_below[", b, "] = ", a.suppress_below[b],
               " must be >= 0 (0 = never)");
  }
  std::vector<int32_t> seen(a.E);
  for (int64_t e = 0; e < a.E; ++e) {
    const int32_t v = a.suppress_ids[e];
    RHEO_CHECK(v >= 0 && v < a.V, "suppress_ids[", e, "] = ", v, " is outside the vocabulary "
               "[0, V = ", a.V, ")");
    seen[e] = v;
  }
  std::sort(seen.begin(), seen.end());
  RHEO_CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end(),
             "suppress_ids must be distinct tokens");
}

void logit_controls_cpu(const LogitControlsArgs& a) {
  logit_controls_check_args(a);
  bool any_ban = false;
  for (int64_t b = 0; b < a.B; ++b) any_ban |= a.E > 0 && a.suppress_below[b] > 0;
  if (!penalties_on(a) && !any_ban) return;
  std::vector<int32_t> path;
  path.reserve(a.N);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t i = 0; i < a.N; ++i) {
      if (a.dtype == DType::kFloat64)
        control_row<double>(a, b, i, path);
      else
        control_row<float>(a, b, i, path);
    }
}

}  // namespace rheo
