#include "model/model.h"

#include <cstdio>

#include "model/blocks/ffn.h"
#include "model/blocks/indexer.h"
#include "model/blocks/mla.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/matmul.h"
#include "util/error.h"

namespace sparsemla::model {

std::unique_ptr<Model> Model::load(const std::string& path, const ModelOptions& opts) {
  std::unique_ptr<Model> m(new Model());
  m->file_ = gguf::File::open(path);
  m->hp_ = load_hparams(*m->file_);
  m->spec_ = &arch_spec(m->hp_.arch);
  m->w_ = bind_weights(*m->file_, m->hp_);
  m->rope_ = ops::Rope(m->hp_);
  m->attention_ = opts.attention;
  if (!m->spec_->sparse_attention) m->attention_ = AttentionMode::Dense;
  if (opts.attention == AttentionMode::Dense && m->spec_->sparse_attention)
    std::fprintf(stderr,
                 "warning: --attention dense: attending to every position instead of the indexer's top-%u; "
                 "%s was trained with sparse attention, so this changes the model's output\n",
                 m->hp_.idx_top_k, m->spec_->name);
  m->pool_ = std::make_unique<ops::ThreadPool>(opts.threads);
  return m;
}

kv::CacheShape Model::cache_shape(int32_t n_blocks, int32_t block_size) const {
  kv::CacheShape s;
  s.n_layers = int32_t(hp_.n_layer);
  s.latent_dim = int32_t(hp_.kv_lora_rank + hp_.qk_rope);
  s.idx_dim = hp_.has_indexer() ? int32_t(hp_.idx_dim) : 0;
  s.block_size = block_size;
  s.n_blocks = n_blocks;
  return s;
}

void Model::forward(const std::vector<SeqInput>& batch, kv::PagedCache& cache, std::vector<float>& logits) {
  const int64_t H = hp_.n_embd;
  std::vector<TokenRef> toks;
  std::vector<int32_t> ids;
  std::vector<const std::vector<int32_t>*> tables;
  std::vector<int64_t> out_rows;  // tokens whose logits are returned
  for (size_t s = 0; s < batch.size(); ++s) {
    const SeqInput& in = batch[s];
    if (!in.block_table) fail("forward: sequence {} has no block table", s);
    if (in.tokens.empty()) fail("forward: sequence {} has no new tokens", s);
    tables.push_back(in.block_table);
    for (size_t i = 0; i < in.tokens.size(); ++i) {
      const int32_t id = in.tokens[i];
      if (id < 0 || uint32_t(id) >= hp_.n_vocab)
        fail("forward: token id {} is outside the vocabulary of {} tokens", id, hp_.n_vocab);
      const int64_t pos = in.pos0 + int64_t(i);
      if (in.all_logits || i + 1 == in.tokens.size()) out_rows.push_back(int64_t(toks.size()));
      toks.push_back({int32_t(s), pos, cache.slot(*in.block_table, pos)});
      ids.push_back(id);
    }
  }
  const int64_t T = int64_t(toks.size());
  ops::ThreadPool& pool = *pool_;

  std::vector<float> h(size_t(T * H)), x(size_t(T * H)), attn(size_t(T * H));
  for (int64_t t = 0; t < T; ++t) ops::dequantize_row(w_.token_embd, ids[size_t(t)], h.data() + t * H);

  std::vector<float> qr;
  std::vector<std::vector<int32_t>> selected;  // the last full indexer layer's choice, per token
  const bool sparse = attention_ == AttentionMode::Sparse;
  for (uint32_t il = 0; il < hp_.n_layer; ++il) {
    const LayerWeights& L = w_.layers[il];
    for (int64_t t = 0; t < T; ++t) ops::rms_norm(h.data() + t * H, L.attn_norm.data(), H, hp_.rms_eps, x.data() + t * H);
    if (hp_.q_lora_rank > 0) {
      const int64_t ql = hp_.q_lora_rank;
      qr.resize(size_t(T * ql));
      ops::matmul(L.mla.q_a, x.data(), T, qr.data(), pool);
      for (int64_t t = 0; t < T; ++t) ops::rms_norm(qr.data() + t * ql, L.mla.q_a_norm.data(), ql, hp_.rms_eps, qr.data() + t * ql);
    }
    mla_write_cache(L.mla, hp_, rope_, spec_->main_rope, x.data(), toks, cache, int32_t(il), pool);
    if (sparse && L.indexer.present)
      selected = indexer_select(L.indexer, hp_, rope_, spec_->indexer_rope, x.data(), qr.data(), toks, tables, cache,
                                int32_t(il), pool);
    mla_attend(L.mla, hp_, rope_, spec_->main_rope, x.data(), qr.data(), toks, tables, sparse ? &selected : nullptr,
               cache, int32_t(il), attn.data(), pool);
    for (int64_t i = 0; i < T * H; ++i) h[size_t(i)] += attn[size_t(i)];

    for (int64_t t = 0; t < T; ++t) ops::rms_norm(h.data() + t * H, L.ffn_norm.data(), H, hp_.rms_eps, x.data() + t * H);
    if (L.ffn.moe) moe_forward(L.ffn, hp_, x.data(), T, attn.data(), pool);
    else mlp_forward(L.ffn.gate, L.ffn.up, L.ffn.down, x.data(), T, attn.data(), pool);
    for (int64_t i = 0; i < T * H; ++i) h[size_t(i)] += attn[size_t(i)];
  }

  const int64_t R = int64_t(out_rows.size());
  std::vector<float> normed(size_t(R * H));
  for (int64_t r = 0; r < R; ++r)
    ops::rms_norm(h.data() + out_rows[size_t(r)] * H, w_.output_norm.data(), H, hp_.rms_eps, normed.data() + r * H);
  const size_t base = logits.size();
  logits.resize(base + size_t(R) * hp_.n_vocab);
  ops::matmul(w_.output, normed.data(), R, logits.data() + base, pool);
}

}  // namespace sparsemla::model
