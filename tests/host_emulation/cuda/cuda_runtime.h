// Host stand-ins for the few CUDA names that the int8 decode units (src/ops/cuda/q8_units.cuh) and
// the dequantizers they use (dequant.cuh) need, with the device's arithmetic: dp4a, byte permutes,
// fp32 operations rounded once to nearest (no contraction), fp16 conversion. Only for
// test_q8_units_host.cpp, which compiles those headers with the host compiler; never on the
// include path of the engine. (Names with double underscores are the CUDA ones being stood in for.)
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __align__(x) alignas(x)

struct alignas(8) uint2 {
  uint32_t x, y;
};
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline int2 make_int2(int a, int b) { return {a, b}; }
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }

// Byte i of the result is byte (s >> 4i) & 7 of the eight bytes y:x (the default mode).
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  uint8_t b[8];
  std::memcpy(b, &x, 4);
  std::memcpy(b + 4, &y, 4);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t(b[(s >> (4 * i)) & 7]) << (8 * i);
  return r;
}
// Four signed byte products added to c.
inline int __dp4a(int a, int b, int c) {
  for (int i = 0; i < 4; ++i) c += int(int8_t(a >> (8 * i))) * int(int8_t(b >> (8 * i)));
  return c;
}
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
inline int __popc(uint32_t v) { return __builtin_popcount(v); }
// (volatile: one rounding per operation, never contracted into an FMA by the host compiler)
inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}
inline float __fsub_rn(float a, float b) {
  volatile float r = a - b;
  return r;
}
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __int2float_rn(int i) { return float(i); }
template <class To, class From>
inline To bits_as(From v) {
  static_assert(sizeof(To) == sizeof(From));
  To t;
  std::memcpy(&t, &v, sizeof t);
  return t;
}
inline float __int_as_float(int i) { return bits_as<float>(i); }
inline float __uint_as_float(uint32_t i) { return bits_as<float>(i); }
inline uint32_t __float_as_uint(float f) { return bits_as<uint32_t>(f); }
inline int __float_as_int(float f) { return bits_as<int>(f); }
