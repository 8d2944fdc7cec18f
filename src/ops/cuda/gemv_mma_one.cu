// The one-token tensor-core decode product for Q4_K (T = 1, or one token per expert pair): the
// fast mode's kernel for a batch-1 step's Q4_K products.
//
// At one token the n of an m16n8k16 mma would hold one useful column of 8. Here it holds the 8
// scale groups of 32 columns of a 256-column unit instead (one_block): a thread gives the b
// registers the token's activations only in the column of its weights' group, so D[row][n] sums
// group n's raw products. The weights go in as the exact bf16 integers 128 + q straight from a
// byte permute, with no per-weight scaling, and the scales are applied once per group in fp32, so
// only the activations are rounded, to bf16 (2.2e-3 relative on the test shapes, against ~8e-3 for
// the multi-token kernel of gemv_mma.cu, which rounds every weight to bf16).
//
// Layout: a block takes 16 rows (one m16 tile); its 8 warps split the row's 256-blocks round-robin
// (warp w takes w, w + 8, ...) and add their sums in warp order (shuffles over a row's 4 threads,
// then shared memory), so an expert pair is summed exactly as a product of the expert's rows alone.
// The block first stages the token in shared memory (stage_bf16): bf16 values, so each pass's b
// registers are one shared load for two mma (zeros from a zero row for the threads whose group it
// is not), and the sum of every 16 columns, so the group sums need no second mma.
//
// Q6_K and Q8_0 have no such kernel: the same scheme (Q6_K: 16 groups of 16 in two sets of sums;
// Q8_0: fp16 1024 + (q + 128) with each group of activations scaled by a power of 2) measured
// slower than their fp32 kernels at one token, both held back by loads of 2-byte aligned blocks
// (docs/PERFORMANCE.md, session 13).
#include "ops/cuda/gemv_mma.cuh"
#include "ops/cuda/gemv_reduce.cuh"
#include "ops/cuda/quant_matmul.h"

namespace sparsemla::cuda {

namespace {

using namespace mma_gemv;

__device__ __forceinline__ uint4 lds128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }

// A staged token as one 256-column unit sees it: its columns' 16-bit values (2 bytes each), its
// groups' sums, and 64 bytes of zeros. base() gives the b registers of the columns at byte offset
// `at` of the unit when `mine`, else zeros: 16 bytes, two mma's worth (b.x, b.y for columns at ..
// + 4; b.z, b.w for the next 4).
struct UnitToken {
  const uint8_t* x;
  const float* sums;  // per 16 columns
  const uint8_t* zeros;
  __device__ const uint8_t* base(bool mine, int at) const { return mine ? x + at : zeros; }
};

// The block's 256 threads stage x[0, n_cols) (n_cols a multiple of 256) as bf16 values and the fp32
// sum of each 16 columns' bf16 values (4 lanes): thread t takes columns 4t + 1024 i .. + 4, the
// loads of kBatch rounds issued before any is used (one round at a time left each block waiting
// on a chain of L2 round trips: 16% of the head's stall samples, Nsight Compute). Whole warps take
// part in each round (a round's active threads are a multiple of 64), so the shuffles see full
// warps. Layout in smem: values [n_cols] | sums [n_cols / 16] | 64 bytes of zeros.
constexpr size_t bf16_staged_bytes(int64_t n_cols) { return size_t(n_cols) * 2 + size_t(n_cols / 16) * 4 + 64; }
__device__ __forceinline__ UnitToken stage_bf16(const float* x, int n_cols, uint8_t* smem) {
  constexpr int kBatch = 4;
  float* sums = reinterpret_cast<float*>(smem + 2 * size_t(n_cols));
  uint8_t* zeros = reinterpret_cast<uint8_t*>(sums + n_cols / 16);
  const int stride = 4 * int(blockDim.x);
  for (int i0 = 4 * int(threadIdx.x); i0 < n_cols; i0 += kBatch * stride) {
    float4 v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (i0 + b * stride < n_cols) v[b] = __ldg(reinterpret_cast<const float4*>(x + i0 + b * stride));
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + b * stride;
      if (i >= n_cols) break;
      const uint32_t p0 = pack_bf16x2(v[b].x, v[b].y), p1 = pack_bf16x2(v[b].z, v[b].w);
      *reinterpret_cast<uint2*>(smem + 2 * i) = make_uint2(p0, p1);
      float s = (__uint_as_float(p0 << 16) + __uint_as_float(p0 & 0xFFFF0000u)) +
                (__uint_as_float(p1 << 16) + __uint_as_float(p1 & 0xFFFF0000u));
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (threadIdx.x % 4 == 0) sums[i / 16] = s;
    }
  }
  if (threadIdx.x < 4) reinterpret_cast<uint4*>(zeros)[threadIdx.x] = make_uint4(0u, 0u, 0u, 0u);
  __syncthreads();
  return {smem, sums, zeros};
}

// Q4_K: thread c's quarter of each row's 256-block (Q4KMma), bf16 staging.
struct Q4KOne : Q4KMma {
  static constexpr int kUnroll = 2;  // units whose loads are issued together
  static constexpr size_t staged_bytes(int64_t n_cols) { return bf16_staged_bytes(n_cols); }
  __device__ static UnitToken stage(const float* x, int n_cols, uint8_t* smem) { return stage_bf16(x, n_cols, smem); }
  __device__ static UnitToken unit(const UnitToken& t, int kb) { return {t.x + 512 * kb, t.sums + 16 * kb, t.zeros}; }
  // Rows g, g + 8 for thread (g, c). In the pass of columns 64c + 32h + 4j .. + 4 (group 2c + h)
  // only the thread with g = 2c + h gives the b registers the activations, so D[row][n] sums group
  // n's products with the weights as the mma saw them, 128 + q. Thread (g, c) then holds D for its
  // own groups 2c, 2c + 1 and applies their scales once in fp32 with S_n, the group's activation
  // sum: tot[row] += d sc_n D - (128 d sc_n + dmin m_n) S_n (a weight is d sc q - dmin m).
  __device__ static void one_block(const Raw (&r)[2], const UnitToken& t, int g, int c, float (&tot)[2]) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint8_t* xb = t.base(g == 2 * c + h, 2 * (64 * c + 32 * h));
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const uint4 b = lds128(xb + 16 * jj);
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          uint32_t aw[4];
#pragma unroll
          for (int row = 0; row < 2; ++row) {
            const uint32_t nib = nibbles(r[row], 2 * jj + jp, h);
            aw[row] = __byte_perm(nib, 0x43434343u, 0x4140);  // magic_pair's bits
            aw[2 + row] = __byte_perm(nib, 0x43434343u, 0x4342);
          }
          mma_bf16_16816(acc, aw, jp ? b.z : b.x, jp ? b.w : b.y);
        }
      }
    }
    // acc: [row g, group 2c], [g, 2c + 1], [g + 8, 2c], [g + 8, 2c + 1].
    const float4 s16 = *reinterpret_cast<const float4*>(t.sums + 4 * c);
    const float sum[2] = {s16.x + s16.y, s16.z + s16.w};
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      float scale[2], min[2];
      group_scales(r[row], c, scale, min);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float coef = __fmaf_rn(128.0f, scale[n], min[n]);
        tot[row] = __fmaf_rn(scale[n], acc[2 * row + n], __fmaf_rn(-coef, sum[n], tot[row]));
      }
    }
  }
};

// With the kernel's static 512 bytes, kOneTokenMaxCols columns stay within the default 48 KB.
static_assert(bf16_staged_bytes(kOneTokenMaxCols) + sizeof(float) * kMmaWarps * kMmaRows <= 48 * 1024);

template <class M, int MinBlocks>
__global__ void __launch_bounds__(kMmaWarps * 32, MinBlocks) gemv_mma_one_kernel(const MatArgs a) {
  extern __shared__ uint4 smem[];  // M::staged_bytes(n_cols)
  __shared__ float part[kMmaWarps][kMmaRows];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
  const int64_t row0 = int64_t(blockIdx.x) * kMmaRows;
  const int n_blocks = int(a.n_cols / 256);
  // The warp's first U units are loaded before the token is staged, so that their memory latency
  // overlaps the staging and its barrier; then the units in order, as for_warp_blocks walks them.
  // Outside expert mode the weights are loaded even before the wait for the kernel before (they
  // are not its output; the expert ids are).
  constexpr int U = M::kUnroll;
  typename M::Raw first[U][2];
  const uint8_t* w[2];
  const auto load_first = [&](const uint8_t* base) {
    block_rows(base, a, row0, g, w);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (warp + u * kMmaWarps < n_blocks)
#pragma unroll
        for (int row = 0; row < 2; ++row) first[u][row] = M::load(w[row] + uint64_t(warp + u * kMmaWarps) * M::kBytes, c);
  };
  if (!a.expert_ids) load_first(a.w);
  gemv_prologue<kMmaRows>(a.prefetch && !a.expert_ids, a.w, a.row_bytes, row0, a.n_rows);
  BlockView v;
  if (!block_view(a, v)) return;
  if (a.expert_ids) load_first(v.w);
  const UnitToken token = M::stage(v.token(a, 0), int(a.n_cols), reinterpret_cast<uint8_t*>(smem));
  float tot[2] = {0.0f, 0.0f};  // rows g, g + 8
  const auto step = [&](const typename M::Raw (&r)[2], int kb) { M::one_block(r, M::unit(token, kb), g, c, tot); };
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (warp + u * kMmaWarps < n_blocks) step(first[u], warp + u * kMmaWarps);
  for_warp_blocks<M, U>(w, n_blocks, warp + U * kMmaWarps, c, step);
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    tot[row] += __shfl_xor_sync(0xffffffffu, tot[row], 1);
    tot[row] += __shfl_xor_sync(0xffffffffu, tot[row], 2);
  }
  if (c == 0) {
    part[warp][g] = tot[0];
    part[warp][g + 8] = tot[1];
  }
  __syncthreads();
  if (threadIdx.x < kMmaRows) {
    float sum = part[0][threadIdx.x];
#pragma unroll
    for (int k = 1; k < kMmaWarps; ++k) sum += part[k][threadIdx.x];
    if (row0 + threadIdx.x < a.n_rows) v.y[row0 + threadIdx.x] = sum;
  }
}

template <class M>
void launch_one(const MatArgs& a, cudaStream_t s) {
  const dim3 grid{unsigned(ceil_div(a.n_rows, int64_t(kMmaRows))), unsigned(a.expert_ids ? a.n_tokens : 1)};
  const size_t smem = M::staged_bytes(a.n_cols);
  // Three blocks per multiprocessor (80 registers) where the grid fills them; a grid of one wave
  // or less (the 2048-row shapes: 128 blocks) keeps the uncapped kernel, faster there (session 7).
  if (mma_takes_three_blocks(a.n_rows, grid.y, a.sm_count))
    pdl::launch(gemv_mma_one_kernel<M, 3>, grid, kMmaWarps * 32, smem, s, a);
  else
    pdl::launch(gemv_mma_one_kernel<M, 1>, grid, kMmaWarps * 32, smem, s, a);
}

}  // namespace

void launch_gemv_mma_one(gguf::GgmlType t, const MatArgs& a, cudaStream_t s) {
  if (a.group_offsets || (!a.expert_ids && a.n_tokens != 1))
    fail("cuda::launch_gemv_mma_one: one token per product (got {} tokens{})", a.n_tokens,
         a.group_offsets ? ", grouped" : "");
  if (a.n_cols > kOneTokenMaxCols || a.n_cols % 256 != 0)
    fail("cuda::launch_gemv_mma_one: {} columns; the one-token kernel takes multiples of 256 up to {}", a.n_cols,
         kOneTokenMaxCols);
  if (t != gguf::GgmlType::Q4_K)
    fail("cuda::launch_gemv_mma_one: no one-token tensor-core kernel for {}", gguf::type_name(t));
  launch_one<Q4KOne>(a, s);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
