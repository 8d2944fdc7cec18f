// One row per block, held in registers: the norms of the small operations (small_ops.cu) and the
// fused cache writes that normalize before they store (cache_write.cu) share these, so a fused
// kernel gives the bits of the unfused chain.
//
// A row of up to kRowCache x blockDim.x values (8192 at 512 threads: hidden sizes 6144 and 7168)
// is read once into registers, all of a thread's loads in flight together: walking the row with
// one dependent load at a time cost ~7-11 us per 6144-value row on an H200, for one token. Longer
// rows take a loop (small_ops.cu). Either way each thread sums its values in the same order
// (i = tid, tid + blockDim.x, ...), so the two give the same bits.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/small_ops_reduce.cuh"

namespace sparsemla::cuda {

// Threads for one row of n values: a warp for short rows, up to 512 so that long rows (n = 6144)
// still give each thread a dozen values.
inline int row_threads(int64_t n) {
  if (n <= 64) return 32;
  if (n <= 512) return 128;
  if (n <= 2048) return 256;
  return 512;
}

constexpr int kRowCache = 16;

// The longest row a block of row_threads(n) threads holds in registers.
constexpr int64_t kMaxCachedRow = int64_t(kRowCache) * 512;

// Whether this block's row fits in its threads' registers.
__device__ __forceinline__ bool row_fits(int64_t n) { return n <= int64_t(kRowCache) * blockDim.x; }

// f(j, i) for this thread's positions i = tid + j * blockDim.x inside the row, j < kRowCache.
template <class F>
__device__ __forceinline__ void for_row(int64_t n, F&& f) {
#pragma unroll
  for (int j = 0; j < kRowCache; ++j) {
    const int64_t i = threadIdx.x + int64_t(j) * blockDim.x;
    if (i < n) f(j, i);
  }
}

// This thread's values of the row, 0 past its end (adding 0 to a sum leaves its bits) and all 0
// for a null row.
__device__ __forceinline__ void load_row(const float* row, int64_t n, float (&v)[kRowCache]) {
#pragma unroll
  for (int j = 0; j < kRowCache; ++j) v[j] = 0.0f;
  if (row) for_row(n, [&](int j, int64_t i) { v[j] = row[i]; });
}

// 1 / sqrt(mean(x^2) + eps) of the row in v (load_row), in every thread. Synchronizes the block.
__device__ __forceinline__ float rms_inv(const float (&v)[kRowCache], int64_t n, float eps) {
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kRowCache; ++j) ss += v[j] * v[j];
  ss = block_sum(ss);
  return 1.0f / sqrtf(ss / float(n) + eps);
}

// The row's mean and 1 / sqrt(biased variance + eps), in every thread. Synchronizes the block.
__device__ __forceinline__ void layer_norm_stats(const float (&v)[kRowCache], int64_t n, float eps, float* mean,
                                                 float* inv) {
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kRowCache; ++j) sum += v[j];
  const float m = block_sum(sum) / float(n);
  float var = 0.0f;
  for_row(n, [&](int j, int64_t) { var += (v[j] - m) * (v[j] - m); });
  var = block_sum(var) / float(n);
  *mean = m;
  *inv = 1.0f / sqrtf(var + eps);
}

}  // namespace sparsemla::cuda
