// Feed-forward blocks: the dense SwiGLU MLP and the routed mixture of experts with shared experts.
#pragma once
#include <cstdint>
#include <vector>

#include "model/hparams.h"
#include "model/weights.h"
#include "ops/cpu/thread_pool.h"

namespace sparsemla::model {

// out = down(silu(gate y) * up y)   y: [T, H]   out: [T, H]
void mlp_forward(const Weight& gate, const Weight& up, const Weight& down, const float* y, int64_t T, float* out,
                 ops::ThreadPool& pool);

struct Routing {
  std::vector<int32_t> experts;  // [used]
  std::vector<float> weights;    // [used]
};

// The router of one token: scores (sigmoid or softmax of the logits), the selection bias, group-
// limited choice, normalization and scaling.   logits: [E]   bias: [E]
Routing route(const HParams& hp, const float* logits, const float* bias);

// MoE layer: routed experts weighted by their routing, plus the shared experts.  y, out: [T, H]
void moe_forward(const FfnWeights& w, const HParams& hp, const float* y, int64_t T, float* out, ops::ThreadPool& pool);

}  // namespace sparsemla::model
