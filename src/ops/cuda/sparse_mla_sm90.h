// The Hopper (sm_90a) sparse MLA kernel's entry points (sparse_mla_sm90.cu), for the launch in
// sparse_mla.cu. Host-side declarations only.
#pragma once

#include "ops/cuda/attention.h"

namespace sparsemla::cuda {

// The Hopper kernel and its launch (sparse_mla_sm90.cu): splits of rows_per_split rows each, blocks
// in pairs where `pairs` and the rows and heads allow; returns the blocks per cluster launched.
// merge: the splits of a token may merge in their cluster instead of the merge kernel (merged tells
// whether they did; then `part` is not used). Returns the blocks per cluster launched.
int sparse_mla_wgmma(const AttentionArgs& a, int splits, int rows_per_split, float* part, bool pairs, bool merge,
                     bool& merged, Stream s);
// The split count the Hopper kernel takes for a planned `splits` of 2-16 where its splits merge in
// their clusters, and whether its blocks pair (`pairs` in, for fp8 rows of an even number of 64-head
// blocks): the most splits, up to `splits` and 8, whose clusters the device runs all at once (paired,
// for a plan of 2-8: (2, 1, S) clusters of at most 4 splits; where none of those fit, unpaired
// (1, 1, S) ones); else `splits` and `pairs`, merged by the kernel.
struct WgmmaClusterSplits {
  int splits;
  bool pairs;
};
WgmmaClusterSplits wgmma_cluster_splits(const AttentionArgs& a, int splits, bool pairs);

}  // namespace sparsemla::cuda
