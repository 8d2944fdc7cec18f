// Multi-head latent attention, absorbed: queries are turned into the latent space (W_UK), scored
// against the cached latent rows [c | k_pe], and the attention output is taken back out of it (W_UV).
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

// Writes each new token's latent row [rmsnorm(c) | rope(k_pe)] into the cache.
//   x: [T, H] (attn_norm output)
void mla_write_cache(const MlaWeights& w, const HParams& hp, const ops::Rope& rope, ops::RopeStyle style,
                     const float* x, const std::vector<TokenRef>& toks, kv::PagedCache& cache, int32_t layer,
                     ops::ThreadPool& pool);

// Attention of each new token over `selected[t]` (positions of its sequence, all <= its own) or,
// when `selected` is null, over every position <= its own. Adds nothing: writes out = o @ attn_output.
// hp.n_head is the number of heads `w` holds: all of them, or a rank's share under tensor
// parallelism (then `out` is that rank's partial sum of attn_output over its heads' columns).
//   x: [T, H]   qr: [T, q_lora] (null without q_lora)   out: [T, H]
void mla_attend(const MlaWeights& w, const HParams& hp, const ops::Rope& rope, ops::RopeStyle style,
                const float* x, const float* qr, const std::vector<TokenRef>& toks,
                const std::vector<const std::vector<int32_t>*>& block_tables,
                const std::vector<std::vector<int32_t>>* selected, kv::PagedCache& cache, int32_t layer, float* out,
                ops::ThreadPool& pool);

}  // namespace sparsemla::model
