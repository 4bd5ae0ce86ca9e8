// Fused layer operators on the CPU (csrc/include/rheo/fused_ops.h): RMSNorm with the residual
// add, RoPE on q and k, SiLU(gate) * up. One row at a time, in the header's order.
//
// The two ops whose bits depend on how they are computed, the norm (a sum) and SiLU (exp by fused
// multiply-adds), run as one always_inline body on 16-lane vectors compiled three times: for
// AVX-512 + FMA, AVX2 + FMA and the x86-64 baseline, picked by cpu::active_isa() (RHEO_CPU_ISA).
// Not cpu_math.h's RHEO_ISA_COPIES, whose AVX2 copy has no FMA: SLEEF's exp needs a real fused
// multiply-add in every copy (the baseline copy calls fmaf, one lane at a time, correctly rounded
// as the instruction is), so the three give the same bits. The sources build with
// -ffp-contract=off, so no other a * b + c is fused anywhere. The last hidden % 16 (I % 16)
// elements of a row run through the scalar helpers of the header, which the CUDA twins use too.
// RoPE has no sum and no FMA: plain loops, the same bits however the compiler vectorises them.
#include "rheo/fused_ops.h"

#include <cmath>
#include <cstring>

#include "cpu_math.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace rheo {
namespace {

using cpu::bf16_to_float;
using cpu::Float16;
using cpu::float_to_bf16;
using cpu::Half16;
using cpu::Int16;
using cpu::kLanes;
using cpu::Uint16x32;
typedef double Double16 __attribute__((vector_size(128)));  // 16 x double

// --- element access: float32 rows as they are, bf16 rows widened (exact) and rounded back ----

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_to_float(v); }
inline void store1(float* dst, float v) { *dst = v; }
inline void store1(uint16_t* dst, float v) { *dst = float_to_bf16(v); }
// v rounded to the element type and widened back: what a torch op in that dtype leaves.
inline float rounded(float v, const float*) { return v; }
inline float rounded(float v, const uint16_t*) { return bf16_to_float(float_to_bf16(v)); }

RHEO_ALWAYS_INLINE Float16 load16(const float* p) { return cpu::F32Row::load16(p); }
RHEO_ALWAYS_INLINE Float16 load16(const uint16_t* p) { return cpu::Bf16Row::load16(p); }

// Nearest-even bf16 bits of 16 floats (NaN kept a quiet NaN), as cpu::float_to_bf16.
RHEO_ALWAYS_INLINE Uint16x32 bf16_bits16(const Float16& f) {
  const Uint16x32 x = (Uint16x32)f;
  const Uint16x32 nearest = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  return (x & 0x7FFFFFFFu) > 0x7F800000u ? (x >> 16) | 0x40u : nearest;
}
RHEO_ALWAYS_INLINE void store16(float* p, const Float16& v) { std::memcpy(p, &v, sizeof v); }
RHEO_ALWAYS_INLINE void store16(uint16_t* p, const Float16& v) {
  const Half16 h = __builtin_convertvector(bf16_bits16(v), Half16);
  std::memcpy(p, &h, sizeof h);
}
RHEO_ALWAYS_INLINE Float16 rounded16(const Float16& v, const float*) { return v; }
RHEO_ALWAYS_INLINE Float16 rounded16(const Float16& v, const uint16_t*) {
  return (Float16)(bf16_bits16(v) << 16);
}

RHEO_ALWAYS_INLINE Float16 splat(float v) { return Float16{} + v; }

// a * b + c rounded once, lane by lane (one vfmadd in the FMA copies, fmaf in the baseline).
RHEO_ALWAYS_INLINE Float16 fma16(const Float16& a, const Float16& b, const Float16& c) {
  Float16 r;
#pragma GCC unroll 16
  for (int j = 0; j < kLanes; ++j) r[j] = __builtin_fmaf(a[j], b[j], c[j]);
  return r;
}

// Order keys of floats (cpu_math.h order_key16): vector compares of floats would be split into
// scalar compares (-ftrapping-math), integer compares stay vectors.
RHEO_ALWAYS_INLINE Int16 key16(const Float16& v) { return cpu::order_key16(v); }

// sleef_expf (fused_ops.h) on 16 lanes, the same operations in the same order.
RHEO_ALWAYS_INLINE Float16 sleef_exp16(const Float16& d) {
  const Float16 t = d * 1.442695040888963407359924681001892137426645954152985934135449406931f;
  const Int16 bits = (Int16)t, key = key16(t);
  Float16 tc = key > cpu::order_key(256.0f) ? splat(256.0f) : t;
  tc = key < cpu::order_key(-256.0f) ? splat(-256.0f) : tc;
  tc = (bits & 0x7FFFFFFF) > 0x7F800000 ? Float16{} : tc;  // NaN
  const Float16 qf = (tc + 12582912.0f) - 12582912.0f;
  const Int16 q = __builtin_convertvector(qf, Int16);
  Float16 s = fma16(qf, splat(-0.693145751953125f), d);
  s = fma16(qf, splat(-1.428606765330187045e-06f), s);
  Float16 u = splat(0.000198527617612853646278381f);
  u = fma16(u, s, splat(0.00139304355252534151077271f));
  u = fma16(u, s, splat(0.00833336077630519866943359f));
  u = fma16(u, s, splat(0.0416664853692054748535156f));
  u = fma16(u, s, splat(0.166666671633720397949219f));
  u = fma16(u, s, splat(0.5f));
  u = 1.0f + fma16(s * s, u, s);
  const Int16 half = q >> 1;
  u = (u * (Float16)((Uint16x32)(half + 127) << 23)) * (Float16)((Uint16x32)(q - half + 127) << 23);
  const Int16 dbits = (Int16)d, dkey = key16(d);
  const Int16 is_nan = (dbits & 0x7FFFFFFF) > 0x7F800000 ? Int16{} + 1 : Int16{};
  u = (dkey < cpu::order_key(-104.0f)) & (is_nan == 0) ? Float16{} : u;
  u = (dkey > cpu::order_key(100.0f)) & (is_nan == 0) ? splat(INFINITY) : u;
  return u;
}

// --- add_rms_norm ----------------------------------------------------------------------------

template <typename Elem>
RHEO_ALWAYS_INLINE void add_rms_norm_body(const AddRmsNormArgs& a) {
  const Elem* weight = static_cast<const Elem*>(a.weight);  // [hidden]
  const int64_t hidden = a.hidden, full = hidden - hidden % kLanes;
  for (int64_t row = a.row_begin; row < a.row_end; ++row) {
    const Elem* x = static_cast<const Elem*>(a.x) + row * a.x_stride;  // [hidden]
    const Elem* delta =
        a.delta ? static_cast<const Elem*>(a.delta) + row * a.delta_stride : nullptr;
    Elem* normed = static_cast<Elem*>(a.normed_out) + row * hidden;  // [hidden]
    // Step 1: r = round(x + delta), written out; its squares summed per lane c % 32 in double.
    const Elem* r = x;  // [hidden] the residual the norm reads
    if (delta) {
      Elem* out = static_cast<Elem*>(a.residual_out) + row * hidden;
      for (int64_t c = 0; c < full; c += kLanes)
        store16(out + c, load16(x + c) + load16(delta + c));
      for (int64_t c = full; c < hidden; ++c) store1(out + c, to_float(x[c]) + to_float(delta[c]));
      r = out;
    }
    Double16 acc[2] = {};  // lanes 0..15 and 16..31
    for (int64_t c = 0; c < full; c += kLanes) {
      const Double16 v = __builtin_convertvector(load16(r + c), Double16);
      acc[(c / kLanes) % 2] += v * v;
    }
    double lane[kNormLanes];
    std::memcpy(lane, &acc[0], sizeof acc[0]);
    std::memcpy(lane + kLanes, &acc[1], sizeof acc[1]);
    for (int64_t c = full; c < hidden; ++c) {
      const double v = to_float(r[c]);
      lane[c % kNormLanes] += v * v;
    }
    for (int o = kNormLanes / 2; o > 0; o /= 2)
      for (int t = 0; t < o; ++t) lane[t] += lane[t + o];
    const float var = static_cast<float>(lane[0] / static_cast<double>(hidden));
    const float inv = 1.0f / std::sqrt(var + a.eps);
    // Step 2: normed = round(weight * round(r * inv)).
    for (int64_t c = 0; c < full; c += kLanes)
      store16(normed + c, load16(weight + c) * rounded16(load16(r + c) * inv, r));
    for (int64_t c = full; c < hidden; ++c)
      store1(normed + c, to_float(weight[c]) * rounded(to_float(r[c]) * inv, r));
  }
}

// --- silu_mul --------------------------------------------------------------------------------

template <typename Elem>
RHEO_ALWAYS_INLINE void silu_mul_body(const SiluMulArgs& a) {
  const int64_t I = a.I, full = I - I % kLanes;
  for (int64_t row = a.row_begin; row < a.row_end; ++row) {
    const Elem* gate = static_cast<const Elem*>(a.gate_up) + row * a.gu_stride;  // [I]
    const Elem* up = gate + I;                                                    // [I]
    Elem* out = static_cast<Elem*>(a.out) + row * I;                              // [I]
    for (int64_t c = 0; c < full; c += kLanes) {
      const Float16 g = load16(gate + c);
      const Float16 silu = g / (1.0f + sleef_exp16(-g));
      store16(out + c, rounded16(silu, gate) * load16(up + c));
    }
    for (int64_t c = full; c < I; ++c)
      store1(out + c, rounded(silu_float(to_float(gate[c])), gate) * to_float(up[c]));
  }
}

// The three copies of a body and their dispatcher (see the top of the file).
#if defined(__GNUC__) && defined(__x86_64__)
#define RHEO_FUSED_COPIES(name, body, Args)                                                   \
  template <typename Elem>                                                                    \
  __attribute__((target("avx512f,fma"))) void name##_avx512(const Args& a) { body<Elem>(a); } \
  template <typename Elem>                                                                    \
  __attribute__((target("avx2,fma"))) void name##_avx2(const Args& a) { body<Elem>(a); }      \
  template <typename Elem>                                                                    \
  void name##_default(const Args& a) { body<Elem>(a); }                                       \
  template <typename Elem>                                                                    \
  void name(const Args& a) {                                                                  \
    static const bool has_fma = __builtin_cpu_supports("fma");                                \
    const cpu::Isa level = cpu::active_isa();                                                 \
    if (level == cpu::Isa::kAvx512) return name##_avx512<Elem>(a);                            \
    if (level == cpu::Isa::kAvx2 && has_fma) return name##_avx2<Elem>(a);                     \
    name##_default<Elem>(a);                                                                  \
  }
#else
#define RHEO_FUSED_COPIES(name, body, Args) \
  template <typename Elem>                  \
  void name(const Args& a) { body<Elem>(a); }
#endif

RHEO_FUSED_COPIES(add_rms_norm_rows, add_rms_norm_body, AddRmsNormArgs)
RHEO_FUSED_COPIES(silu_mul_rows, silu_mul_body, SiluMulArgs)

// --- rope_qk ---------------------------------------------------------------------------------

template <typename Elem>
void rope_qk_rows(const RopeQkArgs& a) {
  const int64_t D = a.D, half = D / 2;
  for (int64_t row = a.row_begin; row < a.row_end; ++row) {
    const Elem* qkv = static_cast<const Elem*>(a.qkv) + row * a.qkv_stride;  // [(H + 2Hkv) D]
    const Elem* cos = static_cast<const Elem*>(a.cos) + row * half;           // [D / 2]
    const Elem* sin = static_cast<const Elem*>(a.sin) + row * half;           // [D / 2]
    for (int64_t h = 0; h < a.H + a.Hkv; ++h) {
      const Elem* x = qkv + h * D;  // [D] head h: a q head, then the k heads
      Elem* out = h < a.H ? static_cast<Elem*>(a.q_out) + (row * a.H + h) * D
                          : static_cast<Elem*>(a.k_out) + (row * a.Hkv + h - a.H) * D;
      for (int64_t c = 0; c < half; ++c) {
        const float lo = to_float(x[c]), hi = to_float(x[c + half]);
        const float cs = to_float(cos[c]), sn = to_float(sin[c]);
        // HF: q * cos + rotate_half(q) * sin, rotate_half(q) = cat(-q[D/2:], q[:D/2]).
        store1(out + c, rounded(lo * cs, x) + rounded(-hi * sn, x));
        store1(out + c + half, rounded(hi * cs, x) + rounded(lo * sn, x));
      }
    }
  }
}

template <typename Args>
void check_rows(const Args& a, const char* what) {
  RHEO_CHECK(0 <= a.row_begin && a.row_begin <= a.row_end && a.row_end <= a.rows, what,
             " needs 0 <= row_begin <= row_end <= rows=", a.rows, ", got [", a.row_begin, ", ",
             a.row_end, ")");
}

}  // namespace

void add_rms_norm_cpu(const AddRmsNormArgs& a) {
  RHEO_CHECK(a.rows >= 0 && a.hidden > 0, "add_rms_norm needs rows >= 0 and hidden > 0, got rows=",
             a.rows, ", hidden=", a.hidden);
  RHEO_CHECK(a.x_stride >= a.hidden && (a.delta == nullptr || a.delta_stride >= a.hidden),
             "add_rms_norm needs row strides >= hidden=", a.hidden, ", got x_stride=", a.x_stride,
             ", delta_stride=", a.delta_stride);
  RHEO_CHECK(a.eps >= 0.0f, "add_rms_norm needs eps >= 0, got ", a.eps);
  check_rows(a, "add_rms_norm");
  switch (a.dtype) {
    case DType::kBFloat16: return add_rms_norm_rows<uint16_t>(a);
    case DType::kFloat32: return add_rms_norm_rows<float>(a);
    default: fail("add_rms_norm takes bfloat16 or float32; convert the inputs");
  }
}

void rope_qk_cpu(const RopeQkArgs& a) {
  RHEO_CHECK(a.rows >= 0 && a.H >= 0 && a.Hkv >= 0 && a.D > 0 && a.D % 2 == 0,
             "rope_qk needs rows, H, Hkv >= 0 and an even D > 0, got rows=", a.rows, ", H=", a.H,
             ", Hkv=", a.Hkv, ", D=", a.D);
  RHEO_CHECK(a.qkv_stride >= (a.H + 2 * a.Hkv) * a.D, "rope_qk needs qkv_stride >= (H + 2 Hkv) D=",
             (a.H + 2 * a.Hkv) * a.D, ", got ", a.qkv_stride);
  check_rows(a, "rope_qk");
  switch (a.dtype) {
    case DType::kBFloat16: return rope_qk_rows<uint16_t>(a);
    case DType::kFloat32: return rope_qk_rows<float>(a);
    default: fail("rope_qk takes bfloat16 or float32; convert the inputs");
  }
}

void silu_mul_cpu(const SiluMulArgs& a) {
  RHEO_CHECK(a.rows >= 0 && a.I >= 0, "silu_mul needs rows, I >= 0, got rows=", a.rows, ", I=",
             a.I);
  RHEO_CHECK(a.gu_stride >= 2 * a.I, "silu_mul needs gu_stride >= 2 I=", 2 * a.I, ", got ",
             a.gu_stride);
  check_rows(a, "silu_mul");
  switch (a.dtype) {
    case DType::kBFloat16: return silu_mul_rows<uint16_t>(a);
    case DType::kFloat32: return silu_mul_rows<float>(a);
    default: fail("silu_mul takes bfloat16 or float32; convert the inputs");
  }
}

}  // namespace rheo

#pragma GCC diagnostic pop
