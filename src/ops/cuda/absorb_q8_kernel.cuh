// The head-batched int8 absorption kernel of absorb_q8.cu (the description is there), in a header
// of its own so that the host emulation (tests/host_emulation) builds and runs it where there is no
// GPU; absorb_q8.cu chooses, launches and checks it.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>

#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/dynamic_smem.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/q8_quantize.cuh"
#include "ops/cuda/q8_units.cuh"

namespace sparsemla::cuda::absorb {

constexpr int kHqThreads = 256;
constexpr int kHqUnitsPerThread = 2;  // units per thread that a block's rows come to (at most)
constexpr int kHqPass = 4;            // tokens per pass at most (a pass re-reads its units from shared memory)
constexpr int kHqLevels = 2;
constexpr size_t kHqMaxSmem = 96 * 1024;  // within the 99 KB of SM86/89/12x

struct HeadQ8Args {
  const uint8_t* w = nullptr;  // [heads][rows][row_bytes]
  uint64_t row_bytes = 0;
  int heads = 0, rows = 0, cols = 0;
  int rows_per_block = 0;  // RB
  const float* x = nullptr;
  int64_t x_stride = 0;
  int T = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  QuantTables tables;
};

// Dynamic shared memory: [RB rows' bytes, 16-aligned] [T][cols] q | [T][cols] r | [T][cols / 32]
// {scale, sum} | [NT][RB][U + 1] unit dots (a row's U + 1 apart: the row sums' lanes, one row
// each, read no shared bank twice).
struct HqLayout {
  size_t w = 0, q = 0, r = 0, blocks = 0, dots = 0, total = 0;
};
__host__ __device__ inline size_t hq_align16(size_t n) { return (n + 15) / 16 * 16; }
__host__ __device__ inline int hq_tokens_per_pass(int T) { return T == 1 ? 1 : T == 2 ? 2 : kHqPass; }
__host__ __device__ inline HqLayout hq_layout(uint64_t row_bytes, int rb, int cols, int T, int units_per_row) {
  HqLayout l;
  l.w = 0;
  l.q = hq_align16(uint64_t(rb) * row_bytes);
  l.r = l.q + hq_align16(size_t(T) * cols);
  l.blocks = l.r + hq_align16(size_t(T) * cols);
  l.dots = l.blocks + size_t(T) * (cols / 32) * 8;
  l.total = l.dots + size_t(hq_tokens_per_pass(T)) * rb * (units_per_row + 1) * 4;
  return l;
}

// Grid (ceil(rows / RB), heads); NT = hq_tokens_per_pass(T) tokens per pass (the last token
// repeated in a pass past T).
template <class V, int NT>
__global__ void __launch_bounds__(kHqThreads) head_q8_kernel(const HeadQ8Args a) {
  SPARSEMLA_DYNAMIC_SMEM(sm);
  constexpr int L = kHqLevels;
  const int h = blockIdx.y, tid = threadIdx.x;
  const int U = a.cols / V::kBlock * V::kUnitsPerBlock;  // units per row
  const int r0 = blockIdx.x * a.rows_per_block, nr = min(a.rows_per_block, a.rows - r0);
  const HqLayout lay = hq_layout(a.row_bytes, a.rows_per_block, a.cols, a.T, U);
  // The block's rows, contiguous and 16-byte aligned (head_q8_supported).
  const uint8_t* src = a.w + (uint64_t(h) * a.rows + r0) * a.row_bytes;
  const int pieces = int(uint64_t(nr) * a.row_bytes / 16);
  for (int p = tid; p < pieces; p += kHqThreads) cp_async16(sm + lay.w + 16 * p, src + 16 * p);
  cp_async_commit();
  pdl::wait();
  pdl::launch_dependents();  // the next decode product may prefetch its weights
  // Every token's activations of this head, quantized: warp w takes blocks w, w + 8, ... of 32.
  int8_t* sq = reinterpret_cast<int8_t*>(sm + lay.q);
  int8_t* sr = reinterpret_cast<int8_t*>(sm + lay.r);
  int2* sb = reinterpret_cast<int2*>(sm + lay.blocks);
  const int nb = a.cols / 32, lane = tid % 32;
  for (int b = tid / 32; b < a.T * nb; b += kHqThreads / 32) {
    const int t = b / nb, c = (b % nb) * 32 + lane;
    quantize_q8_warp<L>(a.x[(int64_t(t) * a.heads + h) * a.x_stride + c], b, lane, sq, sr, sb);
  }
  cp_async_wait_all();
  __syncthreads();
  float* dots = reinterpret_cast<float*>(sm + lay.dots);  // [NT][nr][U + 1]
  const int n_units = nr * U;
  for (int t0 = 0; t0 < a.T; t0 += NT) {
    q8units::TokenX<L, true> x[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int tok = min(t0 + t, a.T - 1);
      x[t].q[0] = sq + tok * a.cols;
      x[t].q[1] = sr + tok * a.cols;
      x[t].xb = sb + tok * nb;
    }
    for (int i = tid; i < n_units; i += kHqThreads) {
      const int row = i / U, iu = i % U, b = iu / V::kUnitsPerBlock, u = iu % V::kUnitsPerBlock;
      const typename V::W wu = V::load(sm + lay.w + uint64_t(row) * a.row_bytes + b * V::kBytes, u, a.tables);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const typename V::template X<L> xu = V::template load_x<L>(x[t], b, u);
        dots[(t * nr + row) * (U + 1) + iu] = V::fma(wu, xu, 0.0f);
      }
    }
    __syncthreads();
    for (int j = tid; j < NT * nr; j += kHqThreads) {
      const int t = j / nr, row = j % nr;
      if (t0 + t >= a.T) continue;
      const float* d = dots + (t * nr + row) * (U + 1);
      float s = 0.0f;
      for (int k = 0; k < U; ++k) s = __fadd_rn(s, d[k]);
      a.out[(int64_t(t0 + t) * a.heads + h) * a.out_stride + r0 + row] = s;
    }
    __syncthreads();  // (the next pass writes the dots again)
  }
}

// Rows per block: the most rows whose units come to at most kHqUnitsPerThread per thread (at least
// one row), a multiple of the rows that make a whole number of 16-byte pieces, and no more than
// the head has.
inline int rows_per_block(uint64_t row_bytes, int rows, int units_per_row) {
  const int granule = int(16 / std::gcd(row_bytes, uint64_t(16)));
  int rb = std::max(1, kHqThreads * kHqUnitsPerThread / units_per_row);
  rb = std::max(granule, rb / granule * granule);
  return std::min(rb, (rows + granule - 1) / granule * granule);
}

}  // namespace sparsemla::cuda::absorb
