// The token tiles of a prefill's routed experts (cuda::matmul_expert_tiles in quant_matmul.h: the
// prefill kernel's grouped mode, gemm_kernel.cuh). Plain C++ without CUDA, so that the host
// emulation's tests build it everywhere.
#pragma once
#include <cstdint>
#include <vector>

#include "util/error.h"

namespace sparsemla::cuda {

// The experts of a prefill in few launches (the prefill kernel's grouped mode, gemm_kernel.cuh):
// the activations grouped by expert (expert e's rows right after expert e - 1's, from row 0: the
// order gather_rows gives), each group cut into tiles of one launch's width in tokens. A tile
// multiplies rows [first, first + count) of x by expert `expert`'s rows of the stacked weight into
// the same rows of y (count <= the width). Each of its products is summed as matmul_prefill sums a
// product of its tokens alone without column splits (bf16 tensor cores, fp32 accumulation): ~2e-3
// to 6e-3 relative to the fp32 product.
struct ExpertTile {
  int32_t expert = 0, first = 0, count = 0, pad = 0;
};
constexpr int kExpertTileWidths[3] = {32, 64, 128};
// The tiles of the groups of counts[e] rows with lo <= counts[e] < hi (other groups' rows are
// skipped, not tiled): 128-token tiles while 128 or more of a group's tokens remain, then one tile
// of the narrowest width that holds the rest. of_width[i]: the tiles of width kExpertTileWidths[i],
// in expert order.
struct ExpertTileLists {
  std::vector<ExpertTile> of_width[3];
  size_t total() const { return of_width[0].size() + of_width[1].size() + of_width[2].size(); }
};
inline ExpertTileLists expert_tiles(const int32_t* counts, int64_t n_experts, int64_t lo, int64_t hi) {
  if (n_experts < 0 || (n_experts > 0 && !counts)) fail("cuda::expert_tiles: {} experts without counts", n_experts);
  ExpertTileLists l;
  int64_t first = 0;
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t c = counts[e];
    if (c < 0) fail("cuda::expert_tiles: expert {} has a negative count {}", e, c);
    if (first + c > INT32_MAX) fail("cuda::expert_tiles: more than {} rows", INT32_MAX);
    if (c > 0 && c >= lo && c < hi) {
      int64_t at = first, left = c;
      for (; left >= 128; at += 128, left -= 128) l.of_width[2].push_back({int32_t(e), int32_t(at), 128, 0});
      if (left > 0) l.of_width[left <= 32 ? 0 : left <= 64 ? 1 : 2].push_back({int32_t(e), int32_t(at), int32_t(left), 0});
    }
    first += c;
  }
  return l;
}

}  // namespace sparsemla::cuda
