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

// Consecutive sequences of a batch whose runs of new tokens are all at least `min_run` long (prefill
// chunks) or all shorter (decode tokens): [begin, end) of the flattened batch (sequences in batch
// order), and its tokens per sequence on average. The GPU indexer scores each segment in a call of
// its own, so that a prefill chunk and the decode tokens served beside it each take the kernel that
// suits them (cuda::IndexerArgs::tokens_per_run).
struct RunSegment {
  int64_t begin = 0, end = 0, tokens_per_run = 1;
};
inline std::vector<RunSegment> run_segments(const std::vector<SeqInput>& batch, int64_t min_run) {
  std::vector<RunSegment> out;
  int64_t at = 0, runs = 0;
  bool long_runs = false;
  for (const SeqInput& in : batch) {
    const int64_t n = int64_t(in.tokens.size());
    const bool is_long = n >= min_run;
    if (out.empty() || is_long != long_runs) {
      out.push_back({at, at, 1});
      runs = 0;
      long_runs = is_long;
    }
    at += n;
    out.back().end = at;
    out.back().tokens_per_run = (at - out.back().begin) / ++runs;
  }
  return out;
}

// One new token of the flattened batch.
struct TokenRef {
  int32_t seq = 0;   // index into the batch
  int64_t pos = 0;   // absolute position in its sequence
  int64_t slot = 0;  // physical cache slot of this position
};

}  // namespace sparsemla::model
