// Logit controls on CUDA (contract in csrc/include/rheo/logit_controls.h), mirroring
// csrc/cpu/logit_controls.cpp.
//
// Work mapping: one block per node row (grid B * N), kThreads threads. Thread 0 walks the node's
// path to the root into shared memory (depth < N, a few dozen steps); then the threads stride over
// the history entries (each entry's count adds its occurrences on the path), then over the path
// tokens new to the history (binary search in the ascending history ids), and after a barrier ban
// the suppressed tokens. Every token of the row is written by at most one thread per phase (history
// ids are distinct, a new path token is written at its first occurrence only, and the ban comes
// after the barrier), so there are no races and no atomics. The row is touched only at those
// tokens: O(H + depth^2) per row instead of O(V).
//
// Errors: a row whose tree path or history breaks the rules sets kStatusBadControls and is left
// unchanged; the host raises logit_controls_cpu's message for it.

#include <cstdint>

#include "device_utils.cuh"
#include "rheo/common.h"
#include "rheo/logit_controls.h"

namespace rheo {
namespace {

constexpr int kThreads = 128;

struct PathShared {
  int32_t depth;  // -1: the tree is bad
  int32_t bad;    // a history rule is broken
};

__device__ int32_t count_on_path(const int32_t* path, int32_t end, int32_t v) {
  int32_t n = 0;
  for (int32_t j = 0; j < end; ++j) n += path[j] == v;
  return n;
}

__device__ bool in_history(const int32_t* ids, int32_t n, int32_t v) {
  int32_t lo = 0, hi = n;
  while (lo < hi) {
    const int32_t mid = (lo + hi) / 2;
    if (ids[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < n && ids[lo] == v;
}

// grid = B * N, block = kThreads, dynamic shared = N int32 (the path tokens).
template <typename T>
__global__ void __launch_bounds__(kThreads) logit_controls_kernel(LogitControlsArgs a) {
  RHEO_DYNAMIC_SHARED(int32_t, path);
  __shared__ PathShared sh;
  const int64_t b = blockIdx.x / a.N, i = blockIdx.x % a.N;
  const int32_t* tokens = a.tokens + b * a.N;
  const int32_t* parents = a.parents + b * a.N;
  const int32_t* ids = a.history_ids + b * a.H;
  const int32_t* counts = a.history_counts + b * a.H;
  const int32_t n = a.history_len[b];
  if (threadIdx.x == 0) {  // the path, deepest first, checking the tree rules on the way
    int32_t depth = 0;
    bool bad = parents[0] != -1;
    for (int64_t j = i; j > 0 && !bad; j = parents[j]) {
      bad = parents[j] < 0 || parents[j] >= j || tokens[j] < 0 || tokens[j] >= a.V;
      if (!bad) path[depth++] = tokens[j];
    }
    sh.depth = bad ? -1 : depth;
    sh.bad = bad || n < 0 || n > a.H || a.suppress_below[b] < 0;
  }
  __syncthreads();
  const int32_t depth = sh.depth;
  for (int32_t h = threadIdx.x; !sh.bad && h < n; h += kThreads) {
    const bool ok = ids[h] >= 0 && ids[h] < a.V && (h == 0 || ids[h - 1] < ids[h]) && counts[h] >= 0;
    if (!ok) sh.bad = 1;  // benign race: every writer stores 1
  }
  for (int64_t e = threadIdx.x; !sh.bad && e < a.E; e += kThreads)
    if (a.suppress_ids[e] < 0 || a.suppress_ids[e] >= a.V) sh.bad = 1;
  __syncthreads();
  if (sh.bad) {
    if (threadIdx.x == 0) cuda::report_status(a.status, kStatusBadControls);
    return;
  }
  T* row = static_cast<T*>(a.logits) + blockIdx.x * a.V;
  const T r = static_cast<T>(a.repetition_penalty), pres = static_cast<T>(a.presence_penalty),
          freq = static_cast<T>(a.frequency_penalty);
  for (int32_t h = threadIdx.x; h < n; h += kThreads)
    row[ids[h]] = penalised_logit(row[ids[h]], counts[h] + count_on_path(path, depth, ids[h]), r,
                                  pres, freq);
  for (int32_t j = threadIdx.x; j < depth; j += kThreads) {
    const int32_t v = path[j];
    if (count_on_path(path, j, v) > 0 || in_history(ids, n, v)) continue;
    row[v] = penalised_logit(row[v], count_on_path(path, depth, v), r, pres, freq);
  }
  __syncthreads();
  if (depth < a.suppress_below[b])
    for (int64_t e = threadIdx.x; e < a.E; e += kThreads) row[a.suppress_ids[e]] = banned_logit<T>();
}

// 16 bytes: PathShared, padded by nvcc.
RHEO_STATIC_SHARED(16, logit_controls_kernel<float>);
RHEO_STATIC_SHARED(16, logit_controls_kernel<double>);

}  // namespace

cudaError_t logit_controls_cuda(const LogitControlsArgs& args, cudaStream_t stream) {
  logit_controls_check_scalars(args);
  const unsigned grid = static_cast<unsigned>(args.B * args.N);
  const size_t smem = static_cast<size_t>(args.N) * sizeof(int32_t);
  const bool f64 = args.dtype == DType::kFloat64;
  cuda::SharedFit fit;
  const cudaError_t err = f64 ? cuda::fit_shared(logit_controls_kernel<double>, smem, &fit)
                              : cuda::fit_shared(logit_controls_kernel<float>, smem, &fit);
  if (err != cudaSuccess) return err;
  RHEO_CHECK(fit.fits(), "logit controls on CUDA hold a node's path in shared memory: N=",
             args.N, " nodes need ", fit.needed(), " bytes a block (", fit.static_bytes,
             " static + ", smem, " dynamic), over the ", fit.limit, " of GPU ", fit.device,
             " (cudaDevAttrMaxSharedMemoryPerBlockOptin); use fewer tree nodes (docs/kernels.md "
             "§7) or apply the controls on the CPU");
  if (f64)
    logit_controls_kernel<double> RHEO_LAUNCH(grid, kThreads, smem, stream)(args);
  else
    logit_controls_kernel<float> RHEO_LAUNCH(grid, kThreads, smem, stream)(args);
  return cudaGetLastError();
}

}  // namespace rheo
