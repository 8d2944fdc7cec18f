// What one forward call computes: several sequences, each a run of new tokens at its own positions
// (a prefill chunk, or one decode token), over the paged KV cache.
#pragma once
#include <cstdint>
#include <vector>

namespace sparsemla::model {

struct SeqInput {
  std::vector<int32_t> tokens;                   // the new tokens
  int64_t pos0 = 0;                              // position of tokens[0]; the cache holds [0, pos0)
  const std::vector<int32_t>* block_table = nullptr;  // covers pos0 + tokens.size() positions
  bool all_logits = false;                       // logits for every new token, or only the last
};

// One new token of the flattened batch.
struct TokenRef {
  int32_t seq = 0;   // index into the batch
  int64_t pos = 0;   // absolute position in its sequence
  int64_t slot = 0;  // physical cache slot of this position
};

}  // namespace sparsemla::model
