// What the tensor-core decode products (gemv_mma.cu: 1-8 tokens along the mma's n; gemv_mma_one.cu:
// one token, the n holding a 256-block's scale groups) share: how a Q4_K or Q6_K 256-block is read
// by the thread (g = lane / 4, c = lane % 4) of a warp that multiplies rows g and g + 8 of a 16-row
// tile, and how its values become the bf16 pairs of an m16n8k16 A fragment.
//
// Weights enter the mma as the exact bf16 integers 128 + q: a byte permute against 0x43 (the bf16
// exponent of 128) turns 4 bytes q < 128 into two such pairs, no conversion instruction. Any column
// may sit in any k slot of an mma as long as the activation in the same slot is that column's, so
// each thread feeds the mma its own columns with their activations.
#pragma once
#include <cuda_bf16.h>

#include "ops/cuda/dequant.cuh"
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/gemv_reduce.cuh"
#include "ops/cuda/quant_matmul_kernels.cuh"

namespace sparsemla::cuda::mma_gemv {

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
  // Both groups are among 0-3 (c < 2: 6-bit values in bytes 2c, 2c + 1 of the first two scale
  // words) or among 4-7 (their low 4 bits in the third word's bytes 2 (c % 2), + 1, the top 2 bits
  // in the top bits of the first two words' same bytes), as dq::k4_scale_min reads them; here the
  // two bytes are decoded side by side.
  __device__ static void group_scales(const Raw& r, int c, float (&scale)[2], float (&min)[2]) {
    const float d = half_to_f(r.hd.x & 0xFFFF), dmin = half_to_f(r.hd.x >> 16);
    const int sh = 16 * (c & 1);
    const uint32_t s0 = r.hd.y >> sh, s1 = r.hd.z >> sh, s2 = r.hd.w >> sh;
    const uint32_t sc = c < 2 ? s0 & 0x3F3Fu : (s2 & 0x0F0Fu) | ((s0 >> 2) & 0x3030u);
    const uint32_t m = c < 2 ? s1 & 0x3F3Fu : ((s2 >> 4) & 0x0F0Fu) | ((s1 >> 2) & 0x3030u);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      scale[n] = __fmul_rn(d, int_to_f(int((sc >> (8 * n)) & 0xFFu)));
      min[n] = __fmul_rn(dmin, int_to_f(int((m >> (8 * n)) & 0xFFu)));
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

// Thread (g, c)'s NR weight rows g + 8 i (two per 16-row tile; rows past the end read the last).
template <int NR>
__device__ __forceinline__ void block_rows(const uint8_t* base, int64_t n_rows, uint64_t row_bytes, int64_t row0,
                                           int g, const uint8_t* (&w)[NR]) {
#pragma unroll
  for (int i = 0; i < NR; ++i) w[i] = base + uint64_t(min(row0 + g + 8 * i, n_rows - 1)) * row_bytes;
}

// Thread c's part of 256-block kb of each of its rows.
template <class M, int NR>
__device__ __forceinline__ void load_rows(const uint8_t* const (&w)[NR], int kb, int c, typename M::Raw (&r)[NR]) {
#pragma unroll
  for (int i = 0; i < NR; ++i) r[i] = M::load(w[i] + uint64_t(kb) * M::kBytes, c);
}

// This warp's 256-blocks kb = first, first + 8, ... (the block's 8 warps share the rows) of its
// rows w, U at a time with all their loads issued first, then the rest one at a time: step(r, kb)
// for each, in kb order.
template <class M, int U, int NR, class Step>
__device__ __forceinline__ void for_warp_blocks(const uint8_t* const (&w)[NR], int n_blocks, int first, int c,
                                                Step&& step) {
  int kb = first;
  for (; kb + (U - 1) * kMmaWarps < n_blocks; kb += U * kMmaWarps) {
    typename M::Raw r[U][NR];
#pragma unroll
    for (int u = 0; u < U; ++u) load_rows<M>(w, kb + u * kMmaWarps, c, r[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) step(r[u], kb + u * kMmaWarps);
  }
  for (; kb < n_blocks; kb += kMmaWarps) {
    typename M::Raw r[NR];
    load_rows<M>(w, kb, c, r);
    step(r, kb);
  }
}

// Row tiles per block of the one-token kernels (gemv_mma_one.cu, gemv_q8_mma.cu): two (the b
// registers shared by 32 rows, half the blocks) where each warp has one 256-block per row (n_cols
// <= 2048) or the grid still fills the device with two such blocks per SM; else one, which fills it
// better (the bf16 kernel: three blocks per SM at 80 registers). Measured for the bf16 kernel on
// the H200 (docs/PERFORMANCE.md, session 13): output head 154880 x 6144 201 -> 183 us, 8 experts
// 2048 x 6144 28.3 -> 23.8, 16384 x 2048 11.7 -> 9.9, 6144 x 2048 5.0 -> 4.7; kept at one: 6144 x
// 16384 (23.8 against 26.9), 2048 x 6144 (6.0 / 7.1), 4096^2 (5.7 / 5.9). The tile count does not
// change any row's sum (same passes, same order).
inline bool one_token_two_tiles(const MatArgs& a) {
  const int64_t items = a.expert_ids ? a.n_tokens : 1;  // blocks per row tile of each product
  return a.n_cols <= 256 * kMmaWarps || a.blocks_of_all(2 * kMmaRows) * items >= 2 * int64_t(a.sm_count);
}

// The frame of the one-token kernels (gemv_mma_one.cu, gemv_q8_mma.cu): rows [16 NT bx, + 16 NT)
// of the block's product (grid z) for its one token (an expert pair's, in expert mode). Thread
// (g, c) of warp w multiplies rows g + 8 i (i < 2 NT) over the 256-blocks w, w + 8, ...: the first
// U are loaded before the wait for the kernel before (outside expert mode: the weights are not its
// output, the expert ids are), then begin(v) binds the token (all threads reach it: a staging
// barrier may sit there), step(r, kb, tot) runs each block in kb order, and the block's 8 warps
// add their sums in warp order, so an expert pair is summed as the expert's rows alone.
template <class M, int NT, int U, class Begin, class Step>
__device__ __forceinline__ void one_token_rows(const MatArgs& a, Begin&& begin, Step&& step) {
  constexpr int NR = 2 * NT, ROWS = kMmaRows * NT;
  using Raw = typename M::Raw;
  __shared__ float part[kMmaWarps][ROWS];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = lane % 4;
  const int64_t row0 = int64_t(blockIdx.x) * ROWS;
  const int n_blocks = int(a.n_cols / 256);
  const uint8_t* w[NR];
  Raw first[U][NR];
  const BlockMat m = block_mat(a);
  if (row0 >= m.n_rows) return;  // (several products: the grid covers the one with the most rows)
  const auto load_first = [&](const uint8_t* base) {
    block_rows(base, m.n_rows, m.row_bytes, row0, g, w);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (warp + u * kMmaWarps < n_blocks) load_rows<M>(w, warp + u * kMmaWarps, c, first[u]);
  };
  if (!a.expert_ids) load_first(m.w);
  gemv_prologue<ROWS>(a.prefetch && !a.expert_ids, m.w, m.row_bytes, row0, m.n_rows);
  BlockView v;
  if (!block_view(a, v)) return;
  if (a.expert_ids) load_first(v.w);
  begin(v);
  float tot[NR] = {};
  const auto run = [&](const Raw (&r)[NR], int kb) { step(r, kb, tot); };
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (warp + u * kMmaWarps < n_blocks) run(first[u], warp + u * kMmaWarps);
  for_warp_blocks<M, U>(w, n_blocks, warp + U * kMmaWarps, c, run);
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    tot[i] += __shfl_xor_sync(0xffffffffu, tot[i], 1);
    tot[i] += __shfl_xor_sync(0xffffffffu, tot[i], 2);
    if (c == 0) part[warp][g + 8 * i] = tot[i];
  }
  __syncthreads();
  if (threadIdx.x < ROWS) {
    float sum = part[0][threadIdx.x];
#pragma unroll
    for (int k = 1; k < kMmaWarps; ++k) sum += part[k][threadIdx.x];
    if (row0 + threadIdx.x < v.n_rows) v.y[row0 + threadIdx.x] = sum;
  }
}

}  // namespace sparsemla::cuda::mma_gemv
