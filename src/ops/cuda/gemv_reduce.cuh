// What the decode products' blocks (gemv.cuh, gemv_q8.cu) share: the walk over a row's units, and
// the end of the block, where each thread's sums acc[row][token] are reduced over the block in a
// fixed order (a shuffle tree within each warp, then the warps in order), so a token's result never
// depends on the other tokens, and stored as y[t0 + t][row0 + r] for the rows and tokens that exist.
#pragma once
#include <cstdint>

#include "ops/cuda/mat_args.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/small_ops_reduce.cuh"

namespace sparsemla::cuda {

// unit(iu) for this thread's units iu = tid, tid + blockDim.x, ... < n_units, U at a time fully
// unrolled (so that U units' loads are in flight together), then the rest one by one. The order
// depends only on n_units and the block size (batch invariance).
template <int U, class F>
__device__ __forceinline__ void for_each_unit(int n_units, F&& unit) {
  const int n_threads = blockDim.x;
  int iu = threadIdx.x;
  for (; iu + (U - 1) * n_threads < n_units; iu += U * n_threads) {
#pragma unroll
    for (int j = 0; j < U; ++j) unit(iu + j * n_threads);
  }
  for (; iu < n_units; iu += n_threads) unit(iu);
}

// The start of a decode product launched through pdl::launch: with `prefetch`, threads 0 .. R - 1
// ask for the first kGemvPrefetchBytes of the block's weight rows (rows row0 .. row0 + R - 1 of w,
// those that exist) to be brought into L2 while the kernel before it still runs; then it waits for
// that kernel (pdl.cuh) and lets the next one start its own prologue. Only the start of each row:
// enough to cover the launch and the first memory latency, little enough that a wave of blocks
// (about 1,000 x 4 rows) does not flood L2.
constexpr uint32_t kGemvPrefetchBytes = 4096;

template <int R>
__device__ __forceinline__ void gemv_prologue(bool prefetch, const uint8_t* w, uint64_t row_bytes, int64_t row0,
                                              int64_t n_rows) {
  if (prefetch && threadIdx.x < R && row0 + threadIdx.x < n_rows)
    pdl::prefetch_l2(w + uint64_t(row0 + threadIdx.x) * row_bytes,
                     uint32_t(row_bytes < kGemvPrefetchBytes ? row_bytes : kGemvPrefetchBytes));
  pdl::wait();
  pdl::launch_dependents();
}

// The start of a decode kernel whose block takes R rows from row0 for the tokens of its view
// (gemv.cuh, gemv_q8_kernels.cuh): the prologue (no prefetch where the weights depend on the
// routing), the block's view and its rows' addresses, rows past the end repeating the last (their
// sums are not stored). False where the block has nothing to do: then all its threads return.
template <int R>
__device__ __forceinline__ bool start_rows(const MatArgs& a, int64_t row0, BlockView& v, const uint8_t* (&w)[R]) {
  const BlockMat m = block_mat(a);
  if (row0 >= m.n_rows) return false;  // (several products: the grid covers the one with the most rows)
  gemv_prologue<R>(a.prefetch && !a.expert_ids && !a.group_offsets, m.w, m.row_bytes, row0, m.n_rows);
  if (!block_view(a, v)) return false;
#pragma unroll
  for (int r = 0; r < R; ++r) w[r] = v.w + uint64_t(min(row0 + r, v.n_rows - 1)) * v.row_bytes;
  return true;
}

template <int R, int NT, int kWarps>
__device__ __forceinline__ void block_sum_store(const float (&acc)[R][NT], float (&partial)[kWarps][R * NT],
                                                int64_t row0, int64_t n_rows, int64_t t0, int64_t n_tokens,
                                                float* ybase) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, n_threads = blockDim.x, n_warps = n_threads / 32;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float s = warp_sum(acc[r][t]);
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
