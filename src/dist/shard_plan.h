// Tensor-parallel sharding plan: for N ranks, which rows or columns of every matrix each rank holds.
//
//   attention   attn_q_b / attn_q rows, attn_k_b, attn_v_b (and legacy attn_kv_b) rows by head;
//               attn_output by input columns (the rank's heads' v rows), then all-reduce.
//               q_a, kv_a_mqa, the latent KV cache and the whole indexer are replicated: every
//               rank computes the same top-k selection.
//   dense FFN   gate / up by output rows, down by input columns, then all-reduce.
//   MoE         expert parallel: rank r owns experts [r E/N, (r+1) E/N) and computes their weighted
//               outputs for the tokens routed to them, then all-reduce; the router is replicated.
//               The shared expert is split like a dense FFN.
//   vocabulary  token_embd and output rows by token: each rank embeds (and scores) its slice;
//               embeddings are all-reduced (other ranks add zeros), logits all-gathered.
//
// Heads, experts and vocabulary rows must divide by N. Column splits must fall on quantization
// block boundaries: attn_output's is fixed by the heads and refused otherwise; an FFN's is cut in
// whole blocks of its down matrix's type (8 columns at least, for the GPU kernels), evenly when F / N is a whole number of blocks (every
// published model), otherwise as evenly as the blocks allow (a small model's ranks may then hold
// no columns of it: they add zeros). Every rank computes exactly what the whole model computes,
// only the order of the final sums across ranks changes.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "model/hparams.h"

namespace sparsemla::gguf {
class File;
}

namespace sparsemla::dist {

// Part of a matrix: rows [row0, row0 + n_rows) and columns [col0, col0 + n_cols) of its 2-D view
// (columns are ne0, the input dimension).
struct Slice {
  int64_t row0 = 0, n_rows = 0;
  int64_t col0 = 0, n_cols = 0;
};

enum class SplitAxis { Replicated, Rows, Cols };

// How one matrix is divided between the ranks.
struct TensorSplit {
  std::string name;                 // GGUF tensor name: "blk.3.attn_k_b.weight"
  gguf::GgmlType type = gguf::GgmlType::F32;
  int64_t rows = 0, cols = 0;       // the whole matrix as a 2-D view: {ne0 = cols, ne1 * ne2 = rows}
  SplitAxis axis = SplitAxis::Replicated;
  std::vector<int64_t> bounds;      // [N + 1]: rank r holds [bounds[r], bounds[r + 1]) along `axis`
  std::string unit;                 // what the axis is cut into: "head", "expert", "token", "column"
  int64_t unit_size = 1;            // rows (or columns) per unit

  Slice slice(int rank) const;
  // "rows [24, 48) (head 1)" for messages.
  std::string describe(const Slice& s) const;
};

// The type of each tensor of a model, or nullopt where the file has no such tensor.
using TensorTypes = std::function<std::optional<gguf::GgmlType>(const std::string& name)>;
// Types as a file holds them.
TensorTypes types_of(const gguf::File& f);

class ShardPlan {
 public:
  // Plans N ranks for a model. Without `types` every matrix is taken to be F32 and present (for
  // planning from hyperparameters alone). Throws Error naming the number that does not divide.
  static ShardPlan make(const model::HParams& hp, int n_ranks, const TensorTypes& types = {});

  int n_ranks() const { return n_ranks_; }
  int64_t heads_per_rank() const { return heads_; }
  int64_t experts_per_rank() const { return experts_; }
  int64_t vocab_per_rank() const { return vocab_; }
  // Every planned matrix: token_embd, output, then the main layers' (next-n layers are not run).
  const std::vector<TensorSplit>& tensors() const { return tensors_; }
  // The split of a tensor, or null when the plan has none.
  const TensorSplit* find(const std::string& name) const;
  // One paragraph for logs: ranks, heads, experts, vocabulary and FFN columns per rank.
  std::string summary() const;

 private:
  int n_ranks_ = 1;
  int64_t heads_ = 0, experts_ = 0, vocab_ = 0;
  std::vector<TensorSplit> tensors_;
};

}  // namespace sparsemla::dist
