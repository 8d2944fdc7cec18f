#include "dist/sharded_model.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <thread>

#include "dist/rank_threads.h"
#include "dist/shard_weights.h"
#include "model/forward.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/matmul.h"
#include "ops/cpu/thread_pool.h"
#include "util/error.h"

namespace sparsemla::dist {

ReplicatedCache::ReplicatedCache(const kv::CacheShape& shape, int n_ranks) {
  if (n_ranks < 1) fail("a replicated KV cache needs at least one rank, got {}", n_ranks);
  for (int r = 0; r < n_ranks; ++r) replicas_.emplace_back(shape);
}

struct ShardedModel::Rank {
  model::ModelWeights w;         // this rank's views (shard_weights.h)
  model::HParams attn_hp;        // the model's, with n_head = this rank's heads
  model::ExpertRange experts;    // the routed experts this rank computes
  std::unique_ptr<ops::ThreadPool> pool;
};

ShardedModel::ShardedModel(const model::Model& model, int n_ranks, int threads, int only_rank)
    : model_(model), plan_(ShardPlan::make(model.hparams(), n_ranks, types_of(model.file()))) {
  const model::HParams& hp = model.hparams();
  if (only_rank >= n_ranks) fail("tensor parallel: rank {} of a group of {}", only_rank, n_ranks);
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  const int local = only_rank >= 0 ? 1 : n_ranks;
  for (int r = 0; r < n_ranks; ++r) {
    if (only_rank >= 0 && r != only_rank) {
      ranks_.push_back(nullptr);
      continue;
    }
    auto rank = std::make_unique<Rank>();
    rank->w = bind_shard(model.weights(), hp, plan_, r);
    rank->attn_hp = hp;
    rank->attn_hp.n_head = uint32_t(plan_.heads_per_rank());
    rank->experts = {r * plan_.experts_per_rank(), plan_.experts_per_rank()};
    rank->pool = std::make_unique<ops::ThreadPool>(std::max(1, threads / local));
    ranks_.push_back(std::move(rank));
  }
  if (only_rank < 0) threads_ = std::make_unique<RankThreads>(n_ranks);
}

ShardedModel::~ShardedModel() = default;

ReplicatedCache ShardedModel::make_cache(int32_t n_blocks, int32_t block_size) const {
  return ReplicatedCache(model_.cache_shape(n_blocks, block_size), n_ranks());
}

void ShardedModel::forward(const std::vector<model::SeqInput>& batch, ReplicatedCache& cache,
                           std::vector<float>& logits) {
  if (cache.n_ranks() != n_ranks())
    fail("tensor parallel: a cache of {} replicas for {} ranks", cache.n_ranks(), n_ranks());
  if (local_ranks().size() != ranks_.size())
    fail("tensor parallel: this process holds rank {} of {} only: forward_rank() runs it", fmt::join(local_ranks(), ", "),
         n_ranks());
  const model::FlatBatch b = model::flatten_batch(batch, cache.replica(0), model_.hparams().n_vocab);
  const size_t base = logits.size();
  logits.resize(base + b.out_rows.size() * model_.hparams().n_vocab);
  InProcessGroup group(n_ranks());
  try {
    group.run(
        [&](Communicator& comm) {
          rank_forward(comm, b, cache.replica(comm.rank()), comm.rank() == 0 ? logits.data() + base : nullptr);
        },
        threads_.get());
  } catch (...) {
    logits.resize(base);
    throw;
  }
}

void ShardedModel::forward_rank(Communicator& comm, const std::vector<model::SeqInput>& batch, kv::PagedCache& cache,
                                std::vector<float>& logits) {
  if (comm.size() != n_ranks() || comm.rank() < 0 || comm.rank() >= n_ranks() || !ranks_[size_t(comm.rank())])
    fail("tensor parallel: rank {} of {} asked to run, but this process holds {}", comm.rank(), comm.size(),
         fmt::join(local_ranks(), ", "));
  const model::FlatBatch b = model::flatten_batch(batch, cache, model_.hparams().n_vocab);
  const size_t base = logits.size();
  if (comm.rank() == 0) logits.resize(base + b.out_rows.size() * model_.hparams().n_vocab);
  try {
    rank_forward(comm, b, cache, comm.rank() == 0 ? logits.data() + base : nullptr);
  } catch (...) {
    logits.resize(base);
    throw;
  }
}

std::vector<int> ShardedModel::local_ranks() const {
  std::vector<int> out;
  for (size_t r = 0; r < ranks_.size(); ++r)
    if (ranks_[r]) out.push_back(int(r));
  return out;
}

void ShardedModel::rank_forward(Communicator& comm, const model::FlatBatch& b, kv::PagedCache& cache, float* logits) {
  Rank& rank = *ranks_[size_t(comm.rank())];
  const model::HParams& hp = model_.hparams();
  const int64_t H = hp.n_embd, T = int64_t(b.toks.size()), N = comm.size();
  const int64_t Vr = plan_.vocab_per_rank(), v0 = comm.rank() * Vr;

  // Embeddings: the rank holding a token's row writes it, the others add zeros.   h: [T, H]
  std::vector<float> h(size_t(T * H), 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = b.ids[size_t(t)];
    if (id >= v0 && id < v0 + Vr) ops::dequantize_row(rank.w.token_embd, id - v0, h.data() + t * H);
  }
  comm.all_reduce_sum(h.data(), T * H);

  model::run_layers(model::LayerStack{hp, rank.attn_hp, model_.spec(), model_.rope(), model_.attention(), rank.w.layers,
                                      rank.experts, [&comm](float* data, int64_t n) { comm.all_reduce_sum(data, n); }},
                    b, cache, h.data(), *rank.pool);

  // This rank's vocabulary slice of the logits, gathered from every rank.   [R, Vr] -> [N, R, Vr]
  const int64_t R = int64_t(b.out_rows.size());
  std::vector<float> normed(size_t(R * H)), mine(size_t(R * Vr)), all(size_t(N * R * Vr));
  for (int64_t r = 0; r < R; ++r)
    ops::rms_norm(h.data() + b.out_rows[size_t(r)] * H, rank.w.output_norm.data(), H, hp.rms_eps, normed.data() + r * H);
  ops::matmul(rank.w.output, normed.data(), R, mine.data(), *rank.pool);
  comm.all_gather(mine.data(), R * Vr, all.data());
  if (!logits) return;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < N; ++k)
      std::copy_n(all.data() + (k * R + r) * Vr, Vr, logits + r * N * Vr + k * Vr);
}

}  // namespace sparsemla::dist
