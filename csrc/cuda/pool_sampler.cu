// Pool sampler on CUDA (contract: rheo/pool_sampler.h; CPU twin: csrc/cpu/pool_sampler.cpp).
//
// Work mapping: one block of 256 threads per row. A row (V up to ~150k) is one block's worth of
// streaming work, n (expanded nodes, ~10-100) fills the GPU well enough, and keeping a row inside
// one block makes every cross-thread step a __syncthreads, with no inter-block protocol.
// Per row:
//   1. radix select (8 bits a pass, 256-bin shared histogram) of the key of the Se-th highest
//      logit: every element above it is in the support, ties at it are taken lowest id first
//      (each warp scans a contiguous id range; warp counts in order), so the support is exactly
//      the CPU's;
//   2. the Se entries are gathered into the row's outputs (q_tilde_ids, q_tilde as scratch) and
//      rank-sorted in support order (descending logit, lower id first);
//   3. the outside mass sum exp(l - M) over l below the support (block reduction in double);
//   4. warp 0 runs the support math in double (z, z_T, the inverse CDF for Y with the same Philox
//      coin as a warp scan, slots, proxies), so CPU and CUDA pick the same Y except when a coin
//      falls within rounding of a CDF boundary;
//   5. all threads write q~.
// Bad input cannot raise here (no host sync): a forced token that cannot be Y leaves its row
// without a sampled child, a row with a NaN / inf logit gets safe outputs; both set a status bit
// (common.h StatusBit) that the host reads once per step.

#include <cfloat>
#include <cstdint>

#include "device_utils.cuh"
#include "rheo/pool_sampler.h"

namespace rheo {
namespace {

constexpr int kThreads = 256;
// Support entries a thread ranks: Se <= 256 * 8 = 2048. Its three local arrays are the kernel's
// stack frame (128 bytes for fp64), which the driver reserves for every resident thread (at 64
// entries: 1 KB, ~270 MB of local memory on an H200).
constexpr int kMaxPerThread = 8;
constexpr int64_t kMaxSupport = int64_t(kThreads) * kMaxPerThread;

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ double load(const double* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}

// Order-preserving unsigned keys: a > b as reals <=> key(a) > key(b), and a == b as reals <=>
// key(a) == key(b): -0.0 maps to +0.0's key, so the two tie and the lower id goes first, as on
// the CPU (a review defect: -0.0 used to rank below +0.0).
__device__ __forceinline__ uint32_t key_of(float x) {
  const uint32_t b = __float_as_uint(x == 0.0f ? 0.0f : x);
  return b ^ ((b >> 31) ? 0xFFFFFFFFu : 0x80000000u);
}
__device__ __forceinline__ uint64_t key_of(double x) {
  const uint64_t b = static_cast<uint64_t>(__double_as_longlong(x == 0.0 ? 0.0 : x));
  return b ^ ((b >> 63) ? ~0ull : 0x8000000000000000ull);
}

template <typename T>
__device__ T block_sum(T v, T* shared) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, off);
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
  __syncthreads();
  T total = 0;
  for (int w = 0; w < kThreads / 32; ++w) total += shared[w];
  __syncthreads();
  return total;
}

// Step 1: the key of the Se-th highest logit and how many entries equal to it the support takes.
// Returns false (block-uniform) when the row holds a NaN or an infinity: the first pass reads
// every logit anyway, so the check costs one barrier.
template <typename Src, typename Key>
__device__ bool radix_select(const Src* row, int64_t V, int64_t Se, Key* thr, int64_t* n_ties) {
  __shared__ unsigned int hist[256];
  __shared__ Key prefix_s;
  __shared__ int64_t remaining_s;
  if (threadIdx.x == 0) { prefix_s = 0; remaining_s = Se; }
  bool finite = true;
  for (int shift = int(sizeof(Key)) * 8 - 8; shift >= 0; shift -= 8) {
    hist[threadIdx.x] = 0;
    __syncthreads();
    const Key prefix = prefix_s;
    const Key high_mask = shift + 8 >= int(sizeof(Key)) * 8 ? Key(0) : ~Key(0) << (shift + 8);
    const bool first = shift + 8 == int(sizeof(Key)) * 8;
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const auto x = load(row, i);
      if (first) finite &= isfinite(x);
      const Key k = key_of(x);
      if ((k & high_mask) == prefix) atomicAdd(&hist[(k >> shift) & 0xFF], 1u);
    }
    if (first && __syncthreads_or(!finite)) return false;  // also the barrier after the pass
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t above = 0;
      for (int b = 255; b >= 0; --b) {
        if (above + hist[b] >= remaining_s) {
          prefix_s = prefix | (Key(b) << shift);
          remaining_s -= above;
          break;
        }
        above += hist[b];
      }
    }
    __syncthreads();
  }
  *thr = prefix_s;
  *n_ties = remaining_s;
  __syncthreads();
  return true;
}

// Step 2: gather the support into ids / vals (the row's outputs as scratch), in support order.
// False (block-uniform) on a non-finite logit, with nothing gathered.
template <typename Src, typename Key, typename Acc>
__device__ bool gather_support(const Src* row, int64_t V, int64_t Se, int32_t* ids, Acc* vals) {
  __shared__ unsigned int above_count, warp_ties[kThreads / 32];
  Key thr;
  int64_t n_ties;
  if (!radix_select<Src, Key>(row, V, Se, &thr, &n_ties)) return false;
  const int64_t n_above = Se - n_ties;
  if (threadIdx.x == 0) above_count = 0;
  __syncthreads();
  // Warp w owns the contiguous ids [w_lo, w_hi) and reads them 32 at a time (coalesced). Pass 1
  // places the entries above the threshold (any order: the rank sort below orders them) and
  // counts the warp's ties; the warps' counts in warp order give each warp its first tie slot,
  // and pass 2 places ties lowest id first until the support is full (usually one tie, so it
  // reads a few tiles). Two block barriers in all; the tile loop this replaces paid three per
  // 256 ids (1500 at V = 128256).
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int kWarps = kThreads / 32;
  const int64_t per_warp = (V + kWarps - 1) / kWarps;
  const int64_t w_lo = per_warp * warp < V ? per_warp * warp : V;
  const int64_t w_hi = w_lo + per_warp < V ? w_lo + per_warp : V;
  unsigned int warp_count = 0;
  for (int64_t i0 = w_lo; i0 < w_hi; i0 += 32) {  // warp-uniform trip count
    const int64_t i = i0 + lane;
    const bool in = i < w_hi;
    const Acc x = in ? Acc(load(row, i)) : Acc(0);
    const Key k = in ? key_of(x) : Key(0);
    if (in && k > thr) {
      const unsigned int at = atomicAdd(&above_count, 1u);
      ids[at] = static_cast<int32_t>(i);
      vals[at] = x;
    }
    warp_count += __popc(__ballot_sync(0xFFFFFFFFu, in && k == thr));
  }
  if (lane == 0) warp_ties[warp] = warp_count;
  __syncthreads();
  int64_t before = 0;
  for (int w = 0; w < warp; ++w) before += warp_ties[w];
  for (int64_t i0 = w_lo; i0 < w_hi && before < n_ties; i0 += 32) {  // before: warp-uniform
    const int64_t i = i0 + lane;
    const bool in = i < w_hi;
    const Acc x = in ? Acc(load(row, i)) : Acc(0);
    const bool tie = in && key_of(x) == thr;
    const unsigned int ballot = __ballot_sync(0xFFFFFFFFu, tie);
    const int64_t at = before + __popc(ballot & ((1u << lane) - 1u));
    if (tie && at < n_ties) {
      ids[n_above + at] = static_cast<int32_t>(i);
      vals[n_above + at] = x;
    }
    before += __popc(ballot);
  }
  __syncthreads();
  // Rank sort: rank = number of entries ahead in support order; then scatter in place.
  int32_t my_id[kMaxPerThread];
  Acc my_val[kMaxPerThread];
  int32_t my_rank[kMaxPerThread];
  int mine = 0;
  for (int64_t j = threadIdx.x; j < Se; j += kThreads, ++mine) {
    my_id[mine] = ids[j];
    my_val[mine] = vals[j];
    int32_t rank = 0;
    for (int64_t o = 0; o < Se; ++o)
      rank += vals[o] > my_val[mine] || (vals[o] == my_val[mine] && ids[o] < my_id[mine]);
    my_rank[mine] = rank;
  }
  __syncthreads();
  for (int t = 0; t < mine; ++t) {
    ids[my_rank[t]] = my_id[t];
    vals[my_rank[t]] = my_val[t];
  }
  __syncthreads();
  return true;
}

// Step 3: sum of exp(l - M) over l < lmin, plus the ties at lmin left outside the support.
template <typename Src, typename Acc>
__device__ double outside_mass(const Src* row, int64_t V, int64_t Se, Acc M, Acc lmin) {
  __shared__ double partial_d[kThreads / 32];
  __shared__ long long partial_i[kThreads / 32];
  double sum = 0.0;
  long long at_or_above = 0;
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    const Acc x = Acc(load(row, i));
    if (x < lmin) sum += double(exp(x - M));
    else ++at_or_above;
  }
  sum = block_sum(sum, partial_d);
  at_or_above = block_sum(at_or_above, partial_i);
  return sum + double(at_or_above - Se) * exp(double(lmin) - double(M));
}

// The coin of row r's sampled token; the key from memory when the args point at one (coin_key).
__device__ __forceinline__ double row_coin(const PoolSamplerArgs& a, int64_t r) {
  const CoinKey key = coin_key(a.key, a.seed, a.step);
  return pool_coin(key.seed, key.step, a.level, uint32_t(r));
}

struct RowPlan {  // warp 0's results, shared with the block for step 5
  int64_t y;      // support index of Y, or -1
  double W;       // tempered mass of the non-leads, relative to l_m
  double l_m;     // l_{x_{m+1}}
};

// Sum over j in [begin, Se) of f(j), lane-strided, then a warp sum.
template <typename F>
__device__ __forceinline__ double warp_sum_over(int64_t begin, int64_t Se, F f) {
  double x = 0.0;
  for (int64_t j = begin + (threadIdx.x & 31); j < Se; j += 32) x += f(j);
  return cuda::warp_sum(x);
}

// Step 4 (warp 0, all 32 lanes): the CPU's support math (cpu/pool_sampler.cpp) with the sums over
// the support as lane-strided warp sums in a fixed order and the inverse CDF as a warp scan, 32
// entries a round (the review: thread 0 alone evaluated ~640 double exps). The sums add in
// another order than the CPU's, so Y can differ from the CPU's only when the coin falls within
// rounding of a CDF boundary; lane 0 then writes the K slots (K small) and the plan.
template <typename Acc>
__device__ RowPlan plan_row(const PoolSamplerArgs& a, int64_t r, int64_t Se, const int32_t* ids,
                            const Acc* vals, double outside) {
  const int lane = threadIdx.x & 31;
  const int32_t m = a.m;
  const double M = double(vals[0]);
  const double support_mass = warp_sum_over(0, Se, [&](int64_t j) { return exp(double(vals[j]) - M); });
  const double log_total = log(outside + support_mass);
  RowPlan plan{-1, 0.0, double(vals[m < Se ? m : 0])};
  const double l_m = plan.l_m, T = a.T;
  const auto weight = [&](int64_t j) { return exp((double(vals[j]) - l_m) / T); };
  const int32_t forced_token = a.forced_sample ? a.forced_sample[r] : -1;
  if (a.kind == PoolKind::kRheo && a.T > 0.0) {
    plan.W = warp_sum_over(m, Se, weight);
    const double all = warp_sum_over(0, Se, [&](int64_t j) { return exp((double(vals[j]) - M) / T); });
    const double log_zT = (l_m - M) / T + log(plan.W) - log(all);
    const double tiny = sizeof(Acc) == 8 ? DBL_MIN : FLT_MIN;
    if (m == 0 || log_zT >= log(tiny)) {
      const double target =
          forced_token != -1 ? 0.0 : row_coin(a, r) * plan.W;
      double running = 0.0;  // the mass of the rounds before this one (warp-uniform)
      int64_t last_positive = m;
      for (int64_t base = m; base < Se && plan.y < 0; base += 32) {  // warp-uniform loop
        const int64_t j = base + lane;
        const double w = j < Se ? weight(j) : 0.0;
        if (forced_token != -1) {
          const unsigned hit = __ballot_sync(0xFFFFFFFFu, j < Se && ids[j] == forced_token && w > 0.0);
          if (hit) plan.y = base + 31 - __clz(static_cast<int>(hit));
          continue;
        }
        double incl = w;  // inclusive scan of the round's weights over the lanes
        for (int o = 1; o < 32; o <<= 1) {
          const double up = __shfl_up_sync(0xFFFFFFFFu, incl, o);
          if (lane >= o) incl += up;
        }
        const unsigned positive = __ballot_sync(0xFFFFFFFFu, w > 0.0);
        if (positive) last_positive = base + 31 - __clz(static_cast<int>(positive));
        const unsigned crossed = __ballot_sync(0xFFFFFFFFu, j < Se && running + incl > target);
        if (crossed) plan.y = base + __ffs(static_cast<int>(crossed)) - 1;
        running += __shfl_sync(0xFFFFFFFFu, incl, 31);
      }
      if (plan.y < 0 && forced_token == -1) plan.y = last_positive;
    }
  }
  // The proxy of Y for m >= 1 needs the non-lead mass (all lanes take part in the sum).
  const double nonlead =
      outside + warp_sum_over(m, Se, [&](int64_t k) { return exp(double(vals[k]) - M); });
  if (lane != 0) return plan;
  // Slots: leads, Y at slot m (Lemma 4 proxy, never q(Y)), then the best remaining entries.
  int32_t* tokens = a.tokens + r * a.K;
  Acc* log_proxy = static_cast<Acc*>(a.log_proxy) + r * a.K;
  int64_t j = 0;
  for (int32_t slot = 0; slot < a.K; ++slot) {
    if (plan.y >= 0 && slot == m) {
      const double proxy =
          m == 0 ? log(fmin(1.0, exp(double(vals[0]) - M - log_total) + kProxyEpsilon))
                 : fmin(double(vals[m - 1]) - M - log_total, log(nonlead) - log_total);
      tokens[slot] = ids[plan.y];
      log_proxy[slot] = Acc(fmax(proxy, double(vals[m]) - M - log_total));
      continue;
    }
    if (j == plan.y) ++j;
    tokens[slot] = ids[j];
    log_proxy[slot] = Acc(double(vals[j]) - M - log_total);
    ++j;
  }
  a.sampled_slot[r] = plan.y >= 0 ? m : -1;
  // A forced token that could not be Y (not in the support past the leads, q~ = 0, no sampled
  // slot in this row): the CPU raises; here the row keeps no sampled child and the host learns
  // it from the status word.
  if (forced_token != -1 && plan.y < 0) cuda::report_status(a.status, kStatusBadForced);
  return plan;
}

// A row with a NaN / inf logit: the CPU raises; here the row gets outputs that keep the step's
// later kernels in range (distinct ids 0.., log proxies -inf, no sampled child, q~ = 0) and the
// status bit tells the host (a review defect: NaN used to give repeated ids, inf NaN proxies).
template <typename Acc>
__device__ void poison_row(const PoolSamplerArgs& a, int64_t r, int64_t Se, int32_t* ids,
                           Acc* q_tilde) {
  for (int64_t j = threadIdx.x; j < Se; j += kThreads) ids[j] = static_cast<int32_t>(j), q_tilde[j] = Acc(0);
  Acc* log_proxy = static_cast<Acc*>(a.log_proxy) + r * a.K;
  for (int32_t k = threadIdx.x; k < a.K; k += kThreads) {
    a.tokens[r * a.K + k] = k;
    log_proxy[k] = Acc(-INFINITY);
  }
  if (threadIdx.x == 0) {
    a.sampled_slot[r] = -1;
    static_cast<Acc*>(a.q_sampled)[r] = Acc(0);
    cuda::report_status(a.status, kStatusNonFiniteDraft);
  }
}

template <typename Src, typename Acc, typename Key>
__global__ void __launch_bounds__(kThreads) pool_sampler_kernel(PoolSamplerArgs a) {
  __shared__ RowPlan plan;
  const int64_t r = blockIdx.x;
  const int64_t Se = a.S < a.V ? a.S : a.V;
  const Src* row = static_cast<const Src*>(a.logits) + r * a.row_stride;
  int32_t* ids = a.q_tilde_ids + r * Se;
  Acc* vals = static_cast<Acc*>(a.q_tilde) + r * Se;  // support logits until step 5
  if (!gather_support<Src, Key, Acc>(row, a.V, Se, ids, vals)) {
    poison_row<Acc>(a, r, Se, ids, vals);
    return;
  }
  const double outside = outside_mass<Src, Acc>(row, a.V, Se, vals[0], vals[Se - 1]);
  if (threadIdx.x < 32) {  // warp 0 (whole: kThreads >= 32)
    const RowPlan p = plan_row<Acc>(a, r, Se, ids, vals, outside);
    if (threadIdx.x == 0) plan = p;
  }
  __syncthreads();
  // Step 5: q~ = exp((l - l_m) / T) / W on support minus leads, 0 on the leads / without Y.
  double q_y = 0.0;
  for (int64_t j = threadIdx.x; j < Se; j += kThreads) {
    const bool in_tilde = plan.y >= 0 && j >= a.m;
    const double q = in_tilde ? exp((double(vals[j]) - plan.l_m) / a.T) / plan.W : 0.0;
    if (j == plan.y) q_y = q;
    vals[j] = Acc(q);
  }
  if (plan.y < 0 && threadIdx.x == 0) static_cast<Acc*>(a.q_sampled)[r] = Acc(0);
  if (plan.y >= 0 && plan.y % kThreads == threadIdx.x) static_cast<Acc*>(a.q_sampled)[r] = Acc(q_y);
}

// radix_select's histogram, gather_support's counts, outside_mass's partials and the RowPlan.
RHEO_STATIC_SHARED(1232, pool_sampler_kernel<float, float, uint32_t>);
RHEO_STATIC_SHARED(1232, pool_sampler_kernel<__half, float, uint32_t>);
RHEO_STATIC_SHARED(1232, pool_sampler_kernel<__nv_bfloat16, float, uint32_t>);
RHEO_STATIC_SHARED(1232, pool_sampler_kernel<double, double, uint64_t>);

template <typename Src, typename Acc, typename Key>
cudaError_t launch(const PoolSamplerArgs& a, cudaStream_t stream) {
  pool_sampler_kernel<Src, Acc, Key> RHEO_LAUNCH(static_cast<unsigned int>(a.n), kThreads, 0, stream)(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t pool_sampler_cuda(const PoolSamplerArgs& a, cudaStream_t stream) {
  if (a.n == 0) return cudaSuccess;
  if ((a.S < a.V ? a.S : a.V) > kMaxSupport) return cudaErrorInvalidValue;
  switch (a.dtype) {
    case DType::kFloat32: return launch<float, float, uint32_t>(a, stream);
    case DType::kFloat16: return launch<__half, float, uint32_t>(a, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16, float, uint32_t>(a, stream);
    case DType::kFloat64: return launch<double, double, uint64_t>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace rheo
