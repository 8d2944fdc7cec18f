// The DSA lightning indexer: scores every earlier position of a token's sequence with a few cheap
// heads and selects the top-k positions the main attention will see.
#pragma once
#include <cstdint>
#include <vector>

#include "kv/paged_cache.h"
#include "model/batch.h"
#include "model/hparams.h"
#include "model/weights.h"
#include "ops/cpu/rope.h"
#include "ops/cpu/thread_pool.h"

namespace sparsemla::model {

// Writes the new tokens' indexer keys, then returns for each token the positions it attends to:
// the min(top_k, pos + 1) highest-scoring positions <= pos of its sequence.
//   x: [T, H] (attn_norm output)   qr: [T, q_lora]
std::vector<std::vector<int32_t>> indexer_select(const IndexerWeights& w, const HParams& hp, const ops::Rope& rope,
                                                 ops::RopeStyle style, const float* x, const float* qr,
                                                 const std::vector<TokenRef>& toks,
                                                 const std::vector<const std::vector<int32_t>*>& block_tables,
                                                 kv::PagedCache& cache, int32_t layer, ops::ThreadPool& pool);

// score(s) = sum_h w_h * relu(q_h . k_s), the indexer's score of one position.
//   q: [idx_heads, idx_dim]   weights: [idx_heads] (already scaled)   k: [idx_dim]
float indexer_score(const float* q, const float* weights, const float* k, int64_t heads, int64_t dim);

}  // namespace sparsemla::model
