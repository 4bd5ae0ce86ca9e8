// White-box tests of verification.cu's device functions on the CPU emulator: this file includes
// the .cu itself, so its internal functions (anonymous namespace) can be launched one at a time.
// Each test is one of the defects a review of verification.cu found (numbered as there), and
// failed on the code before its fix:
//   top_p_boundaries      defect 4: sub-bins summed a few ulps short of their parent bin ended
//                         the radix search with no bin, and top-p kept all V tokens (the
//                         masses are integers now; the rows on a bin boundary stay);
//   no_resum_on_zero      defect 5: a rejected child of weight 0 re-summed Z (the CPU does not);
//   draw_without_mass     defect 5: the final draw returned -1 with no mass left (the CPU: 0);
//   caller_workspace      defect 6: verification_cuda allocated B x V doubles per call with
//                         cudaMallocAsync, outside torch's allocator.
#include "../../csrc/cuda/verification.cu"
#include "check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {


// Row processing of one fp64 row (row_stats), then p's weight at every token (0 = cut).
__global__ void top_p_kernel(rheo::VerificationArgs a, double* w) {
  __shared__ rheo::RowShared sh;
  rheo::row_stats<rheo::F64Row>(a, 0, sh);
  const double* x = static_cast<const double*>(a.logits);
  for (int64_t v = threadIdx.x; v < a.V; v += rheo::kThreads)
    w[v] = rheo::target_weight<rheo::F64Row>(sh.st, x, v, a.T, 1.0f, a.min_p);
}

// The walk kernel's order-preserving key of an fp64 value (verification.cu key64).
uint64_t key_of(double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  if ((u << 1) == 0) u = 0;
  return (u >> 63) ? ~u : (u | (1ull << 63));
}

// Rows of random p (with runs of equal values and zeros) given as fp64 logits log p (zeros as
// -1e4, below the underflow cut), and top_p set exactly on a cumulative mass of the sorted row at
// the end of a radix bin of a random level, where the sub-bins' sums decide. The kept set must be
// the first k tokens of (p desc, id asc) with k within one of the float64 rule's count (a rounding
// boundary). The radix masses are integers now, so sub-bins add up to their parent bin exactly;
// with sums in double they could fall a few ulps short, no bin was found and top-p kept all V.
void top_p_boundaries() {
  std::mt19937_64 rng(7);
  int cases = 0, off_by_one = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t V = 40 + static_cast<int64_t>(rng() % 200);
    std::vector<double> x(V), e(V);
    for (auto& v : x) {
      const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
      v = u < 0.3 ? std::log(0.125) : u < 0.35 ? -1e4 : std::log(u * u * u);  // ties, zeros, a spread
    }
    const double m = *std::max_element(x.begin(), x.end());
    double total = 0.0;
    for (int64_t v = 0; v < V; ++v) {
      e[v] = x[v] - m >= -700.0 ? std::exp(x[v] - m) : 0.0;  // the kernel's weight
      total += e[v];
    }
    std::vector<int32_t> order(V);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return e[a] > e[b]; });
    // The cut right after the last token of a radix bin of the logit keys (of a random level).
    const int level = static_cast<int>(rng() % 4), shift = 56 - 8 * level;
    int64_t j = 1 + static_cast<int64_t>(rng() % (V / 2));
    const auto bin = [&](int64_t i) { return key_of(x[order[i]]) >> shift; };
    while (j < V && e[order[j]] > 0.0 && bin(j) == bin(j - 1)) ++j;
    double top_p = 0.0;
    for (int64_t i = 0; i < j; ++i) top_p += e[order[i]] / total;
    if (!(top_p < 1.0)) continue;
    // The rule in float64 (csrc/include/rheo/verification.h): keep while the mass before < top_p.
    int64_t want = 0;
    double before = 0.0;
    while (want < V && e[order[want]] > 0.0 && before < top_p) before += e[order[want++]] / total;
    rheo::VerificationArgs a;
    a.logits = x.data();
    a.dtype = rheo::DType::kFloat64;
    a.B = 1, a.N = 1, a.V = V;
    a.T = 1.0;
    a.top_p = top_p;
    std::vector<double> w(V, -1.0);
    top_p_kernel RHEO_LAUNCH(1, rheo::kThreads, 0, nullptr)(a, w.data());
    CHECK(cudaGetLastError() == cudaSuccess);
    int64_t kept = 0;
    while (kept < V && w[order[kept]] > 0.0) ++kept;
    for (int64_t i = kept; i < V; ++i) CHECK(w[order[i]] == 0.0);  // a prefix of the order
    ++cases;
    if (kept != want) ++off_by_one;
    if (kept < want - 1 || kept > want + 1) {
      std::printf("FAIL top_p_boundaries trial %d: V=%ld kept %ld tokens, the rule keeps %ld\n",
                  trial, long(V), long(kept), long(want));
      ++failures;
    }
  }
  std::printf("top_p_boundaries: %d rows on a boundary, %d kept one token more or less\n", cases,
              off_by_one);
}

constexpr int kHashBits = 5;

// The walk's entry into the root of tree 0 (fp64), its stats computed in the walk: the prologue
// of the kernels below.
__device__ rheo::Residual enter_root(const rheo::VerificationArgs& a, double* dyn,
                                     rheo::WalkShared& sh) {
  const rheo::Residual r = rheo::carve_residual(dyn, a, kHashBits);
  if (threadIdx.x == 0) sh.dirty = 1;
  __syncthreads();
  rheo::begin_node<rheo::F64Row>(a, 0, 0, nullptr, r, sh);
  return r;
}

// One fp64 tree (logits [1, N, V]) entered at the root with its stats computed in the walk.
__global__ void plain_rejection_kernel(rheo::VerificationArgs a, double z_scale, double* out) {
  RHEO_DYNAMIC_SHARED(double, dyn);
  __shared__ rheo::WalkShared sh;
  const rheo::Residual r = enter_root(a, dyn, sh);
  if (threadIdx.x == 0) sh.Z = z_scale * sh.st.z;
  __syncthreads();
  const int32_t child = rheo::run_layer<rheo::F64Row>(a, 0, 0, r, sh);
  if (threadIdx.x == 0) out[0] = child, out[1] = sh.Z, out[2] = z_scale * sh.st.z;
}

// A root whose only child has weight 0 while the tracked Z sits below the re-sum threshold: the
// rejection changes nothing, so Z must stay as it is (the CPU re-sums only when r changed).
void no_resum_on_zero() {
  const int64_t V = 8;
  const std::vector<double> logits = {-1e4, std::log(0.2), std::log(0.3), std::log(0.5),
                                      -1e4, -1e4, -1e4, -1e4, /* node 1 */ 0, 0, 0, 0, 0, 0, 0, 0};
  const std::vector<int32_t> tokens = {0, 0}, parents = {-1, 0}, sampled = {-1, -1};
  rheo::VerificationArgs a;
  a.logits = logits.data();
  a.dtype = rheo::DType::kFloat64;
  a.B = 1, a.N = 2, a.V = V;
  a.tokens = tokens.data();
  a.parents = parents.data();
  a.sampled_row = sampled.data();
  a.method = rheo::VerifyMethod::kTopK;
  std::vector<double> out(3, -7.0);
  plain_rejection_kernel RHEO_LAUNCH(1, rheo::kThreads, rheo::walk_smem_bytes(2, 0, kHashBits),
                                     nullptr)(a, 5e-7, out.data());
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(out[0] == -1.0);    // the weight-0 child is rejected
  CHECK(out[1] == out[2]);  // and Z is left alone
}

// The final draw at the root of a one-node fp64 tree, after zeroing `zero_token` (-1: none).
__global__ void draw_kernel(rheo::VerificationArgs a, int32_t zero_token, int32_t* out) {
  RHEO_DYNAMIC_SHARED(double, dyn);
  __shared__ rheo::WalkShared sh;
  const rheo::Residual r = enter_root(a, dyn, sh);
  if (zero_token >= 0 && threadIdx.x == 0) {
    rheo::hash_insert(r, zero_token, rheo::kZeroed);
    sh.dirty = 1;
  }
  __syncthreads();
  const int32_t token = rheo::draw_from<rheo::F64Row>(a, 0, 0, 0.5, r, sh);
  if (threadIdx.x == 0) *out = token;
}

// All of p's mass on token 123; with it removed the residual has no mass and the draw must give
// token 0 as the CPU does (it used to give -1).
void draw_without_mass() {
  const int64_t V = 300;
  std::vector<double> logits(V, -1e4);
  logits[123] = 0.0;
  const std::vector<int32_t> tokens = {0}, parents = {-1}, sampled = {-1};
  rheo::VerificationArgs a;
  a.logits = logits.data();
  a.dtype = rheo::DType::kFloat64;
  a.B = 1, a.N = 1, a.V = V;
  a.tokens = tokens.data();
  a.parents = parents.data();
  a.sampled_row = sampled.data();
  int32_t token = -7;
  const size_t smem = rheo::walk_smem_bytes(1, 0, kHashBits);
  draw_kernel RHEO_LAUNCH(1, rheo::kThreads, smem, nullptr)(a, 123, &token);
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(token == 0);
  draw_kernel RHEO_LAUNCH(1, rheo::kThreads, smem, nullptr)(a, -1, &token);
  CHECK(token == 123);
}

// verification_cuda takes its workspace from the caller and allocates nothing.
void caller_workspace() {
  const int64_t B = 2, N = 3, V = 50;
  std::vector<float> logits(B * N * V);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(i % 7) * 0.5f;
  const std::vector<int32_t> tokens = {0, 6, 13, 0, 6, 20}, parents = {-1, 0, 0, -1, 0, 1};
  const std::vector<int32_t> sampled(B * N, -1);
  std::vector<int32_t> path(B * 3, -7), len(B, -7), bonus(B, -7), status(1, 0);
  std::vector<double> workspace(B * V);
  rheo::VerificationArgs a;
  a.logits = logits.data();
  a.B = B, a.N = N, a.V = V;
  a.tokens = tokens.data();
  a.parents = parents.data();
  a.sampled_row = sampled.data();
  a.method = rheo::VerifyMethod::kTopK;
  a.accept_path = path.data();
  a.path_capacity = 3;
  a.accept_len = len.data();
  a.bonus_token = bonus.data();
  a.status = status.data();
  CHECK(rheo::verification_cuda(a, nullptr) == cudaErrorInvalidValue);  // no workspace
  a.workspace = workspace.data();
  const uint64_t before = rheo_emu::counters().allocations;
  CHECK(rheo::verification_cuda(a, nullptr) == cudaSuccess);
  CHECK(rheo_emu::counters().allocations == before);
  CHECK(status[0] == 0);
  for (int64_t b = 0; b < B; ++b) CHECK(len[b] >= 1 && bonus[b] >= 0 && bonus[b] < V);
  // A support too large for the walk's shared memory is a clear error on the host, not a launch
  // failure (the q~ table is never read: the check is on sizes).
  a.R = 1, a.Se = 20000;
  bool raised = false;
  try {
    rheo::verification_cuda(a, nullptr);
  } catch (const rheo::ValueError& e) {
    raised = std::string(e.what()).find("Se=20000") != std::string::npos;
  }
  CHECK(raised);
}

}  // namespace

int main(int argc, char** argv) {
  rheo_emu::set_schedule_seed(argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1);
  top_p_boundaries();
  no_resum_on_zero();
  draw_without_mass();
  caller_workspace();
  std::printf("internals: %s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
