// The parts of the forward pass shared by the whole model (Model::forward) and by each rank of the
// tensor-parallel forward (dist::ShardedModel): the batch flattened into tokens, and the layer stack.
// The unsharded forward is the one-rank case: the same code, with nothing to sum across ranks.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "kv/paged_cache.h"
#include "model/arch/arch.h"
#include "model/batch.h"
#include "model/blocks/ffn.h"
#include "model/decisions.h"
#include "model/hparams.h"
#include "model/weights.h"
#include "ops/cpu/rope.h"
#include "ops/cpu/thread_pool.h"

namespace sparsemla::model {

enum class AttentionMode {
  Sparse,  // the model's own DSA top-k selection (default for glm-dsa and deepseek32)
  Dense,   // every earlier position: not what a DSA model was trained with
};

// A batch flattened into its new tokens, in batch order.
struct FlatBatch {
  std::vector<TokenRef> toks;                        // [T]
  std::vector<int32_t> ids;                          // [T] token ids
  std::vector<const std::vector<int32_t>*> tables;   // [n_seq] block tables
  std::vector<int64_t> out_rows;                     // indices into toks of the tokens whose logits are returned
};

// The paged cache the layer stack writes for a model: a latent row per layer and position, and an
// index key where the model has an indexer.
kv::CacheShape cache_shape_for(const HParams& hp, int32_t n_blocks, int32_t block_size);

// Checks every sequence (block table, tokens, ids < n_vocab) and flattens the batch; throws Error.
// `blocks` maps positions to slots: the CPU cache, or the GPU cache (the same slot numbering).
FlatBatch flatten_batch(const std::vector<SeqInput>& batch, const kv::BlockAllocator& blocks, uint32_t n_vocab);

// What the layer stack runs on: the whole model, or one rank's shard of it.
struct LayerStack {
  const HParams& hp;        // the model's hyperparameters
  const HParams& attn_hp;   // hp, but n_head = the heads `layers` hold (a rank's share under tensor parallelism)
  const ArchSpec& spec;
  const ops::Rope& rope;
  AttentionMode attention;
  const std::vector<LayerWeights>& layers;  // [>= hp.n_layer]
  ExpertRange experts;                      // the routed experts the MoE weights hold
  // Sums a rank's partial attention / FFN output over the ranks, in place: (data [n], n). Empty for
  // the whole model, whose outputs are already complete.
  std::function<void(float*, int64_t)> all_reduce;
  // Where the discrete choices of this forward are written (null: not recorded), and choices to
  // follow instead of the model's own (null: none). See model/decisions.h.
  Decisions* record = nullptr;
  const Decisions* force = nullptr;
};

// Runs the main layers over the hidden states, writing every new token's cache rows on the way.
//   h: [T, H], in place
void run_layers(const LayerStack& s, const FlatBatch& b, kv::PagedCache& cache, float* h, ops::ThreadPool& pool);

}  // namespace sparsemla::model
