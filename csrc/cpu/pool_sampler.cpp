// Pool sampler on the CPU (contract: csrc/include/rheo/pool_sampler.h, DESIGN.md §2.1).
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
#include "rheo/pool_sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

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

using cpu::Float16;
using cpu::Int16;
using cpu::kLanes;

constexpr int64_t kSumBlock = 1024;  // elements summed in float before the sum goes to double

template <typename Real>
struct Entry {
  Real logit;
  int32_t id;
};

// Support order: descending logit, ties lower token id first. As a heap comparator it keeps the
// worst entry of the support on top.
struct Better {
  template <typename Real>
  bool operator()(const Entry<Real>& a, const Entry<Real>& b) const {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  }
};

// Replaces the heap's worst entry (the root) by `e`, which ranks before it, and restores the heap.
template <typename Real>
inline void replace_worst(Entry<Real>* heap, int64_t size, Entry<Real> e) {
  int64_t j = 0;
  while (true) {
    int64_t child = 2 * j + 1;
    if (child >= size) break;
    if (child + 1 < size && Better()(heap[child], heap[child + 1])) ++child;  // the worse child
    if (!Better()(e, heap[child])) break;
    heap[j] = heap[child];
    j = child;
  }
  heap[j] = e;
}

struct RowError {
  int code = 0;  // 0 ok, 1 non-finite logit, 2 bad forced sample
  int64_t token = 0;
  double value = 0.0;
  const char* why = "";
};

// Pass 1 (float rows): the row max M as an order key, the max key of each chunk of whole 16-lane
// blocks into chunk_max[0..n_chunks), and the first non-finite logit (or -1). With n_chunks >= Se
// the Se-th largest chunk max t is a floor for the support: Se chunks hold a logit >= t, so every
// support entry is >= t. About kChunksPerSlot chunks per support slot keep t close to the Se-th
// largest logit (few candidates in pass 2); V < 16 Se gives no floor (every logit a candidate).
constexpr int64_t kChunksPerSlot = 4;

inline int64_t chunk_length(int64_t V, int64_t Se) {
  return std::max<int64_t>(kLanes, V / (kChunksPerSlot * Se * kLanes) * kLanes);
}

template <typename Row>
RHEO_ALWAYS_INLINE int64_t bound_row(const typename Row::Elem* row, int64_t V, int64_t Se,
                                     int32_t* max_key, int32_t* chunk_max) {
  const int64_t chunk = chunk_length(V, Se), n_chunks = V / chunk;
  Int16 bad = Int16{}, row_max = Int16{} + std::numeric_limits<int32_t>::min();
  for (int64_t c = 0; c < n_chunks; ++c) {
    Int16 in_chunk = Int16{} + std::numeric_limits<int32_t>::min();
    for (int64_t i = c * chunk; i < (c + 1) * chunk; i += kLanes) {
      const Float16 v = Row::load16(row + i);
      bad |= cpu::ones_where_non_finite(v);
      const Int16 key = cpu::order_key16(v);
      in_chunk = key > in_chunk ? key : in_chunk;
    }
    row_max = in_chunk > row_max ? in_chunk : row_max;
    chunk_max[c] = cpu::max16(in_chunk);
  }
  int32_t top = cpu::max16(row_max);
  for (int64_t i = n_chunks * chunk; i < V; ++i) {
    const float x = Row::load1(row, i);
    bad[0] |= !std::isfinite(x);
    top = std::max(top, cpu::order_key(x));
  }
  *max_key = top;
  if (!cpu::any16(bad)) return -1;
  for (int64_t j = 0;; ++j)
    if (!std::isfinite(Row::load1(row, j))) return j;
}

// Pass 2 (float rows): the candidates (key >= floor_key, in id order) and the sum of exp(x - M)
// over the other logits, which are all outside the support. Float sums over blocks of kSumBlock
// (four accumulators, so the adds do not wait on each other), then double.
RHEO_ALWAYS_INLINE void scan_block(const Float16& v, int64_t i0, int32_t floor_key, float M,
                                   Float16& acc, std::vector<Entry<float>>& cand) {
  const Int16 key = cpu::order_key16(v);
  // exp16 flushes inputs below -87 to 0; masking its input keeps the selects apart (GCC 12 fuses
  // nested selects into a mask AND that it only does in scalar code).
  acc += cpu::exp16(key < floor_key ? v - M : Float16{} - 100.0f);
  if (!cpu::any16(key >= floor_key ? Int16{} + 1 : Int16{})) return;
  for (int k = 0; k < kLanes; ++k)
    if (key[k] >= floor_key) cand.push_back({v[k], static_cast<int32_t>(i0 + k)});
}

template <typename Row>
RHEO_ALWAYS_INLINE double scan_row(const typename Row::Elem* row, int64_t V, float M,
                                   int32_t floor_key, std::vector<Entry<float>>& cand) {
  double sum = 0.0;
  int64_t i = 0;
  while (i + 4 * kLanes <= V) {
    Float16 acc[4] = {};
    const int64_t end = std::min(V, i + kSumBlock) - 4 * kLanes;
    for (; i <= end; i += 4 * kLanes)
      for (int u = 0; u < 4; ++u)
        scan_block(Row::load16(row + i + u * kLanes), i + u * kLanes, floor_key, M, acc[u], cand);
    const Float16 all = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (int k = 0; k < kLanes; ++k) sum += static_cast<double>(all[k]);
  }
  for (; i < V; ++i) {
    const float x = Row::load1(row, i);
    if (cpu::order_key(x) >= floor_key) cand.push_back({x, static_cast<int32_t>(i)});
    else sum += std::exp(static_cast<double>(x) - M);
  }
  return sum;
}

// One compiled clone set per element type (target_clones does not apply to templates).
#define RHEO_POOL_PASSES(name, Row)                                                            \
  RHEO_SIMD_CLONES int64_t bound_##name(const Row::Elem* x, int64_t V, int64_t Se,            \
                                        int32_t* max_key, int32_t* chunk_max) {               \
    return bound_row<Row>(x, V, Se, max_key, chunk_max);                                       \
  }                                                                                            \
  RHEO_SIMD_CLONES double scan_##name(const Row::Elem* x, int64_t V, float M, int32_t floor_key, \
                                      std::vector<Entry<float>>& cand) {                       \
    return scan_row<Row>(x, V, M, floor_key, cand);                                            \
  }
RHEO_POOL_PASSES(f32, cpu::F32Row)
RHEO_POOL_PASSES(bf16, cpu::Bf16Row)
RHEO_POOL_PASSES(f16, cpu::F16Row)
#undef RHEO_POOL_PASSES

// The fp64 path (exact tests) stays scalar: the same heap rule and std::exp in double.
int64_t select_f64(const double* x, int64_t V, int64_t Se, Entry<double>* heap) {
  for (int64_t i = 0; i < V; ++i)
    if (!std::isfinite(x[i])) return i;
  for (int64_t i = 0; i < Se; ++i) heap[i] = {x[i], static_cast<int32_t>(i)};
  std::make_heap(heap, heap + Se, Better());
  for (int64_t i = Se; i < V; ++i)
    if (x[i] > heap[0].logit) replace_worst(heap, Se, {x[i], static_cast<int32_t>(i)});
  return -1;
}

double outside_f64(const double* x, int64_t V, double M, double lmin, int64_t* at_or_above) {
  double sum = 0.0;
  *at_or_above = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (x[i] < lmin) sum += std::exp(x[i] - M);
    else ++*at_or_above;
  }
  return sum;
}

// fp64 rows: outside mass given the support. Logits strictly below the worst support logit
// `lmin` are outside; of those at or above it, all but the Se support entries are ties at `lmin`
// (higher ids), each of mass exp(lmin - M).
double outside_mass_f64(const double* x, int64_t V, int64_t Se, double M, double lmin) {
  int64_t at_or_above = 0;
  const double below = outside_f64(x, V, M, lmin, &at_or_above);
  return below + static_cast<double>(at_or_above - Se) * std::exp(lmin - M);
}

// Passes 1 and 2 of one row: the Se best entries sorted in support order into `support`, and the
// outside mass, sum exp(l - M) over every token outside the support (M = the row max). False (and
// `err` filled) on a non-finite logit. Summing the outside directly (rather than total minus
// support) keeps its relative error at float rounding even when the support holds almost all of
// the mass. `cand` is scratch.
template <typename Real>
bool scan_support(const void* row, DType dtype, int64_t V, int64_t Se,
                  std::vector<Entry<Real>>& support, std::vector<int32_t>& chunk_max,
                  std::vector<Entry<float>>& cand, double* outside, RowError& err) {
  support.resize(Se);
  if constexpr (std::is_same_v<Real, double>) {
    const double* x = static_cast<const double*>(row);
    const int64_t bad = select_f64(x, V, Se, support.data());
    if (bad >= 0) {
      err = {1, bad, x[bad], ""};
      return false;
    }
    std::sort_heap(support.begin(), support.end(), Better());  // best first
    *outside = outside_mass_f64(x, V, Se, support[0].logit, support[Se - 1].logit);
    return true;
  } else {
    const auto* f32 = static_cast<const float*>(row);
    const auto* u16 = static_cast<const uint16_t*>(row);
    int32_t max_key;
    chunk_max.resize(V / kLanes + 1);
    const int64_t bad = dtype == DType::kBFloat16 ? bound_bf16(u16, V, Se, &max_key, chunk_max.data())
                        : dtype == DType::kFloat16 ? bound_f16(u16, V, Se, &max_key, chunk_max.data())
                                                   : bound_f32(f32, V, Se, &max_key, chunk_max.data());
    if (bad >= 0) {
      const float value = dtype == DType::kFloat32    ? f32[bad]
                          : dtype == DType::kBFloat16 ? cpu::bf16_to_float(u16[bad])
                                                      : cpu::half_to_float(u16[bad]);
      err = {1, bad, value, ""};
      return false;
    }
    const int64_t n_chunks = V / chunk_length(V, Se);
    int32_t floor_key = std::numeric_limits<int32_t>::min();
    if (n_chunks >= Se) {  // the Se-th largest chunk max
      std::nth_element(chunk_max.begin(), chunk_max.begin() + (Se - 1),
                       chunk_max.begin() + n_chunks, std::greater<int32_t>());
      floor_key = chunk_max[Se - 1];
    }
    // -0.0 ties with a floor of +0.0 in the float order but has the lower key: admit it too.
    if (floor_key == cpu::order_key(0.0f)) floor_key = cpu::order_key(-0.0f);
    const float M = cpu::key_to_float(max_key);
    cand.clear();
    double sum = dtype == DType::kBFloat16 ? scan_bf16(u16, V, M, floor_key, cand)
                 : dtype == DType::kFloat16 ? scan_f16(u16, V, M, floor_key, cand)
                                            : scan_f32(f32, V, M, floor_key, cand);
    // At least Se candidates (bound_row); the best Se of them are the support, and the rest
    // (ties at the worst support logit included) are outside.
    std::nth_element(cand.begin(), cand.begin() + (Se - 1), cand.end(), Better());
    std::sort(cand.begin(), cand.begin() + Se, Better());
    std::copy(cand.begin(), cand.begin() + Se, support.begin());
    for (size_t k = Se; k < cand.size(); ++k)
      sum += std::exp(static_cast<double>(cand[k].logit) - static_cast<double>(M));
    *outside = sum;
    return true;
  }
}

// Y ~ q~ on support minus leads (support indices m..Se-1), weights w_j = exp((l_j - l_m) / T).
// Writes q~ into qt[0..Se) and returns the support index of Y; -1 when z_T underflows (the
// degenerate case of DESIGN.md §2.1: no sampled child, qt all 0). `forced` is a support index
// to pin Y to, or -1 to draw with the coin `u` by inverse CDF in support order.
int64_t sample_tilde(const double* l, int64_t Se, int32_t m, double T, double u, int64_t forced,
                     double tiny, double* qt) {
  std::fill(qt, qt + Se, 0.0);
  double W = 0.0, all = 0.0;  // tempered mass of the non-leads (rel. l_m) and of all (rel. l_0)
  for (int64_t j = m; j < Se; ++j) W += std::exp((l[j] - l[m]) / T);
  for (int64_t j = 0; j < Se; ++j) all += std::exp((l[j] - l[0]) / T);
  // z_T = tempered mass outside the leads, in logs so that no term overflows.
  const double log_zT = (l[m] - l[0]) / T + std::log(W) - std::log(all);
  if (m > 0 && !(log_zT >= std::log(tiny))) return -1;
  for (int64_t j = m; j < Se; ++j) qt[j] = std::exp((l[j] - l[m]) / T) / W;
  if (forced >= 0) return forced;
  const double target = u * W;
  double running = 0.0;
  int64_t last_positive = m;
  for (int64_t j = m; j < Se; ++j) {
    const double w = std::exp((l[j] - l[m]) / T);
    if (w > 0.0) last_positive = j;
    running += w;
    if (running > target) return j;
  }
  return last_positive;  // rounding left u * W at or past the running total
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
  // log q = l - log-sum-exp over V; the support part of the sum is exact in double.
  double support_mass = 0.0;
  for (int64_t j = 0; j < Se; ++j) {
    ids[j] = heap[j].id;
    l[j] = static_cast<double>(heap[j].logit);
    support_mass += std::exp(l[j] - static_cast<double>(M));
  }
  const double log_total = std::log(outside + support_mass);
  for (int64_t j = 0; j < Se; ++j) log_q[j] = l[j] - static_cast<double>(M) - log_total;
  // T = 0 forces the plain top-K pool for every kind (greedy; DESIGN.md §2.1).
  const int32_t m = a.m;
  const bool rheo = a.kind == PoolKind::kRheo && a.T > 0.0;
  const int32_t forced_token = a.forced_sample ? a.forced_sample[r] : -1;
  int64_t y = -1;
  if (rheo) {
    const int64_t forced = forced_index(forced_token, ids, Se, m, err);
    if (err.code) return;
    const double u = pool_coin(a.seed, a.step, a.level, static_cast<uint32_t>(r));
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
        for (int64_t k = Se - 1; k >= m; --k) nonlead += std::exp(l[k] - static_cast<double>(M));
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
    std::vector<double> work(3 * Se);
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
