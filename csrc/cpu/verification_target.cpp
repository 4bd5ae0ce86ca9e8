// Verification on the CPU, steps 0 and 1 at a visited node (header "Target processing"): its row
// of logits into the processed target p (temperature -> top-k -> top-p -> min-p), held as the residual
// r = w / Z that verification.cpp's layer of tests starts from. Two paths: double throughout
// (fp64 logits, T = 0) and the float path of the fp32 / bf16 / fp16 rows at T > 0.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "cpu_math.h"
#include "verification_internal.h"

namespace rheo {
namespace verification_detail {
namespace {

using cpu::bf16_to_float;
using cpu::exp_nonpositive;
using cpu::half_to_float;

// Max with four independent lanes (a single running max is bound by the compare latency).
inline double max4(const double* x, int64_t n) {
  double acc[4] = {x[0], x[0], x[0], x[0]};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) acc[k] = x[i + k] > acc[k] ? x[i + k] : acc[k];
  for (; i < n; ++i) acc[0] = x[i] > acc[0] ? x[i] : acc[0];
  return std::max(std::max(acc[0], acc[1]), std::max(acc[2], acc[3]));
}

// Sum with four independent accumulators (the plain loop is bound by the add latency).
inline double sum4(const double* x, int64_t n) {
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) acc[k] += x[i + k];
  for (; i < n; ++i) acc[0] += x[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// p[v] = exp(x[v] - m) where x[v] >= kth, else 0 (m = max x). The exp loop is unconditional and
// the mask a second loop: GCC will not speculate a trapping exp into a select (-ftrapping-math),
// so a fused loop would stay scalar.
RHEO_ALWAYS_INLINE void exp_shifted_masked_loop(const double* x, int64_t V, double m, double kth,
                                                double* p) {
  for (int64_t v = 0; v < V; ++v) p[v] = exp_nonpositive(x[v] - m);
  if (kth == -std::numeric_limits<double>::infinity()) return;
  for (int64_t v = 0; v < V; ++v) p[v] = x[v] >= kth ? p[v] : 0.0;
}
RHEO_ISA_COPIES(void, exp_shifted_masked, exp_shifted_masked_loop,
                (const double* x, int64_t V, double m, double kth, double* p), (x, V, m, kth, p))

// True when every x[v] is finite (exponent bits not all ones): integer ops, so it vectorises.
RHEO_ALWAYS_INLINE bool all_finite_loop(const double* x, int64_t V) {
  constexpr uint64_t kExpMask = 0x7FF0000000000000ull;
  uint64_t bad = 0;
  for (int64_t v = 0; v < V; ++v) {
    uint64_t bits;
    std::memcpy(&bits, &x[v], sizeof(bits));
    bad |= static_cast<uint64_t>((bits & kExpMask) == kExpMask);
  }
  return bad == 0;
}
RHEO_ISA_COPIES(bool, all_finite, all_finite_loop, (const double* x, int64_t V), (x, V))

// Step 0: row of logits -> x = logits / T in double (raw logits at T = 0). False on NaN/inf,
// with the first bad token in *bad.
template <typename T, typename Convert>
bool load_row(const T* src, int64_t V, double temperature, double* x, BadLogit* bad,
              Convert convert) {
  const double scale_by = temperature > 0.0 ? temperature : 1.0;
  for (int64_t v = 0; v < V; ++v) x[v] = convert(src[v]);
  if (!all_finite(x, V)) {
    for (bad->token = 0; std::isfinite(x[bad->token]); ++bad->token) {
    }
    bad->value = x[bad->token];
    return false;
  }
  for (int64_t v = 0; v < V; ++v) x[v] /= scale_by;
  return true;
}

bool load_node(const VerificationArgs& a, int64_t b, int64_t node, double* x, BadLogit* bad) {
  const int64_t off = (b * a.N + node) * a.V;
  bad->node = node;
  switch (a.dtype) {
    case DType::kFloat32:
      return load_row(static_cast<const float*>(a.logits) + off, a.V, a.T, x, bad,
                      [](float f) { return static_cast<double>(f); });
    case DType::kFloat64:
      return load_row(static_cast<const double*>(a.logits) + off, a.V, a.T, x, bad,
                      [](double f) { return f; });
    case DType::kFloat16:
      return load_row(static_cast<const uint16_t*>(a.logits) + off, a.V, a.T, x, bad,
                      [](uint16_t h) { return static_cast<double>(half_to_float(h)); });
    case DType::kBFloat16:
      return load_row(static_cast<const uint16_t*>(a.logits) + off, a.V, a.T, x, bad,
                      [](uint16_t h) { return static_cast<double>(bf16_to_float(h)); });
  }
  return false;
}

RHEO_ALWAYS_INLINE void divide_by_loop(double* p, int64_t V, double by) {
  for (int64_t v = 0; v < V; ++v) p[v] /= by;
}
RHEO_ISA_COPIES(void, divide_by, divide_by_loop, (double* p, int64_t V, double by), (p, V, by))

RHEO_ALWAYS_INLINE int64_t count_positive_loop(const double* p, int64_t V) {
  int64_t n = 0;
  for (int64_t v = 0; v < V; ++v) n += p[v] > 0.0 ? 1 : 0;
  return n;
}
RHEO_ISA_COPIES(int64_t, count_positive, count_positive_loop, (const double* p, int64_t V), (p, V))

// Top-p (header rule): sort p descending, ties by lower id; keep a token while the mass strictly
// before it is < top_p; renormalise. The sort grows a sorted prefix only as far as needed.
void apply_top_p(double* p, int64_t V, double top_p, int32_t* ids) {
  int64_t n = 0;
  for (int64_t v = 0; v < V; ++v)
    if (p[v] > 0.0) ids[n++] = static_cast<int32_t>(v);
  const auto before = [p](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
  int64_t sorted = 0, cut = n;
  double kept = 0.0;
  while (sorted < n && cut == n) {
    const int64_t end = std::min(n, std::max<int64_t>(64, 4 * sorted));
    std::partial_sort(ids + sorted, ids + end, ids + n, before);
    for (int64_t j = sorted; j < end; ++j) {
      if (kept >= top_p) {
        cut = j;
        break;
      }
      kept += p[ids[j]];
    }
    sorted = end;
  }
  for (int64_t j = cut; j < n; ++j) p[ids[j]] = 0.0;
  divide_by(p, V, kept);
}

// Min-p after top-p (HF's order): drop the w < min_p * max w (the ratio p(v) / max p does not
// depend on the normalisation, so w may be unnormalised). Returns the new sum; *nnz the count.
double apply_min_p(double* w, int64_t V, double min_p, int64_t* nnz) {
  double best = 0.0;
  for (int64_t v = 0; v < V; ++v) best = w[v] > best ? w[v] : best;
  const double threshold = min_p * best;
  for (int64_t v = 0; v < V; ++v) w[v] = w[v] >= threshold ? w[v] : 0.0;
  *nnz = count_positive(w, V);
  return sum4(w, V);
}

// Step 1: the processed target p at a loaded node (header "Target processing"), into r.
void process_target(const VerificationArgs& a, Workspace& ws, Residual& r) {
  const int64_t V = a.V;
  const double* x = ws.x.get();
  double* p = ws.w.get();
  if (a.T == 0.0) {  // greedy: one-hot on the argmax, lowest id on ties
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (x[v] > x[best]) best = v;
    std::fill(p, p + V, 0.0);
    p[best] = 1.0;
    r = {p, 1.0, 1, V, 1.0};
    return;
  }
  double kth = -std::numeric_limits<double>::infinity();  // top-k: keep x >= k-th largest
  if (a.top_k > 0 && a.top_k < V) {
    double* sorted = ws.sorted.get();
    std::copy(x, x + V, sorted);
    std::nth_element(sorted, sorted + (a.top_k - 1), sorted + V, std::greater<double>());
    kth = ws.sorted[a.top_k - 1];
  }
  const double m = max4(x, V);
  exp_shifted_masked(x, V, m, kth, p);
  const double sum = sum4(p, V);
  divide_by(p, V, sum);
  if (a.top_p < 1.0) apply_top_p(p, V, a.top_p, ws.ids.get());
  int64_t nnz = 0;
  if (a.min_p > 0.0) {
    divide_by(p, V, apply_min_p(p, V, a.min_p, &nnz));
  } else {
    nnz = count_positive(p, V);
  }
  r = {p, 1.0, nnz, V, 1.0};
}

// The fp32 / bf16 / fp16 path at T > 0 (acc_t = float in the header): the row is read in place
// 16 lanes at a time (cpu_math.h), p uses the float exp (rel. error ~2e-7; sums per block in float,
// then double) and stays unnormalised, r = w / Z with Z = the softmax sum, which saves a pass
// over V. A coin within ~1e-6 relative of a threshold may fall otherwise than in the float64
// reference; the tests count those as ties. fp64 logits and T = 0 keep the double path above.
using cpu::Float16;
using cpu::Int16;
using cpu::kLanes;
constexpr int64_t kSumBlock = 1024;

template <typename Row>  // max key and first non-finite logit (-1: none)
RHEO_ALWAYS_INLINE int64_t max_row(const typename Row::Elem* x, int64_t V, int32_t* max_key) {
  Int16 bad = Int16{}, best = Int16{} + std::numeric_limits<int32_t>::min();
  int64_t v = 0;
  for (; v + kLanes <= V; v += kLanes) {
    const Float16 f = Row::load16(x + v);
    bad |= cpu::ones_where_non_finite(f);
    const Int16 key = cpu::order_key16(f);
    best = key > best ? key : best;
  }
  int32_t top = cpu::max16(best);
  for (; v < V; ++v) {
    bad[0] |= !std::isfinite(Row::load1(x, v));
    top = std::max(top, cpu::order_key(Row::load1(x, v)));
  }
  *max_key = top;
  if (!cpu::any16(bad)) return -1;
  for (int64_t j = 0;; ++j)
    if (!std::isfinite(Row::load1(x, j))) return j;
}

// w[v] = exp((x[v] - mx) / T) where key(x[v]) >= kth_key, else 0; returns sum(w), *nnz = #{w > 0}.
template <typename Row>
RHEO_ALWAYS_INLINE double exp_row(const typename Row::Elem* x, int64_t V, float mx, float inv_T,
                                  int32_t kth_key, double* w, int64_t* nnz) {
  typedef double Double16 __attribute__((vector_size(128)));
  double sum = 0.0;
  Int16 count = Int16{};
  int64_t v = 0;
  while (v + kLanes <= V) {
    Float16 acc = Float16{};
    for (const int64_t end = std::min(V, v + kSumBlock); v + kLanes <= end; v += kLanes) {
      const Float16 f = Row::load16(x + v);
      const Float16 e =
          cpu::exp16(cpu::order_key16(f) >= kth_key ? (f - mx) * inv_T : Float16{} - 100.0f);
      acc += e;
      count += (Int16)e > 0 ? Int16{} + 1 : Int16{};  // e >= 0: positive bits iff e > 0
      const Double16 e64 = __builtin_convertvector(e, Double16);
      std::memcpy(w + v, &e64, sizeof e64);
    }
    for (int k = 0; k < kLanes; ++k) sum += static_cast<double>(acc[k]);
  }
  int64_t n = 0;
  for (int k = 0; k < kLanes; ++k) n += count[k];
  if (v < V) {  // the V % 16 tail: the body's arithmetic on one zero-padded block, so that equal
                // logits get bitwise equal w wherever they sit (top-p breaks ties by id on w)
    const int rest = static_cast<int>(V - v);
    typename Row::Elem padded[kLanes] = {};
    std::memcpy(padded, x + v, rest * sizeof *x);
    const Float16 f = Row::load16(padded);
    const Float16 in = cpu::order_key16(f) >= kth_key ? (f - mx) * inv_T : Float16{} - 100.0f;
    const Int16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const Float16 e = cpu::exp16(lane < rest ? in : Float16{} - 100.0f);  // padding: e = 0
    for (int k = 0; k < rest; ++k) {
      w[v + k] = static_cast<double>(e[k]);
      sum += w[v + k];
      n += w[v + k] > 0.0;
    }
  }
  *nnz = n;
  return sum;
}

// One set of ISA copies per element type.
#define RHEO_VERIFY_PASSES(name, Row)                                                          \
  RHEO_ISA_COPIES(int64_t, max_##name, max_row<Row>,                                           \
                  (const Row::Elem* x, int64_t V, int32_t* max_key), (x, V, max_key))          \
  RHEO_ISA_COPIES(double, exp_##name, exp_row<Row>,                                            \
                  (const Row::Elem* x, int64_t V, float mx, float inv_T, int32_t kth_key,      \
                   double* w, int64_t* nnz),                                                   \
                  (x, V, mx, inv_T, kth_key, w, nnz))
RHEO_VERIFY_PASSES(f32, cpu::F32Row)
RHEO_VERIFY_PASSES(bf16, cpu::Bf16Row)
RHEO_VERIFY_PASSES(f16, cpu::F16Row)
#undef RHEO_VERIFY_PASSES

// Steps 0 and 1 on the float path: the processed target p of one node into r. False on NaN/inf.
template <typename Elem, typename MaxFn, typename ExpFn, typename Load1>
bool float_target(const VerificationArgs& a, const Elem* x, Workspace& ws, Residual& r,
                  BadLogit* bad, MaxFn max_fn, ExpFn exp_fn, Load1 load1) {
  const int64_t V = a.V;
  int32_t max_key;
  bad->token = max_fn(x, V, &max_key);
  if (bad->token >= 0) {
    bad->value = load1(x, bad->token);
    return false;
  }
  int32_t kth_key = std::numeric_limits<int32_t>::min();  // top-k: keep x >= k-th largest
  if (a.top_k > 0 && a.top_k < V) {
    double* sorted = ws.sorted.get();
    for (int64_t v = 0; v < V; ++v) sorted[v] = load1(x, v);
    std::nth_element(sorted, sorted + (a.top_k - 1), sorted + V, std::greater<double>());
    const float kth = static_cast<float>(sorted[a.top_k - 1]);
    kth_key = cpu::order_key(kth == 0.0f ? -0.0f : kth);  // -0.0 ties with a k-th of +0.0
  }
  double* w = ws.w.get();
  int64_t nnz;
  const float inv_T = static_cast<float>(1.0 / a.T);
  const double sum = exp_fn(x, V, cpu::key_to_float(max_key), inv_T, kth_key, w, &nnz);
  r = {w, sum, nnz, V, sum};
  if (a.top_p < 1.0) {
    divide_by(w, V, sum);
    apply_top_p(w, V, a.top_p, ws.ids.get());
    r = {w, 1.0, count_positive(w, V), V, 1.0};
  }
  if (a.min_p > 0.0) {
    const double kept = apply_min_p(w, V, a.min_p, &nnz);
    r = {w, kept, nnz, V, kept};
  }
  return true;
}

}  // namespace

// Steps 0 and 1 at `node` of tree b, on the float path where it applies. False on NaN/inf.
bool prepare_node(const VerificationArgs& a, int64_t b, int64_t node, Workspace& ws, Residual& r,
                  BadLogit* bad) {
  const int64_t off = (b * a.N + node) * a.V;
  bad->node = node;
  const auto* f32 = static_cast<const float*>(a.logits) + off;
  const auto* u16 = static_cast<const uint16_t*>(a.logits) + off;
  if (a.T > 0.0 && a.dtype == DType::kFloat32)
    return float_target(a, f32, ws, r, bad, max_f32, exp_f32, cpu::F32Row::load1);
  if (a.T > 0.0 && a.dtype == DType::kBFloat16)
    return float_target(a, u16, ws, r, bad, max_bf16, exp_bf16, cpu::Bf16Row::load1);
  if (a.T > 0.0 && a.dtype == DType::kFloat16)
    return float_target(a, u16, ws, r, bad, max_f16, exp_f16, cpu::F16Row::load1);
  if (!load_node(a, b, node, ws.x.get(), bad)) return false;
  process_target(a, ws, r);
  return true;
}

}  // namespace verification_detail
}  // namespace rheo
