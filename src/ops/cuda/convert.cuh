// The number conversions the attention kernels share (bf16 / fp16 packing, fp8 e4m3 widening and
// rounding) and two small helpers, apart from mma.cuh's inline-assembly building blocks: plain
// CUDA C++ (the fp8 pair conversion's SM89 form aside), so that the host emulation
// (tests/host_emulation) builds them as they are against its stand-ins for cuda_bf16.h, cuda_fp16.h
// and cuda_fp8.h, and stands in for mma.cuh alone. mma.cuh includes this header.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

namespace sparsemla::cuda {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return *static_cast<const uint32_t*>(p); }

template <class T16>
__device__ __forceinline__ T16 to16(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 to16<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half to16<__half>(float v) { return __float2half(v); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float fp8_to_float(uint8_t v) {
  __nv_fp8_e4m3 f;
  f.__x = v;
  return float(f);
}
// Two e4m3 values (the low 16 bits of v, little-endian) widened exactly to two fp16 values.
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(v & 0xffffu), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}
// The same of the high 16 bits. From SM89 the conversion instruction reads either half of its
// register (F2FP ... R.H1), so the half is named in PTX rather than shifted down: one instruction
// less per widened pair (in the fp8-row attention kernel a tenth of its instructions, session 23).
__device__ __forceinline__ uint32_t fp8x2_hi_to_f16x2(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t d;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(d) : "r"(v));
  return d;
#else
  return fp8x2_to_f16x2(v >> 16);
#endif
}

// Eight e4m3 values (little-endian in v) times their scale, as eight bf16 values.
__device__ __forceinline__ uint4 widen_fp8x8(uint2 v, float scale) {
  const uint32_t h[4] = {fp8x2_to_f16x2(v.x), fp8x2_hi_to_f16x2(v.x), fp8x2_to_f16x2(v.y), fp8x2_hi_to_f16x2(v.y)};
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[j]));
    w[j] = pack_bf16(f.x * scale, f.y * scale);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Kernels that hold q as fp16 scale each row of it by a power of two 2^-e (exact) that brings its
// largest magnitude into [2^12, 2^13), and its scores back by 2^e: fp16 then neither overflows past
// 65504 nor loses precision to subnormals, whatever q's range. This is 2^-e for a row whose largest
// magnitude has the bits `amax_bits` (1 for a zero, subnormal, infinite or NaN maximum; e kept within
// [-64, 64]).
__device__ __forceinline__ float q_factor(uint32_t amax_bits) {
  const int biased = int(amax_bits >> 23) & 0xff;
  if (biased == 0 || biased == 255) return 1.0f;
  const int e = min(64, max(-64, biased - 127 - 12));
  return __uint_as_float(uint32_t(127 - e) << 23);
}

__device__ __forceinline__ uint8_t float_to_fp8(float v) { return __nv_fp8_e4m3(v).__x; }  // saturating

// The cache slot of position `pos` of sequence `seq` through its block table.
__device__ __forceinline__ int64_t slot_of(const int32_t* tables, int32_t max_blocks, int32_t block_size, int seq,
                                           int pos) {
  return int64_t(tables[int64_t(seq) * max_blocks + pos / block_size]) * block_size + pos % block_size;
}

}  // namespace sparsemla::cuda
