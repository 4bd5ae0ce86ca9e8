// Every CUDA kernel (csrc/cuda/*.cu, run on the CPU emulator csrc/emu) against its CPU twin
// (csrc/cpu) on the same inputs and Philox coins, and against itself under a second schedule.
//
//   kernel_tests [--quick] [--only NAME] [--seeds A,B] | --static-shared
//
// For each case: the CPU kernel gives the expected outputs; the CUDA kernel runs under schedule
// seed A and again under seed B (other thread interleavings, block order, shared-memory poison)
// and the two runs must agree bit for bit; the CUDA outputs must equal the CPU's exactly for
// integers (ids, tokens, slots, paths) and within a stated tolerance for floats (the CUDA sums
// add in another order). Bad input: the CPU raises, the CUDA kernel sets its status bit (common.h
// StatusBit) and writes in-range outputs. Sizes: V = 111, 32000, 128256; N = 1
// and 60; S > V; B up to 8; fp32/bf16/fp16 (fp64 where the kernel takes it); tie-heavy logits
// (integer valued, with +0.0 and -0.0), T = 0, top-p, top-k, forced samples.
// --quick keeps the small cases (for the AddressSanitizer + UBSan build).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "rheo/fused_ops.h"
#include "rheo/logit_controls.h"
#include "rheo/pool_sampler.h"
#include "rheo/proxy_rerank.h"
#include "rheo/quant_linear.h"
#include "rheo/skinny_linear.h"
#include "rheo/tree_attention.h"
#include "rheo/verification.h"

namespace {

using rheo::DType;

bool quick = false;
uint64_t seed_a = 1, seed_b = 2;
int failures = 0, cases = 0;
std::string current_case;

void fail(const std::string& what) {
  if (failures < 40) std::printf("FAIL [%s] %s\n", current_case.c_str(), what.c_str());
  ++failures;
}

// --- inputs ----------------------------------------------------------------------------------

struct Rng {
  std::mt19937_64 g;
  explicit Rng(uint64_t s) : g(s) {}
  double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(g); }
  int64_t below(int64_t n) { return static_cast<int64_t>(g() % static_cast<uint64_t>(n)); }
  float normal(float sd) { return std::normal_distribution<float>(0.0f, sd)(g); }
};

enum class Logits { kNormal, kTies, kPeaked };

// Logit values (float) of a kind: kTies = integers in [-3, 3] with zeros of both signs.
std::vector<float> make_logits(Rng& rng, int64_t count, Logits kind) {
  std::vector<float> x(count);
  for (auto& v : x) {
    switch (kind) {
      case Logits::kNormal: v = rng.normal(3.0f); break;
      case Logits::kTies: {
        const int64_t k = rng.below(8) - 4;  // -4 .. 3; -4 stands for -0.0
        v = k == -4 ? -0.0f : static_cast<float>(k);
        break;
      }
      case Logits::kPeaked: v = rng.uniform() < 0.01 ? 12.0f + rng.normal(1.0f) : rng.normal(1.0f);
    }
  }
  return x;
}

size_t elem_size(DType d) { return d == DType::kFloat64 ? 8 : d == DType::kFloat32 ? 4 : 2; }
const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "fp32";
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat64: return "fp64";
  }
  return "?";
}

// A buffer of `dtype` elements holding `x` (rounded to nearest even for 16-bit types).
std::vector<unsigned char> encode(const std::vector<float>& x, DType dtype) {
  std::vector<unsigned char> out(x.size() * elem_size(dtype));
  for (size_t i = 0; i < x.size(); ++i) {
    unsigned char* p = out.data() + i * elem_size(dtype);
    switch (dtype) {
      case DType::kFloat32: std::memcpy(p, &x[i], 4); break;
      case DType::kFloat64: { const double d = x[i]; std::memcpy(p, &d, 8); break; }
      case DType::kFloat16: { const __half h = __float2half_rn(x[i]); std::memcpy(p, &h, 2); break; }
      case DType::kBFloat16: { const __nv_bfloat16 h = __float2bfloat16_rn(x[i]); std::memcpy(p, &h, 2); break; }
    }
  }
  return out;
}

double decode(const unsigned char* p, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: { float f; std::memcpy(&f, p, 4); return f; }
    case DType::kFloat64: { double d; std::memcpy(&d, p, 8); return d; }
    case DType::kFloat16: { __half h; std::memcpy(&h, p, 2); return __half2float(h); }
    case DType::kBFloat16: { __nv_bfloat16 h; std::memcpy(&h, p, 2); return __bfloat162float(h); }
  }
  return 0.0;
}

// --- comparisons -----------------------------------------------------------------------------

template <typename T>
void expect_equal(const std::vector<T>& cuda, const std::vector<T>& cpu, const char* what) {
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (cuda[i] != cpu[i]) {
      fail(std::string(what) + "[" + std::to_string(i) + "]: cuda " + std::to_string(cuda[i]) +
           " cpu " + std::to_string(cpu[i]));
      return;
    }
  }
}

// Floats: equal infinities, or |cuda - cpu| <= tol * max(1, |cpu|).
void expect_close(const std::vector<unsigned char>& cuda, const std::vector<unsigned char>& cpu,
                  DType dtype, double tol, const char* what) {
  const size_t es = elem_size(dtype);
  for (size_t i = 0; i * es < cpu.size(); ++i) {
    const double a = decode(cuda.data() + i * es, dtype), b = decode(cpu.data() + i * es, dtype);
    if (a == b || (std::isnan(a) && std::isnan(b))) continue;
    if (std::fabs(a - b) <= tol * std::max(1.0, std::fabs(b))) continue;
    char msg[200];
    std::snprintf(msg, sizeof msg, "%s[%zu]: cuda %.17g cpu %.17g (tol %.1e)", what, i, a, b, tol);
    fail(msg);
    return;
  }
}

// Runs the CUDA kernel under both schedules; `run` fills its outputs from a fresh state.
// Returns the first run's outputs (the caller compares them with the CPU's).
template <typename Outputs>
Outputs run_twice(const std::function<cudaError_t(Outputs&)>& run, Outputs fresh) {
  Outputs first = fresh, second = fresh;
  rheo_emu::set_schedule_seed(seed_a);
  cudaError_t err = run(first);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) fail(std::string("launch failed: ") + cudaGetErrorString(err) + ": " +
                               rheo_emu::last_error_message());
  rheo_emu::set_schedule_seed(seed_b);
  err = run(second);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) fail(std::string("second schedule failed: ") + rheo_emu::last_error_message());
  if (!(first == second)) fail("the two schedules disagree (a race or an uninitialised read)");
  return first;
}

bool cpu_raises(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const rheo::ValueError&) {
    return true;
  }
  return false;
}

// --- pool sampler ------------------------------------------------------------------------------

struct PoolCase {
  int64_t n, V;
  int32_t K, m, S;
  double T;
  rheo::PoolKind kind;
  DType dtype;
  Logits logits;
  bool forced;
};

struct PoolOut {
  std::vector<int32_t> tokens, slot, ids;
  std::vector<unsigned char> log_proxy, q, q_y;
  std::vector<int32_t> status;
  bool operator==(const PoolOut& o) const {
    return tokens == o.tokens && slot == o.slot && ids == o.ids && log_proxy == o.log_proxy &&
           q == o.q && q_y == o.q_y && status == o.status;
  }
};

PoolOut pool_outputs(const PoolCase& c) {
  const int64_t Se = std::min<int64_t>(c.S, c.V);
  const DType acc = c.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  PoolOut o;
  o.tokens.assign(c.n * c.K, -7);
  o.slot.assign(c.n, -7);
  o.ids.assign(c.n * Se, -7);
  o.log_proxy.assign(c.n * c.K * elem_size(acc), 0xAB);
  o.q.assign(c.n * Se * elem_size(acc), 0xAB);
  o.q_y.assign(c.n * elem_size(acc), 0xAB);
  o.status.assign(1, 0);
  return o;
}

rheo::PoolSamplerArgs pool_args(const PoolCase& c, const void* logits, const int32_t* forced,
                                PoolOut& o, uint64_t seed) {
  rheo::PoolSamplerArgs a;
  a.logits = logits;
  a.dtype = c.dtype;
  a.n = c.n;
  a.V = c.V;
  a.row_stride = c.V;
  a.K = c.K;
  a.m = c.m;
  a.S = c.S;
  a.T = c.T;
  a.kind = c.kind;
  a.seed = seed;
  a.step = 3;
  a.level = 2;
  a.forced_sample = forced;
  a.tokens = o.tokens.data();
  a.log_proxy = o.log_proxy.data();
  a.sampled_slot = o.slot.data();
  a.q_tilde_ids = o.ids.data();
  a.q_tilde = o.q.data();
  a.q_sampled = o.q_y.data();
  a.status = o.status.data();
  return a;
}

void pool_case(const PoolCase& c, uint64_t seed) {
  ++cases;
  current_case = "pool_sampler n=" + std::to_string(c.n) + " V=" + std::to_string(c.V) +
                 " K=" + std::to_string(c.K) + " m=" + std::to_string(c.m) + " S=" +
                 std::to_string(c.S) + " T=" + std::to_string(c.T) + " " +
                 (c.kind == rheo::PoolKind::kRheo ? "rheo" : "topk") + " " + dtype_name(c.dtype) +
                 (c.logits == Logits::kTies ? " ties" : "") + (c.forced ? " forced" : "");
  Rng rng(seed);
  const auto logits = encode(make_logits(rng, c.n * c.V, c.logits), c.dtype);
  std::vector<int32_t> forced;
  PoolOut cpu = pool_outputs(c);
  if (c.forced) {  // pin Y to a random support entry past the leads with q~ > 0 (or leave -1)
    PoolOut free = pool_outputs(c);
    rheo::pool_sampler_cpu(pool_args(c, logits.data(), nullptr, free, seed));
    const int64_t Se = std::min<int64_t>(c.S, c.V);
    const DType acc = c.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
    forced.assign(c.n, -1);
    for (int64_t r = 0; r < c.n; ++r) {
      if (free.slot[r] < 0) continue;
      for (int tries = 0; tries < 20; ++tries) {
        const int64_t s = c.m + rng.below(Se - c.m);
        if (decode(free.q.data() + (r * Se + s) * elem_size(acc), acc) > 0.0) {
          forced[r] = free.ids[r * Se + s];
          break;
        }
      }
    }
  }
  const int32_t* f = c.forced ? forced.data() : nullptr;
  rheo::pool_sampler_cpu(pool_args(c, logits.data(), f, cpu, seed));
  const PoolOut cuda = run_twice<PoolOut>(
      [&](PoolOut& o) { return rheo::pool_sampler_cuda(pool_args(c, logits.data(), f, o, seed), nullptr); },
      pool_outputs(c));
  const DType acc = c.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  const double tol = acc == DType::kFloat64 ? 1e-12 : 2e-5;
  expect_equal(cuda.ids, cpu.ids, "q_tilde_ids");
  expect_equal(cuda.slot, cpu.slot, "sampled_slot");
  expect_equal(cuda.tokens, cpu.tokens, "tokens");
  expect_close(cuda.log_proxy, cpu.log_proxy, acc, tol, "log_proxy");
  expect_close(cuda.q, cpu.q, acc, tol, "q_tilde");
  expect_close(cuda.q_y, cpu.q_y, acc, tol, "q_sampled");
  expect_equal(cuda.status, std::vector<int32_t>{0}, "status");
}

// A review defect: -0.0 and +0.0 straddle the support boundary; the CPU takes the lower id.
void pool_signed_zero() {
  ++cases;
  current_case = "pool_sampler -0.0 / +0.0 at the support boundary";
  const int64_t V = 12;
  std::vector<float> x(V, -5.0f);
  x[3] = 4.0f, x[9] = 3.0f, x[11] = 2.0f, x[5] = -0.0f, x[7] = 0.0f;
  const PoolCase c{1, V, 4, 1, 4, 1.0, rheo::PoolKind::kTopK, DType::kFloat32, Logits::kNormal, false};
  const auto logits = encode(x, c.dtype);
  PoolOut cpu = pool_outputs(c);
  rheo::pool_sampler_cpu(pool_args(c, logits.data(), nullptr, cpu, 1));
  const PoolOut cuda = run_twice<PoolOut>(
      [&](PoolOut& o) { return rheo::pool_sampler_cuda(pool_args(c, logits.data(), nullptr, o, 1), nullptr); },
      pool_outputs(c));
  expect_equal(cpu.ids, std::vector<int32_t>{3, 9, 11, 5}, "cpu support");
  expect_equal(cuda.ids, cpu.ids, "q_tilde_ids");
  expect_equal(cuda.tokens, cpu.tokens, "tokens");
}

// Defect 2: NaN / inf draft logits. The CPU raises; CUDA sets kStatusNonFiniteDraft, gives the
// row no sampled child and keeps every output in range and free of NaN.
void pool_non_finite() {
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity()}) {
    ++cases;
    current_case = std::string("pool_sampler non-finite draft logit ") + std::to_string(bad);
    const PoolCase c{3, 300, 6, 1, 32, 1.0, rheo::PoolKind::kRheo, DType::kFloat32, Logits::kNormal, false};
    Rng rng(5);
    auto x = make_logits(rng, c.n * c.V, Logits::kNormal);
    x[1 * c.V + 17] = bad;
    const auto logits = encode(x, c.dtype);
    PoolOut cpu = pool_outputs(c);
    if (!cpu_raises([&] { rheo::pool_sampler_cpu(pool_args(c, logits.data(), nullptr, cpu, 1)); }))
      fail("the CPU kernel accepted a non-finite logit");
    const PoolOut cuda = run_twice<PoolOut>(
        [&](PoolOut& o) { return rheo::pool_sampler_cuda(pool_args(c, logits.data(), nullptr, o, 1), nullptr); },
        pool_outputs(c));
    if (!(cuda.status[0] & rheo::kStatusNonFiniteDraft)) fail("status bit kStatusNonFiniteDraft not set");
    const int64_t Se = 32;
    for (int64_t r = 0; r < c.n; ++r) {
      std::set<int32_t> seen;
      for (int64_t s = 0; s < Se; ++s) {
        const int32_t id = cuda.ids[r * Se + s];
        if (id < 0 || id >= c.V || !seen.insert(id).second) fail("row " + std::to_string(r) + ": support id out of range or repeated");
      }
      for (int32_t k = 0; k < c.K; ++k) {
        const int32_t t = cuda.tokens[r * c.K + k];
        if (t < 0 || t >= c.V) fail("token out of range");
        if (std::isnan(decode(cuda.log_proxy.data() + (r * c.K + k) * 4, DType::kFloat32))) fail("NaN log_proxy");
      }
    }
    if (cuda.slot[1] != -1) fail("the bad row kept a sampled child");
  }
}

// A forced token that cannot be Y: CPU raises, CUDA sets kStatusBadForced.
void pool_bad_forced() {
  ++cases;
  current_case = "pool_sampler forced token outside the support";
  const PoolCase c{2, 200, 4, 1, 16, 1.0, rheo::PoolKind::kRheo, DType::kFloat32, Logits::kNormal, true};
  Rng rng(9);
  const auto logits = encode(make_logits(rng, c.n * c.V, Logits::kNormal), c.dtype);
  PoolOut probe = pool_outputs(c);
  rheo::pool_sampler_cpu(pool_args(c, logits.data(), nullptr, probe, 1));
  std::vector<int32_t> forced = {-1, probe.ids[1 * 16 + 0]};  // row 1: its lead, never Y
  PoolOut cpu = pool_outputs(c);
  if (!cpu_raises([&] { rheo::pool_sampler_cpu(pool_args(c, logits.data(), forced.data(), cpu, 1)); }))
    fail("the CPU kernel accepted a lead as forced Y");
  const PoolOut cuda = run_twice<PoolOut>(
      [&](PoolOut& o) { return rheo::pool_sampler_cuda(pool_args(c, logits.data(), forced.data(), o, 1), nullptr); },
      pool_outputs(c));
  if (!(cuda.status[0] & rheo::kStatusBadForced)) fail("status bit kStatusBadForced not set");
  if (cuda.slot[1] != -1) fail("the bad row kept a sampled child");
}

void pool_sampler_tests() {
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64};
  uint64_t seed = 100;
  for (const int64_t V : {int64_t(111), int64_t(32000), int64_t(128256)}) {
    if (quick && V > 111) continue;
    for (const DType d : dtypes) {
      if (V == 128256 && d != DType::kFloat32 && d != DType::kBFloat16) continue;
      for (const Logits lk : {Logits::kNormal, Logits::kTies, Logits::kPeaked}) {
        const int64_t n = V > 32000 ? 2 : (lk == Logits::kNormal ? 10 : 4);
        pool_case({n, V, 10, 1, 128, 1.0, rheo::PoolKind::kRheo, d, lk, false}, ++seed);
        if (V > 32000) continue;
        pool_case({n, V, 10, 0, 128, 0.7, rheo::PoolKind::kRheo, d, lk, false}, ++seed);
        pool_case({n, V, 8, 3, 64, 1.3, rheo::PoolKind::kRheo, d, lk, true}, ++seed);
        pool_case({n, V, 10, 1, 128, 0.0, rheo::PoolKind::kTopK, d, lk, false}, ++seed);
      }
    }
  }
  // S > V, K = V, a single row, one lead with K = 2.
  for (const DType d : dtypes) {
    pool_case({3, 40, 10, 2, 128, 1.0, rheo::PoolKind::kRheo, d, Logits::kTies, false}, ++seed);
    pool_case({1, 16, 16, 15, 300, 0.5, rheo::PoolKind::kRheo, d, Logits::kNormal, false}, ++seed);
    pool_case({1, 111, 2, 1, 2, 1.0, rheo::PoolKind::kRheo, d, Logits::kPeaked, false}, ++seed);
  }
  pool_signed_zero();
  pool_non_finite();
  pool_bad_forced();
}

// --- select_expand and build_tree ---------------------------------------------------------------

struct ExpandOut {
  std::vector<int32_t> expand, status;
  bool operator==(const ExpandOut& o) const { return expand == o.expand && status == o.status; }
};

// Path scores with many exact ties (quantised) and some -inf.
std::vector<float> make_scores(Rng& rng, int64_t count, bool ties) {
  std::vector<float> s(count);
  for (auto& v : s) {
    v = ties ? -static_cast<float>(rng.below(6)) * 0.5f : -std::fabs(rng.normal(4.0f));
    if (rng.uniform() < 0.03) v = -std::numeric_limits<float>::infinity();
  }
  return s;
}

void select_expand_case(int64_t B, int64_t M, int32_t topk, bool ties, bool nan, uint64_t seed) {
  ++cases;
  current_case = "select_expand B=" + std::to_string(B) + " M=" + std::to_string(M) +
                 " topk=" + std::to_string(topk) + (ties ? " ties" : "") + (nan ? " NaN" : "");
  Rng rng(seed);
  auto scores = make_scores(rng, B * M, ties);
  if (nan) scores[(B - 1) * M + M / 2] = std::numeric_limits<float>::quiet_NaN();
  auto args = [&](ExpandOut& o) {
    rheo::SelectExpandArgs a;
    a.scores = scores.data();
    a.B = B;
    a.M = M;
    a.topk = topk;
    a.expand = o.expand.data();
    a.status = o.status.data();
    return a;
  };
  const ExpandOut fresh{std::vector<int32_t>(B * topk, -7), {0}};
  ExpandOut cpu = fresh;
  const bool raised = cpu_raises([&] { rheo::select_expand_cpu(args(cpu)); });
  const ExpandOut cuda = run_twice<ExpandOut>(
      [&](ExpandOut& o) { return rheo::select_expand_cuda(args(o), nullptr); }, fresh);
  if (nan) {
    if (!raised) fail("the CPU kernel accepted a NaN score");
    if (!(cuda.status[0] & rheo::kStatusNanScore)) fail("status bit kStatusNanScore not set");
    for (const int32_t e : cuda.expand)
      if (e < 0 || e >= M) fail("expand index out of range after a NaN: " + std::to_string(e));
    return;
  }
  expect_equal(cuda.expand, cpu.expand, "expand");
  expect_equal(cuda.status, std::vector<int32_t>{0}, "status");
}

struct Candidates {
  int64_t B, L;
  std::vector<float> scores;
  std::vector<int32_t> tokens, parents, sampled, root, prefix;
};

// Candidates as the draft loop makes them: level 1 = K children of the root; each further level
// = K children of each of the topk best candidates of the previous level (select_expand_cpu),
// score = parent score + a log proxy <= 0; slot 1 of each group is the sampled child.
Candidates make_candidates(Rng& rng, int64_t B, int32_t K, int32_t topk, int32_t depth, bool ties) {
  Candidates c;
  c.B = B;
  std::vector<std::vector<float>> sc(B);
  std::vector<std::vector<int32_t>> tok(B), par(B), smp(B);
  int32_t rows = 0;
  std::vector<int64_t> level_begin(B, 0), level_end(B, 0);
  auto proxy = [&] { return ties ? -static_cast<float>(rng.below(4)) * 0.5f : -std::fabs(rng.normal(1.5f)); };
  for (int64_t b = 0; b < B; ++b) {
    for (int32_t k = 0; k < K; ++k) {
      sc[b].push_back(proxy());
      tok[b].push_back(static_cast<int32_t>(rng.below(1000)));
      par[b].push_back(-1);
      smp[b].push_back(k == 1 ? rows : -1);
    }
    ++rows;
    level_end[b] = K;
  }
  for (int32_t d = 1; d < depth; ++d) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t M = level_end[b] - level_begin[b];
      std::vector<int32_t> chosen(topk);
      rheo::SelectExpandArgs a;
      a.scores = sc[b].data() + level_begin[b];
      a.B = 1;
      a.M = M;
      a.topk = topk;
      a.expand = chosen.data();
      rheo::select_expand_cpu(a);
      level_begin[b] = level_end[b];
      for (int32_t p = 0; p < topk; ++p) {
        const int32_t parent = static_cast<int32_t>(level_begin[b] - M + chosen[p]);
        for (int32_t k = 0; k < K; ++k) {
          sc[b].push_back(sc[b][parent] + proxy());
          tok[b].push_back(static_cast<int32_t>(rng.below(1000)));
          par[b].push_back(parent);
          smp[b].push_back(k == 1 ? rows : -1);
        }
        ++rows;
      }
      level_end[b] = static_cast<int64_t>(sc[b].size());
    }
  }
  c.L = static_cast<int64_t>(sc[0].size());
  for (int64_t b = 0; b < B; ++b) {
    c.scores.insert(c.scores.end(), sc[b].begin(), sc[b].end());
    c.tokens.insert(c.tokens.end(), tok[b].begin(), tok[b].end());
    c.parents.insert(c.parents.end(), par[b].begin(), par[b].end());
    c.sampled.insert(c.sampled.end(), smp[b].begin(), smp[b].end());
    c.root.push_back(static_cast<int32_t>(rng.below(1000)));
    c.prefix.push_back(static_cast<int32_t>(rng.below(500)));
  }
  return c;
}

struct TreeOut {
  std::vector<int32_t> tokens, parents, depth, positions, sampled, cand_index, retrieve, n_leaves;
  std::vector<uint8_t> mask;
  std::vector<int32_t> status;
  bool operator==(const TreeOut& o) const {
    return tokens == o.tokens && parents == o.parents && depth == o.depth &&
           positions == o.positions && sampled == o.sampled && cand_index == o.cand_index &&
           retrieve == o.retrieve && n_leaves == o.n_leaves && mask == o.mask && status == o.status;
  }
};

TreeOut tree_outputs(int64_t B, int32_t N, int32_t depth) {
  TreeOut o;
  for (auto* v : {&o.tokens, &o.parents, &o.depth, &o.positions, &o.sampled, &o.cand_index})
    v->assign(B * N, -7);
  o.retrieve.assign(B * N * (depth + 1), -7);
  o.n_leaves.assign(B, -7);
  o.mask.assign(B * N * N, 7);
  o.status.assign(1, 0);
  return o;
}

rheo::BuildTreeArgs tree_args(const Candidates& c, int32_t N, int32_t depth, TreeOut& o) {
  rheo::BuildTreeArgs a;
  a.cand_scores = c.scores.data();
  a.cand_tokens = c.tokens.data();
  a.cand_parents = c.parents.data();
  a.cand_sampled = c.sampled.data();
  a.root_tokens = c.root.data();
  a.prefix_len = c.prefix.data();
  a.B = c.B;
  a.L = c.L;
  a.N = N;
  a.max_depth = depth;
  a.tokens = o.tokens.data();
  a.parents = o.parents.data();
  a.depth = o.depth.data();
  a.positions = o.positions.data();
  a.sampled_row = o.sampled.data();
  a.cand_index = o.cand_index.data();
  a.tree_mask = o.mask.data();
  a.retrieve_indices = o.retrieve.data();
  a.n_leaves = o.n_leaves.data();
  a.status = o.status.data();
  return a;
}

enum class TreeDefect { kNone, kNan, kParentOut, kNotClosed };

void build_tree_case(int64_t B, int32_t K, int32_t topk, int32_t depth, int32_t N, bool ties,
                     TreeDefect defect, uint64_t seed) {
  ++cases;
  current_case = "build_tree B=" + std::to_string(B) + " K=" + std::to_string(K) + " topk=" +
                 std::to_string(topk) + " depth=" + std::to_string(depth) + " N=" +
                 std::to_string(N) + (ties ? " ties" : "") + " defect=" +
                 std::to_string(static_cast<int>(defect));
  Rng rng(seed);
  Candidates c = make_candidates(rng, B, K, topk, depth, ties);
  const int64_t bad_b = B - 1;
  switch (defect) {
    case TreeDefect::kNone: break;
    case TreeDefect::kNan: c.scores[bad_b * c.L + 1] = std::numeric_limits<float>::quiet_NaN(); break;
    case TreeDefect::kParentOut: c.parents[bad_b * c.L + c.L - 1] = static_cast<int32_t>(c.L); break;
    case TreeDefect::kNotClosed:  // a child that outranks its pruned parent
      c.scores[bad_b * c.L + c.L - 1] = 1.0f;
      c.scores[bad_b * c.L + c.parents[bad_b * c.L + c.L - 1]] = -1e30f;
      break;
  }
  TreeOut cpu = tree_outputs(B, N, depth);
  const bool raised = cpu_raises([&] { rheo::build_tree_cpu(tree_args(c, N, depth, cpu)); });
  const TreeOut cuda = run_twice<TreeOut>(
      [&](TreeOut& o) { return rheo::build_tree_cuda(tree_args(c, N, depth, o), nullptr); },
      tree_outputs(B, N, depth));
  if (defect != TreeDefect::kNone) {
    if (!raised) fail("the CPU kernel accepted a bad candidate set");
    if (cuda.n_leaves[bad_b] != -1) fail("the bad entry's n_leaves is not -1");
    const int32_t want = defect == TreeDefect::kNan ? rheo::kStatusNanScore : rheo::kStatusBadTree;
    if (!(cuda.status[0] & want)) fail("status bit " + std::to_string(want) + " not set");
    // The bad entry's layout must stay usable by the step's later kernels: in-range indices.
    for (int32_t i = 0; i < N; ++i) {
      const int32_t p = cuda.parents[bad_b * N + i], pos = cuda.positions[bad_b * N + i];
      if (p < -1 || p >= i || (i > 0 && p < 0)) fail("bad entry: parent out of range");
      if (pos < c.prefix[bad_b] || pos > c.prefix[bad_b] + depth) fail("bad entry: position out of range");
    }
    return;
  }
  if (raised) fail("the CPU kernel raised on valid candidates");
  expect_equal(cuda.tokens, cpu.tokens, "tokens");
  expect_equal(cuda.parents, cpu.parents, "parents");
  expect_equal(cuda.depth, cpu.depth, "depth");
  expect_equal(cuda.positions, cpu.positions, "positions");
  expect_equal(cuda.sampled, cpu.sampled, "sampled_row");
  expect_equal(cuda.cand_index, cpu.cand_index, "cand_index");
  expect_equal(cuda.retrieve, cpu.retrieve, "retrieve_indices");
  expect_equal(cuda.n_leaves, cpu.n_leaves, "n_leaves");
  expect_equal(cuda.mask, cpu.mask, "tree_mask");
  expect_equal(cuda.status, std::vector<int32_t>{0}, "status");
}

void proxy_rerank_tests() {
  uint64_t seed = 200;
  for (const bool ties : {false, true}) {
    select_expand_case(1, 10, 10, ties, false, ++seed);
    select_expand_case(8, 100, 10, ties, false, ++seed);
    select_expand_case(3, 13000, 7, ties, false, ++seed);  // past the staged shared memory
    select_expand_case(2, 50, 5, ties, true, ++seed);
    build_tree_case(1, 10, 10, 8, 60, ties, TreeDefect::kNone, ++seed);
    build_tree_case(8, 10, 10, 8, 60, ties, TreeDefect::kNone, ++seed);
    build_tree_case(2, 4, 2, 3, 1, ties, TreeDefect::kNone, ++seed);
    build_tree_case(3, 6, 3, 5, 17, ties, TreeDefect::kNone, ++seed);
    if (!quick) build_tree_case(1, 10, 10, 130, 60, ties, TreeDefect::kNone, ++seed);  // L > 12K: unstaged
  }
  build_tree_case(2, 10, 10, 4, 30, false, TreeDefect::kNan, ++seed);
  build_tree_case(2, 10, 10, 4, 30, false, TreeDefect::kParentOut, ++seed);
  build_tree_case(2, 10, 10, 4, 30, false, TreeDefect::kNotClosed, ++seed);
}

// --- tree attention ------------------------------------------------------------------------------

// The outputs, and the split-KV workspace (poisoned with NaN, so a partial the merge reads but no
// block wrote shows up in out). Only out is compared between the schedules.
struct AttnOut {
  std::vector<unsigned char> out;
  std::vector<float> workspace;
  bool operator==(const AttnOut& o) const { return out == o.out; }
};

// A ragged batch from a KV pool (empty vectors: the plain batch, prefix `prefix` for every b,
// slot b): prefix_lens [B] per sequence (`prefix` is then their host-side bound), slots [B] into
// S slots of k/v. In these cases every k/v row no sequence may see (past P_b + N of its slot, and
// the unused slots) is NaN, so a read of one shows up in out.
struct Ragged {
  std::vector<int32_t> prefix_lens;
  std::vector<int32_t> slots;
  int64_t S = 0;
};

// blind_every > 0: nodes n % blind_every == 0 get an all-zero mask row (with prefix 0 they see
// nothing and must get zeros; the other nodes may still see them as ancestors).
void tree_attention_case(int64_t B, int64_t N, int64_t H, int64_t Hkv, int64_t D, int64_t prefix,
                         DType dtype, bool random_mask, uint64_t seed, int64_t blind_every = 0,
                         const Ragged& ragged = {}) {
  ++cases;
  auto list = [](const std::vector<int32_t>& x) {
    std::string s;
    for (const int32_t e : x) s += (s.empty() ? "" : ",") + std::to_string(e);
    return s;
  };
  current_case = "tree_attention B=" + std::to_string(B) + " N=" + std::to_string(N) + " H=" +
                 std::to_string(H) + "/" + std::to_string(Hkv) + " D=" + std::to_string(D) +
                 " prefix=" + std::to_string(prefix) + " " + dtype_name(dtype) +
                 (random_mask ? " random mask" : "") +
                 (blind_every ? " blind every " + std::to_string(blind_every) : "") +
                 (ragged.prefix_lens.empty() ? "" : " prefix_lens=" + list(ragged.prefix_lens)) +
                 (ragged.slots.empty() ? "" : " slots=" + list(ragged.slots) + " of " +
                                                  std::to_string(ragged.S));
  auto prefix_of = [&](int64_t b) -> int64_t {
    return ragged.prefix_lens.empty() ? prefix : ragged.prefix_lens[b];
  };
  Rng rng(seed);
  const int64_t S = ragged.slots.empty() ? B : ragged.S;
  const int64_t Lc = prefix + N + 3;  // spare cache rows past the tree: never read
  const int64_t q_pad = 5;            // q rows strided with padding between heads' blocks
  const int64_t q_stride_h = D, q_stride_n = H * D + q_pad, q_stride_b = N * q_stride_n;
  const auto q = encode(make_logits(rng, B * q_stride_b, Logits::kNormal), dtype);
  const int64_t kv_stride_h = D, kv_stride_l = Hkv * D, kv_stride_b = Lc * kv_stride_l;
  std::vector<float> k_values = make_logits(rng, S * kv_stride_b, Logits::kNormal);
  std::vector<float> v_values = make_logits(rng, S * kv_stride_b, Logits::kNormal);
  if (!ragged.prefix_lens.empty() || !ragged.slots.empty()) {
    std::vector<int64_t> seen_rows(S, 0);  // rows of each slot some sequence may see
    for (int64_t b = 0; b < B; ++b) {
      const int64_t slot = ragged.slots.empty() ? b : ragged.slots[b];
      seen_rows[slot] = std::max(seen_rows[slot], prefix_of(b) + N);
    }
    for (int64_t slot = 0; slot < S; ++slot)
      for (int64_t i = slot * kv_stride_b + seen_rows[slot] * kv_stride_l;
           i < (slot + 1) * kv_stride_b; ++i)
        k_values[i] = v_values[i] = std::numeric_limits<float>::quiet_NaN();
  }
  const auto k = encode(k_values, dtype);
  const auto v = encode(v_values, dtype);
  std::vector<uint8_t> mask(B * N * N, 0);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> parent(N, -1);
    for (int64_t i = 1; i < N; ++i) parent[i] = rng.below(i);
    for (int64_t i = 0; i < N; ++i) {
      if (blind_every > 0 && i % blind_every == 0) continue;
      if (random_mask) {
        for (int64_t j = 0; j < N; ++j) mask[(b * N + i) * N + j] = rng.uniform() < 0.3;
        continue;
      }
      for (int64_t j = i; j >= 0; j = parent[j]) mask[(b * N + i) * N + j] = 1;
    }
  }
  rheo::TreeAttentionArgs base;
  base.q = q.data();
  base.k = k.data();
  base.v = v.data();
  base.tree_mask = mask.data();
  base.dtype = dtype;
  base.B = B, base.N = N, base.H = H, base.Hkv = Hkv, base.D = D;
  base.prefix_len = prefix;
  if (!ragged.prefix_lens.empty()) base.prefix_lens = ragged.prefix_lens.data();
  if (!ragged.slots.empty()) base.kv_slots = ragged.slots.data();
  base.S = S;
  base.q_stride_b = q_stride_b, base.q_stride_n = q_stride_n, base.q_stride_h = q_stride_h;
  base.kv_stride_b = kv_stride_b, base.kv_stride_l = kv_stride_l, base.kv_stride_h = kv_stride_h;
  base.scale = 1.0f / std::sqrt(static_cast<float>(D));
  auto args = [&](AttnOut& o) {
    rheo::TreeAttentionArgs a = base;
    a.out = o.out.data();
    a.workspace = o.workspace.empty() ? nullptr : o.workspace.data();
    return a;
  };
  const size_t ws_floats = rheo::tree_attention_workspace_floats(base);
  if (ws_floats > 0)
    current_case += " splits=" + std::to_string(ws_floats / (B * N * H * (D + 2)));
  const AttnOut fresh{std::vector<unsigned char>(B * N * H * D * elem_size(dtype), 0xAB),
                      std::vector<float>(ws_floats, std::numeric_limits<float>::quiet_NaN())};
  AttnOut cpu = fresh;
  rheo::tree_attention_cpu(args(cpu));
  const AttnOut cuda =
      run_twice<AttnOut>([&](AttnOut& o) { return rheo::tree_attention_cuda(args(o), nullptr); }, fresh);
  // float32 sums in another order; a 16-bit output may round to the neighbouring value.
  const double tol = dtype == DType::kFloat32 ? 1e-4 : dtype == DType::kBFloat16 ? 1.6e-2 : 2e-3;
  expect_close(cuda.out, cpu.out, dtype, tol, "out");  // values ~ N(0, 3): tol relative to that scale
  const size_t es = elem_size(dtype);
  for (size_t i = 0; i * es < cuda.out.size(); ++i)
    if (!std::isfinite(decode(cuda.out.data() + i * es, dtype))) {
      fail("out[" + std::to_string(i) + "] is not finite (a row no node may see was read, or " +
           "a partial the merge reads was never written)");
      break;
    }
  if (blind_every > 0) {  // the blind nodes of the sequences with prefix 0 get exactly zero
    for (int64_t b = 0; b < B; ++b)
      for (int64_t n = 0; prefix_of(b) == 0 && n < N; n += blind_every)
        for (int64_t i = (b * N + n) * H * D; i < (b * N + n + 1) * H * D; ++i)
          if (decode(cuda.out.data() + i * es, dtype) != 0.0) {
            fail("blind node " + std::to_string(n) + " of entry " + std::to_string(b) +
                 " got a non-zero output");
            b = B, n = N;
            break;
          }
  }
}

// The CUDA limits: D past the register tiles, H % Hkv, a split prefix without a workspace.
void tree_attention_limits() {
  ++cases;
  current_case = "tree_attention limits";
  rheo::TreeAttentionArgs a;
  a.B = 1, a.N = 60, a.H = 32, a.Hkv = 8, a.D = 128, a.prefix_len = 8192;
  if (rheo::tree_attention_workspace_floats(a) == 0) fail("prefix 8192 is not split");
  if (!cpu_raises([&] { rheo::tree_attention_cuda(a, nullptr); }))
    fail("a split prefix with a null workspace does not raise");
  a.prefix_len = 10;
  if (rheo::tree_attention_workspace_floats(a) != 0) fail("prefix 10 is split");
  a.D = 257;
  if (!cpu_raises([&] { rheo::tree_attention_workspace_floats(a); })) fail("D = 257 does not raise");
  a.D = 128, a.Hkv = 5;
  if (!cpu_raises([&] { rheo::tree_attention_cuda(a, nullptr); })) fail("H % Hkv != 0 does not raise");
  // The plan sees only the host bound prefix_len, never the device arrays.
  a.Hkv = 8, a.prefix_len = 8192;
  const int32_t lens[1] = {3}, slots[1] = {0};
  const size_t ws = rheo::tree_attention_workspace_floats(a);
  a.prefix_lens = lens;
  if (rheo::tree_attention_workspace_floats(a) != ws) fail("the workspace depends on prefix_lens");
  a.kv_slots = slots, a.S = 0;
  if (!cpu_raises([&] { rheo::tree_attention_workspace_floats(a); })) fail("kv_slots, S = 0 does not raise");
  // The CPU kernel checks the values (host memory).
  a.S = 1, a.prefix_len = 2;
  if (!cpu_raises([&] { rheo::tree_attention_cpu(a); })) fail("prefix_lens > prefix_len does not raise");
  a.prefix_len = 3, a.S = 0;
  if (!cpu_raises([&] { rheo::tree_attention_cpu(a); })) fail("kv_slots, S = 0 does not raise on the CPU");
}

void tree_attention_tests() {
  uint64_t seed = 300;
  tree_attention_limits();
  for (const DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    tree_attention_case(1, 1, 4, 2, 64, 0, d, false, ++seed);
    tree_attention_case(2, 7, 4, 1, 33, 5, d, false, ++seed);
    tree_attention_case(1, 60, 4, 2, 128, quick ? 20 : 300, d, false, ++seed);
    tree_attention_case(3, 9, 2, 2, 16, 0, d, true, ++seed);  // rows that see nothing: zeros
    // The paper's heads (G = 4): 240 query rows = 3.75 row tiles, 5 uneven splits at 1000.
    tree_attention_case(1, 60, 32, 8, 128, quick ? 200 : 1000, d, false, ++seed);
    tree_attention_case(2, 2, 8, 2, 80, 255, d, false, ++seed);   // 2 splits, a 1-key tail tile
    tree_attention_case(1, 5, 4, 4, 64, 257, d, false, ++seed);   // G = 1, 2 splits
    tree_attention_case(3, 17, 8, 2, 33, 1, d, true, ++seed);     // 68 rows: a 4-row second tile
    tree_attention_case(1, 3, 12, 4, 128, quick ? 700 : 2000, d, false, ++seed);  // G = 3, 8 splits
    tree_attention_case(2, 4, 4, 2, 256, 100, d, false, ++seed);  // D = 256: 145 KB opt-in
    tree_attention_case(1, 6, 6, 3, 150, 40, d, false, ++seed);   // kVec = 3, D % 64 != 0
    tree_attention_case(1, 300, 2, 1, 64, 0, d, false, ++seed, 7);  // blind rows, 2 splits
    tree_attention_case(2, 40, 4, 1, 7, 0, d, true, ++seed, 3);     // blind rows, tiny D
    // Ragged batches from a KV pool. The split plan comes from the bound prefix_len, so the
    // short sequences have whole splits past their P_b + N: empty partials, weight 0 in the merge.
    tree_attention_case(4, 7, 8, 2, 32, 70, d, false, ++seed, 3, {{0, 3, 17, 70}, {4, 0, 5, 2}, 6});
    tree_attention_case(3, 9, 8, 2, 64, quick ? 600 : 2000, d, false, ++seed, 4,
                        {{quick ? 600 : 2000, 5, 0}, {1, 2, 0}, 3});  // 8 splits; 7 empty for b = 1, 2
    tree_attention_case(2, 60, 32, 8, 128, quick ? 300 : 1000, d, false, ++seed, 0,
                        {{quick ? 40 : 300, quick ? 300 : 1000}, {}, 0});  // paper heads, no slots
    tree_attention_case(3, 5, 4, 4, 64, 600, d, true, ++seed, 2, {{0, 0, 0}, {}, 0});  // all P_b = 0
    tree_attention_case(3, 6, 4, 2, 80, 40, d, false, ++seed, 0, {{}, {2, 2, 0}, 5});  // shared slot
    tree_attention_case(2, 4, 6, 3, 48, 900, d, false, ++seed, 0, {{100, 250}, {1, 0}, 2});  // loose bound
  }
}

// --- fused layer operators ----------------------------------------------------------------------

struct FusedOut {
  std::vector<unsigned char> a, b;  // add_rms_norm: residual, normed; rope: q, k; silu: out, -
  bool operator==(const FusedOut& o) const { return a == o.a && b == o.b; }
};

// Inputs with a spread of magnitudes (|x| up to ~40: silu's exp near its clamps, norms of rows
// that differ by 10^3), NaN-free; the same bytes go to both twins. Bitwise: the CUDA twin must
// give the CPU's bits (fused_ops.h fixes every order and rounding).
std::vector<unsigned char> fused_input(Rng& rng, int64_t count, DType dtype, float scale) {
  std::vector<float> x(count);
  for (auto& v : x) v = rng.normal(scale) * static_cast<float>(std::exp(rng.uniform() * 3.0 - 1.5));
  return encode(x, dtype);
}

void add_rms_norm_case(int64_t rows, int64_t hidden, bool with_delta, DType dtype, uint64_t seed) {
  ++cases;
  current_case = "add_rms_norm rows=" + std::to_string(rows) + " hidden=" + std::to_string(hidden) +
                 (with_delta ? " +delta " : " ") + dtype_name(dtype);
  Rng rng(seed);
  const int64_t x_stride = hidden + 5, d_stride = hidden + 2;
  const auto x = fused_input(rng, rows * x_stride, dtype, 3.0f);
  const auto delta = fused_input(rng, rows * d_stride, dtype, 1.0f);
  const auto weight = fused_input(rng, hidden, dtype, 1.0f);
  auto args = [&](FusedOut& o) {
    rheo::AddRmsNormArgs a;
    a.x = x.data(), a.weight = weight.data();
    a.delta = with_delta ? delta.data() : nullptr;
    a.residual_out = with_delta ? o.a.data() : nullptr;
    a.normed_out = o.b.data();
    a.dtype = dtype, a.rows = rows, a.hidden = hidden;
    a.x_stride = x_stride, a.delta_stride = d_stride, a.eps = 1e-5f;
    a.row_begin = 0, a.row_end = rows;
    return a;
  };
  const std::vector<unsigned char> poison(rows * hidden * elem_size(dtype), 0xAB);
  FusedOut cpu{poison, poison};
  rheo::add_rms_norm_cpu(args(cpu));
  const FusedOut cuda = run_twice<FusedOut>(
      [&](FusedOut& o) { return rheo::add_rms_norm_cuda(args(o), nullptr); }, FusedOut{poison, poison});
  expect_equal(cuda.a, cpu.a, "residual");
  expect_equal(cuda.b, cpu.b, "normed");
}

void rope_qk_case(int64_t rows, int64_t H, int64_t Hkv, int64_t D, DType dtype, uint64_t seed) {
  ++cases;
  current_case = "rope_qk rows=" + std::to_string(rows) + " H=" + std::to_string(H) + " Hkv=" +
                 std::to_string(Hkv) + " D=" + std::to_string(D) + " " + dtype_name(dtype);
  Rng rng(seed);
  const int64_t stride = (H + 2 * Hkv) * D + 3;
  const auto qkv = fused_input(rng, rows * stride, dtype, 2.0f);
  std::vector<float> cos(rows * D / 2), sin(rows * D / 2);
  for (size_t i = 0; i < cos.size(); ++i) {
    const double angle = rng.uniform() * 6000.0;
    cos[i] = static_cast<float>(std::cos(angle)), sin[i] = static_cast<float>(std::sin(angle));
  }
  const auto cos_b = encode(cos, dtype), sin_b = encode(sin, dtype);
  auto args = [&](FusedOut& o) {
    rheo::RopeQkArgs a;
    a.qkv = qkv.data(), a.cos = cos_b.data(), a.sin = sin_b.data();
    a.q_out = o.a.data(), a.k_out = o.b.data();
    a.dtype = dtype, a.rows = rows, a.H = H, a.Hkv = Hkv, a.D = D, a.qkv_stride = stride;
    a.row_begin = 0, a.row_end = rows;
    return a;
  };
  const FusedOut fresh{std::vector<unsigned char>(rows * H * D * elem_size(dtype), 0xAB),
                       std::vector<unsigned char>(rows * Hkv * D * elem_size(dtype), 0xAB)};
  FusedOut cpu = fresh;
  rheo::rope_qk_cpu(args(cpu));
  const FusedOut cuda =
      run_twice<FusedOut>([&](FusedOut& o) { return rheo::rope_qk_cuda(args(o), nullptr); }, fresh);
  expect_equal(cuda.a, cpu.a, "q");
  expect_equal(cuda.b, cpu.b, "k");
}

void silu_mul_case(int64_t rows, int64_t I, DType dtype, uint64_t seed) {
  ++cases;
  current_case = "silu_mul rows=" + std::to_string(rows) + " I=" + std::to_string(I) + " " +
                 dtype_name(dtype);
  Rng rng(seed);
  const int64_t stride = 2 * I + 7;
  auto gate_up = fused_input(rng, rows * stride, dtype, 8.0f);
  if (rows * I > 4) {  // exp's clamps and overflow: silu(-120) = -0, silu(-90), silu(110) = 110
    const std::vector<float> edge = {-120.0f, -90.0f, 110.0f, -0.0f};
    const auto bytes = encode(edge, dtype);
    std::memcpy(gate_up.data(), bytes.data(), bytes.size());
  }
  auto args = [&](FusedOut& o) {
    rheo::SiluMulArgs a;
    a.gate_up = gate_up.data(), a.out = o.a.data();
    a.dtype = dtype, a.rows = rows, a.I = I, a.gu_stride = stride;
    a.row_begin = 0, a.row_end = rows;
    return a;
  };
  const FusedOut fresh{std::vector<unsigned char>(rows * I * elem_size(dtype), 0xAB), {}};
  FusedOut cpu = fresh;
  rheo::silu_mul_cpu(args(cpu));
  const FusedOut cuda =
      run_twice<FusedOut>([&](FusedOut& o) { return rheo::silu_mul_cuda(args(o), nullptr); }, fresh);
  expect_equal(cuda.a, cpu.a, "out");
}

void fused_ops_tests() {
  uint64_t seed = 700;
  for (const DType d : {DType::kFloat32, DType::kBFloat16}) {
    add_rms_norm_case(1, 576, true, d, ++seed);   // SmolLM2's decode step
    add_rms_norm_case(3, 100, false, d, ++seed);  // a tail past the 16-lane blocks, no delta
    add_rms_norm_case(5, 17, true, d, ++seed);    // fewer columns than lanes
    rope_qk_case(1, 9, 3, 64, d, ++seed);         // SmolLM2's heads
    rope_qk_case(4, 4, 1, 12, d, ++seed);
    silu_mul_case(1, 1536, d, ++seed);
    silu_mul_case(3, 37, d, ++seed);  // a tail past the 16-lane blocks
    if (!quick) {
      add_rms_norm_case(16, 2048, true, d, ++seed);
      silu_mul_case(16, 1000, d, ++seed);
      rope_qk_case(16, 32, 8, 128, d, ++seed);
    }
  }
}

// --- skinny linear --------------------------------------------------------------------------------

void skinny_linear_case(int64_t n, int64_t in, int64_t out, int64_t o_begin, int64_t o_end,
                        DType dtype, int64_t x_pad, uint64_t seed, bool edges = false) {
  ++cases;
  current_case = "skinny_linear n=" + std::to_string(n) + " in=" + std::to_string(in) + " out=" +
                 std::to_string(out) + " [" + std::to_string(o_begin) + ", " +
                 std::to_string(o_end) + ") " + dtype_name(dtype) + " x_pad=" + std::to_string(x_pad);
  Rng rng(seed);
  const int64_t x_stride = in + x_pad, y_stride = out + 3;
  auto x = encode(make_logits(rng, n * x_stride, Logits::kNormal), dtype);
  auto w = encode(make_logits(rng, out * in, Logits::kNormal), dtype);
  if (edges && dtype == DType::kBFloat16) {  // denormals (read as 0), 2^-126, tiny products
    const uint16_t kEdges[] = {0x0001, 0x8005, 0x0080, 0x1980, 0x9A40, 0x3F80};
    for (auto* v : {&x, &w})
      for (size_t i = 0; i + 1 < v->size(); i += 2 * (7 + rng.below(13))) {
        const uint16_t e = kEdges[rng.below(6)];
        memcpy(v->data() + i, &e, 2);
      }
  }
  auto args = [&](AttnOut& o) {
    rheo::SkinnyLinearArgs a;
    a.x = x.data();
    a.w = w.data();
    a.y = o.out.data();
    a.dtype = dtype;
    a.n = n, a.in = in, a.out = out;
    a.x_stride = x_stride, a.y_stride = y_stride;
    a.o_begin = o_begin, a.o_end = o_end;
    return a;
  };
  const AttnOut fresh{std::vector<unsigned char>(n * y_stride * elem_size(dtype), 0xAB)};
  AttnOut cpu = fresh;
  rheo::skinny_linear_cpu(args(cpu));
  const AttnOut cuda =
      run_twice<AttnOut>([&](AttnOut& o) { return rheo::skinny_linear_cuda(args(o), nullptr); }, fresh);
  expect_equal(cuda.out, cpu.out, "y (skinny::dot's bits on both)");
}

void skinny_linear_tests() {
  uint64_t seed = 400;
  for (const DType d : {DType::kFloat32, DType::kBFloat16}) {
    skinny_linear_case(1, 64, 37, 0, 37, d, 0, ++seed);
    skinny_linear_case(3, 100, 16, 0, 16, d, 0, ++seed);    // in % 8 != 0: scalar loads
    skinny_linear_case(9, 256, 40, 5, 33, d, 8, ++seed);    // rows past kMaxRows, a column range
    skinny_linear_case(17, 512, 8, 0, 8, d, 3, ++seed);     // misaligned stride: scalar loads
    if (!quick) skinny_linear_case(4, 4096, 64, 0, 64, d, 0, ++seed);
    skinny_linear_case(19, 96 + 5, 21, 0, 21, d, 0, ++seed, true);  // steps + tail, edge values
    skinny_linear_case(70, 64, 9, 2, 9, d, 1, ++seed, true);
  }
}

// --- quantized linear -------------------------------------------------------------------------------

struct QuantOut {
  std::vector<unsigned char> y;
  std::vector<int8_t> xq;
  std::vector<float> xd, xm;
  std::vector<int32_t> xs;
  bool operator==(const QuantOut& o) const {
    return y == o.y && xq == o.xq && xd == o.xd && xs == o.xs && xm == o.xm;
  }
};

// Random packed W (codes of every value, fp16 scales of both signs around 2^-7, zero pads), x of
// a dtype with a row stride; the CUDA quantization and matmul must equal the CPU's bit for bit.
void quant_linear_case(rheo::QuantType type, int64_t n, int64_t in, int64_t out, int64_t p_begin,
                       int64_t p_end, DType dtype, uint64_t seed) {
  ++cases;
  current_case = "quant_linear type=" + std::to_string(static_cast<int>(type)) + " n=" +
                 std::to_string(n) + " in=" + std::to_string(in) + " out=" + std::to_string(out) +
                 " panels [" + std::to_string(p_begin) + ", " + std::to_string(p_end) + ") " +
                 dtype_name(dtype);
  Rng rng(seed);
  const int64_t nb = in / rheo::kQuantBlock, panels = (out + 15) / 16;
  const int64_t rec = rheo::quant_record_bytes(type), x_stride = in + 5, y_stride = out + 3;
  std::vector<uint8_t> w(panels * nb * rec);
  for (auto& b : w) b = static_cast<uint8_t>(rng.below(256));
  const int scales = type == rheo::QuantType::kQ4_1 ? 32 : 16;
  for (int64_t r = 0; r < panels * nb; ++r)
    for (int s = 0; s < scales; ++s) {
      const __half h = __float2half_rn(rng.normal(0.01f));
      std::memcpy(w.data() + r * rec + 2 * s, &h, 2);
    }
  std::vector<float> xf(n * x_stride);
  for (auto& v : xf) v = rng.uniform() < 0.05 ? 0.0f : rng.normal(2.0f);
  const auto x = encode(xf, dtype);
  QuantOut fresh{std::vector<unsigned char>(n * y_stride * elem_size(dtype), 0xAB),
                 std::vector<int8_t>(n * in), std::vector<float>(n * nb),
                 std::vector<float>(n * nb), std::vector<int32_t>(n * nb)};
  auto rows = [&](QuantOut& o) {
    rheo::QuantRowsArgs a;
    a.x = x.data(), a.dtype = dtype, a.n = n, a.in = in, a.x_stride = x_stride;
    a.xq = o.xq.data(), a.xd = o.xd.data(), a.xs = o.xs.data(), a.xm = o.xm.data();
    return a;
  };
  auto lin = [&](QuantOut& o) {
    rheo::QuantLinearArgs a;
    a.xq = o.xq.data(), a.xd = o.xd.data(), a.xs = o.xs.data(), a.xm = o.xm.data();
    a.w = w.data(), a.type = type, a.y = o.y.data(), a.dtype = dtype;
    a.n = n, a.in = in, a.out = out, a.y_stride = y_stride, a.p_begin = p_begin, a.p_end = p_end;
    return a;
  };
  QuantOut cpu = fresh;
  rheo::quantize_rows_q8_cpu(rows(cpu));
  rheo::quant_linear_cpu(lin(cpu));
  const QuantOut cuda = run_twice<QuantOut>(
      [&](QuantOut& o) {
        const cudaError_t e = rheo::quantize_rows_q8_cuda(rows(o), nullptr);
        return e != cudaSuccess ? e : rheo::quant_linear_cuda(lin(o), nullptr);
      },
      fresh);
  expect_equal(cuda.xq, cpu.xq, "xq");
  expect_equal(cuda.xs, cpu.xs, "xs");
  expect_equal(cuda.xd, cpu.xd, "xd");
  expect_equal(cuda.xm, cpu.xm, "xm");
  expect_equal(cuda.y, cpu.y, "y (bytes)");
}

void quant_linear_tests() {
  uint64_t seed = 500;
  using rheo::QuantType;
  for (const QuantType t : {QuantType::kQ8_0, QuantType::kQ4_0, QuantType::kQ4_1}) {
    for (const DType d : {DType::kFloat32, DType::kBFloat16}) {
      quant_linear_case(t, 1, 32, 16, 0, 1, d, ++seed);
      quant_linear_case(t, 3, 96, 37, 0, 3, d, ++seed);    // out % 16 != 0: a padded last panel
      quant_linear_case(t, 11, 64, 50, 1, 3, d, ++seed);   // rows past kMaxRows, a panel range
      if (!quick) quant_linear_case(t, 19, 576, 192, 0, 12, d, ++seed);  // SmolLM2's k/v shape
    }
  }
}

// --- verification -----------------------------------------------------------------------------------

struct VerifyCase {
  int64_t B, N, V, Se;
  DType dtype;
  rheo::VerifyMethod method;
  double T, top_p;
  int32_t top_k;
  Logits logits;
  double min_p = 0.0;
};

struct VerifyOut {
  std::vector<int32_t> path, len, bonus, status;
  bool operator==(const VerifyOut& o) const {
    return path == o.path && len == o.len && bonus == o.bonus && status == o.status;
  }
};

struct VerifyInputs {
  std::vector<unsigned char> logits, q;
  std::vector<int32_t> tokens, parents, sampled, ids;
  int64_t R = 0, P = 0;
};

// A random tree (parents precede children), a sampled child at slot 1 of about half the parents
// with a q~ row over a random support holding its token (q~ > 0 there), target logits of a kind.
// Children's tokens are drawn near the target's mode so that acceptance is common.
VerifyInputs make_verify_inputs(const VerifyCase& c, Rng& rng) {
  VerifyInputs in;
  const DType acc = c.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  std::vector<float> x = make_logits(rng, c.B * c.N * c.V, c.logits);
  std::vector<float> q;
  in.tokens.assign(c.B * c.N, 0);
  in.parents.assign(c.B * c.N, -1);
  in.sampled.assign(c.B * c.N, -1);
  int64_t max_depth = 0;
  for (int64_t b = 0; b < c.B; ++b) {
    std::vector<int64_t> depth(c.N, 0), n_children(c.N, 0);
    for (int64_t i = 1; i < c.N; ++i) {
      const int64_t p = rng.uniform() < 0.6 ? i - 1 : rng.below(i);
      in.parents[b * c.N + i] = static_cast<int32_t>(p);
      depth[i] = depth[p] + 1;
      max_depth = std::max(max_depth, depth[i]);
      // A likely token at the parent: one of the 4 largest logits there, or a random one.
      const float* row = x.data() + (b * c.N + p) * c.V;
      std::vector<int32_t> best(c.V);
      std::iota(best.begin(), best.end(), 0);
      const int64_t top = std::min<int64_t>(4, c.V);
      std::partial_sort(best.begin(), best.begin() + top, best.end(),
                        [&](int32_t u, int32_t v) { return row[u] > row[v]; });
      const int32_t tok = rng.uniform() < 0.8 ? best[rng.below(top)] : static_cast<int32_t>(rng.below(c.V));
      in.tokens[b * c.N + i] = tok;
      if (++n_children[p] == 2 && c.Se > 0 && rng.uniform() < 0.7) {
        in.sampled[b * c.N + i] = static_cast<int32_t>(in.R++);
        std::vector<int32_t> support(c.V);
        std::iota(support.begin(), support.end(), 0);
        std::shuffle(support.begin(), support.end(), rng.g);
        support.resize(c.Se);
        if (std::find(support.begin(), support.end(), tok) == support.end()) support[rng.below(c.Se)] = tok;
        double total = 0.0;
        std::vector<double> w(c.Se);
        for (int64_t s = 0; s < c.Se; ++s) {
          w[s] = support[s] == tok || rng.uniform() < 0.8 ? rng.uniform() + 0.05 : 0.0;
          total += w[s];
        }
        for (int64_t s = 0; s < c.Se; ++s) {
          in.ids.push_back(support[s]);
          q.push_back(static_cast<float>(w[s] / total));
        }
      }
    }
  }
  in.P = max_depth + 1;
  in.logits = encode(x, c.dtype);
  in.q = encode(q, acc);
  return in;
}

VerifyOut verify_outputs(const VerifyCase& c, int64_t P) {
  return {std::vector<int32_t>(c.B * P, -7), std::vector<int32_t>(c.B, -7),
          std::vector<int32_t>(c.B, -7), {0}};
}

rheo::VerificationArgs verify_args(const VerifyCase& c, const VerifyInputs& in, VerifyOut& o,
                                   double* workspace) {
  rheo::VerificationArgs a;
  a.logits = in.logits.data();
  a.dtype = c.dtype;
  a.B = c.B, a.N = c.N, a.V = c.V;
  a.tokens = in.tokens.data();
  a.parents = in.parents.data();
  a.sampled_row = in.sampled.data();
  a.q_tilde_ids = in.ids.data();
  a.q_tilde = in.q.data();
  a.R = in.R, a.Se = c.Se;
  a.method = c.method;
  a.T = c.T;
  a.top_p = c.top_p;
  a.top_k = c.top_k;
  a.min_p = c.min_p;
  a.seed = 77;
  a.step = 5;
  a.accept_path = o.path.data();
  a.path_capacity = in.P;
  a.accept_len = o.len.data();
  a.bonus_token = o.bonus.data();
  a.status = o.status.data();
  a.workspace = workspace;
  return a;
}

const char* method_name(rheo::VerifyMethod m) {
  return m == rheo::VerifyMethod::kTopK ? "topk" : m == rheo::VerifyMethod::kRRSW ? "rrsw" : "rheo";
}

int verify_mismatches = 0, verify_trees = 0;
int min_p_trees = 0, min_p_changed = 0;  // trees of min_p > 0 cases at T > 0; those min-p changed

void verification_case(const VerifyCase& c, uint64_t seed) {
  ++cases;
  char name[220];
  std::snprintf(name, sizeof name, "verification B=%ld N=%ld V=%ld Se=%ld %s %s T=%.2f top_p=%.2f top_k=%d min_p=%.2f%s",
                long(c.B), long(c.N), long(c.V), long(c.Se), dtype_name(c.dtype),
                method_name(c.method), c.T, c.top_p, c.top_k, c.min_p,
                c.logits == Logits::kTies ? " ties" : c.logits == Logits::kPeaked ? " peaked" : "");
  current_case = name;
  Rng rng(seed);
  const VerifyInputs in = make_verify_inputs(c, rng);
  std::vector<double> workspace(c.B * c.V);
  VerifyOut cpu = verify_outputs(c, in.P);
  rheo::verification_cpu(verify_args(c, in, cpu, nullptr));
  const VerifyOut cuda = run_twice<VerifyOut>(
      [&](VerifyOut& o) { return rheo::verification_cuda(verify_args(c, in, o, workspace.data()), nullptr); },
      verify_outputs(c, in.P));
  verify_trees += static_cast<int>(c.B);
  if (c.min_p > 0.0) {  // the same tree without min-p: T = 0 must ignore it; at T > 0 it must bite
    VerifyCase off = c;
    off.min_p = 0.0;
    VerifyOut cpu_off = verify_outputs(c, in.P);
    rheo::verification_cpu(verify_args(off, in, cpu_off, nullptr));
    if (c.T == 0.0) {
      if (!(cpu_off == cpu)) fail("T = 0: the CPU walk depends on min_p");
      VerifyOut cuda_off = verify_outputs(c, in.P);
      rheo::verification_cuda(verify_args(off, in, cuda_off, workspace.data()), nullptr);
      if (!(cuda_off == cuda)) fail("T = 0: the CUDA walk depends on min_p");
    } else {
      min_p_trees += static_cast<int>(c.B);
      for (int64_t b = 0; b < c.B; ++b) min_p_changed += cpu_off.len[b] != cpu.len[b] || cpu_off.bonus[b] != cpu.bonus[b];
    }
  }
  // A coin within rounding of an acceptance threshold may go the other way (block sums add in
  // another order); a tree that differs is counted, and more than 1 in 200 fails the run.
  for (int64_t b = 0; b < c.B; ++b) {
    bool same = cuda.len[b] == cpu.len[b] && cuda.bonus[b] == cpu.bonus[b];
    for (int64_t i = 0; i < in.P; ++i) same = same && cuda.path[b * in.P + i] == cpu.path[b * in.P + i];
    if (!same) {
      ++verify_mismatches;
      std::printf("note [%s] tree %ld: cuda len %d bonus %d, cpu len %d bonus %d\n", name, long(b),
                  cuda.len[b], cuda.bonus[b], cpu.len[b], cpu.bonus[b]);
    }
  }
  expect_equal(cuda.status, std::vector<int32_t>{0}, "status");
}

// Bad input at verification: the CPU raises, CUDA sets a status bit and emits a safe verdict.
void verification_bad(const char* what, int32_t bit, const std::function<void(VerifyInputs&, const VerifyCase&)>& spoil) {
  ++cases;
  current_case = std::string("verification bad input: ") + what;
  const VerifyCase c{2, 12, 300, 16, DType::kFloat32, rheo::VerifyMethod::kRheo, 1.0, 1.0, 0, Logits::kNormal};
  Rng rng(11);
  VerifyInputs in = make_verify_inputs(c, rng);
  spoil(in, c);
  std::vector<double> workspace(c.B * c.V);
  VerifyOut cpu = verify_outputs(c, in.P);
  if (!cpu_raises([&] { rheo::verification_cpu(verify_args(c, in, cpu, nullptr)); }))
    fail("the CPU kernel accepted it");
  const VerifyOut cuda = run_twice<VerifyOut>(
      [&](VerifyOut& o) { return rheo::verification_cuda(verify_args(c, in, o, workspace.data()), nullptr); },
      verify_outputs(c, in.P));
  if (!(cuda.status[0] & bit)) fail("status bit " + std::to_string(bit) + " not set");
  for (int64_t b = 0; b < c.B; ++b)
    if (cuda.len[b] < 1 || cuda.bonus[b] < 0 || cuda.bonus[b] >= c.V) fail("verdict out of range");
}

// A NaN target logit at a node the walk never visits: no status bit, and the verdict is the
// CPU's (the prepass records the NaN for that row; only a visited node's record fails the tree).
void verification_unvisited_nan(const VerifyCase& c, uint64_t seed) {
  ++cases;
  char name[160];
  std::snprintf(name, sizeof name, "verification NaN at an unvisited node B=%ld N=%ld V=%ld %s",
                long(c.B), long(c.N), long(c.V), dtype_name(c.dtype));
  current_case = name;
  Rng rng(seed);
  VerifyInputs in = make_verify_inputs(c, rng);
  VerifyOut first = verify_outputs(c, in.P);
  rheo::verification_cpu(verify_args(c, in, first, nullptr));
  const size_t es = elem_size(c.dtype);
  int poisoned = 0;
  for (int64_t b = 0; b < c.B; ++b) {
    std::vector<char> visited(c.N, 0);
    for (int64_t i = 0; i < first.len[b]; ++i) visited[first.path[b * in.P + i]] = 1;
    for (int64_t node = c.N - 1; node > 0; --node) {
      if (visited[node]) continue;
      std::vector<float> nan(1, std::numeric_limits<float>::quiet_NaN());
      const std::vector<unsigned char> bytes = encode(nan, c.dtype);
      std::memcpy(in.logits.data() + ((b * c.N + node) * c.V + 7) * es, bytes.data(), es);
      ++poisoned;
      break;
    }
  }
  if (poisoned == 0) fail("every node visited: no unvisited node to poison");
  VerifyOut cpu = verify_outputs(c, in.P);
  if (cpu_raises([&] { rheo::verification_cpu(verify_args(c, in, cpu, nullptr)); }))
    fail("the CPU kernel raised on an unvisited node");
  std::vector<double> workspace(c.B * c.V);
  const VerifyOut cuda = run_twice<VerifyOut>(
      [&](VerifyOut& o) { return rheo::verification_cuda(verify_args(c, in, o, workspace.data()), nullptr); },
      verify_outputs(c, in.P));
  expect_equal(cuda.status, std::vector<int32_t>{0}, "status");
  expect_equal(cuda.len, cpu.len, "accept_len");
  expect_equal(cuda.path, cpu.path, "accept_path");
  expect_equal(cuda.bonus, cpu.bonus, "bonus_token");
}

void verification_tests() {
  uint64_t seed = 500;
  using M = rheo::VerifyMethod;
  const std::vector<DType> dtypes = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64};
  for (const DType d : dtypes) {
    for (const M m : {M::kTopK, M::kRRSW, M::kRheo}) {
      for (const Logits lk : {Logits::kNormal, Logits::kTies, Logits::kPeaked}) {
        verification_case({4, 60, 111, 32, d, m, 1.0, 1.0, 0, lk}, ++seed);
        verification_case({4, 60, 111, 32, d, m, 0.7, 0.8, 0, lk}, ++seed);
        verification_case({4, 60, 111, 32, d, m, 1.0, 1.0, 20, lk}, ++seed);
        verification_case({4, 60, 111, 32, d, m, 0.0, 1.0, 0, lk}, ++seed);
        // top_p = 0.53, not 0.5: tie-heavy rows often keep n equally likely tokens after top-k,
        // and top_p * n an integer is a rounding boundary in both kernels.
        verification_case({2, 1, 111, 32, d, m, 0.9, 0.53, 7, lk}, ++seed);
      }
      if (quick) continue;
      verification_case({1, 60, 32000, 128, d, m, 1.0, 0.9, 0, Logits::kPeaked}, ++seed);
      verification_case({8, 20, 3000, 64, d, m, 0.8, 1.0, 50, Logits::kNormal}, ++seed);
    }
  }
  if (!quick) {
    verification_case({1, 30, 128256, 128, DType::kBFloat16, M::kRheo, 1.0, 0.95, 0, Logits::kPeaked}, ++seed);
    // The prepass at scale: all 60 rows processed in parallel, the walk reads their stats.
    verification_case({1, 60, 128256, 128, DType::kBFloat16, M::kRheo, 1.0, 1.0, 0, Logits::kPeaked}, ++seed);
    verification_case({1, 60, 32000, 128, DType::kFloat32, M::kRRSW, 0.8, 0.9, 50, Logits::kNormal}, ++seed);
    verification_case({8, 60, 32000, 128, DType::kBFloat16, M::kRheo, 1.0, 1.0, 0, Logits::kPeaked}, ++seed);
  }
  verification_case({8, 60, 3000, 64, DType::kFloat16, M::kRheo, 1.0, 0.8, 0, Logits::kTies}, ++seed);
  // Min-p after top-k / top-p (HF's order), alone and combined; T = 0 must ignore it. To keep the
  // suite's time the logit kind rotates with the method and the dtype (each method meets each
  // kind), and --quick keeps one method per dtype. min_p = 0.1 / 0.05 / 0.3 / 0.5 sit away from
  // the tie-heavy rows' weights exp(-k / T) (T = 1, 0.7, 0.9): only rounding can flip a token at
  // the min-p threshold, and such a tree is a counted mismatch like any other.
  const Logits kinds[] = {Logits::kNormal, Logits::kTies, Logits::kPeaked};
  const M methods[] = {M::kTopK, M::kRRSW, M::kRheo};
  for (size_t di = 0; di < dtypes.size(); ++di) {
    const DType d = dtypes[di];
    for (size_t mi = 0; mi < 3; ++mi) {
      if (quick && mi != di % 3) continue;
      const M m = methods[mi];
      const Logits lk = kinds[(mi + di) % 3];
      verification_case({4, 60, 111, 32, d, m, 1.0, 1.0, 0, lk, 0.1}, ++seed);
      verification_case({4, 60, 111, 32, d, m, 0.7, 0.8, 0, lk, 0.05}, ++seed);
      verification_case({4, 60, 111, 32, d, m, 1.0, 1.0, 20, lk, 0.3}, ++seed);
      verification_case({4, 60, 111, 32, d, m, 0.0, 1.0, 0, lk, 0.2}, ++seed);
      verification_case({2, 1, 111, 32, d, m, 0.9, 0.53, 7, lk, 0.5}, ++seed);
    }
    if (!quick) verification_case({4, 20, 3000, 64, d, M::kRRSW, 0.8, 1.0, 50, Logits::kNormal, 0.1}, ++seed);
  }
  if (!quick) {  // V = 32000: the prepass regime (V >= 6 N, the rows' stats in parallel) with min-p
    verification_case({1, 60, 32000, 128, DType::kBFloat16, M::kRheo, 1.0, 0.9, 0, Logits::kPeaked, 0.05}, ++seed);
    verification_case({1, 60, 32000, 128, DType::kFloat32, M::kTopK, 1.0, 0.95, 0, Logits::kNormal, 0.02}, ++seed);
  }
  if (min_p_trees > 0 && min_p_changed == 0) fail("min_p changed no tree's walk on the CPU: the cases do not exercise it");
  // NaN at a node off the accepted path: the prepass regime (V >= 6 N) and the one without it.
  verification_unvisited_nan({2, 12, 300, 16, DType::kFloat32, M::kRheo, 1.0, 1.0, 0, Logits::kNormal}, ++seed);
  verification_unvisited_nan({4, 60, 111, 32, DType::kBFloat16, M::kRRSW, 0.9, 0.9, 0, Logits::kNormal}, ++seed);
  verification_unvisited_nan({2, 20, 3000, 64, DType::kFloat64, M::kTopK, 0.0, 1.0, 0, Logits::kPeaked}, ++seed);
  verification_bad("NaN target logit at the root", rheo::kStatusNonFiniteTarget, [](VerifyInputs& in, const VerifyCase& c) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(in.logits.data() + (1 * c.N * c.V + 7) * 4, &nan, 4);
  });
  verification_bad("parent after its child", rheo::kStatusBadVerifyInput, [](VerifyInputs& in, const VerifyCase& c) {
    in.parents[1 * c.N + 3] = 5;
  });
  verification_bad("token outside the vocabulary", rheo::kStatusBadVerifyInput, [](VerifyInputs& in, const VerifyCase& c) {
    in.tokens[0 * c.N + 4] = static_cast<int32_t>(c.V);
  });
  verification_bad("sampled token with q~ = 0", rheo::kStatusBadVerifyInput, [](VerifyInputs& in, const VerifyCase& c) {
    for (int64_t j = 0; j < c.B * c.N; ++j) {
      if (in.sampled[j] < 0) continue;
      const int64_t row = in.sampled[j];
      for (int64_t s = 0; s < c.Se; ++s)
        if (in.ids[row * c.Se + s] == in.tokens[j]) std::memset(in.q.data() + (row * c.Se + s) * 4, 0, 4);
      return;
    }
  });
  verification_bad("two sampled children", rheo::kStatusBadVerifyInput, [](VerifyInputs& in, const VerifyCase& c) {
    for (int64_t j = 0; j < c.N; ++j) {
      if (in.sampled[j] < 0) continue;
      for (int64_t k = 1; k < c.N; ++k)
        if (k != j && in.parents[k] == in.parents[j]) in.sampled[k] = in.sampled[j];
      return;
    }
  });
}


// --- logit controls ----------------------------------------------------------------------------

struct ControlsCase {
  int64_t B, N, V, H;
  DType dtype;
  double rep, pres, freq;
  int64_t E;       // suppressed tokens
  int ban;         // suppress_below: 0 = never, 1 = the root only, 2 = deep (random depth >= 2)
  int history;     // 0 = history_len 0, 1 = full (H), 2 = mixed (0, full and in between)
  bool chain = false;  // one path 0 -> 1 -> ... -> N-1, every other token the same hot one
  int fanout = 0;      // > 0: a complete tree, parent (i - 1) / fanout (shallow at any N)
};

struct ControlsInputs {
  std::vector<unsigned char> logits;  // [B, N, V] of dtype
  std::vector<int32_t> tokens, parents, ids, counts, len, suppress, below;
};

// A random tree whose node tokens repeat each other and the history (half drawn from a small
// pool of hot tokens), a history of distinct ascending ids with generated counts (0 = prompt
// only; entries past history_len hold junk the kernels must not read), suppressed tokens that
// overlap the hot pool.
ControlsInputs make_controls_inputs(const ControlsCase& c, Rng& rng) {
  ControlsInputs in;
  // Small V: integer logits with +0.0 and -0.0 (the repetition rule's sign test at zero).
  in.logits = encode(make_logits(rng, c.B * c.N * c.V, c.V < 100 ? Logits::kTies : Logits::kNormal), c.dtype);
  std::vector<int32_t> hot(std::min<int64_t>(6, c.V));
  for (auto& t : hot) t = static_cast<int32_t>(rng.below(c.V));
  in.tokens.assign(c.B * c.N, 0);
  in.parents.assign(c.B * c.N, -1);
  in.ids.assign(c.B * c.H, -5);  // entries past history_len: junk, never read
  in.counts.assign(c.B * c.H, -5);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t i = 1; i < c.N; ++i) {
      in.parents[b * c.N + i] = static_cast<int32_t>(
          c.fanout > 0 ? (i - 1) / c.fanout : c.chain || rng.uniform() < 0.6 ? i - 1 : rng.below(i));
      in.tokens[b * c.N + i] = c.chain && i % 2 ? hot[0]
                               : rng.uniform() < 0.5 ? hot[rng.below(hot.size())]
                                                     : static_cast<int32_t>(rng.below(c.V));
    }
    in.tokens[b * c.N] = hot[0];  // the root's token is in the history already; unused
    int64_t n = c.history == 0 ? 0 : c.history == 1 ? c.H : b == 0 ? c.H : rng.below(c.H + 1);
    if (c.history == 2 && b == 1) n = 0;
    std::vector<int32_t> all(c.V);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng.g);
    std::copy(hot.begin(), hot.end(), all.begin());  // the hot tokens first (repeats on paths)
    std::vector<int32_t> pick(all.begin(), all.begin() + n);
    std::sort(pick.begin(), pick.end());
    pick.erase(std::unique(pick.begin(), pick.end()), pick.end());
    while (static_cast<int64_t>(pick.size()) < n) {  // hot tokens repeat: refill to n distinct
      const int32_t v = static_cast<int32_t>(rng.below(c.V));
      if (!std::binary_search(pick.begin(), pick.end(), v)) pick.insert(std::lower_bound(pick.begin(), pick.end(), v), v);
    }
    for (int64_t h = 0; h < n; ++h) {
      in.ids[b * c.H + h] = pick[h];
      in.counts[b * c.H + h] = rng.uniform() < 0.3 ? 0 : static_cast<int32_t>(rng.below(4));
    }
    in.len.push_back(static_cast<int32_t>(n));
    in.below.push_back(c.ban == 0 ? 0 : c.ban == 1 ? 1 : static_cast<int32_t>(2 + rng.below(c.N + 2)));
  }
  std::set<int32_t> banned = {hot.back()};
  while (static_cast<int64_t>(banned.size()) < c.E) banned.insert(static_cast<int32_t>(rng.below(c.V)));
  in.suppress.assign(banned.begin(), banned.end());
  std::shuffle(in.suppress.begin(), in.suppress.end(), rng.g);
  in.suppress.resize(c.E);
  return in;
}

struct ControlsOut {
  std::vector<unsigned char> logits;
  std::vector<int32_t> status;
  bool operator==(const ControlsOut& o) const { return logits == o.logits && status == o.status; }
};

rheo::LogitControlsArgs controls_args(const ControlsCase& c, const ControlsInputs& in, ControlsOut& o) {
  rheo::LogitControlsArgs a;
  a.logits = o.logits.data();
  a.dtype = c.dtype;
  a.B = c.B, a.N = c.N, a.V = c.V, a.H = c.H, a.E = c.E;
  a.tokens = in.tokens.data();
  a.parents = in.parents.data();
  a.history_ids = in.ids.data();
  a.history_counts = in.counts.data();
  a.history_len = in.len.data();
  a.suppress_ids = in.suppress.data();
  a.suppress_below = in.below.data();
  a.repetition_penalty = c.rep;
  a.presence_penalty = c.pres;
  a.frequency_penalty = c.freq;
  a.status = o.status.data();
  return a;
}

std::string controls_name(const ControlsCase& c) {
  char name[200];
  std::snprintf(name, sizeof name, "logit_controls B=%ld N=%ld V=%ld H=%ld %s r=%.2f pres=%.2f freq=%.2f E=%ld ban=%d history=%d",
                long(c.B), long(c.N), long(c.V), long(c.H), dtype_name(c.dtype), c.rep, c.pres,
                c.freq, long(c.E), c.ban, c.history);
  return name;
}

int controls_rows_changed = 0;  // rows the CPU changed, over the valid cases (a negative control)

// Valid input: the CUDA rows equal the CPU's bit for bit (the arithmetic is penalised_logit in
// the row's type on both sides), status 0.
void logit_controls_case(const ControlsCase& c, uint64_t seed) {
  ++cases;
  current_case = controls_name(c);
  Rng rng(seed);
  const ControlsInputs in = make_controls_inputs(c, rng);
  const ControlsOut fresh{in.logits, {0}};
  ControlsOut cpu = fresh;
  rheo::logit_controls_cpu(controls_args(c, in, cpu));
  const ControlsOut cuda = run_twice<ControlsOut>(
      [&](ControlsOut& o) { return rheo::logit_controls_cuda(controls_args(c, in, o), nullptr); }, fresh);
  expect_equal(cuda.status, std::vector<int32_t>{0}, "status");
  const size_t row = c.V * elem_size(c.dtype);
  for (int64_t r = 0; r < c.B * c.N; ++r) {
    controls_rows_changed += std::memcmp(cpu.logits.data() + r * row, in.logits.data() + r * row, row) != 0;
    if (std::memcmp(cuda.logits.data() + r * row, cpu.logits.data() + r * row, row) == 0) continue;
    for (int64_t v = 0; v < c.V; ++v) {
      const size_t at = (r * c.V + v) * elem_size(c.dtype);
      if (std::memcmp(cuda.logits.data() + at, cpu.logits.data() + at, elem_size(c.dtype)) == 0) continue;
      char msg[200];
      std::snprintf(msg, sizeof msg, "row %ld (tree %ld node %ld) token %ld: cuda %.17g cpu %.17g", long(r),
                    long(r / c.N), long(r % c.N), long(v), decode(cuda.logits.data() + at, c.dtype),
                    decode(cpu.logits.data() + at, c.dtype));
      fail(msg);
      break;
    }
    return;
  }
}

// Bad input: the CPU raises; CUDA sets kStatusBadControls and leaves every row whose path or
// history breaks a rule as it was; the other rows are what the CPU makes of the valid input.
// bad_row(in, b, i) says which rows break a rule after `spoil`.
void logit_controls_bad(const char* what, const std::function<void(ControlsInputs&, const ControlsCase&)>& spoil,
                        const std::function<bool(const ControlsInputs&, const ControlsCase&, int64_t, int64_t)>& bad_row) {
  ++cases;
  current_case = std::string("logit_controls bad input: ") + what;
  const ControlsCase c{3, 24, 400, 200, DType::kFloat32, 1.3, 0.2, 0.1, 2, 2, 1};
  Rng rng(13);
  ControlsInputs in = make_controls_inputs(c, rng);
  ControlsOut valid{in.logits, {0}};
  rheo::logit_controls_cpu(controls_args(c, in, valid));
  spoil(in, c);
  ControlsOut cpu{in.logits, {0}};
  if (!cpu_raises([&] { rheo::logit_controls_cpu(controls_args(c, in, cpu)); })) fail("the CPU kernel accepted it");
  const ControlsOut cuda = run_twice<ControlsOut>(
      [&](ControlsOut& o) { return rheo::logit_controls_cuda(controls_args(c, in, o), nullptr); },
      ControlsOut{in.logits, {0}});
  if (!(cuda.status[0] & rheo::kStatusBadControls)) fail("status bit kStatusBadControls not set");
  const size_t row = c.V * elem_size(c.dtype);
  int n_bad = 0;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t i = 0; i < c.N; ++i) {
      const size_t at = (b * c.N + i) * row;
      const bool bad = bad_row(in, c, b, i);
      n_bad += bad;
      const unsigned char* want = (bad ? in.logits : valid.logits).data() + at;
      if (std::memcmp(cuda.logits.data() + at, want, row) != 0) {
        fail("tree " + std::to_string(b) + " node " + std::to_string(i) +
             (bad ? ": a bad row was changed" : ": a good row differs from the CPU's"));
        return;
      }
    }
  if (n_bad == 0) fail("the spoiled input has no bad row");
}

// Rows of tree b whose path from node i to the root breaks a tree rule.
bool bad_path(const ControlsInputs& in, const ControlsCase& c, int64_t b, int64_t i) {
  const int32_t* parents = in.parents.data() + b * c.N;
  const int32_t* tokens = in.tokens.data() + b * c.N;
  if (parents[0] != -1) return true;
  for (int64_t j = i; j > 0; j = parents[j])
    if (parents[j] < 0 || parents[j] >= j || tokens[j] < 0 || tokens[j] >= c.V) return true;
  return false;
}

void logit_controls_tests() {
  uint64_t seed = 600;
  struct Penalties { double rep, pres, freq; };
  const Penalties penalties[] = {{1.3, 0.0, 0.0}, {0.7, 0.0, 0.0}, {1.0, 0.5, 0.0},
                                 {1.0, 0.0, 0.4}, {1.2, -0.3, 0.25}, {1.0, 0.0, 0.0}};
  for (const DType d : {DType::kFloat32, DType::kFloat64}) {
    for (const Penalties& p : penalties) {
      // Small V: the history is most of the vocabulary and path tokens repeat it; V ~ 1000 with
      // H = 300 > 128 threads: the strided history loop, and a mixed history_len per tree.
      for (int ban = 0; ban < 3; ++ban) {
        const int64_t E = ban == 0 && p.rep != 1.0 ? 0 : 3;
        logit_controls_case({2, 17, 29, 29, d, p.rep, p.pres, p.freq, E, ban, 1}, ++seed);
        logit_controls_case({3, 40, 1000, 300, d, p.rep, p.pres, p.freq, E, ban, 2}, ++seed);
        if (quick) continue;
        logit_controls_case({1, 40, 29, 20, d, p.rep, p.pres, p.freq, E, ban, 0}, ++seed);
        logit_controls_case({3, 33, 1013, 257, d, p.rep, p.pres, p.freq, E, ban, 1}, ++seed);
      }
    }
    logit_controls_case({1, 1, 5, 0, d, 1.5, 0.1, 0.1, 1, 1, 0}, ++seed);       // N = 1, H = 0
    logit_controls_case({2, 40, 1000, 300, d, 1.0, 0.0, 0.0, 0, 0, 1}, ++seed);  // all off: no-op
    // A chain of depth 159 > 128 threads: the strided loop over the path tokens, a token seen
    // 80 times on one path, the ban down to a random depth.
    logit_controls_case({1, 160, 1000, 150, d, 1.1, 0.3, 0.2, 4, 2, 1, true}, ++seed);
  }
  if (controls_rows_changed == 0) fail("the controls changed no row: the cases do not exercise them");
  using In = ControlsInputs;
  using C = ControlsCase;
  logit_controls_bad("parent after its child", [](In& in, const C& c) { in.parents[1 * c.N + 7] = 9; }, bad_path);
  logit_controls_bad("root with a parent", [](In& in, const C& c) { in.parents[2 * c.N] = 0; }, bad_path);
  logit_controls_bad("token outside the vocabulary", [](In& in, const C& c) {
    in.tokens[0 * c.N + 5] = static_cast<int32_t>(c.V);
  }, bad_path);
  const auto tree1 = [](const In&, const C&, int64_t b, int64_t) { return b == 1; };
  logit_controls_bad("history not ascending", [](In& in, const C& c) {
    std::swap(in.ids[1 * c.H + 130], in.ids[1 * c.H + 131]);  // past the first 128 threads
  }, tree1);
  logit_controls_bad("history id out of range", [](In& in, const C& c) {
    in.ids[1 * c.H + in.len[1] - 1] = static_cast<int32_t>(c.V);  // still ascending
  }, tree1);
  logit_controls_bad("negative history id", [](In& in, const C& c) { in.ids[1 * c.H] = -1; }, tree1);
  logit_controls_bad("negative history count", [](In& in, const C& c) { in.counts[1 * c.H + 3] = -1; }, tree1);
  logit_controls_bad("history_len > H", [](In& in, const C& c) { in.len[1] = static_cast<int32_t>(c.H + 1); }, tree1);
  logit_controls_bad("history_len < 0", [](In& in, const C&) { in.len[1] = -1; }, tree1);
  logit_controls_bad("negative suppress_below", [](In& in, const C&) { in.below[1] = -1; }, tree1);
  logit_controls_bad("suppressed token outside the vocabulary", [](In& in, const C& c) {
    in.suppress[1] = static_cast<int32_t>(c.V);
  }, [](const In&, const C&, int64_t, int64_t) { return true; });
}

// --- shared memory at each GPU class's limits ------------------------------------------------------
// On each emulated device (rheo_emu::kDevices: H100/H200, A100, Ada) in turn, every kernel that
// asks for shared memory runs at the edge of its admitted range (docs/kernels.md §7) and is
// refused one step past it: one line naming the sizes, the bytes and the device's limit, before
// anything launches. A launch needs its kernel's static bytes (nvcc's figures) plus its dynamic
// bytes, computed here from the layouts the .cu files state.

size_t walk_bytes(int64_t N, int64_t Se) {  // verification: WalkShared + ce, q, order, hash
  int bits = 5;
  while ((int64_t{1} << bits) < 2 * (N + Se)) ++bits;
  return 12112 + 12 * N + 8 * Se + (size_t{8} << bits);
}
size_t controls_bytes(int64_t N) { return 16 + 4 * N; }  // PathShared + the path's tokens
size_t attention_bytes(int64_t D) {  // q_t, v, p, k_t tiles (no static shared memory)
  return 4 * (101 * D + 2048 * ((D + 63) / 64) + 2176);
}
// The largest x in [lo, hi] with bytes(x) <= limit (bytes grows with x), or lo - 1.
int64_t largest_fitting(const std::function<size_t(int64_t)>& bytes, size_t limit, int64_t lo,
                        int64_t hi) {
  while (lo <= hi && bytes(hi) > limit) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (bytes(mid) > limit) hi = mid - 1;
    else lo = mid + 1;
  }
  return hi;
}

// `run` throws one rheo::ValueError line holding every word, and launches nothing.
void expect_refused(const std::string& what, const std::function<void()>& run,
                    const std::vector<std::string>& words) {
  ++cases;
  current_case = what;
  const uint64_t launches = rheo_emu::counters().launches;
  try {
    run();
    fail("accepted");
  } catch (const rheo::ValueError& e) {
    const std::string msg = e.what();
    if (msg.find('\n') != std::string::npos) fail("more than one line: " + msg);
    for (const std::string& w : words)
      if (msg.find(w) == std::string::npos) fail("no \"" + w + "\" in: " + msg);
  }
  if (rheo_emu::counters().launches != launches) fail("launched before refusing");
}

void refuse_verification(int64_t N, int64_t Se, size_t limit) {
  const VerifyCase c{1, N, Se + 50, Se, DType::kFloat32, rheo::VerifyMethod::kRheo, 1.0, 1.0, 0, Logits::kNormal};
  Rng rng(7);
  const VerifyInputs in = make_verify_inputs(c, rng);
  std::vector<double> workspace(c.B * c.V);
  VerifyOut o = verify_outputs(c, in.P);
  expect_refused("verification N=" + std::to_string(N) + " Se=" + std::to_string(Se) + " refused",
                 [&] { rheo::verification_cuda(verify_args(c, in, o, workspace.data()), nullptr); },
                 {"N=" + std::to_string(N), "Se=" + std::to_string(Se),
                  std::to_string(walk_bytes(N, Se)), std::to_string(limit)});
}

void refuse_controls(int64_t N, size_t limit) {
  const ControlsCase c{1, N, 29, 29, DType::kFloat32, 1.3, 0.0, 0.0, 3, 1, 1, false, 4};
  Rng rng(7);
  const ControlsInputs in = make_controls_inputs(c, rng);
  ControlsOut o{in.logits, {0}};
  expect_refused("logit_controls N=" + std::to_string(N) + " refused",
                 [&] { rheo::logit_controls_cuda(controls_args(c, in, o), nullptr); },
                 {"N=" + std::to_string(N), std::to_string(controls_bytes(N)), std::to_string(limit)});
}

void refuse_attention(int64_t D, size_t limit) {
  rheo::TreeAttentionArgs a;  // null buffers: nothing may launch
  a.B = 1, a.N = 6, a.H = 4, a.Hkv = 2, a.D = D, a.prefix_len = 10;
  expect_refused("tree_attention D=" + std::to_string(D) + " refused",
                 [&] { rheo::tree_attention_cuda(a, nullptr); },
                 {"D=" + std::to_string(D), std::to_string(attention_bytes(D)), std::to_string(limit)});
}

void launch_limits_tests() {
  uint64_t seed = 700;
  for (int dev = 0; dev < rheo_emu::kDeviceCount; ++dev) {
    const rheo_emu::DeviceModel& d = rheo_emu::kDevices[dev];
    cudaSetDevice(dev);
    std::printf("device %d %s: opt-in ceiling %zu bytes\n", dev, d.name, d.shared_optin);
    // Verification at N = 60, Se = 1024 (--support 1024): 12112 static + 41680 dynamic bytes,
    // over 48 KB only with the static part. The opt-in is set once per device and kernel.
    const uint64_t sets = rheo_emu::counters().attribute_sets;
    verification_case({1, 60, 1500, 1024, DType::kFloat32, rheo::VerifyMethod::kRheo, 1.0, 1.0, 0, Logits::kNormal}, ++seed);
    if (rheo_emu::counters().attribute_sets != sets + 1) fail("walk_kernel not opted in exactly once");
    verification_case({2, 60, 1500, 1024, DType::kFloat32, rheo::VerifyMethod::kRRSW, 0.8, 0.9, 0, Logits::kNormal}, ++seed);
    if (rheo_emu::counters().attribute_sets != sets + 1) fail("walk_kernel opted in again on the same device");
    // Verification's edge at N = 60: the largest support that fits, then one more.
    const int64_t Se = largest_fitting([](int64_t s) { return walk_bytes(60, s); }, d.shared_optin, 1, 20000);
    verification_case({1, 60, Se + 50, Se, DType::kBFloat16, rheo::VerifyMethod::kRheo, 1.0, 1.0, 0, Logits::kPeaked}, ++seed);
    refuse_verification(60, Se + 1, d.shared_optin);
    // Logit controls at N = 12288 (49168 bytes: over 48 KB) and at the device's edge.
    logit_controls_case({1, 12288, 29, 29, DType::kFloat32, 1.3, 0.2, 0.1, 3, 2, 1, false, 4}, ++seed);
    const int64_t N = largest_fitting(controls_bytes, d.shared_optin, 1, 1 << 20);
    if (!quick) logit_controls_case({1, N, 7, 7, DType::kFloat64, 1.2, 0.0, 0.3, 2, 1, 1, false, 8}, ++seed);
    refuse_controls(N + 1, d.shared_optin);
    // Tree attention: D <= 256 (its register tiles) where that fits, else the device's edge.
    const int64_t D = largest_fitting(attention_bytes, d.shared_optin, 1, 256);
    tree_attention_case(1, 6, 4, 2, D, 40, DType::kBFloat16, false, ++seed);
    if (D < 256) refuse_attention(D + 1, d.shared_optin);
    // The pool sampler: static shared memory only (1232 bytes), at its largest support.
    pool_case({2, 2100, 10, 1, 2048, 1.0, rheo::PoolKind::kRheo, DType::kFloat32, Logits::kNormal, false}, ++seed);
    std::printf("  verification N=60: Se <= %ld; logit controls N <= %ld; tree attention D <= %ld\n",
                long(Se), long(N), long(D));
  }
  cudaSetDevice(0);
}
}  // namespace

int main(int argc, char** argv) {
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--static-shared") {  // the .cu files' RHEO_STATIC_SHARED figures, for the nvcc test
      for (const auto& f : rheo_emu::static_shared_figures()) std::printf("%s %zu\n", f.kernel.c_str(), f.bytes);
      return 0;
    }
    if (arg == "--quick") quick = true;
    else if (arg == "--only" && i + 1 < argc) only = argv[++i];
    else if (arg == "--seeds" && i + 1 < argc) std::sscanf(argv[++i], "%lu,%lu", &seed_a, &seed_b);
    else {
      std::printf("usage: kernel_tests [--quick] [--only NAME] [--seeds A,B]\n");
      return 2;
    }
  }
  const std::pair<const char*, void (*)()> suites[] = {
      {"pool_sampler", pool_sampler_tests}, {"proxy_rerank", proxy_rerank_tests},
      {"tree_attention", tree_attention_tests}, {"skinny_linear", skinny_linear_tests},
      {"verification", verification_tests}, {"logit_controls", logit_controls_tests},
      {"launch_limits", launch_limits_tests},
      {"quant_linear", quant_linear_tests}, {"fused_ops", fused_ops_tests}};
  for (const auto& [name, fn] : suites) {
    if (!only.empty() && only != name) continue;
    const int before = failures, cases_before = cases;
    rheo_emu::reset_counters();
    fn();
    const auto c = rheo_emu::counters();
    std::printf("%-15s %3d cases  %s  (%lu launches, %lu blocks, %lu fiber switches)\n", name,
                cases - cases_before, failures == before ? "ok" : "FAILED",
                static_cast<unsigned long>(c.launches), static_cast<unsigned long>(c.blocks),
                static_cast<unsigned long>(c.switches));
  }
  if (verify_trees > 0) {
    std::printf("verification: %d of %d trees differ from the CPU (coin at a rounding boundary)\n",
                verify_mismatches, verify_trees);
    if (verify_mismatches * 200 > verify_trees) {
      std::printf("FAIL more than 1 in 200 trees differ\n");
      ++failures;
    }
  }
  std::printf("%s: %d cases, %d failures (schedules %lu and %lu)\n", failures ? "FAILED" : "ok",
              cases, failures, static_cast<unsigned long>(seed_a), static_cast<unsigned long>(seed_b));
  return failures ? 1 : 0;
}
