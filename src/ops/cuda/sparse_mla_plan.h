// The sparse MLA launch's plan (sparse_mla.cu): which kernel, how many heads per block, tiles in
// flight, split-KV blocks and warp sets a call takes on a device, from the device's limits alone
// (no GPU needed), so that the launch rule can be checked for every device where there is none.
// Plain C++.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ops/cuda/attention.h"
#include "ops/cuda/attention_smem.h"

namespace sparsemla::cuda {

struct MlaLaunchPlan {
  AttentionKernel kernel = AttentionKernel::Fma;  // Wgmma asked for falls back to Mma on small batches
  bool fp8_rows = false;     // the mma kernel that reads fp8 rows as stored (sparse_mla_fp8.cu)
  int heads_per_block = 0;   // 16, 32 or 64 (fma: 1)
  int stages = 0;            // tiles in flight (fma: 0)
  int splits = 1;            // split-KV blocks per token
  int tiles_per_split = 0;   // tiles of 32 rows per split (fma: 0)
  int tile_pairs = 1;        // sets of warps per head group (2: tile pairs)
  size_t smem = 0;           // the mma kernel's shared memory per block (0: fma or wgmma)
};

// The Hopper kernel takes fp8 rows from this many (token, head) rows or this many tokens; fewer go
// to the mma kernel where a token has 32 heads or more: GLM-5's 64 heads below 4 tokens (32, one
// GPU's share at tensor parallel 2, too), DeepSeek-V3.2's 128 at one token; 8 or 16 heads take the
// Hopper kernel at every batch (sparse_mla.cu, plan_mma, has the figures;
// SPARSEMLA_WGMMA_FP8_MIN_ROWS moves the rows' bound).
constexpr int64_t kWgmmaFp8MinRows = 256;
constexpr int64_t kWgmmaFp8MinTokens = 4;

// The Hopper kernel stores a block's output by bulk copies (one per head's row, staged in the tile
// buffers) where a token has this many heads or more (a last block of fewer, as at 96 heads, too);
// fewer heads (one GPU's share under tensor parallelism, padded to a block of 64) store the fragments
// from registers. H100, session 50, run 96, attention us at 4K, fragments / bulk: GLM-5 bf16 batch 1
// 16.5 / 15.3, 2 18.6 / 16.7, 8 32.4 / 29.6, 32 73.9 / 71.0, 128 126.8 / 127.4; DeepSeek-V3.2 fp8
// batch 2 23.9 / 21.4, 8 39.8 / 37.0, 128 201.6 / 200.4; 8 heads batch 1 10.6 / 11.4, 8 14.7 / 15.4;
// 32 heads within 0.4 either way.
constexpr int kWgmmaBulkOutputMinHeads = 64;
// With its bulk stores the Hopper kernel takes both row types from this many (token, head) rows:
// below, GLM-5's 64 heads at one token, the mma kernel (sparse_mla.cu, plan_mma, has the figures;
// both kernels timed on one device in session 51, run 99).
constexpr int64_t kWgmmaBulkMinRows = 128;

// The Hopper kernel's split clusters (sparse_mla_sm90.cu): a token's splits of one 64-head block as
// one thread-block cluster that merges them, (1, 1, S) for unpaired blocks, (2, 1, S) for pairs
// (fp8 rows of an even number of 64-head blocks), at most a portable cluster's 8 blocks.
constexpr int kWgmmaMaxClusterSplits = 8;
constexpr int kWgmmaMaxPairClusterSplits = kWgmmaMaxClusterSplits / 2;
struct WgmmaClusterSplits {
  int splits;
  bool pairs;
};
// The split count and pairing the launch takes for a planned `splits` (sparse_mla, where the caller
// did not force a count) on a device that runs clusters_at_once(x, s) clusters of (x, 1, s) blocks at
// once, for T tokens of blocks_x 64-head blocks and `tiles` kRows-row tiles (attention_smem.h) per
// token; `pairs`: the launch may pair, pair_clusters: pairs may merge in clusters
// (SPARSEMLA_WGMMA_PAIR_CLUSTERS). Blocks pair (sparse_mla_wgmma) for fp8 rows of an even blocks_x
// where a split has two 64-row tiles or more (kWgmmaPairMinRows).
//   - Pairs at the plan's count, planned 2-8 ways: the most splits, up to 4 and the plan's, whose
//     (2, 1, S) clusters all fit (fewer splits keep the rows to pair); where none do, unpaired
//     clusters as below. Planned past 8: kept, merged by the kernel.
//   - Unpaired, planned 2-16 ways: the most splits, up to 8 and the plan's, whose (1, 1, S) clusters
//     all fit (returned unpaired: the launch then does not pair them, whatever their rows). Planned
//     past 16 (GLM-5 below 8 tokens on 132 SMs): kept.
//   - Where no such clusters fit: the plan's count and `pairs`, merged by the kernel.
// (The figures: sparse_mla.cu, above the call; PERFORMANCE.md sessions 52-53.)
constexpr int kWgmmaPairMinRows = 128;
// Whether the Hopper launch pairs blocks of rows_per_split rows (sparse_mla_wgmma); and at `splits`
// of a token's `tiles` (mma_geometry's rows per split).
inline bool wgmma_pairs(bool pairs, bool fp8, int64_t blocks_x, int64_t rows_per_split) {
  return pairs && fp8 && blocks_x % 2 == 0 && rows_per_split >= kWgmmaPairMinRows;
}
inline bool wgmma_pairs_at(bool pairs, bool fp8, int64_t blocks_x, int tiles, int splits) {
  const int s = splits < tiles ? splits : tiles;
  return s >= 1 && wgmma_pairs(pairs, fp8, blocks_x, int64_t((tiles + s - 1) / s) * mla_smem::kRows);
}
template <class ClustersAtOnce>
WgmmaClusterSplits wgmma_split_cluster_rule(int splits, bool pairs, bool fp8, int64_t blocks_x, int64_t T, int tiles,
                                            bool pair_clusters, ClustersAtOnce clusters_at_once) {
  constexpr int kMax = kWgmmaMaxClusterSplits;
  const bool paired = wgmma_pairs_at(pairs, fp8, blocks_x, tiles, splits);
  if (splits < 2 || splits > (paired ? kMax : 2 * kMax)) return {splits, pairs};
  if (paired) {
    if (!pair_clusters) return {splits, pairs};
    for (int s = splits < kWgmmaMaxPairClusterSplits ? splits : kWgmmaMaxPairClusterSplits; s >= 2; --s)
      if (int64_t(clusters_at_once(2, s)) >= blocks_x / 2 * T) return {s, true};
  }
  for (int s = splits < kMax ? splits : kMax; s >= 2; --s)
    if (int64_t(clusters_at_once(1, s)) >= blocks_x * T) return {s, false};
  return {splits, pairs};
}

// What sparse_mla(a, k, ws, s, splits, heads_per_block) launches on a device whose limits ws holds
// (sm_count, smem_optin, and device_smem_per_sm or the emulated smem_per_sm; sparse_mla() fills
// them in from the current device). Throws Error where sparse_mla() would (shapes no kernel takes,
// limits missing).
MlaLaunchPlan plan_sparse_mla(const AttentionArgs& a, AttentionKernel k, const AttentionWorkspace& ws, int splits = 0,
                              int heads_per_block = 0);

}  // namespace sparsemla::cuda
