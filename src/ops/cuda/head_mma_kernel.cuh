// The absorption products' tensor-core kernel for decode batches of a few tokens (absorb.cu chooses
// it; Blas::per_head): bf16 weights read as stored, W_h [rows, cols] row-major per head, times the
// head's activations of T <= 16 tokens rounded to bf16, fp32 accumulation by mma.sync m16n8k16.
// In a header of its own so that the host emulation (tests/host_emulation) runs it without a GPU.
//
// Why: the GEMV (head_gemv_kernel) takes its tokens four at a time and reads the weights again for
// each pass, and forms every product with FMAs, so its time grows with the batch (H200, GLM-5 W_UV:
// 7.0 us at one token, 27.4 at eight, 51.5 at sixteen); on the tensor cores a token more costs a
// column of the mma's n = 8 (16), so the weights are read once and the time stays near their
// bytes for any T up to 16.
//
// A warp takes 16 rows of one head and all the head's columns; a block, kHmWarps warps (64 rows).
// Its head's activations are staged in shared memory as bf16, T rows padded with zeros to the
// tiles' 8 or 16 tokens, rows hm_stride apart: an odd multiple of 64 bytes, so that the 16-byte
// loads of a quarter warp (tokens g, g + 1 at columns 8q) fall in 8 different bank groups. The weights go from global memory straight into the
// mma's A fragments: lane (g = lane / 4, q = lane % 4) loads 16 bytes of rows g and g + 8 at
// columns 32c + 8q .. 32c + 8q + 7 of each 32-column chunk c, and the chunk's two k-steps take
// their values in the order k-step 0: columns 8q + {0, 1} (k slots 2q, 2q + 1) and 8q + {2, 3}
// (slots 2q + 8, 2q + 9); k-step 1: 8q + {4, 5} and 8q + {6, 7}. The B fragments (the tokens)
// are loaded in the same column order (16 bytes of token g's row), so each k slot pairs a weight
// with its own activation: the sum is W x over the chunk's columns, in the tensor core's order.
// Each 16-byte load of the warp covers 64 contiguous bytes of 8 rows: whole 32-byte sectors.
// The first chunks' weights are loaded before the wait for the kernel before (weights are no
// kernel's output; pdl.cuh).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/dynamic_smem.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/pdl.cuh"

namespace sparsemla::cuda::headmma {

constexpr int kHmWarps = 4;
constexpr int kHmRowsPerWarp = 16;
constexpr int kHmChunk = 32;       // columns per chunk (two k-steps of 16)
constexpr int kHmMaxTokens = 16;   // two n-tiles of 8

// CH of a launch: every chunk of the row in flight at once where it has at most 16 (GLM-5's W_UK 6,
// W_UV 16, DeepSeek-V3.2's W_UK 4: 128 registers of weights at most), 16 at a time beyond.
__host__ __device__ inline int hm_chunks_in_flight(int cols) {
  const int chunks = cols / kHmChunk;
  return chunks <= 4 ? 4 : chunks <= 8 ? 8 : 16;
}

// bf16 values from one staged token row to the next (cols a multiple of kHmChunk: 64-byte rows).
__host__ __device__ inline int hm_stride(int cols) { return cols % 64 == 0 ? cols + 32 : cols; }

// Shared memory of a launch: the staged tokens, [NTILE * 8][hm_stride(cols)] bf16.
__host__ __device__ inline size_t hm_smem(int ntile, int cols) { return size_t(ntile) * 8 * hm_stride(cols) * 2; }

// Whether the kernel takes the shape: whole 32-column chunks, 16-byte aligned rows and base.
__host__ __device__ inline bool hm_takes(int cols, int64_t T, const void* w) {
  return T >= 1 && T <= kHmMaxTokens && cols > 0 && cols % kHmChunk == 0 &&
         (reinterpret_cast<uintptr_t>(w) & 15) == 0;
}

struct HeadMmaArgs {
  const __nv_bfloat16* w = nullptr;  // [heads][rows][cols]
  int heads = 0, rows = 0, cols = 0;
  const float* x = nullptr;  // [T][heads][x_stride]
  int64_t x_stride = 0;
  int T = 0;
  float* out = nullptr;  // [T][heads][out_stride]
  int64_t out_stride = 0;
};

// CH chunks' weights in flight per lane (all of a row's where it has at most CH chunks).
// Grid (ceil(rows / 64), heads); NTILE = 1 (T <= 8) or 2.
template <int NTILE, int CH>
__global__ void __launch_bounds__(kHmWarps * 32) head_mma_kernel(const HeadMmaArgs a) {
  SPARSEMLA_DYNAMIC_SMEM(sm);
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(sm);
  const int h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int stride = hm_stride(a.cols), chunks = a.cols / kHmChunk;
  const int r0 = (blockIdx.x * kHmWarps + warp) * kHmRowsPerWarp;
  // Rows past the head's end read its last row (their sums are not stored).
  const __nv_bfloat16* wh = a.w + int64_t(h) * a.rows * a.cols;
  const uint4* wr0 = reinterpret_cast<const uint4*>(wh + int64_t(min(r0 + g, a.rows - 1)) * a.cols) + q;
  const uint4* wr8 = reinterpret_cast<const uint4*>(wh + int64_t(min(r0 + g + 8, a.rows - 1)) * a.cols) + q;
  uint4 w0[CH], w8[CH];  // rows g and g + 8, chunks c0 .. c0 + CH
  auto load = [&](int c0) {
#pragma unroll
    for (int i = 0; i < CH; ++i)
      if (c0 + i < chunks) {
        w0[i] = __ldg(wr0 + (c0 + i) * (kHmChunk / 8));
        w8[i] = __ldg(wr8 + (c0 + i) * (kHmChunk / 8));
      }
  };
  const bool active = r0 < a.rows;
  if (active) load(0);
  pdl::wait();
  pdl::launch_dependents();  // the next decode product may prefetch its weights
  // The head's tokens as bf16 (as the GEMM path rounds them), zeros past T.
  const int n_pad = NTILE * 8;
  for (int i = threadIdx.x; i < n_pad * a.cols; i += kHmWarps * 32) {
    const int t = i / a.cols, c = i % a.cols;
    const float v = t < a.T ? a.x[(int64_t(t) * a.heads + h) * a.x_stride + c] : 0.0f;
    xs[t * stride + c] = __float2bfloat16(v);
  }
  __syncthreads();
  if (!active) return;
  float acc[NTILE][4];
#pragma unroll
  for (int j = 0; j < NTILE; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  for (int c0 = 0; c0 < chunks; c0 += CH) {
    if (c0 > 0) load(c0);
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      if (c0 + i >= chunks) break;
      const int col = (c0 + i) * kHmChunk + 8 * q;
#pragma unroll
      for (int j = 0; j < NTILE; ++j) {
        const uint4 xv = *reinterpret_cast<const uint4*>(xs + (j * 8 + g) * stride + col);
        const uint32_t a0[4] = {w0[i].x, w8[i].x, w0[i].y, w8[i].y};
        const uint32_t b0[2] = {xv.x, xv.y};
        mma_16816(acc[j], a0, b0, __nv_bfloat16());
        const uint32_t a1[4] = {w0[i].z, w8[i].z, w0[i].w, w8[i].w};
        const uint32_t b1[2] = {xv.z, xv.w};
        mma_16816(acc[j], a1, b1, __nv_bfloat16());
      }
    }
  }
  // C fragment: acc[j][0..1] row g, tokens 8j + 2q, 8j + 2q + 1; acc[j][2..3] row g + 8.
#pragma unroll
  for (int j = 0; j < NTILE; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = r0 + g + (e >= 2 ? 8 : 0), t = j * 8 + 2 * q + (e & 1);
      if (row < a.rows && t < a.T) a.out[(int64_t(t) * a.heads + h) * a.out_stride + row] = acc[j][e];
    }
}

// The launch of T tokens of rows of `cols` columns: the kernel, its grid and shared memory.
struct HmLaunch {
  void (*kernel)(HeadMmaArgs) = nullptr;
  dim3 grid;
  size_t smem = 0;
};
inline HmLaunch hm_launch(int heads, int rows, int cols, int64_t T) {
  HmLaunch l;
  const int ntile = T <= 8 ? 1 : 2, ch = hm_chunks_in_flight(cols);
  l.kernel = ntile == 1 ? (ch == 4 ? head_mma_kernel<1, 4> : ch == 8 ? head_mma_kernel<1, 8> : head_mma_kernel<1, 16>)
                        : (ch == 4 ? head_mma_kernel<2, 4> : ch == 8 ? head_mma_kernel<2, 8> : head_mma_kernel<2, 16>);
  l.grid = dim3(unsigned((rows + kHmWarps * kHmRowsPerWarp - 1) / (kHmWarps * kHmRowsPerWarp)), unsigned(heads));
  l.smem = hm_smem(ntile, cols);
  return l;
}

}  // namespace sparsemla::cuda::headmma
