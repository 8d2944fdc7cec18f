// The absorption products' head-batched GEMV (absorb.cu chooses it, head_path, and launches it):
// in a header of its own so that the host emulation (tests/host_emulation) runs it in CI, where
// there is no GPU.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/attention.h"
#include "ops/cuda/dynamic_smem.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/rope.cuh"
#include "ops/cuda/small_ops_reduce.cuh"

namespace sparsemla::cuda::headgemv {

// The GEMV (head_path says where it runs; session 32 timed cuBLAS at 2-16 tokens at 7.3-11.3 us, not
// the small fraction of bandwidth first thought, and the tensor-core kernel below both): it reads
// each weight once per pass of NT tokens, in 16-byte loads. A block computes the 4 x RPW rows of one head for all tokens: its
// head's activations, rounded to bf16 as the GEMM path rounds them, are staged in shared memory;
// each of the 4 warps takes RPW rows, its lanes split every row into 8-column chunks (chunk i:
// lanes i, i + 32, ...), and a butterfly sums the lanes. A token's sum is formed in the same order
// whatever the batch size (tokens are taken NT at a time with separate accumulators) and whatever
// RPW. The lane's first chunk of each row is loaded before the wait for the kernel before (weights
// are no kernel's output; pdl.cuh), so that its latency overlaps that kernel's end and the staging.
// Rows of at most 32 chunks (256 columns: GLM-5's W_UK, 192) take 4 rows per warp, so the lane's
// only chunks are those first loads and twice the blocks share the device (H200, Nsight Compute,
// one decode step: 8.3 -> 7.1 us); wider rows keep 8 (GLM-5's W_UV, 512 columns: 8.0 us, against
// 8.4 with 4 rows and 8.6 with both of the lane's chunks loaded first).
constexpr int kHgWarps = 4;
constexpr int kHgShortRowsPerWarp = 4, kHgRowsPerWarp = 8;  // rows of <= 256 columns, and wider ones
constexpr int kHgMaxTokens = 16;
constexpr int kHgMaxStaged = 12288;  // T * cols floats (48 KB of shared memory)

__device__ __forceinline__ void bf16x8_to_f(const uint4& v, float (&f)[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
  }
}

// A lane's chunk ch of a weight row (columns 8 ch .. 8 ch + 8) as the row stores it, and its values
// in fp32 (exact).
struct Bf16Row {
  using Raw = uint4;
  __device__ static Raw load(const uint8_t* row, int ch) { return __ldg(reinterpret_cast<const uint4*>(row) + ch); }
  __device__ static void to_f(const Raw& v, float (&f)[8]) { bf16x8_to_f(v, f); }
};
struct F16Row {
  using Raw = uint4;
  __device__ static Raw load(const uint8_t* row, int ch) { return __ldg(reinterpret_cast<const uint4*>(row) + ch); }
  __device__ static void to_f(const Raw& v, float (&f)[8]) {
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
};
// ROPE: the launch also does a HeadRope (one token; its own instantiation, so that the others keep
// their registers: cosf's slow path takes a stack frame).
template <class WR, int NT, int RPW, bool ROPE = false>
__global__ void __launch_bounds__(kHgWarps * 32) head_gemv_kernel(const uint8_t* __restrict__ w, int heads, int rows,
                                                                   int cols, const float* __restrict__ x,
                                                                   int64_t x_stride, int T, float* __restrict__ out,
                                                                   int64_t out_stride, HeadRope rope) {
  SPARSEMLA_DYNAMIC_SMEM(smem);
  float* xs = reinterpret_cast<float*>(smem);  // [T][cols]
  const int h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, chunks = cols / 8;
  const int64_t row_bytes = int64_t(cols) * 2;  // (16-bit values)
  const int r0 = (blockIdx.x * kHgWarps + warp) * RPW;
  const uint8_t* wh = w + int64_t(h) * rows * row_bytes;
  auto load_w = [&](int r, int ch) { return WR::load(wh + int64_t(min(r0 + r, rows - 1)) * row_bytes, ch); };
  typename WR::Raw first[RPW];
  if (r0 < rows && lane < chunks)
#pragma unroll
    for (int r = 0; r < RPW; ++r) first[r] = load_w(r, lane);
  pdl::wait();
  pdl::launch_dependents();  // the next decode product may prefetch its weights
  for (int i = threadIdx.x; i < T * cols; i += blockDim.x) {
    const int t = i / cols, c = i % cols;
    xs[i] = __bfloat162float(__float2bfloat16(x[(int64_t(t) * heads + h) * x_stride + c]));
  }
  __syncthreads();
  // The head's rotation (HeadRope), by the last block of its rows: rope_kernel's arithmetic.
  if (ROPE && blockIdx.x == gridDim.x - 1) {
    const int64_t half = rope.table.half;
    for (int64_t i = threadIdx.x; i < T * half; i += blockDim.x) {
      const int64_t t = i / half, j = i % half;
      const RopeAngle ang = rope_angle(rope.table, float(rope.pos[t]), j);
      const int64_t ia = rope_a(rope.table, j), ib = rope_b(rope.table, j);
      const float* row = rope.x + (t * heads + h) * rope.x_stride;
      float x0 = row[ia], x1 = row[ib];
      rope_rotate(ang, &x0, &x1);
      float* orow = rope.out + (t * heads + h) * rope.out_stride;
      orow[ia] = x0;
      orow[ib] = x1;
    }
  }
  if (r0 >= rows) return;
  for (int t0 = 0; t0 < T; t0 += NT) {
    float acc[RPW][NT];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
    // acc[r][t] += chunk ch of row r . chunk ch of token t0 + t.
    auto chunk_dot = [&](const typename WR::Raw (&wv)[RPW], int ch) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float4* xp = reinterpret_cast<const float4*>(xs + min(t0 + t, T - 1) * cols + 8 * ch);
        const float4 a = xp[0], b = xp[1];
        const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          float wf[8];
          WR::to_f(wv[r], wf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][t] = fmaf(wf[i], xv[i], acc[r][t]);
        }
      }
    };
    if constexpr (RPW == kHgShortRowsPerWarp) {  // rows of at most 32 chunks: the first loads are all
      if (lane < chunks) chunk_dot(first, lane);
    } else {
      for (int ch = lane; ch < chunks; ch += 32) {
        typename WR::Raw wv[RPW];
#pragma unroll
        for (int r = 0; r < RPW; ++r) wv[r] = ch == lane ? first[r] : load_w(r, ch);
        chunk_dot(wv, ch);
      }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float v = warp_sum(acc[r][t]);
        if (lane == 0 && r0 + r < rows && t0 + t < T) out[(int64_t(t0 + t) * heads + h) * out_stride + r0 + r] = v;
      }
  }
}

}  // namespace sparsemla::cuda::headgemv
