// Sparse MLA decode on Hopper (sm_90a): the matrix products on wgmma, both operands read from shared
// memory by the tensor cores, for latent 512 + rope 64 (GLM-5, DeepSeek-V3.2).
//
// One block per (token, 64 heads, split), three warpgroups:
//   producer (warpgroup 2): gathers each tile of 64 latent rows into shared memory as bf16 (cp.async
//     for bf16 rows; fp8 rows through registers, widened with their group scales), two tiles in
//     flight, handed over through mbarriers (full: the tile is there; empty: both consumers are done).
//   consumer 0 (warpgroup 0): S = Q K^T for the 64 heads x 64 rows (36 wgmma m64n64k16, Q resident
//     in shared memory), the online softmax in registers, P (bf16) to shared memory for consumer 1,
//     then O[:, 0:256] += P V with P from registers (m64n256k16).
//   consumer 1 (warpgroup 1): O[:, 256:512] += P V with P from shared memory.
// V is the first 512 columns of the same rows: one tile serves both products.
//
// Pairs (fp8 rows, an even number of 64-head blocks: DeepSeek-V3.2's 128 heads): two blocks of a
// token and split form a thread-block cluster and gather the same rows, so each producer gathers and
// widens only half of every tile (rows 32 r .. 32 r + 31 for cluster rank r) and writes them into
// both blocks' buffers, into the other block's with st.async, which counts its bytes on that block's
// `remote` mbarrier. A buffer is free once the consumers of both blocks are done with it (every consumer
// thread arrives on its block's `empty`, each consumer warp once on the other block's). The fp8
// gather (loads and widening) is the producer's cost, so pairs halve it; bf16 rows, gathered by
// cp.async in whole lines, are faster unpaired (see Form).
//
// P is unswizzled ("interleaved") core matrices of 8 rows x 16 bytes: a [rows][dims] bf16 matrix is
// stored as [dims / 8][rows][8]; q is in 128-byte swizzled lines (load_q). The K tiles are stored
// interleaved for fp8 and paired rows (a thread's 8 converted dims are one 16-byte store, 8
// consecutive rows one 128-byte line), and for bf16 unpaired rows in 128-byte swizzled lines (9
// pieces of 64 dims x 64 rows; see Form), so that a group of 8 lanes copies whole 128-byte pieces of
// a row. Either way the tile is the K-major B operand of
// Q K^T (rows = n) and, unchanged, the MN-major B operand of P V (rows = k).
// Descriptor strides: LBO between core matrices along K (swizzled MN-major: between pieces along N),
// SBO along M or N (swizzled: between 8-row atoms).
//
// Split clusters (on by default, AttentionWorkspace::split_clusters): where a token's rows are split
// 2-8 ways (unpaired blocks) or 2-4 ways (pairs), its splits form a cluster along z, (1, 1, S) or
// (2, 1, S), and each block merges its heads' splits over distributed shared memory (merge_splits)
// instead of the merge kernel; sparse_mla() takes fewer splits where the planned ones' clusters do
// not all fit at once or the plan splits unpaired blocks 9-16 ways, and unpairs fp8 blocks where only
// unpaired clusters fit (wgmma_cluster_splits).
//
// Built only for sm_90a (src/CMakeLists.txt); other architectures compile a stub that traps, and
// the host side refuses to launch where this build has no sm_90a code or the device is not 9.0.
#include <cuda_bf16.h>

#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "ops/cuda/attention.h"
#include "ops/cuda/attention_smem.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/sm90.cuh"
#include "ops/cuda/sparse_mla_plan.h"
#include "ops/cuda/sparse_mla_sm90.h"
#include "ops/cuda/sparse_mla_tile.cuh"
#include "util/env.h"

namespace sparsemla::cuda {
namespace {

constexpr int kHeads = 64;    // heads per block: the M of every wgmma
constexpr int kTile = 64;     // latent rows per tile: the N of S = Q K^T, the K of O += P V
constexpr int kLora = 512;    // latent (and value) dims
constexpr int kRope = 64;
constexpr int kDim = kLora + kRope;
constexpr int kChunks = kDim / 8;  // 16-byte chunks of a bf16 row
constexpr int kThreads = 384;
// Splits merged in their cluster (merge_splits): at most a portable cluster's size.
constexpr int kMaxClusterSplits = kMergeMaxSplits;
static_assert(kWgmmaPairMinRows == 2 * kTile, "pairs need two tiles per split");
static_assert(kMaxClusterSplits == kWgmmaMaxClusterSplits, "the launch rule's cluster bound is the merge's");

// Shared memory, in bytes.
constexpr int kMatBytes = kChunks * 64 * 16;             // one [64][576] bf16 matrix: 72 KB
constexpr int kOffQ = 0;                                  // q, [9][64 heads][128 B] swizzled
constexpr int kOffK = kOffQ + kMatBytes;                  // two tiles, interleaved or swizzled (Form)
constexpr int kOffP = kOffK + 2 * kMatBytes;              // P, [8][64 heads][8 rows] bf16
constexpr int kOffAlpha = kOffP + (kTile / 8) * 64 * 16;  // [2][64] per-head rescale of tile j (j % 2)
constexpr int kOffL = kOffAlpha + 2 * 64 * 4;                // [64] softmax denominators (epilogue)
constexpr int kOffM = kOffL + 64 * 4;                     // [64] running maxima (epilogue)
constexpr int kOffValid = kOffM + 64 * 4;                 // [2][64] uint32: the tile's row is used
constexpr int kOffBar = kOffValid + 2 * kTile * 4;        // mbarriers full[2], empty[2], remote[2]
constexpr int kSmemBytes = kOffBar + 6 * 8;               // 230,960 of the 232,448 a block may have
static_assert(kSmemBytes == mla_smem::kWgmmaBytes, "the selector checks devices against mla_smem::kWgmmaBytes");

// Registers per thread of the three roles: they add up to 3 x 168, what the block starts with
// (__launch_bounds__(384, 1) on 64K registers); setmaxnreg moves registers between warpgroups.
constexpr int kRegsQk = 224, kRegsPv = 160, kRegsProducer = 120;
static_assert(kRegsQk + kRegsPv + kRegsProducer == 3 * 168, "the block's registers are 384 x 168");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

using namespace sm90;  // the instructions (ops/cuda/sm90.cuh)

constexpr float kLog2e = 1.4426950408889634f;
// Bytes a block of a pair receives from the other block per tile: 32 rows and their flags (fp8
// pairs: widened rows by st.async; bf16 rows never pair).
constexpr uint32_t kPeerBytes = 32 * (kChunks * 16 + 4);

// Named barriers between the two consumer warpgroups (0 is __syncthreads).
constexpr int kBarQ = 1;       // q is in shared memory
constexpr int kBarPReady = 2;  // P and alpha of the tile are in shared memory
constexpr int kBarPFree = 3;   // consumer 1 is done reading them (both warpgroups wait)
constexpr int kBarEpi = 4;     // denominators and maxima are in shared memory

__device__ constexpr int ceil_tiles(int rows) { return (rows + kTile - 1) / kTile; }

// Layouts of a K tile in shared memory (Form below): interleaved core matrices ([72][64 rows][16 B],
// chunk cc of row r at cc * 1024 + r * 16), or 128-byte swizzled lines (the layout TMA and FlashMLA use:
// 9 pieces of 64 dims, [9][64 rows][128 B], chunk cc of row r in piece cc / 8 at line position
// (cc % 8) ^ (r % 8); atoms of 8 rows x 128 B, 1024-byte aligned).
template <bool SW>
__device__ __forceinline__ int kv_off(int r, int cc) {
  if constexpr (SW) return (cc / 8) * 8192 + r * 128 + (((cc % 8) ^ (r % 8)) * 16);
  else return cc * 1024 + r * 16;
}

// Where an fp8 producer's writes go (interleaved tiles): row `row` of this block's tile, and in a
// pair also the other block's.
struct Dest {
  unsigned char* tile;  // this block's buffer
  uint32_t peer;        // the same buffer in the other block (shared::cluster), if paired
  uint32_t peer_bar;    // the other block's remote[b]
  int row;
  __device__ void put16(int cc, uint4 v, bool paired) const {
    const int off = kv_off<false>(row, cc);
    *reinterpret_cast<uint4*>(tile + off) = v;
    if (paired) st_async16(peer + off, v, peer_bar);
  }
};

// q of the block's 64 heads as bf16 in 128-byte swizzled lines, laid out as the bf16 K tiles (kv_off<true>:
// 9 pieces of 64 dims, [9][64 heads][128 B]), by the 256 consumer threads in two rounds of 18 float4
// loads in flight. Each half warp takes one (head, piece) at a time, its 16 lanes the piece's 16
// float4 (256 contiguous bytes of fp32, whole lines: a warp's load reads 4 lines) and writes it as
// one 128-byte line of shared memory (8-byte stores, no bank conflict); half warp w takes heads w +
// 16 i of piece k / 4 at step k, so every address is the thread's own plus a constant. (The form
// before, a head per lane, read 32 lines per load instruction: its cost grew with the heads and made
// the batch-1 launch, one tile per block, slower at 64 heads than at 8.) Missing heads are zero.
__device__ __forceinline__ void load_q(const AttentionArgs& a, int t, int h0, unsigned char* sQ, int ctid) {
  constexpr int kRow4 = kDim / 4;                                  // float4 per head
  constexpr int kSteps = kHeads * kRow4 / 256, kRound = kSteps / 2;  // per thread: 36, 18 a round
  static_assert(kRow4 == 9 * 16 && kSteps == 4 * 9, "16 half warps, 4 heads each per piece, 9 pieces");
  const int hw = ctid / 16, l16 = ctid % 16;
  const int present = a.heads - h0 - hw;  // heads of this half warp's run (hw + 16 i) that q holds: i * 16 < present
  const float4* src = reinterpret_cast<const float4*>(a.q + (int64_t(t) * a.heads + h0 + hw) * kDim) + l16;
  unsigned char* dst = sQ + kv_off<true>(hw, l16 / 2) + (l16 % 2) * 8;
#pragma unroll
  for (int r = 0; r < kSteps; r += kRound) {
    float4 x[kRound];
#pragma unroll
    for (int u = 0; u < kRound; ++u) {
      const int k = r + u, i = k % 4, piece = k / 4;
      x[u] = 16 * i < present ? src[16 * i * kRow4 + piece * 16] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kRound; ++u) {
      const int k = r + u, i = k % 4, piece = k / 4;
      *reinterpret_cast<uint2*>(dst + piece * 8192 + 16 * i * 128) =
          make_uint2(pack_bf16(x[u].x, x[u].y), pack_bf16(x[u].z, x[u].w));
    }
  }
}

// What a block does: token t, heads h0 .. h0 + 63, rows [r_begin, r_end) of the token's rows.
struct Work {
  int t, h0, split, splits;
  bool bulk_out;  // store_output's form
  bool merge;     // the splits are one cluster that merges them (merge_splits); needs bulk_out
  int r_begin, r_end, n_tiles;
};

// One fp8 row's share of a producer thread: e4m3 pieces part + 4 i (dims 16 p .. 16 p + 15, scale
// group i / 2) and the row's four group scales. (Its rope pieces are copied as they are stored.)
struct Fp8Piece {
  uint4 v[8];
  float4 scale;
};

__device__ __forceinline__ void load_fp8_piece(Fp8Piece& x, const uint8_t* base, int slot, int64_t row_bytes,
                                               int part) {
  const uint8_t* src = base + int64_t(slot) * row_bytes;
  const bool used = slot >= 0;
#pragma unroll
  for (int i = 0; i < 8; ++i)
    x.v[i] = used ? *reinterpret_cast<const uint4*>(src + (part + 4 * i) * 16) : make_uint4(0, 0, 0, 0);
  x.scale = used ? *reinterpret_cast<const float4*>(src + kLora) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// Widens a piece to bf16 into its row of a tile (and of the other block's, if paired) and copies
// the row's rope pieces part and part + 4.
__device__ __forceinline__ void store_fp8_piece(const Fp8Piece& x, const uint8_t* base, int slot, int64_t row_bytes,
                                                const Dest& dst, int part, bool paired) {
  uint4 rope[2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
    rope[i] = slot >= 0 ? *reinterpret_cast<const uint4*>(base + int64_t(slot) * row_bytes + kLora + 16 + (part + 4 * i) * 16)
                        : make_uint4(0, 0, 0, 0);
  const float scales[4] = {x.scale.x, x.scale.y, x.scale.z, x.scale.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int p = part + 4 * i;
    dst.put16(2 * p, widen_fp8x8(make_uint2(x.v[i].x, x.v[i].y), scales[i / 2]), paired);
    dst.put16(2 * p + 1, widen_fp8x8(make_uint2(x.v[i].z, x.v[i].w), scales[i / 2]), paired);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) dst.put16(kLora / 8 + part + 4 * i, rope[i], paired);
}

// How the producer gathers, and the tile layout its consumers read:
//   fp8 rows (paired or not): interleaved tiles; a thread takes rows w * 8 + lane % 8 (+ 32 per round)
//     of warp w and the 16-byte pieces lane / 8 + 4 i, loads them into registers, widens and stores
//     them; eight lanes write one 128-byte line of shared memory. (Session 45: their rope pieces by
//     cp.async, every row's in each block of a pair, lost 4-19%; with the e4m3 pieces also loaded a
//     tile ahead, 2-10%: H100, GLM-5 fp8 batch 128 135 -> 160 / 148 us; wgmma_fp8_forms.patch.)
//   bf16 rows (never paired), LINES: swizzled tiles gathered by cp.async in whole lines: a group of 8
//     lanes copies a row's 128-byte pieces whole (lane q the 16 bytes q of each), so a warp reads 4
//     whole lines of 4 rows per instruction; group g takes rows g + 16 i. The copies' completion
//     arrives on the full barrier by itself (cp.async.mbarrier.arrive.noinc), so the producer never
//     waits for its own copies (H100, session 44: GLM-5 batch 128 193 -> 130 us, DeepSeek-V3.2 unpaired
//     212 us against 272 paired; fp8 and paired rows in swizzled tiles lost 3-19%, so they keep theirs;
//     pairs in lines, each block forwarding its half to the other by bulk copies, lost to unpaired lines
//     at every batch, session 45: 306 us against 211 at batch 128, wgmma_bf16_pairs.patch).
//   bf16 rows, !LINES (SPARSEMLA_WGMMA_LINES=0, for A/B): as fp8 rows' threads and tiles, by cp.async,
//     the producer waiting for its copies before it arrives.
template <bool FP8, bool PAIR, bool LINES>
struct Form {
  static_assert(!LINES || !FP8, "whole-line gathers are for bf16 rows");
  static_assert(!PAIR || FP8, "bf16 rows never pair");
  static constexpr bool kPair = PAIR;
  static constexpr bool kSwizzled = LINES;
  static constexpr bool kAsync = LINES;            // the copies arrive on the full barrier by themselves
  static constexpr uint32_t kFullArrivals = LINES ? 256 : 128;  // the producer's threads (+ their copies)
  static constexpr int kVStep = LINES ? 2048 : 256;  // bytes between P V's k-steps of 16 rows in a tile
};

// Warpgroup 2. Rows and pieces per thread: see Form above.
// No load's result is waited for soon after it is issued: a row's slot is found in three steps one
// tile apart (position for tile j + 3, block-table entry for tile j + 2, slot for tile j + 1, whose
// fp8 rows are then prefetched into L2), and fp8 rows are loaded into registers before the buffer
// they go to is free. Slots are int32 here (a layer's cache has fewer than 2^31 rows).
template <bool FP8, bool PAIR, bool LINES>
__device__ __forceinline__ void produce(const AttentionArgs& a, const Work& w, unsigned char* smem, int ptid) {
  constexpr bool kLines = LINES;
  constexpr int kRounds = (kLines ? 4 : 2) / (PAIR ? 2 : 1);
  constexpr int kStep = kLines ? 16 : 32;  // rows between a thread's rounds
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kOffBar);
  uint64_t* empty = full + 2;
  uint64_t* remote = full + 4;
  uint32_t* valid = reinterpret_cast<uint32_t*>(smem + kOffValid);
  // rank: this block's place in its pair (the cluster's x); peer: the other block's cluster rank
  // (a pair's blocks are x 0 and 1 of the same z, also where their splits form the cluster's z).
  const uint32_t crank = PAIR ? cluster_rank() : 0u, rank = crank & 1u, peer = crank ^ 1u;
  // part: which of the row's 16-byte pieces (part + 4 i; lines: part + 8 p); row_a: round 0's row.
  const int part = kLines ? ptid % 8 : (ptid % 32) / 8;
  const int row_a = (kLines ? ptid / 8 : (ptid / 32) * 8 + ptid % 8) + 32 * int(rank);
  const uint8_t* base = static_cast<const uint8_t*>(a.latent.data);
  const int64_t row_bytes = a.latent.row_bytes;
  const int32_t* table = a.latent.block_tables + int64_t(a.seq[w.t]) * a.latent.max_blocks;
  const int bs = a.latent.block_size;
  // Row (tile j, round) is entry first + j * 64 + kStep * round of the token's rows, if below `rows`.
  const int first = w.r_begin + row_a, rows = w.r_end - first;
  const int32_t* sel = a.selected ? a.selected + int64_t(w.t) * a.top_k + first : nullptr;
  auto position = [&](int j, int round) {  // -1: no row (an unused entry, or past the split)
    const int k = j * kTile + kStep * round;
    if (k >= rows) return -1;
    return sel ? sel[k] : first + k;
  };
  auto block_of = [&](int pos) { return pos >= 0 ? table[pos / bs] : 0; };
  auto slot_at = [&](int pos, int blk) { return pos >= 0 ? blk * bs + pos % bs : -1; };
  int pos1[kRounds], blk1[kRounds], pos2[kRounds], slot0[kRounds], slot1[kRounds];
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    const int p0 = position(0, round);
    slot0[round] = slot_at(p0, block_of(p0));
    pos1[round] = position(1, round);
    blk1[round] = block_of(pos1[round]);
    pos2[round] = position(2, round);
  }
  for (int j = 0; j < w.n_tiles; ++j) {
    const int b = j & 1;
    int pos3[kRounds], blk2[kRounds];
#pragma unroll
    for (int round = 0; round < kRounds; ++round) {
      pos3[round] = position(j + 3, round);
      blk2[round] = block_of(pos2[round]);
      slot1[round] = slot_at(pos1[round], blk1[round]);
      // fp8 rows: tile j + 1's rows into L2, one bulk prefetch per row. Not for bf16 rows, whose
      // gather it slows (H100, session 43: GLM-5 batch 128 217.5 -> 196.4 us without it, a 16K
      // prefill +2.8%; fp8 rows gained or lost up to 3% by shape, so they keep it).
      if (FP8 && part == 0 && slot1[round] >= 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + int64_t(slot1[round]) * row_bytes),
                     "r"(uint32_t(row_bytes))
                     : "memory");
    }
    unsigned char* tile = smem + kOffK + b * kMatBytes;
    const uint32_t peer_bar = PAIR ? peer_u32addr(smem_u32addr(&remote[b]), peer) : 0u;
    auto dest = [&](int round) {
      return Dest{tile, PAIR ? peer_u32addr(smem_u32addr(tile), peer) : 0u, peer_bar, row_a + kStep * round};
    };
    if constexpr (FP8) {  // the rows into registers before the buffer is free
      Fp8Piece x[kRounds];
#pragma unroll
      for (int round = 0; round < kRounds; ++round) load_fp8_piece(x[round], base, slot0[round], row_bytes, part);
      mbar_wait(&empty[b], ((j >> 1) & 1) ^ 1);
      if (PAIR && ptid == 0) mbar_arrive_expect(&remote[b], kPeerBytes);  // what the other block sends
#pragma unroll
      for (int round = 0; round < kRounds; ++round)
        store_fp8_piece(x[round], base, slot0[round], row_bytes, dest(round), part, PAIR);
    } else {
      mbar_wait(&empty[b], ((j >> 1) & 1) ^ 1);
      constexpr int kPieces = kLines ? kChunks / 8 : kChunks / 4, kPieceStep = kLines ? 8 : 4;
#pragma unroll
      for (int round = 0; round < kRounds; ++round) {
        const int r = row_a + kStep * round;
        const uint8_t* src = base + int64_t(slot0[round]) * row_bytes;
#pragma unroll
        for (int i = 0; i < kPieces; ++i) {
          const int c = part + kPieceStep * i;
          unsigned char* dst = tile + kv_off<kLines>(r, c);
          if (slot0[round] >= 0) cp_async16(dst, src + c * 16);
          else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
        }
      }
      if constexpr (kLines) cp_async_mbar_arrive_noinc(&full[b]);
      else cp_async_wait_all();
    }
    if (part == 0) {
#pragma unroll
      for (int round = 0; round < kRounds; ++round) {
        uint32_t* flag = valid + b * kTile + row_a + kStep * round;
        *flag = slot0[round] >= 0;
        if (PAIR && FP8) st_async4(peer_u32addr(smem_u32addr(flag), peer), slot0[round] >= 0, peer_bar);
      }
    }
    fence_async_smem();
    mbar_arrive(&full[b]);
#pragma unroll
    for (int round = 0; round < kRounds; ++round) {
      slot0[round] = slot1[round];
      pos1[round] = pos2[round];
      blk1[round] = blk2[round];
      pos2[round] = pos3[round];
    }
  }
}

// A consumer thread is done with buffer b: one arrival per thread on this block's empty[b], and in
// a pair one per warp on the other block's (after the whole warp's arrivals: its reads are done).
template <bool PAIR>
__device__ __forceinline__ void release_tile(uint64_t* empty_b) {
  mbar_arrive(empty_b);
  if constexpr (PAIR) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive_peer(peer_u32addr(smem_u32addr(empty_b), cluster_rank() ^ 1u));
  }
}

// Waits until tile j is in buffer b: full[b] (this block's producer), and in a pair remote[b] (the
// other block's half; the barriers are full[2], empty[2], remote[2] from kOffBar).
// Where the producer's copies arrive by themselves (bf16 rows in lines), the tensor cores' reads are
// ordered after them here.
template <class F>
__device__ __forceinline__ void wait_tile(uint64_t* full, int j) {
  const int b = j & 1;
  mbar_wait(&full[b], (j >> 1) & 1);
  if constexpr (F::kPair) mbar_wait(&full[4 + b], (j >> 1) & 1);
  if constexpr (F::kAsync) fence_async_smem();
}

// Consumer fragments (m64nN accumulators): warp w of the warpgroup holds rows 16 w + g and 16 w + g + 8
// (g = lane / 4); register 4 j + e is column 8 j + 2 (lane % 4) + (e & 1) of row 16 w + g (+ 8 if e >= 2).
struct Lane {
  int row0, q4;  // rows row0 and row0 + 8 of the block; columns 2 q4, 2 q4 + 1 of every 8
  __device__ explicit Lane(int tid) : row0((tid % 128) / 32 * 16 + (tid % 32) / 4), q4(tid % 4) {}
};

// O *= the rows' rescale factors; skipped by a warp whose rows' maxima did not move (most tiles).
__device__ __forceinline__ void rescale(float (&o)[128], float alpha0, float alpha1) {
  if (!__any_sync(0xffffffffu, alpha0 != 1.0f || alpha1 != 1.0f)) return;
#pragma unroll
  for (int jn = 0; jn < 32; ++jn) {
    o[4 * jn] *= alpha0;
    o[4 * jn + 1] *= alpha0;
    o[4 * jn + 2] *= alpha1;
    o[4 * jn + 3] *= alpha1;
  }
}

// The block's output: normalized rows [heads][512] when unsplit, else the split's unnormalized sums
// with each head's maximum and denominator (from shared memory, kBarEpi), rows of
// partial_row_floats(512). Two forms (Work::bulk_out, chosen by the host side):
//  - bulk: both consumer warpgroups put their columns (wg * 256 .. + 255) into a staging copy in the
//    tile buffers (free once both consumers are past their last tile: rows kStageStride floats
//    apart, 8 banks apart, so that a half warp's float2 stores meet no conflict), then one bulk copy
//    (the TMA unit) per head's row. Stored from the fragments, every warp instruction wrote 8 heads'
//    rows, and those stores held a third of the stall samples at one tile per block (session 49);
//    copied from the staging copy by the threads instead (a warp's store 256 contiguous bytes), as
//    many store instructions: slower than the bulk copies at every shape (session 50, run 96;
//    scripts/device/patches/wgmma_staged_output.patch).
//  - fragments: each consumer thread stores its fragments' float2: faster where the block's 64 rows
//    are mostly padding (8 heads), and where the output is not 16-byte aligned.
constexpr int kStageStride = kLora + 8;
constexpr int kBarStage = 5;  // the staging copy is whole
static_assert(kOffK + kHeads * kStageStride * 4 <= kOffP, "the staging copy fits in the tile buffers");
static_assert(kStageStride * 4 % 16 == 0 && kOffK % 16 == 0, "staged rows start 16-byte aligned (bulk copies)");

// Merged in the cluster (Work::merge: the token's splits, at most kMaxClusterSplits, are one
// thread-block cluster along z): every block has staged its unnormalized sums with each head's
// maximum and denominator (store_output's bulk form); after a cluster barrier, block `rank` of S
// takes the rank-th S-th of the (head, 4 dims) items, reads the S staging copies over distributed
// shared memory, and writes the normalized output itself. No partial rows go through global memory
// and no merge kernel runs. The weights come from merge_weights8 (sparse_mla_tile.cuh) and the
// splits are added in order, as mla_combine_kernel does: the merge kernel's bits. A second barrier
// keeps every staging copy until the other blocks are done reading it. Called by the 256 consumer
// threads; the producer's 128 take part in both barriers (mla_wgmma_body).
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ float ld_cluster_f(uint32_t addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void merge_splits(const AttentionArgs& a, const Work& w, unsigned char* smem) {
  const int S = w.splits, tid = threadIdx.x;
  // The cluster is (nx, 1, S): nx = 2 for pairs, whose two blocks (x) each merge their own heads'
  // splits; split s of this block's heads is cluster rank x + nx s. (rank = split: the cluster
  // spans the grid's z.)
  const uint32_t nx = cluster_dim_x(), x = cluster_rank() % nx, rank = uint32_t(w.split);
  const uint32_t stage = smem_u32addr(smem + kOffK);
  float* sW = reinterpret_cast<float*>(smem + kOffP);  // [64][kMaxClusterSplits]: P's buffer is free now
  uint32_t peer[kMaxClusterSplits];
#pragma unroll
  for (int s = 0; s < kMaxClusterSplits; ++s) peer[s] = s < S ? peer_u32addr(stage, x + nx * uint32_t(s)) : 0u;
  cluster_sync();  // every block's staging copy is whole
  const int rows = min(kHeads, a.heads - w.h0);
  if (tid < rows) {
    const uint32_t at = uint32_t(tid * kStageStride + kLora) * 4u;
    float m[kMaxClusterSplits], l[kMaxClusterSplits], wt[kMaxClusterSplits];
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      m[s] = s < S ? ld_cluster_f(peer[s] + at) : -INFINITY;
      l[s] = s < S ? ld_cluster_f(peer[s] + at + 4u) : 0.0f;
    }
    merge_weights8(m, l, wt);
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) sW[tid * kMaxClusterSplits + s] = wt[s];
  }
  named_sync(kBarStage, 256);
  constexpr int kRow4 = kLora / 4;
  const int items = rows * kRow4, begin = int(int64_t(items) * rank / S), end = int(int64_t(items) * (rank + 1) / S);
  for (int i = begin + tid; i < end; i += 256) {
    const int h = i / kRow4, c4 = i % kRow4;
    const uint32_t at = uint32_t(h * kStageStride + 4 * c4) * 4u;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      if (s >= S) break;
      const float4 o = ld_cluster_f4(peer[s] + at);
      const float ws = sW[h * kMaxClusterSplits + s];
      acc.x += ws * o.x;
      acc.y += ws * o.y;
      acc.z += ws * o.z;
      acc.w += ws * o.w;
    }
    *reinterpret_cast<float4*>(a.out + (int64_t(w.t) * a.heads + w.h0 + h) * kLora + 4 * c4) = acc;
  }
  cluster_sync();  // no block leaves while another may still read its staging copy
}

__device__ __forceinline__ void store_output(const AttentionArgs& a, const Work& w, const Lane& ln, int wg,
                                             const float (&o)[128], unsigned char* smem, float* part) {
  const float* sL = reinterpret_cast<const float*>(smem + kOffL);
  const float* sM = reinterpret_cast<const float*>(smem + kOffM);
  const int col0 = wg * 256 + 2 * ln.q4;
  const int64_t prow = partial_row_floats(kLora);
  if (!w.bulk_out) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = ln.row0 + 8 * rr, h = w.h0 + row;
      if (h >= a.heads) continue;
      const float lr = sL[row];
      if (w.splits == 1) {
        const float inv = lr > 0.0f ? 1.0f / lr : 0.0f;
        float* dst = a.out + (int64_t(w.t) * a.heads + h) * kLora + col0;
#pragma unroll
        for (int jn = 0; jn < 32; ++jn)
          *reinterpret_cast<float2*>(dst + 8 * jn) = make_float2(o[4 * jn + 2 * rr] * inv, o[4 * jn + 2 * rr + 1] * inv);
      } else {
        float* dst = part + ((int64_t(w.t) * w.splits + w.split) * a.heads + h) * prow;
#pragma unroll
        for (int jn = 0; jn < 32; ++jn)
          *reinterpret_cast<float2*>(dst + col0 + 8 * jn) = make_float2(o[4 * jn + 2 * rr], o[4 * jn + 2 * rr + 1]);
        if (wg == 0 && ln.q4 == 0) {
          dst[kLora] = sM[row];
          dst[kLora + 1] = lr;
        }
      }
    }
    return;
  }
  float* stage = reinterpret_cast<float*>(smem + kOffK);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = ln.row0 + 8 * rr;
    const float lr = sL[row];
    const float f = w.splits == 1 ? (lr > 0.0f ? 1.0f / lr : 0.0f) : 1.0f;
    float* dst = stage + row * kStageStride + col0;
#pragma unroll
    for (int jn = 0; jn < 32; ++jn)
      *reinterpret_cast<float2*>(dst + 8 * jn) = make_float2(o[4 * jn + 2 * rr] * f, o[4 * jn + 2 * rr + 1] * f);
    if (w.splits > 1 && wg == 0 && ln.q4 == 0) {  // (an unsplit row is kLora long: no maximum, no sum)
      stage[row * kStageStride + kLora] = sM[row];
      stage[row * kStageStride + kLora + 1] = lr;
    }
  }
  if (w.merge) {
    merge_splits(a, w, smem);
    return;
  }
  fence_async_smem();  // the staging copy, written by these threads, is read by the bulk copies
  named_sync(kBarStage, 256);
  // Head row r of the block (consecutive rows in both outputs) by consumer thread r.
  const int rows = min(kHeads, a.heads - w.h0), r = threadIdx.x;
  if (r < rows) {
    const int64_t row_len = w.splits == 1 ? kLora : prow;
    float* dst = w.splits == 1 ? a.out + (int64_t(w.t) * a.heads + w.h0) * kLora
                               : part + ((int64_t(w.t) * w.splits + w.split) * a.heads + w.h0) * prow;
    bulk_store(dst + r * row_len, smem_u32addr(stage + r * kStageStride), uint32_t(row_len * 4));
    bulk_commit();
    bulk_wait_read();  // (the block's shared memory outlives the copy's reads)
  }
}

// Warpgroup 0: S = Q K^T, the online softmax, P to consumer 1, O[:, 0:256] += P V.
template <class F>
__device__ __forceinline__ void consume_qk(const AttentionArgs& a, const Work& w, unsigned char* smem, float* part) {
  const Lane ln(threadIdx.x);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kOffBar);
  uint64_t* empty = full + 2;
  float* sAlpha = reinterpret_cast<float*>(smem + kOffAlpha);
  const uint32_t sbase = smem_u32addr(smem);
  load_q(a, w.t, w.h0, smem + kOffQ, threadIdx.x);
  fence_async_smem();
  named_sync(kBarQ, 256);

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float sl2 = a.scale * kLog2e;
  for (int j = 0; j < w.n_tiles; ++j) {
    const int b = j & 1;
    const uint32_t tile = sbase + kOffK + b * kMatBytes;
    wait_tile<F>(full, j);

    // S = Q K^T over 36 k-steps of 16 dims (in q and a swizzled tile 32 bytes apart within a piece's
    // lines, pieces 8192 bytes apart; in an interleaved tile 2048 bytes apart).
    float s[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.0f;
    const uint64_t dq = wgmma_desc_sw128(sbase + kOffQ, 16, 1024);
    const uint64_t dk = F::kSwizzled ? wgmma_desc_sw128(tile, 16, 1024) : wgmma_desc(tile, 1024, 128);
    auto sw_step = [](int ks) { return (ks / 4) * 8192 + (ks % 4) * 32; };
    auto k_step = [&](int ks) { return F::kSwizzled ? sw_step(ks) : ks * 2048; };
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kDim / 16; ++ks)
      wgmma_m64n64k16_ss(s, dq + (sw_step(ks) >> 4), dk + (k_step(ks) >> 4), ks);
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(s);

    // Online softmax on rows row0 (e = 0, 1) and row0 + 8 (e = 2, 3); unused rows are -inf.
    const uint32_t* valid = reinterpret_cast<const uint32_t*>(smem + kOffValid) + b * kTile;
#pragma unroll
    for (int jn = 0; jn < 8; ++jn)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[4 * jn + e] = valid[8 * jn + 2 * ln.q4 + (e & 1)] ? s[4 * jn + e] * sl2 : -INFINITY;
    float alpha[2];
    online_softmax<8>(s, m, l, alpha);
    rescale(o, alpha[0], alpha[1]);
    // P as bf16: p[2 jn + rr] holds row row0 + 8 rr, columns 8 jn + 2 q4 and + 1.
    uint32_t p[16];
#pragma unroll
    for (int jn = 0; jn < 8; ++jn) {
      p[2 * jn] = pack_bf16(s[4 * jn], s[4 * jn + 1]);
      p[2 * jn + 1] = pack_bf16(s[4 * jn + 2], s[4 * jn + 3]);
    }

    // Hand P and alpha to consumer 1 once it is done with the previous tile's.
    if (j > 0) named_sync(kBarPFree, 256);
#pragma unroll
    for (int jn = 0; jn < 8; ++jn)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr)
        *reinterpret_cast<uint32_t*>(smem + kOffP + jn * 1024 + (ln.row0 + 8 * rr) * 16 + ln.q4 * 4) = p[2 * jn + rr];
    if (ln.q4 == 0) {
      sAlpha[b * 64 + ln.row0] = alpha[0];
      sAlpha[b * 64 + ln.row0 + 8] = alpha[1];
    }
    fence_async_smem();
    named_arrive(kBarPReady, 256);

    // O[:, 0:256] += P V: k-step kk takes rows 16 kk .. 16 kk + 15 (256 bytes into an interleaved
    // tile, 2048 into a swizzled one, whose pieces of 64 dims are 8192 bytes apart).
    const uint64_t dv = F::kSwizzled ? wgmma_desc_sw128(tile, 8192, 1024) : wgmma_desc(tile, 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      const uint32_t frag[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
      wgmma_m64n256k16_rs(o, frag, dv + kk * (F::kVStep >> 4));
    }
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(o);
    reg_fence(p);
    release_tile<F::kPair>(&empty[b]);
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
  }
  if (ln.q4 == 0) {
    float* sL = reinterpret_cast<float*>(smem + kOffL);
    float* sM = reinterpret_cast<float*>(smem + kOffM);
    sL[ln.row0] = l[0];
    sL[ln.row0 + 8] = l[1];
    sM[ln.row0] = m[0];
    sM[ln.row0 + 8] = m[1];
  }
  named_sync(kBarEpi, 256);
  store_output(a, w, ln, 0, o, smem, part);
}

// Warpgroup 1: O[:, 256:512] += P V with P and the rescale from consumer 0.
template <class F>
__device__ __forceinline__ void consume_pv(const AttentionArgs& a, const Work& w, unsigned char* smem, float* part) {
  const Lane ln(threadIdx.x);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kOffBar);
  uint64_t* empty = full + 2;
  const float* sAlpha = reinterpret_cast<const float*>(smem + kOffAlpha);
  const uint32_t sbase = smem_u32addr(smem);
  load_q(a, w.t, w.h0, smem + kOffQ, threadIdx.x);
  fence_async_smem();
  named_sync(kBarQ, 256);

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  for (int j = 0; j < w.n_tiles; ++j) {
    const int b = j & 1;
    const uint32_t tile = sbase + kOffK + b * kMatBytes;
    wait_tile<F>(full, j);
    named_sync(kBarPReady, 256);
    rescale(o, sAlpha[b * 64 + ln.row0], sAlpha[b * 64 + ln.row0 + 8]);
    // P k-steps are 2048 bytes apart; V's dims 256.. start 32 chunks of 8 dims into an interleaved
    // tile, 4 pieces into a swizzled one.
    const uint64_t dp = wgmma_desc(sbase + kOffP, 1024, 128);
    const uint64_t dv =
        F::kSwizzled ? wgmma_desc_sw128(tile + 4 * 8192, 8192, 1024) : wgmma_desc(tile + 32 * 1024, 128, 1024);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) wgmma_m64n256k16_ss(o, dp + kk * (2048 >> 4), dv + kk * (F::kVStep >> 4));
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(o);
    release_tile<F::kPair>(&empty[b]);
    if (j + 1 < w.n_tiles) named_sync(kBarPFree, 256);  // nothing to do before the next P anyway
  }
  named_sync(kBarEpi, 256);
  store_output(a, w, ln, 1, o, smem, part);
}

template <bool FP8, bool PAIR, bool LINES>
__device__ __forceinline__ void mla_wgmma_body(const AttentionArgs& a, int rows_per_split, float* part, bool bulk_out,
                                               bool merge) {
  extern __shared__ __align__(1024) unsigned char smem[];
  using F = Form<FP8, PAIR, LINES>;
  Work w;
  w.t = blockIdx.y;
  w.h0 = blockIdx.x * kHeads;
  w.split = blockIdx.z;
  w.splits = gridDim.z;
  w.bulk_out = bulk_out || merge;
  w.merge = merge && w.splits > 1;
  const int n_rows = token_rows(a, w.t);
  w.r_begin = w.split * rows_per_split;
  w.r_end = min(n_rows, w.r_begin + rows_per_split);
  w.n_tiles = w.r_end > w.r_begin ? ceil_tiles(w.r_end - w.r_begin) : 0;
  if (threadIdx.x == 0) {
    // Swizzled q (and tiles) need 1024-byte aligned atoms: the block's shared memory starts so aligned.
    if ((smem_u32addr(smem) & 1023u) != 0) __trap();
    // full: the producer's threads (and for bf16 rows in lines their copies' completions)
    const uint32_t producers = F::kFullArrivals;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + kOffBar);
    mbar_init(&bars[0], producers);
    mbar_init(&bars[1], producers);
    mbar_init(&bars[2], PAIR ? 256 + 8 : 256);  // empty: both consumers' threads (+ the other block's warps)
    mbar_init(&bars[3], PAIR ? 256 + 8 : 256);
    mbar_init(&bars[4], 1);  // remote: this block's producer thread 0, with the bytes the other block sends
    mbar_init(&bars[5], 1);
    if (PAIR) asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (PAIR) cluster_sync();  // the other block's barriers exist before anything reaches them
  else __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegsQk));
    consume_qk<F>(a, w, smem, part);
  } else if (wg == 1) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegsPv));
    consume_pv<F>(a, w, smem, part);
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegsProducer));
    produce<FP8, PAIR, LINES>(a, w, smem, threadIdx.x - 256);
    if (w.merge) {  // merge_splits' two barriers
      cluster_sync();
      cluster_sync();
    }
  }
  if (PAIR) cluster_sync();  // neither block leaves while the other may still reach its shared memory
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <bool FP8, bool PAIR, bool LINES>
__global__ void __launch_bounds__(kThreads, 1) mla_wgmma_kernel(const __grid_constant__ AttentionArgs a,
                                                                int rows_per_split, float* part, bool bulk_out,
                                                                bool merge) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  mla_wgmma_body<FP8, PAIR, LINES>(a, rows_per_split, part, bulk_out, merge);
#else
  __trap();  // no sm_90a code in this pass: the host side never launches it here
#endif
}

using Kernel = void (*)(AttentionArgs, int, float*, bool, bool);

// A launch of thread-block clusters of `cluster` blocks.
cudaLaunchConfig_t cluster_config(dim3 grid, dim3 cluster, cudaStream_t s, cudaLaunchAttribute& attr) {
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster.x;
  attr.val.clusterDim.y = cluster.y;
  attr.val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmemBytes;
  cfg.stream = s;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cfg;
}

// How many clusters of `cluster` blocks the device runs at once (each block a whole SM): 0 where
// it cannot run them at all (or the driver refuses the question). Asked once per kernel, cluster
// shape and device.
int max_clusters(Kernel kernel, dim3 cluster) {
  static std::map<std::tuple<Kernel, unsigned, unsigned, int>, int> known;
  static std::mutex mu;
  int dev = 0;
  SPARSEMLA_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_tuple(kernel, cluster.x, cluster.z, dev);
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find(key); it != known.end()) return it->second;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_config(cluster, cluster, nullptr, attr);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();  // a shape the device cannot run: no such clusters (the launch takes another form)
    clusters = 0;
  }
  return known[key] = clusters;
}

// The unpaired kernel for these rows: bf16 rows in whole lines into swizzled tiles (Form);
// SPARSEMLA_WGMMA_LINES=0 for the interleaved tiles of before (A/B).
Kernel unpaired_kernel(bool fp8) {
  static const bool lines_off = env_off("SPARSEMLA_WGMMA_LINES");
  return fp8 ? mla_wgmma_kernel<true, false, false>
             : lines_off ? mla_wgmma_kernel<false, false, false> : mla_wgmma_kernel<false, false, true>;
}

// Paired fp8 blocks' splits merged in (2, 1, S) clusters, S <= kWgmmaMaxPairClusterSplits (a
// portable cluster's 8 blocks); SPARSEMLA_WGMMA_PAIR_CLUSTERS=0 leaves pairs to the merge kernel, as
// before (A/B).
bool pair_clusters_on() {
  static const bool off = env_off("SPARSEMLA_WGMMA_PAIR_CLUSTERS");
  return !off;
}
Kernel pair_kernel() { return mla_wgmma_kernel<true, true, false>; }

}  // namespace

WgmmaClusterSplits wgmma_cluster_splits(const AttentionArgs& a, int splits, int tiles, bool pairs) {
  const bool fp8 = a.dtype == KvDtype::FP8;
  const Kernel paired = pair_kernel(), unpaired = unpaired_kernel(fp8);
  allow_smem(paired, kSmemBytes);
  allow_smem(unpaired, kSmemBytes);
  return wgmma_split_cluster_rule(splits, pairs, fp8, ceil_div(a.heads, kHeads), a.T, tiles, pair_clusters_on(),
                                  [&](int x, int s) {
                                    return max_clusters(x == 2 ? paired : unpaired, dim3(unsigned(x), 1, unsigned(s)));
                                  });
}

int sparse_mla_wgmma(const AttentionArgs& a, int splits, int rows_per_split, float* part, bool pairs, bool merge,
                     bool& merged, Stream s) {
  merged = false;
#if !defined(SPARSEMLA_HAVE_SM90A)
  fail("sparse_mla: this build has no sm_90a machine code for the wgmma kernel (90 is not in CMAKE_CUDA_ARCHITECTURES)");
#endif
  const auto [major, minor] = compute_capability();
  if (major != 9 || minor != 0)
    fail("sparse_mla: the wgmma kernel runs on compute capability 9.0 only, the device is {}.{}", major, minor);
  if (a.kv_lora != kLora || a.rope != kRope)
    fail("sparse_mla: the wgmma kernel takes latent {} + rope {}, got {} + {}", kLora, kRope, a.kv_lora, a.rope);
  if (a.dtype != KvDtype::BF16 && a.dtype != KvDtype::FP8)
    fail("sparse_mla: the wgmma kernel takes bf16 or fp8 latent rows, not {}", kv_dtype_name(a.dtype));
  if (a.latent.row_bytes != latent_row_bytes(a.dtype, kLora, kRope))
    fail("sparse_mla: latent rows of {} bytes, the wgmma kernel expects {}", a.latent.row_bytes,
         latent_row_bytes(a.dtype, kLora, kRope));
  const dim3 grid(unsigned(ceil_div(a.heads, kHeads)), unsigned(a.T), unsigned(splits));
  const bool fp8 = a.dtype == KvDtype::FP8;
  const auto st = static_cast<cudaStream_t>(s);
  // store_output's form: bulk copies from kWgmmaBulkOutputMinHeads (sparse_mla_plan.h), where the
  // rows they store start 16-byte aligned. SPARSEMLA_WGMMA_BULK_OUT=0 / 1 takes the fragments' form /
  // the bulk copies (where aligned) at every head count, for measuring.
  static const int bulk_env = env_switch("SPARSEMLA_WGMMA_BULK_OUT");
  const bool aligned = (reinterpret_cast<uintptr_t>(splits == 1 ? static_cast<void*>(a.out) : part) & 15u) == 0;
  const bool bulk_out = aligned && (bulk_env >= 0 ? bulk_env == 1 : a.heads >= kWgmmaBulkOutputMinHeads);
  // Pairs for fp8 rows, where there are two blocks of heads per token and each block has two tiles or
  // more (with one, the cluster's launch and barriers cost more than the halved gather saves: H200,
  // DeepSeek-V3.2 fp8 batch 1, 23.0 us paired against 21.4). bf16 rows gather faster unpaired in
  // whole lines than paired through registers (H100, session 44, DeepSeek-V3.2 batch 128: 212 us
  // against 272) or paired in lines (session 45: 306), so they never pair.
  // A pair's splits, 2 .. kWgmmaMaxPairClusterSplits, merge in (2, 1, S) clusters where all of them
  // fit at once (as the unpaired blocks' below).
  const bool out_aligned = (reinterpret_cast<uintptr_t>(a.out) & 15u) == 0;
  if (wgmma_pairs(pairs, fp8, grid.x, rows_per_split)) {
    const Kernel kernel = pair_kernel();
    allow_smem(kernel, kSmemBytes);
    if (merge && pair_clusters_on() && splits > 1 && splits <= kWgmmaMaxPairClusterSplits && out_aligned &&
        int64_t(max_clusters(kernel, dim3(2, 1, unsigned(splits)))) >= int64_t(grid.x / 2) * grid.y) {
      cudaLaunchAttribute attr;
      const cudaLaunchConfig_t cfg = cluster_config(grid, dim3(2, 1, unsigned(splits)), st, attr);
      SPARSEMLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a, rows_per_split, part, true, true));
      merged = true;
      return 2 * splits;
    }
    if (max_clusters(kernel, dim3(2, 1, 1)) > 0) {
      cudaLaunchAttribute attr;
      const cudaLaunchConfig_t cfg = cluster_config(grid, dim3(2, 1, 1), st, attr);
      SPARSEMLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a, rows_per_split, part, bulk_out, false));
      return 2;
    }
  }
  const Kernel kernel = unpaired_kernel(fp8);
  allow_smem(kernel, kSmemBytes);
  // The splits of a (token, 64 heads) as one cluster that merges them (merge_splits), where they are
  // 2 .. kMaxClusterSplits, the output is 16-byte aligned, and the device runs all of the launch's
  // clusters at once (clusters are placed within a GPC: 3 blocks of a whole SM each fit fewer per
  // device than single blocks do, and a second wave would cost more than the merge kernel).
  if (merge && splits > 1 && splits <= kMaxClusterSplits && out_aligned &&
      int64_t(max_clusters(kernel, dim3(1, 1, unsigned(splits)))) >= int64_t(grid.x) * grid.y) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_config(grid, dim3(1, 1, unsigned(splits)), st, attr);
    SPARSEMLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, a, rows_per_split, part, true, true));
    merged = true;
    return splits;
  }
  kernel<<<grid, kThreads, kSmemBytes, st>>>(a, rows_per_split, part, bulk_out, false);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
  return 1;
}

}  // namespace sparsemla::cuda
