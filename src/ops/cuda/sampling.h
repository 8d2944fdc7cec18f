// Sampling on the GPU: one token per row of logits, each row with its own parameters, following
// engine/sampler.cpp's filters (temperature, min-p, top-k, top-p; see engine::filter_candidates)
// with the same tie rules. Penalties (repetition, frequency, presence) stay on the CPU for now: a
// row that needs them is penalized before its logits reach these functions.
//
// The random number of a draw is Philox-4x32-10 keyed by the row's seed at counter `step`, so a
// seeded row draws the same token whatever its neighbours in the batch, and on every run (every
// sum is taken in a fixed order). Draws differ from the CPU sampler's (another generator); the
// distribution they follow is the same. Plain C++ (no CUDA headers): every pointer is a device
// pointer; every call is asynchronous on stream `s`.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ops/cuda/buffer.h"

namespace sparsemla::cuda {

// One row's parameters, as engine::SamplingParams has them, plus the row's draw counter.
struct RowSampling {
  float temperature = 1.0f;  // <= 0: greedy (argmax, lowest id on ties), as is top_k == 1
  float top_p = 1.0f;        // (0, 1]; 1: off
  int32_t top_k = 0;         // <= 0: off
  float min_p = 0.0f;        // [0, 1]; 0: off
  uint64_t seed = 0;
  uint64_t step = 0;         // the request's draw number: advance it by one per sampled token
};

// Bytes of device scratch that sample() and sampling_probs() need for B rows of V logits.
size_t sampling_workspace_bytes(int64_t B, int64_t V);

// One token per row.   logits: [B, V] fp32   params: [B]   ids: [B] int32
void sample(const float* logits, int64_t B, int64_t V, const RowSampling* params, void* workspace, int32_t* ids,
            Stream s);

// The distribution sample() draws from, per row: the probabilities at the temperature of the tokens
// that survive the filters, normalized, 0 for the others; greedy rows get a one-hot on their token.
// For tests, and for speculative decoding's acceptance test.   logits: [B, V]   probs: [B, V] fp32
void sampling_probs(const float* logits, int64_t B, int64_t V, const RowSampling* params, void* workspace,
                    float* probs, Stream s);

}  // namespace sparsemla::cuda
