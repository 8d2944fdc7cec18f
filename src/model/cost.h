// What one token costs: the weight bytes a batch-1 decode step must read and the matrix FLOPs,
// the numbers tokens/s is compared with.
#pragma once
#include <cstdint>

namespace sparsemla::gguf {
class File;
}

namespace sparsemla::model {
struct HParams;

struct TokenCost {
  uint64_t weight_bytes = 0;  // bytes of weights read per decode token (routed experts: the used ones)
  uint64_t flops = 0;         // 2 x multiply-adds of the matrix products per token (attention excluded)
};

// Main layers only (the next-n layers are not run); the token embedding counts one row.
TokenCost token_cost(const gguf::File& f, const HParams& hp);

}  // namespace sparsemla::model
