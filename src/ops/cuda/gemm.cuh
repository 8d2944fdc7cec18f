// The prefill product's launches (gemm_kernel.cuh describes the kernel): one product, its columns
// split where its tiles alone cannot fill the GPU; or the experts' tiles of a prefill in one launch.
#pragma once
#include <cuda_bf16.h>

#include <algorithm>

#include "ops/cuda/gemm_kernel.cuh"
#include "ops/cuda/quant_matmul_kernels.cuh"

namespace sparsemla::cuda {

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
    gemm_kernel<D, TN><<<grid, kGemmThreads, 0, s>>>(a, int(per_split), a.y, nullptr);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
    return;
  }
  const int64_t n = a.n_tokens * a.n_rows;
  void* parts = nullptr;
  SPARSEMLA_CUDA_CHECK(cudaMallocAsync(&parts, size_t(splits * n) * sizeof(float), s));
  gemm_kernel<D, TN><<<grid, kGemmThreads, 0, s>>>(a, int(per_split), static_cast<float*>(parts), nullptr);
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

// The grouped launch (matmul_expert_tiles): n_tiles tiles of `tn` tokens (32, 64 or 128) over the
// a.n_rows rows of one expert, for a and, where a.n_more is 1, a.more[0] (grid z).
template <class D>
void launch_gemm_groups(const MatArgs& a, const ExpertTile* tiles, int n_tiles, int tn, cudaStream_t s) {
  const dim3 grid{unsigned((a.n_rows + kTileM - 1) / kTileM), unsigned(n_tiles), unsigned(1 + a.n_more)};
  if (tn == 32) gemm_kernel<D, 32><<<grid, kGemmThreads, 0, s>>>(a, 0, a.y, tiles);
  else if (tn == 64) gemm_kernel<D, 64><<<grid, kGemmThreads, 0, s>>>(a, 0, a.y, tiles);
  else gemm_kernel<D, 128><<<grid, kGemmThreads, 0, s>>>(a, 0, a.y, tiles);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
