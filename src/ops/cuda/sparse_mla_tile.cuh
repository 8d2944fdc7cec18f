// What the attention kernels share (sparse_mla.cu: latent rows as bf16 tiles in shared memory;
// sparse_mla_fp8.cu: fp8 rows read as stored; sparse_mla_sm90.cu: the Hopper kernel): the launch
// geometry, a selection entry -> cache slot, a k-step of the scores, the online-softmax step, and the
// mma.sync kernels' score exchange between the two warps of a pair.
#pragma once
#include <cmath>
#include <cstdint>

#include "ops/cuda/attention.h"
#include "ops/cuda/attention_smem.h"
#include "ops/cuda/mma.cuh"

namespace sparsemla::cuda {

constexpr float kLog2e = 1.4426950408889634f;

// Floats of one split's partial output per (token, split, head), the rows the split merge
// (mla_combine_kernel) reads: kv_lora unnormalized sums, the running maximum, the denominator, and
// two floats of padding, so that each row of kv_lora = 512 starts 16-byte aligned (the Hopper kernel
// stores a row with one bulk copy).
__host__ __device__ constexpr int64_t partial_row_floats(int kv_lora) { return int64_t(kv_lora) + 4; }

// The split merge's weights for up to kMergeMaxSplits splits, w[s] = exp2(m[s] - M) / L, from each
// split's running maximum m[s] (log2 domain; -inf for an empty split and for s past the splits) and
// denominator l[s] (0 there), formed as mla_combine_kernel forms them: its lanes 0..7 hold the
// terms exp2(m[s] - M) l[s] (the other lanes 0) and add them by xor shuffles 16, 8, .., 1, which for
// 8 terms is the tree below. The Hopper kernel's cluster merge (merge_splits) takes its weights from
// here and adds w[s] times split s's sums in split order, as the merge kernel does: the same bits
// (SparseMlaOnTheHost.ClusterMergeHasTheMergeKernelsBits).
// The terms and their sums are each rounded on their own, never fused into an FMA by the compiler: in
// the merge kernel they meet only after its shuffles.
constexpr int kMergeMaxSplits = 8;
__host__ __device__ inline float merge_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;  // (the host emulation)
  return r;
#endif
}
__host__ __device__ inline float merge_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  volatile float r = a + b;
  return r;
#endif
}
__host__ __device__ inline void merge_weights8(const float (&m)[kMergeMaxSplits], const float (&l)[kMergeMaxSplits],
                                               float (&w)[kMergeMaxSplits]) {
  float M = -INFINITY;
#pragma unroll
  for (int s = 0; s < kMergeMaxSplits; ++s) M = fmaxf(M, m[s]);
  float v[kMergeMaxSplits];
#pragma unroll
  for (int s = 0; s < kMergeMaxSplits; ++s) {
    w[s] = m[s] == -INFINITY ? 0.0f : exp2f(m[s] - M);
    v[s] = merge_mul(w[s], l[s]);
  }
  const float L = merge_add(merge_add(merge_add(v[0], v[4]), merge_add(v[2], v[6])),
                            merge_add(merge_add(v[1], v[5]), merge_add(v[3], v[7])));
  const float inv = L > 0.0f ? 1.0f / L : 0.0f;
#pragma unroll
  for (int s = 0; s < kMergeMaxSplits; ++s) w[s] *= inv;
}

struct MlaGeometry {
  int d;                   // kv_lora + rope
  int d_pad;               // d rounded up to 32 (two halves of whole k-steps)
  int stride;              // smem row stride in bf16 values (the bf16-tile kernel)
  int splits;
  int tiles_per_split;
  int hg;                  // head groups of 16 per block (1, 2 or 4)
  int stages;              // tiles in flight
  int tile_pairs = 1;      // sets of warps per head group taking alternate tiles (the mma kernel's TP)
  int raw_stage;           // bytes of a stage of fp8 rows as stored (mla_smem::fp8_stage_bytes)
  int score_bytes;         // bytes of the score exchange (mla_smem::score_bytes)
  size_t launch_smem = 0;  // > the block's bytes: asked for to emulate a smaller device (smem_per_sm)
};

__host__ __device__ inline int latent_groups(int kv_lora) { return (kv_lora + kFp8Group - 1) / kFp8Group; }

// The entries of token t's selection its blocks go over: with selections in top_k's order
// (AttentionArgs::selected_front) the first min(top_k, n_ctx[t]), since a token has at most n_ctx
// positions and they come first (the rest are -1: the prompt's first top_k tokens of a prefill
// skip those tiles); else all top_k. Dense: the token's context.
__device__ __forceinline__ int token_rows(const AttentionArgs& a, int t) {
  if (!a.selected) return a.n_ctx[t];
  return a.selected_front ? min(a.top_k, a.n_ctx[t]) : a.top_k;
}

// Position index -> slot, or -1 for an unused entry.
__device__ __forceinline__ int64_t row_slot(const AttentionArgs& a, int t, int seq, int idx, int n_rows) {
  if (idx >= n_rows) return -1;
  const int pos = a.selected ? a.selected[int64_t(t) * a.top_k + idx] : idx;
  if (pos < 0) return -1;
  return slot_of(a.latent.block_tables, a.latent.max_blocks, a.latent.block_size, seq, pos);
}

// The rows of a block (blockIdx: x head group, y token, z split): positions r_begin .. r_end of
// the token's selection (or context, dense) in sequence seq.
struct BlockRows {
  int t, split, seq, n_rows, r_begin, r_end;
};
__device__ __forceinline__ BlockRows block_rows(const AttentionArgs& a, const MlaGeometry& geo) {
  BlockRows b;
  b.t = blockIdx.y;
  b.split = blockIdx.z;
  b.seq = a.seq[b.t];
  b.n_rows = token_rows(a, b.t);
  b.r_begin = b.split * geo.tiles_per_split * mla_smem::kRows;
  b.r_end = min(b.n_rows, b.r_begin + geo.tiles_per_split * mla_smem::kRows);
  return b;
}

// Looks up the slots of the chunk of rows from c0 (at most kChunk), 32 bits each (kNoSlot: no
// row), once every thread of the block is done with the previous chunk; every thread calls this.
// Returns the chunk's rows.
__device__ __forceinline__ int load_chunk_slots(uint32_t* sSlot, const AttentionArgs& a, const BlockRows& br, int c0,
                                                int tid, int threads) {
  const int rows = min(br.r_end - c0, mla_smem::kChunk);
  __syncthreads();  // the previous chunk's slots and tiles are no longer read
  for (int j = tid; j < rows; j += threads) {
    const int64_t slot = row_slot(a, br.t, br.seq, c0 + j, br.n_rows);
    sSlot[j] = slot < 0 ? mla_smem::kNoSlot : uint32_t(slot);
  }
  __syncthreads();
  return rows;
}

// One k-step of 16 of S = Q K^T, 16 heads x 32 rows, from bf16 in shared memory: this lane's ldmatrix
// addresses of the q rows, of latent rows 0-15 and of rows 16-31 ([row][dim] = B's [n][k]).
__device__ __forceinline__ void score_kstep(float s[4][4], const void* qa, const void* kb0, const void* kb1) {
  uint32_t fa[4], fb0[4], fb1[4];
  ldmatrix_x4(fa, qa);
  ldmatrix_x4(fb0, kb0);
  ldmatrix_x4(fb1, kb1);
  mma_16816(s[0], fa, fb0, __nv_bfloat16());
  mma_16816(s[1], fa, fb0 + 2, __nv_bfloat16());
  mma_16816(s[2], fa, fb1, __nv_bfloat16());
  mma_16816(s[3], fa, fb1 + 2, __nv_bfloat16());
}

// Slack of the lazy softmax maximum (log2 units): the running maximum m moves only when a tile's
// maximum passes it by more than this, so P = 2^(s - m) <= 2^kMaxSlack (256: within fp16 and bf16,
// whose P feeds the products) and after the first tiles of a row m, and with it the output's
// factor alpha = 1, almost never changes. The result is the same up to rounding: the output and
// the denominator are both taken against the same m.
constexpr float kMaxSlack = 8.0f;

// The online-softmax step on a lane's two rows of NT n-tiles of C fragments (s[4 nt + e]: e = 0, 1
// row g, e = 2, 3 row g + 8; already in log2 units, masked entries -inf): s becomes P
// (unnormalized), m and l advance, alpha is the factor of the running output. Lazy: the maximum
// moves by kMaxSlack steps (above) and 2^x is fast_exp2 (mma.cuh); else m is the exact running maximum.
template <int NT, bool Lazy = false>
__device__ __forceinline__ void online_softmax(float* s, float m[2], float l[2], float alpha[2]) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * rr], s[4 * nt + 2 * rr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // (Lazy: -inf + slack is -inf, so the first live tile always sets m.)
    const float m_new = Lazy ? (mx > m[rr] + kMaxSlack ? mx : m[rr]) : fmaxf(m[rr], mx);
    const bool none = m_new == -INFINITY;
    if constexpr (Lazy) alpha[rr] = m_new == m[rr] ? 1.0f : fast_exp2(m[rr] - m_new);
    else alpha[rr] = none ? 1.0f : exp2f(m[rr] - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 2 * rr; e < 2 * rr + 2; ++e) {
        const float x = s[4 * nt + e] - m_new;
        const float p = none ? 0.0f : Lazy ? fast_exp2(x) : exp2f(x);
        s[4 * nt + e] = p;
        sum += p;
      }
    l[rr] = l[rr] * alpha[rr] + sum;
    m[rr] = m_new;
  }
}

// Whether a warp's running output needs rescaling: some lane's factor is not exactly 1. With the
// lazy maximum (and the fp8-row kernel's lazy scale) that is rare after a row's first tiles, and
// the warp skips its output's multiplications; x * 1 = x, so the result is the same bit for bit.
__device__ __forceinline__ bool warp_rescales(float f0, float f1) {
  return !__all_sync(0xffffffffu, f0 == 1.0f && f1 == 1.0f);
}

// The warps of a pair (half 0 and 1) each hold s = their half of q . row for 16 heads x 32 rows (C
// fragments of four n-tiles of 8 rows). Adds the halves through shared memory (one barrier: every
// thread of the block calls this), masks rows past `valid` or without a slot, and takes the online
// softmax step (lazy: online_softmax) on rows g and g + 8: s becomes P (unnormalized, <= 256), m and
// l advance, and alpha is the factor of the running output. sS: [pairs][2 halves][16][kSStride].
__device__ __forceinline__ void pair_softmax(float s[4][4], float* sS, int pair, int half, int lane,
                                             const uint32_t* slots, int valid, float sl2, float m[2], float l[2],
                                             float alpha[2]) {
  using mla_smem::kSStride;
  const int g = lane / 4, q4 = lane % 4;
  float* mine = sS + (pair * 2 + half) * 16 * kSStride;
  // A lane's two columns of an n-tile as one 8-byte store (and load below): with kSStride = 8 mod
  // 32, each half warp's 16 lanes cover the 32 banks once.
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int c = nt * 8 + q4 * 2;
    *reinterpret_cast<float2*>(mine + g * kSStride + c) = make_float2(s[nt][0], s[nt][1]);
    *reinterpret_cast<float2*>(mine + (g + 8) * kSStride + c) = make_float2(s[nt][2], s[nt][3]);
  }
  // The tile's live rows as one mask (a row per lane), read before the barrier.
  const uint32_t live = __ballot_sync(0xffffffffu, lane < valid && slots[lane] != mla_smem::kNoSlot) >> (2 * q4);
  __syncthreads();
  const float* s0 = sS + (pair * 2) * 16 * kSStride;
  const float* s1 = s0 + 16 * kSStride;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int at = (g + 8 * rr) * kSStride + nt * 8 + q4 * 2;
      const float2 a = *reinterpret_cast<const float2*>(s0 + at), b = *reinterpret_cast<const float2*>(s1 + at);
      s[nt][2 * rr] = (live >> (nt * 8)) & 1u ? (a.x + b.x) * sl2 : -INFINITY;
      s[nt][2 * rr + 1] = (live >> (nt * 8 + 1)) & 1u ? (a.y + b.y) * sl2 : -INFINITY;
    }
  online_softmax<4, true>(s[0], m, l, alpha);
}

// Completes the denominators over the four lanes of a row (after the last tile).
__device__ __forceinline__ void pair_denominators(float l[2]) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
  }
}

}  // namespace sparsemla::cuda
