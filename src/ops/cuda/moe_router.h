// The MoE router on the GPU, for T tokens at once, and the grouping of the routed (token, slot)
// pairs by expert that grouped expert GEMMs read. Plain C++ (no CUDA headers): every pointer is a
// device pointer; every call is asynchronous on stream `s` and never waits for the device.
#pragma once
#include <cstddef>
#include <cstdint>

#include "model/hparams.h"
#include "ops/cuda/buffer.h"

namespace sparsemla::cuda {

// model::route() for each token: scores (sigmoid or softmax of the logits, per hp.expert_gating),
// the selection bias added for the choice only, group-limited choice (the hp.n_group_used groups
// with the best group scores: the sum of the two best biased scores for sigmoid routers, the best
// one for softmax routers), the hp.n_expert_used experts with the best biased scores (ties: the
// lower id), and their unbiased scores, normalized if hp.expert_weights_norm, times
// hp.expert_weights_scale. The CPU's experts in the CPU's order with its weights, but for one ulp
// of a score where glibc's expf rounds differently (about 1 value in 1600).
//   logits: [T, E] fp32   bias: [E] fp32 (may be null: no bias)   ids: [T, k] int32   weights: [T, k] fp32
void moe_route(const model::HParams& hp, const float* logits, const float* bias, int64_t T, int32_t* ids,
               float* weights, Stream s);

// Bytes of device scratch that moe_group needs for n = T * k routed pairs over E experts.
size_t moe_group_workspace_bytes(int64_t n, int64_t E);

// Groups the routed pairs by expert: entry j = t * k + slot of `ids` ([T, k], flattened to [n]).
//   counts[e]  = pairs routed to expert e                                   [E]
//   offsets[e] = sum of counts before e; offsets[E] = pairs in all          [E + 1]
//   perm[offsets[e] ..] = the entries j routed to e, ascending (token order) [n]
// Ids outside [0, E) are left out of all three.
// With `active` (and n_active) also, for cuda::matmul_expert_groups:
//   active[0 .. *n_active) = the experts with pairs, ascending                  [E]
//   perm[offsets[E] .. n)  = -1 (the entries left out)
void moe_group(const int32_t* ids, int64_t n, int64_t E, int32_t* counts, int32_t* offsets, int32_t* perm,
               void* workspace, Stream s, int32_t* active = nullptr, int32_t* n_active = nullptr);

}  // namespace sparsemla::cuda
