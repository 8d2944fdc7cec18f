// The tensor-core decode product (1-8 tokens per pass) for Q4_K and Q6_K weights, the fast mode's
// kernel for the types most GLM-5 / DeepSeek GGUF files hold: weights decoded straight to bf16
// pairs in registers and multiplied with mma.sync m16n8k16 (bf16 in, fp32 accumulate), tokens
// along n (a pass holds 8; fewer leave the rest of the fragment zero).
//
// Why: the fp32 decode kernel (gemv.cuh) spends about 6.7 instructions per weight at one token
// (Nsight Compute, H200: decode to fp32, FMA, addressing), and each further token adds an FMA per
// weight. Here a weight costs about 3.7 instructions whatever the token count (up to 8):
//   - 4 bytes of nibbles (8 weights) become 4 bf16 pairs 128 + q by one mask, one shift and byte
//     permutes against 0x43 (the bf16 exponent of 128): no conversion instruction;
//   - (128 + q) - 128 is exact in bf16, then one bf16x2 FMA applies the sub-block scale and min
//     (d*sc and dmin*m rounded to bf16; one rounding of the value, as the prefill kernel's tile);
//   - one mma per 8 weights per thread.
// Activations are rounded to bf16 (the prefill kernel's rounding), so results agree with the
// fp32 product to ~1e-2 relative, not to fp32 rounding: precise mode keeps the fp32 kernel.
// At 4-8 tokens it is 1.7-2x faster than the fp32 kernel, so matmul takes it from 2 (Q4_K) or 3
// (Q6_K) tokens. One Q4_K token has its own kernel (gemv_mma_one.cu: the weights exact, no
// per-weight scaling).
//
// Layout: a block takes 16 rows (one m16 tile) and all tokens; its 8 warps split the row's
// 256-element blocks round-robin (warp w takes w, w + 8, ...), and add their fragments in warp
// order through shared memory at the end. Thread (g = lane / 4, c = lane % 4) reads rows g and
// g + 8 of a 256-block as gemv_mma.cuh describes, and loads its columns' activations (one float4
// per 4 columns) for its token g. Batch invariance: a token's sum is the same sequence of mma and
// warp additions whatever the other tokens are (each output element of an mma depends only on its
// own row and column).
#include "ops/cuda/gemv_mma.cuh"
#include "ops/cuda/gemv_reduce.cuh"

namespace sparsemla::cuda {

namespace {

using namespace mma_gemv;

// Rows [16 bx, +16) for the block's tokens (BlockView), 8 tokens per pass; the block's 8 warps
// split the row's 256-blocks round-robin, U blocks per step with all their loads issued first.
// Measured (H200, docs/PERFORMANCE.md): 8 warps and U = 2 beat 4-16 warps per block with the next
// block's loads software-pipelined; MinBlocks = 3 (80 registers, a few bytes spilled: 3 blocks per
// multiprocessor, where uncapped ptxas gives Q4_K 139 and Q6_K 183, one block) is 1.2-1.6x faster
// wherever the grid fills them: the kernel waits on its loads, and more warps hide that.
template <class M, int U, int MinBlocks>
__global__ void __launch_bounds__(kMmaWarps * 32, MinBlocks) gemv_mma_kernel(const MatArgs a) {
  __shared__ float part[kMmaWarps][kMmaRows][kMmaTokens];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
  const int64_t row0 = int64_t(blockIdx.x) * kMmaRows;
  gemv_prologue<kMmaRows>(a.prefetch && !a.expert_ids && !a.group_offsets, a.w, a.row_bytes, row0, a.n_rows);
  BlockView v;
  if (!block_view(a, v)) return;
  const int n_blocks = int(a.n_cols / 256);
  const uint8_t* w[2];
  block_rows(v.w, v.n_rows, v.row_bytes, row0, g, w);
  for (int64_t t0 = 0; t0 < v.n_tokens; t0 += kMmaTokens) {
    const bool has = t0 + g < v.n_tokens;  // this thread's token g of the pass exists
    const float* x = v.token(a, min(t0 + g, v.n_tokens - 1));
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for_warp_blocks<M, U>(w, n_blocks, warp, c, [&](const typename M::Raw (&r)[2], int kb) {
      M::step(r, c, x + int64_t(kb) * 256, has, acc);
    });
    // Fragment: rows g and g + 8, tokens 2c and 2c + 1; warps added in order.
    part[warp][g][2 * c] = acc[0];
    part[warp][g][2 * c + 1] = acc[1];
    part[warp][g + 8][2 * c] = acc[2];
    part[warp][g + 8][2 * c + 1] = acc[3];
    __syncthreads();
    if (threadIdx.x < kMmaRows * kMmaTokens) {
      const int row = threadIdx.x / kMmaTokens, t = threadIdx.x % kMmaTokens;
      float sum = part[0][row][t];
#pragma unroll
      for (int k = 1; k < kMmaWarps; ++k) sum += part[k][row][t];
      if (row0 + row < a.n_rows && t0 + t < v.n_tokens) v.y[(t0 + t) * a.n_rows + row0 + row] = sum;
    }
    __syncthreads();
  }
}

template <class M>
void launch(const MatArgs& a, cudaStream_t s) {
  const dim3 grid(unsigned(ceil_div(a.n_rows, kMmaRows)), a.expert_ids || a.group_offsets ? unsigned(a.n_tokens) : 1u);
  // Three blocks per multiprocessor (registers capped at 85, a few bytes spilled) where the grid
  // fills them; a grid of one wave or less (the 2048-row shapes: 128 blocks) keeps the uncapped
  // kernel, which is faster there (docs/PERFORMANCE.md, session 7).
  if (mma_takes_three_blocks(a.n_rows, grid.y, a.sm_count))
    pdl::launch(gemv_mma_kernel<M, 2, 3>, grid, kMmaWarps * 32, 0, s, a);
  else
    pdl::launch(gemv_mma_kernel<M, 2, 1>, grid, kMmaWarps * 32, 0, s, a);
}

}  // namespace

void launch_gemv_mma(gguf::GgmlType t, const MatArgs& a, cudaStream_t s) {
  if (a.n_more) fail("cuda::launch_gemv_mma: the multi-token tensor-core kernel takes one product at a time");
  if (t == gguf::GgmlType::Q4_K)
    launch<Q4KMma>(a, s);
  else if (t == gguf::GgmlType::Q6_K)
    launch<Q6KMma>(a, s);
  else
    fail("cuda::launch_gemv_mma: no tensor-core decode kernel for {}", gguf::type_name(t));
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
