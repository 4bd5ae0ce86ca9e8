// Pool sampler on the CPU (contract: csrc/include/rheo/pool_sampler.h, DESIGN.md §2.1).
//
// One row at a time (OpenMP over rows). Per row:
//   pass 1  over V: the Se highest logits in a bounded heap (one compare per element against the
//                   heap's worst entry; inserts are rare) and a finiteness check;
//   pass 2  over V: the untempered mass outside the support, sum exp(l - M) for l below the
//                   support (M = the row max = the best support logit);
//   then, on the Se support entries only, in double: log q, the leads, z, q~, Y, the fills.
// Exponentials over V use a polynomial expf that the compiler vectorises (max rel. error about
// 2e-7); every quantity on the support uses std::exp in double.
#include "rheo/pool_sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

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

constexpr int64_t kBlock = 512;  // elements converted / scanned at a time (fits in L1)

// exp(x) for 16 floats x <= 0: x = n ln2 + r, |r| <= ln2/2, degree-7 Taylor polynomial (max
// rel. error about 2e-7), 2^n through the exponent bits; exp(x < -87) = 0. Written on GCC/Clang
// vector types because the compilers will not if-convert the scalar selects under
// -ftrapping-math; the width suits AVX-512 and splits into AVX2 / SSE registers elsewhere.
typedef float Float16 __attribute__((vector_size(64)));
typedef int32_t Int16 __attribute__((vector_size(64)));

__attribute__((always_inline)) inline void fast_exp16(const Float16& x, Float16& out) {
  const Float16 lo = Float16{} - 87.0f;
  const Int16 keep = x >= lo;
  const Float16 xc = keep ? x : lo;
  const Float16 n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  const Float16 r = (xc - n * 0.693145752f) - n * 1.42860677e-6f;
  Float16 p = Float16{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Int16 bits = (__builtin_convertvector(n, Int16) + 127) << 23;
  out = keep ? p * (Float16)bits : Float16{};
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else {  // zero or subnormal: value = mant * 2^-24, exact in float
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Block [i0, i0 + len) of a row as Real: the row itself when no conversion is needed.
template <typename Real>
const Real* load_block(const void* row, DType dtype, int64_t i0, int64_t len, Real* buf) {
  if (dtype == DType::kFloat16 || dtype == DType::kBFloat16) {
    const uint16_t* src = static_cast<const uint16_t*>(row) + i0;
    for (int64_t i = 0; i < len; ++i)
      buf[i] = dtype == DType::kFloat16 ? half_to_float(src[i]) : bf16_to_float(src[i]);
    return buf;
  }
  return static_cast<const Real*>(row) + i0;  // Real matches the dtype (float32 / float64)
}

template <typename Real>
struct Entry {
  Real logit;
  int32_t id;
};

// Support order: descending logit, ties lower token id first. As a heap comparator it keeps the
// worst entry of the support on top.
template <typename Real>
inline bool better(const Entry<Real>& a, const Entry<Real>& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

struct RowError {
  int code = 0;  // 0 ok, 1 non-finite logit, 2 bad forced sample
  int64_t token = 0;
  double value = 0.0;
  const char* why = "";
};

template <typename Real>
bool all_finite(const Real* x, int64_t len) {
  int bad = 0;
  for (int64_t i = 0; i < len; ++i) bad |= !(std::abs(x[i]) <= std::numeric_limits<Real>::max());
  return !bad;
}

template <typename Real>
bool any_above(const Real* x, int64_t len, Real threshold) {
  int above = 0;
  for (int64_t i = 0; i < len; ++i) above |= x[i] > threshold;
  return above;
}

// Pass 1: the Se best entries of the row, sorted in support order. Returns false (and fills
// `err`) on a non-finite logit. Scanning ids upwards, a logit equal to the heap's worst loses the
// tie (higher id), so a strict `>` decides every insertion.
template <typename Real>
bool select_support(const void* row, DType dtype, int64_t V, int64_t Se,
                    std::vector<Entry<Real>>& heap, RowError& err) {
  Real buf[kBlock];
  heap.clear();
  for (int64_t i0 = 0; i0 < V; i0 += kBlock) {
    const int64_t len = std::min(kBlock, V - i0);
    const Real* x = load_block(row, dtype, i0, len, buf);
    if (!all_finite(x, len)) {
      int64_t i = 0;
      while (std::abs(x[i]) <= std::numeric_limits<Real>::max()) ++i;
      err = {1, i0 + i, static_cast<double>(x[i]), ""};
      return false;
    }
    int64_t i = 0;
    for (; i < len && static_cast<int64_t>(heap.size()) < Se; ++i) {
      heap.push_back({x[i], static_cast<int32_t>(i0 + i)});
      if (static_cast<int64_t>(heap.size()) == Se)
        std::make_heap(heap.begin(), heap.end(), better<Real>);
    }
    if (i == len || !any_above(x + i, len - i, heap.front().logit)) continue;
    for (; i < len; ++i) {
      if (!(x[i] > heap.front().logit)) continue;
      std::pop_heap(heap.begin(), heap.end(), better<Real>);
      heap.back() = {x[i], static_cast<int32_t>(i0 + i)};
      std::push_heap(heap.begin(), heap.end(), better<Real>);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), better<Real>);  // best first
  return true;
}

// Sum of exp(x - M) over the x < lmin of one block, and the count of x >= lmin. Compiled for
// AVX-512, AVX2 and the baseline, picked at load time (the build passes no -march).
__attribute__((target_clones("avx512f", "avx2", "default")))
void outside_block(const float* x, int64_t len, float M, float lmin, double& sum,
                   int64_t& at_or_above) {
  Float16 acc = Float16{};
  Int16 count = Int16{};
  for (int64_t i = 0; i < len; i += 16) {
    Float16 v = Float16{} + lmin;  // padding lanes count as "at or above" and are subtracted
    std::memcpy(&v, x + i, sizeof(float) * std::min<int64_t>(16, len - i));
    const Int16 outside = v < lmin;
    Float16 e;
    fast_exp16(v - M, e);
    acc += outside ? e : Float16{};
    count += outside ? Int16{} : Int16{} + 1;
  }
  for (int j = 0; j < 16; ++j) {
    sum += static_cast<double>(acc[j]);
    at_or_above += count[j];
  }
  at_or_above -= (16 - len % 16) % 16;
}

inline void outside_block(const double* x, int64_t len, double M, double lmin, double& sum,
                          int64_t& at_or_above) {
  for (int64_t i = 0; i < len; ++i) {
    if (x[i] < lmin) sum += std::exp(x[i] - M);
    else ++at_or_above;
  }
}

// Pass 2: sum of exp(l - M) over the tokens outside the support. Logits strictly below the
// worst support logit `lmin` are outside; of those equal to or above it, all but the Se support
// entries are ties at `lmin` (higher ids), each of mass exp(lmin - M). Summing the outside
// directly (rather than total minus support) keeps its relative error at float rounding even
// when the support holds almost all of the mass.
template <typename Real>
double outside_mass(const void* row, DType dtype, int64_t V, int64_t Se, Real M, Real lmin) {
  Real buf[kBlock];
  double sum = 0.0;
  int64_t at_or_above = 0;
  for (int64_t i0 = 0; i0 < V; i0 += kBlock) {
    const int64_t len = std::min(kBlock, V - i0);
    outside_block(load_block(row, dtype, i0, len, buf), len, M, lmin, sum, at_or_above);
  }
  return sum + static_cast<double>(at_or_above - Se) * std::exp(static_cast<double>(lmin - M));
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
              std::vector<double>& work, RowError& err) {
  const int64_t Se = std::min<int64_t>(a.S, a.V);
  const size_t elem = a.dtype == DType::kFloat64 ? 8 : a.dtype == DType::kFloat32 ? 4 : 2;
  const void* row = static_cast<const char*>(a.logits) + r * a.row_stride * elem;
  if (!select_support<Real>(row, a.dtype, a.V, Se, heap, err)) return;
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
  const double outside = outside_mass<Real>(row, a.dtype, a.V, Se, M, heap[Se - 1].logit);
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
    std::vector<Entry<Real>> heap;
    std::vector<double> work(3 * Se);
    heap.reserve(Se);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < a.n; ++r) pool_row<Real, Acc>(a, r, heap, work, errors[r]);
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
