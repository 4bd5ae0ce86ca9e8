// Verification on the CPU (csrc/include/rheo/verification.h): one tree per OpenMP iteration.
// Per visited node: the processed target p (temperature -> top-k -> top-p) into a dense buffer,
// then one layer of tests in verification order on the residual r = w / Z, where w starts as p
// and is only ever touched on the sparse support of q~ and at rejected children.
// Sampling mode (verification_cpu) and law mode (verification_law_cpu) share run_layer; they
// differ only in the `decide` callback (a Philox coin, or the exact probabilities).
#include "rheo/verification.h"

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace rheo {
namespace {

// Below this the tracked normaliser Z has lost too many digits to cancellation (Z = 1 - sum of
// removed masses); it is re-summed from w, an O(V) pass reached with probability ~ Z.
constexpr double kResumBelow = 1e-6;

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
RHEO_SIMD_CLONES
void exp_shifted_masked(const double* x, int64_t V, double m, double kth, double* p) {
  for (int64_t v = 0; v < V; ++v) p[v] = exp_nonpositive(x[v] - m);
  if (kth == -std::numeric_limits<double>::infinity()) return;
  for (int64_t v = 0; v < V; ++v) p[v] = x[v] >= kth ? p[v] : 0.0;
}

// One tree's int inputs and the per-thread workspace.
struct TreeView {
  const int32_t* tokens;       // [N]
  const int32_t* parents;      // [N]
  const int32_t* sampled_row;  // [N]
};

struct Workspace {  // uninitialised buffers: every use writes before it reads
  std::unique_ptr<double[]> x;       // [V] logits / T of the visited node
  std::unique_ptr<double[]> w;       // [V] residual weights, r = w / Z
  std::unique_ptr<double[]> sorted;  // [V] top-k selection scratch
  std::unique_ptr<int32_t[]> ids;    // [V] top-p candidate ids
  std::unique_ptr<int32_t[]> order;  // [N] children in verification order
  Workspace(int64_t V, int64_t N)
      : x(new double[V]), w(new double[V]), sorted(new double[V]), ids(new int32_t[V]),
        order(new int32_t[N]) {}
};

// The residual r = w / Z of one layer (Algorithm 1's r).
struct Residual {
  double* w;     // [V] unnormalised weights, starts as p
  double Z;      // sum(w), tracked through the sparse updates
  int64_t nnz;   // #{v : w[v] > 0}, exact: the rounding guard reads it
  int64_t V;
  double Z0;     // sum(w) of p itself: 1 when p is normalised (fp64), else the softmax sum
};

// First non-finite logit of a visited node, reported after the parallel region.
struct BadLogit {
  int64_t node = -1, token = -1;
  double value = 0.0;
};

// True when every x[v] is finite (exponent bits not all ones): integer ops, so it vectorises.
RHEO_SIMD_CLONES
bool all_finite(const double* x, int64_t V) {
  constexpr uint64_t kExpMask = 0x7FF0000000000000ull;
  uint64_t bad = 0;
  for (int64_t v = 0; v < V; ++v) {
    uint64_t bits;
    std::memcpy(&bits, &x[v], sizeof(bits));
    bad |= static_cast<uint64_t>((bits & kExpMask) == kExpMask);
  }
  return bad == 0;
}

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

RHEO_SIMD_CLONES
void divide_by(double* p, int64_t V, double by) {
  for (int64_t v = 0; v < V; ++v) p[v] /= by;
}

RHEO_SIMD_CLONES
int64_t count_positive(const double* p, int64_t V) {
  int64_t n = 0;
  for (int64_t v = 0; v < V; ++v) n += p[v] > 0.0 ? 1 : 0;
  return n;
}

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
  r = {p, 1.0, count_positive(p, V), V, 1.0};
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
  for (; v < V; ++v) {
    const float f = Row::load1(x, v);
    w[v] = cpu::order_key(f) >= kth_key ? std::exp(static_cast<double>((f - mx) * inv_T)) : 0.0;
    sum += w[v];
    n += w[v] > 0.0;
  }
  *nnz = n;
  return sum;
}

#define RHEO_VERIFY_PASSES(name, Row)                                                          \
  RHEO_SIMD_CLONES int64_t max_##name(const Row::Elem* x, int64_t V, int32_t* max_key) {      \
    return max_row<Row>(x, V, max_key);                                                        \
  }                                                                                            \
  RHEO_SIMD_CLONES double exp_##name(const Row::Elem* x, int64_t V, float mx, float inv_T,     \
                                     int32_t kth_key, double* w, int64_t* nnz) {               \
    return exp_row<Row>(x, V, mx, inv_T, kth_key, w, nnz);                                     \
  }
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
  return true;
}

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

// Children of `node` in verification order (DESIGN.md §2 method table). Returns the count;
// *y_pos = position of the sampled child's min(1, r/q~) test, -1 if none (always -1 for kTopK).
int64_t verification_order(const VerificationArgs& a, const TreeView& t, int64_t node,
                           int32_t* order, int64_t* y_pos) {
  int64_t n = 0;
  *y_pos = -1;
  for (int64_t j = node + 1; j < a.N; ++j) {
    if (t.parents[j] != node) continue;
    if (a.method != VerifyMethod::kTopK && t.sampled_row[j] >= 0) *y_pos = n;
    order[n++] = static_cast<int32_t>(j);
  }
  if (a.method == VerifyMethod::kRheo && *y_pos > 0) {  // Algorithm 1: Y is tested first
    std::rotate(order, order + *y_pos, order + *y_pos + 1);
    *y_pos = 0;
  }
  return n;
}

double q_tilde_at(const VerificationArgs& a, int64_t i) {
  return a.dtype == DType::kFloat64 ? static_cast<const double*>(a.q_tilde)[i]
                                    : static_cast<const float*>(a.q_tilde)[i];
}

void resum_if_cancelled(Residual& r) {
  if (r.Z >= kResumBelow * r.Z0) return;
  r.Z = 0.0;
  for (int64_t v = 0; v < r.V; ++v) r.Z += r.w[v];
}

// One layer at `node` (header "One layer"): tests the children in verification order.
// decide(j, child, num, den, forced) -> true to accept; the test's probability is
// min(1, num / den), or 1 when `forced` (rounding guard). Returns the accepted child or -1
// (every child rejected; r is then the residual to emit from).
template <typename Decide>
int32_t run_layer(const VerificationArgs& a, const TreeView& t, int64_t node, Residual& r,
                  int32_t* order, Decide&& decide) {
  int64_t y_pos;
  const int64_t n = verification_order(a, t, node, order, &y_pos);
  for (int64_t j = 0; j < n; ++j) {
    const int32_t child = order[j];
    const int32_t token = t.tokens[child];
    if (j != y_pos) {  // plain sequential-rejection test: accept with prob r(c)
      const double wc = r.w[token];
      if (decide(j, child, wc / r.Z, 1.0, wc > 0.0 && r.nnz == 1)) return child;
      if (wc > 0.0) {  // Algorithm 1 line 16: r(c) = 0, r = norm(r)
        r.w[token] = 0.0;
        r.Z -= wc;
        r.nnz -= 1;
        resum_if_cancelled(r);
      }
      continue;
    }
    // The sampled child Y: accept with prob min(1, r(Y) / q~(Y)); else r = norm(max(0, r - q~)).
    // With r = w / Z: max(0, w / Z - q~) = max(0, w - Z q~) / Z, so only the support changes.
    const int64_t row = t.sampled_row[child];
    const int32_t* ids = a.q_tilde_ids + row * a.Se;
    const auto q = [&](int64_t s) { return q_tilde_at(a, row * a.Se + s); };
    double q_y = 0.0, removed = 0.0;
    int64_t lost = 0;  // support entries whose weight the correction sets to zero
    for (int64_t s = 0; s < a.Se; ++s) {
      const double w = r.w[ids[s]], zq = r.Z * q(s);
      if (ids[s] == token) q_y = q(s);
      removed += std::min(w, zq);
      lost += w > 0.0 && w <= zq;
    }
    // Rounding guard: a rejection leaving r without mass accepts instead.
    if (decide(j, child, r.w[token] / r.Z, q_y, r.nnz == lost)) return child;
    for (int64_t s = 0; s < a.Se; ++s) r.w[ids[s]] = std::max(0.0, r.w[ids[s]] - r.Z * q(s));
    r.Z -= removed;
    r.nnz -= lost;
    resum_if_cancelled(r);
  }
  return -1;
}

// Final draw: inverse CDF over ids in increasing order, the smallest v with
// cumsum_{u <= v} w(u) > coin * sum(w) (header "Coins").
int32_t draw_from(const Residual& r, double coin) {
  double total = 0.0;
  for (int64_t v = 0; v < r.V; ++v) total += r.w[v];
  const double target = coin * total;
  double cum = 0.0;
  int32_t last = 0;
  for (int64_t v = 0; v < r.V; ++v) {
    if (r.w[v] <= 0.0) continue;
    cum += r.w[v];
    last = static_cast<int32_t>(v);
    if (cum > target) return last;
  }
  return last;  // coin * total rounded up to total
}

TreeView tree_of(const VerificationArgs& a, int64_t b) {
  return {a.tokens + b * a.N, a.parents + b * a.N, a.sampled_row + b * a.N};
}

// The walk of tree b with Philox coins. False (and *bad filled) on a non-finite logit.
bool walk_tree(const VerificationArgs& a, int64_t b, Workspace& ws, BadLogit* bad) {
  const TreeView t = tree_of(a, b);
  int32_t* path = a.accept_path + b * a.path_capacity;
  std::fill(path, path + a.path_capacity, -1);
  path[0] = 0;
  int32_t len = 1, node = 0;
  const auto coin = [&](int64_t slot) {
    return verify_coin(a.seed, a.step, static_cast<uint32_t>(b), static_cast<uint32_t>(a.N),
                       static_cast<uint32_t>(node), static_cast<uint32_t>(slot));
  };
  while (true) {
    Residual r;
    if (!prepare_node(a, b, node, ws, r, bad)) return false;
    const int32_t child = run_layer(a, t, node, r, ws.order.get(),
                                    [&](int64_t j, int32_t, double num, double den, bool forced) {
                                      return forced || coin(j) * den < num;
                                    });
    if (child < 0) {  // every child rejected, or a leaf (r = p): emit from r and stop
      a.accept_len[b] = len;
      a.bonus_token[b] = draw_from(r, coin(kResidualSlot));
      return true;
    }
    path[len++] = child;
    node = child;
  }
}

template <typename Acc>
bool law_tree(const VerificationArgs& a, int64_t b, Workspace& ws, BadLogit* bad) {
  const TreeView t = tree_of(a, b);
  Acc* accept = static_cast<Acc*>(a.accept_prob) + b * a.N;
  std::fill(accept, accept + a.N, Acc(0));
  accept[0] = Acc(1);
  for (int64_t node = 0; node < a.N; ++node) {
    Residual r;
    if (!prepare_node(a, b, node, ws, r, bad)) return false;
    double reach = 1.0;  // P(all tests so far rejected | node visited)
    const int32_t stop = run_layer(a, t, node, r, ws.order.get(),
                                   [&](int64_t, int32_t child, double num, double den, bool forced) {
                                     const double acc =
                                         forced ? 1.0 : std::min(1.0, std::max(0.0, num / den));
                                     accept[child] = static_cast<Acc>(reach * acc);
                                     reach *= 1.0 - acc;
                                     return reach == 0.0;  // nothing left to reject into
                                   });
    Acc* emit = static_cast<Acc*>(a.emit_prob) + (b * a.N + node) * a.V;
    double total = 0.0;
    for (int64_t v = 0; v < a.V; ++v) total += r.w[v];
    for (int64_t v = 0; v < a.V; ++v)
      emit[v] = stop >= 0 ? Acc(0) : static_cast<Acc>(reach * (r.w[v] / total));
  }
  return true;
}

// Runs fn(b, ws, bad) over the trees in parallel; raises the first bad logit after the region.
template <typename Fn>
void for_each_tree(const VerificationArgs& a, Fn fn) {
  std::vector<BadLogit> bad(a.B);
  std::vector<char> failed(a.B, 0);
#pragma omp parallel if (a.B > 1)
  {
    Workspace ws(a.V, a.N);
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < a.B; ++b) failed[b] = !fn(b, ws, &bad[b]);
  }
  for (int64_t b = 0; b < a.B; ++b)
    RHEO_CHECK(!failed[b], "logits[", b, ", ", bad[b].node, ", ", bad[b].token, "] = ",
               bad[b].value, " at visited node ", bad[b].node, ": target logits must be finite "
               "at every visited node; check the target model output (masked tokens must be "
               "large negative numbers, not -inf)");
}

// Tree structure rules of one tree b (parents, tokens, sampled rows and their q~).
void check_tree(const VerificationArgs& a, int64_t b, std::vector<int32_t>& depth,
                std::vector<int32_t>& sampled_children) {
  const TreeView t = tree_of(a, b);
  RHEO_CHECK(t.parents[0] == -1, "parents[", b, ", 0] = ", t.parents[0],
             ": node 0 is the root and must have parent -1");
  depth[0] = 0;
  std::fill(sampled_children.begin(), sampled_children.end(), 0);
  for (int64_t j = 1; j < a.N; ++j) {
    const int32_t par = t.parents[j], tok = t.tokens[j], row = t.sampled_row[j];
    RHEO_CHECK(par >= 0 && par < j, "parents[", b, ", ", j, "] = ", par, ": a node's parent must "
               "precede it (0 <= parent < node); lay the tree out with build_tree");
    RHEO_CHECK(tok >= 0 && tok < a.V, "tokens[", b, ", ", j, "] = ", tok, " is outside the "
               "vocabulary [0, V = ", a.V, ")");
    RHEO_CHECK(row >= -1 && row < a.R, "sampled_row[", b, ", ", j, "] = ", row, " must be -1 or "
               "a row of q_tilde in [0, R = ", a.R, ")");
    depth[j] = depth[par] + 1;
    if (row < 0) continue;
    RHEO_CHECK(++sampled_children[par] == 1, "node ", par, " of tree ", b, " has more than one "
               "sampled child (second: node ", j, "); at most one child per parent has "
               "sampled_row >= 0");
    double q_tok = 0.0;
    for (int64_t s = 0; s < a.Se; ++s) {
      const int32_t id = a.q_tilde_ids[row * a.Se + s];
      const double q = q_tilde_at(a, row * a.Se + s);
      RHEO_CHECK(id >= 0 && id < a.V, "q_tilde_ids[", row, ", ", s, "] = ", id, " is outside "
                 "the vocabulary [0, V = ", a.V, ")");
      RHEO_CHECK(std::isfinite(q) && q >= 0.0, "q_tilde[", row, ", ", s, "] = ", q, " must be "
                 "a finite probability >= 0");
      if (id == tok) q_tok = q;
    }
    RHEO_CHECK(q_tok > 0.0, "sampled node ", j, " of tree ", b, " has token ", tok, " with q~ = "
               "0 in q_tilde row ", row, ": a sampled token must be in its support with "
               "q~ > 0 (was it drawn from that row?)");
  }
  if (a.accept_path == nullptr) return;  // law mode has no path
  const int32_t max_depth = *std::max_element(depth.begin(), depth.end());
  RHEO_CHECK(a.path_capacity >= max_depth + 1, "path_capacity = ", a.path_capacity, " but tree ",
             b, " has depth ", max_depth, "; path_capacity must be >= depth + 1 = ",
             max_depth + 1);
}

}  // namespace

void verification_check_args(const VerificationArgs& a) {
  RHEO_CHECK(a.B >= 1 && a.N >= 1 && a.V >= 1, "logits must be [B, N, V] with B, N, V >= 1, got "
             "[", a.B, ", ", a.N, ", ", a.V, "]");
  RHEO_CHECK(std::isfinite(a.T) && a.T >= 0.0, "T=", a.T, " must be a finite temperature >= 0 "
             "(0 = greedy)");
  RHEO_CHECK(a.top_p > 0.0 && a.top_p <= 1.0, "top_p=", a.top_p, " must be in (0, 1]; use 1.0 "
             "to disable");
  RHEO_CHECK(a.top_k >= 0, "top_k=", a.top_k, " must be >= 0; use 0 to disable");
  const int32_t m = static_cast<int32_t>(a.method);
  RHEO_CHECK(m >= 0 && m <= 2, "method=", m, " must be 0 (topk), 1 (rrsw) or 2 (rheo)");
  RHEO_CHECK(a.R >= 0 && a.Se >= 0, "q_tilde must be [R, Se] with R, Se >= 0, got [", a.R, ", ",
             a.Se, "]");
  RHEO_CHECK(a.accept_path == nullptr || a.path_capacity >= 1, "path_capacity = ",
             a.path_capacity, " must be >= 1 (the root)");
  RHEO_CHECK(a.N <= (int64_t{1} << 31) / a.B, "B * N = ", a.B * a.N, " must fit the 32-bit coin "
             "index; verify fewer trees per call");
  std::vector<int32_t> depth(a.N), sampled_children(a.N);
  for (int64_t b = 0; b < a.B; ++b) check_tree(a, b, depth, sampled_children);
}

void verification_cpu(const VerificationArgs& args) {
  verification_check_args(args);
  RHEO_CHECK(args.accept_path && args.accept_len && args.bonus_token,
             "verification_cpu needs accept_path, accept_len and bonus_token outputs");
  for_each_tree(args, [&](int64_t b, Workspace& ws, BadLogit* bad) {
    return walk_tree(args, b, ws, bad);
  });
}

void verification_law_cpu(const VerificationArgs& args) {
  verification_check_args(args);
  RHEO_CHECK(args.accept_prob && args.emit_prob,
             "verification_law_cpu needs accept_prob and emit_prob outputs");
  const bool f64 = args.dtype == DType::kFloat64;
  for_each_tree(args, [&](int64_t b, Workspace& ws, BadLogit* bad) {
    return f64 ? law_tree<double>(args, b, ws, bad) : law_tree<float>(args, b, ws, bad);
  });
}

}  // namespace rheo
