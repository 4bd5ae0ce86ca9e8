// __half and __nv_bfloat16 for the CPU emulator: 16-bit storage types with the CUDA conversion
// functions the sources use. float -> 16 bit rounds to nearest even (NaN stays NaN, overflow
// goes to inf); 16 bit -> float is exact. Binary layout matches the device types, so buffers
// written by the CPU kernels (c10::Half / c10::BFloat16, uint16_t) are read bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};

namespace rheo_emu::detail {
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace rheo_emu::detail

inline float __bfloat162float(__nv_bfloat16 h) {
  return rheo_emu::detail::bits_f32(static_cast<uint32_t>(h.bits) << 16);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const uint32_t u = rheo_emu::detail::f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};  // NaN
  const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(rounded >> 16)};
}

inline float __half2float(__half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1Fu, man = h.bits & 0x3FFu;
  if (exp == 0x1F) return rheo_emu::detail::bits_f32(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return rheo_emu::detail::bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
  const float mag = static_cast<float>(man) * (1.0f / 16777216.0f);  // man * 2^-24, exact
  return sign ? -mag : mag;
}
inline __half __float2half_rn(float f) {
  const uint32_t u = rheo_emu::detail::f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return {static_cast<uint16_t>(sign | 0x7E00u)};  // NaN
  if (a >= 0x477FF000u) return {static_cast<uint16_t>(sign | 0x7C00u)};  // rounds to inf
  if (a < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // value / 2^-24 rounded to nearest even; exact in float since value < 2^-14.
    const float scaled = rheo_emu::detail::bits_f32(a) * 16777216.0f;
    const float r = __builtin_nearbyintf(scaled);  // default rounding mode: to nearest even
    return {static_cast<uint16_t>(sign | static_cast<uint16_t>(r))};
  }
  const uint32_t exp = (a >> 23) - 112u, man = a & 0x7FFFFFu;
  uint32_t h = (exp << 10) | (man >> 13);
  const uint32_t rest = man & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carries into the exponent right
  return {static_cast<uint16_t>(sign | h)};
}
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __ushort_as_half(unsigned short bits) { return {bits}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return {bits}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.bits; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
