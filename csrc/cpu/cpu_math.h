// Numerics shared by the CPU kernels (not part of any kernel contract; torch-free C++17 plus the
// GCC/Clang vector extension): fp16/bf16 <-> float conversions, scalar and 16-lane, and the two
// branch-free exponentials (float for the fp32/bf16/fp16 paths, double for the exact fp64 path).
//
// The build passes no -march: each hot loop that uses these helpers is one always_inline body
// compiled three times by RHEO_ISA_COPIES (AVX-512, AVX2, baseline), and a dispatcher runs the copy
// of cpu::active_isa() (rheo/common.h: the CPU's best, or RHEO_CPU_ISA). The helpers are
// always_inline so each copy gets its own vector code. They are written on vector types because
// GCC will not if-convert scalar selects around a trapping op (-ftrapping-math).
//
// Every copy gives the same bits, so results do not depend on the CPU. The sources build with
// -ffp-contract=off (setup.py, CMakeLists.txt): GCC's default fuses a * b + c into one FMA where
// the target has FMA (the AVX-512 copy), and GCC 12 did so in the 8-lane body and the scalar tail
// of exp_nonpositive's loop but not in its 4-lane vector epilogue, so tied logits got p one ulp
// apart. Uncontracted, every lane and the tail do the same IEEE operations in the same order
// (and nothing reassociates: never build with -ffast-math).
// std::exp in scalar code is glibc's, which picks its own FMA variant by CPU: the same at every
// level on one machine and on any two CPUs with FMA, not always between a CPU with and one without.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "rheo/common.h"

// The 16-lane helpers pass vectors by value but are always inlined, so no call ever uses the
// vector ABI that GCC warns about when AVX-512 is not enabled for the whole file.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace rheo {
namespace cpu {

#define RHEO_ALWAYS_INLINE __attribute__((always_inline)) inline

// RHEO_ISA_COPIES(ret, name, body, (params), (args)) defines `ret name(params)`, which runs
// `body(args)` (an always_inline function) in its copy for the active level: name_avx512,
// name_avx2 or name_default. Explicit copies and not GCC's target_clones, whose ifunc picks a
// clone once at load time: RHEO_CPU_ISA and the tests could not reach the others.
#if defined(__GNUC__) && defined(__x86_64__)
#define RHEO_ISA_COPIES(ret, name, body, params, args)                                \
  __attribute__((target("avx512f"))) ret name##_avx512 params { return body args; } \
  __attribute__((target("avx2"))) ret name##_avx2 params { return body args; }      \
  ret name##_default params { return body args; }                                   \
  ret name params {                                                                 \
    switch (::rheo::cpu::active_isa()) {                                            \
      case ::rheo::cpu::Isa::kAvx512: return name##_avx512 args;                    \
      case ::rheo::cpu::Isa::kAvx2: return name##_avx2 args;                        \
      default: return name##_default args;                                          \
    }                                                                               \
  }
#else
#define RHEO_ISA_COPIES(ret, name, body, params, args) \
  ret name params { return body args; }
#endif

// 16 lanes: one AVX-512 register, two AVX2 or four SSE registers.
constexpr int kLanes = 16;
typedef float Float16 __attribute__((vector_size(64)));
typedef int32_t Int16 __attribute__((vector_size(64)));
typedef uint32_t Uint16x32 __attribute__((vector_size(64)));  // 16 x uint32
typedef uint16_t Half16 __attribute__((vector_size(32)));     // 16 x raw fp16 / bf16 bits

// ---------------------------------------------------------------------------------------------
// Scalar conversions (IEEE binary16 and bfloat16 <-> float32; to-16-bit rounds to nearest even).
// ---------------------------------------------------------------------------------------------
inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));  // rebias 15 -> 127
}

inline float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_half(float f) {
  const uint32_t x = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (ax >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                        // below 2^-14: subnormal half, units of 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(bits_to_float(ax) * 16777216.0f));
  }
  uint32_t h = (ax - 0x38000000u) >> 13;  // rebias 127 -> 15, keep 10 mantissa bits
  const uint32_t rest = ax & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry bumps the exponent: right
  return sign | static_cast<uint16_t>(h);
}

inline uint16_t float_to_bf16(float f) {
  const uint32_t x = float_to_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------------------------------------
// Row readers: a logits row of float32, bfloat16 or float16 read as float, 16 lanes at a time
// (fp16 / bf16 converted on the fly, exact, equal lane by lane to the scalar converters) or one
// element at a time (tails and rare paths). Elem is the stored element type.
// ---------------------------------------------------------------------------------------------
struct F32Row {
  using Elem = float;
  RHEO_ALWAYS_INLINE static Float16 load16(const float* src) {
    Float16 v;
    std::memcpy(&v, src, sizeof v);
    return v;
  }
  RHEO_ALWAYS_INLINE static float load1(const float* src, int64_t i) { return src[i]; }
};

struct Bf16Row {
  using Elem = uint16_t;
  RHEO_ALWAYS_INLINE static Float16 load16(const uint16_t* src) {
    Half16 h;
    std::memcpy(&h, src, sizeof h);
    return (Float16)(__builtin_convertvector(h, Uint16x32) << 16);
  }
  RHEO_ALWAYS_INLINE static float load1(const uint16_t* src, int64_t i) {
    return bf16_to_float(src[i]);
  }
};

struct F16Row {
  using Elem = uint16_t;
  // Exponent and mantissa shifted into place and rebiased (15 -> 127); inf / NaN get the float
  // exponent 255; zero and subnormals come out as 2^-14 * (1 + mantissa / 2^10) - 2^-14, exact.
  RHEO_ALWAYS_INLINE static Float16 load16(const uint16_t* src) {
    Half16 h;
    std::memcpy(&h, src, sizeof h);
    const Uint16x32 u = __builtin_convertvector(h, Uint16x32);
    const Uint16x32 shifted = (u & 0x7FFFu) << 13;
    const Uint16x32 exponent = shifted & (0x7C00u << 13);
    Uint16x32 bits = shifted + (112u << 23);
    bits = exponent == (0x7C00u << 13) ? bits + (112u << 23) : bits;
    const Float16 small = (Float16)(bits + (1u << 23)) - 6.103515625e-05f;  // 2^-14
    const Float16 f = exponent == 0u ? small : (Float16)bits;
    return (Float16)((Uint16x32)f | ((u & 0x8000u) << 16));
  }
  RHEO_ALWAYS_INLINE static float load1(const uint16_t* src, int64_t i) {
    return half_to_float(src[i]);
  }
};

// Masks. A vector compare must feed a select directly: used as a value (an integer vector of
// -1 / 0) GCC 12 cannot materialise it in the AVX-512 clone and splits it into scalar compares.
RHEO_ALWAYS_INLINE Int16 ones_where_non_finite(const Float16& v) {  // 1 on NaN / +-inf lanes
  return ((Uint16x32)v & 0x7F800000u) == 0x7F800000u ? Int16{} + 1 : Int16{};
}

// True when any lane of `x` (a vector of 0 / 1 or other non-negative flags) is non-zero; the
// halves are folded as vectors, so only the last 4 lanes are read one by one.
RHEO_ALWAYS_INLINE bool any16(const Int16& x) {
  typedef int32_t Int8 __attribute__((vector_size(32)));
  typedef int32_t Int4 __attribute__((vector_size(16)));
  Int8 lo8, hi8;
  std::memcpy(&lo8, &x, sizeof lo8);
  std::memcpy(&hi8, reinterpret_cast<const char*>(&x) + sizeof lo8, sizeof hi8);
  const Int8 x8 = lo8 | hi8;
  Int4 lo4, hi4;
  std::memcpy(&lo4, &x8, sizeof lo4);
  std::memcpy(&hi4, reinterpret_cast<const char*>(&x8) + sizeof lo4, sizeof hi4);
  const Int4 x4 = lo4 | hi4;
  return (x4[0] | x4[1] | x4[2] | x4[3]) != 0;
}

// ---------------------------------------------------------------------------------------------
// Compares on the bits. A float vector compare is split into scalar compares under GCC's
// default -ftrapping-math, so the hot loops order floats through integer keys instead: the key
// is monotone in the float order (finite values; -0.0 ranks just below +0.0, which only matters
// where a caller says so).
// ---------------------------------------------------------------------------------------------
RHEO_ALWAYS_INLINE Int16 order_key16(const Float16& v) {
  const Int16 bits = (Int16)v;
  return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

inline int32_t order_key(float f) {
  const int32_t bits = static_cast<int32_t>(float_to_bits(f));
  return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

inline float key_to_float(int32_t key) {  // the inverse of order_key
  return bits_to_float(static_cast<uint32_t>(key ^ ((key >> 31) & 0x7FFFFFFF)));
}

// The largest lane of an integer vector (halves folded as vectors).
RHEO_ALWAYS_INLINE int32_t max16(const Int16& x) {
  typedef int32_t Int8 __attribute__((vector_size(32)));
  typedef int32_t Int4 __attribute__((vector_size(16)));
  Int8 lo8, hi8;
  std::memcpy(&lo8, &x, sizeof lo8);
  std::memcpy(&hi8, reinterpret_cast<const char*>(&x) + sizeof lo8, sizeof hi8);
  const Int8 x8 = lo8 > hi8 ? lo8 : hi8;
  Int4 lo4, hi4;
  std::memcpy(&lo4, &x8, sizeof lo4);
  std::memcpy(&hi4, reinterpret_cast<const char*>(&x8) + sizeof lo4, sizeof hi4);
  const Int4 x4 = lo4 > hi4 ? lo4 : hi4;
  const int32_t a = x4[0] > x4[1] ? x4[0] : x4[1], b = x4[2] > x4[3] ? x4[2] : x4[3];
  return a > b ? a : b;
}

// exp(x) for 16 floats x <= 0 (also -0.0): x = n ln2 + r, |r| <= ln2/2, degree-7 Taylor
// polynomial (max rel. error about 2e-7), 2^n through the exponent bits; exp(x < -87) = 0.
// For x <= 0 a larger unsigned bit pattern is a more negative x, which gives the clamp.
RHEO_ALWAYS_INLINE Float16 exp16(const Float16& x) {
  constexpr uint32_t kFloorBits = 0xC2AE0000u;  // -87.0f
  const Float16 xc = (Uint16x32)x <= kFloorBits ? x : Float16{} - 87.0f;
  const Float16 n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest
  const Float16 r = (xc - n * 0.693145752f) - n * 1.42860677e-6f;
  Float16 p = Float16{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Int16 bits = (__builtin_convertvector(n, Int16) + 127) << 23;
  return (Uint16x32)x <= kFloorBits ? p * (Float16)bits : Float16{};
}

// exp(d) for d <= 0 in double to ~1 ulp, branch-free so loops over it vectorise (glibc's scalar
// exp was the bottleneck at V = 128k). Cody-Waite reduction d = k ln2 + r, |r| <= ln2 / 2,
// degree-13 Taylor polynomial; 2^k is applied as 2^(k + 512) * 2^-512 so subnormals round once.
RHEO_ALWAYS_INLINE double exp_nonpositive(double d) {
  constexpr double kLog2e = 1.4426950408889634, kLn2Hi = 0.6931471803691238,
                   kLn2Lo = 1.9082149292705877e-10, kRound = 6755399441055744.0;  // 1.5 * 2^52
  // Clamp d at -800 (exp underflows to 0 below there) on the bits: for d <= 0 a larger unsigned
  // pattern is a more negative d; a float compare would keep the loop scalar (-ftrapping-math).
  constexpr uint64_t kFloorBits = 0xC089000000000000ull;  // -800.0
  uint64_t d_bits;
  std::memcpy(&d_bits, &d, sizeof(d));
  d_bits = d_bits < kFloorBits ? d_bits : kFloorBits;
  double dc;
  std::memcpy(&dc, &d_bits, sizeof(dc));
  const double t = dc * kLog2e + kRound;  // k = round(dc / ln2) sits in the low mantissa bits
  const double kd = t - kRound;
  const double r = (dc - kd * kLn2Hi) - kd * kLn2Lo;
  double poly = 1.0 / 6227020800.0;  // Horner over 1/13!, 1/12!, ..., 1/1!, 1/0!
  poly = poly * r + 1.0 / 479001600.0;
  poly = poly * r + 1.0 / 39916800.0;
  poly = poly * r + 1.0 / 3628800.0;
  poly = poly * r + 1.0 / 362880.0;
  poly = poly * r + 1.0 / 40320.0;
  poly = poly * r + 1.0 / 5040.0;
  poly = poly * r + 1.0 / 720.0;
  poly = poly * r + 1.0 / 120.0;
  poly = poly * r + 1.0 / 24.0;
  poly = poly * r + 1.0 / 6.0;
  poly = poly * r + 0.5;
  poly = poly * r + 1.0;
  poly = poly * r + 1.0;
  uint64_t t_bits, round_bits;
  std::memcpy(&t_bits, &t, sizeof(t));
  std::memcpy(&round_bits, &kRound, sizeof(kRound));
  const uint64_t scale_bits = (t_bits - round_bits + 512 + 1023) << 52;  // 2^(k + 512)
  double scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  return poly * scale * 0x1p-512;  // one rounding, also for subnormal results
}

// Weights a decode step streams from memory once (a few x rows against a whole matrix): the
// hardware prefetcher follows a tile's few row streams only a few lines ahead, so a matrix that
// a step's other work had evicted (the target's, after sampling, bookkeeping and the draft
// levels) was read at a fraction of the memory's bandwidth: the default pair's bf16 forward
// right after a step's host work took ~2x its time run back to back (BENCHMARKS.md, "Issue 39,
// fourteenth session"). The skinny kernel asks for a matrix's first kPrefetchBytes when a call
// starts, and for each block of rows kPrefetchBytes ahead of the block it computes. A hint: it
// never faults (past a matrix's end it reads nothing) and changes no result.
constexpr int64_t kPrefetchBytes = 16384;

// Every 64-byte line of ``bytes`` at p asked for at once: they come in parallel, not one
// demand miss after another.
RHEO_ALWAYS_INLINE void prefetch_range(const void* p, int64_t bytes) {
  const char* at = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(at + i, 0, 3);
}

}  // namespace cpu
}  // namespace rheo

#pragma GCC diagnostic pop
