#include "model/model.h"

#include <cstdio>

#include "ops/cpu/basic.h"
#include "ops/cpu/matmul.h"

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
  return cache_shape_for(hp_, n_blocks, block_size);
}

void Model::forward(const std::vector<SeqInput>& batch, kv::PagedCache& cache, std::vector<float>& logits,
                    const Decisions* force, Decisions* record) {
  const int64_t H = hp_.n_embd;
  const FlatBatch b = flatten_batch(batch, cache, hp_.n_vocab);
  const int64_t T = int64_t(b.toks.size());
  ops::ThreadPool& pool = *pool_;

  std::vector<float> h(size_t(T * H));
  for (int64_t t = 0; t < T; ++t) ops::dequantize_row(w_.token_embd, b.ids[size_t(t)], h.data() + t * H);
  run_layers(LayerStack{hp_, hp_, *spec_, rope_, attention_, w_.layers, {}, {}, record, force}, b, cache, h.data(), pool);

  const int64_t R = int64_t(b.out_rows.size());
  std::vector<float> normed(size_t(R * H));
  for (int64_t r = 0; r < R; ++r)
    ops::rms_norm(h.data() + b.out_rows[size_t(r)] * H, w_.output_norm.data(), H, hp_.rms_eps, normed.data() + r * H);
  const size_t base = logits.size();
  logits.resize(base + size_t(R) * hp_.n_vocab);
  ops::matmul(w_.output, normed.data(), R, logits.data() + base, pool);
}

}  // namespace sparsemla::model
