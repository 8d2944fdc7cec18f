// Scalar conversions between float32 and the 16-bit / 8-bit float formats of model files.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace sparsemla {

inline float bits_to_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f32_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// IEEE binary16 -> binary32, exact for every input (subnormals, inf, NaN payload kept).
inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_to_f32(sign);
    // subnormal: value = mant * 2^-24, exact in float32
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

// binary32 -> binary16, round to nearest even; overflow gives inf, NaN stays NaN.
inline uint16_t f32_to_fp16(float f) {
  const uint32_t x = f32_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (ax < 0x38800000u) {                         // below the smallest normal 2^-14
    // subnormal or zero: round(|f| * 2^24) with ties to even
    const float v = bits_to_f32(ax) * 16777216.0f;
    return sign | static_cast<uint16_t>(std::nearbyint(v));
  }
  uint32_t mant = ax & 0x7fffffu;
  uint32_t exp = (ax >> 23) - 112;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carry may move into the exponent: correct
  return sign | static_cast<uint16_t>(h);
}

inline float bf16_to_f32(uint16_t b) { return bits_to_f32(uint32_t(b) << 16); }

// binary32 -> bfloat16, round to nearest even; NaN stays a quiet NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

// OCP FP8 E4M3 (bias 7, no infinities, 0x7f/0xff NaN, largest finite 448) -> binary32, exact.
inline float fp8_e4m3_to_f32(uint8_t v) {
  const float sign = (v & 0x80u) ? -1.0f : 1.0f;
  const uint32_t exp = (v >> 3) & 0xfu, mant = v & 0x7u;
  if (exp == 0xf && mant == 0x7) return std::nanf("");
  if (exp == 0) return sign * std::ldexp(float(mant), -9);  // subnormal: mant * 2^-6 / 8
  return sign * std::ldexp(1.0f + float(mant) / 8.0f, int(exp) - 7);
}

// binary32 -> E4M3, round to nearest even, saturating to +-448 (as CUDA's __NV_SATFINITE).
inline uint8_t f32_to_fp8_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;
  // Candidates are exact in float: pick the nearest of the 127 finite magnitudes, ties to even code.
  int e;
  std::frexp(a, &e);                 // a = m * 2^e, m in [0.5, 1)
  int exp = std::max(e - 1, -6);     // unbiased exponent of the binade (subnormals share -6)
  const float step = std::ldexp(1.0f, exp - 3);  // spacing of 3 mantissa bits in this binade
  float q = std::nearbyint(a / step);            // round half to even on the mantissa grid
  float r = q * step;
  if (r >= 448.0f) return sign | 0x7e;
  if (r == 0.0f) return sign;
  int re;
  std::frexp(r, &re);
  const int rexp = re - 1;
  if (rexp < -6) return uint8_t(sign | uint8_t(std::lround(r / std::ldexp(1.0f, -9))));  // subnormal code
  const uint32_t mant = uint32_t(std::lround((r / std::ldexp(1.0f, rexp) - 1.0f) * 8.0f));
  return uint8_t(sign | uint8_t((rexp + 7) << 3) | uint8_t(mant));
}

}  // namespace sparsemla
