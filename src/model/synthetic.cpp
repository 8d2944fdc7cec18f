#include "model/synthetic.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <random>

#include "gguf/ggml_types.h"
#include "gguf/writer.h"
#include "util/error.h"
#include "util/half.h"

namespace sparsemla::model {

namespace {

// Random blocks of a Q4_K, Q6_K or Q8_0 tensor without quantizing anything: random bytes, then each
// block's fp16 scale(s) set to 0.01 (every other byte pattern is a valid block). Values of a few
// hundredths, different in every row; fast enough for a GLM-5-sized embedding table.
std::vector<uint8_t> random_blocks(gguf::GgmlType t, int64_t n_values, std::mt19937& rng) {
  const auto& tr = gguf::traits(t);
  std::vector<uint8_t> bytes(size_t(n_values / tr.block_size) * tr.type_size);
  for (size_t i = 0; i + 4 <= bytes.size(); i += 4) {
    const uint32_t v = rng();
    std::memcpy(&bytes[i], &v, 4);
  }
  const uint16_t small = f32_to_fp16(0.01f);
  for (size_t at = 0; at < bytes.size(); at += tr.type_size) {
    if (t == gguf::GgmlType::Q4_K) {  // d, dmin
      std::memcpy(&bytes[at], &small, 2);
      std::memcpy(&bytes[at + 2], &small, 2);
    } else if (t == gguf::GgmlType::Q6_K) {  // d, after ql, qh and the scales
      std::memcpy(&bytes[at + 208], &small, 2);
    } else {  // Q8_0: d
      std::memcpy(&bytes[at], &small, 2);
    }
  }
  return bytes;
}

}  // namespace

SyntheticSpec SyntheticSpec::glm5_width(uint32_t layers) {
  SyntheticSpec s;
  s.n_layer = layers;
  s.n_leading_dense = 1;
  s.n_vocab = 154880;
  s.n_embd = 6144;
  s.n_ff = 12288;
  s.n_head = 64;
  s.q_lora = 2048;
  s.kv_lora = 512;
  s.qk_nope = 192;
  s.qk_rope = 64;
  s.v_head = 256;
  s.n_expert = 256;
  s.n_expert_used = 8;
  s.n_expert_shared = 1;
  s.n_ff_exp = 2048;
  s.idx_heads = 32;
  s.idx_dim = 128;
  s.idx_top_k = 2048;
  s.n_ctx = 202752;
  return s;
}

SyntheticSpec SyntheticSpec::glm5_small() { return SyntheticSpec{}; }

void write_synthetic_model(const SyntheticSpec& s, const std::string& path) {
  if (s.arch == Arch::DeepSeek2) fail("synthetic models: only the DSA archs (glm-dsa, deepseek32) are generated");
  const std::string a = arch_name(s.arch);
  gguf::Writer w;
  auto key = [&](const std::string& k) { return a + "." + k; };
  w.set("general.architecture", gguf::Value::string(a));
  w.set("general.name", gguf::Value::string(fmt::format("synthetic {} {} layers", a, s.n_layer)));
  w.set(key("block_count"), gguf::Value::u32(s.n_layer + s.n_nextn));
  w.set(key("nextn_predict_layers"), gguf::Value::u32(s.n_nextn));
  w.set(key("context_length"), gguf::Value::u32(s.n_ctx));
  w.set(key("embedding_length"), gguf::Value::u32(s.n_embd));
  w.set(key("feed_forward_length"), gguf::Value::u32(s.n_ff));
  w.set(key("attention.head_count"), gguf::Value::u32(s.n_head));
  w.set(key("attention.head_count_kv"), gguf::Value::u32(1));
  w.set(key("rope.freq_base"), gguf::Value::f32(s.rope_theta));
  w.set(key("attention.layer_norm_rms_epsilon"), gguf::Value::f32(1e-5f));
  w.set(key("expert_count"), gguf::Value::u32(s.n_expert));
  w.set(key("expert_used_count"), gguf::Value::u32(s.n_expert_used));
  w.set(key("expert_group_count"), gguf::Value::u32(s.n_expert_groups));
  w.set(key("expert_group_used_count"), gguf::Value::u32(s.n_group_used));
  w.set(key("expert_gating_func"), gguf::Value::u32(2));
  w.set(key("attention.key_length"), gguf::Value::u32(s.kv_lora + s.qk_rope));
  w.set(key("attention.value_length"), gguf::Value::u32(s.kv_lora));
  w.set(key("leading_dense_block_count"), gguf::Value::u32(s.n_leading_dense));
  w.set(key("vocab_size"), gguf::Value::u32(s.n_vocab));
  w.set(key("attention.q_lora_rank"), gguf::Value::u32(s.q_lora));
  w.set(key("attention.kv_lora_rank"), gguf::Value::u32(s.kv_lora));
  w.set(key("attention.key_length_mla"), gguf::Value::u32(s.qk_nope + s.qk_rope));
  w.set(key("attention.value_length_mla"), gguf::Value::u32(s.v_head));
  w.set(key("expert_feed_forward_length"), gguf::Value::u32(s.n_ff_exp));
  w.set(key("expert_shared_count"), gguf::Value::u32(s.n_expert_shared));
  w.set(key("expert_weights_scale"), gguf::Value::f32(2.5f));
  w.set(key("expert_weights_norm"), gguf::Value::boolean(true));
  w.set(key("rope.dimension_count"), gguf::Value::u32(s.qk_rope));
  w.set(key("attention.indexer.head_count"), gguf::Value::u32(s.idx_heads));
  w.set(key("attention.indexer.key_length"), gguf::Value::u32(s.idx_dim));
  w.set(key("attention.indexer.top_k"), gguf::Value::u32(s.idx_top_k));

  std::mt19937 rng(s.seed);
  auto tensor = [&](const std::string& name, std::vector<int64_t> ne, gguf::GgmlType type, float sd, float mean = 0) {
    int64_t n = 1;
    for (int64_t d : ne) n *= d;
    std::normal_distribution<float> nd(mean, sd);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = nd(rng);
    w.add_tensor(name, type, ne, v);
  };
  const auto F32 = gguf::GgmlType::F32;
  auto type_of = [&](const std::string& name, int64_t ne0) {
    // Rows that are not whole blocks of the type (GLM-5's 192-wide attn_k_b under a K-quant) fall
    // back to Q8_0, as llama.cpp's quantizer falls back.
    if (!s.q4_k_m) return ne0 % gguf::traits(s.matrix_type).block_size == 0 ? s.matrix_type : gguf::GgmlType::Q8_0;
    if (ne0 % 256 != 0) return gguf::GgmlType::Q8_0;
    const bool high = name.find("ffn_down") != std::string::npos || name.find("attn_v_b") != std::string::npos ||
                      name == "output.weight";
    return high ? gguf::GgmlType::Q6_K : gguf::GgmlType::Q4_K;
  };
  auto mat = [&](const std::string& name, int64_t in, std::vector<int64_t> ne) {
    const gguf::GgmlType t = type_of(name, ne[0]);
    const bool quick_random = t == gguf::GgmlType::Q4_K || t == gguf::GgmlType::Q6_K || t == gguf::GgmlType::Q8_0;
    if (s.zero_matrices && name == "token_embd.weight") {
      // Zero embeddings would make every hidden state zero, so every token would go to the experts
      // the router's bias prefers: random rows give each token its own routing, as a real model does
      // (as Q8_0 where the type has no random blocks here: the lookup's cost is not what is timed).
      const gguf::GgmlType et = quick_random ? t : gguf::GgmlType::Q8_0;
      w.add_tensor_bytes(name, et, ne, random_blocks(et, ne[0] * ne[1], rng));
    } else if (s.zero_matrices)
      w.add_tensor_zeros(name, t, ne);
    else
      tensor(name, std::move(ne), t, 1.0f / std::sqrt(float(in)));
  };
  auto norm = [&](const std::string& name, int64_t n) { tensor(name, {n}, F32, 0.05f, 1.0f); };
  const int64_t H = s.n_embd, V = s.n_vocab;
  mat("token_embd.weight", 1, {H, V});
  norm("output_norm.weight", H);
  mat("output.weight", H, {H, V});
  for (uint32_t il = 0; il < s.n_layer + s.n_nextn; ++il) {
    auto n = [il](const char* t) { return fmt::format("blk.{}.{}", il, t); };
    norm(n("attn_norm.weight"), H);
    norm(n("ffn_norm.weight"), H);
    mat(n("attn_q_a.weight"), H, {H, s.q_lora});
    norm(n("attn_q_a_norm.weight"), s.q_lora);
    mat(n("attn_q_b.weight"), s.q_lora, {s.q_lora, int64_t(s.n_head) * (s.qk_nope + s.qk_rope)});
    mat(n("attn_kv_a_mqa.weight"), H, {H, s.kv_lora + s.qk_rope});
    norm(n("attn_kv_a_norm.weight"), s.kv_lora);
    mat(n("attn_k_b.weight"), s.qk_nope, {s.qk_nope, s.kv_lora, s.n_head});
    mat(n("attn_v_b.weight"), s.kv_lora, {s.kv_lora, s.v_head, s.n_head});
    mat(n("attn_output.weight"), int64_t(s.n_head) * s.v_head, {int64_t(s.n_head) * s.v_head, H});
    mat(n("indexer.attn_q_b.weight"), s.q_lora, {s.q_lora, int64_t(s.idx_heads) * s.idx_dim});
    mat(n("indexer.attn_k.weight"), H, {H, s.idx_dim});
    tensor(n("indexer.proj.weight"), {H, s.idx_heads}, F32, 1.0f / std::sqrt(float(H)));
    norm(n("indexer.k_norm.weight"), s.idx_dim);
    tensor(n("indexer.k_norm.bias"), {s.idx_dim}, F32, 0.02f);
    if (il < s.n_leading_dense) {
      mat(n("ffn_gate.weight"), H, {H, s.n_ff});
      mat(n("ffn_up.weight"), H, {H, s.n_ff});
      mat(n("ffn_down.weight"), s.n_ff, {s.n_ff, H});
    } else {
      tensor(n("ffn_gate_inp.weight"), {H, s.n_expert}, F32, 1.0f / std::sqrt(float(H)));
      tensor(n("exp_probs_b.bias"), {s.n_expert}, F32, 0.01f);
      mat(n("ffn_gate_exps.weight"), H, {H, s.n_ff_exp, s.n_expert});
      mat(n("ffn_up_exps.weight"), H, {H, s.n_ff_exp, s.n_expert});
      mat(n("ffn_down_exps.weight"), s.n_ff_exp, {s.n_ff_exp, H, s.n_expert});
      const int64_t Fs = int64_t(s.n_ff_exp) * s.n_expert_shared;
      mat(n("ffn_gate_shexp.weight"), H, {H, Fs});
      mat(n("ffn_up_shexp.weight"), H, {H, Fs});
      mat(n("ffn_down_shexp.weight"), Fs, {Fs, H});
    }
    if (il >= s.n_layer) {
      mat(n("nextn.eh_proj.weight"), 2 * H, {2 * H, H});
      norm(n("nextn.enorm.weight"), H);
      norm(n("nextn.hnorm.weight"), H);
      norm(n("nextn.shared_head_norm.weight"), H);
    }
  }
  w.write(path);
}

}  // namespace sparsemla::model
