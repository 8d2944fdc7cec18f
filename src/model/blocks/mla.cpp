#include "model/blocks/mla.h"

#include <cmath>

#include "ops/cpu/attention.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/matmul.h"

namespace sparsemla::model {

void mla_write_cache(const MlaWeights& w, const HParams& hp, const ops::Rope& rope, ops::RopeStyle style,
                     const float* x, const std::vector<TokenRef>& toks, kv::PagedCache& cache, int32_t layer,
                     ops::ThreadPool& pool) {
  const int64_t T = int64_t(toks.size());
  const int64_t kv_lora = hp.kv_lora_rank, latent = hp.kv_lora_rank + hp.qk_rope;
  std::vector<float> kv(size_t(T * latent));  // [T, kv_lora + rope]
  ops::matmul(w.kv_a_mqa, x, T, kv.data(), pool);
  for (int64_t t = 0; t < T; ++t) {
    float* row = kv.data() + t * latent;
    float* dst = cache.latent(layer, toks[size_t(t)].slot);
    ops::rms_norm(row, w.kv_a_norm.data(), kv_lora, hp.rms_eps, dst);
    for (int64_t i = kv_lora; i < latent; ++i) dst[i] = row[i];
    rope.apply(dst + kv_lora, toks[size_t(t)].pos, style);
    cache.round_latent(layer, toks[size_t(t)].slot);
  }
}

void mla_attend(const MlaWeights& w, const HParams& hp, const ops::Rope& rope, ops::RopeStyle style,
                const float* x, const float* qr, const std::vector<TokenRef>& toks,
                const std::vector<const std::vector<int32_t>*>& block_tables,
                const std::vector<std::vector<int32_t>>* selected, kv::PagedCache& cache, int32_t layer, float* out,
                ops::ThreadPool& pool) {
  const int64_t T = int64_t(toks.size());
  const int64_t n_head = hp.n_head, nope = hp.qk_nope, rope_dims = hp.qk_rope, vh = hp.v_head;
  const int64_t kv_lora = hp.kv_lora_rank, qk = nope + rope_dims;
  const float scale = hp.softmax_scale();

  // q = qr @ q_b (or x @ q), per head [q_nope | q_pe]: [T, n_head, qk]
  std::vector<float> q(size_t(T * n_head * qk));
  if (hp.q_lora_rank > 0) ops::matmul(w.q_b, qr, T, q.data(), pool);
  else ops::matmul(w.q, x, T, q.data(), pool);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < n_head; ++h) rope.apply(q.data() + (t * n_head + h) * qk + nope, toks[size_t(t)].pos, style);

  // Absorb W_UK into the query: qa[t, h] = W_UK_h^T q_nope[t, h]   [T, n_head, kv_lora]
  std::vector<float> qa(size_t(T * n_head * kv_lora), 0.0f);
  {
    std::vector<float> qn(size_t(T * nope)), qah(size_t(T * kv_lora));
    for (int64_t h = 0; h < n_head; ++h) {
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < nope; ++i) qn[size_t(t * nope + i)] = q[size_t((t * n_head + h) * qk + i)];
      if (!w.legacy_kv_b) {
        ops::matmul(w.k_b.rows(h * kv_lora, kv_lora), qn.data(), T, qah.data(), pool);
      } else {
        std::fill(qah.begin(), qah.end(), 0.0f);
        const Weight k_rows = w.kv_b.rows(h * (nope + vh), nope);
        for (int64_t t = 0; t < T; ++t) ops::matmul_transposed_acc(k_rows, qn.data() + t * nope, qah.data() + t * kv_lora);
      }
      for (int64_t t = 0; t < T; ++t)
        std::copy_n(qah.data() + t * kv_lora, kv_lora, qa.data() + (t * n_head + h) * kv_lora);
    }
  }

  // Softmax attention over the selected latent rows, output in latent space: [T, n_head, kv_lora]
  std::vector<float> o_lat(size_t(T * n_head * kv_lora), 0.0f);
  pool.parallel_for(T * n_head, [&](int64_t b, int64_t e) {
    std::vector<float> logits;
    std::vector<const float*> rows;
    for (int64_t th = b; th < e; ++th) {
      const int64_t t = th / n_head;
      const TokenRef& tok = toks[size_t(t)];
      const std::vector<int32_t>& table = *block_tables[size_t(tok.seq)];
      rows.clear();
      if (selected) {
        for (int32_t p : (*selected)[size_t(t)]) rows.push_back(cache.latent(layer, cache.slot(table, p)));
      } else {
        for (int64_t p = 0; p <= tok.pos; ++p) rows.push_back(cache.latent(layer, cache.slot(table, p)));
      }
      ops::latent_attention(qa.data() + th * kv_lora, q.data() + th * qk + nope, rows.data(), int64_t(rows.size()),
                            kv_lora, rope_dims, scale, o_lat.data() + th * kv_lora, logits);
    }
  });

  // Out of the latent space: o[t, h] = W_UV_h o_lat[t, h]   [T, n_head * v_head]
  std::vector<float> o(size_t(T * n_head * vh));
  {
    std::vector<float> ol(size_t(T * kv_lora)), oh(size_t(T * vh));
    for (int64_t h = 0; h < n_head; ++h) {
      for (int64_t t = 0; t < T; ++t)
        std::copy_n(o_lat.data() + (t * n_head + h) * kv_lora, kv_lora, ol.data() + t * kv_lora);
      const Weight v_rows = w.legacy_kv_b ? w.kv_b.rows(h * (nope + vh) + nope, vh) : w.v_b.rows(h * vh, vh);
      ops::matmul(v_rows, ol.data(), T, oh.data(), pool);
      for (int64_t t = 0; t < T; ++t) std::copy_n(oh.data() + t * vh, vh, o.data() + (t * n_head + h) * vh);
    }
  }
  ops::matmul(w.output, o.data(), T, out, pool);
}

}  // namespace sparsemla::model
