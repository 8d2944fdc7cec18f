// The end of a decode product's block (gemv.cuh, gemv_q8.cu): each thread's sums acc[row][token]
// reduced over the block in a fixed order (a shuffle tree within each warp, then the warps in
// order), so a token's result never depends on the other tokens, and stored as
// y[t0 + t][row0 + r] for the rows and tokens that exist.
#pragma once
#include <cstdint>

namespace sparsemla::cuda {

template <int R, int NT, int kWarps>
__device__ __forceinline__ void block_sum_store(const float (&acc)[R][NT], float (&partial)[kWarps][R * NT],
                                                int64_t row0, int64_t n_rows, int64_t t0, int64_t n_tokens,
                                                float* ybase) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, n_threads = blockDim.x, n_warps = n_threads / 32;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float s = acc[r][t];
#pragma unroll
      for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xFFFFFFFFu, s, off);
      if (lane == 0) partial[warp][r * NT + t] = s;
    }
  __syncthreads();
  for (int i = tid; i < R * NT; i += n_threads) {
    const int r = i / NT, t = i % NT;
    float s = partial[0][i];
    for (int k = 1; k < n_warps; ++k) s += partial[k][i];
    if (row0 + r < n_rows && t0 + t < n_tokens) ybase[(t0 + t) * n_rows + row0 + r] = s;
  }
  __syncthreads();
}

}  // namespace sparsemla::cuda
