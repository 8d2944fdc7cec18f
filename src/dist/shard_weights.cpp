#include "dist/shard_weights.h"

#include <fmt/format.h>

#include <cstdint>

#include "util/error.h"

namespace sparsemla::dist {
namespace {

using model::ModelWeights;
using model::Weight;

// fn(name, matrix of full, same matrix of shard) for every matrix of the main layers that `full`
// has, under its GGUF name.
template <class Shard, class Fn>
void for_each_matrix(const ModelWeights& full, Shard& shard, uint32_t n_layer, Fn&& fn) {
  auto visit = [&](const std::string& name, const Weight& f, auto& s) {
    if (f.data) fn(name, f, s);
  };
  visit("token_embd.weight", full.token_embd, shard.token_embd);
  visit("output.weight", full.output, shard.output);
  for (uint32_t il = 0; il < n_layer; ++il) {
    auto n = [il](const char* s) { return fmt::format("blk.{}.{}", il, s); };
    const model::LayerWeights& F = full.layers[il];
    auto& S = shard.layers[il];
    visit(n("attn_q_a.weight"), F.mla.q_a, S.mla.q_a);
    visit(n("attn_q_b.weight"), F.mla.q_b, S.mla.q_b);
    visit(n("attn_q.weight"), F.mla.q, S.mla.q);
    visit(n("attn_kv_a_mqa.weight"), F.mla.kv_a_mqa, S.mla.kv_a_mqa);
    visit(n("attn_k_b.weight"), F.mla.k_b, S.mla.k_b);
    visit(n("attn_v_b.weight"), F.mla.v_b, S.mla.v_b);
    visit(n("attn_kv_b.weight"), F.mla.kv_b, S.mla.kv_b);
    visit(n("attn_output.weight"), F.mla.output, S.mla.output);
    visit(n("indexer.attn_q_b.weight"), F.indexer.q_b, S.indexer.q_b);
    visit(n("indexer.attn_k.weight"), F.indexer.k, S.indexer.k);
    visit(n("indexer.proj.weight"), F.indexer.proj, S.indexer.proj);
    visit(n("ffn_gate.weight"), F.ffn.gate, S.ffn.gate);
    visit(n("ffn_up.weight"), F.ffn.up, S.ffn.up);
    visit(n("ffn_down.weight"), F.ffn.down, S.ffn.down);
    visit(n("ffn_gate_inp.weight"), F.ffn.gate_inp, S.ffn.gate_inp);
    visit(n("ffn_gate_exps.weight"), F.ffn.gate_exps, S.ffn.gate_exps);
    visit(n("ffn_up_exps.weight"), F.ffn.up_exps, S.ffn.up_exps);
    visit(n("ffn_down_exps.weight"), F.ffn.down_exps, S.ffn.down_exps);
    visit(n("ffn_gate_shexp.weight"), F.ffn.gate_shexp, S.ffn.gate_shexp);
    visit(n("ffn_up_shexp.weight"), F.ffn.up_shexp, S.ffn.up_shexp);
    visit(n("ffn_down_shexp.weight"), F.ffn.down_shexp, S.ffn.down_shexp);
  }
}

const TensorSplit& split_of(const ShardPlan& plan, const std::string& name, const Weight& full) {
  const TensorSplit* t = plan.find(name);
  if (!t) fail("tensor parallel: the plan has no entry for {}", name);
  if (t->type != full.type || t->rows != full.n_rows || t->cols != full.n_cols)
    fail("tensor parallel: the plan has {} as {} {} x {}, the model as {} {} x {}", name, gguf::type_name(t->type),
         t->rows, t->cols, gguf::type_name(full.type), full.n_rows, full.n_cols);
  return *t;
}

// Where `view` lies in `full`, as a slice; false when it is not a slice of it at all.
bool slice_in(const Weight& full, const Weight& view, Slice* out) {
  if (!view.data || view.type != full.type || view.row_bytes != full.row_bytes) return false;
  const uintptr_t base = reinterpret_cast<uintptr_t>(full.data), at = reinterpret_cast<uintptr_t>(view.data);
  const uint64_t size = uint64_t(full.n_rows) * full.row_bytes;
  if (at < base || at - base > size) return false;
  const uint64_t offset = at - base;
  const gguf::TypeTraits& tr = gguf::traits(full.type);
  const uint64_t in_row = offset % full.row_bytes;
  if (in_row % tr.type_size != 0) return false;
  *out = Slice{int64_t(offset / full.row_bytes), view.n_rows, int64_t(in_row / tr.type_size) * tr.block_size, view.n_cols};
  return true;
}

}  // namespace

ModelWeights bind_shard(const ModelWeights& full, const model::HParams& hp, const ShardPlan& plan, int rank) {
  if (rank < 0 || rank >= plan.n_ranks()) fail("tensor parallel: rank {} is not in a plan of {} ranks", rank, plan.n_ranks());
  ModelWeights shard;
  shard.output_norm = full.output_norm;
  shard.layers.assign(full.layers.begin(), full.layers.begin() + hp.n_layer);
  shard.token_embd = full.token_embd;
  shard.output = full.output;
  for_each_matrix(full, shard, hp.n_layer, [&](const std::string& name, const Weight& f, Weight& s) {
    const Slice sl = split_of(plan, name, f).slice(rank);
    s = f.rows(sl.row0, sl.n_rows).cols(sl.col0, sl.n_cols);
  });
  verify_shard(full, shard, hp, plan, rank);
  return shard;
}

void verify_shard(const ModelWeights& full, const ModelWeights& shard, const model::HParams& hp, const ShardPlan& plan,
                  int rank) {
  if (shard.layers.size() < hp.n_layer)
    fail("tensor parallel: rank {} holds {} layers, the model runs {}", rank, shard.layers.size(), hp.n_layer);
  for_each_matrix(full, shard, hp.n_layer, [&](const std::string& name, const Weight& f, const Weight& s) {
    const TensorSplit& t = split_of(plan, name, f);
    const Slice want = t.slice(rank);
    const Weight w = f.rows(want.row0, want.n_rows).cols(want.col0, want.n_cols);
    if (s.data == w.data && s.type == w.type && s.n_rows == w.n_rows && s.n_cols == w.n_cols && s.row_bytes == w.row_bytes)
      return;
    Slice got;
    if (!slice_in(f, s, &got))
      fail("tensor-parallel shard check: {} on rank {} of {}: expected {}, found a view that is not a slice of it",
           name, rank, plan.n_ranks(), t.describe(want));
    fail("tensor-parallel shard check: {} on rank {} of {}: expected {}, found {}", name, rank, plan.n_ranks(),
         t.describe(want), t.describe(got));
  });
}

}  // namespace sparsemla::dist
