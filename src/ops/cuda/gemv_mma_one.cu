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
// Layout: a block takes one or two m16 row tiles (one_token_two_tiles); its 8 warps split the rows' 256-blocks
// round-robin (warp w takes w, w + 8, ...) and add their sums in warp order (shuffles over a row's 4
// threads, then shared memory), so an expert pair is summed exactly as a product of the expert's
// rows alone, whatever the tile count.
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

// A staged token as one 256-column unit sees it: its columns' bf16 values (2 bytes each), its
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

// One 256-block of NT row tiles for thread (g, c): rows g + 8 i (i < 2 NT; tile i / 2), thread c's
// quarter of each (Q4KMma). In the pass of columns 64c + 32h + 4j .. + 4 (group 2c + h) only the
// thread with g = 2c + h gives the b registers the activations, so D[row][n] sums group n's
// products with the weights as the mma saw them, 128 + q; the tiles share each pass's b registers.
// Thread (g, c) then holds D for its own groups 2c, 2c + 1 and applies their scales once in fp32
// with S_n, the group's activation sum: tot[i] += d sc_n D - (128 d sc_n + dmin m_n) S_n (a
// weight is d sc q - dmin m).
template <int NT>
__device__ __forceinline__ void one_block(const Q4KMma::Raw (&r)[2 * NT], const UnitToken& t, int g, int c,
                                          float (&tot)[2 * NT]) {
  float acc[NT][4] = {};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint8_t* xb = t.base(g == 2 * c + h, 2 * (64 * c + 32 * h));
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const uint4 b = lds128(xb + 16 * jj);
#pragma unroll
      for (int jp = 0; jp < 2; ++jp)
#pragma unroll
        for (int tile = 0; tile < NT; ++tile) {
          uint32_t aw[4];
#pragma unroll
          for (int row = 0; row < 2; ++row) {
            const uint32_t nib = Q4KMma::nibbles(r[2 * tile + row], 2 * jj + jp, h);
            aw[row] = __byte_perm(nib, 0x43434343u, 0x4140);  // magic_pair's bits
            aw[2 + row] = __byte_perm(nib, 0x43434343u, 0x4342);
          }
          mma_bf16_16816(acc[tile], aw, jp ? b.z : b.x, jp ? b.w : b.y);
        }
    }
  }
  // acc[tile]: [row g, group 2c], [g, 2c + 1], [g + 8, 2c], [g + 8, 2c + 1].
  const float4 s16 = *reinterpret_cast<const float4*>(t.sums + 4 * c);
  const float sum[2] = {s16.x + s16.y, s16.z + s16.w};
#pragma unroll
  for (int i = 0; i < 2 * NT; ++i) {
    float scale[2], min[2];
    Q4KMma::group_scales(r[i], c, scale, min);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const float coef = __fmaf_rn(128.0f, scale[n], min[n]);
      tot[i] = __fmaf_rn(scale[n], acc[i / 2][2 * (i % 2) + n], __fmaf_rn(-coef, sum[n], tot[i]));
    }
  }
}

// With the kernel's static shared memory, kOneTokenMaxCols columns stay within the default 48 KB.
static_assert(bf16_staged_bytes(kOneTokenMaxCols) + sizeof(float) * kMmaWarps * kMmaRows * 2 <= 48 * 1024);

// One token's rows (one_token_rows), the token staged in shared memory once the first blocks'
// loads are in flight (their memory latency overlaps the staging and its barrier).
template <int NT, int MinBlocks>
__global__ void __launch_bounds__(kMmaWarps * 32, MinBlocks) gemv_mma_one_kernel(const MatArgs a) {
  extern __shared__ uint4 smem[];  // bf16_staged_bytes(n_cols)
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  UnitToken token{};
  one_token_rows<Q4KMma, NT, NT == 1 ? 2 : 1>(
      a,
      [&](const BlockView& v) {
        token = stage_bf16(v.token(a, 0), int(a.n_cols), reinterpret_cast<uint8_t*>(smem));
      },
      [&](const Q4KMma::Raw (&r)[2 * NT], int kb, float (&tot)[2 * NT]) {
        one_block<NT>(r, {token.x + 512 * kb, token.sums + 16 * kb, token.zeros}, g, c, tot);
      });
}


template <int NT>
void launch_tiles(const MatArgs& a, cudaStream_t s) {
  const int64_t items = a.expert_ids ? a.n_tokens : 1;  // blocks per row tile of each product
  const dim3 grid{unsigned(ceil_div(a.max_rows(), int64_t(kMmaRows) * NT)), unsigned(items), 1u + unsigned(a.n_more)};
  const size_t smem = bf16_staged_bytes(a.n_cols);
  // Three blocks per multiprocessor (80 registers) where the grid fills them; a grid of one wave
  // or less (the 2048-row shapes: 128 blocks) keeps the uncapped kernel, faster there (session 7).
  // (Blocks past a product's rows leave at once: only the others count.)
  if (a.blocks_of_all(int64_t(kMmaRows) * NT) * items >= 2 * int64_t(a.sm_count))
    pdl::launch(gemv_mma_one_kernel<NT, NT == 1 ? 3 : 2>, grid, kMmaWarps * 32, smem, s, a);
  else
    pdl::launch(gemv_mma_one_kernel<NT, 1>, grid, kMmaWarps * 32, smem, s, a);
}

}  // namespace

void launch_gemv_mma_one(gguf::GgmlType t, const MatArgs& a, cudaStream_t s) {
  if (a.group_offsets || (!a.expert_ids && a.n_tokens != 1))
    fail("cuda::launch_gemv_mma_one: one token per product (got {} tokens{})", a.n_tokens,
         a.group_offsets ? ", grouped" : "");
  if (a.n_cols > kOneTokenMaxCols)
    fail("cuda::launch_gemv_mma_one: {} columns; the one-token kernel stages at most {} in shared memory",
         a.n_cols, kOneTokenMaxCols);
  if (t != gguf::GgmlType::Q4_K)
    fail("cuda::launch_gemv_mma_one: no one-token tensor-core kernel for {}", gguf::type_name(t));
  if (one_token_two_tiles(a)) launch_tiles<2>(a, s);
  else launch_tiles<1>(a, s);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
