// Host stand-in for the fp16 names the kernels use (see cuda_runtime.h beside it): conversions with
// the device's rounding (to nearest even, through the host compiler's _Float16), the pair types.
#pragma once
#include "cuda_runtime.h"

struct __half {
  uint16_t bits;
};
struct __half2 {
  __half x, y;
};
struct __half_raw {
  unsigned short x;
};
struct __half2_raw {
  unsigned short x, y;
};
inline __half __ushort_as_half(uint16_t h) { return {h}; }
inline float __half2float(__half v) {
  _Float16 f;
  std::memcpy(&f, &v.bits, 2);
  return float(f);
}
inline __half __float2half(float v) {
  const _Float16 f = static_cast<_Float16>(v);  // (round to nearest even: the host's mode)
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
inline __half __float2half_rn(float v) { return __float2half(v); }
inline float2 __half22float2(__half2 v) { return make_float2(__half2float(v.x), __half2float(v.y)); }
inline __half2 __floats2half2_rn(float lo, float hi) { return {__float2half(lo), __float2half(hi)}; }
