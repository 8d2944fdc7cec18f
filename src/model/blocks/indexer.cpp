#include "model/blocks/indexer.h"

#include <cmath>

#include "ops/cpu/basic.h"
#include "ops/cpu/matmul.h"

namespace sparsemla::model {

float indexer_score(const float* q, const float* weights, const float* k, int64_t heads, int64_t dim) {
  float score = 0.0f;
  for (int64_t h = 0; h < heads; ++h) {
    float dot = 0.0f;
    for (int64_t i = 0; i < dim; ++i) dot += q[h * dim + i] * k[i];
    score += weights[h] * std::max(dot, 0.0f);
  }
  return score;
}

std::vector<std::vector<int32_t>> indexer_select(const IndexerWeights& w, const HParams& hp, const ops::Rope& rope,
                                                 ops::RopeStyle style, const float* x, const float* qr,
                                                 const std::vector<TokenRef>& toks,
                                                 const std::vector<const std::vector<int32_t>*>& block_tables,
                                                 kv::PagedCache& cache, int32_t layer, ops::ThreadPool& pool) {
  const int64_t T = int64_t(toks.size());
  const int64_t heads = hp.idx_heads, dim = hp.idx_dim;

  // keys: layernorm(x @ attn_k), rope on the first rope dims
  std::vector<float> k(size_t(T * dim));
  ops::matmul(w.k, x, T, k.data(), pool);
  for (int64_t t = 0; t < T; ++t) {
    float* dst = cache.index_key(layer, toks[size_t(t)].slot);
    ops::layer_norm(k.data() + t * dim, w.k_norm_w.data(), w.k_norm_b.data(), dim, 1e-6f, dst);
    rope.apply(dst, toks[size_t(t)].pos, style);
    cache.round_index_key(layer, toks[size_t(t)].slot);
  }

  // queries: qr @ q_b per head, rope on the first rope dims of each head   [T, heads, dim]
  std::vector<float> q(size_t(T * heads * dim));
  ops::matmul(w.q_b, qr, T, q.data(), pool);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h) rope.apply(q.data() + (t * heads + h) * dim, toks[size_t(t)].pos, style);

  // per-head weights, with both scales folded in: heads^-0.5 and dim^-0.5 (relu commutes with them)
  std::vector<float> wts(size_t(T * heads));
  ops::matmul(w.proj, x, T, wts.data(), pool);
  const float wscale = 1.0f / std::sqrt(float(heads) * float(dim));
  for (float& v : wts) v *= wscale;

  std::vector<std::vector<int32_t>> selected(static_cast<size_t>(T));
  pool.parallel_for(T, [&](int64_t b, int64_t e) {
    std::vector<float> scores;
    for (int64_t t = b; t < e; ++t) {
      const TokenRef& tok = toks[size_t(t)];
      const std::vector<int32_t>& table = *block_tables[size_t(tok.seq)];
      scores.resize(size_t(tok.pos + 1));
      for (int64_t p = 0; p <= tok.pos; ++p)
        scores[size_t(p)] = indexer_score(q.data() + t * heads * dim, wts.data() + t * heads,
                                          cache.index_key(layer, cache.slot(table, p)), heads, dim);
      selected[size_t(t)] = ops::top_k(scores.data(), tok.pos + 1, hp.idx_top_k);
    }
  });
  return selected;
}

}  // namespace sparsemla::model
