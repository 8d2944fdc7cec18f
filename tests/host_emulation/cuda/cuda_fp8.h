// Host stand-in for the fp8 e4m3 names the kernels use (see cuda_runtime.h beside it): from float
// rounded to nearest even and saturated to +-448 (__NV_SATFINITE, as __nv_fp8_e4m3's constructor;
// NaN to 0x7f), to float and pairs to fp16 exact. E5M2 is not stood in for.
#pragma once
#include "cuda_fp16.h"

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };

namespace emu {
// e4m3 code -> fp16 bits, exact (every e4m3 value is an fp16 normal); NaN -> 0x7fff.
inline uint16_t e4m3_to_f16_bits(uint8_t v) {
  const uint16_t sign = uint16_t((v & 0x80u) << 8);
  const unsigned e = (v >> 3) & 0xfu, m = v & 7u;
  if (e == 0xf && m == 7) return 0x7fff;
  if (e != 0) return uint16_t(sign | ((e + 8) << 10) | (m << 7));  // 2^(e-7) (1 + m/8): fp16 exponent e - 7 + 15
  if (m == 0) return sign;
  // m 2^-9 with m's top bit p: 2^(p-9) (1 + (m - 2^p) / 2^p)
  const unsigned p = m >= 4 ? 2 : m >= 2 ? 1 : 0;
  return uint16_t(sign | ((p + 6) << 10) | ((m - (1u << p)) << (10 - p)));
}
// float -> e4m3 code: nearest, ties to the even code, saturated to +-448; NaN -> 0x7f.
inline uint8_t float_to_e4m3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;
  if (a >= 0x43e00000u) return sign | 0x7e;  // >= 448 (infinity included): saturated
  if (a < 0x3c800000u) {                      // below 2^-6: the subnormal grid of 2^-9 (exact scaling)
    float x;
    std::memcpy(&x, &a, 4);
    return uint8_t(sign | uint8_t(std::nearbyint(x * 512.0f)));  // (8: the smallest normal, code 0x08)
  }
  const uint32_t e = (a >> 23) - 127 + 7, mant = a & 0x7fffffu;
  const uint32_t keep = mant >> 20, low = mant & 0xfffffu;
  uint32_t code = (e << 3) | keep;
  if (low > 0x80000u || (low == 0x80000u && (keep & 1u))) ++code;  // (a carry into the exponent is right)
  return uint8_t(sign | (code > 0x7e ? 0x7e : code));
}
}  // namespace emu

struct __nv_fp8_e4m3 {
  __nv_fp8_storage_t __x;
  __nv_fp8_e4m3() = default;
  explicit __nv_fp8_e4m3(float f) : __x(emu::float_to_e4m3(f)) {}
  explicit operator float() const { return __half2float(__ushort_as_half(emu::e4m3_to_f16_bits(__x))); }
};

inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t x, __nv_fp8_interpretation_t kind) {
  if (kind != __NV_E4M3) {
    std::fprintf(stderr, "emu: only e4m3 is stood in for\n");
    std::abort();
  }
  return {emu::e4m3_to_f16_bits(uint8_t(x & 0xffu)), emu::e4m3_to_f16_bits(uint8_t(x >> 8))};
}
