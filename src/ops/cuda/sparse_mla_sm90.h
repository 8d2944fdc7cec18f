// The Hopper (sm_90a) sparse MLA kernel's entry points (sparse_mla_sm90.cu), for the launch in
// sparse_mla.cu. Host-side declarations only.
#pragma once

#include "ops/cuda/attention.h"
#include "ops/cuda/sparse_mla_plan.h"

namespace sparsemla::cuda {

// The Hopper kernel and its launch (sparse_mla_sm90.cu): splits of rows_per_split rows each, blocks
// in pairs where `pairs` and the rows and heads allow (wgmma_pairs); merge: the splits of a token
// may merge in their cluster instead of the merge kernel (merged tells whether they did; then `part`
// is not used). Returns the blocks per cluster launched.
int sparse_mla_wgmma(const AttentionArgs& a, int splits, int rows_per_split, float* part, bool pairs, bool merge,
                     bool& merged, Stream s);
// The split count the Hopper kernel takes for a planned `splits` where its splits merge in their
// clusters, and whether its blocks pair: wgmma_split_cluster_rule (sparse_mla_plan.h) on this
// device's cluster occupancy; tiles: the token's kRows-row tiles (the plan's).
WgmmaClusterSplits wgmma_cluster_splits(const AttentionArgs& a, int splits, int tiles, bool pairs);

}  // namespace sparsemla::cuda
