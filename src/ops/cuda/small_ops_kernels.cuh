// The kernels of the small operations (small_ops.cu has the host side): norms, RoPE, SwiGLU, residual
// add, scale, softmax and fp32 <-> bf16, with the launch shapes the tests need, in a header of their
// own so that the host emulation (tests/host_emulation) builds and runs them where there is no GPU.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "ops/cuda/pdl.cuh"
#include "ops/cuda/q8_quantize.cuh"
#include "ops/cuda/rope.cuh"
#include "ops/cuda/row_norm.cuh"
#include "ops/cuda/small_ops.h"
#include "ops/cuda/small_ops_reduce.cuh"

namespace sparsemla::cuda::smallops {

constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxElementwiseBlocks = 65535;

// Blocks of kElementwiseThreads for n values: one value a thread, the grid-stride loops take the rest.
inline int elementwise_blocks(int64_t n) {
  return int(std::min<int64_t>(kMaxElementwiseBlocks, (n + kElementwiseThreads - 1) / kElementwiseThreads));
}

// ---- norms: one block per row (row_norm.cuh) ----

// x may be out (an in-place norm), hence no __restrict__ on either.
__global__ void rms_norm_kernel(const float* x, int64_t x_stride, const float* __restrict__ w,
                                int64_t n, float eps, float* out, int64_t out_stride) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const float* xr = x + int64_t(blockIdx.x) * x_stride;
  float* orow = out + int64_t(blockIdx.x) * out_stride;
  if (row_fits(n)) {
    float v[kRowCache], wv[kRowCache];
    load_row(xr, n, v);
    load_row(w, n, wv);  // with the row's loads: no round trip for them after the sum
    const float scale = rms_inv(v, n, eps);  // synchronizes: every read of x is done before out (maybe x) is written
    for_row(n, [&](int j, int64_t i) { orow[i] = v[j] * scale * wv[j]; });
    return;
  }
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss);
  const float scale = 1.0f / sqrtf(ss / float(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = xr[i] * scale * w[i];
}

__global__ void add_rms_norm_kernel(float* __restrict__ h, const float* __restrict__ delta,
                                    const float* __restrict__ w, int64_t n, float eps, float* __restrict__ out) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  float* hr = h + int64_t(blockIdx.x) * n;
  const float* dr = delta + int64_t(blockIdx.x) * n;
  float* orow = out + int64_t(blockIdx.x) * n;
  if (row_fits(n)) {
    float v[kRowCache], wv[kRowCache];
#pragma unroll
    for (int j = 0; j < kRowCache; ++j) v[j] = 0.0f;
    for_row(n, [&](int j, int64_t i) { v[j] = hr[i] + dr[i]; });
    load_row(w, n, wv);  // with the row's loads: no round trip for them after the sum
    for_row(n, [&](int j, int64_t i) { hr[i] = v[j]; });
    const float scale = rms_inv(v, n, eps);
    for_row(n, [&](int j, int64_t i) { orow[i] = v[j] * scale * wv[j]; });
    return;
  }
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = hr[i] + dr[i];
    hr[i] = v;
    ss += v * v;
  }
  ss = block_sum(ss);
  const float scale = 1.0f / sqrtf(ss / float(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = hr[i] * scale * w[i];
}

__global__ void layer_norm_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                  const float* __restrict__ b, int64_t n, float eps, float* __restrict__ out) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const float* xr = x + int64_t(blockIdx.x) * n;
  float* orow = out + int64_t(blockIdx.x) * n;
  if (row_fits(n)) {
    float v[kRowCache], wv[kRowCache], bv[kRowCache];
    load_row(xr, n, v);
    load_row(w, n, wv);  // with the row's loads: no round trip for them after the sums
    load_row(b, n, bv);  // (zeros without a bias)
    float mean, inv;
    layer_norm_stats(v, n, eps, &mean, &inv);
    for_row(n, [&](int j, int64_t i) { orow[i] = (v[j] - mean) * inv * wv[j] + bv[j]; });
    return;
  }
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += xr[i];
  const float mean = block_sum(sum) / float(n);
  float var = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) var += (xr[i] - mean) * (xr[i] - mean);
  var = block_sum(var) / float(n);
  const float inv = 1.0f / sqrtf(var + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = (xr[i] - mean) * inv * w[i] + (b ? b[i] : 0.0f);
}

// ---- RoPE: blockIdx.x the token; threadIdx.x walks the pairs, blockIdx.y/threadIdx.y the heads ----

constexpr int kRopePairThreads = 32, kRopeHeadThreads = 8;

// The RoPE launch for T tokens of `heads` heads: blockIdx.y walks groups of kRopeHeadThreads heads (one block
// walked all 64 heads of a token, ~3 us).
inline dim3 rope_block() { return dim3(kRopePairThreads, kRopeHeadThreads); }
inline dim3 rope_grid(int64_t T, int64_t heads) {
  return dim3(unsigned(T), unsigned(std::min<int64_t>((heads + kRopeHeadThreads - 1) / kRopeHeadThreads, 65535)));
}

// In place (x == out, width = 2 half) or into another array: out's first 2 half values of each head
// are x's rotated, its values [2 half, width) x's copied.
template <class Pos>
__global__ void rope_kernel(const float* x, int64_t x_stride, float* out, int64_t out_stride, int64_t width,
                            int64_t heads, const Pos* __restrict__ pos, RopeTable r) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const int64_t t = blockIdx.x;
  const float p = float(pos[t]);
  const int64_t h0 = int64_t(blockIdx.y) * blockDim.y + threadIdx.y, h_step = int64_t(gridDim.y) * blockDim.y;
  for (int64_t i = threadIdx.x; i < r.half; i += blockDim.x) {
    const RopeAngle ang = rope_angle(r, p, i);
    const int64_t a = rope_a(r, i), b = rope_b(r, i);
    for (int64_t h = h0; h < heads; h += h_step) {
      const float* row = x + (t * heads + h) * x_stride;
      float* orow = out + (t * heads + h) * out_stride;
      float x0 = row[a], x1 = row[b];
      rope_rotate(ang, &x0, &x1);
      orow[a] = x0;
      orow[b] = x1;
    }
  }
  for (int64_t c = 2 * r.half + threadIdx.x; c < width; c += blockDim.x)
    for (int64_t h = h0; h < heads; h += h_step)
      out[(t * heads + h) * out_stride + c] = x[(t * heads + h) * x_stride + c];
}

// ---- elementwise ----

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

__global__ void silu_mul_kernel(float* gate, const float* __restrict__ up, int64_t n) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    gate[i] = silu_times(gate[i], up[i]);
}

// One thread per value, whole warps per 32 values: each warp quantizes the activation block it wrote.
template <int L>
__global__ void silu_mul_q8_kernel(float* gate, const float* __restrict__ up, int64_t n, Q8Out q) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i - threadIdx.x % 32 >= n) return;  // whole warps (n is whole blocks of 32)
  const float v = silu_times(gate[i], up[i]);
  gate[i] = v;
  quantize_q8_warp<L>(v, i / 32, int(threadIdx.x % 32), q.q, q.r, q.blocks);
}

__global__ void silu_mul_fused_kernel(const float* __restrict__ gate_up, int64_t T, int64_t F,
                                      float* __restrict__ out) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * F; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / F, f = i - t * F;
    out[i] = silu_times(gate_up[t * 2 * F + f], gate_up[t * 2 * F + F + f]);
  }
}

__global__ void add_kernel(float* h, const float* __restrict__ delta, int64_t n) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    h[i] += delta[i];
}

__global__ void scale_kernel(float* x, float factor, int64_t n) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= factor;
}

__global__ void softmax_rows_kernel(float* x, int64_t n) {
  float* row = x + int64_t(blockIdx.x) * n;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, row[i]);
  m = block_max(m, -INFINITY);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float e = expf(row[i] - m);
    row[i] = e;
    sum += e;
  }
  const float inv = 1.0f / block_sum(sum);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) row[i] *= inv;
}

// util/half.h's conversions, on the device.
__global__ void f32_to_bf16_kernel(const float* __restrict__ x, uint16_t* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t b = __float_as_uint(x[i]);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
      out[i] = uint16_t((b >> 16) | 0x40u);
    } else {
      b += 0x7fffu + ((b >> 16) & 1u);
      out[i] = uint16_t(b >> 16);
    }
  }
}

__global__ void bf16_to_f32_kernel(const uint16_t* __restrict__ x, float* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __uint_as_float(uint32_t(x[i]) << 16);
}

}  // namespace sparsemla::cuda::smallops
