// Verification on the CPU, steps 0 and 1 at a visited node (header "Target processing"): its row
// of logits into the processed target p (temperature -> top-k -> top-p -> min-p), held as the residual
// r = w / Z that verification.cpp's layer of tests starts from. Two paths: double throughout
// (fp64 logits) and the float path of the fp32 / bf16 / fp16 rows, read in place (at T = 0 their
// argmax, the double path's one-hot p).
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
  if (scale_by != 1.0)
    for (int64_t v = 0; v < V; ++v) x[v] /= scale_by;
  return true;
}

// The lowest id of the largest x (x finite; -0.0 equals +0.0, as `>` and `==` have it).
int64_t argmax_first(const double* x, int64_t V) {
  const double m = max4(x, V);
  int64_t best = 0;
  while (!(x[best] == m)) ++best;
  return best;
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

// Eight doubles and their bits. p >= 0 here, and a non-negative double's bits order like the
// double, so the compares are on integers (a float compare in a vectorised loop is split into
// scalar ones under GCC's -ftrapping-math); each compare feeds a select (cpu_math.h).
typedef double Double8 __attribute__((vector_size(64)));
typedef int64_t Long8 __attribute__((vector_size(64)));

// The mass of the p >= t, summed in 8 lanes (an estimate: top_p's cut sums in its own order).
RHEO_ALWAYS_INLINE double mass_above_loop(const double* p, int64_t V, double t) {
  int64_t key;
  std::memcpy(&key, &t, sizeof key);
  Double8 acc = Double8{};
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    Double8 x;
    std::memcpy(&x, p + v, sizeof x);
    acc += (Long8)x >= key ? x : Double8{};
  }
  double mass = 0.0;
  for (int k = 0; k < 8; ++k) mass += acc[k];
  for (; v < V; ++v) mass += p[v] >= t ? p[v] : 0.0;
  return mass;
}
RHEO_ISA_COPIES(double, mass_above, mass_above_loop, (const double* p, int64_t V, double t),
                (p, V, t))

// The p >= t (t > 0) with their ids, in id order, into c; returns their count. Blocks of 8
// with none are skipped by one vector compare.
RHEO_ALWAYS_INLINE int64_t gather_above_loop(const double* p, int64_t V, double t, Candidate* c) {
  int64_t key;
  std::memcpy(&key, &t, sizeof key);
  int64_t n = 0, v = 0;
  for (; v + 8 <= V; v += 8) {
    Double8 x;
    std::memcpy(&x, p + v, sizeof x);
    const Long8 above = (Long8)x >= key ? Long8{} + 1 : Long8{};
    int64_t any = 0;
    for (int k = 0; k < 8; ++k) any |= above[k];
    if (any == 0) continue;
    for (int64_t u = v; u < v + 8; ++u)
      if (p[u] >= t) c[n++] = {p[u], static_cast<int32_t>(u)};
  }
  for (; v < V; ++v)
    if (p[v] >= t) c[n++] = {p[v], static_cast<int32_t>(v)};
  return n;
}
RHEO_ISA_COPIES(int64_t, gather_above, gather_above_loop,
                (const double* p, int64_t V, double t, Candidate* c), (p, V, t, c))

// p[v] / kept where (p[v], -v) >= (p_last, -id_last) (the kept tokens: those before or at the
// last kept one in the order p descending, ids ascending), else 0.
RHEO_ALWAYS_INLINE void keep_divide_loop(double* p, int64_t V, double p_last, int64_t id_last,
                                         double kept) {
  int64_t last;
  std::memcpy(&last, &p_last, sizeof last);
  for (int64_t v = 0; v < V; ++v) {
    int64_t bits;
    std::memcpy(&bits, &p[v], sizeof bits);
    const bool keep = bits > last || (bits == last && v <= id_last);
    p[v] = keep ? p[v] / kept : 0.0;
  }
}
RHEO_ISA_COPIES(void, keep_divide, keep_divide_loop,
                (double* p, int64_t V, double p_last, int64_t id_last, double kept),
                (p, V, p_last, id_last, kept))

// The cut of the candidates c[0, n) (a prefix of the order p descending, ids ascending, of every
// positive p): sorted in place only as far as the cut, as top-p keeps them. Returns the number
// kept (n: every one, the cut not reached within c), with *kept their mass summed in that order.
int64_t top_p_cut(Candidate* c, int64_t n, double top_p, double* kept) {
  const auto before = [](const Candidate& a, const Candidate& b) {
    return a.p > b.p || (a.p == b.p && a.id < b.id);
  };
  int64_t sorted = 0;
  *kept = 0.0;
  while (sorted < n) {
    const int64_t end = std::min(n, std::max<int64_t>(64, 4 * sorted));
    if (end < n) std::nth_element(c + sorted, c + end - 1, c + n, before);  // the next end - sorted
    std::sort(c + sorted, c + end, before);  // in order (a strict total order: one result)
    for (int64_t j = sorted; j < end; ++j) {
      if (*kept >= top_p) return j;
      *kept += c[j].p;
    }
    sorted = end;
  }
  return n;
}

// Top-p (header rule): sort p descending, ties by lower id; keep a token while the mass strictly
// before it is < top_p; renormalise. Only the p >= t are sorted, for the first t of p_max / 16^j
// (j = 1..8) above which the mass reaches top_p (with room for rounding): the kept tokens are a
// prefix of the order, so they lie among them. Where the cut is not reached among them
// (rounding) or no t has the mass, every positive p is sorted, as before. The kept ids, in id
// order, go to ws.support (the final draw's support); returns their count.
int64_t apply_top_p(double* p, int64_t V, double top_p, Workspace& ws) {
  Candidate* c = ws.cands.get(V);
  double kept = 0.0, t = max4(p, V);
  int64_t n = 0, cut = 0;
  bool found = false;  // the cut among the p >= t: all of them once they reach top_p, as the
  // next token in the order (below t) would find the mass before it >= top_p
  for (int j = 0; j < 8 && !found; ++j) {
    t = std::ldexp(t, -4);
    if (!(t > 0.0)) break;
    if (mass_above(p, V, t) < top_p * (1.0 + 1e-9)) continue;
    n = gather_above(p, V, t, c);
    cut = top_p_cut(c, n, top_p, &kept);
    found = cut < n || kept >= top_p;
    if (!found) break;  // they fall short after all (rounding): every positive p below
  }
  if (!found) {
    n = 0;
    for (int64_t v = 0; v < V; ++v)
      if (p[v] > 0.0) c[n++] = {p[v], static_cast<int32_t>(v)};
    cut = top_p_cut(c, n, top_p, &kept);
  }
  keep_divide(p, V, c[cut - 1].p, c[cut - 1].id, kept);
  int32_t* support = ws.support.get(V);
  for (int64_t j = 0; j < cut; ++j) support[j] = c[j].id;
  std::sort(support, support + cut);
  return cut;
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
  const double* x = ws.x.get(V);
  double* p = ws.w.get(V);
  if (a.T == 0.0) {  // greedy: one-hot on the argmax, lowest id on ties
    const int64_t best = argmax_first(x, V);
    r = {one_hot(ws, V, best), 1.0, 1, V, 1.0, best};
    return;
  }
  ws.zeroed = nullptr;  // p is written below
  double kth = -std::numeric_limits<double>::infinity();  // top-k: keep x >= k-th largest
  if (a.top_k > 0 && a.top_k < V) {
    double* sorted = ws.sorted.get(V);
    std::copy(x, x + V, sorted);
    std::nth_element(sorted, sorted + (a.top_k - 1), sorted + V, std::greater<double>());
    kth = sorted[a.top_k - 1];
  }
  const double m = max4(x, V);
  exp_shifted_masked(x, V, m, kth, p);
  const double sum = sum4(p, V);
  divide_by(p, V, sum);
  const int64_t kept = a.top_p < 1.0 ? apply_top_p(p, V, a.top_p, ws) : 0;
  int64_t nnz = 0;
  if (a.min_p > 0.0) {
    divide_by(p, V, apply_min_p(p, V, a.min_p, &nnz));
  } else {
    nnz = count_positive(p, V);
  }
  r = {p, 1.0, nnz, V, 1.0};
  if (a.top_p < 1.0) r.support = ws.support.get(V), r.support_n = kept;
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

// The argmax of a row (the lowest id among the largest values, -0.0 equal to +0.0, as the
// double path's `>` has it) into *best; returns the first non-finite logit's id (-1: none).
template <typename Row>
RHEO_ALWAYS_INLINE int64_t argmax_row(const typename Row::Elem* x, int64_t V, int64_t* best) {
  const int32_t minus_zero = cpu::order_key(-0.0f);
  const Int16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  Int16 bad = Int16{}, top = Int16{} + std::numeric_limits<int32_t>::min(), at = Int16{};
  int64_t v = 0;
  for (; v + kLanes <= V; v += kLanes) {  // per lane its first largest key (V < 2^31)
    const Float16 f = Row::load16(x + v);
    bad |= cpu::ones_where_non_finite(f);
    Int16 key = cpu::order_key16(f);
    key = key == minus_zero ? Int16{} : key;  // -0.0 ranks with +0.0
    at = key > top ? lane + static_cast<int32_t>(v) : at;
    top = key > top ? key : top;
  }
  int32_t best_key = cpu::max16(top);
  int64_t best_at = V;
  for (int k = 0; k < kLanes; ++k)
    if (top[k] == best_key && v > 0) best_at = std::min<int64_t>(best_at, at[k]);
  for (; v < V; ++v) {
    const float f = Row::load1(x, v);
    bad[0] |= !std::isfinite(f);
    int32_t key = cpu::order_key(f);
    key = key == minus_zero ? 0 : key;
    if (best_at == V || key > best_key) best_key = key, best_at = v;
  }
  *best = best_at;
  if (!cpu::any16(bad)) return -1;
  for (int64_t j = 0;; ++j)
    if (!std::isfinite(Row::load1(x, j))) return j;
}

// One set of ISA copies per element type.
#define RHEO_VERIFY_PASSES(name, Row)                                                          \
  RHEO_ISA_COPIES(int64_t, max_##name, max_row<Row>,                                           \
                  (const Row::Elem* x, int64_t V, int32_t* max_key), (x, V, max_key))          \
  RHEO_ISA_COPIES(int64_t, argmax_##name, argmax_row<Row>,                                   \
                  (const Row::Elem* x, int64_t V, int64_t* best), (x, V, best))                \
  RHEO_ISA_COPIES(double, exp_##name, exp_row<Row>,                                            \
                  (const Row::Elem* x, int64_t V, float mx, float inv_T, int32_t kth_key,      \
                   double* w, int64_t* nnz),                                                   \
                  (x, V, mx, inv_T, kth_key, w, nnz))
RHEO_VERIFY_PASSES(f32, cpu::F32Row)
RHEO_VERIFY_PASSES(bf16, cpu::Bf16Row)
RHEO_VERIFY_PASSES(f16, cpu::F16Row)
#undef RHEO_VERIFY_PASSES

// T = 0 on the float path: p one-hot on the argmax, the lowest id among the largest logits
// (-0.0 equal to +0.0), read in place: the double path's p without converting the row. False on
// NaN/inf (the first one, as the double path reports it).
template <typename Elem, typename ArgmaxFn, typename Load1>
bool greedy_target(const VerificationArgs& a, const Elem* x, Workspace& ws, Residual& r,
                   BadLogit* bad, ArgmaxFn argmax_fn, Load1 load1) {
  int64_t best;
  bad->token = argmax_fn(x, a.V, &best);
  if (bad->token >= 0) {
    bad->value = load1(x, bad->token);
    return false;
  }
  r = {one_hot(ws, a.V, best), 1.0, 1, a.V, 1.0, best};
  return true;
}

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
    double* sorted = ws.sorted.get(V);
    for (int64_t v = 0; v < V; ++v) sorted[v] = load1(x, v);
    std::nth_element(sorted, sorted + (a.top_k - 1), sorted + V, std::greater<double>());
    const float kth = static_cast<float>(sorted[a.top_k - 1]);
    kth_key = cpu::order_key(kth == 0.0f ? -0.0f : kth);  // -0.0 ties with a k-th of +0.0
  }
  double* w = ws.w.get(V);
  ws.zeroed = nullptr;  // written below
  int64_t nnz;
  const float inv_T = static_cast<float>(1.0 / a.T);
  const double sum = exp_fn(x, V, cpu::key_to_float(max_key), inv_T, kth_key, w, &nnz);
  r = {w, sum, nnz, V, sum};
  int64_t top_p_kept = 0;
  if (a.top_p < 1.0) {
    divide_by(w, V, sum);
    top_p_kept = apply_top_p(w, V, a.top_p, ws);
    r = {w, 1.0, count_positive(w, V), V, 1.0};
  }
  if (a.min_p > 0.0) {
    const double kept = apply_min_p(w, V, a.min_p, &nnz);
    r = {w, kept, nnz, V, kept};
  }
  if (a.top_p < 1.0) r.support = ws.support.get(V), r.support_n = top_p_kept;
  return true;
}

}  // namespace

// The walk after a one-hot only zeroes weights or lowers the one (run_layer: a rejected child's
// weight, max(0, w - Z q~) on q~'s support), so only `best` can be non-zero when it ends.
double* one_hot(Workspace& ws, int64_t V, int64_t best) {
  double* p = ws.w.get(V);
  if (ws.zeroed == p && ws.zeroed_n >= V) {
    if (ws.zeroed_one >= 0) p[ws.zeroed_one] = 0.0;
  } else {
    std::fill(p, p + V, 0.0);
    ws.zeroed = p, ws.zeroed_n = V;
  }
  p[best] = 1.0;
  ws.zeroed_one = best;
  return p;
}

// Steps 0 and 1 at `node` of tree b, on the float path where it applies. False on NaN/inf.
bool prepare_node(const VerificationArgs& a, int64_t b, int64_t node, Workspace& ws, Residual& r,
                  BadLogit* bad) {
  const int64_t off = (b * a.N + node) * a.V;
  bad->node = node;
  const auto* f32 = static_cast<const float*>(a.logits) + off;
  const auto* u16 = static_cast<const uint16_t*>(a.logits) + off;
  if (a.T == 0.0 && a.dtype == DType::kFloat32)
    return greedy_target(a, f32, ws, r, bad, argmax_f32, cpu::F32Row::load1);
  if (a.T == 0.0 && a.dtype == DType::kBFloat16)
    return greedy_target(a, u16, ws, r, bad, argmax_bf16, cpu::Bf16Row::load1);
  if (a.T == 0.0 && a.dtype == DType::kFloat16)
    return greedy_target(a, u16, ws, r, bad, argmax_f16, cpu::F16Row::load1);
  if (a.T > 0.0 && a.dtype == DType::kFloat32)
    return float_target(a, f32, ws, r, bad, max_f32, exp_f32, cpu::F32Row::load1);
  if (a.T > 0.0 && a.dtype == DType::kBFloat16)
    return float_target(a, u16, ws, r, bad, max_bf16, exp_bf16, cpu::Bf16Row::load1);
  if (a.T > 0.0 && a.dtype == DType::kFloat16)
    return float_target(a, u16, ws, r, bad, max_f16, exp_f16, cpu::F16Row::load1);
  if (!load_node(a, b, node, ws.x.get(a.V), bad)) return false;
  process_target(a, ws, r);
  return true;
}

}  // namespace verification_detail
}  // namespace rheo
