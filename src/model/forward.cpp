#include "model/forward.h"

#include "model/blocks/indexer.h"
#include "model/blocks/mla.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/matmul.h"
#include "util/error.h"

namespace sparsemla::model {

kv::CacheShape cache_shape_for(const HParams& hp, int32_t n_blocks, int32_t block_size) {
  kv::CacheShape s;
  s.n_layers = int32_t(hp.n_layer);
  s.latent_dim = int32_t(hp.kv_lora_rank + hp.qk_rope);
  s.idx_dim = hp.has_indexer() ? int32_t(hp.idx_dim) : 0;
  s.block_size = block_size;
  s.n_blocks = n_blocks;
  return s;
}

FlatBatch flatten_batch(const std::vector<SeqInput>& batch, const kv::BlockAllocator& blocks, uint32_t n_vocab) {
  FlatBatch b;
  for (size_t s = 0; s < batch.size(); ++s) {
    const SeqInput& in = batch[s];
    if (!in.block_table) fail("forward: sequence {} has no block table", s);
    if (in.tokens.empty()) fail("forward: sequence {} has no new tokens", s);
    b.tables.push_back(in.block_table);
    for (size_t i = 0; i < in.tokens.size(); ++i) {
      const int32_t id = in.tokens[i];
      if (id < 0 || uint32_t(id) >= n_vocab)
        fail("forward: token id {} is outside the vocabulary of {} tokens", id, n_vocab);
      const int64_t pos = in.pos0 + int64_t(i);
      if (in.all_logits || i + 1 == in.tokens.size()) b.out_rows.push_back(int64_t(b.toks.size()));
      b.toks.push_back({int32_t(s), pos, blocks.slot(*in.block_table, pos)});
      b.ids.push_back(id);
    }
  }
  return b;
}

namespace {

// Checks that recorded choices fit this forward: one entry per token of every layer that needs one.
void check_forced(const Decisions& d, const HParams& hp, int64_t T, bool sparse,
                  const std::vector<LayerWeights>& layers) {
  if (d.layers.size() < hp.n_layer) fail("forward: forced choices for {} layers, the model has {}", d.layers.size(), hp.n_layer);
  for (uint32_t il = 0; il < hp.n_layer; ++il) {
    const LayerDecisions& l = d.layers[il];
    if (sparse && l.selected.size() != size_t(T))
      fail("forward: forced selection of layer {} covers {} tokens, the batch has {}", il, l.selected.size(), T);
    if (layers[il].ffn.moe && (l.experts.size() != size_t(T) || l.weights.size() != size_t(T)))
      fail("forward: forced routing of layer {} covers {} tokens, the batch has {}", il, l.experts.size(), T);
  }
}

}  // namespace

void run_layers(const LayerStack& s, const FlatBatch& b, kv::PagedCache& cache, float* h, ops::ThreadPool& pool) {
  const HParams& hp = s.hp;
  const int64_t H = hp.n_embd;
  const int64_t T = int64_t(b.toks.size());
  const auto reduce = [&](float* data) {
    if (s.all_reduce) s.all_reduce(data, T * H);
  };
  std::vector<float> x(size_t(T * H)), attn(size_t(T * H));
  std::vector<float> qr;
  std::vector<std::vector<int32_t>> selected;  // the last full indexer layer's choice, per token
  const bool sparse = s.attention == AttentionMode::Sparse;
  if (s.force) check_forced(*s.force, hp, T, sparse && hp.has_indexer(), s.layers);
  if (s.record) s.record->layers.assign(hp.n_layer, LayerDecisions{});
  std::vector<Routing> routes, forced_routes;
  for (uint32_t il = 0; il < hp.n_layer; ++il) {
    const LayerWeights& L = s.layers[il];
    for (int64_t t = 0; t < T; ++t) ops::rms_norm(h + t * H, L.attn_norm.data(), H, hp.rms_eps, x.data() + t * H);
    if (hp.q_lora_rank > 0) {
      const int64_t ql = hp.q_lora_rank;
      qr.resize(size_t(T * ql));
      ops::matmul(L.mla.q_a, x.data(), T, qr.data(), pool);
      for (int64_t t = 0; t < T; ++t) ops::rms_norm(qr.data() + t * ql, L.mla.q_a_norm.data(), ql, hp.rms_eps, qr.data() + t * ql);
    }
    mla_write_cache(L.mla, hp, s.rope, s.spec.main_rope, x.data(), b.toks, cache, int32_t(il), pool);
    if (sparse && L.indexer.present)
      selected = indexer_select(L.indexer, hp, s.rope, s.spec.indexer_rope, x.data(), qr.data(), b.toks, b.tables, cache,
                                int32_t(il), pool);
    if (sparse && hp.has_indexer()) {
      if (s.force) selected = s.force->layers[il].selected;
      if (s.record) s.record->layers[il].selected = selected;
    }
    mla_attend(L.mla, s.attn_hp, s.rope, s.spec.main_rope, x.data(), qr.data(), b.toks, b.tables,
               sparse ? &selected : nullptr, cache, int32_t(il), attn.data(), pool);
    reduce(attn.data());
    for (int64_t i = 0; i < T * H; ++i) h[i] += attn[size_t(i)];

    for (int64_t t = 0; t < T; ++t) ops::rms_norm(h + t * H, L.ffn_norm.data(), H, hp.rms_eps, x.data() + t * H);
    if (L.ffn.moe) {
      if (s.force) {
        const LayerDecisions& f = s.force->layers[il];
        forced_routes.resize(size_t(T));
        for (int64_t t = 0; t < T; ++t) forced_routes[size_t(t)] = Routing{f.experts[size_t(t)], f.weights[size_t(t)]};
      }
      moe_forward(L.ffn, hp, x.data(), T, attn.data(), pool, s.experts, s.force ? &forced_routes : nullptr,
                  s.record ? &routes : nullptr);
      if (s.record) {
        LayerDecisions& r = s.record->layers[il];
        for (const Routing& rt : routes) {
          r.experts.push_back(rt.experts);
          r.weights.push_back(rt.weights);
        }
      }
    } else {
      mlp_forward(L.ffn.gate, L.ffn.up, L.ffn.down, x.data(), T, attn.data(), pool);
    }
    reduce(attn.data());
    for (int64_t i = 0; i < T * H; ++i) h[i] += attn[size_t(i)];
  }
}

}  // namespace sparsemla::model
