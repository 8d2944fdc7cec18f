// Hyperparameters of the MLA model family, read from GGUF metadata with the defaults the published
// files rely on. One struct for glm-dsa, deepseek32 and deepseek2; fields that an arch lacks are 0.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace sparsemla::gguf {
class File;
}

namespace sparsemla::model {

enum class Arch { GlmDsa, DeepSeek32, DeepSeek2 };

// "glm-dsa" -> Arch::GlmDsa; false for archs this engine does not run.
bool arch_from_name(const std::string& name, Arch* out);
const char* arch_name(Arch a);

enum class RopeScaling { None, Linear, Yarn };

struct HParams {
  Arch arch = Arch::GlmDsa;
  std::string arch_name;

  // layers
  uint32_t n_layer_total = 0;   // block_count: main layers + next-n (MTP) layers
  uint32_t n_nextn = 0;         // nextn_predict_layers
  uint32_t n_layer = 0;         // main layers = n_layer_total - n_nextn
  uint32_t n_leading_dense = 0; // the first layers use a dense MLP instead of MoE

  uint32_t n_vocab = 0;
  uint32_t n_ctx_train = 0;
  uint32_t n_embd = 0;          // hidden size H
  uint32_t n_ff = 0;            // dense MLP width
  float rms_eps = 1e-6f;

  // MLA attention
  uint32_t n_head = 0;
  uint32_t n_head_kv = 1;
  uint32_t q_lora_rank = 0;     // 0: no low-rank q (attn_q instead of attn_q_a/attn_q_b)
  uint32_t kv_lora_rank = 0;    // latent width; the cache holds kv_lora_rank + qk_rope values per token
  uint32_t qk_nope = 0;         // per-head query/key dims without position
  uint32_t qk_rope = 0;         // per-head rotary dims (rope.dimension_count)
  uint32_t v_head = 0;          // per-head value dims
  bool legacy_kv_b = false;     // file predates key_length_mla: attn_kv_b, key_length = nope + rope

  // RoPE
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling = RopeScaling::None;
  float rope_factor = 1.0f;
  uint32_t rope_orig_ctx = 0;
  float yarn_beta_fast = 32.0f;
  float yarn_beta_slow = 1.0f;
  float yarn_log_mul = 0.0f;    // 0.1 * mscale_all_dim

  // MoE
  uint32_t n_expert = 0;
  uint32_t n_expert_used = 0;
  uint32_t n_expert_shared = 0;
  uint32_t n_expert_groups = 1;
  uint32_t n_group_used = 1;
  uint32_t n_ff_exp = 0;
  float expert_weights_scale = 1.0f;
  bool expert_weights_norm = false;
  uint32_t expert_gating = 2;   // 1 softmax, 2 sigmoid

  // DSA lightning indexer (glm-dsa, deepseek32)
  uint32_t idx_heads = 0;
  uint32_t idx_dim = 0;
  uint32_t idx_top_k = 0;
  bool idx_rope_interleaved = false;  // glm-dsa: interleaved pairs; deepseek32: half split
  std::vector<bool> idx_full;         // per layer (main + next-n): own indexer (true) or shared (false)

  // Keys that were absent and took a default, for `inspect`.
  std::vector<std::string> defaulted;

  bool has_indexer() const { return idx_heads > 0; }
  bool is_moe_layer(uint32_t il) const { return n_expert > 0 && il >= n_leading_dense; }
  // Attention logit scale: (nope + rope)^-0.5, times mscale^2 under YaRN.
  float softmax_scale() const;
  // YaRN magnitude correction 1 + yarn_log_mul * ln(factor); 1 without YaRN.
  float yarn_mscale() const;
};

// Reads the hyperparameters. Throws sparsemla::Error for an arch this engine does not run, or with
// the list of every required key that is missing or inconsistent.
HParams load_hparams(const gguf::File& f);

}  // namespace sparsemla::model
