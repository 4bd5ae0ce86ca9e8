// Verification on CUDA, part 1 (included by verification.cu only): the logit row types, the
// block primitives (every sum in a fixed order) and row_stats, the O(V) processing of one node
// row into its NodeStats (see verification.cu's header for the design).
#pragma once

#include <cstdint>

#include "device_utils.cuh"
#include "rheo/verification.h"

namespace rheo {
namespace {

using u64 = unsigned long long;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr double kResumBelow = 1e-6;     // as in the CPU kernel
constexpr int32_t kNoTie = INT32_MAX;    // top-p keeps every tie at the threshold
constexpr int32_t kUnchanged = INT32_MAX;  // hash value: entry untouched at this node
constexpr int32_t kZeroed = -1;            // hash value: a rejected child's token, w = 0

// What the walk needs of a node's row (the prepass output, 48 bytes). A token v is kept when
// key(v) >= kth and (key(v) > tau or (key(v) == tau and v <= last_tie)); 0 / kNoTie: off.
struct NodeStats {
  double m;          // max of the compared value (fp32/bf16/fp16: the logit; fp64: logit / T)
  double z;          // Z0: sum of e over the kept tokens
  u64 kth;           // top-k: the key of the k-th largest
  u64 tau;           // top-p: the key of the threshold element
  int32_t nnz;       // #{kept v: e(v) > 0}
  int32_t last_tie;  // top-p: the last id kept among the ties at tau
  int32_t argmax;    // T = 0: the one-hot token (lowest id on ties)
  int32_t bad;       // a non-finite logit in the row
};
static_assert(sizeof(NodeStats) == 48, "NodeStats is 6 doubles of the workspace");

// --- rows: the logit types -----------------------------------------------------------------------
// value: what the max and top-k compare (fp64: x = logit / T, as the CPU's double path; the float
// types: the raw logit, as the CPU's float path); key: an order-preserving unsigned key of it,
// left-aligned, with -0.0 and +0.0 equal; weight: e = exp((value - m) / T) in the CPU's precision,
// 0 below the cut (an explicit underflow, so e > 0 exactly where y >= kCut).

__device__ __forceinline__ u64 key32(uint32_t u) {
  if ((u & 0x7FFFFFFFu) == 0) u = 0;
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return static_cast<u64>(u) << 32;
}
__device__ __forceinline__ u64 key16(uint32_t u) {
  if ((u & 0x7FFFu) == 0) u = 0;
  u = (u & 0x8000u) ? (~u & 0xFFFFu) : (u | 0x8000u);
  return static_cast<u64>(u) << 48;
}
__device__ __forceinline__ u64 key64(double d) {
  u64 u = static_cast<u64>(__double_as_longlong(d));
  if ((u << 1) == 0) u = 0;
  return (u >> 63) ? ~u : (u | (1ull << 63));
}

__device__ __forceinline__ float float_weight(float c, float m, float inv_T) {
  const float y = (c - m) * inv_T;
  return y >= -80.0f ? expf(y) : 0.0f;
}

struct F32Row {
  using Elem = float;
  using C = float;
  static constexpr int kBits = 32;
  __device__ static C value(Elem l, double) { return l; }
  __device__ static bool finite(Elem l) { return isfinite(l); }
  __device__ static u64 key(Elem l, C) { return key32(__float_as_uint(l)); }
  __device__ static double weight(C c, C m, float inv_T) { return float_weight(c, m, inv_T); }
};

struct Bf16Row {
  using Elem = uint16_t;
  using C = float;
  static constexpr int kBits = 16;
  __device__ static C value(Elem l, double) { return __uint_as_float(static_cast<uint32_t>(l) << 16); }
  __device__ static bool finite(Elem l) { return (l & 0x7F80u) != 0x7F80u; }
  __device__ static u64 key(Elem l, C) { return key16(l); }
  __device__ static double weight(C c, C m, float inv_T) { return float_weight(c, m, inv_T); }
};

struct F16Row {
  using Elem = uint16_t;
  using C = float;
  static constexpr int kBits = 16;
  __device__ static C value(Elem l, double) { return __half2float(__ushort_as_half(l)); }
  __device__ static bool finite(Elem l) { return (l & 0x7C00u) != 0x7C00u; }
  __device__ static u64 key(Elem l, C) { return key16(l); }
  __device__ static double weight(C c, C m, float inv_T) { return float_weight(c, m, inv_T); }
};

struct F64Row {
  using Elem = double;
  using C = double;
  static constexpr int kBits = 64;
  __device__ static C value(Elem l, double T) { return T > 0.0 ? l / T : l; }
  __device__ static bool finite(Elem l) { return isfinite(l); }
  __device__ static u64 key(Elem, C c) { return key64(c); }
  __device__ static double weight(C c, C m, float) {
    const double y = c - m;
    return y >= -700.0 ? exp(y) : 0.0;
  }
};

__device__ __forceinline__ float inv_temperature(double T) {
  return T > 0.0 ? static_cast<float>(1.0 / T) : 1.0f;  // the CPU float path's inv_T
}

// p at token v of a node before its tests, unnormalised (p = e / Z0). Min-p keeps e >= min_p:
// the max token's e is exactly 1 (exp of 0) and top-k / top-p always keep it, so e / max e = e.
template <typename Row>
__device__ __forceinline__ double target_weight(const NodeStats& st, const typename Row::Elem* x,
                                                int64_t v, double T, float inv_T, double min_p) {
  if (T == 0.0) return v == st.argmax ? 1.0 : 0.0;
  const typename Row::Elem l = x[v];
  const typename Row::C c = Row::value(l, T);
  const u64 k = Row::key(l, c);
  if (k < st.kth || k < st.tau || (k == st.tau && v > st.last_tie)) return 0.0;
  const double e = Row::weight(c, static_cast<typename Row::C>(st.m), inv_T);
  return e >= min_p ? e : 0.0;
}

__device__ double q_tilde_at(const VerificationArgs& a, int64_t i) {
  return a.dtype == DType::kFloat64 ? static_cast<const double*>(a.q_tilde)[i]
                                    : static_cast<const float*>(a.q_tilde)[i];
}

// --- block primitives (every sum in a fixed order: both schedules agree bit for bit) ----------------

struct RowShared {
  double red_d[kWarps];
  int64_t red_i[kWarps];
  unsigned cnt32[256], lo32[256], hi32[256];  // radix histograms, as the atomics add them
  u64 cnt[256], mass[256];  // the same, widened: counts and fixed-point masses
  double grp[kThreads];     // find_crossing: group sums of the crossing chunk
  double chunk_sum[kWarps], chunk_before[kWarps];
  int64_t chunk_last[kWarps];
  double find_target, find_before;
  int64_t find_result;
  int find_chunk;
  int bin;  // select_bin's answer and the sums above it
  u64 above, above_cnt, target;
  int32_t last_tie;
  NodeStats st;  // row_stats' result
};

template <typename T, typename Op>
__device__ T warp_reduce(T val, Op op) {
  for (int o = 16; o > 0; o >>= 1) val = op(val, __shfl_xor_sync(kFull, val, o));
  return val;
}

// Every thread gets the result.
template <typename T, typename Op>
__device__ T block_reduce(T val, Op op, T* scratch) {
  val = warp_reduce(val, op);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = val;
  __syncthreads();
  T total = scratch[0];
  for (int i = 1; i < kWarps; ++i) total = op(total, scratch[i]);
  __syncthreads();
  return total;
}

struct Add {
  template <typename T>
  __device__ T operator()(T x, T y) const { return x + y; }
};
struct Max {
  template <typename T>
  __device__ T operator()(T x, T y) const { return x > y ? x : y; }
};
struct Min {
  template <typename T>
  __device__ T operator()(T x, T y) const { return x < y ? x : y; }
};

__device__ double block_sum(double v, RowShared& sh) { return block_reduce(v, Add(), sh.red_d); }
__device__ int64_t block_sum_i(int64_t v, RowShared& sh) { return block_reduce(v, Add(), sh.red_i); }
__device__ int64_t block_min_i(int64_t v, RowShared& sh) { return block_reduce(v, Min(), sh.red_i); }

// Prefix sums over threads in thread order: *excl and *incl of this thread, *total of the block.
template <typename T>
__device__ void block_scan(T v, T* scratch, T* excl, T* incl, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T in = v;
  for (int o = 1; o < 32; o <<= 1) {
    const T up = __shfl_up_sync(kFull, in, o);
    if (lane >= o) in += up;
  }
  T ex = __shfl_up_sync(kFull, in, 1);
  if (lane == 0) ex = T(0);
  if (lane == 31) scratch[warp] = in;
  __syncthreads();
  T off = T(0), all = T(0);
  for (int i = 0; i < kWarps; ++i) {
    if (i == warp) off = all;
    all += scratch[i];
  }
  __syncthreads();
  *excl = off + ex;
  *incl = off + in;
  *total = all;
}

// Adds one element to bin `bin` of the block histograms (bin < 0: none): a count, and its
// fixed-point mass q when `mass` (false: counts only). Native 32-bit shared atomics only (a
// 64-bit shared add is a compare-and-swap loop): the mass goes in as two 32-bit words with the
// carry of the low word passed on exactly, so the sums are integers and do not depend on the
// order of the atomics. No warp operations: any lane may call it alone.
__device__ __forceinline__ void hist_add(RowShared& sh, int bin, bool mass, u64 q) {
  if (bin < 0) return;
  atomicAdd(&sh.cnt32[bin], 1u);
  if (!mass) return;
  const unsigned lo = static_cast<unsigned>(q), hi = static_cast<unsigned>(q >> 32);
  const unsigned old = atomicAdd(&sh.lo32[bin], lo);
  const unsigned carry = old + lo < old ? 1u : 0u;
  if (hi + carry != 0) atomicAdd(&sh.hi32[bin], hi + carry);
}

__device__ void hist_clear(RowShared& sh) {
  for (int i = threadIdx.x; i < 256; i += kThreads) sh.cnt32[i] = 0, sh.lo32[i] = 0, sh.hi32[i] = 0;
}

// The 32-bit words into the 64-bit histograms select_bin reads (call between barriers).
__device__ void hist_widen(RowShared& sh) {
  for (int i = threadIdx.x; i < 256; i += kThreads) {
    sh.cnt[i] = sh.cnt32[i];
    sh.mass[i] = (static_cast<u64>(sh.hi32[i]) << 32) | sh.lo32[i];
  }
}

// Warp 0: the highest bin b with sum_{c >= b} h[c] >= need (need >= 1), into sh.bin, with the sums
// above it: sh.above of h and sh.above_cnt of h2 (when given). The sums are integers, so a bin's
// sub-bins add up to exactly its own sum and the descent always finds a bin; should none reach
// need all the same, the lowest non-empty bin is taken (a review defect: the radix search over
// double masses ran out of bins and top-p switched off).
__device__ void select_bin(const u64* h, const u64* h2, u64 need, RowShared& sh) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  const u64* nonempty_h = h2 != nullptr ? h2 : h;
  u64 mine = 0, mine2 = 0;
  for (int k = 0; k < 8; ++k) {
    mine += h[8 * lane + k];
    if (h2 != nullptr) mine2 += h2[8 * lane + k];
  }
  u64 suf = mine, suf2 = mine2;  // sums over the lanes >= this one
  for (int o = 1; o < 32; o <<= 1) {
    const u64 t = __shfl_down_sync(kFull, suf, o), t2 = __shfl_down_sync(kFull, suf2, o);
    if (lane + o < 32) suf += t, suf2 += t2;
  }
  u64 nonempty_mine = 0;
  for (int k = 0; k < 8; ++k) nonempty_mine += nonempty_h[8 * lane + k];
  const unsigned ok = __ballot_sync(kFull, suf >= need);
  const unsigned nonempty = __ballot_sync(kFull, nonempty_mine > 0);
  const int owner = ok != 0 ? 31 - __clz(static_cast<int>(ok))
                            : (nonempty != 0 ? __ffs(static_cast<int>(nonempty)) - 1 : 0);
  if (lane != owner) return;
  u64 acc = suf - mine, acc2 = suf2 - mine2;  // the lanes above
  int bin = 8 * lane;
  if (ok != 0) {
    for (int k = 7; k >= 0; --k) {
      bin = 8 * lane + k;
      if (acc + h[bin] >= need) break;
      acc += h[bin];
      if (h2 != nullptr) acc2 += h2[bin];
    }
  } else {
    int low = 7;
    for (int k = 0; k < 8; ++k)
      if (nonempty_h[8 * lane + k] > 0) {
        low = k;
        break;
      }
    bin = 8 * lane + low;
    for (int k = 7; k > low; --k) {
      acc += h[8 * lane + k];
      if (h2 != nullptr) acc2 += h2[8 * lane + k];
    }
  }
  sh.bin = bin;
  sh.above = acc;
  sh.above_cnt = acc2;
}

// The inverse-CDF search over f >= 0 on [0, V): the smallest v with f(v) > 0 and
// sum_{u <= v} f(u) > target_of(total), total = sum f; -1 when total is 0 (no mass). Coalesced in
// three levels: warp w sums the 32-aligned chunk w with its lanes strided (all of V); the chunk
// where the running sum crosses is re-summed in groups of 32 by all warps (V / 16); one warp scans
// the crossing group. Each level adds in a fixed order; where rounding makes a level miss the
// crossing the level above found, the answer is that chunk's (group's) last positive entry, as
// the CPU's is the last positive entry when coin * total rounds up to total.
template <typename F, typename Target>
__device__ int64_t find_crossing(int64_t V, F f, Target target_of, RowShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t C = (V + kThreads - 1) / kThreads * 32;  // chunk length, a multiple of 32
  {
    const int64_t lo = warp * C, hi = lo + C < V ? lo + C : V;
    double part = 0.0;
    int64_t last = -1;
    for (int64_t base = lo; base < hi; base += 32) {  // warp-uniform
      const int64_t v = base + lane;
      const double x = v < hi ? f(v) : 0.0;
      part += x;
      if (x > 0.0) last = v;
    }
    part = warp_reduce(part, Add());
    last = warp_reduce(last, Max());
    if (lane == 0) sh.chunk_sum[warp] = part, sh.chunk_last[warp] = last;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double cum = 0.0;
    int64_t last = -1;
    for (int w = 0; w < kWarps; ++w) {
      sh.chunk_before[w] = cum;
      cum += sh.chunk_sum[w];
      if (sh.chunk_last[w] >= 0) last = sh.chunk_last[w];
    }
    const double target = target_of(cum);
    int found = -1;
    for (int w = 0; w < kWarps && found < 0; ++w)
      if (sh.chunk_sum[w] > 0.0 && sh.chunk_before[w] + sh.chunk_sum[w] > target) found = w;
    sh.find_chunk = found;
    sh.find_target = target;
    sh.find_result = last;  // nothing crosses: the last positive entry (-1: no mass)
  }
  __syncthreads();
  const int w = sh.find_chunk;
  const double target = sh.find_target;
  if (w < 0) {
    const int64_t result = sh.find_result;
    __syncthreads();
    return result;
  }
  const int64_t lo = w * C, hi = lo + C < V ? lo + C : V, groups = (hi - lo + 31) / 32;
  double carry = sh.chunk_before[w];
  int64_t hit = INT64_MAX;
  for (int64_t g0 = 0; g0 < groups && hit == INT64_MAX; g0 += kThreads) {  // uniform
    const int64_t g1 = g0 + kThreads < groups ? g0 + kThreads : groups;
    for (int64_t g = g0 + warp; g < g1; g += kWarps) {  // warp-uniform
      const int64_t v = lo + g * 32 + lane;
      const double x = warp_reduce(v < hi ? f(v) : 0.0, Add());
      if (lane == 0) sh.grp[g - g0] = x;
    }
    __syncthreads();
    const int64_t g = g0 + threadIdx.x;
    const double gs = g < g1 ? sh.grp[threadIdx.x] : 0.0;
    double ex, in, total;
    block_scan(gs, sh.red_d, &ex, &in, &total);
    const bool crosses = gs > 0.0 && carry + in > target;
    hit = block_min_i(crosses ? g : INT64_MAX, sh);
    if (hit == g) sh.find_before = carry + ex;
    carry += total;
    __syncthreads();
  }
  if (hit == INT64_MAX) {  // rounding: the chunk's sum crossed, its groups' did not
    const int64_t result = sh.chunk_last[w];
    __syncthreads();
    return result;
  }
  if (warp == 0) {
    const int64_t v = lo + hit * 32 + lane;
    const double x = v < hi ? f(v) : 0.0;
    double in = x;  // warp inclusive scan, then the crossing lane
    for (int o = 1; o < 32; o <<= 1) {
      const double up = __shfl_up_sync(kFull, in, o);
      if (lane >= o) in += up;
    }
    const unsigned crossing = __ballot_sync(kFull, x > 0.0 && sh.find_before + in > target);
    const unsigned positive = __ballot_sync(kFull, x > 0.0);
    if (lane == 0)
      sh.find_result = lo + hit * 32 +
                       (crossing != 0 ? __ffs(static_cast<int>(crossing)) - 1
                                      : 31 - __clz(static_cast<int>(positive)));
  }
  __syncthreads();
  const int64_t result = sh.find_result;
  __syncthreads();
  return result;
}

// --- step 1: the processed target of one row, as NodeStats -----------------------------------------

__device__ void write_stats(const NodeStats& st, RowShared& sh) {
  if (threadIdx.x == 0) sh.st = st;
  __syncthreads();
}

// Bits of fixed point for the top-p masses: V masses <= 1 sum below 2^63.
__device__ __forceinline__ int mass_bits(int64_t V) {
  int bits = 0;
  while ((int64_t{1} << bits) <= V) ++bits;
  return 63 - bits;
}

// Header "Target processing" at one row of logits (block-wide; every thread returns after sh.st
// is written). T = 0: the argmax. Otherwise pass 1 reads the row once for the non-finite check and
// the max (plus, plain, the sum and count of e by online softmax; plus, with top-k, the first radix
// digit); top-k: an MSB-first radix select of the k-th largest key, 8 bits a pass; top-p: the same
// descent over the fixed-point masses of the kept tokens (integers: exact and order-free), then
// the ties kept at the threshold in id order.
template <typename Row>
__device__ void filtered_stats(const VerificationArgs& a, int64_t row, RowShared& sh) {
  using Elem = typename Row::Elem;
  using C = typename Row::C;
  const Elem* x = static_cast<const Elem*>(a.logits) + row * a.V;
  const int64_t V = a.V;
  const float inv_T = inv_temperature(a.T);
  NodeStats st;
  st.m = 0.0, st.z = 1.0, st.kth = 0, st.tau = 0, st.nnz = 1, st.last_tie = kNoTie;
  st.argmax = 0, st.bad = 0;

  if (a.T == 0.0) {  // greedy: one-hot on the argmax, lowest id on ties
    C best = -INFINITY;
    int64_t arg = V;
    bool bad = false;
    for (int64_t v = threadIdx.x; v < V; v += kThreads) {
      const Elem l = x[v];
      bad |= !Row::finite(l);
      const C c = Row::value(l, 0.0);
      if (c > best) best = c, arg = v;  // v increases: ties keep the lowest id
    }
    if (__syncthreads_or(bad)) {
      st.bad = 1;
      return write_stats(st, sh);
    }
    const double m = block_reduce(static_cast<double>(best), Max(), sh.red_d);
    st.argmax = static_cast<int32_t>(block_min_i(static_cast<double>(best) == m ? arg : V, sh));
    return write_stats(st, sh);
  }

  const bool topk = a.top_k > 0 && a.top_k < V, topp = a.top_p < 1.0, plain = !topk && !topp;
  hist_clear(sh);
  __syncthreads();
  // Pass 1. Online softmax (plain): s_t = sum of e relative to the thread's running max m_t,
  // rescaled when it grows; n_t counts e > 0 relative to m_t, and lo_t is the least value counted:
  // when e(lo_t) > 0 at the final max every counted e is still > 0 (monotone), and an element not
  // counted stays at 0, so the count is exact; otherwise (a row spanning the underflow cut) the
  // sum and count are redone in a second pass.
  C m_t = -INFINITY, lo_t = INFINITY;
  double s_t = 0.0;
  int64_t n_t = 0;
  bool bad = false;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const Elem l = x[v];
    bad |= !Row::finite(l);
    const C c = Row::value(l, a.T);
    if (c > m_t) {
      if (s_t > 0.0) s_t *= Row::weight(m_t, c, inv_T);
      m_t = c;
    }
    if (plain) {
      const double e = Row::weight(c, m_t, inv_T);
      if (e > 0.0) s_t += e, ++n_t, lo_t = c < lo_t ? c : lo_t;
    }
    if (topk) hist_add(sh, static_cast<int>(Row::key(l, c) >> 56), false, 0);
  }
  if (__syncthreads_or(bad)) {
    st.bad = 1;
    return write_stats(st, sh);
  }
  const C m = static_cast<C>(block_reduce(static_cast<double>(m_t), Max(), sh.red_d));
  st.m = static_cast<double>(m);

  if (plain) {
    double S = block_sum(s_t > 0.0 ? s_t * Row::weight(m_t, m, inv_T) : 0.0, sh);
    int64_t n = block_sum_i(n_t, sh);
    if (!__syncthreads_and(n_t == 0 || Row::weight(lo_t, m, inv_T) > 0.0)) {
      double s = 0.0;
      int64_t k = 0;
      for (int64_t v = threadIdx.x; v < V; v += kThreads) {
        const double e = Row::weight(Row::value(x[v], a.T), m, inv_T);
        s += e;
        k += e > 0.0;
      }
      S = block_sum(s, sh);
      n = block_sum_i(k, sh);
    }
    st.z = S;
    st.nnz = static_cast<int32_t>(n);
    return write_stats(st, sh);
  }

  // Top-k: the k-th largest key, MSB-first, 8 bits a pass (the first digit came with pass 1).
  const int low_shift = 64 - Row::kBits;
  if (topk) {
    u64 prefix = 0, mask = 0, remaining = static_cast<u64>(a.top_k);
    for (int shift = 56; shift >= low_shift; shift -= 8) {
      if (shift != 56) {
        hist_clear(sh);
        __syncthreads();
        for (int64_t v = threadIdx.x; v < V; v += kThreads) {
          const Elem l = x[v];
          const u64 k = Row::key(l, Row::value(l, a.T));
          if ((k & mask) == prefix) hist_add(sh, static_cast<int>((k >> shift) & 255), false, 0);
        }
      }
      __syncthreads();
      hist_widen(sh);
      __syncthreads();
      select_bin(sh.cnt, nullptr, remaining, sh);
      __syncthreads();
      remaining -= sh.above;
      prefix |= static_cast<u64>(sh.bin) << shift;
      mask |= 255ull << shift;
      __syncthreads();
    }
    st.kth = prefix;
  }

  if (!topp) {  // top-k alone: the sum and count of the kept e
    double s = 0.0;
    int64_t n = 0;
    for (int64_t v = threadIdx.x; v < V; v += kThreads) {
      const Elem l = x[v];
      const C c = Row::value(l, a.T);
      if (Row::key(l, c) < st.kth) continue;
      const double e = Row::weight(c, m, inv_T);
      s += e;
      n += e > 0.0;
    }
    st.z = block_sum(s, sh);
    st.nnz = static_cast<int32_t>(block_sum_i(n, sh));
    return write_stats(st, sh);
  }

  // Top-p: keep a token while the mass before it (in key order, ties by id) is < top_p * sum.
  // Masses are q = round(e 2^F) in 64-bit integers; the descent finds the threshold key tau (the
  // first whose inclusive mass reaches the target) with `above` = the mass of the keys > tau.
  const double scale = ldexp(1.0, mass_bits(V));
  u64 prefix = 0, mask = 0, above = 0, above_cnt = 0, target = 0, n_ties = 0, tie_mass = 0;
  for (int shift = 56; shift >= low_shift; shift -= 8) {
    hist_clear(sh);
    __syncthreads();
    for (int64_t v = threadIdx.x; v < V; v += kThreads) {
      const Elem l = x[v];
      const C c = Row::value(l, a.T);
      const u64 k = Row::key(l, c);
      if (k < st.kth || (k & mask) != prefix) continue;
      const double e = Row::weight(c, m, inv_T);
      if (e > 0.0) hist_add(sh, static_cast<int>((k >> shift) & 255), true, static_cast<u64>(e * scale + 0.5));
    }
    __syncthreads();
    hist_widen(sh);
    __syncthreads();
    if (shift == 56 && threadIdx.x == 0) {  // the target, from the whole kept mass
      u64 total = 0;
      for (int i = 0; i < 256; ++i) total += sh.mass[i];
      const double t = ceil(a.top_p * static_cast<double>(total));
      u64 tq = t >= static_cast<double>(total) ? total : static_cast<u64>(t);
      sh.target = tq < 1 ? 1 : tq;
    }
    __syncthreads();
    target = sh.target;
    select_bin(sh.mass, sh.cnt, target > above ? target - above : 1, sh);
    __syncthreads();
    above += sh.above;
    above_cnt += sh.above_cnt;
    prefix |= static_cast<u64>(sh.bin) << shift;
    mask |= 255ull << shift;
    n_ties = sh.cnt[sh.bin];
    tie_mass = sh.mass[sh.bin];
    __syncthreads();
  }
  st.tau = prefix;
  // The ties at tau share one mass: tie j (in id order) is kept while above + j q < target.
  const u64 q_tau = n_ties > 0 ? tie_mass / n_ties : 0;
  u64 keep = n_ties;
  if (q_tau > 0 && target > above) {
    const u64 need = (target - above + q_tau - 1) / q_tau;
    keep = need < n_ties ? need : n_ties;
  }
  if (keep < 1 && n_ties > 0) keep = 1;
  if (keep < n_ties) {  // the keep-th tie in id order
    const u64 tau = prefix;
    const int64_t id = find_crossing(
        V,
        [&](int64_t v) {
          const Elem l = x[v];
          return Row::key(l, Row::value(l, a.T)) == tau ? 1.0 : 0.0;
        },
        [&](double) { return static_cast<double>(keep) - 0.5; }, sh);
    st.last_tie = static_cast<int32_t>(id);
  }
  st.nnz = static_cast<int32_t>(above_cnt + keep);
  st.z = static_cast<double>(above + keep * q_tau) / scale;
  return write_stats(st, sh);
}

// The processed target's stats (header "Target processing"): filtered_stats (temperature, top-k,
// top-p), then min-p, HF's order: of the tokens top-p kept, those with p < min_p * max p go, i.e.
// e < min_p (target_weight's rule); one more pass sums and counts the e that stay.
template <typename Row>
__device__ void row_stats(const VerificationArgs& a, int64_t row, RowShared& sh) {
  filtered_stats<Row>(a, row, sh);
  if (a.T == 0.0 || a.min_p <= 0.0 || sh.st.bad) return;
  const NodeStats st = sh.st;
  const typename Row::Elem* x = static_cast<const typename Row::Elem*>(a.logits) + row * a.V;
  const float inv_T = inv_temperature(a.T);
  double s = 0.0;
  int64_t n = 0;
  for (int64_t v = threadIdx.x; v < a.V; v += kThreads) {
    const double e = target_weight<Row>(st, x, v, a.T, inv_T, a.min_p);
    s += e;
    n += e > 0.0;
  }
  const double z = block_sum(s, sh);
  const int64_t nnz = block_sum_i(n, sh);
  if (threadIdx.x == 0) sh.st.z = z, sh.st.nnz = static_cast<int32_t>(nnz);
  __syncthreads();
}

}  // namespace
}  // namespace rheo
