// The prefill product's kernel (many tokens), in a header without launches so that the host
// emulation (tests/host_emulation) builds it; gemm.cuh launches it.
//
// A block computes a 128-row x TN-token tile of y. Each 64-column step decodes the weight tile (128
// rows x 4 or 8 units, dequant.cuh) to bf16 in shared memory, rounds the activation tile to bf16
// beside it, and its 8 warps (each 32 tokens wide: TN / 32 along tokens, the rest along rows)
// multiply them with mma.sync m16n8k16 (bf16 in, fp32 accumulate), reading fragments with
// ldmatrix. Decoding the weights costs more than the multiplications, so the token tile is wide
// (TN = 128: each decoded element serves 128 tokens) when there are that many tokens. For a decode
// batch (9-64 tokens) TN = 32 or 64 keeps the accumulators few (64-80 registers instead of 128), so
// 3-4 blocks share a multiprocessor: the GLM-5-width decode step at batch 32 went from 5.47 to 4.46
// ms (H200, docs/PERFORMANCE.md). Plain sm_80 instructions: the same code runs on Ampere through
// Blackwell.
//
// Two modes:
//  - one product: blocks (row tile, token tile, column split). When the tiles alone cannot fill the
//    GPU (few rows or few tokens), the columns are split over gridDim.z blocks that write partial
//    sums to a workspace, added up by a second kernel in split order (deterministic).
//  - grouped (matmul_expert_tiles: the experts of a prefill): block (row tile, tile t, product z)
//    multiplies expert tiles[t].expert's rows of the stacked weight of product z (a.w, or
//    a.more[0].w) with the tile's activation rows [first, first + count) of a.x into the same rows
//    of y (a.y, or a.more[0].y). The many experts fill the GPU, so the columns are never split.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/cuda/convert.cuh"
#include "ops/cuda/dequant.cuh"
#include "ops/cuda/expert_tiles.h"
#include "ops/cuda/mat_args.cuh"
#include "ops/cuda/mma.cuh"

namespace sparsemla::cuda {

constexpr int kTileM = 128;    // weight rows per block
constexpr int kTileK = 64;     // columns per step: a quarter of a 256-element block
constexpr int kTilePad = 8;    // bf16 padding per shared row: 144-byte rows, conflict-free ldmatrix
constexpr int kGemmThreads = 256;

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Blocks per multiprocessor the register budget is set for: fewer accumulators, more blocks.
template <int TN>
constexpr int kGemmBlocksPerSm = TN == 128 ? 2 : TN == 64 ? 3 : 4;

// y (or partial sums when split) for rows [128 bx, +128) of one product, over the 64-column steps
// [s0, s1). Grouped (tiles not null): the tile's rows of its expert, every step, into y.
template <class D, int TN>
__global__ void __launch_bounds__(kGemmThreads, kGemmBlocksPerSm<TN>)
    gemm_kernel(const MatArgs a, int steps_per_split, float* out, const ExpertTile* tiles) {
  static_assert(TN == 32 || TN == 64 || TN == 128, "token tiles of 32, 64 or 128");
  constexpr int kWarpsN = TN / 32, kWarpsM = kGemmThreads / 32 / kWarpsN;  // warps along tokens, rows
  constexpr int kWarpRows = kTileM / kWarpsM, kMI = kWarpRows / 16;         // rows per warp, m16 tiles
  __shared__ __align__(16) __nv_bfloat16 As[kTileM][kTileK + kTilePad];  // [row][col]
  __shared__ __align__(16) __nv_bfloat16 Bs[TN][kTileK + kTilePad];      // [token][col]
  constexpr int kUnitsPerRow = kTileK / D::kUnit;
  constexpr int kAIters = kTileM * kUnitsPerRow / kGemmThreads;
  constexpr int kBIters = TN * kTileK / 4 / kGemmThreads;
  static_assert(kTileK % D::kUnit == 0 && (D::kBlock >= kTileK ? D::kBlock % kTileK == 0 : kTileK % D::kBlock == 0),
                "a tile step must hold whole units");

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp % kWarpsM, wn = warp / kWarpsM;  // warp tile: rows kWarpRows wm.., tokens 32 wn..
  const int64_t m0 = int64_t(blockIdx.x) * kTileM;
  const int64_t n_steps = (a.n_cols + kTileK - 1) / kTileK;
  // This block's operands: weight rows, activation rows (from token n0), output and steps.
  const uint8_t* w = a.w;
  const float* x = a.x;
  float* y;
  int64_t n_tokens = a.n_tokens, n0, s0, s1;
  if (tiles) {
    const ExpertTile t = tiles[blockIdx.y];
    const bool second = blockIdx.z != 0;
    w = (second ? a.more[0].w : a.w) + uint64_t(t.expert) * uint64_t(a.n_rows) * a.row_bytes;
    x += int64_t(t.first) * a.n_cols;
    y = (second ? a.more[0].y : a.y) + int64_t(t.first) * a.n_rows;
    n_tokens = t.count;
    n0 = 0, s0 = 0, s1 = n_steps;
  } else {
    n0 = int64_t(blockIdx.y) * TN;
    s0 = int64_t(blockIdx.z) * steps_per_split;
    s1 = min(n_steps, s0 + steps_per_split);
    y = out + int64_t(blockIdx.z) * a.n_tokens * a.n_rows;  // [n_tokens, n_rows] per split
  }

  float acc[kMI][4][4];  // [m16 tile][n8 tile][fragment element]
#pragma unroll
  for (int i = 0; i < kMI; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  for (int64_t step = s0; step < s1; ++step) {
    const int64_t k0 = step * kTileK;
    // Weight tile: unit uu of tile row `row`; rows past the end repeat the last row (not stored),
    // units past n_cols (a 32-element type's half step) are zeros.
#pragma unroll 1
    for (int it = 0; it < kAIters; ++it) {
      const int idx = it * kGemmThreads + tid;
      const int row = idx / kUnitsPerRow, uu = idx % kUnitsPerRow;
      const int64_t gu = k0 / D::kUnit + uu;  // unit index within the row
      const int64_t b = gu / D::kUnitsPerBlock;
      const int u = int(gu % D::kUnitsPerBlock);
      float v[D::kUnit];
      if (gu * D::kUnit < a.n_cols) {
        const int64_t grow = min(m0 + row, a.n_rows - 1);
        dq::dequantize_fast<D>(w + uint64_t(grow) * a.row_bytes + uint64_t(b) * D::kBytes, u, v, a.tables);
      } else {
#pragma unroll
        for (int i = 0; i < D::kUnit; ++i) v[i] = 0.0f;
      }
#pragma unroll
      for (int run = 0; run < D::kUnit / 8; ++run) {
        const int col = int(b * D::kBlock + D::run(u, run) - k0);
        const float* p = v + 8 * run;
        *reinterpret_cast<uint4*>(&As[row][col]) =
            make_uint4(pack_bf16x2(p[0], p[1]), pack_bf16x2(p[2], p[3]), pack_bf16x2(p[4], p[5]), pack_bf16x2(p[6], p[7]));
      }
    }
    // Activation tile: 16 float4 per token; tokens past the end and columns past n_cols are zeros.
#pragma unroll
    for (int it = 0; it < kBIters; ++it) {
      const int idx = it * kGemmThreads + tid;
      const int tok = idx / (kTileK / 4), c = 4 * (idx % (kTileK / 4));
      float4 xv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (n0 + tok < n_tokens && k0 + c < a.n_cols)
        xv = __ldg(reinterpret_cast<const float4*>(x + (n0 + tok) * a.n_cols + k0 + c));
      *reinterpret_cast<uint2*>(&Bs[tok][c]) = make_uint2(pack_bf16x2(xv.x, xv.y), pack_bf16x2(xv.z, xv.w));
    }
    __syncthreads();

#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      uint32_t af[kMI][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
        ldmatrix_x4(af[mi], &As[kWarpRows * wm + 16 * mi + lane % 16][kk + 8 * (lane / 16)]);
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {
        uint32_t r[4];
        ldmatrix_x4(r, &Bs[32 * wn + 16 * nj + (lane & 7) + 8 * (lane >> 4)][kk + 8 * ((lane >> 3) & 1)]);
        bf[2 * nj][0] = r[0];
        bf[2 * nj][1] = r[1];
        bf[2 * nj + 1][0] = r[2];
        bf[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_bf16_16816(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
    __syncthreads();
  }

  // Fragment element e of tile (mi, ni): row g (+8 for e >= 2), token 2 (lane % 4) + e % 2.
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t row = m0 + kWarpRows * wm + 16 * mi + lane / 4 + 8 * (e / 2);
        const int64_t tok = n0 + 32 * wn + 8 * ni + 2 * (lane % 4) + e % 2;
        if (row < a.n_rows && tok < n_tokens) y[tok * a.n_rows + row] = acc[mi][ni][e];
      }
}

}  // namespace sparsemla::cuda
