// The discrete choices of one forward pass, per layer and per token of the flattened batch: the
// positions each token's attention reads (sparse layers) and the experts it is routed to (MoE
// layers). A forward can record them, and the CPU forward can be made to follow recorded ones: two
// engines that make the same choices compute the same function and differ only by rounding. The
// GPU tests use this, because on small random models a bf16 rounding can flip a top-k choice and
// move a logit by far more than the rounding itself.
#pragma once
#include <cstdint>
#include <vector>

namespace sparsemla::model {

struct LayerDecisions {
  std::vector<std::vector<int32_t>> selected;  // [T][<= top_k] positions; empty on dense layers
  std::vector<std::vector<int32_t>> experts;   // [T][used] routed experts; empty on dense-MLP layers
  std::vector<std::vector<float>> weights;     // [T][used] their routing weights
};

struct Decisions {
  std::vector<LayerDecisions> layers;  // [n_layer]
};

}  // namespace sparsemla::model
