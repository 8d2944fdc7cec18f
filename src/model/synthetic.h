// Random-weight models of any size in llama.cpp's GGUF layout, written with the project's writer:
// for benchmarks (a GLM-5-width layer stack) and for tests that need shapes the fixtures lack.
#pragma once
#include <cstdint>
#include <string>

#include "gguf/ggml_types.h"
#include "model/hparams.h"

namespace sparsemla::model {

struct SyntheticSpec {
  Arch arch = Arch::GlmDsa;
  uint32_t n_layer = 4;          // main layers
  uint32_t n_nextn = 0;
  uint32_t n_leading_dense = 1;
  uint32_t n_vocab = 4096;
  uint32_t n_embd = 512;
  uint32_t n_ff = 1536;
  uint32_t n_head = 8;
  uint32_t q_lora = 256, kv_lora = 128, qk_nope = 64, qk_rope = 32, v_head = 64;
  uint32_t n_expert = 16, n_expert_used = 4, n_expert_shared = 1, n_ff_exp = 256;
  uint32_t n_expert_groups = 1, n_group_used = 1;
  uint32_t idx_heads = 8, idx_dim = 64, idx_top_k = 64;
  uint32_t n_ctx = 4096;
  float rope_theta = 1e6f;
  // Every 2-D+ weight but the router and norms (Q8_0 where rows are not whole blocks of it).
  gguf::GgmlType matrix_type = gguf::GgmlType::Q8_0;
  // Q4_K_M's mix instead of matrix_type: Q6_K for ffn_down / ffn_down_exps / attn_v_b / output, Q4_K
  // elsewhere, Q8_0 where rows are not whole 256-value blocks (as llama.cpp falls back).
  bool q4_k_m = false;
  // Matrices written as zero bytes (sparse holes: instant, no memory) instead of random values, for
  // timing GLM-5-width layers. The embedding table (Q4_K, Q6_K or Q8_0) gets random blocks instead,
  // and norms, biases and the router stay random, so that tokens are routed to different experts.
  bool zero_matrices = false;
  uint32_t seed = 1;

  // GLM-5's real widths (MODEL_SPEC.md) with `layers` main layers, the first dense.
  static SyntheticSpec glm5_width(uint32_t layers);
  // A small GLM-5-shaped model for CPU benchmarks.
  static SyntheticSpec glm5_small();
};

// Writes the model; weights ~ N(0, 1/sqrt(fan_in)) so activations stay O(1) through the layers.
void write_synthetic_model(const SyntheticSpec& spec, const std::string& path);

}  // namespace sparsemla::model
