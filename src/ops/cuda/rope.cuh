// The rotation of ops::Rope::apply on the device, shared by the RoPE kernel (small_ops.cu) and the
// kernels that rotate as part of a fused operation (the cache writes, the indexer's queries): one
// formula, so a fused kernel gives the bits of the unfused chain.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/small_ops.h"

namespace sparsemla::cuda {

// The two values pair i of a head rotates (RopeTable).
__device__ __forceinline__ int64_t rope_a(const RopeTable& r, int64_t i) { return r.interleaved ? 2 * i : i; }
__device__ __forceinline__ int64_t rope_b(const RopeTable& r, int64_t i) { return r.interleaved ? 2 * i + 1 : i + r.half; }

// cos and sin of pair i at position p, times the table's attention factor.
struct RopeAngle {
  float c, s;
};
__device__ __forceinline__ RopeAngle rope_angle(const RopeTable& r, float p, int64_t i) {
  // As ops::Rope::apply: the angle, cos and sin in fp32.
  const float angle = p * r.inv_freq[i];
  return {cosf(angle) * r.attn_factor, sinf(angle) * r.attn_factor};
}

// (x0, x1) rotated by the angle, without fused multiply-adds so that it rounds as the CPU does.
__device__ __forceinline__ void rope_rotate(RopeAngle a, float* x0, float* x1) {
  const float v0 = *x0, v1 = *x1;
  *x0 = __fsub_rn(__fmul_rn(v0, a.c), __fmul_rn(v1, a.s));
  *x1 = __fadd_rn(__fmul_rn(v0, a.s), __fmul_rn(v1, a.c));
}

}  // namespace sparsemla::cuda
