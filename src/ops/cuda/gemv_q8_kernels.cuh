// The int8-activation decode kernels of gemv_q8.cu (the description is there), the activation
// quantization, and the plan of which kernel runs a product with what grid: in a header of their
// own so that the host emulation (tests/host_emulation) builds and runs them where there is no GPU;
// gemv_q8.cu launches them.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "ops/cuda/check.cuh"
#include "ops/cuda/cp_async.cuh"
#include "ops/cuda/dynamic_smem.cuh"
#include "ops/cuda/gemv_reduce.cuh"
#include "ops/cuda/mat_args.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/q8_quantize.cuh"
#include "ops/cuda/q8_units.cuh"
#include "util/env.h"

namespace sparsemla::cuda::q8gemv {

using namespace q8units;

constexpr int kQ8MaxThreads = 256;
// Rows per block: each activation load feeds kQ8Rows rows.
constexpr int kQ8Rows = 4;
// The staged kernel's shared memory per block at most: within SM86/89/12x's 99 KB (and the
// H100/H200's 227 KB) with room for the block's partial sums.
constexpr size_t kStagedMaxSmem = 96 * 1024;

// acc[row][t] += unit iu of each row . token t's activations of the unit.
template <class V, int R, int NT, int L>
__device__ __forceinline__ void q8_unit(const uint8_t* const (&w)[R], const TokenX<L> (&x)[NT], int iu,
                                        float (&acc)[R][NT], const QuantTables& tb) {
  const int b = iu / V::kUnitsPerBlock, u = iu % V::kUnitsPerBlock;
  typename V::W wu[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wu[r] = V::load(w[r] + int64_t(b) * V::kBytes, u, tb);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const typename V::template X<L> xu = V::template load_x<L>(x[t], b, u);
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r][t] = V::fma(wu[r], xu, acc[r][t]);
  }
}

// The blocks' rows, products, expert pairs and tokens as gemv.cuh's kernel takes them (MatArgs,
// block_mat, block_view), with the activations at a.xq (and a.xr) instead of a.x.
template <class V, int NT, int R, int L>
__global__ void __launch_bounds__(kQ8MaxThreads) gemv_q8_kernel(const MatArgs a) {
  // Units per step: at 4 or more tokens the accumulators and activations take the registers that
  // the unrolled weight loads would need (the order of the units is the same either way).
  constexpr int U = NT >= 4 ? 1 : V::kUnroll;
  __shared__ float partial[kQ8MaxThreads / 32][R * NT];  // per warp: [row][token]
  const int n_units = int(a.n_cols / V::kBlock) * V::kUnitsPerBlock;
  const int64_t n_ab = a.n_cols / 32;  // activation blocks per token
  const int64_t row0 = int64_t(blockIdx.x) * R;
  BlockView v;
  const uint8_t* w[R];
  if (!start_rows<R>(a, row0, v, w)) return;

  for (int64_t t0 = 0; t0 < v.n_tokens; t0 += NT) {
    // Tokens past the end repeat the last one; their sums are not stored.
    TokenX<L> x[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int64_t tok = v.token_row(a, min(t0 + t, v.n_tokens - 1));
      x[t].q[0] = a.xq + tok * a.n_cols;
      if constexpr (L == 2) x[t].q[1] = a.xr + tok * a.n_cols;
      x[t].xb = a.xb + tok * n_ab;
    }
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;

    for_each_unit<U>(n_units, [&](int iu) { q8_unit<V, R, NT, L>(w, x, iu, acc, a.tables); });

    block_sum_store(acc, partial, row0, v.n_rows, t0, v.n_tokens, v.y);
  }
}

// ---- staged loads (one token or expert pairs; Q6_K and Q8_0) ----
//
// Q6_K (210-byte) and Q8_0 (34-byte) blocks are only 2-byte aligned, so the kernel above reads each
// 16 weight bytes as five 4-byte loads and byte permutes, scattered over the warp's 8 (Q6_K) or 32
// (Q8_0) consecutive blocks: many small L1 requests per byte. Here each warp first copies the
// bytes its 32 lanes' units cover (one "chunk": 32 units of each of its R rows, 1680 bytes of a
// Q6_K row, 1088 of a Q8_0 one, 16-byte aligned when the rows are) into shared memory with
// 16-byte cp.async copies, coalesced, and the units are then decoded from there as before. Each
// thread takes the same units in the same order as gemv_q8_kernel<V, 1, R, L> and adds them the
// same way, so the result is the same bits (a one-token product, or one per expert pair, with
// several products). With two or more chunks per warp, the next chunk's copy is in flight while
// the current one is decoded (two buffers, where they fit; else one after the other).
template <class V>
struct Staged {
  static constexpr int kChunkBlocks = 32 / V::kUnitsPerBlock;
  static constexpr int kChunkBytes = kChunkBlocks * V::kBytes;
  static_assert(32 % V::kUnitsPerBlock == 0 && kChunkBytes % 16 == 0, "a warp's chunk is whole 16-byte pieces");
  // Chunk buffers per warp: two when a warp has more than one chunk (the next one's copy in flight
  // while the current one is decoded) and they fit in kStagedMaxSmem, else one.
  __host__ __device__ static constexpr size_t smem_of(int n_threads, int buffers, int R) {
    return size_t(n_threads / 32) * size_t(buffers) * size_t(R) * kChunkBytes;
  }
  __host__ __device__ static int buffers(int n_units, int n_threads, int R) {
    return n_units > n_threads && smem_of(n_threads, 2, R) <= kStagedMaxSmem ? 2 : 1;
  }
  static size_t smem(int n_units, int n_threads, int R) { return smem_of(n_threads, buffers(n_units, n_threads, R), R); }
};

// One warp's chunk: R rows' kChunkBytes each from byte `off` of rows row0 .. (clamped to the last
// row) into dst ([R][kChunkBytes]), as one cp.async group of 16-byte copies.
template <class V, int R>
__device__ __forceinline__ void staged_copy(uint8_t* dst, const BlockView& v, int64_t row0, int64_t off, int lane) {
  constexpr int kPiecesPerRow = Staged<V>::kChunkBytes / 16;
#pragma unroll 1
  for (int i = lane; i < R * kPiecesPerRow; i += 32) {
    const int r = i / kPiecesPerRow, p = i % kPiecesPerRow;
    const uint8_t* row = v.w + uint64_t(min(row0 + r, v.n_rows - 1)) * v.row_bytes;  // (w[r], not indexed)
    cp_async16(dst + r * Staged<V>::kChunkBytes + 16 * p, row + off + 16 * p);
  }
  cp_async_commit();
}

// acc[r] += this lane's unit (unit iu0 + lane of each row) from a landed chunk src ([R][kChunkBytes]).
template <class V, int R, int L, class TB>
__device__ __forceinline__ void staged_unit(const uint8_t* src, const typename V::template X<L>& xu, int lane,
                                            float (&acc)[R][1], const TB& tb) {
  const int u = lane % V::kUnitsPerBlock;
  src += (lane / V::kUnitsPerBlock) * V::kBytes;
  typename V::W wu[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wu[r] = V::load(src + r * Staged<V>::kChunkBytes, u, tb);
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = V::fma(wu[r], xu, acc[r][0]);
}

// The token's int8 activation rows (one token, or the block's expert pair's row).
template <int L>
__device__ __forceinline__ TokenX<L> staged_token(const MatArgs& a, const BlockView& v) {
  TokenX<L> x;
  const int64_t tok = v.token_row(a, 0);
  x.q[0] = a.xq + tok * a.n_cols;
  if constexpr (L == 2) x.q[1] = a.xr + tok * a.n_cols;
  x.xb = a.xb + tok * (a.n_cols / 32);
  return x;
}

template <class V, int R, int L>
__global__ void __launch_bounds__(kQ8MaxThreads) gemv_q8_staged_kernel(const MatArgs a) {
  using S = Staged<V>;
  SPARSEMLA_DYNAMIC_SMEM(stage);  // per warp: [buffers][R][kChunkBytes]
  __shared__ float partial[kQ8MaxThreads / 32][R];
  const int n_units = int(a.n_cols / V::kBlock) * V::kUnitsPerBlock;
  const int n_threads = blockDim.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nbuf = S::buffers(n_units, n_threads, R);
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const BlockMat m = block_mat(a);
  if (row0 >= m.n_rows) return;
  gemv_prologue<R>(a.prefetch && !a.expert_ids, m.w, m.row_bytes, row0, m.n_rows);
  BlockView v;
  if (!block_view(a, v)) return;
  const TokenX<L> x = staged_token<L>(a, v);
  float acc[R][1];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;

  uint8_t* buf = stage + size_t(warp) * nbuf * R * S::kChunkBytes;
  // Chunk of units [iu0, iu0 + 32) of the R rows into buffer k.
  const auto copy = [&](int iu0, int k) {
    staged_copy<V, R>(buf + k * R * S::kChunkBytes, v, row0, int64_t(iu0 / V::kUnitsPerBlock) * V::kBytes, lane);
  };
  int iu0 = warp * 32;
  if (iu0 < n_units) copy(iu0, 0);
  for (int k = 0; iu0 < n_units; iu0 += n_threads, ++k) {
    const int cur = nbuf == 2 ? (k & 1) : 0;
    if (nbuf == 2) {
      if (iu0 + n_threads < n_units) copy(iu0 + n_threads, cur ^ 1);
      else cp_async_commit();  // (an empty group: the wait below counts one behind)
      cp_async_wait_group<1>();
    } else {
      cp_async_wait_all();
    }
    __syncwarp();
    const int iu = iu0 + lane;
    const typename V::template X<L> xu = V::template load_x<L>(x, iu / V::kUnitsPerBlock, iu % V::kUnitsPerBlock);
    staged_unit<V, R, L>(buf + cur * R * S::kChunkBytes, xu, lane, acc, a.tables);
    __syncwarp();  // every lane's reads of this buffer are done before it is filled again
    if (nbuf == 1 && iu0 + n_threads < n_units) copy(iu0 + n_threads, 0);
  }
  block_sum_store(acc, partial, row0, v.n_rows, 0, 1, v.y);
}

// Groups k < n of R rows in turn, from byte `off` of rows row_of(k) .. into buf ([2][R][kChunkBytes],
// this warp's): group k + 1's copy in flight while group k is decoded, its sums (this lane's unit)
// handed to done(k, acc).
template <class V, int R, int L, class RowOf, class Done, class TB>
__device__ __forceinline__ void staged_groups(uint8_t* buf, const BlockView& v, int64_t off, int n, RowOf&& row_of,
                                              const typename V::template X<L>& xu, int lane, const TB& tb,
                                              Done&& done) {
  constexpr int kBuf = R * Staged<V>::kChunkBytes;
  if (n > 0) staged_copy<V, R>(buf, v, row_of(0), off, lane);
  for (int k = 0; k < n; ++k) {
    const int cur = k & 1;
    if (k + 1 < n) staged_copy<V, R>(buf + (cur ^ 1) * kBuf, v, row_of(k + 1), off, lane);
    else cp_async_commit();  // (an empty group: the wait below counts one behind)
    cp_async_wait_group<1>();
    __syncwarp();
    float acc[R][1];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
    staged_unit<V, R, L, TB>(buf + cur * kBuf, xu, lane, acc, tb);
    __syncwarp();  // every lane's reads of this buffer are done before it is filled again
    done(k, acc);
  }
}

// Rows of one chunk (32 units: Q6_K rows of 2048 columns, as GLM-5's expert down products), where
// gemv_q8_staged_kernel runs one-warp blocks of R rows that copy, wait, decode and leave. Here a block
// holds kGroupWarps warps and each warp takes G groups of R rows in turn, group k + 1's copy in
// flight while group k is decoded (two buffers per warp); group k of warp w is row group
// (blockIdx.x G + k) kGroupWarps + w, so a block's warps read neighbouring rows at once. Each row is
// summed by the same lanes in the same order and reduced by the same shuffle tree as in
// gemv_q8_staged_kernel with its one warp: the same bits.
template <class V, int R, int L>
__global__ void __launch_bounds__(kQ8MaxThreads) gemv_q8_staged_groups_kernel(const MatArgs a, int G) {
  using S = Staged<V>;
  SPARSEMLA_DYNAMIC_SMEM(stage);  // per warp: [2][R][kChunkBytes]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
  const BlockMat m = block_mat(a);
  const auto group_row = [&](int k) { return ((int64_t(blockIdx.x) * G + k) * n_warps + warp) * R; };
  if (int64_t(blockIdx.x) * G * n_warps * R >= m.n_rows) return;
  gemv_prologue<R>(a.prefetch && !a.expert_ids, m.w, m.row_bytes, group_row(0), m.n_rows);
  BlockView v;
  if (!block_view(a, v)) return;
  const TokenX<L> x = staged_token<L>(a, v);
  const typename V::template X<L> xu = V::template load_x<L>(x, lane / V::kUnitsPerBlock, lane % V::kUnitsPerBlock);
  uint8_t* buf = stage + size_t(warp) * 2 * R * S::kChunkBytes;
  int n = 0;  // this warp's groups
  while (n < G && group_row(n) < v.n_rows) ++n;
  staged_groups<V, R, L>(buf, v, 0, n, group_row, xu, lane, a.tables, [&](int k, const float (&acc)[R][1]) {
    const int64_t row0 = group_row(k);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = warp_sum(acc[r][0]);
      if (lane == 0 && row0 + r < v.n_rows) v.y[row0 + r] = s;
    }
  });
}

// Rows of one chunk per warp and more than one warp (Q6_K rows of 4096 to 10240 columns: the output
// head's 6144; wider rows' two buffers per warp pass kStagedMaxSmem), where gemv_q8_staged_kernel
// copies, waits, decodes and leaves once per block. Here a block takes G row groups in turn, each warp's
// chunk of group k + 1 in flight while group k is decoded (two buffers per warp); each group is
// summed and reduced as gemv_q8_staged_kernel sums and reduces its one: the same bits. SG: the IQ
// unit's grid table is first copied into shared memory after the chunk buffers and read from there
// (grid_in_shared below); the same entries, so the same bits.
template <class V, int R, int L, bool SG = false>
__global__ void __launch_bounds__(kQ8MaxThreads) gemv_q8_staged_runs_kernel(const MatArgs a, int G) {
  using S = Staged<V>;
  SPARSEMLA_DYNAMIC_SMEM(stage);  // per warp: [2][R][kChunkBytes]; then (SG) the grid table
  __shared__ float partial[kQ8MaxThreads / 32][R];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const BlockMat m = block_mat(a);
  const int64_t first = int64_t(blockIdx.x) * G * R;
  if (first >= m.n_rows) return;
  gemv_prologue<R>(a.prefetch && !a.expert_ids, m.w, m.row_bytes, first, m.n_rows);
  BlockView v;
  if (!block_view(a, v)) return;
  const TokenX<L> x = staged_token<L>(a, v);
  const int iu = warp * 32 + lane;
  const typename V::template X<L> xu = V::template load_x<L>(x, iu / V::kUnitsPerBlock, iu % V::kUnitsPerBlock);
  const int64_t off = int64_t(warp * 32 / V::kUnitsPerBlock) * V::kBytes;
  uint8_t* buf = stage + size_t(warp) * 2 * R * S::kChunkBytes;
  int n = 0;  // the block's groups (the same for every warp: the barriers below are the block's)
  while (n < G && first + int64_t(n) * R < v.n_rows) ++n;
  const auto row_of = [&](int k) { return first + int64_t(k) * R; };
  const auto done = [&](int k, const float (&acc)[R][1]) { block_sum_store(acc, partial, row_of(k), v.n_rows, 0, 1, v.y); };
  if constexpr (SG && GridOf<V>::kBytes > 0) {  // the IQ grid table read from the block's copy (SharedTables)
    uint8_t* grid = stage + size_t(blockDim.x / 32) * 2 * R * S::kChunkBytes;
    const uint4* src = static_cast<const uint4*>(V::grid(a.tables));
    for (int i = threadIdx.x; i < GridOf<V>::kBytes / 16; i += blockDim.x) reinterpret_cast<uint4*>(grid)[i] = __ldg(src + i);
    __syncthreads();
    SharedTables tb;
    static_cast<QuantTables&>(tb) = a.tables;
    V::set_grid(tb, grid);
    staged_groups<V, R, L>(buf, v, off, n, row_of, xu, lane, tb, done);
  } else {
    staged_groups<V, R, L>(buf, v, off, n, row_of, xu, lane, a.tables, done);
  }
}

// Row groups per warp for the row-group kernels: the most, up to 4, that still leave every
// multiprocessor a block (blocks of `warps` warps, each warp its own groups; or of one team of warps
// sharing its groups: warps 1). H200, two levels, us per call (docs/PERFORMANCE.md, session 27):
// Q6_K 6144 x 2048 (4 warps) one product 6.4 (2 groups: 192 blocks) against 8.1 (4: 96 blocks) and
// 8.0 for one-warp blocks of one group; 8 experts 28.8 (4) against 29.9 (2), 36.1 (8: 384 blocks)
// and 34.6; the Q6_K output head 154880 x 6144 (3 warps sharing each group) 238.7 (4) against 241.7
// (2), 239.4 (8) and 269.9.
constexpr int kGroupWarps = 4, kMaxGroupsPerWarp = 4;
int groups_per_warp(int64_t row_groups, int warps, int sm_count) {
  int g = kMaxGroupsPerWarp;
  while (g > 1 && ceil_div(row_groups, int64_t(warps) * g) < sm_count) g /= 2;
  return g;
}

// Whether a product takes the staged kernel (with `staged`, the switch of gemv_q8.cu): the 2-byte
// aligned types, one token (or one per expert pair), rows of whole chunks and at least
// V::kStagedMinCols columns, and every matrix 16-byte aligned (so every chunk is). (One buffer per
// warp always fits: Staged::buffers.)
template <class V>
bool takes_staged(const MatArgs& a, bool staged) {
  using S = Staged<V>;
  static_assert(S::smem_of(kQ8MaxThreads, 1, kQ8Rows) <= kStagedMaxSmem, "one chunk buffer per warp fits");
  if (!staged || a.group_offsets || (!a.expert_ids && a.n_tokens != 1)) return false;
  if (a.n_cols < V::kStagedMinCols || (a.n_cols / V::kBlock) % S::kChunkBlocks != 0 || a.row_bytes % 16 != 0)
    return false;
  const auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  if (!aligned16(a.w) || !aligned16(a.shared_w)) return false;
  for (int i = 0; i < a.n_more; ++i)
    if (!aligned16(a.more[i].w) || !aligned16(a.more[i].shared_w) || a.more[i].row_bytes % 16 != 0) return false;
  return true;
}

// Threads per block: enough that each takes about kUnroll units of a row, a multiple of 32 in
// [32, kQ8MaxThreads]. A function of n_cols and the type only (batch invariance).
template <class V>
int q8_threads(int64_t n_cols) {
  const int64_t n_units = n_cols / V::kBlock * V::kUnitsPerBlock;
  const int64_t want = (n_units + V::kUnroll - 1) / V::kUnroll;
  return int(std::min<int64_t>(kQ8MaxThreads, std::max<int64_t>(32, (want + 31) / 32 * 32)));
}

// Tokens per pass of a grouped launch: two at every batch, where the fp32 kernel takes one up to
// batches of 16 (gemv.cuh, kGroupOneTokenBatch). A pass of two costs a one-token group no more
// than a pass of one here (dp4a, few registers per token) and saves the others' second pass
// (GLM-5-width Q8_0 model, batch 8: 3.23 against 3.31-3.35 ms per step; batch 32, where both take
// two, the same; H200, docs/PERFORMANCE.md).
constexpr int kQ8GroupTokens = 2;

// How one product runs: the kernel (or the row-group kernel, which takes G row groups per warp or
// block as a second argument), its grid, threads and dynamic shared memory. A function of the
// arguments alone: gemv_q8.cu launches it, the host emulation runs it.
struct Q8Plan {
  enum Path { kPlain, kStaged, kStagedGroups, kStagedRuns };
  Path path = kPlain;
  void (*kernel)(const MatArgs) = nullptr;
  void (*group_kernel)(const MatArgs, int) = nullptr;
  dim3 grid;
  int threads = 0;
  size_t smem = 0;
  int groups = 0;  // G of the row-group kernels
};

// Whether the row-runs kernel of G row groups per block reads V's grid table from a copy in shared
// memory (SPARSEMLA_Q8_SMEM_GRID=0: never, for A/B): tables up to 8 KB always; IQ1's 16 KB only where
// a block has 4 groups or more to spread its copy over. H100, one token, two levels, us (global table
// -> shared copy): head 154880 x 6144 (4 groups per block) IQ3_XXS 249.3 -> 210.4, IQ2_XXS 186.7 ->
// 176.3, IQ1_S 172.8 -> 162.4, IQ2_XS 191.3 -> 185.5; 2048 x 6144 IQ2_XXS 6.6 -> 6.1, IQ3_XXS 7.2 ->
// 7.0, IQ2_XS 7.3 -> 6.8, IQ1_S 6.2 -> 6.7 (its copy costs more than it saves there).
template <class V>
bool grid_in_shared(int groups_per_block) {
  static const bool off = env_off("SPARSEMLA_Q8_SMEM_GRID");
  constexpr int bytes = GridOf<V>::kBytes;
  return bytes > 0 && !off && (bytes <= 8192 || groups_per_block >= 4);
}

template <class V, int L>
Q8Plan plan_q8(const MatArgs& a, bool staged) {
  constexpr int R = kQ8Rows;
  Q8Plan p;
  p.threads = q8_threads<V>(a.n_cols);
  const unsigned blocks = unsigned(ceil_div(a.max_rows(), int64_t(R)));
  const unsigned z = 1u + unsigned(a.n_more);  // several products: product i in grid z = i
  if (a.n_more && (a.group_offsets || (!a.expert_ids && a.n_tokens != 1)))
    fail("cuda::launch_q8: several products take one token or expert pairs");
  if constexpr (V::kBytes % 16 != 0) {  // (16-byte aligned blocks gain nothing from staging)
    if (takes_staged<V>(a, staged)) {
      const int n_units = int(a.n_cols / V::kBlock) * V::kUnitsPerBlock;
      const unsigned y = a.expert_ids ? unsigned(a.n_tokens) : 1u;
      const int64_t groups = ceil_div(a.max_rows(), int64_t(R));  // of R rows
      if (n_units == 32) {  // rows of one chunk: warps that take several row groups
        p.path = Q8Plan::kStagedGroups;
        p.groups = groups_per_warp(groups * y * z, kGroupWarps, a.sm_count);
        p.group_kernel = gemv_q8_staged_groups_kernel<V, R, L>;
        p.grid = dim3(unsigned(ceil_div(groups, int64_t(kGroupWarps) * p.groups)), y, z);
        p.threads = 32 * kGroupWarps;
        p.smem = Staged<V>::smem_of(32 * kGroupWarps, 2, R);
      } else if (n_units == p.threads && Staged<V>::smem_of(p.threads, 2, R) <= kStagedMaxSmem) {  // a chunk per warp
        p.path = Q8Plan::kStagedRuns;
        p.groups = groups_per_warp(groups * y * z, 1, a.sm_count);
        p.group_kernel = gemv_q8_staged_runs_kernel<V, R, L>;
        p.grid = dim3(unsigned(ceil_div(groups, int64_t(p.groups))), y, z);
        p.smem = Staged<V>::smem_of(p.threads, 2, R);
        if constexpr (GridOf<V>::kBytes > 0) {
          if (grid_in_shared<V>(p.groups)) {
            p.group_kernel = gemv_q8_staged_runs_kernel<V, R, L, true>;
            p.smem += GridOf<V>::kBytes;
          }
        }
      } else {
        p.path = Q8Plan::kStaged;
        p.kernel = gemv_q8_staged_kernel<V, R, L>;
        p.grid = dim3(blocks, y, z);
        p.smem = Staged<V>::smem(n_units, p.threads, R);
      }
      return p;
    }
  }
  if (a.group_offsets) {  // a grid row per group (MatArgs::n_tokens), two tokens per pass at every batch
    p.kernel = gemv_q8_kernel<V, kQ8GroupTokens, R, L>;
    p.grid = dim3(blocks, unsigned(a.n_tokens));
  } else if (a.expert_ids) {
    p.kernel = gemv_q8_kernel<V, 1, R, L>;
    p.grid = dim3(blocks, unsigned(a.n_tokens), z);
  } else if (a.n_tokens == 1) {
    p.kernel = gemv_q8_kernel<V, 1, R, L>;
    p.grid = dim3(blocks, 1, z);
  } else {
    p.kernel = a.n_tokens == 2   ? gemv_q8_kernel<V, 2, R, L>
               : a.n_tokens <= 4 ? gemv_q8_kernel<V, 4, R, L>
                                 : gemv_q8_kernel<V, 8, R, L>;
    p.grid = dim3(blocks);
  }
  return p;
}

// One warp per block of 32 values (the rule is in quant_matmul_q8.h); r: the residual level (L = 2).
template <int L>
__global__ void quantize_q8_kernel(const float* x, int64_t n_blocks, int8_t* q, int8_t* r, int2* blocks) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const int64_t blk = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (blk >= n_blocks) return;  // whole warps
  quantize_q8_warp<L>(x[blk * 32 + lane], blk, lane, q, r, blocks);
}

}  // namespace sparsemla::cuda::q8gemv
