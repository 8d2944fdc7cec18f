#include "dist/cuda/sharded_gpu_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <set>

#include "dist/communicator.h"
#include "dist/rank_threads.h"
#include "dist/shard_weights.h"
#include "model/cuda/gpu_ops.h"
#include "model/model.h"
#include "ops/device.h"
#include "util/error.h"
#if SPARSEMLA_HAVE_NCCL
#include "dist/cuda/nccl_communicator.h"
#endif

namespace sparsemla::dist {

namespace gpu = model::gpu;

ShardedGpuCache::ShardedGpuCache(std::vector<model::GpuCache> replicas, int32_t block_size, int32_t n_blocks)
    : BlockAllocator(block_size, n_blocks), replicas_(std::move(replicas)) {
  for (const model::GpuCache& c : replicas_)
    if (c.block_size() != block_size || c.n_blocks() != n_blocks)
      fail("tensor parallel: a cache replica of {} blocks of {} in a cache of {} blocks of {}", c.n_blocks(),
           c.block_size(), n_blocks, block_size);
}

namespace {

// Collectives on device memory through the host: each copies the rank's data to the host, runs the
// in-process group's collective (`inner`, set for each forward), and copies the result back,
// waiting for it. Any number of ranks per GPU.
class HostStagedCommunicator : public Communicator {
 public:
  explicit HostStagedCommunicator(cuda::Stream s, Communicator* in = nullptr) : inner(in), s_(s) {}
  Communicator* inner = nullptr;
  int rank() const override { return inner->rank(); }
  int size() const override { return inner->size(); }
  void all_reduce_sum(float* data, int64_t n) override {
    host_.resize(size_t(n));
    gpu::download(host_.data(), data, size_t(n) * sizeof(float), s_);
    inner->all_reduce_sum(host_.data(), n);
    upload(data, n);
  }
  void all_gather(const float* in, int64_t n, float* out) override {
    std::vector<float> mine(static_cast<size_t>(n));
    gpu::download(mine.data(), in, size_t(n) * sizeof(float), s_);
    host_.resize(size_t(n) * size_t(size()));
    inner->all_gather(mine.data(), n, host_.data());
    upload(out, int64_t(host_.size()));
  }
  void broadcast(float* data, int64_t n, int root) override {
    host_.resize(size_t(n));
    gpu::download(host_.data(), data, size_t(n) * sizeof(float), s_);
    inner->broadcast(host_.data(), n, root);
    upload(data, n);
  }
  void barrier() override {
    gpu::synchronize(s_);
    inner->barrier();
  }
  void abort(const std::string& reason) override { inner->abort(reason); }

 private:
  void upload(float* dst, int64_t n) {
    gpu::upload_async(dst, host_.data(), size_t(n) * sizeof(float), s_);
    gpu::synchronize(s_);  // host_ is reused
  }
  cuda::Stream s_;
  std::vector<float> host_;
};

model::GpuShard shard_of(const ShardPlan& plan, int r, const model::ModelWeights& views) {
  model::GpuShard shard;
  shard.weights = &views;
  shard.rank = r;
  shard.n_ranks = plan.n_ranks();
  shard.n_head = uint32_t(plan.heads_per_rank());
  shard.experts = {r * plan.experts_per_rank(), plan.experts_per_rank()};
  shard.vocab_first = r * plan.vocab_per_rank();
  shard.vocab_count = plan.vocab_per_rank();
  return shard;
}

}  // namespace

std::unique_ptr<Communicator> host_staged(Communicator& inner, cuda::Stream s) {
  return std::make_unique<HostStagedCommunicator>(s, &inner);
}

model::GpuCollectives collectives_of(Communicator& comm, bool capturable) {
  model::GpuCollectives c;
  Communicator* p = &comm;
  c.all_reduce_sum = [p](float* data, int64_t n) { p->all_reduce_sum(data, n); };
  c.all_gather = [p](const float* in, int64_t n, float* out) { p->all_gather(in, n, out); };
  c.capturable = capturable;
  return c;
}

std::unique_ptr<GpuRank> load_gpu_rank(const model::Model& cpu, int n_ranks, int rank, const model::GpuModelOptions& o) {
  if (rank < 0 || rank >= n_ranks) fail("tensor parallel: rank {} of a group of {}", rank, n_ranks);
  auto g = std::make_unique<GpuRank>();
  g->plan = ShardPlan::make(cpu.hparams(), n_ranks, types_of(cpu.file()));
  g->views = bind_shard(cpu.weights(), cpu.hparams(), g->plan, rank);
  try {
    g->gpu = model::GpuModel::load_shard(cpu, shard_of(g->plan, rank, g->views), o);
  } catch (const Error& e) {
    fail("tensor parallel: rank {} on GPU {}: {}", rank, o.device, e.what());
  }
  return g;
}

struct ShardedGpuModel::Rank {
  int device = 0;
  model::ModelWeights views;             // dist::bind_shard's, checked against the plan
  std::unique_ptr<model::GpuModel> gpu;
  std::unique_ptr<HostStagedCommunicator> staged;  // HostStaged transport
};

struct ShardedGpuModel::Group {
  TpTransport transport = TpTransport::Nccl;
#if SPARSEMLA_HAVE_NCCL
  std::vector<std::unique_ptr<NcclCommunicator>> nccl;  // [N]
#endif
};

std::unique_ptr<ShardedGpuModel> ShardedGpuModel::load(const model::Model& cpu, int n_ranks,
                                                       const ShardedGpuOptions& opts) {
  if (n_ranks < 1) fail("tensor parallel: {} ranks", n_ranks);
  if (!ops::built_with_cuda()) fail("--device cuda: this build has no CUDA");
  std::string why;
  const std::vector<ops::DeviceInfo> devs = ops::list_devices(&why);
  if (devs.empty()) fail("--device cuda: no CUDA device ({})", why);
  std::vector<int> devices = opts.devices;
  // By default rank r takes GPU r; host-staged ranks may share GPUs, so they wrap around the GPUs
  // there are (two ranks on a one-GPU machine: both on GPU 0).
  if (devices.empty())
    for (int r = 0; r < n_ranks; ++r)
      devices.push_back(opts.transport == TpTransport::HostStaged ? r % int(devs.size()) : r);
  if (int(devices.size()) != n_ranks) fail("tensor parallel: {} devices for {} ranks", devices.size(), n_ranks);
  for (int d : devices)
    if (d < 0 || size_t(d) >= devs.size())
      fail("--tensor-parallel {} --device cuda needs {} GPUs (one per rank); {} found{}", n_ranks,
           *std::max_element(devices.begin(), devices.end()) + 1, devs.size(),
           devs.size() == 1 ? "" : fmt::format(" (GPU {} does not exist)", d));
  if (opts.transport == TpTransport::Nccl) {
#if !SPARSEMLA_HAVE_NCCL
    fail("--tensor-parallel {} --device cuda: this build has no NCCL (nccl.h and libnccl were not found at configure "
         "time)", n_ranks);
#endif
    if (std::set<int>(devices.begin(), devices.end()).size() != devices.size())
      fail("tensor parallel over NCCL needs a GPU of its own for each rank; the ranks were given GPUs {}",
           fmt::join(devices, ", "));
  }

  std::unique_ptr<ShardedGpuModel> m(new ShardedGpuModel());
  m->plan_ = ShardPlan::make(cpu.hparams(), n_ranks, types_of(cpu.file()));
  m->group_ = std::make_unique<Group>();
  m->group_->transport = opts.transport;
  m->threads_ = std::make_unique<RankThreads>(n_ranks);
  const model::HParams& hp = cpu.hparams();
  for (int r = 0; r < n_ranks; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->device = devices[size_t(r)];
    rank->views = bind_shard(cpu.weights(), hp, m->plan_, r);
    const model::GpuShard shard = shard_of(m->plan_, r, rank->views);
    model::GpuModelOptions o = opts.gpu;
    o.device = rank->device;
    o.verbose = opts.gpu.verbose && r == 0;
    try {
      rank->gpu = model::GpuModel::load_shard(cpu, shard, o);
    } catch (const Error& e) {
      fail("tensor parallel: rank {} on GPU {}: {}", r, rank->device, e.what());
    }
    m->ranks_.push_back(std::move(rank));
  }

  // Each rank's communicator, and its model's collectives through it.
  if (opts.transport == TpTransport::HostStaged) {
    for (auto& rank : m->ranks_) rank->staged = std::make_unique<HostStagedCommunicator>(rank->gpu->stream());
  } else {
#if SPARSEMLA_HAVE_NCCL
    const NcclUniqueId id = nccl_unique_id();
    Group& g = *m->group_;
    g.nccl.resize(size_t(n_ranks));
    m->threads_->run([&](int r) {
      Rank& rank = *m->ranks_[size_t(r)];
      g.nccl[size_t(r)] = std::make_unique<NcclCommunicator>(id, r, n_ranks, rank.device, rank.gpu->stream());
    });
#endif
  }
  for (int r = 0; r < n_ranks; ++r) {
    // NCCL only enqueues; the host-staged copies wait.
    m->ranks_[size_t(r)]->gpu->set_collectives(collectives_of(*m->communicator(r), opts.transport == TpTransport::Nccl));
  }
  return m;
}

ShardedGpuModel::~ShardedGpuModel() {
#if SPARSEMLA_HAVE_NCCL
  // ncclCommDestroy first finalizes the communicator, which may wait for the group's other members
  // to finalize too: with every member in this process, one thread per rank.
  //
  // The ranks' models go first: their CUDA graphs hold NCCL's captured kernel plans, and a
  // communicator's destroy waits until every graph that captured one of its collectives is gone
  // (they were destroyed after the communicators, so the destroy never returned: the NCCL test's
  // "hang at the end" on two H200s).
  for (auto& r : ranks_) {
    gpu::set_device(r->device);
    r->gpu.reset();
  }
  if (group_ && group_->nccl.size() > 1 && threads_) threads_->run([this](int r) { group_->nccl[size_t(r)].reset(); });
#endif
}

const model::HParams& ShardedGpuModel::hparams() const { return ranks_[0]->gpu->hparams(); }

model::GpuModel& ShardedGpuModel::rank(int r) { return *ranks_[size_t(r)]->gpu; }

void ShardedGpuModel::on_ranks(const std::function<void(int)>& fn) {
  const int N = n_ranks();
  if (group_->transport == TpTransport::HostStaged) {  // a fresh in-process group: a failed one stays failed
    InProcessGroup group(N);
    for (int r = 0; r < N; ++r) ranks_[size_t(r)]->staged->inner = &group.comm(r);
    group.run([&](Communicator& c) { fn(c.rank()); }, threads_.get());
    return;
  }
#if SPARSEMLA_HAVE_NCCL
  threads_->run(fn, [this](const std::string& reason) {
    for (auto& c : group_->nccl) c->abort(reason);
  });
#endif
}

Communicator* ShardedGpuModel::communicator(int r) {
  if (group_->transport == TpTransport::HostStaged) return ranks_[size_t(r)]->staged.get();
#if SPARSEMLA_HAVE_NCCL
  return group_->nccl[size_t(r)].get();
#else
  return nullptr;
#endif
}

std::string ShardedGpuModel::memory_report() const {
  std::string s = plan_.summary();
  s += fmt::format("\ncollectives: {}", group_->transport == TpTransport::Nccl ? "NCCL" : "host-staged (in-process group)");
  for (const auto& r : ranks_) {
    s += '\n';
    s += r->gpu->memory_report();
  }
  return s;
}

ShardedGpuCache ShardedGpuModel::make_cache(int32_t n_blocks, int32_t block_size) const {
  std::vector<model::GpuCache> replicas;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    gpu::set_device(ranks_[r]->device);
    try {
      replicas.push_back(ranks_[r]->gpu->make_cache(n_blocks, block_size));
    } catch (const Error& e) {
      fail("tensor parallel: rank {} on GPU {}: {}", r, ranks_[r]->device, e.what());
    }
  }
  return ShardedGpuCache(std::move(replicas), block_size, n_blocks);
}

void ShardedGpuModel::sample(const std::vector<model::SeqInput>& batch, ShardedGpuCache& cache,
                             const std::vector<cuda::RowSampling>& params, std::vector<int32_t>& ids) {
  per_rank<int32_t>(batch, cache, ids, [&](model::GpuModel& g, model::GpuCache& c, std::vector<int32_t>& out) {
    g.sample(batch, c, params, out);
  });
}

template <class T>
void ShardedGpuModel::per_rank(const std::vector<model::SeqInput>& batch, ShardedGpuCache& cache, std::vector<T>& out,
                               const std::function<void(model::GpuModel&, model::GpuCache&, std::vector<T>&)>& fn) {
  const int N = n_ranks();
  if (cache.n_ranks() != N) fail("tensor parallel: a cache of {} replicas for {} ranks", cache.n_ranks(), N);
  // Bad input fails here, before any rank starts: a rank failing alone would stop the group for good.
  (void)model::GpuModel::check_batch(batch, cache, hparams().n_vocab);
  const size_t base = out.size();
  std::vector<std::vector<T>> others(static_cast<size_t>(N));
  try {
    on_ranks([&](int r) {
      Rank& rank = *ranks_[size_t(r)];
      gpu::set_device(rank.device);
      fn(*rank.gpu, cache.replica(r), r == 0 ? out : others[size_t(r)]);
    });
  } catch (...) {
    out.resize(base);
    throw;
  }
}

double ShardedGpuModel::all_reduce_us(int64_t n, int iters) {
  const int N = n_ranks();
  std::vector<double> us(static_cast<size_t>(N), 0.0);
  auto rank_run = [&](int r, Communicator& comm) {
    Rank& rank = *ranks_[size_t(r)];
    gpu::set_device(rank.device);
    cuda::DeviceBuffer buf(size_t(std::max<int64_t>(n, 1)) * sizeof(float));
    gpu::fill_bytes(buf.get(), 0, buf.bytes(), rank.gpu->stream());
    for (int i = 0; i < 5; ++i) comm.all_reduce_sum(buf.as<float>(), n);
    comm.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) comm.all_reduce_sum(buf.as<float>(), n);
    gpu::synchronize(rank.gpu->stream());
    us[size_t(r)] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
  };
  on_ranks([&](int r) { rank_run(r, *communicator(r)); });
  return *std::max_element(us.begin(), us.end());
}

void ShardedGpuModel::forward(const std::vector<model::SeqInput>& batch, ShardedGpuCache& cache,
                              std::vector<float>& logits) {
  per_rank<float>(batch, cache, logits, [&](model::GpuModel& g, model::GpuCache& c, std::vector<float>& out) {
    g.forward(batch, c, out);
  });
}

}  // namespace sparsemla::dist
