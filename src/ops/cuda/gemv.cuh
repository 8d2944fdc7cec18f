// The decode product (few tokens): each block takes kGemvRows weight rows and all tokens; its
// threads split a row's units (dequant.cuh) round-robin, decode them to fp32 in registers and
// multiply them with fp32 activations read through the L1 cache. The activation loads, not the
// weight bytes, are most of the L1 traffic, so every load feeds all the block's rows. Tokens are
// processed NT = 1, 2 or 4 at a time (accumulators per row); more tokens take several passes over
// the rows, which the L1/L2 caches then serve.
//
// Batch invariance: the number of threads depends only on n_cols, thread i takes units
// i, i + threads, ... in that order, each unit's products are summed in a fixed order
// (dq::unit_dot), and the per-thread sums are reduced by a fixed shuffle tree and then warp by
// warp. None of it depends on NT, on the number of tokens or on the other tokens' values.
#pragma once
#include "ops/cuda/quant_matmul_kernels.cuh"

namespace sparsemla::cuda {

constexpr int kGemvRows = 4;         // weight rows per block (share the activation loads)
constexpr int kGemvMaxThreads = 128;

template <class D, int NT>
__global__ void __launch_bounds__(kGemvMaxThreads) gemv_kernel(const MatArgs a) {
  constexpr int R = kGemvRows;
  __shared__ float partial[kGemvMaxThreads / 32][R * NT];  // per warp: [row][token]
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, n_warps = blockDim.x / 32;
  const int n_units = int(a.n_cols / D::kUnit);
  const int64_t row0 = int64_t(blockIdx.x) * R;
  // Expert mode: this block's pair selects the expert's rows, its activation row and output row;
  // the product is then the one-token product, summed exactly as a one-token call sums it.
  const uint8_t* wbase = a.w;
  const float* xbase = a.x;
  float* ybase = a.y;
  int64_t n_tokens = a.n_tokens;
  if (a.expert_ids) {
    const int64_t pair = blockIdx.y;
    const int32_t e = a.expert_ids[pair];
    if (e < 0) return;  // an unused slot: its output row is not written
    wbase += uint64_t(e) * uint64_t(a.n_rows) * a.row_bytes;
    xbase += (pair / a.x_div) * a.n_cols;
    ybase += pair * a.n_rows;
    n_tokens = 1;
  }
  const uint8_t* w[R];
#pragma unroll
  for (int r = 0; r < R; ++r) w[r] = wbase + uint64_t(min(row0 + r, a.n_rows - 1)) * a.row_bytes;

  for (int64_t t0 = 0; t0 < n_tokens; t0 += NT) {
    // Tokens past the end repeat the last one; their sums are not stored.
    const float* x[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) x[t] = xbase + min(t0 + t, n_tokens - 1) * a.n_cols;
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;

    for (int iu = tid; iu < n_units; iu += blockDim.x) {
      const int b = iu / D::kUnitsPerBlock, u = iu % D::kUnitsPerBlock;
      const int64_t c0 = int64_t(b) * D::kBlock;
      float xs[NT][D::kUnit];
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int run = 0; run < D::kUnit / 8; ++run) {
          const float4* p = reinterpret_cast<const float4*>(x[t] + c0 + D::run(u, run));
          const float4 x0 = __ldg(p), x1 = __ldg(p + 1);
          float* o = xs[t] + 8 * run;
          o[0] = x0.x, o[1] = x0.y, o[2] = x0.z, o[3] = x0.w, o[4] = x1.x, o[5] = x1.y, o[6] = x1.z, o[7] = x1.w;
        }
      const uint8_t* blk[R];
#pragma unroll
      for (int r = 0; r < R; ++r) blk[r] = w[r] + int64_t(b) * D::kBytes;
      dq::unit_dot<D, R, NT>(blk, u, xs, acc, a.tables);
    }

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
    if (tid < R * NT) {
      const int r = tid / NT, t = tid % NT;
      float s = partial[0][tid];
      for (int i = 1; i < n_warps; ++i) s += partial[i][tid];
      if (row0 + r < a.n_rows && t0 + t < n_tokens) ybase[(t0 + t) * a.n_rows + row0 + r] = s;
    }
    __syncthreads();
  }
}

template <class D>
void launch_gemv(const MatArgs& a, cudaStream_t s) {
  const int64_t n_units = a.n_cols / D::kUnit;
  const int threads = int(std::min<int64_t>(kGemvMaxThreads, std::max<int64_t>(32, (n_units + 31) / 32 * 32)));
  const unsigned blocks = unsigned(ceil_div(a.n_rows, kGemvRows));
  if (a.expert_ids)
    gemv_kernel<D, 1><<<dim3(blocks, unsigned(a.n_tokens)), threads, 0, s>>>(a);
  else if (a.n_tokens == 1)
    gemv_kernel<D, 1><<<blocks, threads, 0, s>>>(a);
  else if (a.n_tokens == 2)
    gemv_kernel<D, 2><<<blocks, threads, 0, s>>>(a);
  else
    gemv_kernel<D, 4><<<blocks, threads, 0, s>>>(a);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
