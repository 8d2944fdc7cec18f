// Host stand-in for the bf16 names the kernels use (see cuda_runtime.h beside it): float to bf16
// rounded to nearest even as the device's cvt.rn.bf16.f32 (NaN to the canonical 0x7fff), bf16 to
// float exact.
#pragma once
#include "cuda_fp16.h"

struct __nv_bfloat16 {
  uint16_t __x;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline __nv_bfloat16 __float2bfloat16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fff};
  // The 16 bits dropped decide: above half up, below down, at half to the even result.
  const uint32_t low = u & 0xffffu, keep = u >> 16;
  const uint32_t up = low > 0x8000u || (low == 0x8000u && (keep & 1u)) ? 1u : 0u;
  return {uint16_t(keep + up)};  // (a carry into the exponent is right, to infinity included)
}
inline __nv_bfloat16 __float2bfloat16_rn(float v) { return __float2bfloat16(v); }
inline float __bfloat162float(__nv_bfloat16 v) {
  const uint32_t u = uint32_t(v.__x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) { return {__float2bfloat16(lo), __float2bfloat16(hi)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return make_float2(__bfloat162float(v.x), __bfloat162float(v.y)); }
