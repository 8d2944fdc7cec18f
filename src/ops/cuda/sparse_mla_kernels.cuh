// The generic sparse MLA attention kernels of sparse_mla.cu (the description is there): the mma
// kernel over bf16 tiles of bf16 or fp8 latent rows, the merge of its splits, and the fma kernel;
// with the geometry and launch (kernel, grid, threads, shared memory) of the mma kernel that
// sparse_mla() chooses. In a header of their own so that the host emulation (tests/host_emulation)
// builds and runs them where there is no GPU; sparse_mla.cu launches them.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "ops/cuda/attention.h"
#include "ops/cuda/attention_smem.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/dynamic_smem.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/sparse_mla_tile.cuh"

namespace sparsemla::cuda::mla {

using mla_smem::kChunk;
using mla_smem::kNoSlot;
using mla_smem::kRows;
using mla_smem::nv_tiles;
using Geometry = MlaGeometry;

// A thread's 16-byte pieces 0, STEP, 2 STEP, ... below n of a gathered row: copied from src to dst
// (cp.async) where the row exists, else zeros. The addresses advance by a constant (the copy loop
// with each piece's address computed from its index, 64-bit, was 32% of the kernel's instructions
// at one token: H100, Nsight; in this form the kernel's time is within the spread of the former's:
// H100, session 35).
template <int STEP, class T>
__device__ __forceinline__ void copy_row_pieces(T* dst, const uint8_t* src, int n, bool exists) {
  uint8_t* d = reinterpret_cast<uint8_t*>(dst);
  if (exists) {
    for (int c = 0; c < n; c += STEP, d += 16 * STEP, src += 16 * STEP) cp_async16(d, src);
  } else {
    for (int c = 0; c < n; c += STEP, d += 16 * STEP) *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
  }
}

// One fp8 latent row (kv_lora e4m3 values, one fp32 scale per kFp8Group, rope bf16 values after the
// scales) widened by one warp into a bf16 tile row: lane l takes the 8-value pieces l, l + 32, ...
// and the rope words likewise (consecutive lanes, consecutive bytes: no bank conflicts). `exists`
// false: the row is zeros (its source is not read).
__device__ __forceinline__ void widen_fp8_row(__nv_bfloat16* dst, const uint8_t* row, int kv_lora, int rope, int lane,
                                              bool exists) {
  const float* scales = reinterpret_cast<const float*>(row + kv_lora);
  for (int c = lane; c < kv_lora / 8; c += 32) {
    uint4 w = make_uint4(0, 0, 0, 0);
    if (exists) w = widen_fp8x8(*reinterpret_cast<const uint2*>(row + c * 8), scales[c / (kFp8Group / 8)]);
    *reinterpret_cast<uint4*>(dst + c * 8) = w;
  }
  const uint32_t* rope_words = reinterpret_cast<const uint32_t*>(row + kv_lora + 4 * latent_groups(kv_lora));
  for (int c = lane; c < rope / 2; c += 32)
    *reinterpret_cast<uint32_t*>(dst + kv_lora + 2 * c) = exists ? rope_words[c] : 0u;
}

// TP: tile pairs. 1: the block's pairs of warps take every tile together. 2 (16 or 32 heads, two stages):
// a second set of pairs takes every other tile, so that the two tiles in flight are computed at
// once, each set with its own running maximum, denominator and output, merged at the end through
// shared memory (MlaGeometry::tile_pairs: where the launch takes it); fp8 rows then have two bf16
// tiles to be widened into.
template <int NV, bool FP8, int HG, int STAGES, int KS, int TP = 1>
__global__ void __launch_bounds__(HG * 64 * TP) mla_mma_kernel(AttentionArgs a, Geometry geo, float* part) {
  static_assert(TP == 1 || (TP == 2 && STAGES == 2 && HG <= 2), "tile pairs: 16 or 32 heads, two stages");
  constexpr int THREADS = HG * 64 * TP;
  constexpr int NBUF = FP8 && TP == 1 ? 1 : STAGES;  // bf16 tiles (fp8 rows with one set widen into one)
  SPARSEMLA_DYNAMIC_SMEM(smem);
  const int stride = geo.stride, D = geo.d;
  const int64_t row_bytes = a.latent.row_bytes;
  unsigned char* sp = smem;
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(sp);  // [HG * 16][stride]
  sp += size_t(HG) * 16 * stride * 2;
  __nv_bfloat16* sKbuf = reinterpret_cast<__nv_bfloat16*>(sp);  // [NBUF][32][stride]
  sp += size_t(NBUF) * kRows * stride * 2;
  // fp8 rows as stored, double-buffered ([2][32][row_bytes], each stage padded to fp8_stage_bytes);
  // the scores [HG pairs][2 halves][16][33] go in the stage of the tile being computed (widened by
  // then), or after the tiles without fp8 stages.
  uint8_t* sRaw = sp;
  const int raw_stage = geo.raw_stage;
  sp += FP8 && STAGES == 2 ? 2 * raw_stage : geo.score_bytes;
  uint32_t* sSlot = reinterpret_cast<uint32_t*>(sp);  // [kChunk] cache slots (32 bits: GpuCache checks)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q4 = lane % 4;
  const int tp = warp / (2 * HG);  // the warp's set of pairs: tiles it + tp of each step of TP tiles
  const int pair = (warp % (2 * HG)) / 2, half = warp % 2;
  const int h0 = blockIdx.x * HG * 16;
  const BlockRows br = block_rows(a, geo);
  const int t = br.t, split = br.split, r_begin = br.r_begin, r_end = br.r_end;

  {  // the row tiles' pad columns (D .. stride) are zero; the copies never write them
    const int pad = (stride - D) / 8, rows = NBUF * kRows;
    for (int i = tid; i < rows * pad; i += THREADS)
      *reinterpret_cast<uint4*>(sKbuf + (i / pad) * stride + D + (i % pad) * 8) = make_uint4(0, 0, 0, 0);
  }
  // Queries, four values at a time, many loads in flight; pad columns and missing heads are zero.
  // Called once the first tile's copy is under way. A block has 4 TP threads per head row (THREADS =
  // 4 TP x HG x 16): thread tid takes row tid / 4 TP and its columns (tid % 4 TP) x 4 + 16 TP k, so a
  // warp's loads of a round are 8 / TP rows' 64 TP contiguous bytes, and no index is divided (with the merge's
  // change, taking out the runtime division of a flat index by the row's float4s cut the kernel's
  // warp instructions at one token by 26%: H100, Nsight, GLM-5 at 1K, 638 K -> 470 K for 272 mma per warp).
  auto load_q = [&]() {
    constexpr int kInFlight = 12, PER_HEAD = 4 * TP;
    static_assert(THREADS == PER_HEAD * HG * 16, "4 TP threads per head row");
    const int r = tid / PER_HEAD, h = h0 + r;
    const float* q = a.q + (int64_t(t) * a.heads + min(h, a.heads - 1)) * D;
    __nv_bfloat16* dst = sQ + r * stride;
    for (int c0 = (tid % PER_HEAD) * 4; c0 < stride; c0 += 4 * PER_HEAD * kInFlight) {
      float4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int c = c0 + 4 * PER_HEAD * u;
        v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (h < a.heads && c < D) v[u] = *reinterpret_cast<const float4*>(q + c);
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int c = c0 + 4 * PER_HEAD * u;
        if (c < stride)
          *reinterpret_cast<uint2*>(dst + c) = make_uint2(pack_bf16(v[u].x, v[u].y), pack_bf16(v[u].z, v[u].w));
      }
    }
  };
  bool q_loaded = false;

  float o[NV][4];
#pragma unroll
  for (int j = 0; j < NV; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float sl2 = a.scale * kLog2e;
  const int ksteps = KS > 0 ? KS : geo.d_pad / 32;  // k-steps of 16 in each half (KS: known at compile time)
  const uint8_t* base = static_cast<const uint8_t*>(a.latent.data);

  for (int c0 = r_begin; c0 < r_end; c0 += kChunk) {
    const int chunk_rows = load_chunk_slots(sSlot, a, br, c0, tid, THREADS);
    const int n_tiles = (chunk_rows + kRows - 1) / kRows;

    // Starts copying tile j of the chunk into its buffer (bf16 rows, or raw fp8 rows), or for fp8
    // without a second stage converts it straight from global memory.
    auto issue = [&](int j) {
      const uint32_t* slots = sSlot + j * kRows;
      const int valid = min(kRows, chunk_rows - j * kRows);
      if constexpr (!FP8) {
        __nv_bfloat16* dstK = sKbuf + (STAGES == 2 ? (j & 1) : 0) * kRows * stride;
        constexpr int PER_ROW = THREADS / kRows;  // threads per row
        const int r = tid / PER_ROW, c0 = tid % PER_ROW;
        const uint32_t slot = r < valid ? slots[r] : kNoSlot;
        copy_row_pieces<PER_ROW>(dstK + r * stride + c0 * 8, base + int64_t(slot) * row_bytes + c0 * 16, D / 8 - c0,
                                 slot != kNoSlot);
      } else if constexpr (STAGES == 2) {
        uint8_t* dstR = sRaw + (j & 1) * raw_stage;
        constexpr int PER_ROW = THREADS / kRows;
        const int r = tid / PER_ROW, c0 = tid % PER_ROW;
        const uint32_t slot = r < valid ? slots[r] : kNoSlot;
        copy_row_pieces<PER_ROW>(dstR + r * row_bytes + c0 * 16, base + int64_t(slot) * row_bytes + c0 * 16,
                                 int(row_bytes / 16) - c0, slot != kNoSlot);
      } else {
        // Each warp a row at a time, its lanes along the row (no index divided; missing rows zero).
        for (int r = warp; r < kRows; r += THREADS / 32) {
          const uint32_t slot = r < valid ? slots[r] : kNoSlot;
          widen_fp8_row(sKbuf + r * stride, base + int64_t(slot) * row_bytes, a.kv_lora, a.rope, lane, slot != kNoSlot);
        }
      }
    };

    issue(0);
    if constexpr (TP == 2) {
      if (n_tiles > 1) issue(1);
    }
    cp_async_commit();
    if (!q_loaded) {
      load_q();  // visible to all warps after the barrier at the top of the tile loop
      q_loaded = true;
    }
    for (int it0 = 0; it0 < n_tiles; it0 += TP) {
      const int it = it0 + tp;  // this warp's tile (TP = 2: it may be past the chunk's last)
      if constexpr (TP == 2) {
        cp_async_wait_group<0>();
      } else if constexpr (STAGES == 2) {
        if (it + 1 < n_tiles) issue(it + 1);
        cp_async_commit();
        cp_async_wait_group<1>();
      } else {
        cp_async_wait_group<0>();
      }
      __syncthreads();
      const __nv_bfloat16* sK = sKbuf + (NBUF == 2 ? (it & 1) : 0) * kRows * stride;
      if constexpr (FP8 && STAGES == 2) {  // widen the landed fp8 tile(s) into the bf16 buffer(s)
#pragma unroll
        for (int u = 0; u < TP; ++u) {
          const int tile = it0 + u;
          if (tile >= n_tiles) break;
          const uint8_t* raw = sRaw + (tile & 1) * raw_stage;
          __nv_bfloat16* dstK = sKbuf + (NBUF == 2 ? (tile & 1) : 0) * kRows * stride;
          // Each warp a row at a time, its lanes along the row: no index divided (the flat index
          // divided by the row's runtime piece count cost ~20 instructions per 8 values: H100,
          // Nsight, GLM-5 fp8 batch 1, IMAD 348 K warp instructions against 57 K for bf16 rows).
          for (int r = warp; r < kRows; r += THREADS / 32)
            widen_fp8_row(dstK + r * stride, raw + r * row_bytes, a.kv_lora, a.rope, lane, true);
        }
        __syncthreads();
      }
      const uint32_t* slots = sSlot + it * kRows;
      const int valid = max(0, min(kRows, chunk_rows - it * kRows));
      const bool computes = TP == 1 || valid > 0;  // (warp-uniform; a set without a tile still meets the barriers)
      float* sS = reinterpret_cast<float*>(sRaw + (FP8 && STAGES == 2 ? (it & 1) * raw_stage : 0));

      // S = Q K^T over this warp's half of the dims: [16 heads][32 rows]
      float s[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      {
        const int mi = lane / 8, ri = lane % 8;
        // A: rows (mi % 2) * 8 + ri, columns (mi / 2) * 8; B ([row][dim] = [n][k]): rows (mi / 2) * 8 + ri
        // (+16 for the second pair of n-tiles), columns (mi % 2) * 8.
        const __nv_bfloat16* qa = sQ + (pair * 16 + (mi % 2) * 8 + ri) * stride + half * ksteps * 16 + (mi / 2) * 8;
        const __nv_bfloat16* kb = sK + ((mi / 2) * 8 + ri) * stride + half * ksteps * 16 + (mi % 2) * 8;
        if (computes) {
#pragma unroll(KS > 0 ? KS : 1)
          for (int ks = 0; ks < ksteps; ++ks) {
            score_kstep(s, qa + ks * 16, kb + ks * 16, kb + 16 * stride + ks * 16);
          }
        }
      }
      float alpha[2];
      pair_softmax(s, sS, tp * HG + pair, half, lane, slots, valid, sl2, m, l, alpha);
      if (warp_rescales(alpha[0], alpha[1])) {
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          o[j][0] *= alpha[0];
          o[j][1] *= alpha[0];
          o[j][2] *= alpha[1];
          o[j][3] *= alpha[1];
        }
      }

      // O += P V over this warp's half of the output dims
#pragma unroll
      for (int kk = 0; kk < (computes ? 2 : 0); ++kk) {
        const uint32_t fa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                                pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
        const int mi = lane / 8, ri = lane % 8;
        const __nv_bfloat16* vrow = sK + (kk * 16 + (mi % 2) * 8 + ri) * stride + half * NV * 8 + (mi / 2) * 8;
#pragma unroll
        for (int j = 0; j < NV; j += 2) {
          uint32_t fb[4];
          ldmatrix_x4_trans(fb, vrow + j * 8);
          mma_16816(o[j], fa, fb, __nv_bfloat16());
          mma_16816(o[j + 1], fa, fb + 2, __nv_bfloat16());
        }
      }
      __syncthreads();  // this tile's buffers and S are free again
      if constexpr (TP == 2) {
        if (it0 + 2 < n_tiles) {
          issue(it0 + 2);
          if (it0 + 3 < n_tiles) issue(it0 + 3);
          cp_async_commit();
        }
      } else if constexpr (STAGES == 1) {
        if (it + 1 < n_tiles) {
          issue(it + 1);
          cp_async_commit();
        }
      }
    }
  }

  pair_denominators(l);
  if constexpr (TP == 2) {
    // The second set hands its output, maxima and denominators to the first through the tile buffers
    // (free since the loop's last barrier; mla_smem::tile_pairs_fit); the first merges them into its own.
    float4* xo = reinterpret_cast<float4*>(sKbuf);  // [2 HG warps][NV][32 lanes]
    float4* xm = xo + 2 * HG * NV * 32;             // [2 HG warps][32 lanes]: m, l of rows g and g + 8
    const int w = warp % (2 * HG);
    if (tp == 1) {
#pragma unroll
      for (int j = 0; j < NV; ++j) xo[(w * NV + j) * 32 + lane] = make_float4(o[j][0], o[j][1], o[j][2], o[j][3]);
      xm[w * 32 + lane] = make_float4(m[0], m[1], l[0], l[1]);
    }
    __syncthreads();
    if (tp == 1) return;
    const float4 x = xm[w * 32 + lane];
    const float xms[2] = {x.x, x.y}, xls[2] = {x.z, x.w};
    float f[2], fx[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const float M = fmaxf(m[rr], xms[rr]);
      f[rr] = m[rr] == -INFINITY ? 0.0f : exp2f(m[rr] - M);
      fx[rr] = xms[rr] == -INFINITY ? 0.0f : exp2f(xms[rr] - M);
      l[rr] = l[rr] * f[rr] + xls[rr] * fx[rr];
      m[rr] = M;
    }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const float4 v = xo[(w * NV + j) * 32 + lane];
      o[j][0] = o[j][0] * f[0] + v.x * fx[0];
      o[j][1] = o[j][1] * f[0] + v.y * fx[0];
      o[j][2] = o[j][2] * f[1] + v.z * fx[1];
      o[j][3] = o[j][3] * f[1] + v.w * fx[1];
    }
  }
  // Output: normalized when unsplit, else the split's unnormalized sum with its max and denominator.
  // Pairs of dims as one 8-byte store (kv_lora is even): a warp's store fills whole 32-byte sectors.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int h = h0 + pair * 16 + g + rr * 8;  // head of this row
    if (h >= a.heads) continue;
    if (geo.splits == 1) {
      const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
      float* dst = a.out + (int64_t(t) * a.heads + h) * a.kv_lora;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int c = half * NV * 8 + j * 8 + q4 * 2;
        if (c < a.kv_lora) *reinterpret_cast<float2*>(dst + c) = make_float2(o[j][2 * rr] * inv, o[j][2 * rr + 1] * inv);
      }
    } else {
      const int64_t row = (int64_t(t) * geo.splits + split) * a.heads + h;
      float* dst = part + row * partial_row_floats(a.kv_lora);
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int c = half * NV * 8 + j * 8 + q4 * 2;
        if (c < a.kv_lora) *reinterpret_cast<float2*>(dst + c) = make_float2(o[j][2 * rr], o[j][2 * rr + 1]);
      }
      if (half == 0 && q4 == 0) {
        dst[a.kv_lora] = m[rr];
        dst[a.kv_lora + 1] = l[rr];
      }
    }
  }
}

// Merges the splits of one (token, head): out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s.
// A block takes kCombineDims output dims of one (token, head). Every thread first loads its dim of
// the first kCombineEarly splits (independent of the weights, so these loads and the weights' are in
// flight together: one round trip to L2 where there were three at 32 splits); its first warp turns
// the splits' maxima and denominators (one load each per lane) into weights in shared memory; then
// every thread sums its dim over the splits in order.
constexpr int kMaxSplits = 128;
constexpr int kCombineDims = 128;
constexpr int kCombineEarly = 32;  // splits whose values a thread loads before the weights
__global__ void __launch_bounds__(kCombineDims) mla_combine_kernel(AttentionArgs a, int splits, const float* part) {
  __shared__ float s_w[kMaxSplits];
  const int t = blockIdx.z, h = blockIdx.y, tid = threadIdx.x;
  const int64_t stride = partial_row_floats(a.kv_lora);
  const int64_t split_step = int64_t(a.heads) * stride;
  const float* p = part + (int64_t(t) * splits * a.heads + h) * stride;
  const int c = blockIdx.x * kCombineDims + tid;
  const int n_early = min(splits, kCombineEarly);
  float early[kCombineEarly];
#pragma unroll
  for (int sp = 0; sp < kCombineEarly; ++sp) early[sp] = sp < n_early && c < a.kv_lora ? p[sp * split_step + c] : 0.0f;
  if (tid < 32) {
    constexpr int kPerLane = kMaxSplits / 32;
    float ms[kPerLane], ls[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int sp = tid + 32 * j;
      ms[j] = sp < splits ? p[sp * split_step + a.kv_lora] : -INFINITY;
      ls[j] = sp < splits ? p[sp * split_step + a.kv_lora + 1] : 0.0f;
    }
    float M = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) M = fmaxf(M, ms[j]);
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float L = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      ms[j] = ms[j] == -INFINITY ? 0.0f : exp2f(ms[j] - M);
      L += ms[j] * ls[j];
    }
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (tid + 32 * j < splits) s_w[tid + 32 * j] = ms[j] * inv;
  }
  __syncthreads();
  if (c >= a.kv_lora) return;
  float acc = 0.0f;
#pragma unroll
  for (int sp = 0; sp < kCombineEarly; ++sp)
    if (sp < n_early) acc += s_w[sp] * early[sp];
#pragma unroll 16
  for (int sp = n_early; sp < splits; ++sp) acc += s_w[sp] * p[sp * split_step + c];
  a.out[(int64_t(t) * a.heads + h) * a.kv_lora + c] = acc;
}

// One block per (token, head): 128 rows at a time, one row per thread for the logits, then every
// thread accumulates its output dims over the chunk.
template <KvDtype DT>
__device__ __forceinline__ float latent_value(const AttentionArgs& a, const uint8_t* row, int c) {
  if constexpr (DT == KvDtype::F32) {
    return reinterpret_cast<const float*>(row)[c];
  } else if constexpr (DT == KvDtype::FP8) {
    if (c < a.kv_lora)
      return fp8_to_float(row[c]) * reinterpret_cast<const float*>(row + a.kv_lora)[c / kFp8Group];
    return __bfloat162float(
        reinterpret_cast<const __nv_bfloat16*>(row + a.kv_lora + 4 * latent_groups(a.kv_lora))[c - a.kv_lora]);
  } else {
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[c]);
  }
}

constexpr int kFmaThreads = 128, kFmaMaxOut = 8;  // kv_lora <= 1024

template <KvDtype DT>
__global__ void __launch_bounds__(kFmaThreads) mla_fma_kernel(AttentionArgs a) {
  __shared__ float sP[kFmaThreads];
  __shared__ int64_t sSlot[kFmaThreads];
  __shared__ float sRed[kFmaThreads / 32];
  const int t = blockIdx.y, h = blockIdx.x, tid = threadIdx.x, D = a.kv_lora + a.rope;
  const int seq = a.seq[t];
  const int n_rows = token_rows(a, t);
  const float* q = a.q + (int64_t(t) * a.heads + h) * D;
  const uint8_t* base = static_cast<const uint8_t*>(a.latent.data);
  float acc[kFmaMaxOut] = {};
  float m = -INFINITY, l = 0.0f;
  for (int r0 = 0; r0 < n_rows; r0 += kFmaThreads) {
    const int64_t slot = row_slot(a, t, seq, r0 + tid, n_rows);
    float logit = -INFINITY;
    if (slot >= 0) {
      const uint8_t* row = base + slot * a.latent.row_bytes;
      float dot = 0.0f;
      for (int c = 0; c < D; ++c) dot += q[c] * latent_value<DT>(a, row, c);
      logit = dot * a.scale;
    }
    float mx = logit;
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (tid % 32 == 0) sRed[tid / 32] = mx;
    __syncthreads();
    mx = sRed[0];
    for (int w = 1; w < kFmaThreads / 32; ++w) mx = fmaxf(mx, sRed[w]);
    const float m_new = fmaxf(m, mx);
    const float alpha = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    const float p = logit == -INFINITY ? 0.0f : expf(logit - m_new);
    sP[tid] = p;
    sSlot[tid] = slot;
    __syncthreads();
    float sum = 0.0f;
    for (int j = 0; j < kFmaThreads; ++j) sum += sP[j];
    l = l * alpha + sum;
    m = m_new;
    for (int i = 0; i < kFmaMaxOut; ++i) {
      const int c = tid + i * kFmaThreads;
      if (c >= a.kv_lora) break;
      float v = acc[i] * alpha;
      // (Unrolled by 4, not whole: fully unrolled under the unrolled i loop, ptxas spilled 5.6-12 KB
      // a thread for sm_80 / 86 / 89. The same sums in the same order.)
#pragma unroll 4
      for (int j = 0; j < kFmaThreads; ++j)
        if (sSlot[j] >= 0) v += sP[j] * latent_value<DT>(a, base + sSlot[j] * a.latent.row_bytes, c);
      acc[i] = v;
    }
    __syncthreads();
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  float* dst = a.out + (int64_t(t) * a.heads + h) * a.kv_lora;
  for (int i = 0; i < kFmaMaxOut; ++i) {
    const int c = tid + i * kFmaThreads;
    if (c < a.kv_lora) dst[c] = acc[i] * inv;
  }
}

// The geometry of an mma kernel launch with hg head groups of 16 per block and `stages` tiles in
// flight (sparse_mla() chooses both), over the `tiles` tiles of kRows of a token's rows (at least
// one) in at most `splits` (>= 1) splits of whole tiles: fewer where the tiles do not fill them;
// tile_pairs 2: two sets of warps per head group (the kernel's TP; hg 1 or 2, two stages).
inline MlaGeometry mma_geometry(const AttentionArgs& a, int hg, int stages, int tiles, int splits, int tile_pairs = 1) {
  MlaGeometry geo;
  geo.d = a.kv_lora + a.rope;
  geo.d_pad = (geo.d + 31) / 32 * 32;
  geo.stride = mla_smem::stride(a.kv_lora, a.rope);
  geo.hg = hg;
  geo.stages = stages;
  geo.raw_stage = int(mla_smem::fp8_stage_bytes(hg * tile_pairs, a.latent.row_bytes));
  geo.tile_pairs = tile_pairs;
  geo.score_bytes = int(mla_smem::score_bytes(hg * tile_pairs));
  if (tile_pairs != 1 && (tile_pairs != 2 || hg > 2 || stages != 2))
    fail("sparse_mla: tile pairs take 16 or 32 heads per block and two stages");
  if (tile_pairs == 2 && !mla_smem::tile_pairs_fit(hg, a.kv_lora, geo.stride))
    fail("sparse_mla: the tile pairs' merge does not fit the tiles");
  splits = std::min({splits, tiles, kMaxSplits});
  geo.tiles_per_split = ceil_div(tiles, splits);
  geo.splits = ceil_div(tiles, geo.tiles_per_split);
  return geo;
}

// How the mma kernel runs on `geo`: the variant for the rows' dims (NV, the unrolled k-loop of
// 512 + 64), the rows' format and geo's heads per block and stages; its grid (head groups x tokens
// x splits), threads and dynamic shared memory (geo.launch_smem where larger).
struct MmaLaunch {
  void (*kernel)(AttentionArgs, MlaGeometry, float*) = nullptr;
  dim3 grid;
  int threads = 0;
  size_t smem = 0;
};

template <int NV, bool FP8, int HG, int STAGES, int TP = 1>
MmaLaunch mma_launch_of(const AttentionArgs& a, const Geometry& geo) {
  MmaLaunch l;
  l.smem = std::max(mla_smem::bytes(HG, STAGES, FP8, geo.stride, a.latent.row_bytes, TP), geo.launch_smem);
  // GLM-5 / DeepSeek rows (512 + 64) get the k-loop unrolled: 18 k-steps of 16 per half of 288.
  l.kernel = NV == 32 && geo.d_pad == 576 ? mla_mma_kernel<NV, FP8, HG, STAGES, (NV == 32 ? 18 : 0), TP>
                                          : mla_mma_kernel<NV, FP8, HG, STAGES, 0, TP>;
  l.grid = dim3(unsigned(ceil_div(a.heads, HG * 16)), unsigned(a.T), unsigned(geo.splits));
  l.threads = HG * 64 * TP;
  return l;
}

template <int NV, bool FP8>
MmaLaunch mma_launch_variant(const AttentionArgs& a, const Geometry& geo) {
  if (geo.tile_pairs == 2) {
    if (geo.hg == 2) return mma_launch_of<NV, FP8, 2, 2, 2>(a, geo);
    return mma_launch_of<NV, FP8, 1, 2, 2>(a, geo);
  }
  if (geo.hg == 4) {
    if (geo.stages == 2) return mma_launch_of<NV, FP8, 4, 2>(a, geo);
    return mma_launch_of<NV, FP8, 4, 1>(a, geo);
  }
  if (geo.hg == 2) {
    if (geo.stages == 2) return mma_launch_of<NV, FP8, 2, 2>(a, geo);
    return mma_launch_of<NV, FP8, 2, 1>(a, geo);
  }
  // 16 heads: two stages (also within 99 KB), or one where a device has less (none known; the tests
  // emulate one).
  if (geo.stages == 2) return mma_launch_of<NV, FP8, 1, 2>(a, geo);
  return mma_launch_of<NV, FP8, 1, 1>(a, geo);
}

template <bool FP8>
MmaLaunch mma_launch_dims(const AttentionArgs& a, const Geometry& geo) {
  switch (nv_tiles(a.kv_lora)) {
    case 2: return mma_launch_variant<2, FP8>(a, geo);
    case 4: return mma_launch_variant<4, FP8>(a, geo);
    case 8: return mma_launch_variant<8, FP8>(a, geo);
    case 16: return mma_launch_variant<16, FP8>(a, geo);
    case 32: return mma_launch_variant<32, FP8>(a, geo);
    default: fail("sparse_mla: the mma kernel takes kv_lora <= 512, got {}", a.kv_lora);
  }
}

inline MmaLaunch mma_launch(const AttentionArgs& a, const Geometry& geo) {
  return a.dtype == KvDtype::FP8 ? mma_launch_dims<true>(a, geo) : mma_launch_dims<false>(a, geo);
}

}  // namespace sparsemla::cuda::mla
