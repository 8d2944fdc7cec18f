// The DSA lightning indexer's score kernels of indexer.cu (the description is there): the mma
// kernels (staged, regs, qfrag) over bf16 or fp8 index keys in the paged cache, counting top_k's
// first digit where asked, and the fma kernel; with the choice among the mma kernels, their shared
// memory and blocks (dispatch_mma, one_wave_tiles). In a header of their own so that the host
// emulation (tests/host_emulation) builds and runs them where there is no GPU; indexer.cu launches
// them.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/attention.h"
#include "ops/cuda/convert.cuh"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/dynamic_smem.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/rope.cuh"
#include "ops/cuda/topk_common.cuh"

namespace sparsemla::cuda::indexer {

constexpr int kKeysPerTile = 64;  // keys per tile: 16 x MT per warp, 4 / MT warps
constexpr int kMaxTilesPerBlock = 32;

// Value c of a key row stored as `D` (KvDtype).
template <KvDtype D>
__device__ __forceinline__ float key_value(const uint8_t* row, int c, int dim) {
  if constexpr (D == KvDtype::FP8) {
    const float* scales = reinterpret_cast<const float*>(row + dim);
    return fp8_to_float(row[c]) * scales[c / kFp8Group];
  } else if constexpr (D == KvDtype::F32) {
    return reinterpret_cast<const float*>(row)[c];
  } else {
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[c]);
  }
}

__host__ __device__ constexpr int heads_padded(int heads) { return (heads + 15) / 16 * 16; }

// Cache pages a block's keys can span: tiles * 64 keys starting anywhere in a page.
__host__ __device__ inline int pages_per_block(int tiles, int block_size) { return (tiles * kKeysPerTile + block_size - 1) / block_size + 1; }

// top_k's first digit counted with the scores (IndexerArgs::counts): a warp's scores of a tile
// grouped by digit (one match), each group's count added to a table per block of the digits it
// wrote, open addressing on digit mod kCountSlots (a block's scores usually fall in a few dozen
// neighbouring digits; a digit that finds no slot within kCountProbes goes straight to the row's
// histogram), and the table added to the row's histogram at the end, one atomic per digit seen.
// Straight atomics per score would serialize on the few digits most scores share.
constexpr int kCountSlots = 128, kCountProbes = 8;
__device__ __forceinline__ void count_scores(bool valid, float score, uint32_t* sBin, uint32_t* sCnt,
                                             uint32_t* row_hist) {
  const uint32_t bin = valid ? topk::order_key(score) >> topk::digit_shift(0) : ~0u;  // (no digit is ~0)
  const uint32_t peers = __match_any_sync(0xffffffffu, bin);
  if (!valid || int(threadIdx.x % 32) != __ffs(peers) - 1) return;
  const uint32_t c = uint32_t(__popc(peers));
  uint32_t slot = bin % kCountSlots;
  for (int i = 0; i < kCountProbes; ++i, slot = (slot + 1) % kCountSlots) {
    const uint32_t old = atomicCAS(&sBin[slot], 0u, bin + 1);  // slots hold digit + 1; 0 is free
    if (old == 0u || old == bin + 1) {
      atomicAdd(&sCnt[slot], c);
      return;
    }
  }
  atomicAdd(&row_hist[bin], c);
}
// The end of counting: once every thread of the block has counted (a barrier, so every thread
// calls this), the table's digits added to the row's histogram, one atomic per digit seen.
__device__ __forceinline__ void flush_counts(const uint32_t* sBin, const uint32_t* sCnt, uint32_t* row_hist,
                                             int threads) {
  __syncthreads();
  for (int i = int(threadIdx.x); i < kCountSlots; i += threads)
    if (const uint32_t b = sBin[i]) atomicAdd(&row_hist[b - 1], sCnt[i]);
}

// A block's share of token blockIdx.y's keys: tiles tile0 .. tile0 + n_tiles - 1 (none: n_tiles <= 0,
// and the block leaves before any barrier), the row's top_k histogram where it asked for one and
// will select with it (IndexerArgs::counts), and the cache slots of its keys from the page-table
// entries that load_pages reads once into shared memory (the key loads then need no global load
// before they can be issued).
struct BlockKeys {
  int t, n, tile0, n_tiles, seq, page0, bs, bs_shift;
  bool pow2;  // the usual page sizes: shifts instead of divisions
  uint32_t* row_hist;
  const int32_t* sPage;
  __device__ __forceinline__ int64_t slot(int p) const {
    return pow2 ? (int64_t(sPage[(p >> bs_shift) - page0]) << bs_shift) + (p & (bs - 1))
                : int64_t(sPage[p / bs - page0]) * bs + p % bs;
  }
};
__device__ __forceinline__ BlockKeys block_keys(const IndexerArgs& a, int tiles_per_block, const int32_t* sPage) {
  BlockKeys b;
  b.t = blockIdx.y;
  b.n = a.n_ctx[b.t];
  b.tile0 = blockIdx.x * tiles_per_block;
  b.n_tiles = min(tiles_per_block, (b.n + kKeysPerTile - 1) / kKeysPerTile - b.tile0);
  b.seq = a.seq[b.t];
  b.bs = a.keys.block_size;
  b.page0 = b.tile0 * kKeysPerTile / b.bs;
  b.pow2 = (b.bs & (b.bs - 1)) == 0;
  b.bs_shift = __ffs(b.bs) - 1;
  b.row_hist = a.counts.hist && b.n > a.counts.k ? a.counts.hist + int64_t(b.t) * a.counts.row_words : nullptr;
  b.sPage = sPage;
  return b;
}
// Zeroes the block's digit table where it counts and reads its page-table entries; every thread
// calls it (one barrier).
__device__ __forceinline__ void load_pages(const BlockKeys& b, const IndexerArgs& a, int32_t* sPage, uint32_t* sBin,
                                           int threads) {
  if (b.row_hist)
    for (int i = threadIdx.x; i < 2 * kCountSlots; i += threads) sBin[i] = 0;  // (sCnt follows sBin)
  const int n_pages = (min(b.n, (b.tile0 + b.n_tiles) * kKeysPerTile) - 1) / b.bs - b.page0 + 1;
  for (int i = threadIdx.x; i < n_pages; i += threads)
    sPage[i] = a.keys.block_tables[int64_t(b.seq) * a.keys.max_blocks + b.page0 + i];
  __syncthreads();
}

// Starts the copy (cp.async) of a tile's bf16 key rows, positions p0 .. p0 + 63 (those from n on
// skipped: their rows keep stale values), into dst [64][DIM + 8]; slot_of(p): key p's cache slot.
// Thread tid of THREADS copies 16-byte chunk tid % CH of rows tid / CH + u * (THREADS / CH): a
// warp's copy is whole consecutive rows.
template <int DIM, int THREADS, class T16, class SlotOf>
__device__ __forceinline__ void issue_bf16_tile(T16* dst, const uint8_t* keys, int64_t RB, int p0, int n,
                                                SlotOf slot_of) {
  constexpr int CH = DIM / 8, ROWS = THREADS / CH, STR = DIM + 8;
  static_assert(THREADS % CH == 0 && kKeysPerTile % ROWS == 0, "whole rows per pass");
  const int c = int(threadIdx.x) % CH, r0 = int(threadIdx.x) / CH;
  dst += r0 * STR + c * 8;
#pragma unroll
  for (int u = 0; u < kKeysPerTile / ROWS; ++u) {
    const int p = p0 + r0 + u * ROWS;
    if (p < n) cp_async16(dst + u * ROWS * STR, keys + slot_of(p) * RB + c * 16);
  }
}

// Starts the copy of a tile of fp8 rows (DIM + 4 bytes each) that are 64 consecutive slots of one
// page, from src: 16-byte chunks of the run, those starting in a row from n on skipped.
template <int DIM, int THREADS>
__device__ __forceinline__ void issue_fp8_run_tile(uint8_t* dst, const uint8_t* src, int p0, int n) {
  constexpr int RB = DIM + 4, CHUNKS = (kKeysPerTile * RB / 16 + THREADS - 1) / THREADS;
#pragma unroll
  for (int u = 0; u < CHUNKS; ++u) {
    const int off = (int(threadIdx.x) + u * THREADS) * 16;
    if (off < kKeysPerTile * RB && p0 + off / RB < n) cp_async16(dst + off, src + off);
  }
}

// Shared memory of the mma kernel: q [heads_pad][DIM + 8] (16-bit), bf16 key tiles [STAGES][64][DIM + 8]
// (none for fp8 keys: those are widened in registers), w [heads_pad], the block's page-table entries
// [pages] (padded to 16 bytes), fp8 rows as stored [STAGES][64][row_bytes], and when counting the
// digit table [2][kCountSlots].
template <int DIM, bool FP8, int STAGES>
size_t mma_smem_bytes(int heads, int64_t row_bytes, int pages, bool count) {
  const size_t str = DIM + 8, hp = size_t(heads_padded(heads));
  return hp * str * 2 + size_t(FP8 ? 0 : STAGES) * kKeysPerTile * str * 2 + hp * 4 + size_t(pages + 3) / 4 * 16 +
         (FP8 ? size_t(STAGES) * kKeysPerTile * size_t(row_bytes) : 0) + (count ? 2 * kCountSlots * 4 : 0);
}

// Four floats as four 16-bit values (T16), little-endian in 8 bytes.
template <class T16>
__device__ __forceinline__ uint2 pack4(float4 v) {
  if constexpr (std::is_same<T16, __half>::value) {
    const __half2 lo = __floats2half2_rn(v.x, v.y), hi = __floats2half2_rn(v.z, v.w);
    return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
  } else {
    return make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
  }
}

// x rounded to nearest even in the 16-bit type T16 (__half or __nv_bfloat16).
template <class T16>
__device__ __forceinline__ T16 round16(float x) {
  if constexpr (std::is_same<T16, __half>::value) return __float2half_rn(x);
  else return __float2bfloat16_rn(x);
}

// Token t's queries into shared memory as 16-bit values (T16), rows [rows][DIM + 8], rows of zeros
// past a.heads: 16-bit queries copied as they are (cp.async in 16-byte chunks through L1, which the
// SM's other blocks of the token then hit: through L2 alone, every block of a one-token call fetching
// the same 16 KB cost 3-5 us at 128K keys; one group committed, for the caller to wait on), fp32 ones
// with eight loads in flight per thread, each float4 stored as four 16-bit values in one 8-byte store.
template <int DIM, int THREADS, class T16>
__device__ __forceinline__ void stage_queries(T16* sQ, const IndexerArgs& a, int t, int rows) {
  constexpr int STR = DIM + 8;
  const int tid = threadIdx.x;
  if (a.q16) {
    constexpr int CH = DIM / 8;  // 16-byte chunks per head
    const uint16_t* q16 = a.q16 + int64_t(t) * a.heads * DIM;
    for (int i = tid; i < rows * CH; i += THREADS) {
      const int h = i / CH, c = i % CH;
      T16* dst = sQ + h * STR + c * 8;
      if (h < a.heads) cp_async16_l1(dst, q16 + h * DIM + c * 8);
      else *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
    cp_async_commit();
  } else {
    const float* q = a.q + int64_t(t) * a.heads * DIM;
    constexpr int V4 = DIM / 4;  // float4 per head
    const int q_vec = a.heads * V4;
    for (int i0 = 0; i0 < rows * V4; i0 += 8 * THREADS) {
      float4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = i0 + u * THREADS + tid;
        v[u] = i < q_vec ? reinterpret_cast<const float4*>(q)[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int i = i0 + u * THREADS + tid;
        if (i / V4 < rows) *reinterpret_cast<uint2*>(sQ + i / V4 * STR + i % V4 * 4) = pack4<T16>(v[u]);
      }
    }
  }
}

// `runs` (fp8): rows are copied as runs of `run` consecutive slots (a page, or 64 keys of one),
// 16 bytes at a time; otherwise row by row, 4 bytes at a time. TILE_RUN (fp8, run = 64): every
// tile is one run, its 8,448 bytes copied from one address (no per-chunk offsets: 80 registers
// instead of 95, six blocks per SM).
template <int DIM, bool FP8, int STAGES, bool TILE_RUN, int MT>
__global__ void __launch_bounds__(128 / MT) indexer_mma_kernel(IndexerArgs a, int tiles_per_block, int run) {
  static_assert(STAGES >= 2, "one tile in flight while another is scored");
  static_assert(MT == 1 || MT == 2, "a warp scores 16 or 32 keys of a tile");
  constexpr int kThreads = 128 / MT;
  using T16 = typename std::conditional<FP8, __half, __nv_bfloat16>::type;
  constexpr int STR = DIM + 8;  // row stride in smem (16-byte aligned, staggers banks)
  constexpr int KSTEPS = DIM / 16;
  SPARSEMLA_DYNAMIC_SMEM(smem);
  const int heads_pad = heads_padded(a.heads);
  const int RB = int(a.keys.row_bytes);
  T16* sQ = reinterpret_cast<T16*>(smem);                                     // [heads_pad][STR]
  T16* sK = sQ + heads_pad * STR;                                             // [STAGES][64][STR] (bf16)
  float* sW = reinterpret_cast<float*>(sK + (FP8 ? 0 : STAGES) * kKeysPerTile * STR);  // [heads_pad]
  int32_t* sPage = reinterpret_cast<int32_t*>(sW + heads_pad);               // [pages]
  const int max_pages = pages_per_block(tiles_per_block, a.keys.block_size);
  uint8_t* sRaw = reinterpret_cast<uint8_t*>(sPage + (max_pages + 3) / 4 * 4);  // fp8: [STAGES][64 * RB]
  uint32_t* sBin = reinterpret_cast<uint32_t*>(sRaw + (FP8 ? STAGES * kKeysPerTile * RB : 0));  // [kCountSlots]
  uint32_t* sCnt = sBin + kCountSlots;                                                          // [kCountSlots]

  const int tid = threadIdx.x;
  const BlockKeys bk = block_keys(a, tiles_per_block, sPage);
  if (bk.n_tiles <= 0) return;
  const int t = bk.t, n = bk.n, tile0 = bk.tile0, n_tiles = bk.n_tiles;
  uint32_t* row_hist = bk.row_hist;
  const uint8_t* keys = static_cast<const uint8_t*>(a.keys.data);
  load_pages(bk, a, sPage, sBin, kThreads);

  // Fp8 runs: this thread's 16-byte chunks of a tile's stage, chunk tid + u * kThreads, the same
  // in every tile: the first key of its run (-1: past the tile) and its byte in that run.
  constexpr int kRunChunks = (kKeysPerTile * (DIM + 4) / 16 + kThreads - 1) / kThreads;
  int run_key[kRunChunks], run_byte[kRunChunks];
  if (FP8 && !TILE_RUN && run > 0) {
    const int run_bytes = run * RB;  // a multiple of 16; RB = DIM + 4 (the launch checks)
#pragma unroll
    for (int u = 0; u < kRunChunks; ++u) {
      const int off = (tid + u * kThreads) * 16, r = off / run_bytes;
      run_key[u] = off < kKeysPerTile * RB ? r * run : -1;
      run_byte[u] = off - r * run_bytes;
    }
  }
  // Pages of a multiple of 64 keys hold whole tiles: one page-table lookup per tile.
  const bool one_page = bk.bs % kKeysPerTile == 0;
  // Starts the copy of tile j of the block into stage `st`; keys past n are not copied (their rows
  // hold stale values, and their scores are not written).
  auto issue = [&](int j, int st) {
    const int p0 = (tile0 + j) * kKeysPerTile;
    const int64_t s0 = one_page ? bk.slot(p0) : 0;
    auto tile_slot = [&](int p) { return one_page ? s0 + (p - p0) : bk.slot(p); };
    if constexpr (!FP8) {
      issue_bf16_tile<DIM, kThreads>(sK + st * kKeysPerTile * STR, keys, RB, p0, n, tile_slot);
    } else {
      uint8_t* dst = sRaw + size_t(st) * kKeysPerTile * RB;
      if constexpr (TILE_RUN) {  // the tile's 64 rows are consecutive slots of one page
        issue_fp8_run_tile<DIM, kThreads>(dst, keys + s0 * RB, p0, n);
      } else if (run > 0) {
#pragma unroll
        for (int u = 0; u < kRunChunks; ++u) {
          const int p = p0 + run_key[u];
          if (run_key[u] >= 0 && p < n)
            cp_async16(dst + (tid + u * kThreads) * 16, keys + tile_slot(p) * RB + run_byte[u]);
        }
      } else {
        const int CH = RB / 4;
        for (int i = tid; i < kKeysPerTile * CH; i += kThreads) {
          const int r = i / CH, c = i % CH, p = p0 + r;
          if (p < n) cp_async4(dst + r * RB + c * 4, keys + tile_slot(p) * RB + c * 4);
        }
      }
    }
  };

#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_tiles) issue(st, st);
    cp_async_commit();
  }
  // Launched with programmatic dependent launch (pdl.cuh): the page-table entries and the first
  // tiles' keys above were written before the kernel this one follows (the step's key row two
  // launches earlier: write_index_keys_normed, then index_queries), so they load while that kernel
  // finishes; its output, the queries and their head weights, only after the wait.
  pdl::wait();
  pdl::launch_dependents();  // the top-k after it may be scheduled (it waits for the scores)

  // queries and head weights of token t, while the first tiles load (waited for with the first tile)
  stage_queries<DIM, kThreads>(sQ, a, t, heads_pad);
  for (int h = tid; h < heads_pad; h += kThreads) sW[h] = h < a.heads ? a.w[int64_t(t) * a.heads + h] : 0.0f;

  const int warp = tid / 32, lane = tid % 32, g = lane / 4, q4 = lane % 4;
  const int r0 = warp * 16 * MT;
  const int mi = lane / 8, ri = lane % 8;
  float* out = a.scores + int64_t(t) * a.score_stride;
  for (int it = 0; it < n_tiles; ++it) {
    if (it == 0) cp_async_wait_all();  // the first tile, and the 16-bit queries committed after it
    else cp_async_wait_group<STAGES - 2>();
    __syncthreads();  // tile `it` landed for every thread; the stage refilled below is no longer read
    if (it + STAGES - 1 < n_tiles) issue(it + STAGES - 1, (it + STAGES - 1) % STAGES);
    cp_async_commit();
    const int st = it % STAGES;
    const T16* tK = sK + st * kKeysPerTile * STR;  // (bf16)
    const uint8_t* raw = sRaw + size_t(st) * kKeysPerTile * RB;  // (fp8: the rows as stored)
    const int p0 = (tile0 + it) * kKeysPerTile;
    if (p0 + r0 >= n) continue;
    uint32_t fa[MT][KSTEPS][4];  // this warp's 16 x MT keys (A, rows = keys), 16 per m-tile
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if constexpr (FP8) {
        // Straight from the stored rows into the A fragments (rows g and g + 8, columns 2 q4 and
        // 2 q4 + 8 of each 16): e4m3 pairs widened exactly to fp16 pairs in registers.
        const uint8_t* ra = raw + (r0 + mt * 16 + g) * RB + 2 * q4;
        const uint8_t* rb = ra + 8 * RB;
        auto pair = [](const uint8_t* p) { return fp8x2_to_f16x2(*reinterpret_cast<const uint16_t*>(p)); };
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
          fa[mt][ks][0] = pair(ra + ks * 16);
          fa[mt][ks][1] = pair(rb + ks * 16);
          fa[mt][ks][2] = pair(ra + ks * 16 + 8);
          fa[mt][ks][3] = pair(rb + ks * 16 + 8);
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks)
          ldmatrix_x4(fa[mt][ks], tK + (r0 + mt * 16 + (mi % 2) * 8 + ri) * STR + ks * 16 + (mi / 2) * 8);
      }
    }
    // v[2 mt]: key r0 + 16 mt + g, v[2 mt + 1]: key r0 + 16 mt + g + 8; this lane's heads. Each
    // B fragment of the queries (ldmatrix from shared memory) serves the MT m-tiles: 32 keys per
    // warp read the queries half as often per key as 16.
    float v[2 * MT];
#pragma unroll
    for (int j = 0; j < 2 * MT; ++j) v[j] = 0.0f;
    for (int nh = 0; nh < heads_pad / 16; ++nh) {
      float c[MT][2][4] = {};
      const T16* qb = sQ + (nh * 16 + (mi / 2) * 8 + ri) * STR + (mi % 2) * 8;
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        uint32_t fb[4];  // B ([head][dim]): heads nh*16 .. +7 in fb[0..1], +8 .. +15 in fb[2..3]
        ldmatrix_x4(fb, qb + ks * 16);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816(c[mt][0], fa[mt][ks], fb, T16());
          mma_16816(c[mt][1], fa[mt][ks], fb + 2, T16());
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float w0 = sW[nh * 16 + u * 8 + q4 * 2], w1 = sW[nh * 16 + u * 8 + q4 * 2 + 1];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          v[2 * mt] += w0 * fmaxf(c[mt][u][0], 0.0f) + w1 * fmaxf(c[mt][u][1], 0.0f);
          v[2 * mt + 1] += w0 * fmaxf(c[mt][u][2], 0.0f) + w1 * fmaxf(c[mt][u][3], 0.0f);
        }
      }
    }
    // Sums over the quad's four lanes; lane 4g + j keeps the key r0 + 8 j + g (j < 2 MT). Every
    // key's sum is (its v of lanes 4g, 4g+1) + (4g+2, 4g+3) whichever lane keeps it: the same
    // bits for MT = 1 and 2.
    float score;
    if constexpr (MT == 1) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        v[j] += __shfl_xor_sync(0xffffffffu, v[j], 1);
        v[j] += __shfl_xor_sync(0xffffffffu, v[j], 2);
      }
      score = q4 == 1 ? v[1] : v[0];
    } else {  // a transpose: each step keeps the half of the values the lane's bit selects
      const bool b0 = q4 & 1, b1 = q4 & 2;
      float k0 = b0 ? v[1] : v[0], k1 = b0 ? v[3] : v[2];
      k0 += __shfl_xor_sync(0xffffffffu, b0 ? v[0] : v[1], 1);
      k1 += __shfl_xor_sync(0xffffffffu, b0 ? v[2] : v[3], 1);
      score = b1 ? k1 : k0;
      score += __shfl_xor_sync(0xffffffffu, b1 ? k0 : k1, 2);
    }
    const int r = r0 + 8 * q4 + g;  // this lane's key in the tile
    const bool mine = q4 < 2 * MT && p0 + r < n;
    if (FP8 && q4 < 2 * MT) score *= *reinterpret_cast<const float*>(raw + r * RB + DIM);  // its scale
    if (mine) out[p0 + r] = score;
    if (row_hist) count_scores(mine, score, sBin, sCnt, row_hist);
  }
  if (row_hist) flush_counts(sBin, sCnt, row_hist, kThreads);
}

// Regs (bf16 keys, up to 64 heads): a warp's 16 keys of a tile go from global memory straight
// into its A fragments, with no shared-memory stage: lane (g, q4) loads the 16-byte chunks q4,
// q4 + 4, ... of key rows g and g + 8, and the queries' columns are stored permuted to match
// (qcol_of), so each chunk is the lane's fragments of two k-steps. The k-steps run outermost over
// all heads (accumulators of every head live, HP16 groups of 16), so a chunk's registers are free
// once its two k-steps are done and the next tile's chunk is loaded into them at once: one tile in
// flight per warp, no barrier in the loop, and only the queries' B fragments read from shared
// memory (the cp.async kernel also writes and reads every key there).
constexpr int kRegThreads = 128;

// The column of the queries' shared row (fragment order) that holds dimension d.
__device__ __forceinline__ int qcol_of(int d) {
  const int c = d / 8, pr = (d % 8) / 2, e = d % 2;  // 16-byte chunk, pair in it, value in the pair
  const int q4 = c % 4, i = c / 4;                  // the lane quarter that loads it, its chunk index
  return 16 * (2 * i + pr / 2) + 8 * (pr % 2) + 2 * q4 + e;
}

template <int DIM, int HP16>
__global__ void __launch_bounds__(kRegThreads) indexer_regs_kernel(IndexerArgs a, int tiles_per_block) {
  constexpr int STR = DIM + 8, KSTEPS = DIM / 16, CHUNKS = DIM / 32;  // CHUNKS: a lane's chunks per row
  constexpr int HP = HP16 * 16;
  SPARSEMLA_DYNAMIC_SMEM(smem);
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem);  // [HP][STR], columns in fragment order
  float* sW = reinterpret_cast<float*>(sQ + HP * STR);         // [HP]
  int32_t* sPage = reinterpret_cast<int32_t*>(sW + HP);        // [pages]
  const int max_pages = pages_per_block(tiles_per_block, a.keys.block_size);
  uint32_t* sBin = reinterpret_cast<uint32_t*>(sPage + (max_pages + 3) / 4 * 4);  // [kCountSlots]
  uint32_t* sCnt = sBin + kCountSlots;                                             // [kCountSlots]

  const BlockKeys bk = block_keys(a, tiles_per_block, sPage);
  if (bk.n_tiles <= 0) return;
  load_pages(bk, a, sPage, sBin, kRegThreads);
  const int tid = threadIdx.x, t = bk.t, n = bk.n, n_tiles = bk.n_tiles;
  uint32_t* row_hist = bk.row_hist;
  const uint8_t* keys = static_cast<const uint8_t*>(a.keys.data);
  const int64_t RB = a.keys.row_bytes;
  // Key p's row, or null past the context (its fragments are zeros, its score not written).
  auto row_of = [&](int p) -> const uint4* {
    return p < n ? reinterpret_cast<const uint4*>(keys + bk.slot(p) * RB) : nullptr;
  };
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, q4 = lane % 4;
  const int mi = lane / 8, ri = lane % 8;
  auto load = [&](const uint4* row, int i) { return row ? __ldcs(row + q4 + 4 * i) : make_uint4(0u, 0u, 0u, 0u); };

  // The first tile's keys before the dependent-launch wait (written two launches earlier, as in the
  // cp.async kernel), the queries after it.
  uint4 L[2][CHUNKS];
  {
    const int p = bk.tile0 * kKeysPerTile + warp * 16 + g;
    const uint4* r0 = row_of(p);
    const uint4* r1 = row_of(p + 8);
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
      L[0][i] = load(r0, i);
      L[1][i] = load(r1, i);
    }
  }
  pdl::wait();
  pdl::launch_dependents();
  {
    // Every chunk's load issued before any is stored (one round trip, not one per chunk).
    constexpr int CH = DIM / 8, PER = (HP * CH + kRegThreads - 1) / kRegThreads;  // 16-byte chunks per head, per thread
    uint32_t v[PER][4];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int idx = tid + u * kRegThreads, h = idx / CH, c = idx % CH;
      v[u][0] = v[u][1] = v[u][2] = v[u][3] = 0u;
      if (idx >= HP * CH || h >= a.heads) continue;
      if (a.q16) {
        const uint4 x = *reinterpret_cast<const uint4*>(a.q16 + (int64_t(t) * a.heads + h) * DIM + c * 8);
        v[u][0] = x.x, v[u][1] = x.y, v[u][2] = x.z, v[u][3] = x.w;
      } else {
        const float4* q = reinterpret_cast<const float4*>(a.q + (int64_t(t) * a.heads + h) * DIM + c * 8);
        const float4 x = q[0], y = q[1];
        v[u][0] = pack_bf16(x.x, x.y), v[u][1] = pack_bf16(x.z, x.w), v[u][2] = pack_bf16(y.x, y.y),
        v[u][3] = pack_bf16(y.z, y.w);
      }
    }
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int idx = tid + u * kRegThreads, h = idx / CH, c = idx % CH;
      if (idx >= HP * CH) continue;
#pragma unroll
      for (int pr = 0; pr < 4; ++pr) *reinterpret_cast<uint32_t*>(sQ + h * STR + qcol_of(c * 8 + 2 * pr)) = v[u][pr];
    }
    for (int h = tid; h < HP; h += kRegThreads) sW[h] = h < a.heads ? a.w[int64_t(t) * a.heads + h] : 0.0f;
  }
  __syncthreads();

  float* out = a.scores + int64_t(t) * a.score_stride;
  const __nv_bfloat16* qb = sQ + ((mi / 2) * 8 + ri) * STR + (mi % 2) * 8;
  for (int it = 0; it < n_tiles; ++it) {
    const int p0 = (bk.tile0 + it) * kKeysPerTile + warp * 16;
    if (p0 >= n) break;  // (so are the later tiles' keys)
    const uint4* nr0 = nullptr;
    const uint4* nr1 = nullptr;
    if (it + 1 < n_tiles) {
      nr0 = row_of(p0 + kKeysPerTile + g);
      nr1 = row_of(p0 + kKeysPerTile + g + 8);
    }
    float c[HP16][2][4] = {};
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int i = ks / 2;
      const bool odd = ks % 2;
      const uint32_t fa[4] = {odd ? L[0][i].z : L[0][i].x, odd ? L[1][i].z : L[1][i].x, odd ? L[0][i].w : L[0][i].y,
                              odd ? L[1][i].w : L[1][i].y};
#pragma unroll
      for (int nh = 0; nh < HP16; ++nh) {
        uint32_t fb[4];  // heads nh*16 .. +7 in fb[0..1], +8 .. +15 in fb[2..3]
        ldmatrix_x4(fb, qb + nh * 16 * STR + ks * 16);
        mma_16816(c[nh][0], fa, fb, __nv_bfloat16());
        mma_16816(c[nh][1], fa, fb + 2, __nv_bfloat16());
      }
      if (odd) {  // chunk i's two k-steps are done: the next tile's chunk i into its registers
        L[0][i] = load(nr0, i);
        L[1][i] = load(nr1, i);
      }
    }
    float v[2] = {0.0f, 0.0f};  // keys p0 + g and p0 + g + 8, this lane's heads
#pragma unroll
    for (int nh = 0; nh < HP16; ++nh)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float w0 = sW[nh * 16 + u * 8 + q4 * 2], w1 = sW[nh * 16 + u * 8 + q4 * 2 + 1];
        v[0] += w0 * fmaxf(c[nh][u][0], 0.0f) + w1 * fmaxf(c[nh][u][1], 0.0f);
        v[1] += w0 * fmaxf(c[nh][u][2], 0.0f) + w1 * fmaxf(c[nh][u][3], 0.0f);
      }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      v[j] += __shfl_xor_sync(0xffffffffu, v[j], 1);
      v[j] += __shfl_xor_sync(0xffffffffu, v[j], 2);
    }
    const float score = q4 == 1 ? v[1] : v[0];
    const int p = p0 + 8 * q4 + g;  // this lane's key (lanes q4 < 2)
    const bool mine = q4 < 2 && p < n;
    if (mine) out[p] = score;
    if (row_hist) count_scores(mine, score, sBin, sCnt, row_hist);
  }
  if (row_hist) flush_counts(sBin, sCnt, row_hist, kRegThreads);
}

// Qfrag (up to 64 heads; bf16 keys, or fp8 keys in pages of whole tiles): the operands swapped. The
// queries are the A operand (rows = heads), copied once per block into shared memory and from there
// into each warp's fragments for the whole block, and the keys the B operand (columns = keys), read
// from the shared-memory stages (cp.async, as the staged kernel): one ldmatrix per 8 keys x 32 dims
// for bf16 keys, one word per lane and k-step widened in registers for fp8. Per tile, each key row is
// read from shared memory once per warp of heads, where the staged kernel reads every query per 16
// keys: for DeepSeek-V3.2's 64 heads 32 KB of shared-memory reads per tile against 80 KB (bf16).
// HW warps (1, 2) share a group of keys, each with MH m-tiles of 16 heads (MH * 16 heads); the
// second warp's sums reach the first through shared memory, at a named barrier of the two.
constexpr int kQfragThreads = 128;

// index_queries' work (attention.h) for token t's first `rows` heads, by a block of THREADS
// (IndexerArgs::prep): each head's rotated queries rounded into its row of sQ (DIM + 8 values; in
// fp16 scaled by the power of two f of its largest value first) and its weight w * w_scale / f into
// sW; padding heads zero. One warp per head, each lane's pairs i = lane, lane + 32, ..., with
// index_queries_kernel's arithmetic in its order: the same bits.
template <int DIM, class T16, int THREADS>
__device__ void prepare_queries(T16* sQ, float* sW, const IndexerArgs& a, int t, int rows) {
  constexpr int STR = DIM + 8, MAXP = (DIM / 2 + 31) / 32;  // a lane's pairs at most (2 half <= DIM)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const RopeTable& r = a.prep.rope;
  const float p = float(a.prep.pos[t]);
  for (int h = warp; h < rows; h += THREADS / 32) {
    T16* dst = sQ + h * STR;
    if (h >= a.heads) {
      for (int c = lane; c < DIM; c += 32) dst[c] = round16<T16>(0.0f);
      if (lane == 0) sW[h] = 0.0f;
      continue;
    }
    const float* row = a.q + (int64_t(t) * a.heads + h) * DIM;
    float v0[MAXP], v1[MAXP];
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < MAXP; ++k) {
      const int64_t i = lane + 32 * k;
      if (i < r.half) {
        float x0 = row[rope_a(r, i)], x1 = row[rope_b(r, i)];
        rope_rotate(rope_angle(r, p, i), &x0, &x1);
        v0[k] = x0;
        v1[k] = x1;
        amax = fmaxf(amax, fmaxf(fabsf(x0), fabsf(x1)));
      }
    }
    float f = 1.0f;
    if constexpr (std::is_same<T16, __half>::value) {
      for (int64_t c = 2 * r.half + lane; c < DIM; c += 32) amax = fmaxf(amax, fabsf(row[c]));
      for (int m = 16; m >= 1; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
      f = q_factor(__float_as_uint(amax));
    }
#pragma unroll
    for (int k = 0; k < MAXP; ++k) {
      const int64_t i = lane + 32 * k;
      if (i < r.half) {
        dst[rope_a(r, i)] = round16<T16>(v0[k] * f);
        dst[rope_b(r, i)] = round16<T16>(v1[k] * f);
      }
    }
    for (int64_t c = 2 * r.half + lane; c < DIM; c += 32) dst[c] = round16<T16>(row[c] * f);
    if (lane == 0) sW[h] = a.w[int64_t(t) * a.heads + h] * a.prep.w_scale / f;
  }
}

// Keeps half of x (by `up`) and adds the partner lane's other half (lane ^ m).
template <int P, int N>
__device__ __forceinline__ void keep_half_add(float (&x)[N], bool up, int m) {
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const float keep = up ? x[i + P] : x[i], send = up ? x[i] : x[i + P];
    x[i] = keep + __shfl_xor_sync(0xffffffffu, send, m);
  }
}
// Each of V (4 or 8) values summed over the 8 lanes that share lane % 4 (g = lane / 4 = 0..7), a
// transpose on the way: V - 1 shuffles (V = 8), 4 (V = 4). Lane g gets the sum of value g (V = 8) or
// g / 2 (V = 4) in x[0].
template <int V>
__device__ __forceinline__ void sum_over_g(float (&x)[V], int lane) {
  static_assert(V == 4 || V == 8, "four or eight values");
  if constexpr (V == 8) {
    keep_half_add<4>(x, lane & 16, 16);
    keep_half_add<2>(x, lane & 8, 8);
    keep_half_add<1>(x, lane & 4, 4);
  } else {
    keep_half_add<2>(x, lane & 16, 16);
    keep_half_add<1>(x, lane & 8, 8);
    x[0] += __shfl_xor_sync(0xffffffffu, x[0], 4);
  }
}

// The step of the qfrag and tokens kernels for two n-tiles of 8 keys, 2 np and 2 np + 1, of a tile
// of 16-bit key rows at kb (row ri of the n-tile, columns 8 mi of each 32: ldmatrix's addresses):
// c[j][mh] = the keys of n-tile 2 np + j against the warp's MH m-tiles of queries (A fragments qa),
// k-step by k-step. Both kernels take it, so that their sums are the same.
template <int MH, int KSTEPS, int STR, class T16>
__device__ __forceinline__ void key_pair_products(float (&c)[2][MH][4], const uint32_t (&qa)[MH][KSTEPS][4],
                                                  const T16* kb, int np) {
#pragma unroll
  for (int kp = 0; kp < KSTEPS / 2; ++kp) {
    uint32_t fb[2][4];  // per n-tile: k-step 2 kp in fb[j][0..1], 2 kp + 1 in fb[j][2..3]
#pragma unroll
    for (int j = 0; j < 2; ++j) ldmatrix_x4(fb[j], kb + (2 * np + j) * 8 * STR + kp * 32);
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int mh = 0; mh < MH; ++mh) {
        mma_16816(c[j][mh], qa[mh][2 * kp], fb[j], T16());
        mma_16816(c[j][mh], qa[mh][2 * kp + 1], fb[j] + 2, T16());
      }
  }
}
// c[j][mh]: heads g (c0, c1) and g + 8 (c2, c3) against keys 8 nt + 2 q4 (c0, c2) and + 1 (c1, c3),
// nt = 2 np + j: x[2 nt], x[2 nt + 1] = the lane's heads' relu-weighted sums (weights wv) for those keys.
template <int MH, int V>
__device__ __forceinline__ void key_pair_head_sums(float (&x)[V], const float (&c)[2][MH][4], const float (&wv)[MH][2],
                                                   int np) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int nt = 2 * np + j;
    x[2 * nt] = x[2 * nt + 1] = 0.0f;
#pragma unroll
    for (int mh = 0; mh < MH; ++mh) {
      x[2 * nt] += wv[mh][0] * fmaxf(c[j][mh][0], 0.0f) + wv[mh][1] * fmaxf(c[j][mh][2], 0.0f);
      x[2 * nt + 1] += wv[mh][0] * fmaxf(c[j][mh][1], 0.0f) + wv[mh][1] * fmaxf(c[j][mh][3], 0.0f);
    }
  }
}

// The qfrag kernel's shared memory: STAGES key stages (bf16 rows [64][DIM + 8], fp8 rows as stored
// [64][DIM + 4]), for fp8 keys the queries' rows [HW * MH * 16][DIM + 8] (bf16 keys use the last
// stage), the partial sums [4 / HW][32], the block's page-table entries, the digit table.
template <int DIM, bool FP8>
__host__ __device__ constexpr int qfrag_stage_bytes() {
  return FP8 ? kKeysPerTile * (DIM + 4) : kKeysPerTile * (DIM + 8) * 2;
}
template <int DIM, bool FP8, int HW, int MH, int STAGES>
__host__ __device__ constexpr int qfrag_rows_bytes() {  // the stages and the fp8 queries
  return STAGES * qfrag_stage_bytes<DIM, FP8>() + (FP8 ? HW * MH * 16 * (DIM + 8) * 2 : 0);
}

// Blocks per SM the registers are held to. Four on an H200: without the bound the 64-head bf16
// kernel took 132 registers (three blocks); with it the 64-head fp8 kernel (taken only when asked
// for) spills 12 bytes. SM12x holds two blocks of 35 KB in its ~100 KB of shared memory, and at four
// ptxas spilled 44 bytes in the 64-head bf16 kernel there: two.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kQfragMinBlocks = 2;
#else
constexpr int kQfragMinBlocks = 4;
#endif
template <int DIM, bool FP8, int HW, int MH, int STAGES>
__global__ void __launch_bounds__(kQfragThreads, kQfragMinBlocks) indexer_qfrag_kernel(IndexerArgs a, int tiles_per_block) {
  static_assert(DIM % 32 == 0 && (HW == 1 || HW == 2) && (MH == 1 || MH == 2) && STAGES >= 2, "shape");
  using T16 = typename std::conditional<FP8, __half, __nv_bfloat16>::type;
  constexpr int STR = DIM + 8, KSTEPS = DIM / 16, RB8 = DIM + 4;  // RB8: an fp8 row's bytes
  constexpr int KG = 4 / HW;                   // key groups of a tile (one per HW warps)
  constexpr int KW = kKeysPerTile / KG;        // keys per group
  constexpr int NT = KW / 8, V = 2 * NT;       // n-tiles of 8 keys; a lane's sums per tile
  constexpr int QROWS = HW * MH * 16;          // query rows, padding heads included
  SPARSEMLA_DYNAMIC_SMEM(smem);
  unsigned char* sStage = smem;  // [STAGES][qfrag_stage_bytes]: bf16 rows [64][STR], fp8 rows as stored [64][RB8]
  T16* sQ = reinterpret_cast<T16*>(FP8 ? smem + STAGES * qfrag_stage_bytes<DIM, FP8>() : smem + (STAGES - 1) * qfrag_stage_bytes<DIM, FP8>());
  float* sPart = reinterpret_cast<float*>(smem + qfrag_rows_bytes<DIM, FP8, HW, MH, STAGES>());  // [KG][32]
  int32_t* sPage = reinterpret_cast<int32_t*>(sPart + KG * 32);  // [pages]
  const int max_pages = pages_per_block(tiles_per_block, a.keys.block_size);
  uint32_t* sBin = reinterpret_cast<uint32_t*>(sPage + (max_pages + 3) / 4 * 4);  // [kCountSlots]
  uint32_t* sCnt = sBin + kCountSlots;                                             // [kCountSlots]

  const BlockKeys bk = block_keys(a, tiles_per_block, sPage);
  if (bk.n_tiles <= 0) return;
  const int tid = threadIdx.x, t = bk.t, n = bk.n, tile0 = bk.tile0, n_tiles = bk.n_tiles;
  uint32_t* row_hist = bk.row_hist;
  const uint8_t* keys = static_cast<const uint8_t*>(a.keys.data);
  const int64_t RB = a.keys.row_bytes;
  load_pages(bk, a, sPage, sBin, kQfragThreads);
  // (fp8: pages of a multiple of 64 slots only, each tile one run; the launch checks)
  const bool one_page = bk.bs % kKeysPerTile == 0;
  auto issue = [&](int j, int st) {
    const int p0 = (tile0 + j) * kKeysPerTile;
    const int64_t s0 = one_page ? bk.slot(p0) : 0;
    unsigned char* dst = sStage + st * qfrag_stage_bytes<DIM, FP8>();
    if constexpr (FP8)
      issue_fp8_run_tile<DIM, kQfragThreads>(dst, keys + s0 * RB, p0, n);
    else
      issue_bf16_tile<DIM, kQfragThreads>(reinterpret_cast<T16*>(dst), keys, RB, p0, n,
                                          [&](int p) { return one_page ? s0 + (p - p0) : bk.slot(p); });
  };
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    if (st < n_tiles) issue(st, st);
    cp_async_commit();
  }
  pdl::wait();  // (as the staged kernel: the keys above may load before, the queries only after)
  pdl::launch_dependents();

  const int warp = tid / 32, lane = tid % 32, g = lane / 4, q4 = lane % 4;
  const int kg = warp / HW, hw = warp % HW;
  const int mi = lane / 8, ri = lane % 8;
  // The queries (bf16 keys: through the last stage, whose first tile the loop issues after they are
  // read; fp8: a region of their own, the stages being too small): 16-byte copies through L1 as the
  // staged kernel's, then this warp's heads as A fragments for the whole block, with their weights;
  // padding heads are zeros.
  static_assert(FP8 || QROWS <= kKeysPerTile, "the queries fit in a stage");
  // (IndexerArgs::prep: the weights through sPart, free until the loop's first barrier)
  static_assert(KG * 32 >= QROWS, "a weight per query row fits in sPart");
  const bool prep = a.prep.pos != nullptr;
  if (prep) prepare_queries<DIM, T16, kQfragThreads>(sQ, sPart, a, t, QROWS);
  else stage_queries<DIM, kQfragThreads>(sQ, a, t, QROWS);
  float wv[MH][2];
  auto weights = [&](auto weight_of) {
#pragma unroll
    for (int mh = 0; mh < MH; ++mh)
#pragma unroll
      for (int r = 0; r < 2; ++r) wv[mh][r] = weight_of((hw * MH + mh) * 16 + g + 8 * r);
  };
  if (!prep) weights([&](int h) { return h < a.heads ? a.w[int64_t(t) * a.heads + h] : 0.0f; });
  cp_async_wait_all();
  __syncthreads();
  if (prep) weights([&](int h) { return sPart[h]; });
  uint32_t qa[MH][KSTEPS][4];
#pragma unroll
  for (int mh = 0; mh < MH; ++mh)
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const T16* q0 = sQ + ((hw * MH + mh) * 16 + g) * STR + ks * 16;
      if constexpr (FP8) {
        // The k-step's dimensions in another order, the same for both operands (the sum is over
        // all of them): logical k = 2 q4 + e is dimension 4 q4 + e, 2 q4 + 8 + e is 4 q4 + 2 + e,
        // so that a lane's B fragments are one 4-byte word of the fp8 row and its A fragments of
        // a row one 8-byte load.
        const uint2 lo = *reinterpret_cast<const uint2*>(q0 + 4 * q4);
        const uint2 hi = *reinterpret_cast<const uint2*>(q0 + 8 * STR + 4 * q4);
        qa[mh][ks][0] = lo.x, qa[mh][ks][2] = lo.y, qa[mh][ks][1] = hi.x, qa[mh][ks][3] = hi.y;
      } else {
        // ldmatrix: rows = heads, matrices rows +0 / +8, columns +0 / +8 of the k-step
        ldmatrix_x4(qa[mh][ks], sQ + ((hw * MH + mh) * 16 + (mi % 2) * 8 + ri) * STR + ks * 16 + (mi / 2) * 8);
      }
    }
  // (the loop's first __syncthreads comes before the last stage is refilled)

  float* out = a.scores + int64_t(t) * a.score_stride;
  const int r0 = kg * KW;
  // This lane's key after the sums: value idx of sum_over_g, which is key 8 (idx / 2) + 2 q4 + idx % 2
  // of the group; with V = 4 lanes g and g + 1 hold the same sum, the even one keeps it.
  const int idx = V == 8 ? g : g / 2;
  const int key = r0 + 8 * (idx / 2) + 2 * q4 + idx % 2;
  const bool owner = V == 8 || g % 2 == 0;
  for (int it = 0; it < n_tiles; ++it) {
    cp_async_wait_group<STAGES - 2>();
    __syncthreads();  // tile `it` landed for every thread; the stage refilled below is no longer read
    if (it + STAGES - 1 < n_tiles) issue(it + STAGES - 1, (it + STAGES - 1) % STAGES);
    cp_async_commit();
    const int p0 = (tile0 + it) * kKeysPerTile;
    if (p0 + r0 >= n) continue;  // (the same for both warps of a group)
    const unsigned char* stage = sStage + (it % STAGES) * qfrag_stage_bytes<DIM, FP8>();
    // B fragments. Bf16: ldmatrix, matrix mi = dimensions 8 mi .. 8 mi + 7 of 32, row ri = key ri of
    // the n-tile. Fp8: key g of the n-tile, the k-step's 4-byte word q4 (the order above), widened.
    const T16* kb = reinterpret_cast<const T16*>(stage) + (r0 + ri) * STR + mi * 8;
    const unsigned char* kr = stage + (r0 + g) * RB8 + 4 * q4;
    float x[V];
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {  // two n-tiles at a time: 2 MH accumulators in flight
      float c[2][MH][4] = {};
      if constexpr (FP8) {
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
          uint32_t fb[2][2];
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const uint32_t w = *reinterpret_cast<const uint32_t*>(kr + (2 * np + j) * 8 * RB8 + ks * 16);
            fb[j][0] = fp8x2_to_f16x2(w), fb[j][1] = fp8x2_hi_to_f16x2(w);
          }
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int mh = 0; mh < MH; ++mh) mma_16816(c[j][mh], qa[mh][ks], fb[j], T16());
        }
      } else {
        key_pair_products<MH, KSTEPS, STR>(c, qa, kb, np);
      }
      key_pair_head_sums(x, c, wv, np);
    }
    sum_over_g<V>(x, lane);
    float score = x[0];
    if constexpr (HW == 2) {
      // The second warp's heads: handed over in sPart, read before the first warp reaches the next
      // tile's __syncthreads, after which the second warp writes sPart again.
      // (barrier ids 1 and 2 named as constants: a computed id makes ptxas reserve all 16.) The second
      // warp waits at the barrier too (bar.sync, not bar.arrive): with bar.arrive compute-sanitizer's
      // racecheck reported the first warp's read and the second warp's write of the next tile as a
      // WAR hazard, though the loop's __syncthreads orders them (session 41).
      if (hw == 1) {
        sPart[kg * 32 + lane] = score;
        if (kg == 0) named_sync(1, 64);
        else named_sync(2, 64);
        continue;
      }
      if (kg == 0) named_sync(1, 64);
      else named_sync(2, 64);
      score += sPart[kg * 32 + lane];
    }
    // fp8: the key's scale, a factor of every head's dot product (and > 0, so of their relu too)
    if constexpr (FP8) score *= *reinterpret_cast<const float*>(stage + key * RB8 + DIM);
    const bool mine = owner && p0 + key < n;
    if (mine) out[p0 + key] = score;
    if (row_hist) count_scores(mine, score, sBin, sCnt, row_hist);
  }
  if (row_hist) flush_counts(sBin, sCnt, row_hist, kQfragThreads);
}

// One warp per key: any head count and dimension, any key format.
template <KvDtype D>
__global__ void indexer_fma_kernel(IndexerArgs a) {
  const int t = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int p = blockIdx.x * (blockDim.x / 32) + warp;
  if (p >= a.n_ctx[t]) return;
  const int64_t slot = slot_of(a.keys.block_tables, a.keys.max_blocks, a.keys.block_size, a.seq[t], p);
  const uint8_t* row = static_cast<const uint8_t*>(a.keys.data) + slot * a.keys.row_bytes;
  const float* q = a.q + int64_t(t) * a.heads * a.dim;
  float score = 0.0f;
  for (int h = 0; h < a.heads; ++h) {
    float dot = 0.0f;
    for (int c = lane; c < a.dim; c += 32) dot += q[h * a.dim + c] * key_value<D>(row, c, a.dim);
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    score += a.w[int64_t(t) * a.heads + h] * fmaxf(dot, 0.0f);
  }
  if (lane == 0) a.scores[int64_t(t) * a.score_stride + p] = score;
}

}  // namespace sparsemla::cuda::indexer

// The tokens kernel (a prefill's tokens sharing each key tile) uses the helpers above.
#include "ops/cuda/indexer_tokens_kernel.cuh"

namespace sparsemla::cuda::indexer {

// --- Host side: the launch shape ------------------------------------------------------------------

// Tiles per block of a launch where `slots` blocks are resident at once (SMs x blocks per SM): enough
// that one wave covers the tokens' keys, so that each block streams several tiles (1 to
// kMaxTilesPerBlock); the grid is then (ceil(tiles / per_block), T).
// With several tokens per block (the tokens kernel) the grid's rows are groups of that many tokens.
inline int64_t token_groups(const IndexerArgs& a, int tokens_per_block) {
  return (a.T + tokens_per_block - 1) / tokens_per_block;
}
inline int one_wave_tiles(const IndexerArgs& a, int64_t slots, int tokens_per_block = 1) {
  const int64_t tiles = (a.max_ctx + kKeysPerTile - 1) / kKeysPerTile;
  slots = std::max<int64_t>(1, slots);
  return int(std::clamp<int64_t>((tiles * token_groups(a, tokens_per_block) + slots - 1) / slots, 1, kMaxTilesPerBlock));
}

// Shared memory of the regs and qfrag kernels for blocks of `tiles` tiles (count: the digit table).
template <int DIM, int HP16>
size_t regs_smem_bytes(int tiles, int block_size, bool count) {
  const int pages = pages_per_block(tiles, block_size);
  return size_t(HP16) * 16 * (DIM + 8) * 2 + size_t(HP16) * 16 * 4 + size_t(pages + 3) / 4 * 16 +
         (count ? 2 * kCountSlots * 4 : 0);
}
template <int DIM, bool FP8, int HW, int MH, int STAGES>
size_t qfrag_smem_bytes(int tiles, int block_size, bool count) {
  const int pages = pages_per_block(tiles, block_size);
  return size_t(qfrag_rows_bytes<DIM, FP8, HW, MH, STAGES>()) + size_t(4 / HW) * 32 * 4 + size_t(pages + 3) / 4 * 16 +
         (count ? 2 * kCountSlots * 4 : 0);
}

// Runs of consecutive slots for fp8 rows: a page, or 64 keys of a larger one, 16-byte aligned; a
// whole tile's run (pages of a multiple of 64 keys, the usual case) is one contiguous copy. 0: rows
// are copied 4 bytes at a time.
inline int fp8_run(const IndexerArgs& a) {
  const int bs = a.keys.block_size;
  if (!(kKeysPerTile % bs == 0 || bs % kKeysPerTile == 0)) return 0;
  const int r = std::min(bs, kKeysPerTile);
  const bool fits = a.keys.row_bytes == a.dim + 4 && (int64_t(r) * a.keys.row_bytes) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.keys.data) % 16 == 0;
  return fits ? r : 0;
}

// Whether the tokens kernel takes a's shape: up to 64 heads; bf16 rows of dim values, 16-byte
// aligned, or fp8 rows in runs of 16-byte copies (fp8_run: the serving cache's pages of 16 slots
// too), more than one token, nothing counted.
inline bool tokens_fit(const IndexerArgs& a) {
  if (heads_padded(a.heads) > 64 || a.T < 2 || a.counts.hist) return false;
  if (a.dtype == KvDtype::FP8) return fp8_run(a) > 0;
  return a.dtype == KvDtype::BF16 && a.keys.row_bytes == int64_t(a.dim) * 2 &&
         reinterpret_cast<uintptr_t>(a.keys.data) % 16 == 0 &&
         (a.q16 ? reinterpret_cast<uintptr_t>(a.q16) % 16 == 0 : reinterpret_cast<uintptr_t>(a.q) % 16 == 0);
}

// The mma kernel that scores a (never kAuto): a.mma, else `env_kernel` (SPARSEMLA_INDEXER_MMA), else
// the measured default; a kernel asked for on a shape it does not take falls back to kStaged.
inline IndexerMma choose_mma(const IndexerArgs& a, IndexerMma env_kernel) {
  IndexerMma k = a.mma != IndexerMma::kAuto ? a.mma : env_kernel;
  const int hp16 = heads_padded(a.heads) / 16;
  // The tokens kernel: where the tokens come in runs of one sequence (a prefill; IndexerArgs::
  // tokens_per_run), on the qfrag kernel's shapes, counting nothing. Otherwise, or asked for where it
  // does not apply, the choice below.
  if (k == IndexerMma::kTokens || (k == IndexerMma::kAuto && a.tokens_per_run >= kIndexerTokensMinRun)) {
    if (tokens_fit(a)) return IndexerMma::kTokens;
    k = IndexerMma::kAuto;
  }
  if (a.dtype == KvDtype::FP8) {
    // Fp8 keys: the qfrag kernel by default for up to 32 heads (GLM-5's, and the tensor-parallel
    // shares), the staged kernel for more. Measured on an H200 (session 22, two rounds; us, staged ->
    // qfrag): GLM-5 one token at 128K 8.2 -> 7.9 (indexer + top-k 19.3-19.4 -> 18.4-18.5), 8 x 128K
    // 48 -> 43, 32 x 32K 48 -> 43, 128 x 4K 32.4 -> 23.4; slower at 2 x 128K (12.2 -> 13.0), 8 x 32K
    // (11.8 -> 12.5) and 128 x 128K (632 -> 644). At 64 heads (DeepSeek-V3.2) qfrag lost at most
    // shapes (one token at 128K 10.9 -> 11.4, 128 x 128K 882 -> 1005; it won at 2 x 32K and 32 x 32K):
    // both warps of a key group widen the same fp8 keys, where the staged kernel widens each once.
    if (k == IndexerMma::kAuto) k = hp16 <= 2 ? IndexerMma::kQfrag : IndexerMma::kStaged;
    return k == IndexerMma::kQfrag && hp16 <= 4 && fp8_run(a) == kKeysPerTile ? k : IndexerMma::kStaged;
  }
  // Bf16 keys: the qfrag kernel by default wherever it applies (up to 64 heads, aligned rows): on an
  // H200 (docs/PERFORMANCE.md, session 22) it was as fast as the best of the other two or faster at 1
  // to 128 tokens x 4K to 128K for 32 and 64 heads (one token at 128K: DeepSeek-V3.2 14.0-14.2 ->
  // 12.3 us, GLM-5 11.6-11.7 -> 10.6; 8 x 128K DeepSeek-V3.2 91-92 -> 74, as the regs kernel). The
  // staged kernel for more heads; the regs kernel only when asked for.
  const bool aligned = a.keys.row_bytes == int64_t(a.dim) * 2 && reinterpret_cast<uintptr_t>(a.keys.data) % 16 == 0 &&
                       (a.q16 ? reinterpret_cast<uintptr_t>(a.q16) % 16 == 0 : reinterpret_cast<uintptr_t>(a.q) % 16 == 0);
  if (k == IndexerMma::kAuto) k = IndexerMma::kQfrag;
  return (k == IndexerMma::kRegs || k == IndexerMma::kQfrag) && hp16 <= 4 && aligned ? k : IndexerMma::kStaged;
}

// The mma kernel for keys of DIM values (FP8 or bf16) that `choice` (choose_mma) names, handed to
// launch(kernel, threads, tokens per block, smem_bytes, extra...): the grid is (tile runs,
// token_groups(a, tokens per block)), smem_bytes(tiles) the kernel's shared memory for blocks of that
// many tiles, `extra` its arguments after (a, tiles per block). qfrag_stages: 2, or 3 (A/B runs).
template <int DIM, bool FP8, class Launch>
void dispatch_qfrag(const IndexerArgs& a, int qfrag_stages, Launch&& launch) {
  const bool count = a.counts.hist != nullptr;
  const int bs = a.keys.block_size, hp16 = heads_padded(a.heads) / 16;
  auto one = [&](auto kernel, auto smem) {
    launch(kernel, kQfragThreads, 1, [=](int tiles) { return smem(tiles, bs, count); });
  };
  // (HW warps of MH m-tiles: up to 64 heads)
  if (qfrag_stages == 3) {
    if (hp16 == 1) return one(indexer_qfrag_kernel<DIM, FP8, 1, 1, 3>, qfrag_smem_bytes<DIM, FP8, 1, 1, 3>);
    if (hp16 == 2) return one(indexer_qfrag_kernel<DIM, FP8, 1, 2, 3>, qfrag_smem_bytes<DIM, FP8, 1, 2, 3>);
    return one(indexer_qfrag_kernel<DIM, FP8, 2, 2, 3>, qfrag_smem_bytes<DIM, FP8, 2, 2, 3>);
  }
  if (hp16 == 1) return one(indexer_qfrag_kernel<DIM, FP8, 1, 1, 2>, qfrag_smem_bytes<DIM, FP8, 1, 1, 2>);
  if (hp16 == 2) return one(indexer_qfrag_kernel<DIM, FP8, 1, 2, 2>, qfrag_smem_bytes<DIM, FP8, 1, 2, 2>);
  one(indexer_qfrag_kernel<DIM, FP8, 2, 2, 2>, qfrag_smem_bytes<DIM, FP8, 2, 2, 2>);
}
template <int DIM, bool FP8, class Launch>
void dispatch_tokens(const IndexerArgs& a, Launch&& launch) {
  const int bs = a.keys.block_size, hp16 = heads_padded(a.heads) / 16, run = FP8 ? fp8_run(a) : 0;
  // (HW warps of MH m-tiles per token, as the qfrag kernel: up to 64 heads)
  if (hp16 == 1)
    return launch(indexer_tokens_kernel<DIM, FP8, 1, 1>, kTokensThreads, kTokensWarps,
                  [=](int tiles) { return tokens_smem_bytes<DIM, FP8, 1>(tiles, bs); }, run);
  if (hp16 == 2)
    return launch(indexer_tokens_kernel<DIM, FP8, 1, 2>, kTokensThreads, kTokensWarps,
                  [=](int tiles) { return tokens_smem_bytes<DIM, FP8, 1>(tiles, bs); }, run);
  launch(indexer_tokens_kernel<DIM, FP8, 2, 2>, kTokensThreads, kTokensWarps / 2,
         [=](int tiles) { return tokens_smem_bytes<DIM, FP8, 2>(tiles, bs); }, run);
}
template <int DIM, bool FP8, int STAGES, bool TILE_RUN, int MT, class Launch>
void dispatch_stages(const IndexerArgs& a, int run, Launch&& launch) {
  const bool count = a.counts.hist != nullptr;
  const int heads = a.heads, bs = a.keys.block_size;
  const int64_t rb = a.keys.row_bytes;
  auto smem = [=](int tiles) { return mma_smem_bytes<DIM, FP8, STAGES>(heads, rb, pages_per_block(tiles, bs), count); };
  launch(indexer_mma_kernel<DIM, FP8, STAGES, TILE_RUN, MT>, 128 / MT, 1, smem, run);
}
template <int DIM, int HP16, class Launch>
void dispatch_regs(const IndexerArgs& a, Launch&& launch) {
  const bool count = a.counts.hist != nullptr;
  const int bs = a.keys.block_size;
  launch(indexer_regs_kernel<DIM, HP16>, kRegThreads, 1,
         [=](int tiles) { return regs_smem_bytes<DIM, HP16>(tiles, bs, count); });
}

// Two stages: one tile in flight while one is scored. Measured on an H200 at one token x 128K keys
// and 128 x 128K: more blocks per SM beat deeper rings (bf16: 3 to 5 stages kept 2-3 blocks per SM
// resident and streamed 15-35% slower; fp8, whole-tile runs, 80 registers: 2 stages hold six blocks
// per SM against five with 3, 13-17% faster at 128 tokens, 4-7% at one).
template <int DIM, bool FP8, class Launch>
void dispatch_mma(const IndexerArgs& a, IndexerMma choice, int qfrag_stages, Launch&& launch) {
  if (choice == IndexerMma::kTokens) return dispatch_tokens<DIM, FP8>(a, launch);
  if constexpr (FP8) {
    // Fp8 keys: a warp of the staged kernel scores 32 keys (MT = 2), each query fragment read from
    // shared memory serving twice the keys; their A fragments are built from scalar loads and
    // widened, so the warp's issue slots, not the bytes, bound it. Measured on an H200 (one binary,
    // two rounds): fp8 indexer alone -12 to -22% at 32K-128K for 1 and 8 tokens (DeepSeek-V3.2 one
    // token at 128K 12.8 -> 11.4 us, GLM-5 10.2 -> 8.4) and -15 to -18% at 128 tokens x 128K; GLM-5
    // at 128 x 4K +17% (30.8 -> 35.9). Bf16 keys (ldmatrix A fragments; 64-92% of the copy rate from
    // 8 tokens at 128K) lost 2-18% with 32 keys per warp (half the warps per SM), so they keep 16.
    if (choice == IndexerMma::kQfrag) return dispatch_qfrag<DIM, true>(a, qfrag_stages, launch);
    const int run = fp8_run(a);
    if (run == kKeysPerTile) return dispatch_stages<DIM, FP8, 2, true, 2>(a, run, launch);
    return dispatch_stages<DIM, FP8, 2, false, 2>(a, run, launch);
  } else {
    const int hp16 = heads_padded(a.heads) / 16;
    if (choice == IndexerMma::kRegs) {
      if (hp16 == 1) return dispatch_regs<DIM, 1>(a, launch);
      if (hp16 == 2) return dispatch_regs<DIM, 2>(a, launch);
      if (hp16 == 3) return dispatch_regs<DIM, 3>(a, launch);
      return dispatch_regs<DIM, 4>(a, launch);
    }
    if (choice == IndexerMma::kQfrag) return dispatch_qfrag<DIM, false>(a, qfrag_stages, launch);
    dispatch_stages<DIM, FP8, 2, false, 1>(a, 0, launch);
  }
}

// index_queries (attention.h): block (token, 8 heads), one warp per head.
constexpr int kQueryHeadsPerBlock = 8;

template <class T16>
__global__ void index_queries_kernel(float* q, float* w, int heads, int dim, RopeTable rope,
                                     const int64_t* __restrict__ pos, float w_scale, T16* q16) {
  pdl::launch_dependents();  // the next kernel may start its prologue (pdl.cuh)
  const int t = blockIdx.x, h = blockIdx.y * kQueryHeadsPerBlock + threadIdx.y, lane = threadIdx.x;
  if (h >= heads) return;
  const int64_t head = int64_t(t) * heads + h;
  float* row = q + head * dim;
  T16* row16 = q16 ? q16 + head * dim : nullptr;
  const float p = float(pos[t]);
  float amax = 0.0f;
  for (int64_t i = lane; i < rope.half; i += 32) {
    const int64_t ia = rope_a(rope, i), ib = rope_b(rope, i);
    float x0 = row[ia], x1 = row[ib];
    rope_rotate(rope_angle(rope, p, i), &x0, &x1);
    row[ia] = x0;
    row[ib] = x1;
    amax = fmaxf(amax, fmaxf(fabsf(x0), fabsf(x1)));
  }
  // fp16 queries (fp8 keys): the row scaled by a power of two f that puts its largest value in
  // [2^12, 2^13) (q_factor), its weight by 1 / f: w relu(q.k) = (w / f) relu(f q.k) exactly, and
  // fp16's range (65504) no longer bounds the queries. bf16 has fp32's range: f = 1.
  float f = 1.0f;
  if (row16 && std::is_same<T16, __half>::value) {
    for (int64_t c = 2 * rope.half + lane; c < dim; c += 32) amax = fmaxf(amax, fabsf(row[c]));
    for (int m = 16; m >= 1; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    f = q_factor(__float_as_uint(amax));
  }
  if (row16) {  // each lane reads back the values it wrote
    for (int64_t i = lane; i < rope.half; i += 32) {
      const int64_t ia = rope_a(rope, i), ib = rope_b(rope, i);
      row16[ia] = round16<T16>(row[ia] * f);  // to nearest even, as pack4 rounds
      row16[ib] = round16<T16>(row[ib] * f);
    }
    for (int64_t c = 2 * rope.half + lane; c < dim; c += 32) row16[c] = round16<T16>(row[c] * f);
  }
  if (lane == 0) w[head] = w[head] * w_scale / f;
}

}  // namespace sparsemla::cuda::indexer
