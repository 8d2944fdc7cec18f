// Sparse MLA attention over latent rows gathered from the paged cache (FlashAttention-style online
// softmax, output in latent space). The same kernels run dense attention when no selection is given.
//
// Mma kernel: a block takes one token and 16, 32 or 64 heads; warps 2g and 2g+1 share heads
// 16g..16g+15. Each tile of 32 rows is gathered into shared memory (cp.async; fp8 rows land as
// stored and are widened to bf16 with their group scales); the two warps of a pair each compute half
// of q . row over the 576 dims, add the halves through shared memory, and then each accumulates half
// of the 512 output dims (P in bf16 on the tensor cores, fp32 accumulators). Long selections are
// split over blocks (split-KV) and merged by a second kernel. Two tiles in flight where shared
// memory allows (attention_smem.h: at 16 heads also within the 99 KB of SM86, SM89 and SM12x); at
// 16 or 32 heads with two tiles in flight, two sets of such pairs take alternate tiles ("tile
// pairs", small batches, where shared memory allows) and merge at the end.
// Fma kernel: one block per token and head, any shape; the reference the selector falls back to.
// Which of them a call launches, and in what shape, is a plan from the device's limits alone
// (plan_sparse_mla, sparse_mla_plan.h), which tests check for every device without a GPU.
#include <algorithm>
#include <cmath>

#include "ops/cuda/attention.h"
#include "ops/cuda/attention_smem.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/sparse_mla_kernels.cuh"
#include "ops/cuda/sparse_mla_plan.h"
#include "ops/cuda/sparse_mla_sm90.h"
#include "util/env.h"

namespace sparsemla::cuda {
namespace {

using namespace mla;

// The shared memory to ask for so that this device holds as many blocks of `bytes` per SM as one
// with `per_sm` bytes per SM would (both reserve 1 KB per block).
size_t emulated_smem(int per_sm, size_t bytes) {
  int dev = 0, here = 0, optin = 0, reserved = 0;
  SPARSEMLA_CUDA_CHECK(cudaGetDevice(&dev));
  SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&here, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
  const size_t blocks = std::max<size_t>(1, size_t(per_sm) / (bytes + size_t(reserved)));
  return std::min(size_t(here) / blocks - size_t(reserved), size_t(optin));
}

}  // namespace

// The fp8-row kernel (sparse_mla_fp8.cu): whether it takes these rows (fp8, latent 512 + rope 64),
// and its launch (geo.hg 1, 2 or 4; geo.stages 2 or 3).
bool mla_fp8_rows_take(const AttentionArgs& a);
void mla_fp8_rows(const AttentionArgs& a, const MlaGeometry& geo, float* part, cudaStream_t st);

namespace {

// The mma / wgmma launch's shape (sparse_mla_plan.h), with the kernel's geometry and what the launch
// needs besides: the device limits come from ws (filled in by sparse_mla() before).
struct MmaPlan {
  AttentionKernel k = AttentionKernel::Mma;
  bool fp8_rows = false;
  Geometry geo{};
  int tiles = 0;    // kRows-row tiles of a token's rows (geo's splits divide them)
  size_t smem = 0;  // the block's shared memory
};

MmaPlan plan_mma(const AttentionArgs& a, AttentionKernel k, const AttentionWorkspace& ws, int splits,
                 int heads_per_block) {
  const bool fp8 = a.dtype == KvDtype::FP8;
  if (a.dtype == KvDtype::F32) fail("sparse_mla: the mma kernel takes bf16 or fp8 latent rows, not f32");
  // The Hopper kernel loses to the generic one on a few tokens: the selector cannot see the batch, so
  // the launch decides. bf16 rows go to it below 8 tokens and 512 (token, head) rows, i.e. GLM-5's 64
  // heads below 8 tokens, DeepSeek-V3.2's 128 below 4 (H100, session 45, attention us at 4K, mma /
  // wgmma: GLM-5 batch 1 12.0 / 20.8, 4 25.3 / 31.7; DeepSeek-V3.2 batch 2 25.4 / 30.7, 4 39.0 / 36.4).
  // fp8 rows go to it below kWgmmaFp8MinRows = 256 (token, head) rows and 4 tokens, where a token
  // has 32 heads or more (sparse_mla_plan.h; H100, session 48, run 82, attention us at 4K and 128K
  // alike, mma / wgmma: GLM-5 batch 1 14.9 / 21.8, 2 20.3 / 23.6, 4 31.7 / 31.0, 8 59 / 37;
  // DeepSeek-V3.2 batch 1 20.5 / 23.6, 2 31.5 / 30.3, 4 60.7 / 36.7; the GLM-5-width 3-layer step at
  // batch 1 and 32K 0.958 / 0.980 ms; session 49, run 90, one GPU's share under tensor parallelism,
  // 4K: 32 heads batch 1 13.0 / 14.5, 2 14.5 / 15.1, 4 19.7 / 18.2, 8 44.0 / 22.8; 16 heads batch 1
  // 12.9 / 11.6, 8 26.1 / 16.0; 8 heads batch 1 12.4 / 10.6, 8 20.1 / 14.9, 32 40.3 / 41.4, 128
  // 162.8 / 117.3). bf16 rows follow the same rule at 8-32 heads (run 90: 32 heads batch 4 18.6 /
  // 19.1, 8 25.1 / 23.1, 128 216 / 117; 8 heads batch 4 10.8 / 11.9, 8 15.0 / 14.6). Forced split
  // counts (tests) keep the kernel asked for. From 64 heads, where the Hopper kernel stores its
  // output by bulk copies (kWgmmaBulkOutputMinHeads), both row types go to it from kWgmmaBulkMinRows =
  // 128 (token, head) rows, i.e. all but GLM-5 at one token (H100, session 50, run 96's bulk stores
  // against the mma kernel's figures above and run 83's: GLM-5 bf16 batch 1 15.3 / 11.7-12.2 (mma),
  // 2 16.7 / 18.3; fp8 batch 1 15.3 / 14.9, 2 16.5 / 20.3; DeepSeek-V3.2 bf16 batch 1 17.3 / 18.4,
  // 2 21.5 / 25.1; fp8 batch 1 17.1 / 20.5; confirmed on one H100 in session 51, run 99, mma /
  // Hopper at 4K: GLM-5 bf16 batch 1 11.5 / 15.2, 2 17.5 / 16.5; fp8 1 14.6 / 15.1, 2 18.9 / 16.7;
  // DeepSeek-V3.2 bf16 1 17.6 / 17.1, fp8 1 19.0 / 16.5). SPARSEMLA_WGMMA_BULK_MIN_ROWS moves that bound,
  // SPARSEMLA_WGMMA_MIN_BATCH and SPARSEMLA_WGMMA_FP8_MIN_ROWS those below 64 heads (1: the Hopper kernel
  // at every batch), for measuring.
  static const int64_t wgmma_min_batch = env_int("SPARSEMLA_WGMMA_MIN_BATCH", 8);
  static const int64_t wgmma_fp8_min_rows = env_int("SPARSEMLA_WGMMA_FP8_MIN_ROWS", kWgmmaFp8MinRows);
  static const int64_t wgmma_bulk_min_rows = env_int("SPARSEMLA_WGMMA_BULK_MIN_ROWS", kWgmmaBulkMinRows);
  const bool small = a.heads >= kWgmmaBulkOutputMinHeads ? a.T * a.heads < wgmma_bulk_min_rows
                     : fp8 ? a.T * a.heads < wgmma_fp8_min_rows && a.T < kWgmmaFp8MinTokens && a.heads >= 32
                           : a.T < wgmma_min_batch && a.T * a.heads < 512;
  if (k == AttentionKernel::Wgmma && small && splits <= 0 && heads_per_block == 0) k = AttentionKernel::Mma;
  if ((a.kv_lora + a.rope) % 8 != 0 || a.kv_lora % 8 != 0 || a.rope % 2 != 0)
    fail("sparse_mla: the mma kernel needs kv_lora and kv_lora + rope multiples of 8 (got {} + {})", a.kv_lora, a.rope);
  const int stride = mla_smem::stride(a.kv_lora, a.rope);
  const int per_sm = ws.smem_per_sm > 0 ? ws.smem_per_sm : ws.device_smem_per_sm;
  // Heads per block: 64 where there are that many (each gathered row serves more heads), fewer when
  // the blocks of a small batch, even split as finely as the rows allow, would leave SMs idle.
  // Two stages (the next tile loads while this one is computed) where shared memory allows.
  const int64_t rows = !a.selected ? a.max_ctx : a.selected_front ? std::min<int64_t>(a.top_k, a.max_ctx) : a.top_k;
  const int tiles = std::max(1, ceil_div(rows, kRows));
  if (heads_per_block != 0 && heads_per_block != 16 && heads_per_block != 32 && heads_per_block != 64)
    fail("sparse_mla: heads_per_block must be 16, 32 or 64, got {}", heads_per_block);
  // A split takes at least two tiles (the second loads while the first is computed; finer splits
  // cost more in partial sums written and merged than they gain).
  const int max_splits = std::min(kMaxSplits, std::max(1, tiles / 2));
  if (k == AttentionKernel::Wgmma) {  // 64 heads per block, one block per SM: split to cover the SMs once
    heads_per_block = 64;
    if (splits <= 0)
      splits = int(std::clamp<int64_t>(ws.sm_count / (int64_t(ceil_div(a.heads, 64)) * a.T), 1, max_splits));
  }
  // Tile pairs (the bf16-tile kernel with 16 or 32 heads and two stages, two tiles or more per
  // split): the two tiles in flight are computed at once by two sets of warps, which halves the chain
  // of a block's work where blocks are few (small batches). Whether they are allowed and hg head
  // groups per block hold them (shared memory and the hand-over through the tile buffers):
  static const bool tile_pairs_off = env_off("SPARSEMLA_MLA_TILE_PAIRS");
  auto tile_pairs_at = [&](int hg) {
    return k == AttentionKernel::Mma && hg <= 2 && ws.tile_pairs && !tile_pairs_off &&
           mla_smem::tile_pairs_hold(hg, fp8, a.kv_lora, a.rope, a.latent.row_bytes, uint64_t(ws.smem_optin));
  };
  int hg = 0;  // head groups of 16 per block
  if (heads_per_block > 0) {
    hg = heads_per_block / 16;
  } else {
    hg = a.heads > 32 ? 4 : 2;
    // Fewer heads per block until the blocks come near one per SM (most of a wave is as good as all).
    while (hg > 1 && int64_t(ceil_div(a.heads, hg * 16)) * a.T * max_splits < ws.sm_count * 3 / 4) hg /= 2;
    // With tile pairs, bf16 rows take 16 heads per block up to 512 (token, head) rows: more,
    // shorter blocks beat blocks that share each gathered row among more heads (H100, bench
    // attention at 4K-128K, us, 16 heads with tile pairs vs the rule above: GLM-5 batch 2 18.6 vs
    // 19.0, 4 25.1 vs 31.5, 8 39.3 vs 59.8; DeepSeek-V3.2 batch 1 18.6 vs 19.1, 2 25.3 vs 30.0, 4 39.2
    // vs 57.5, but 8 84.0 vs 72.2). Not fp8 rows, which each block widens: 16 heads lost there beyond
    // GLM-5 at batch 1 (GLM-5 batch 2 26.0 vs 22.7, 4 40.0 vs 32.2; DeepSeek-V3.2 batch 1 26.5 vs 22.5).
    if (!fp8 && int64_t(a.T) * a.heads <= 512 && tile_pairs_at(1)) hg = 1;
  }
  // fp8 rows of 512 + 64 go to the kernel that reads them as stored (sparse_mla_fp8.cu), unless
  // SPARSEMLA_MLA_FP8_ROWS=0 (A/B), or for small batches where the bf16-tile kernel keeps two stages
  // at these heads. Where an SM holds two of its blocks of 32 heads and two stages (H200, B200: 8
  // warps per SM) it takes that shape (H200, batch 8 / 128: GLM-5 51 / 297 us vs 60 / 419 for the
  // bf16-tile kernel; 86 / 404 with 64 heads and three stages, one block per SM), from 8 tokens
  // (batch 1: DeepSeek-V3.2 28.7 vs 22.8). Else the most heads and stages that fit, from 64 tokens
  // where the bf16-tile kernel has two stages (A100: batch 8 87 vs 62 us, 64 even, 128 413 vs 423,
  // DeepSeek-V3.2 597 vs 688), at every batch where it has not (99 KB devices beyond 16 heads per
  // block: GLM-5 batch 128 427 vs 1918 us with one block per SM; at 16, as GLM-5 batch 1, both tie). Forced shapes (tests) keep it.
  static const bool fp8_rows_off = env_off("SPARSEMLA_MLA_FP8_ROWS");
  const bool forced = splits > 0 || heads_per_block > 0;
  const bool two_per_sm = mla_smem::fp8_rows_two_per_sm(uint64_t(per_sm));
  bool fp8_rows = k == AttentionKernel::Mma && mla_fp8_rows_take(a) && !fp8_rows_off &&
                  mla_smem::fp8_rows_bytes(1, 2) <= size_t(ws.smem_optin);
  if (fp8_rows && a.T < (two_per_sm ? 8 : 64) && !forced &&
      mla_smem::bytes(hg, 2, true, stride, a.latent.row_bytes) <= size_t(ws.smem_optin))
    fp8_rows = false;
  auto bytes_of = [&](int hg, int stages) {
    return fp8_rows ? mla_smem::fp8_rows_bytes(hg, stages)
                    : mla_smem::bytes(hg, stages, fp8, stride, a.latent.row_bytes);
  };
  int max_stages = fp8_rows ? 3 : 2;
  const int min_stages = fp8_rows ? 2 : 1;
  if (fp8_rows && heads_per_block == 0 && two_per_sm) {
    hg = std::min(hg, 2);
    max_stages = 2;
  }
  const mla_smem::Fit fit = mla_smem::fit(hg, max_stages, min_stages, uint64_t(ws.smem_optin), bytes_of);
  if (fit.hg == 0)
    fail("sparse_mla: the mma kernel needs {} bytes of shared memory, the device allows {}", bytes_of(1, min_stages),
         ws.smem_optin);
  if (splits <= 0) {
    const int64_t blocks = int64_t(ceil_div(a.heads, fit.hg * 16)) * a.T;
    splits = blocks >= ws.sm_count ? 1 : int(std::min<int64_t>((2 * ws.sm_count + blocks - 1) / blocks, max_splits));
    splits = std::max(1, splits);
  }
  Geometry geo = mma_geometry(a, fit.hg, fit.stages, tiles, splits);
  if (!fp8_rows && geo.stages == 2 && geo.tiles_per_split >= 2 && tile_pairs_at(geo.hg))
    geo = mma_geometry(a, geo.hg, 2, tiles, splits, 2);
  MmaPlan p;
  p.k = k;
  p.fp8_rows = fp8_rows;
  p.geo = geo;
  p.tiles = tiles;
  p.smem = geo.tile_pairs == 2 ? mla_smem::bytes(geo.hg, 2, fp8, stride, a.latent.row_bytes, 2)
                               : bytes_of(geo.hg, geo.stages);
  return p;
}

// The arguments as launched: SPARSEMLA_MLA_SELECTED_FRONT=0 takes every selection over all top_k
// entries, in the plan and the kernels (A/B of AttentionArgs::selected_front).
AttentionArgs as_launched(const AttentionArgs& args) {
  static const bool front_off = env_off("SPARSEMLA_MLA_SELECTED_FRONT");
  AttentionArgs a = args;
  if (front_off) a.selected_front = false;
  return a;
}

}  // namespace

MlaLaunchPlan plan_sparse_mla(const AttentionArgs& args, AttentionKernel k, const AttentionWorkspace& ws, int splits,
                              int heads_per_block) {
  if (k == AttentionKernel::Fma) return {AttentionKernel::Fma, false, 1, 0, 1, 0, 1, 0};
  if (ws.sm_count <= 0 || ws.smem_optin <= 0 || (ws.smem_per_sm <= 0 && ws.device_smem_per_sm <= 0))
    fail("plan_sparse_mla: the workspace holds no device limits (SM count, shared memory)");
  const MmaPlan p = plan_mma(as_launched(args), k, ws, splits, heads_per_block);
  const bool wgmma = p.k == AttentionKernel::Wgmma;
  return {p.k,          p.fp8_rows,           p.geo.hg * 16, wgmma ? 2 : p.geo.stages, p.geo.splits,
          p.geo.tiles_per_split, p.geo.tile_pairs, wgmma ? 0 : p.smem};
}

void sparse_mla(const AttentionArgs& args, AttentionKernel k, AttentionWorkspace& ws, Stream s, int splits,
                int heads_per_block) {
  const AttentionArgs a = as_launched(args);
  ws.last_cluster = 0;
  ws.last_paired = false;
  ws.last_split_cluster = false;
  ws.last = {};
  if (a.T == 0) return;
  auto st = static_cast<cudaStream_t>(s);
  const bool fp8 = a.dtype == KvDtype::FP8;
  if (k == AttentionKernel::Fma) {
    if (a.kv_lora > kFmaThreads * kFmaMaxOut) fail("sparse_mla: kv_lora {} > {}", a.kv_lora, kFmaThreads * kFmaMaxOut);
    const dim3 grid(unsigned(a.heads), unsigned(a.T));
    if (fp8) mla_fma_kernel<KvDtype::FP8><<<grid, kFmaThreads, 0, st>>>(a);
    else if (a.dtype == KvDtype::F32) mla_fma_kernel<KvDtype::F32><<<grid, kFmaThreads, 0, st>>>(a);
    else mla_fma_kernel<KvDtype::BF16><<<grid, kFmaThreads, 0, st>>>(a);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
    ws.last = {"fma", 1, 0, 1};
    return;
  }
  if (ws.sm_count == 0) {
    int dev = 0;
    SPARSEMLA_CUDA_CHECK(cudaGetDevice(&dev));
    SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&ws.sm_count, cudaDevAttrMultiProcessorCount, dev));
    SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&ws.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  }
  if (ws.device_smem_per_sm == 0) {
    int dev = 0;
    SPARSEMLA_CUDA_CHECK(cudaGetDevice(&dev));
    SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&ws.device_smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  }
  const MmaPlan plan = plan_mma(a, k, ws, splits, heads_per_block);
  k = plan.k;
  const bool fp8_rows = plan.fp8_rows;
  Geometry geo = plan.geo;
  static const bool pairs_off = env_off("SPARSEMLA_MLA_PAIRS");
  static const int split_clusters_env = env_switch("SPARSEMLA_WGMMA_SPLIT_CLUSTERS");
  const bool split_clusters = split_clusters_env >= 0 ? split_clusters_env == 1 : ws.split_clusters;
  // Fewer splits where the planned ones' clusters do not all fit at once but fewer do (clusters of
  // whole-SM blocks are placed within a GPC): merged in clusters they beat more splits merged by the
  // kernel (H100, session 52, run 107, attention us at 4K, planned splits by the kernel -> fewer in
  // clusters: GLM-5 bf16 batch 16 8 splits 45.5 -> 6 34.8, 24 5 splits 59.3 -> 4 41.0, 32 4 splits
  // 70.7 -> 3 49.2, 40 3 splits 82.0 -> 2 59.7; DeepSeek-V3.2 batch 16 4 splits 61.4 -> 3 47.4). Also
  // where the plan splits 9-16 ways (unpaired: 8 at most in a portable cluster; H100, session 53,
  // run 113, planned by the kernel -> 8 in clusters: GLM-5 bf16 batch 8 16 splits 30.2 -> 27.0, 12
  // 11 splits 39.1 -> 28.3; fp8 8 27.8 -> 28.5, 12 37.6 -> 29.1; DeepSeek-V3.2 bf16 4 16 splits 27.7
  // -> 27.2), not past 16 (GLM-5 batch 2 and 4, 32 splits: 17.6 / 22.7 against 26.6 / 26.8 in 8), nor
  // where the caller forced the count (tests).
  // fp8 pairs (DeepSeek-V3.2) merge in (2, 1, S) clusters of at most 4 splits, and unpair where only
  // unpaired clusters fit (H100, session 53, run 112, attention us at 4K, pairs by the kernel ->
  // now: batch 8 8 splits 37.2 -> 4 in pair clusters 36.2, 16 4 splits 58.4 -> 3 44.5, 24 2 splits
  // 86.4 -> 2 58.1, 32 2 splits 99.5 -> 2 unpaired 70.0; unpaired everywhere instead: 35.1, 51.9,
  // 68.7, 69.7).
  bool pairs = ws.pairs && !pairs_off;
  if (k == AttentionKernel::Wgmma && split_clusters && splits <= 0 && geo.splits >= 2 && geo.splits <= 16) {
    const WgmmaClusterSplits fit = wgmma_cluster_splits(a, geo.splits, plan.tiles, pairs);
    pairs = fit.pairs;
    if (fit.splits != geo.splits) geo = mma_geometry(a, geo.hg, geo.stages, plan.tiles, fit.splits);
  }
  if (ws.smem_per_sm > 0) geo.launch_smem = emulated_smem(ws.smem_per_sm, plan.smem);
  float* part = nullptr;
  if (geo.splits > 1) {
    const size_t need = size_t(a.T) * geo.splits * a.heads * partial_row_floats(a.kv_lora) * sizeof(float);
    if (ws.partial.bytes() < need) ws.partial = DeviceBuffer(need);
    part = ws.partial.as<float>();
  }
  bool merged = false;
  ws.last = {k == AttentionKernel::Wgmma ? "wgmma"
             : fp8_rows                    ? "mma fp8 rows"
             : geo.tile_pairs == 2         ? "mma tile pairs"
                                           : "mma",
             geo.hg * 16,
             k == AttentionKernel::Wgmma ? 2 : geo.stages, geo.splits};
  if (k == AttentionKernel::Wgmma) {
    ws.last_cluster = sparse_mla_wgmma(a, geo.splits, geo.tiles_per_split * kRows, part, pairs,
                                       split_clusters, merged, st);
    ws.last_split_cluster = merged;
    ws.last_paired = merged ? ws.last_cluster == 2 * geo.splits : ws.last_cluster == 2;
  } else if (fp8_rows) mla_fp8_rows(a, geo, part, st);
  else {
    const MmaLaunch l = mma_launch(a, geo);
    allow_smem(l.kernel, l.smem);
    l.kernel<<<l.grid, l.threads, l.smem, st>>>(a, geo, part);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
  }
  if (geo.splits > 1 && !merged) {
    const dim3 grid(unsigned(ceil_div(a.kv_lora, kCombineDims)), unsigned(a.heads), unsigned(a.T));
    mla_combine_kernel<<<grid, kCombineDims, 0, st>>>(a, geo.splits, part);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace sparsemla::cuda
