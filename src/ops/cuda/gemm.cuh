// The prefill product (many tokens): a block computes a 128-row x TN-token tile of y. Each
// 64-column step decodes the weight tile (128 rows x 4 or 8 units, dequant.cuh) to bf16 in shared
// memory, rounds the activation tile to bf16 beside it, and its 8 warps (each 32 tokens wide:
// TN / 32 along tokens, the rest along rows) multiply them with mma.sync m16n8k16 (bf16 in, fp32
// accumulate), reading fragments with ldmatrix. Decoding the weights costs more than the
// multiplications, so the token tile is wide (TN = 128: each decoded element serves 128 tokens)
// when there are that many tokens. For a decode batch (9-64 tokens) TN = 32 or 64 keeps the
// accumulators few (64-80 registers instead of 128), so 3-4 blocks share a multiprocessor: the
// GLM-5-width decode step at batch 32 went from 5.47 to 4.46 ms (H200, docs/PERFORMANCE.md).
// Plain sm_80 instructions: the same code runs on Ampere through Blackwell.
//
// When the tiles alone cannot fill the GPU (few rows or few tokens), the columns are split over
// gridDim.z blocks that write partial sums to a stream-ordered workspace, added up by a second
// kernel in split order, so the result stays deterministic.
#pragma once
#include <cuda_bf16.h>

#include <algorithm>

#include "ops/cuda/quant_matmul_kernels.cuh"

namespace sparsemla::cuda {

constexpr int kTileM = 128;    // weight rows per block
constexpr int kTileK = 64;     // columns per step: a quarter of a 256-element block
constexpr int kTilePad = 8;    // bf16 padding per shared row: 144-byte rows, conflict-free ldmatrix
constexpr int kGemmThreads = 256;

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const uint32_t a = uint32_t(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

// d += a * b for one 16x8x16 tile: a row-major 16x16 (4 regs), b column-major 16x8 (2 regs).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Blocks per multiprocessor the register budget is set for: fewer accumulators, more blocks.
template <int TN>
constexpr int kGemmBlocksPerSm = TN == 128 ? 2 : TN == 64 ? 3 : 4;

// y (or partial sums when split) for rows [128 bx, +128) and tokens [TN by, +TN), over the
// 64-column steps [z * steps_per_split, +steps_per_split).
template <class D, int TN>
__global__ void __launch_bounds__(kGemmThreads, kGemmBlocksPerSm<TN>)
    gemm_kernel(const MatArgs a, int steps_per_split, float* out) {
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
  const int64_t m0 = int64_t(blockIdx.x) * kTileM, n0 = int64_t(blockIdx.y) * TN;
  const int64_t n_steps = (a.n_cols + kTileK - 1) / kTileK;
  const int64_t s0 = int64_t(blockIdx.z) * steps_per_split;
  const int64_t s1 = min(n_steps, s0 + steps_per_split);

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
        dq::dequantize_fast<D>(a.w + uint64_t(grow) * a.row_bytes + uint64_t(b) * D::kBytes, u, v, a.tables);
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
      if (n0 + tok < a.n_tokens && k0 + c < a.n_cols)
        xv = __ldg(reinterpret_cast<const float4*>(a.x + (n0 + tok) * a.n_cols + k0 + c));
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
  float* y = out + int64_t(blockIdx.z) * a.n_tokens * a.n_rows;  // [n_tokens, n_rows]
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t row = m0 + kWarpRows * wm + 16 * mi + lane / 4 + 8 * (e / 2);
        const int64_t tok = n0 + 32 * wn + 8 * ni + 2 * (lane % 4) + e % 2;
        if (row < a.n_rows && tok < a.n_tokens) y[tok * a.n_rows + row] = acc[mi][ni][e];
      }
}

// y[i] = sum over splits s of parts[s][i], in split order.   parts: [splits, n]   y: [n]
void sum_splits(const float* parts, int splits, int64_t n, float* y, cudaStream_t s);

template <class D, int TN>
void launch_gemm_tiles(const MatArgs& a, cudaStream_t s) {
  const int64_t tiles_m = (a.n_rows + kTileM - 1) / kTileM, tiles_n = (a.n_tokens + TN - 1) / TN;
  const int64_t n_steps = (a.n_cols + kTileK - 1) / kTileK;
  // kGemmBlocksPerSm resident blocks per multiprocessor; split the columns when the tiles leave
  // most idle, keeping at least 4 steps per split.
  const int64_t slots = kGemmBlocksPerSm<TN> * int64_t(std::max(a.sm_count, 1));
  int64_t splits = std::clamp<int64_t>(slots / (tiles_m * tiles_n), 1, std::min<int64_t>(16, std::max<int64_t>(1, n_steps / 4)));
  const int64_t per_split = (n_steps + splits - 1) / splits;
  splits = (n_steps + per_split - 1) / per_split;
  const dim3 grid{unsigned(tiles_m), unsigned(tiles_n), unsigned(splits)};
  if (splits == 1) {
    gemm_kernel<D, TN><<<grid, kGemmThreads, 0, s>>>(a, int(per_split), a.y);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
    return;
  }
  const int64_t n = a.n_tokens * a.n_rows;
  void* parts = nullptr;
  SPARSEMLA_CUDA_CHECK(cudaMallocAsync(&parts, size_t(splits * n) * sizeof(float), s));
  gemm_kernel<D, TN><<<grid, kGemmThreads, 0, s>>>(a, int(per_split), static_cast<float*>(parts));
  SPARSEMLA_CUDA_LAUNCH_CHECK();
  sum_splits(static_cast<const float*>(parts), int(splits), n, a.y, s);
  SPARSEMLA_CUDA_CHECK(cudaFreeAsync(parts, s));
}

// The token tile by the number of tokens: whole 128-token tiles for prefill, narrower ones for a
// decode batch.
template <class D>
void launch_gemm(const MatArgs& a, cudaStream_t s) {
  if (a.n_tokens <= 32)
    launch_gemm_tiles<D, 32>(a, s);
  else if (a.n_tokens <= 64)
    launch_gemm_tiles<D, 64>(a, s);
  else
    launch_gemm_tiles<D, 128>(a, s);
}

}  // namespace sparsemla::cuda
