#include "model/hparams.h"

#include <fmt/format.h>

#include <cmath>

#include "gguf/reader.h"
#include "util/error.h"

namespace sparsemla::model {

bool arch_from_name(const std::string& name, Arch* out) {
  if (name == "glm-dsa") *out = Arch::GlmDsa;
  else if (name == "deepseek32") *out = Arch::DeepSeek32;
  else if (name == "deepseek2") *out = Arch::DeepSeek2;
  else return false;
  return true;
}

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::GlmDsa: return "glm-dsa";
    case Arch::DeepSeek32: return "deepseek32";
    case Arch::DeepSeek2: return "deepseek2";
  }
  return "?";
}

float HParams::yarn_mscale() const {
  if (rope_scaling != RopeScaling::Yarn || rope_factor <= 1.0f) return 1.0f;
  return 1.0f + yarn_log_mul * std::log(rope_factor);
}

float HParams::softmax_scale() const {
  const float m = yarn_mscale();
  return m * m / std::sqrt(float(qk_nope + qk_rope));
}

namespace {

// Reads keys under the arch prefix, collecting every missing required key before failing.
class KeyReader {
 public:
  KeyReader(const gguf::File& f, HParams& hp) : f_(f), hp_(hp), prefix_(hp.arch_name + ".") {}

  uint32_t u32(const std::string& key) {
    auto v = f_.get_uint(prefix_ + key);
    if (!v) {
      missing_.push_back(prefix_ + key);
      return 0;
    }
    return checked(key, *v);
  }
  uint32_t u32_or(const std::string& key, uint32_t def) {
    auto v = f_.get_uint(prefix_ + key);
    if (!v) {
      hp_.defaulted.push_back(fmt::format("{}{} = {}", prefix_, key, def));
      return def;
    }
    return checked(key, *v);
  }
  float f32_or(const std::string& key, float def) {
    auto v = f_.get_float(prefix_ + key);
    if (!v) {
      hp_.defaulted.push_back(fmt::format("{}{} = {}", prefix_, key, def));
      return def;
    }
    return float(*v);
  }
  bool bool_or(const std::string& key, bool def) {
    auto v = f_.get_bool(prefix_ + key);
    if (!v) {
      hp_.defaulted.push_back(fmt::format("{}{} = {}", prefix_, key, def));
      return def;
    }
    return *v;
  }
  std::string str_or(const std::string& key, const std::string& def) {
    auto v = f_.get_string(prefix_ + key);
    return v ? *v : def;
  }
  bool has(const std::string& key) const { return f_.find(prefix_ + key) != nullptr; }
  const gguf::Value::Array* array(const std::string& key) const { return f_.get_array(prefix_ + key); }
  void problem(std::string what) { problems_.push_back(std::move(what)); }

  void finish() const {
    if (missing_.empty() && problems_.empty()) return;
    std::string msg = fmt::format("{}: cannot run this {} model:", f_.paths()[0], hp_.arch_name);
    if (!missing_.empty()) {
      msg += " missing keys:";
      for (const auto& k : missing_) msg += " " + k;
      msg += ";";
    }
    for (const auto& p : problems_) msg += " " + p + ";";
    msg.pop_back();
    throw Error(msg);
  }

 private:
  uint32_t checked(const std::string& key, uint64_t v) {
    if (v > 0xffffffffu) {
      problem(fmt::format("{}{} = {} is out of range", prefix_, key, v));
      return 0;
    }
    return uint32_t(v);
  }
  const gguf::File& f_;
  HParams& hp_;
  std::string prefix_;
  std::vector<std::string> missing_;
  std::vector<std::string> problems_;
};

}  // namespace

HParams load_hparams(const gguf::File& f) {
  HParams hp;
  hp.arch_name = f.architecture();
  if (!arch_from_name(hp.arch_name, &hp.arch))
    fail("{}: architecture '{}' is not supported (this engine runs glm-dsa, deepseek32 and deepseek2)",
         f.paths()[0], hp.arch_name);
  KeyReader k(f, hp);

  hp.n_layer_total = k.u32("block_count");
  hp.n_nextn = k.u32_or("nextn_predict_layers", 0);
  hp.n_ctx_train = k.u32("context_length");
  hp.n_embd = k.u32("embedding_length");
  hp.n_ff = k.u32("feed_forward_length");
  hp.n_head = k.u32("attention.head_count");
  hp.n_head_kv = k.u32_or("attention.head_count_kv", 1);
  hp.rms_eps = k.f32_or("attention.layer_norm_rms_epsilon", 1e-6f);
  hp.n_leading_dense = k.u32_or("leading_dense_block_count", 0);

  // Vocabulary: the arch key when present, else the token list.
  if (k.has("vocab_size")) hp.n_vocab = k.u32("vocab_size");
  else if (const auto* toks = f.get_array("tokenizer.ggml.tokens")) hp.n_vocab = uint32_t(toks->items.size());

  // MLA
  hp.q_lora_rank = k.u32_or("attention.q_lora_rank", 0);
  hp.kv_lora_rank = k.u32("attention.kv_lora_rank");
  hp.qk_rope = k.u32("rope.dimension_count");
  if (k.has("attention.key_length_mla")) {
    hp.qk_nope = k.u32("attention.key_length_mla") - hp.qk_rope;
    hp.v_head = k.u32("attention.value_length_mla");
    const uint32_t key_len = k.u32_or("attention.key_length", hp.kv_lora_rank + hp.qk_rope);
    const uint32_t val_len = k.u32_or("attention.value_length", hp.kv_lora_rank);
    if (key_len != hp.kv_lora_rank + hp.qk_rope)
      k.problem(fmt::format("attention.key_length is {}, expected kv_lora_rank + rope = {}", key_len,
                            hp.kv_lora_rank + hp.qk_rope));
    if (val_len != hp.kv_lora_rank)
      k.problem(fmt::format("attention.value_length is {}, expected kv_lora_rank = {}", val_len, hp.kv_lora_rank));
  } else {
    hp.legacy_kv_b = true;
    hp.qk_nope = k.u32("attention.key_length") - hp.qk_rope;
    hp.v_head = k.u32("attention.value_length");
  }
  if (hp.qk_nope > 0x7fffffffu) k.problem("key length is smaller than the rope dimension count");

  // RoPE
  hp.rope_theta = k.f32_or("rope.freq_base", 10000.0f);
  const std::string scaling = k.str_or("rope.scaling.type", "none");
  if (scaling == "yarn") hp.rope_scaling = RopeScaling::Yarn;
  else if (scaling == "linear") hp.rope_scaling = RopeScaling::Linear;
  else if (scaling != "none") k.problem(fmt::format("rope.scaling.type '{}' is not supported", scaling));
  if (hp.rope_scaling != RopeScaling::None) {
    hp.rope_factor = k.f32_or("rope.scaling.factor", 1.0f);
    hp.rope_orig_ctx = k.u32_or("rope.scaling.original_context_length", hp.n_ctx_train);
    hp.yarn_beta_fast = k.f32_or("rope.scaling.yarn_beta_fast", 32.0f);
    hp.yarn_beta_slow = k.f32_or("rope.scaling.yarn_beta_slow", 1.0f);
    hp.yarn_log_mul = k.f32_or("rope.scaling.yarn_log_multiplier", 0.1f);
  }

  // MoE
  hp.n_expert = k.u32_or("expert_count", 0);
  if (hp.n_expert > 0) {
    hp.n_expert_used = k.u32("expert_used_count");
    hp.n_expert_shared = k.u32_or("expert_shared_count", 0);
    hp.n_expert_groups = k.u32_or("expert_group_count", 1);
    hp.n_group_used = k.u32_or("expert_group_used_count", 1);
    hp.n_ff_exp = k.u32("expert_feed_forward_length");
    hp.expert_weights_scale = k.f32_or("expert_weights_scale", 1.0f);
    hp.expert_weights_norm = k.bool_or("expert_weights_norm", false);
    hp.expert_gating = k.u32_or("expert_gating_func", 2);
    if (hp.expert_gating != 1 && hp.expert_gating != 2)
      k.problem(fmt::format("expert_gating_func {} is not supported (1 softmax, 2 sigmoid)", hp.expert_gating));
    if (hp.n_expert_used == 0 || hp.n_expert_used > hp.n_expert)
      k.problem(fmt::format("expert_used_count {} is not in 1..expert_count {}", hp.n_expert_used, hp.n_expert));
    if (hp.n_expert_groups == 0 || hp.n_expert % hp.n_expert_groups != 0 || hp.n_group_used == 0 ||
        hp.n_group_used > hp.n_expert_groups)
      k.problem(fmt::format("expert groups {} / used {} do not divide {} experts", hp.n_expert_groups,
                            hp.n_group_used, hp.n_expert));
  }

  // DSA indexer
  if (hp.arch != Arch::DeepSeek2) {
    hp.idx_heads = k.u32("attention.indexer.head_count");
    hp.idx_dim = k.u32("attention.indexer.key_length");
    hp.idx_top_k = k.u32("attention.indexer.top_k");
    hp.idx_rope_interleaved = hp.arch == Arch::GlmDsa;
    if (hp.idx_dim != 0 && hp.idx_dim < hp.qk_rope)
      k.problem(fmt::format("indexer key_length {} is smaller than the rope dims {}", hp.idx_dim, hp.qk_rope));
    if (hp.idx_heads != 0 && hp.q_lora_rank == 0)
      k.problem("the indexer's queries read q_a's output, but attention.q_lora_rank is 0 (no q_a)");
    hp.idx_full.assign(hp.n_layer_total, true);
    if (const auto* types = k.array("attention.indexer.types")) {
      // Shorter than block_count is normal (next-n layers are not listed): the rest are full.
      if (types->items.size() < hp.n_layer_total)
        hp.defaulted.push_back(fmt::format("{}.attention.indexer.types[{}..{}] = full", hp.arch_name,
                                           types->items.size(), hp.n_layer_total - 1));
      for (size_t i = 0; i < types->items.size() && i < hp.n_layer_total; ++i) {
        const auto& v = types->items[i];
        if (v.type() == gguf::ValueType::BOOL) hp.idx_full[i] = v.as_bool();
        else if (v.type() == gguf::ValueType::STRING) hp.idx_full[i] = v.as_string() != "shared";
        else if (v.is_integer()) hp.idx_full[i] = v.as_i64() != 0;
        else k.problem("attention.indexer.types holds " + std::string(gguf::value_type_name(v.type())));
      }
      if (!hp.idx_full.empty() && !hp.idx_full[0])
        k.problem("attention.indexer.types: layer 0 is 'shared' but no earlier layer has an indexer");
    } else {
      hp.defaulted.push_back(hp.arch_name + ".attention.indexer.types = all full");
    }
  }

  if (hp.n_nextn > hp.n_layer_total)
    k.problem(fmt::format("nextn_predict_layers {} exceeds block_count {}", hp.n_nextn, hp.n_layer_total));
  hp.n_layer = hp.n_layer_total - std::min(hp.n_nextn, hp.n_layer_total);
  if (hp.n_leading_dense > hp.n_layer_total)
    k.problem(fmt::format("leading_dense_block_count {} exceeds block_count {}", hp.n_leading_dense,
                          hp.n_layer_total));
  if (hp.n_head_kv != 1) k.problem(fmt::format("attention.head_count_kv is {}, MLA files have 1", hp.n_head_kv));
  k.finish();
  return hp;
}

}  // namespace sparsemla::model
