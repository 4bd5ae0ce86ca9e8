// What the CPU pool sampler files share (CPU-private, not part of the kernel contract in
// csrc/include/rheo/pool_sampler.h):
//   pool_sampler.cpp          per row, on the Se support entries: log q, the leads, z, q~, Y, the
//                             fills; the entry point;
//   pool_sampler_support.cpp  passes 1 and 2 over V: the support and the mass outside it.
#pragma once

#include <cstdint>
#include <vector>

#include "rheo/pool_sampler.h"

namespace rheo {
namespace pool_sampler_detail {

template <typename Real>
struct Entry {
  Real logit;
  int32_t id;
};

struct RowError {
  int code = 0;  // 0 ok, 1 non-finite logit, 2 bad forced sample
  int64_t token = 0;
  double value = 0.0;
  const char* why = "";
};

// Passes 1 and 2 of one row: the Se best entries sorted in support order (descending logit, ties
// lower token id first) into `support`, and the outside mass, sum exp(l - M) over every token
// outside the support (M = the row max). False (and `err` filled) on a non-finite logit. Summing
// the outside directly (rather than total minus support) keeps its relative error at float
// rounding even when the support holds almost all of the mass. `chunk_max` and `cand` are
// scratch. Real = double for fp64 rows, float for fp32 / bf16 / fp16 rows.
template <typename Real>
bool scan_support(const void* row, DType dtype, int64_t V, int64_t Se,
                  std::vector<Entry<Real>>& support, std::vector<int32_t>& chunk_max,
                  std::vector<Entry<float>>& cand, double* outside, RowError& err);

}  // namespace pool_sampler_detail
}  // namespace rheo
