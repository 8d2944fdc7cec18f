// The one-token int8 tensor-core decode product (Q4_K, Q5_K) on quantized activations
// (quant_matmul_q8.h): the fast mode's kernel for a batch-1 step's products of these types.
//
// The scheme is gemv_mma_one.cu's, on integers: a 256-block's 8 scale groups of 32 columns sit
// in the n of an m16n8k32 mma (u8 weights x s8 activations, int32 sums), and the thread that
// gives the b registers column n's activations is the one whose k slots hold group n's weights,
// so D[row][n] is group n's exact integer dot. Thread (g, c) of a warp feeds the mma its quarter c
// of each row's block (Q4KMma's layout: word j holds columns 4j .. + 4 of group 2c in its low
// nibbles, of group 2c + 1 in its high ones) and receives D for exactly those two groups, so the
// scales it applies (d sc per group, times the activation block's scale; minus dmin m times the
// block's activation sum) are those of the header it loaded.
//
// The weights enter the mma as stored: Q4_K's low nibbles as w & 0x0F0F0F0F and its high ones as
// w & 0xF0F0F0F0, i.e. 16 q as an unsigned byte, the 1/16 folded into the group's fp32 scale (one
// instruction per 4 weights); Q5_K adds its fifth bit from qh. The activations need no staging:
// only 8 of a warp's 32 threads (g / 2 == c) give b registers, from the int8 rows themselves.
// (Session 29, H200: weights loaded past L1, ld.global.nc.L1::no_allocate, so that they would not
// evict the activations, cost 10-25%: the header and quarter loads of a block share its lines in L1.)
// With two levels a second mma runs the residual level into its own sums, joined as 254 D1 + D2
// (exact in int32: |D1| <= 32 x 240 x 127). The integer dots are exact, so against W x_hat the
// only rounding is the fp32 scaling and summation (as the dp4a kernel; ~1e-7 relative).
//
// Against the dp4a kernel (gemv_q8.cu), which decodes each nibble into its own byte and runs one
// __dp4a per 4 weights and level, it decodes 8 weights in two instructions and runs one mma per 16
// weights a thread holds (counted from the code, not profiled). On an H200 at one token, two levels,
// it takes 5-21% less time than the dp4a kernel on the Q4_K shapes measured and 0-29% less on the
// Q5_K ones (output head: 146 against 179 us for Q4_K, 195 against 274 for Q5_K).
// Its sums run in another order than the dp4a kernel's, so it is not batch invariant with it:
// the q8 entry points take it only when asked (`one_token_kernel`), as matmul takes the bf16
// one-token kernel and matmul_decode does not.
//
// Q6_K measured slower on this scheme than on the dp4a and fp32 kernels and is left out
// (docs/PERFORMANCE.md, session 25): its 16-column groups need two sets of sums and its - 32 a
// per-group activation sum passed between threads, and its 2-byte aligned 210-byte blocks take five
// word loads and four permutes per 16 bytes: about three times Q4_K's instructions per weight
// (counted from the code). 6144 x 16384 at one token: 47-57 us against 37 for the fp32 kernel and
// 32 for dp4a.
#include "ops/cuda/gemv_mma.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/quant_matmul_q8.h"

namespace sparsemla::cuda {

namespace {

using namespace mma_gemv;

// d += a b: a 16 x 32 unsigned bytes (row), b 32 x 8 signed bytes (col), int32 sums.
__device__ __forceinline__ void mma_u8s8_16832(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// Groups 2c + n of a K-quant header (fp16 d | fp16 dmin | 12 bytes of 6-bit scales and mins, as
// Q4_K and Q5_K store it): scale d * sc and min dmin * m in fp32 (Q4KMma::group_scales).
__device__ __forceinline__ void kmin_group_scales(const uint4& hd, int c, float (&scale)[2], float (&min)[2]) {
  Q4KMma::group_scales(Q4KMma::Raw{hd, {}, {}}, c, scale, min);
}

// One token's int8 activations: level l's values at q[l], the blocks' {scale, sum} at xb.
template <int L>
struct TokenQ8 {
  const int8_t* q[L];
  const int2* xb;
};

// One 256-block kb of a Q4_K / Q5_K matrix (M: a_word, header, kHighScale) for thread (g, c): rows
// g + 8 i (i < 2 NT; tile i / 2). In the passes of half h (low / high nibbles), only the thread with
// g == 2c + h gives b registers (group g's activations); D[row][n] collects group n's integer dot
// over the 8 passes of 4 words.
template <class M, int NT, int L>
__device__ __forceinline__ void kmin_block(const typename M::Raw (&r)[2 * NT], const TokenQ8<L>& t, int kb, int g,
                                          int c, float (&tot)[2 * NT]) {
  // Group g's 32 activations of each level (zeros for the threads that give none) and the
  // {scale, sum} of groups 2c, 2c + 1.
  const bool gives = (g >> 1) == c;
  uint4 xa[L][2];
#pragma unroll
  for (int l = 0; l < L; ++l) {
    xa[l][0] = xa[l][1] = make_uint4(0u, 0u, 0u, 0u);
    if (gives) {
      const uint4* p = reinterpret_cast<const uint4*>(t.q[l] + 256 * int64_t(kb) + 32 * g);
      xa[l][0] = __ldg(p);
      xa[l][1] = __ldg(p + 1);
    }
  }
  const int4 xs = __ldg(reinterpret_cast<const int4*>(t.xb + 8 * int64_t(kb) + 2 * c));
  // One level (S): each half's passes sum into their own registers, and the giving thread gives
  // its group in all 8 passes: in the other half's passes its slots meet the weights of the group
  // beside its own, which lands only in that half's sums of its own column, never read; 32 selects
  // fewer per block. Two levels: one set of sums, the giving thread giving zeros in the other half's
  // passes (two sets spill at the register caps below).
  constexpr bool S = L == 1;
  constexpr int H = S ? 2 : 1;
  int acc[H][L][NT][4] = {};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const bool mine = S || (g & 1) == h;  // (S: the giving thread gives in every pass)
      uint32_t b[L][2];
#pragma unroll
      for (int l = 0; l < L; ++l) {
        b[l][0] = mine ? word_of(xa[l][q / 2], 2 * (q % 2)) : 0u;
        b[l][1] = mine ? word_of(xa[l][q / 2], 2 * (q % 2) + 1) : 0u;
      }
#pragma unroll
      for (int tile = 0; tile < NT; ++tile) {
        // a0: row g, k 4c .. (word 2q); a1: row g + 8; a2, a3: word 2q + 1 (k 16 + 4c ..).
        const uint32_t a[4] = {M::a_word(r[2 * tile], 2 * q, h, c), M::a_word(r[2 * tile + 1], 2 * q, h, c),
                               M::a_word(r[2 * tile], 2 * q + 1, h, c), M::a_word(r[2 * tile + 1], 2 * q + 1, h, c)};
#pragma unroll
        for (int l = 0; l < L; ++l) mma_u8s8_16832(acc[h % H][l][tile], a, b[l][0], b[l][1]);
      }
    }
  }
  // acc[h][.][tile]: [row g, group 2c], [g, 2c + 1], [g + 8, 2c], [g + 8, 2c + 1] (with S, half n's
  // sums for group 2c + n).
  const float dx[2] = {__int_as_float(xs.x), __int_as_float(xs.z)};
  const float ds[2] = {__fmul_rn(dx[0], __int2float_rn(xs.y)), __fmul_rn(dx[1], __int2float_rn(xs.w))};
#pragma unroll
  for (int i = 0; i < 2 * NT; ++i) {
    float scale[2], min[2];
    kmin_group_scales(M::header(r[i]), c, scale, min);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int k = 2 * (i % 2) + n;
      int d = acc[n % H][0][i / 2][k];
      if constexpr (L == 2) d = d * kQ8LevelRatio + acc[n % H][1][i / 2][k];
      const float s = n && M::kHighScale != 1.0f ? __fmul_rn(scale[n], M::kHighScale) : scale[n];
      const float coef = __fmul_rn(s, dx[n]);
      tot[i] = __fmaf_rn(coef, __int2float_rn(d), __fmaf_rn(-min[n], ds[n], tot[i]));
    }
  }
}

// Q4_K: thread c's quarter (Q4KMma::Raw: header, qs[32c .. 32c + 32)). Half h of word j as the
// mma's 4 unsigned bytes: q (low nibbles) or 16 q (high).
struct Q4KOne {
  static constexpr int kBytes = 144;
  static constexpr int kUnrollOneTile = 2;  // 256-blocks loaded at a time with one row tile (two tiles: 1)
  static constexpr bool kTwoTiles = true;   // blocks of two row tiles where the grid allows
  static constexpr float kHighScale = 1.0f / 16.0f;
  using Raw = Q4KMma::Raw;
  __device__ static Raw load(const uint8_t* b, int c) { return Q4KMma::load(b, c); }
  __device__ static const uint4& header(const Raw& r) { return r.hd; }
  __device__ static uint32_t a_word(const Raw& r, int j, int h, int) {
    const uint32_t w = word_of(j < 4 ? r.q0 : r.q1, j % 4);
    return w & (h ? 0xF0F0F0F0u : 0x0F0F0F0Fu);
  }
};

// Q5_K, 176 bytes: fp16 d | fp16 dmin | scales[12] | qh[32] | qs[128]; the fifth bit of element
// 32 G + l is bit G of qh[l], so word j of qh holds, for every group, the fifth bits of its
// columns 4j .. + 4.
struct Q5KOne {
  static constexpr int kBytes = 176;
  static constexpr int kUnrollOneTile = 1;  // 80 bytes per row and block: one at a time
  static constexpr bool kTwoTiles = false;  // (four rows' 320 bytes spill at two blocks per SM)
  static constexpr float kHighScale = 1.0f;
  struct Raw {
    uint4 hd, qh0, qh1, q0, q1;
  };
  __device__ static Raw load(const uint8_t* b, int c) {
    return {ld128(b), ld128(b + 16), ld128(b + 32), ld128(b + 48 + 32 * c), ld128(b + 64 + 32 * c)};
  }
  __device__ static const uint4& header(const Raw& r) { return r.hd; }
  __device__ static uint32_t a_word(const Raw& r, int j, int h, int c) {
    const uint32_t w = word_of(j < 4 ? r.q0 : r.q1, j % 4), hb = word_of(j < 4 ? r.qh0 : r.qh1, j % 4);
    return ((w >> (4 * h)) & 0x0F0F0F0Fu) | (((hb >> (2 * c + h)) & 0x01010101u) << 4);
  }
};

// One token's rows (one_token_rows), its int8 activations bound to the block's token: NT row tiles
// per block, U 256-blocks loaded at a time, at least MINB blocks per multiprocessor (registers
// capped to fit them; launch_levels says which).
template <class M, int NT, int L, int U, int MINB>
__global__ void __launch_bounds__(kMmaWarps * 32, MINB) gemv_q8_one_kernel(const MatArgs a) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  TokenQ8<L> t{};
  one_token_rows<M, NT, U>(
      a,
      [&](const BlockView& v) {
        const int64_t tok = v.token_row(a, 0);
        t.q[0] = a.xq + tok * a.n_cols;
        if constexpr (L == 2) t.q[1] = a.xr + tok * a.n_cols;
        t.xb = a.xb + tok * (a.n_cols / 32);
      },
      [&](const typename M::Raw (&r)[2 * NT], int kb, float (&tot)[2 * NT]) {
        kmin_block<M, NT, L>(r, t, kb, g, c, tot);
      });
}

// Three blocks per multiprocessor: one-tile blocks with one 256-block loaded at a time (79
// registers: 24 warps per SM instead of 16), for Q4_K rows of 8192 columns or more, and of 4096 or
// more where the one-tile blocks fill the device 8 times over with three per SM (the output head).
// Each warp then runs several 256-blocks in turn, and what bounds it is the latency of its load and
// decode chain, not the bytes (session 28: q_b's 16384 x 2048 read from L2 took 7.1 us against 8.0
// from HBM), so more warps help. H200, two levels, us: 6144 x 16384 20.4 -> 19.1; head 154880 x
// 6144 146.8 -> 140.2 (86% -> 90% of the copy rate). Elsewhere they lost: 16384 x 2048 8.0 -> 8.7,
// 8 experts 2048 x 6144 18.0 -> 19.4, 6144 x 2048 3.9 -> 4.1. (Four per SM, 64 registers, spills
// and loses everywhere.)
constexpr int64_t kThreeBlocksMinCols = 8192, kThreeBlocksWideMinCols = 4096, kThreeBlocksWaves = 8;
inline bool takes_three_blocks(const MatArgs& a, int64_t items) {
  if (a.n_cols >= kThreeBlocksMinCols) return true;
  return a.n_cols >= kThreeBlocksWideMinCols && a.blocks_of_all(kMmaRows) * items >= kThreeBlocksWaves * 3 * a.sm_count;
}

// Row tiles per block: two where the bf16 one-token kernel takes two (one_token_two_tiles) and where
// the two-tile blocks still fill the device once (below); Q5_K one.
// These variants are held to 128 registers, so two blocks fit a multiprocessor: uncapped, the
// two-tile kernel took 148 and ran its 192 blocks of a 6144-row product in two waves (5.4 us
// against 4.5 for the bf16 one-token kernel, H200). The tile count and the blocks loaded at a time
// change no row's sum (the same passes in the same order).
template <class M, int L>
void launch_levels(const MatArgs& a, cudaStream_t s) {
  const int64_t items = a.expert_ids ? a.n_tokens : 1;  // blocks per row tile of each product
  if constexpr (M::kTwoTiles) {  // (Q4_K; Q5_K's form would spill under the three-block cap)
    if (takes_three_blocks(a, items)) {
      const dim3 grid{unsigned(ceil_div(a.max_rows(), int64_t(kMmaRows))), unsigned(items), 1u + unsigned(a.n_more)};
      pdl::launch(gemv_q8_one_kernel<M, 1, L, 1, 3>, grid, kMmaWarps * 32, 0, s, a);
      return;
    }
  }
  // Two tiles also where their blocks still fill every multiprocessor once (2 per SM fit): the
  // attention output 6144 x 16384 in 192 blocks, 19.8-19.9 us against 20.4-20.7 in 384 one-tile
  // blocks (1.45 waves; H200, session 26). (The bf16 kernel measured the other way there.)
  const bool two = M::kTwoTiles && (one_token_two_tiles(a) || a.blocks_of_all(2 * kMmaRows) * items >= a.sm_count);
  const int nt = two ? 2 : 1;
  const dim3 grid{unsigned(ceil_div(a.max_rows(), int64_t(kMmaRows) * nt)), unsigned(items), 1u + unsigned(a.n_more)};
  if constexpr (M::kTwoTiles) {
    if (two) {
      pdl::launch(gemv_q8_one_kernel<M, 2, L, 1, 2>, grid, kMmaWarps * 32, 0, s, a);
      return;
    }
  }
  pdl::launch(gemv_q8_one_kernel<M, 1, L, M::kUnrollOneTile, 2>, grid, kMmaWarps * 32, 0, s, a);
}

template <class M>
void launch_type(const MatArgs& a, cudaStream_t s) {
  if (a.xr) launch_levels<M, 2>(a, s);
  else launch_levels<M, 1>(a, s);
}

}  // namespace

bool q8_one_token_supported(gguf::GgmlType t) { return t == gguf::GgmlType::Q4_K || t == gguf::GgmlType::Q5_K; }

void launch_q8_one(gguf::GgmlType t, const MatArgs& a, cudaStream_t s) {
  if (a.group_offsets || (!a.expert_ids && a.n_tokens != 1))
    fail("cuda::launch_q8_one: one token per product (got {} tokens{})", a.n_tokens,
         a.group_offsets ? ", grouped" : "");
  if (!a.xq || !a.xb) fail("cuda::launch_q8_one: no quantized activations");
  if (t == gguf::GgmlType::Q4_K) launch_type<Q4KOne>(a, s);
  else if (t == gguf::GgmlType::Q5_K) launch_type<Q5KOne>(a, s);
  else fail("cuda::launch_q8_one: no one-token int8 tensor-core kernel for {}", gguf::type_name(t));
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
