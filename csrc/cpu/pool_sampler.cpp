// Pool sampler on the CPU (contract: csrc/include/rheo/pool_sampler.h, docs/algorithm.md §4).
//
// One row at a time (OpenMP over rows). Per row:
//   pass 1  over V: the Se highest logits in a bounded heap and a finiteness check; 16 logits at
//                   a time are compared with the heap's worst entry, and only passing lanes are
//                   inserted (rare once the heap is full);
//   pass 2  over V: the untempered mass outside the support, sum exp(l - M) for l below the
//                   support (M = the row max = the best support logit);
//   then, on the Se support entries only, in double: log q, the leads, z, q~, Y, the fills.
// fp32 / bf16 / fp16 rows are read as float 16 lanes at a time (cpu_math.h, converted on the fly)
// and exponentials over V use its float polynomial exp (max rel. error about 2e-7), summed in
// float per block of kSumBlock and then in double; every quantity on the support uses std::exp in
// double. The fp64 path (exact tests) is scalar, in double throughout.
//
// Passes 1 and 2 are in pool_sampler_support.cpp; pool_sampler_internal.h holds what both share.
#include "rheo/pool_sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "pool_sampler_internal.h"

namespace rheo {

void pool_sampler_check_args(const PoolSamplerArgs& a) {
  RHEO_CHECK(a.n >= 0, "n=", a.n, " rows must be >= 0");
  RHEO_CHECK(a.V >= 1, "V=", a.V, ": the draft vocabulary must hold at least one token");
  RHEO_CHECK(a.row_stride >= a.V, "row_stride=", a.row_stride, " must be >= V=", a.V,
             "; pass logits with unit stride along V");
  RHEO_CHECK(a.K >= 1, "K=", a.K, " must be >= 1: a pool has at least one child; raise topk");
  RHEO_CHECK(a.K <= a.V, "K=", a.K, " > V=", a.V,
             ": the pool needs K distinct tokens; lower topk to at most V");
  RHEO_CHECK(a.m >= 0 && a.m < a.K, "m=", a.m, " must be in [0, K=", a.K,
             "): the pool keeps a slot for the sampled token after the m leads; lower leads");
  RHEO_CHECK(a.S >= a.K, "support=", a.S, " < topk=", a.K,
             ": the pool needs K draft tokens in the support; raise support");
  RHEO_CHECK(std::isfinite(a.T) && a.T >= 0.0, "T=", a.T,
             " must be finite and >= 0 (0 = greedy); pass a temperature such as 1.0");
  RHEO_CHECK(a.kind == PoolKind::kTopK || a.kind == PoolKind::kRheo, "kind=",
             static_cast<int>(a.kind), " must be 0 (topk) or 1 (rheo)");
}

namespace {

using pool_sampler_detail::Entry;
using pool_sampler_detail::RowError;
using pool_sampler_detail::scan_support;

// Y ~ q~ on support minus leads (support indices m..Se-1), weights w_j = exp((l_j - l_m) / T).
// Writes q~ into qt[0..Se) and returns the support index of Y; -1 when z_T underflows (the
// degenerate case of docs/algorithm.md §4: no sampled child, qt all 0). `forced` is a support index
// to pin Y to, or -1 to draw with the coin `u` by inverse CDF in support order. Each weight is
// one exp, kept in qt until the draw is done.
int64_t sample_tilde(const double* l, int64_t Se, int32_t m, double T, double u, int64_t forced,
                     double tiny, double* qt) {
  std::fill(qt, qt + m, 0.0);
  double W = 0.0;  // tempered mass of the non-leads, relative to l_m
  for (int64_t j = m; j < Se; ++j) W += (qt[j] = std::exp((l[j] - l[m]) / T));
  // z_T = tempered mass outside the leads over all of it (relative to l_0), in logs so that no
  // term overflows: all = sum_{j<m} exp((l_j - l_0)/T) + exp((l_m - l_0)/T) * W.
  const double shift = (l[m] - l[0]) / T;
  double leads = 0.0;
  for (int64_t j = 0; j < m; ++j) leads += std::exp((l[j] - l[0]) / T);
  const double all = leads + std::exp(shift) * W;
  const double log_zT = shift + std::log(W) - std::log(all);
  if (m > 0 && !(log_zT >= std::log(tiny))) {
    std::fill(qt, qt + Se, 0.0);
    return -1;
  }
  int64_t y = forced;
  if (y < 0) {
    const double target = u * W;
    double running = 0.0;
    int64_t last_positive = m;
    for (int64_t j = m; j < Se && y < 0; ++j) {
      if (qt[j] > 0.0) last_positive = j;
      running += qt[j];
      if (running > target) y = j;
    }
    if (y < 0) y = last_positive;  // rounding left u * W at or past the running total
  }
  for (int64_t j = m; j < Se; ++j) qt[j] /= W;
  return y;
}

// Support index of the forced token (or -1 for "draw"); error when it cannot be Y.
int64_t forced_index(int32_t token, const int32_t* ids, int64_t Se, int32_t m, RowError& err) {
  if (token == -1) return -1;
  const int64_t j = std::find(ids, ids + Se, token) - ids;
  if (j == Se) err = {2, token, 0.0, "is not in the support (the Se highest logits of the row)"};
  else if (j < m) err = {2, token, 0.0, "is a lead (one of the m highest logits), not a sample"};
  return err.code ? -1 : j;
}

template <typename Real, typename Acc>
void pool_row(const PoolSamplerArgs& a, int64_t r, std::vector<Entry<Real>>& heap,
              std::vector<int32_t>& chunks, std::vector<Entry<float>>& cand,
              std::vector<double>& work, RowError& err) {
  const int64_t Se = std::min<int64_t>(a.S, a.V);
  const size_t elem = a.dtype == DType::kFloat64 ? 8 : a.dtype == DType::kFloat32 ? 4 : 2;
  const void* row = static_cast<const char*>(a.logits) + r * a.row_stride * elem;
  double outside;
  if (!scan_support<Real>(row, a.dtype, a.V, Se, heap, chunks, cand, &outside, err)) return;
  const Real M = heap[0].logit;
  double* l = work.data();        // [Se] support logits, support order
  double* log_q = l + Se;         // [Se] log q on the support
  double* qt = log_q + Se;        // [Se] q~ on the support
  int32_t* ids = a.q_tilde_ids + r * Se;
  double* mass = qt + Se;          // [Se] exp(l - M) on the support (untempered)
  // log q = l - log-sum-exp over V; the support part of the sum is exact in double.
  double support_mass = 0.0;
  for (int64_t j = 0; j < Se; ++j) {
    ids[j] = heap[j].id;
    l[j] = static_cast<double>(heap[j].logit);
    support_mass += (mass[j] = std::exp(l[j] - static_cast<double>(M)));
  }
  const double log_total = std::log(outside + support_mass);
  for (int64_t j = 0; j < Se; ++j) log_q[j] = l[j] - static_cast<double>(M) - log_total;
  // T = 0 forces the plain top-K pool for every kind (greedy; docs/algorithm.md §9).
  const int32_t m = a.m;
  const bool rheo = a.kind == PoolKind::kRheo && a.T > 0.0;
  const int32_t forced_token = a.forced_sample ? a.forced_sample[r] : -1;
  int64_t y = -1;
  if (rheo) {
    const int64_t forced = forced_index(forced_token, ids, Se, m, err);
    if (err.code) return;
    const CoinKey key = coin_key(a.key, a.seed, a.step);
    const double u = pool_coin(key.seed, key.step, a.level, static_cast<uint32_t>(r));
    y = sample_tilde(l, Se, m, a.T, u, forced, std::numeric_limits<Acc>::min(), qt);
    if (forced >= 0 && (y < 0 || !(qt[forced] > 0.0))) {
      err = {2, forced_token, 0.0, y < 0 ? "pins a row without a sampled slot (z_T underflows)"
                                         : "has q~ = 0 (it can never be drawn)"};
      return;
    }
  } else {
    std::fill(qt, qt + Se, 0.0);
    if (forced_token != -1) {
      err = {2, forced_token, 0.0, "pins a row without a sampled slot (kind=topk or T=0)"};
      return;
    }
  }
  // Slots: leads 0..m-1, then Y at slot m (if any), then the best remaining support entries.
  int32_t* tokens = a.tokens + r * a.K;
  Acc* log_proxy = static_cast<Acc*>(a.log_proxy) + r * a.K;
  int64_t j = 0;
  for (int32_t slot = 0; slot < a.K; ++slot) {
    if (y >= 0 && slot == m) {
      tokens[slot] = ids[y];
      // Lemma 4: q_proxy = min(q(x_m), z) >= q(x_{m+1}) >= q(any fill), so Y always ranks at
      // slot m+1 whatever it is; the max() only guards against rounding. Never use q(Y) here.
      // z is the untempered mass outside the leads, summed directly (outside + support
      // entries m..Se-1) rather than 1 - sum q(x_i), which cancels when the leads hold ~all mass.
      double proxy;
      if (m == 0) {
        proxy = std::log(std::min(1.0, std::exp(log_q[0]) + kProxyEpsilon));
      } else {
        double nonlead = outside;
        for (int64_t k = Se - 1; k >= m; --k) nonlead += mass[k];
        proxy = std::min(log_q[m - 1], std::log(nonlead) - log_total);
      }
      log_proxy[slot] = static_cast<Acc>(std::max(proxy, log_q[m]));
      continue;
    }
    if (j == y) ++j;  // Y already holds slot m; fills skip it
    tokens[slot] = ids[j];
    log_proxy[slot] = static_cast<Acc>(log_q[j]);
    ++j;
  }
  Acc* q_tilde = static_cast<Acc*>(a.q_tilde) + r * Se;
  for (int64_t k = 0; k < Se; ++k) q_tilde[k] = static_cast<Acc>(qt[k]);
  a.sampled_slot[r] = y >= 0 ? m : -1;
  static_cast<Acc*>(a.q_sampled)[r] = static_cast<Acc>(y >= 0 ? qt[y] : 0.0);
}

template <typename Real, typename Acc>
void pool_rows(const PoolSamplerArgs& a, std::vector<RowError>& errors) {
  const int64_t Se = std::min<int64_t>(a.S, a.V);
#pragma omp parallel if (a.n > 1 && a.n * a.V >= (1 << 16))
  {
    std::vector<Entry<Real>> heap(Se);  // [Se] the support, support order
    std::vector<int32_t> chunks;         // float rows: [V / 16 + 1] chunk maxima of pass 1
    std::vector<Entry<float>> cand;      // float rows: [>= Se] candidates of pass 2
    std::vector<double> work(4 * Se);  // l, log q, q~, exp(l - M) on the support
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < a.n; ++r) pool_row<Real, Acc>(a, r, heap, chunks, cand, work, errors[r]);
  }
}

}  // namespace

void pool_sampler_cpu(const PoolSamplerArgs& a) {
  pool_sampler_check_args(a);
  std::vector<RowError> errors(a.n);
  switch (a.dtype) {
    case DType::kFloat64: pool_rows<double, double>(a, errors); break;
    default: pool_rows<float, float>(a, errors); break;
  }
  // Errors are collected per row inside the parallel region and raised here (first row wins).
  for (int64_t r = 0; r < a.n; ++r) {
    const RowError& e = errors[r];
    if (e.code == 1)
      fail("logits[", r, ", ", e.token, "] = ", e.value,
           " is not finite: the draft logits must be finite (row ", r, ", token ", e.token,
           "); drop masked tokens from the vocabulary instead of setting them to -inf");
    if (e.code == 2)
      fail("forced_sample[", r, "] = ", e.token, " ", e.why,
           "; pass -1 to draw, or a non-lead support token with q~ > 0");
  }
}

}  // namespace rheo
