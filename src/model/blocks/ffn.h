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

// The routed experts whose weights an FfnWeights holds: experts [first, first + count) are rows
// [0, count * F_e) of its gate_exps (a rank's share under expert parallelism). count < 0: all.
struct ExpertRange {
  int64_t first = 0;
  int64_t count = -1;
};

// MoE layer: routed experts weighted by their routing, plus the shared experts.  y, out: [T, H]
// The router always sees every expert; only the experts in `experts` are computed, so with a range
// `out` is that range's part of the sum (plus whatever shared-expert columns `w` holds).
// forced: [T] routing to follow instead of the router's; chosen: [T] receives the routing used
// (model/decisions.h). Either may be null.
void moe_forward(const FfnWeights& w, const HParams& hp, const float* y, int64_t T, float* out, ops::ThreadPool& pool,
                 ExpertRange experts = {}, const std::vector<Routing>* forced = nullptr,
                 std::vector<Routing>* chosen = nullptr);

}  // namespace sparsemla::model
