// Weights bound by name from a GGUF file: quantized matrices stay in the file's mapping (views),
// only 1-D norm vectors and biases are read into float vectors. Shapes are checked against the
// hyperparameters at load, and every missing or misshapen tensor is reported in one error.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/hparams.h"
#include "ops/cpu/matmul.h"

namespace sparsemla::gguf {
class File;
}

namespace sparsemla::model {

using ops::Weight;

struct MlaWeights {
  Weight q_a;        // {H, q_lora}             absent when q_lora_rank == 0
  Weight q_b;        // {q_lora, n_head*(nope+rope)}
  Weight q;          // {H, n_head*(nope+rope)} only when q_lora_rank == 0
  Weight kv_a_mqa;   // {H, kv_lora+rope}
  Weight k_b;        // {nope, kv_lora, n_head}: per head W_UK^T, rows of nope
  Weight v_b;        // {kv_lora, v_head, n_head}: per head W_UV, rows of kv_lora
  Weight kv_b;       // legacy {kv_lora, n_head*(nope+v)}: per head nope k-rows then v v-rows
  Weight output;     // {n_head*v_head, H}
  std::vector<float> q_a_norm;   // [q_lora]
  std::vector<float> kv_a_norm;  // [kv_lora]
  bool legacy_kv_b = false;
};

struct IndexerWeights {
  bool present = false;  // false on IndexShare "shared" layers
  Weight q_b;            // {q_lora, idx_heads*idx_dim}
  Weight k;              // {H, idx_dim}
  Weight proj;           // {H, idx_heads}
  std::vector<float> k_norm_w, k_norm_b;  // [idx_dim] LayerNorm
};

struct FfnWeights {
  bool moe = false;
  // dense MLP
  Weight gate, up, down;  // {H, F}, {H, F}, {F, H}
  // MoE
  Weight gate_inp;        // {H, E}
  std::vector<float> exp_probs_b;  // [E] selection bias (zeros when absent)
  Weight gate_exps, up_exps;       // {H, F_e, E}: expert e is rows [e*F_e, (e+1)*F_e)
  Weight down_exps;                // {F_e, H, E}: expert e is rows [e*H, (e+1)*H)
  Weight gate_shexp, up_shexp, down_shexp;  // shared expert(s), absent when n_expert_shared == 0
};

struct NextnWeights {  // MTP layer: loaded and validated, not used by the forward yet
  Weight eh_proj;      // {2H, H}
  std::vector<float> enorm, hnorm, shared_head_norm;
  Weight shared_head_head, embed_tokens;  // optional
};

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;  // [H]
  MlaWeights mla;
  IndexerWeights indexer;
  FfnWeights ffn;
  bool nextn = false;
  NextnWeights nextn_w;
};

struct ModelWeights {
  Weight token_embd;  // {H, V}
  Weight output;      // {H, V}; token_embd when the file ties them
  std::vector<float> output_norm;
  std::vector<LayerWeights> layers;  // main layers, then next-n layers
};

ModelWeights bind_weights(const gguf::File& f, const HParams& hp);

}  // namespace sparsemla::model
