// Host stand-in for the fp16 conversion the dequantizers use (see cuda_runtime.h beside it).
#pragma once
#include "cuda_runtime.h"

struct __half {
  uint16_t bits;
};
inline __half __ushort_as_half(uint16_t h) { return {h}; }
inline float __half2float(__half v) {
  _Float16 f;
  std::memcpy(&f, &v.bits, 2);
  return float(f);
}
