// Pool sampler on the CPU, passes 1 and 2 over V (see pool_sampler.cpp): the Se highest logits
// of a row in support order, the finiteness check, and the untempered mass outside the support.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#include "pool_sampler_internal.h"

namespace rheo {
namespace pool_sampler_detail {
namespace {

using cpu::Float16;
using cpu::Int16;
using cpu::kLanes;

constexpr int64_t kSumBlock = 1024;  // elements summed in float before the sum goes to double

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

// One set of ISA copies per element type.
#define RHEO_POOL_PASSES(name, Row)                                                            \
  RHEO_ISA_COPIES(int64_t, bound_##name, bound_row<Row>,                                       \
                  (const Row::Elem* x, int64_t V, int64_t Se, int32_t* max_key,                \
                   int32_t* chunk_max),                                                        \
                  (x, V, Se, max_key, chunk_max))                                              \
  RHEO_ISA_COPIES(double, scan_##name, scan_row<Row>,                                          \
                  (const Row::Elem* x, int64_t V, float M, int32_t floor_key,                  \
                   std::vector<Entry<float>>& cand),                                           \
                  (x, V, M, floor_key, cand))
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

}  // namespace

// Passes 1 and 2 of one row (pool_sampler_internal.h).
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

template bool scan_support<float>(const void*, DType, int64_t, int64_t,
                                  std::vector<Entry<float>>&, std::vector<int32_t>&,
                                  std::vector<Entry<float>>&, double*, RowError&);
template bool scan_support<double>(const void*, DType, int64_t, int64_t,
                                   std::vector<Entry<double>>&, std::vector<int32_t>&,
                                   std::vector<Entry<float>>&, double*, RowError&);

}  // namespace pool_sampler_detail
}  // namespace rheo
