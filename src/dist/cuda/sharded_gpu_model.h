// The GPU model split over N ranks by the tensor-parallel plan (dist/shard_plan.h): rank r holds its
// shard of the weights (bound and checked by dist::bind_shard, then uploaded) on its GPU, with its
// own replica of the KV cache, and the ranks sum their partial outputs through a Communicator on
// the device. The CPU's ShardedModel runs the same plan and is what this is compared with.
//
// Transports:
//   Nccl        one GPU per rank (devices[r]), NCCL collectives on each rank's stream. The normal one.
//   HostStaged  the collectives go through host memory and the in-process group: any number of
//               ranks on any devices, one GPU too (NCCL refuses two ranks on one GPU). Slow; for
//               checking the sharded GPU forward on a machine with fewer GPUs than ranks.
//
// Plain C++ (no CUDA headers); built only with CUDA (SPARSEMLA_HAVE_CUDA).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dist/shard_plan.h"
#include "kv/block_allocator.h"
#include "model/batch.h"
#include "model/cuda/gpu_model.h"

namespace sparsemla::model {
class Model;
}

namespace sparsemla::dist {

class Communicator;
class RankThreads;

// One GpuCache per rank, all indexed by the same block tables (every rank writes the same latent
// rows and index keys into its own). Blocks come from this allocator; the replicas' own free lists
// are never used.
class ShardedGpuCache : public kv::BlockAllocator {
 public:
  ShardedGpuCache(std::vector<model::GpuCache> replicas, int32_t block_size, int32_t n_blocks);
  int n_ranks() const { return int(replicas_.size()); }
  model::GpuCache& replica(int rank) { return replicas_[size_t(rank)]; }

 private:
  std::vector<model::GpuCache> replicas_;
};

enum class TpTransport { Nccl, HostStaged };

// One rank of a multi-process group (engine/remote_ranks.h), in this process: the rank's shard,
// bound and checked as ShardedGpuModel::load binds each, on GPU o.device. Its collectives are the
// caller's to set (GpuModel::set_collectives) once its communicator exists.
struct GpuRank {
  ShardPlan plan;
  model::ModelWeights views;  // the rank's views into `cpu`'s tensors
  std::unique_ptr<model::GpuModel> gpu;
};
std::unique_ptr<GpuRank> load_gpu_rank(const model::Model& cpu, int n_ranks, int rank, const model::GpuModelOptions& o);

// Collectives on device memory through host memory and `inner` (a host Communicator: the in-process
// group, or TCP between processes): each copies the data to the host, runs inner's collective and
// copies the result back, waiting for it (so it cannot be captured in a CUDA graph).
std::unique_ptr<Communicator> host_staged(Communicator& inner, cuda::Stream s);
// The collectives a GpuModel uses, through `comm` (which must outlive the model's use of them).
model::GpuCollectives collectives_of(Communicator& comm, bool capturable);

struct ShardedGpuOptions {
  model::GpuModelOptions gpu;   // per rank; gpu.device is ignored (devices below)
  std::vector<int> devices;     // [N] the GPU of each rank; empty: rank r on GPU r
  TpTransport transport = TpTransport::Nccl;
};

class ShardedGpuModel {
 public:
  // Plans `n_ranks` ranks for `cpu`, binds and checks each rank's shard, uploads it to its GPU and
  // joins the ranks' communicators. Throws Error when the model does not divide by n_ranks, when
  // there are fewer GPUs than ranks for NCCL (naming both), when NCCL is not built, or when a
  // rank's shard does not fit its GPU (GpuModel::load's message, with the rank).
  static std::unique_ptr<ShardedGpuModel> load(const model::Model& cpu, int n_ranks, const ShardedGpuOptions& opts);
  ~ShardedGpuModel();
  ShardedGpuModel(const ShardedGpuModel&) = delete;
  ShardedGpuModel& operator=(const ShardedGpuModel&) = delete;

  int n_ranks() const { return plan_.n_ranks(); }
  const ShardPlan& plan() const { return plan_; }
  const model::HParams& hparams() const;
  model::GpuModel& rank(int r);
  // One line per rank: its GPU and memory (GpuModel::memory_report), after the plan's summary.
  std::string memory_report() const;

  // A cache of n_blocks blocks on every rank (GpuModel::make_cache's checks on each).
  ShardedGpuCache make_cache(int32_t n_blocks, int32_t block_size = 16) const;

  // As GpuModel::forward: every rank runs the batch on its thread; logits rows ([n_vocab] each,
  // the ranks' vocabulary slices gathered) are appended in batch order. A rank that fails stops
  // the others (its error is thrown here, naming the rank).
  void forward(const std::vector<model::SeqInput>& batch, ShardedGpuCache& cache, std::vector<float>& logits);

  // As GpuModel::sample: the tokens sampled on the GPU, one per logits row (every rank draws the
  // same ids from the same gathered logits; rank 0's are appended to `ids`).
  void sample(const std::vector<model::SeqInput>& batch, ShardedGpuCache& cache,
              const std::vector<cuda::RowSampling>& params, std::vector<int32_t>& ids);

  // Microseconds one all-reduce of n fp32 values takes on the group (every rank at once, the mean
  // of `iters` back-to-back calls after a warm-up): the per-layer cost of tensor parallelism is two
  // of these at n = tokens x hidden size.
  double all_reduce_us(int64_t n, int iters = 200);

  struct Rank;
  struct Group;

 private:
  ShardedGpuModel() = default;
  Communicator* communicator(int rank);  // the rank's (NCCL, or host-staged)
  // fn(r) for every rank at once, on the rank's own thread; the first rank to fail stops the
  // others, and its error is thrown here.
  void on_ranks(const std::function<void(int)>& fn);
  // Checks the batch once, then fn(rank's model, its cache replica, `out` for rank 0 or a scratch
  // vector for the others) on every rank; `out` is left as it was when a rank fails.
  template <class T>
  void per_rank(const std::vector<model::SeqInput>& batch, ShardedGpuCache& cache, std::vector<T>& out,
                const std::function<void(model::GpuModel&, model::GpuCache&, std::vector<T>&)>& fn);
  ShardPlan plan_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::unique_ptr<Group> group_;
  std::unique_ptr<RankThreads> threads_;  // rank r's calls run on thread r, step after step
};

}  // namespace sparsemla::dist
