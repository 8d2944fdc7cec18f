#include "model/weights.h"

#include <fmt/format.h>

#include "gguf/quants.h"
#include "gguf/reader.h"
#include "util/error.h"

namespace sparsemla::model {
namespace {

// Looks tensors up by name, checks their shapes, and collects every problem before failing.
class Binder {
 public:
  explicit Binder(const gguf::File& f) : f_(f) {}

  const gguf::TensorInfo* find(const std::string& name, std::vector<int64_t> shape, bool required) {
    const gguf::TensorInfo* t = f_.tensor(name);
    if (!t) {
      if (required) missing_.push_back(name);
      return nullptr;
    }
    bool ok = t->n_dims <= shape.size() || (t->n_dims == shape.size() + 1 && t->ne[t->n_dims - 1] == 1);
    for (size_t d = 0; d < 4; ++d) ok = ok && t->ne[d] == (d < shape.size() ? shape[d] : 1);
    if (!ok) {
      std::string want = "{";
      for (size_t d = 0; d < shape.size(); ++d) want += fmt::format("{}{}", d ? ", " : "", shape[d]);
      problems_.push_back(fmt::format("{} has shape {}, expected {}", name, t->shape_string(), want + "}"));
      return nullptr;
    }
    used_++;
    return t;
  }
  Weight weight(const std::string& name, std::vector<int64_t> shape, bool required = true) {
    const gguf::TensorInfo* t = find(name, std::move(shape), required);
    return t ? Weight::of(*t) : Weight{};
  }
  std::vector<float> vec(const std::string& name, int64_t n, bool required = true) {
    const gguf::TensorInfo* t = find(name, {n}, required);
    if (!t) return {};
    if (!gguf::traits(t->type).dequantizable) {
      problems_.push_back(fmt::format("{} has type {}, which cannot be read", name, gguf::type_name(t->type)));
      return {};
    }
    std::vector<float> v(static_cast<size_t>(n));
    gguf::dequantize_row(t->type, t->data, v.data(), n);
    return v;
  }
  bool has(const std::string& name) const { return f_.tensor(name) != nullptr; }

  void finish() const {
    if (missing_.empty() && problems_.empty()) return;
    std::string msg = fmt::format("{}: the model's tensors do not match its metadata:", f_.paths()[0]);
    if (!missing_.empty()) {
      msg += fmt::format(" {} missing:", missing_.size());
      for (size_t i = 0; i < missing_.size() && i < 40; ++i) msg += " " + missing_[i];
      if (missing_.size() > 40) msg += " ...";
      msg += ";";
    }
    for (const auto& p : problems_) msg += " " + p + ";";
    msg.pop_back();
    throw Error(msg);
  }

 private:
  const gguf::File& f_;
  std::vector<std::string> missing_, problems_;
  size_t used_ = 0;
};

}  // namespace

ModelWeights bind_weights(const gguf::File& f, const HParams& hp) {
  Binder b(f);
  const int64_t H = hp.n_embd, V = hp.n_vocab;
  const int64_t n_head = hp.n_head, nope = hp.qk_nope, rope = hp.qk_rope, vh = hp.v_head;
  const int64_t q_lora = hp.q_lora_rank, kv_lora = hp.kv_lora_rank;
  ModelWeights w;
  w.token_embd = b.weight("token_embd.weight", {H, V});
  w.output = b.has("output.weight") ? b.weight("output.weight", {H, V}) : w.token_embd;
  w.output_norm = b.vec("output_norm.weight", H);

  w.layers.resize(hp.n_layer_total);
  for (uint32_t il = 0; il < hp.n_layer_total; ++il) {
    auto n = [il](const char* s) { return fmt::format("blk.{}.{}", il, s); };
    LayerWeights& L = w.layers[il];
    L.attn_norm = b.vec(n("attn_norm.weight"), H);
    L.ffn_norm = b.vec(n("ffn_norm.weight"), H);

    MlaWeights& m = L.mla;
    if (q_lora > 0) {
      m.q_a = b.weight(n("attn_q_a.weight"), {H, q_lora});
      m.q_a_norm = b.vec(n("attn_q_a_norm.weight"), q_lora);
      m.q_b = b.weight(n("attn_q_b.weight"), {q_lora, n_head * (nope + rope)});
    } else {
      m.q = b.weight(n("attn_q.weight"), {H, n_head * (nope + rope)});
    }
    m.kv_a_mqa = b.weight(n("attn_kv_a_mqa.weight"), {H, kv_lora + rope});
    m.kv_a_norm = b.vec(n("attn_kv_a_norm.weight"), kv_lora);
    if (b.has(n("attn_k_b.weight")) || !b.has(n("attn_kv_b.weight"))) {
      m.k_b = b.weight(n("attn_k_b.weight"), {nope, kv_lora, n_head});
      m.v_b = b.weight(n("attn_v_b.weight"), {kv_lora, vh, n_head});
    } else {
      m.legacy_kv_b = true;
      m.kv_b = b.weight(n("attn_kv_b.weight"), {kv_lora, n_head * (nope + vh)});
    }
    m.output = b.weight(n("attn_output.weight"), {n_head * vh, H});

    // The next-n layer is not run; its indexer is optional (IndexShare files may leave it out).
    const bool nextn_without_indexer = il >= hp.n_layer && !b.has(n("indexer.attn_k.weight"));
    if (hp.has_indexer() && hp.idx_full[il] && !nextn_without_indexer) {
      IndexerWeights& ix = L.indexer;
      ix.present = true;
      const int64_t ih = hp.idx_heads, id = hp.idx_dim;
      ix.q_b = b.weight(n("indexer.attn_q_b.weight"), {q_lora, ih * id});
      ix.k = b.weight(n("indexer.attn_k.weight"), {H, id});
      ix.proj = b.weight(n("indexer.proj.weight"), {H, ih});
      ix.k_norm_w = b.vec(n("indexer.k_norm.weight"), id);
      ix.k_norm_b = b.vec(n("indexer.k_norm.bias"), id);
    }

    FfnWeights& ff = L.ffn;
    if (!hp.is_moe_layer(il)) {
      ff.gate = b.weight(n("ffn_gate.weight"), {H, hp.n_ff});
      ff.up = b.weight(n("ffn_up.weight"), {H, hp.n_ff});
      ff.down = b.weight(n("ffn_down.weight"), {hp.n_ff, H});
    } else {
      ff.moe = true;
      const int64_t E = hp.n_expert, Fe = hp.n_ff_exp;
      ff.gate_inp = b.weight(n("ffn_gate_inp.weight"), {H, E});
      ff.exp_probs_b = b.vec(n("exp_probs_b.bias"), E, false);
      if (ff.exp_probs_b.empty()) ff.exp_probs_b.assign(size_t(E), 0.0f);
      ff.gate_exps = b.weight(n("ffn_gate_exps.weight"), {H, Fe, E});
      ff.up_exps = b.weight(n("ffn_up_exps.weight"), {H, Fe, E});
      ff.down_exps = b.weight(n("ffn_down_exps.weight"), {Fe, H, E});
      if (hp.n_expert_shared > 0) {
        const int64_t Fs = Fe * hp.n_expert_shared;
        ff.gate_shexp = b.weight(n("ffn_gate_shexp.weight"), {H, Fs});
        ff.up_shexp = b.weight(n("ffn_up_shexp.weight"), {H, Fs});
        ff.down_shexp = b.weight(n("ffn_down_shexp.weight"), {Fs, H});
      }
    }

    if (il >= hp.n_layer) {
      L.nextn = true;
      NextnWeights& nx = L.nextn_w;
      nx.eh_proj = b.weight(n("nextn.eh_proj.weight"), {2 * H, H});
      nx.enorm = b.vec(n("nextn.enorm.weight"), H);
      nx.hnorm = b.vec(n("nextn.hnorm.weight"), H);
      nx.shared_head_norm = b.vec(n("nextn.shared_head_norm.weight"), H, false);
      nx.shared_head_head = b.weight(n("nextn.shared_head_head.weight"), {H, V}, false);
      nx.embed_tokens = b.weight(n("nextn.embed_tokens.weight"), {H, V}, false);
    }
  }
  b.finish();
  return w;
}

}  // namespace sparsemla::model
