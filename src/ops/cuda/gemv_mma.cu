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
// (Q6_K) tokens. One Q4_K token has its own kernel below (gemv_mma_one_kernel: the weights exact,
// no per-weight scaling); at one token both reach the same speed (H200: output head 195 us, 65%
// of the copy rate), limited by issue and latency together (docs/PERFORMANCE.md, session 8).
//
// Layout: a block takes 16 rows (one m16 tile) and all tokens; its 8 warps split the row's
// 256-element blocks round-robin (warp w takes w, w + 8, ...), and add their fragments in warp
// order through shared memory at the end. Thread (g = lane / 4, c = lane % 4) reads rows g and
// g + 8 of a 256-block: quarter c for Q4_K (its scales' header and 32 bytes: 64 weights per row),
// for Q6_K half c / 2, bytes 16 (c % 2) .. + 16 of each of its runs. Any column may sit in any k
// slot of an mma as long as the activation in the same slot is that column's, so each thread
// feeds the mma its own columns and loads their activations (one float4 per 4 columns) for its
// token g. Batch invariance: a token's sum is the same sequence of mma and warp additions
// whatever the other tokens are (each output element of an mma depends only on its own row and
// column).
#include <cuda_bf16.h>

#include "ops/cuda/dequant.cuh"
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/gemv_reduce.cuh"
#include "ops/cuda/quant_matmul_kernels.cuh"

namespace sparsemla::cuda {

namespace {

using dq::half_to_f;
using dq::int_to_f;
using dq::ld128;
using dq::ld128_a2;

constexpr int kMmaWarps = 8;
constexpr int kMmaRows = int(kMmaRowsPerBlock);
constexpr int kMmaTokens = 8;  // tokens per pass: the n of m16n8k16

__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 bits_bf2(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// Bytes 0, 1 (sel 0x4140) or 2, 3 (0x4342) of v, each under 0x43: the bf16 pair (128 + b0, 128 + b1)
// for bytes < 128.
template <uint32_t kSel>
__device__ __forceinline__ __nv_bfloat162 magic_pair(uint32_t v) {
  return bits_bf2(__byte_perm(v, 0x43434343u, kSel));
}

// One row's pair of weights (128 + q) as bf16 (q - bias) * scale + offset: the subtraction is exact.
__device__ __forceinline__ uint32_t scale_pair(__nv_bfloat162 p, __nv_bfloat162 minus, __nv_bfloat162 sc,
                                               __nv_bfloat162 off) {
  return bf2_bits(__hfma2(__hsub2(p, minus), sc, off));
}

// The activations of 4 consecutive columns of token g as the mma's two b registers.
__device__ __forceinline__ void load_b(const float* x, bool has, uint32_t& b0, uint32_t& b1) {
  float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (has) v = __ldg(reinterpret_cast<const float4*>(x));
  b0 = pack_bf16x2(v.x, v.y);
  b1 = pack_bf16x2(v.z, v.w);
}

// Q4_K, 144 bytes: fp16 d | fp16 dmin | scales[12] | qs[128]. Thread c takes quarter c: groups 2c
// (low nibbles of qs[32c .. 32c + 32)) and 2c + 1 (high nibbles); word j of the quarter holds
// columns 64c + 4j .. + 4 (low) and 64c + 32 + 4j .. + 4 (high).
struct Q4KMma {
  static constexpr int kBytes = 144;
  struct Raw {
    uint4 hd, q0, q1;
  };
  __device__ static Raw load(const uint8_t* b, int c) {
    return {ld128(b), ld128(b + 16 + 32 * c), ld128(b + 32 + 32 * c)};
  }
  // Word j (0..7) of a row's quarter: columns 64c + 4j .. + 4 in its low nibbles, 64c + 32 + 4j ..
  // in its high ones; half h of it (0: low, 1: high) as 4 values, one per byte.
  __device__ static uint32_t nibbles(const Raw& r, int j, int h) {
    const uint32_t w = j == 0 ? r.q0.x : j == 1 ? r.q0.y : j == 2 ? r.q0.z : j == 3 ? r.q0.w
                     : j == 4 ? r.q1.x : j == 5 ? r.q1.y : j == 6 ? r.q1.z : r.q1.w;
    return (h ? w >> 4 : w) & 0x0F0F0F0Fu;
  }
  // Thread c's groups 2c + n: scale d * sc and min dmin * m in fp32 (a weight is scale * q - min).
  __device__ static void group_scales(const Raw& r, int c, float (&scale)[2], float (&min)[2]) {
    const float d = half_to_f(r.hd.x & 0xFFFF), dmin = half_to_f(r.hd.x >> 16);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      int s, m;
      dq::k4_scale_min(r.hd.y, r.hd.z, r.hd.w, 2 * c + n, &s, &m);
      scale[n] = __fmul_rn(d, int_to_f(s));
      min[n] = __fmul_rn(dmin, int_to_f(m));
    }
  }
  // acc += W[rows g, g + 8][this block] x[token g] over this thread's 64 columns.
  __device__ static void step(const Raw (&r)[2], int c, const float* xb, bool has, float (&acc)[4]) {
    // Centred: (128 + q) - 136 = q - 8 exactly, times d*sc, plus 8 d*sc - dmin*m (rounded once to
    // bf16). The offset's rounding is shared by the group's 32 weights; centred, it is about the
    // group's mean value instead of its minimum, which for a group whose values straddle zero is
    // much smaller (uncentred, the products were 2-3x further from the fp32 ones than the prefill
    // kernel's, 1.1e-2 against 4e-3 relative).
    const __nv_bfloat162 k136 = __float2bfloat162_rn(136.0f);
    __nv_bfloat162 sc[2][2], off[2][2];  // [row][group n]
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      float scale[2], min[2];
      group_scales(r[row], c, scale, min);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        sc[row][n] = __float2bfloat162_rn(scale[n]);
        off[row][n] = __float2bfloat162_rn(__fmaf_rn(8.0f, scale[n], -min[n]));
      }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t b0, b1;
        load_b(xb + 64 * c + 32 * n + 4 * j, has, b0, b1);
        uint32_t a[4];
#pragma unroll
        for (int row = 0; row < 2; ++row) {
          const uint32_t v = nibbles(r[row], j, n);
          a[row] = scale_pair(magic_pair<0x4140>(v), k136, sc[row][n], off[row][n]);
          a[2 + row] = scale_pair(magic_pair<0x4342>(v), k136, sc[row][n], off[row][n]);
        }
        mma_bf16_16816(acc, a, b0, b1);
      }
  }
};

// Q6_K, 210 bytes (2-byte aligned): ql[128] | qh[64] | int8 scales[16] | fp16 d. Thread c takes
// half h = c / 2, bytes l in [16 s, 16 s + 16) (s = c % 2) of each run k = 0..3: column 128h +
// 32k + l, 6-bit value from the nibble k / 2 of ql[64h + 32 (k % 2) + l] and bits 2k of
// qh[32h + l], scale sc[8h + s + 2k]. Value d * sc * (q - 32).
struct Q6KMma {
  static constexpr int kBytes = 210;
  struct Raw {
    uint4 la, lb, qh;
    uint2 sc;
    uint32_t d;
  };
  __device__ static Raw load(const uint8_t* b, int c) {
    const int h = c / 2, s = c % 2;
    return {ld128_a2(b + 64 * h + 16 * s), ld128_a2(b + 64 * h + 32 + 16 * s), ld128_a2(b + 128 + 32 * h + 16 * s),
            dq::ld64_a2(b + 192 + 8 * h), dq::ld16(b + 208)};
  }
  __device__ static void step(const Raw (&r)[2], int c, const float* xb, bool has, float (&acc)[4]) {
    const int h = c / 2, s = c % 2;
    const __nv_bfloat162 k160 = __float2bfloat162_rn(160.0f), zero = __float2bfloat162_rn(0.0f);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      __nv_bfloat162 sc[2];
#pragma unroll
      for (int row = 0; row < 2; ++row) {
        const uint32_t word = k < 2 ? r[row].sc.x : r[row].sc.y;  // scales 8h .. 8h + 8; run k's is byte s + 2k
        const int sv = int(int8_t((word >> (8 * (s + 2 * (k % 2)))) & 0xFF));
        sc[row] = __float2bfloat162_rn(__fmul_rn(half_to_f(r[row].d), int_to_f(sv)));
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t b0, b1;
        load_b(xb + 128 * h + 32 * k + 16 * s + 4 * j, has, b0, b1);
        uint32_t a[4];
#pragma unroll
        for (int row = 0; row < 2; ++row) {
          const uint4& l4 = k % 2 ? r[row].lb : r[row].la;
          const uint32_t lw = j == 0 ? l4.x : j == 1 ? l4.y : j == 2 ? l4.z : l4.w;
          const uint32_t hw = j == 0 ? r[row].qh.x : j == 1 ? r[row].qh.y : j == 2 ? r[row].qh.z : r[row].qh.w;
          const uint32_t v = ((lw >> (4 * (k / 2))) & 0x0F0F0F0Fu) | (((hw >> (2 * k)) & 0x03030303u) << 4);
          a[row] = scale_pair(magic_pair<0x4140>(v), k160, sc[row], zero);
          a[2 + row] = scale_pair(magic_pair<0x4342>(v), k160, sc[row], zero);
        }
        mma_bf16_16816(acc, a, b0, b1);
      }
    }
  }
};

// Thread (g, c)'s two weight rows of the block's 16 (g and g + 8; rows past the end read the last).
__device__ __forceinline__ void block_rows(const uint8_t* base, const MatArgs& a, int64_t row0, int g,
                                           const uint8_t* (&w)[2]) {
  w[0] = base + uint64_t(min(row0 + g, a.n_rows - 1)) * a.row_bytes;
  w[1] = base + uint64_t(min(row0 + g + 8, a.n_rows - 1)) * a.row_bytes;
}

// This warp's 256-blocks kb = warp, warp + 8, ... of rows w[0], w[1], U at a time with all their
// loads issued first, then the rest one at a time: step(r, kb) for each, in kb order.
template <class M, int U, class Step>
__device__ __forceinline__ void for_warp_blocks(const uint8_t* const (&w)[2], int n_blocks, int warp, int c,
                                                Step&& step) {
  int kb = warp;
  for (; kb + (U - 1) * kMmaWarps < n_blocks; kb += U * kMmaWarps) {
    typename M::Raw r[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int row = 0; row < 2; ++row) r[u][row] = M::load(w[row] + uint64_t(kb + u * kMmaWarps) * M::kBytes, c);
#pragma unroll
    for (int u = 0; u < U; ++u) step(r[u], kb + u * kMmaWarps);
  }
  for (; kb < n_blocks; kb += kMmaWarps) {
    typename M::Raw r[2];
#pragma unroll
    for (int row = 0; row < 2; ++row) r[row] = M::load(w[row] + uint64_t(kb) * M::kBytes, c);
    step(r, kb);
  }
}

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
  block_rows(v.w, a, row0, g, w);
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

// One token (T = 1, or an expert pair), Q4_K: the n of the mma holds the 256-block's 8 scale groups
// instead of tokens. Thread (g, c) gives its b registers the token's activations only when g is the
// group of its columns (2c for the low nibbles, 2c + 1 for the high), zeros otherwise, so D[row][n]
// sums group n's raw products: the weights go in as the bf16 pairs 128 + q straight from the byte
// permute (no subtraction, no per-weight scale), and a second mma with A = 1 gives each group's sum
// S_n of the (bf16) activations. Thread (g, c) then holds exactly its own groups 2c, 2c + 1 for
// rows g, g + 8 and applies their scales once per 256-block in fp32:
//   y += d sc_n D[row][n] - (128 d sc_n + dmin m_n) S_n.
// The weights' values are not rounded to bf16 (only the activations are), so it is closer to the
// fp32 product than the kernel above (2.2e-3 against ~8e-3 relative on the test shapes). Not the
// kernel above's bits: matmul takes it for every one-token Q4_K product (as fast as or faster than
// the fp32 kernel on every shape measured, H200). Nsight Compute (output head): 3.4 instructions
// per weight (the inner loop ~1.8: per mma pair a mask, 4 byte permutes, the activation load
// with its zero fill and bf16 packing; the rest the per-group scales and per-block overhead), 57%
// of the issue slots used, 1.7 eligible warps of 5.75.

// One 256-block of rows g, g + 8 for thread (g, c): tot[row] += its groups 2c, 2c + 1. x: the
// token's activations at this thread's quarter of the block (x + 256 kb + 64 c).
__device__ __forceinline__ void one_token_block(const Q4KMma::Raw (&r)[2], const float* x, int g, int c,
                                                float (&tot)[2]) {
  const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};  // bf16 pairs (1, 1)
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t b0, b1;
      load_b(x + 32 * h + 4 * j, g == 2 * c + h, b0, b1);
      uint32_t aw[4];
#pragma unroll
      for (int row = 0; row < 2; ++row) {
        const uint32_t nib = Q4KMma::nibbles(r[row], j, h);
        aw[row] = __byte_perm(nib, 0x43434343u, 0x4140);  // magic_pair's bits
        aw[2 + row] = __byte_perm(nib, 0x43434343u, 0x4342);
      }
      mma_bf16_16816(acc, aw, b0, b1);
      mma_bf16_16816(sum, ones, b0, b1);
    }
  // acc: [row g, group 2c], [g, 2c + 1], [g + 8, 2c], [g + 8, 2c + 1]; sum likewise (rows alike).
#pragma unroll
  for (int row = 0; row < 2; ++row) {
    float scale[2], min[2];
    Q4KMma::group_scales(r[row], c, scale, min);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const float coef = __fmaf_rn(128.0f, scale[n], min[n]);
      tot[row] = __fmaf_rn(scale[n], acc[2 * row + n], __fmaf_rn(-coef, sum[2 * row + n], tot[row]));
    }
  }
}

// Rows g and g + 8 summed over the 4 threads of a row (c), then over the warps in order: y[0, 16).
__device__ __forceinline__ void one_token_store(float (&tot)[2], float (&part)[kMmaWarps][kMmaRows], int64_t row0,
                                                int64_t n_rows, float* y) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
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
  if (y && threadIdx.x < kMmaRows) {
    float v = part[0][threadIdx.x];
#pragma unroll
    for (int k = 1; k < kMmaWarps; ++k) v += part[k][threadIdx.x];
    if (row0 + threadIdx.x < n_rows) y[row0 + threadIdx.x] = v;
  }
}

template <int U, int MinBlocks>
__global__ void __launch_bounds__(kMmaWarps * 32, MinBlocks) gemv_mma_one_kernel(const MatArgs a) {
  __shared__ float part[kMmaWarps][kMmaRows];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
  const int64_t row0 = int64_t(blockIdx.x) * kMmaRows;
  gemv_prologue<kMmaRows>(a.prefetch && !a.expert_ids, a.w, a.row_bytes, row0, a.n_rows);
  BlockView v;
  if (!block_view(a, v)) return;
  const int n_blocks = int(a.n_cols / 256);
  const uint8_t* w[2];
  block_rows(v.w, a, row0, g, w);
  const float* x = v.token(a, 0) + 64 * c;
  float tot[2] = {0.0f, 0.0f};  // rows g, g + 8
  for_warp_blocks<Q4KMma, U>(w, n_blocks, warp, c, [&](const Q4KMma::Raw (&r)[2], int kb) {
    one_token_block(r, x + int64_t(kb) * 256, g, c, tot);
  });
  one_token_store(tot, part, row0, a.n_rows, v.y);
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

void launch_gemv_mma_one(gguf::GgmlType t, const MatArgs& a, cudaStream_t s) {
  if (t != gguf::GgmlType::Q4_K)
    fail("cuda::launch_gemv_mma_one: no one-token tensor-core kernel for {}", gguf::type_name(t));
  if (a.group_offsets || (!a.expert_ids && a.n_tokens != 1))
    fail("cuda::launch_gemv_mma_one: one token per product (got {} tokens{})", a.n_tokens,
         a.group_offsets ? ", grouped" : "");
  const int64_t tiles_per_item = ceil_div(a.n_rows, kMmaRows), items = a.expert_ids ? a.n_tokens : 1;
  const dim3 grid{unsigned(tiles_per_item), unsigned(items)};
  if (mma_takes_three_blocks(a.n_rows, grid.y, a.sm_count))
    pdl::launch(gemv_mma_one_kernel<2, 3>, grid, kMmaWarps * 32, 0, s, a);
  else
    pdl::launch(gemv_mma_one_kernel<2, 1>, grid, kMmaWarps * 32, 0, s, a);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

void launch_gemv_mma(gguf::GgmlType t, const MatArgs& a, cudaStream_t s) {
  if (t == gguf::GgmlType::Q4_K)
    launch<Q4KMma>(a, s);
  else if (t == gguf::GgmlType::Q6_K)
    launch<Q6KMma>(a, s);
  else
    fail("cuda::launch_gemv_mma: no tensor-core decode kernel for {}", gguf::type_name(t));
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
