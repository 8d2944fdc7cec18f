// The decode product (few tokens): each block takes R weight rows and all tokens; its threads
// split a row's units (dequant.cuh; the wide units of GemvUnits<D> for Q4_K and Q6_K) round-robin,
// decode them to fp32 in registers and multiply them with fp32 activations read through the L1
// cache. Every activation load feeds all the block's rows. A thread takes U units per step, fully
// unrolled, so that U x R units' weight loads are in flight at once (one unit at a time left the
// kernel waiting on memory latency). At one token the remaining limit is instruction issue (about
// 3 instructions per weight element to decode and multiply); see docs/PERFORMANCE.md. Tokens are
// processed NT = 1, 2, 4 or 8 at a time (R x NT accumulators); more tokens take several passes over
// the rows, which the L1/L2 caches then serve.
//
// Batch invariance: the number of threads depends only on n_cols (and the type), thread i takes
// units i, i + threads, ... and adds each unit's runs into acc[row][token] in that order, each run
// summed in a fixed order; the per-thread sums are reduced by a fixed shuffle tree and then warp by
// warp. None of it depends on NT (U and R are fixed per type), on the number of tokens or on the
// other tokens' values.
#pragma once
#include "ops/cuda/quant_matmul_kernels.cuh"
#include "ops/cuda/gemv_reduce.cuh"
#include "ops/cuda/launch_cache.cuh"

namespace sparsemla::cuda {

constexpr int kGemvMaxThreads = 256;

// acc[row][t] += (unit u of block blk[row]) . (the unit's activations of token t), run by run:
// per run the 8 products q * x chained through fmaf, then sc * that - mn * sum(x). Decoding a
// unit once per run leaves the compiler one set of loads (they are common subexpressions) and
// only the run's 8 values live per row.
template <class V, int R, int NT>
__device__ __forceinline__ void gemv_unit(const uint8_t* const (&w)[R], const float* const (&x)[NT], int iu,
                                          float (&acc)[R][NT], const QuantTables& tables) {
  constexpr int kRuns = V::kUnit / 8;
  const int b = iu / V::kUnitsPerBlock, u = iu % V::kUnitsPerBlock;
  const int64_t c0 = int64_t(b) * V::kBlock;
#pragma unroll
  for (int r = 0; r < kRuns; ++r) {
    float q[R][8], sc[R], mn[R];
#pragma unroll
    for (int row = 0; row < R; ++row) {
      float qa[V::kUnit], sa[kRuns], ma[kRuns];
      V::unit(w[row] + int64_t(b) * V::kBytes, u, qa, sa, ma, tables);
#pragma unroll
      for (int i = 0; i < 8; ++i) q[row][i] = qa[8 * r + i];
      sc[row] = sa[r];
      mn[row] = ma[r];
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const float4* p = reinterpret_cast<const float4*>(x[t] + c0 + V::run(u, r));
      const float4 x0 = __ldg(p), x1 = __ldg(p + 1);
      const float xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      float sx = 0.0f;
      if constexpr (V::kHasMin) {
        sx = xs[0];
#pragma unroll
        for (int i = 1; i < 8; ++i) sx = __fadd_rn(sx, xs[i]);
      }
#pragma unroll
      for (int row = 0; row < R; ++row) {
        float d = __fmul_rn(q[row][0], xs[0]);
#pragma unroll
        for (int i = 1; i < 8; ++i) d = __fmaf_rn(q[row][i], xs[i], d);
        if constexpr (V::kScaled)
          acc[row][t] = __fmaf_rn(sc[row], d, acc[row][t]);
        else
          acc[row][t] = __fadd_rn(acc[row][t], d);
        if constexpr (V::kHasMin) acc[row][t] = __fmaf_rn(-mn[row], sx, acc[row][t]);
      }
    }
  }
}

template <class V, int NT, int R, int U>
__global__ void __launch_bounds__(kGemvMaxThreads) gemv_kernel(const MatArgs a) {
  __shared__ float partial[kGemvMaxThreads / 32][R * NT];  // per warp: [row][token]
  const int n_units = int(a.n_cols / V::kUnit);
  const int64_t row0 = int64_t(blockIdx.x) * R;
  BlockView v;
  const uint8_t* w[R];
  if (!start_rows<R>(a, row0, v, w)) return;

  for (int64_t t0 = 0; t0 < v.n_tokens; t0 += NT) {
    // Tokens past the end repeat the last one; their sums are not stored.
    const float* x[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) x[t] = v.token(a, min(t0 + t, v.n_tokens - 1));
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;

    for_each_unit<U>(n_units, [&](int iu) { gemv_unit<V, R, NT>(w, x, iu, acc, a.tables); });

    block_sum_store(acc, partial, row0, v.n_rows, t0, v.n_tokens, v.y);
  }
}

// Rows per block: each activation load feeds kGemvRows rows.
constexpr int kGemvRows = 4;

// Units a thread takes per step, fully unrolled: 4 units of 8 or 16 elements, 2 of the 32-element
// wide units. Measured on the H200 (2026-11-29, bench_cuda_matmul --variants, R x U in {2, 4, 8} x
// {1, 2, 4}): R = 4 with these U was best or within a few percent of best for Q8_0, Q4_K and Q6_K
// at T = 1 on every shape; R = 8 or R = 2 lost up to 20 points on some shape.
template <class V>
constexpr int kGemvUnroll = V::kUnit == 32 ? 2 : 4;

// Threads per block: enough that each takes about kGemvUnroll units of a row, a multiple of 32 in
// [32, kGemvMaxThreads]. A function of n_cols and the type only (batch invariance).
template <class V>
int gemv_threads(int64_t n_cols) {
  const int64_t n_units = n_cols / V::kUnit;
  const int64_t want = (n_units + kGemvUnroll<V> - 1) / kGemvUnroll<V>;
  return int(std::min<int64_t>(kGemvMaxThreads, std::max<int64_t>(32, (want + 31) / 32 * 32)));
}

// Grouped mode (the precise mode's experts; the fast mode takes the tensor-core kernel): a grid row
// for every group the call may have (MatArgs::n_tokens carries that count here); group_tokens_max,
// the most slots one group can hold (the batch), sets the tokens per pass. A decode batch spread
// over 256 experts leaves most groups 1-2 tokens (8 of 256 experts per token: 1.1 tokens per group
// on average at batch 8, 1.6 at 32, 2.3 at 64), so passes stay narrow:
// one token up to batches of 16, two beyond. Wider passes (NT = 8: 255 registers, a quarter of
// the warps per multiprocessor) cost several times over on one-token groups what they save on
// full ones (GLM-5-width MoE layer at batch 8: docs/PERFORMANCE.md).
constexpr int64_t kGroupOneTokenBatch = 16;

template <class V, int R, int U>
void launch_gemv_groups(const MatArgs& a, unsigned blocks, int threads, cudaStream_t s) {
  const dim3 grid(blocks, unsigned(a.n_tokens));
  if (a.group_tokens_max <= kGroupOneTokenBatch)
    pdl::launch(gemv_kernel<V, 1, R, U>, grid, threads, 0, s, a);
  else
    pdl::launch(gemv_kernel<V, 2, R, U>, grid, threads, 0, s, a);
}

// Few rows of plain weights at one token (the router's 256 fp32 rows, the indexer's 32 head
// weights): one row per block, so that the grid still spreads over the SMs; R changes no row's sum.
// Only where a weight takes at least 2 bytes: for quantized rows the activations each block reads
// again would outweigh the weights.
template <class V>
constexpr bool kOneRowBlocks = V::kBytes * 4 >= V::kBlock * 8;

template <class D>
void launch_gemv(const MatArgs& a, cudaStream_t s) {
  using V = typename dq::GemvUnits<D>::type;
  constexpr int R = kGemvRows, U = kGemvUnroll<V>;
  const int threads = gemv_threads<V>(a.n_cols);
  const unsigned blocks = unsigned(ceil_div(a.max_rows(), int64_t(R)));
  const unsigned z = 1u + unsigned(a.n_more);  // several products: product i in grid z = i
  if (a.n_more && (a.group_offsets || (!a.expert_ids && a.n_tokens != 1)))
    fail("cuda::launch_gemv: several products take one token or expert pairs");
  if (a.expert_ids)
    pdl::launch(gemv_kernel<V, 1, R, U>, dim3(blocks, unsigned(a.n_tokens), z), threads, 0, s, a);
  else if (a.group_offsets)
    launch_gemv_groups<V, R, U>(a, blocks, threads, s);
  else if (kOneRowBlocks<V> && a.n_tokens == 1 && blocks < unsigned(2 * sm_count()))
    pdl::launch(gemv_kernel<V, 1, 1, U>, dim3(unsigned(a.max_rows()), 1, z), threads, 0, s, a);
  else if (a.n_tokens == 1)
    pdl::launch(gemv_kernel<V, 1, R, U>, dim3(blocks, 1, z), threads, 0, s, a);
  else if (a.n_tokens == 2)
    pdl::launch(gemv_kernel<V, 2, R, U>, blocks, threads, 0, s, a);
  else if (a.n_tokens <= 4)
    pdl::launch(gemv_kernel<V, 4, R, U>, blocks, threads, 0, s, a);
  else
    pdl::launch(gemv_kernel<V, 8, R, U>, blocks, threads, 0, s, a);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
