// Helpers shared by the CPU and CUDA kernels: host/device marker, errors, dtypes, Philox
// coins and the one tie rule (docs/algorithm.md §5). Kept in one header so that the CPU and CUDA
// versions cannot drift apart: both draw the same coins and rank nodes the same way.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define RHEO_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define RHEO_HOST_DEVICE inline
#endif

namespace rheo {

// ---------------------------------------------------------------------------------------------
// Errors. RHEO_CHECK throws rheo::ValueError (bad input; pybind11 maps it to Python ValueError).
// Messages name the value, the rule, what was received and the fix (docs/kernels.md §5).
// ---------------------------------------------------------------------------------------------
struct ValueError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
inline void append(std::ostringstream& os, const T& x, const Rest&... rest) {
  os << x;
  append(os, rest...);
}
}  // namespace detail

template <typename... Args>
[[noreturn]] inline void fail(const Args&... args) {
  std::ostringstream os;
  detail::append(os, args...);
  throw ValueError(os.str());
}

#define RHEO_CHECK(cond, ...)        \
  do {                               \
    if (!(cond)) ::rheo::fail(__VA_ARGS__); \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Status bits: how a CUDA kernel reports bad input without a host sync. The CPU kernels raise;
// a CUDA kernel that finds bad input ORs a bit into *status (a [1] int32 device word the caller
// passes, or null), writes outputs that stay in range (so the step's later kernels never index
// out of bounds) and goes on. The host reads the word once per step, with the step's results, and
// raises the CPU kernel's error for the bit (rheo_engine.kernels.raise_status).
// ---------------------------------------------------------------------------------------------
enum StatusBit : int32_t {
  kStatusNonFiniteDraft = 1,   // pool sampler: a NaN/inf draft logit (row gets no Y, finite junk)
  kStatusBadForced = 2,        // pool sampler: a forced token that cannot be Y
  kStatusNanScore = 4,         // select_expand / build_tree: a NaN path score
  kStatusBadTree = 8,          // build_tree: parents, ancestor closure, depth or prefix_len
  kStatusNonFiniteTarget = 16, // verification: a NaN/inf target logit at a visited node
  kStatusBadVerifyInput = 32,  // verification: the tree or the q~ table breaks its rules
  kStatusBadControls = 64,     // logit controls: the tree or the history breaks its rules
};

// Element type of a logits / activation buffer. kFloat64 exists for the exact (float64) tests.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// ---------------------------------------------------------------------------------------------
// CPU dispatch level (csrc/cpu/cpu_isa.cpp): which copy of the CPU hot loops runs (AVX-512, AVX2
// or the x86-64 baseline). Every copy computes the same bits (csrc/cpu/cpu_math.h says how), so
// the level changes speed only; tests force each level to check that.
// ---------------------------------------------------------------------------------------------
namespace cpu {
enum class Isa : int32_t { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };
// The CPU's best level, or RHEO_CPU_ISA (default | avx2 | avx512, read once) lowered to it, as
// torch's ATEN_CPU_CAPABILITY. An unknown RHEO_CPU_ISA raises ValueError on the first call.
Isa active_isa();
Isa set_active_isa(Isa level);  // for tests: lowered to the CPU's best; returns the level now set
Isa parse_isa(const std::string& name, const char* what);  // ValueError naming `what` if unknown
const char* isa_name(Isa level);                            // "default", "avx2", "avx512"
}  // namespace cpu

// ---------------------------------------------------------------------------------------------
// Randomness: Philox-4x32-10 (Salmon et al., SC'11), counter-based, so every coin is a pure
// function of (seed, step, stream, index) and CPU and CUDA draw identical coins.
//   key     = seed (64 bit)
//   counter = {step lo, step hi, stream word, index}
// Stream words (the caller never builds them by hand; use the helpers below):
//   pool sampler:  kStreamPool   + level,  index = row            (one coin per row: Y)
//   verification:  kStreamVerify + slot,   index = b * N + node   (slot = child test j, or
//                  kResidualSlot for the final draw from the residual)
// ---------------------------------------------------------------------------------------------
constexpr uint32_t kStreamPool = 0x10000000u;
constexpr uint32_t kStreamVerify = 0x20000000u;
constexpr uint32_t kResidualSlot = 0xFFFFu;

struct Philox4 {
  uint32_t x[4];
};

RHEO_HOST_DEVICE uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
}

RHEO_HOST_DEVICE Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(kMul0, ctr.x[0], &hi0);
    const uint32_t lo1 = mulhilo32(kMul1, ctr.x[2], &hi1);
    Philox4 next;
    next.x[0] = hi1 ^ ctr.x[1] ^ k0;
    next.x[1] = lo1;
    next.x[2] = hi0 ^ ctr.x[3] ^ k1;
    next.x[3] = lo0;
    ctr = next;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return ctr;
}

// A uniform double in [0, 1) with 53 random bits, for (seed, step, stream, index).
RHEO_HOST_DEVICE double philox_uniform(uint64_t seed, uint64_t step, uint32_t stream,
                                       uint32_t index) {
  Philox4 ctr;
  ctr.x[0] = static_cast<uint32_t>(step);
  ctr.x[1] = static_cast<uint32_t>(step >> 32);
  ctr.x[2] = stream;
  ctr.x[3] = index;
  const Philox4 out =
      philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t hi27 = out.x[0] >> 5, lo26 = out.x[1] >> 6;
  return static_cast<double>(hi27 * 67108864ull + lo26) * (1.0 / 9007199254740992.0);
}

// The Philox key (seed, step) of a kernel's coins: read from `key` [2] int64 (the kernel's own
// memory, device memory on CUDA) when given, so that a captured CUDA graph replays every step
// with that step's coins (the host or a captured op writes the step there); else the scalars.
// A seed >= 2^63 is stored as its int64 bit pattern.
struct CoinKey {
  uint64_t seed, step;
};
RHEO_HOST_DEVICE CoinKey coin_key(const int64_t* key, uint64_t seed, uint64_t step) {
  return key != nullptr ? CoinKey{static_cast<uint64_t>(key[0]), static_cast<uint64_t>(key[1])}
                        : CoinKey{seed, step};
}

// The coin that draws the sampled token Y of pool row `row` at draft level `level`.
RHEO_HOST_DEVICE double pool_coin(uint64_t seed, uint64_t step, uint32_t level, uint32_t row) {
  return philox_uniform(seed, step, kStreamPool + level, row);
}

// The coin for test `slot` (0-based position in the verification order of the node's children,
// or kResidualSlot for the final draw) at tree node `node` of batch entry `b`.
RHEO_HOST_DEVICE double verify_coin(uint64_t seed, uint64_t step, uint32_t b, uint32_t n_nodes,
                                    uint32_t node, uint32_t slot) {
  return philox_uniform(seed, step, kStreamVerify + slot, b * n_nodes + node);
}

// ---------------------------------------------------------------------------------------------
// The tie rule, one everywhere (docs/algorithm.md §5): higher score first; on equal scores the
// lower flat index first. Candidates are numbered in EAGLE's flat order (level by level; inside a
// level, parent rank * K + slot), so "lower flat index" = shallower depth, then better parent
// rank, then earlier slot (leads, sampled slot, fills). This keeps the pruned tree ancestor-
// closed (paper app. C.1) and the sampled slot ahead of a fill tying with its proxy (Lemma 4).
// Scores are float32 sums of log proxies; -inf is a legal score, NaN is rejected upstream.
// ---------------------------------------------------------------------------------------------
RHEO_HOST_DEVICE bool ranks_before(float score_a, int32_t flat_a, float score_b, int32_t flat_b) {
  return score_a > score_b || (score_a == score_b && flat_a < flat_b);
}

}  // namespace rheo
