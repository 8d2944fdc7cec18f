// The CPU forward split over N ranks (tensor parallelism, as planned in shard_plan.h): each rank
// runs on its own thread with its own shard of the weights and its own replica of the paged KV
// cache, and talks to the others only through a Communicator. It computes what
// model::Model::forward computes, up to the order of the sums across ranks, and is the check path
// for the multi-GPU forward, which will run the same plan over NCCL.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "dist/communicator.h"
#include "dist/shard_plan.h"
#include "kv/paged_cache.h"
#include "model/batch.h"
#include "model/model.h"

namespace sparsemla::dist {

// One replica of the paged KV cache per rank, all indexed by the same block tables: every rank
// writes the same latent rows and indexer keys into its own copy. Blocks are allocated from
// replica 0's free list; the other replicas' are never used.
class ReplicatedCache {
 public:
  ReplicatedCache(const kv::CacheShape& shape, int n_ranks);
  int n_ranks() const { return int(replicas_.size()); }
  bool reserve(std::vector<int32_t>& block_table, int64_t n_tokens) { return replicas_[0].reserve(block_table, n_tokens); }
  void release(std::vector<int32_t>& block_table) { replicas_[0].release(block_table); }
  kv::PagedCache& replica(int rank) { return replicas_[size_t(rank)]; }

 private:
  std::vector<kv::PagedCache> replicas_;
};

class ShardedModel {
 public:
  // Plans `n_ranks` ranks for `model` and binds each rank's shard (views into its file); `threads`
  // CPU threads in all (0: one per hardware thread), split between the ranks. `model` must outlive
  // this. Throws Error when the model does not divide by n_ranks.
  // only_rank >= 0: this process runs that one rank of a multi-process group (forward_rank), with
  // all `threads`; the other ranks' shards are not bound.
  ShardedModel(const model::Model& model, int n_ranks, int threads = 0, int only_rank = -1);
  ~ShardedModel();

  int n_ranks() const { return plan_.n_ranks(); }
  const ShardPlan& plan() const { return plan_; }
  // Replicas for `n_blocks` blocks of `block_size` tokens.
  ReplicatedCache make_cache(int32_t n_blocks, int32_t block_size = 16) const;

  // As model::Model::forward: writes the new tokens' cache rows on every replica and appends their
  // logits rows ([n_vocab] each) in batch order.
  void forward(const std::vector<model::SeqInput>& batch, ReplicatedCache& cache, std::vector<float>& logits);

  // One rank's part of forward() in a multi-process group: `comm` reaches the other processes'
  // ranks (comm.rank() is only_rank), `cache` is this rank's replica. Rank 0 appends the logits
  // rows to `logits`; the other ranks leave it as it was.
  void forward_rank(Communicator& comm, const std::vector<model::SeqInput>& batch, kv::PagedCache& cache,
                    std::vector<float>& logits);

 private:
  struct Rank;
  std::vector<int> local_ranks() const;  // the ranks this process holds
  // One rank's forward. logits: [n_out_rows, n_vocab], written by the rank that is given it.
  void rank_forward(Communicator& comm, const model::FlatBatch& b, kv::PagedCache& cache, float* logits);

  const model::Model& model_;
  ShardPlan plan_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<RankThreads> threads_;  // forward(): rank r on thread r, call after call
};

}  // namespace sparsemla::dist
