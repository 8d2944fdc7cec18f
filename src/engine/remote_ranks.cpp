#include "engine/remote_ranks.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <thread>

#include "dist/sharded_model.h"
#include "dist/step_message.h"
#include "dist/tcp_bootstrap.h"
#include "dist/tcp_communicator.h"
#include "kv/paged_cache.h"
#include "model/forward.h"
#include "ops/device.h"
#include "util/env.h"
#include "util/error.h"
#if SPARSEMLA_HAVE_CUDA
#include "model/cuda/gpu_ops.h"
#include "ops/cuda/buffer.h"
#endif
#if SPARSEMLA_HAVE_NCCL
#include "dist/cuda/nccl_communicator.h"
#endif

namespace sparsemla::engine {
namespace {

using dist::RankConfig;
using dist::RankStep;
using dist::TcpBootstrap;
using Ms = std::chrono::milliseconds;

// While this rank runs a step's NCCL collectives, which wait without a deadline, a thread watches
// the TCP connections: a peer that goes away (its process died) aborts the local communicator, so
// the step fails with an error naming that rank instead of waiting for it forever.
class StepWatchdog {
 public:
  StepWatchdog(const TcpBootstrap& boot, std::function<void(const std::string&)> abort)
      : boot_(boot), abort_(std::move(abort)), thread_([this] { loop(); }) {}
  ~StepWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void arm() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      armed_ = true;
    }
    cv_.notify_all();
  }
  void disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
  }

 private:
  void loop() {
    constexpr auto kTick = std::chrono::milliseconds(100);
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || armed_; });
      if (stop_) return;
      lock.unlock();
      const auto t0 = std::chrono::steady_clock::now();
      const std::string lost = boot_.lost_peer(kTick);
      lock.lock();
      if (!lost.empty() && armed_) {
        armed_ = false;
        abort_(fmt::format("{} went away during a step", lost));
      } else if (lost.empty()) {  // a peer with its next message waiting makes poll() return at once
        cv_.wait_until(lock, t0 + kTick, [&] { return stop_; });
      }
    }
  }
  const TcpBootstrap& boot_;
  std::function<void(const std::string&)> abort_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false, stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

// Arms the watchdog for a scope (when there is one).
struct Armed {
  explicit Armed(StepWatchdog* w) : w_(w) {
    if (w_) w_->arm();
  }
  ~Armed() {
    if (w_) w_->disarm();
  }
  StepWatchdog* w_;
};

// This process's rank of the group: its shard, its replica of the KV cache and its collectives.
class LocalRank {
 public:
  // Loads the shard (no collective yet).
  LocalRank(model::Model& m, const RankConfig& c, TcpBootstrap& boot, int gpu)
      : m_(m), c_(c), boot_(boot), tcp_(boot) {
    const int N = boot.size(), r = boot.rank();
    if (!c.cuda) {
      cpu_ = std::make_unique<dist::ShardedModel>(m, N, c.threads, r);
      cpu_cache_ = std::make_unique<kv::PagedCache>(m.cache_shape(c.kv_blocks, c.block_size));
      description_ = fmt::format("CPU, {}", cpu_->plan().summary());
      return;
    }
#if SPARSEMLA_HAVE_CUDA
    model::GpuModelOptions o;
    o.kv_cache = cuda::KvDtype(c.kv_dtype);
    o.device = gpu;
    o.precise = c.precise;
    o.cuda_graphs = c.cuda_graphs;
    o.int8_activations = c.int8_activations;
    o.q8_two_level = c.q8_two_level;
    o.min_cache_tokens = int64_t(c.kv_blocks) * c.block_size;
    o.max_batch_tokens = c.batch_tokens;
    model::gpu::set_device(gpu);
    gpu_ = dist::load_gpu_rank(m, N, r, o);
    gpu_cache_ = std::make_unique<model::GpuCache>(gpu_->gpu->make_cache(c.kv_blocks, c.block_size));
    description_ = gpu_->plan.summary() + "\n" + gpu_->gpu->memory_report();
#else
    (void)gpu;
    fail("rank 0 runs on the GPU, but this sparsemla was built without CUDA");
#endif
  }

  // The device collectives, once every rank has loaded: NCCL (joining blocks until all ranks do),
  // or host-staged over the TCP star.
  void connect() {
    if (!c_.cuda) return;
#if SPARSEMLA_HAVE_CUDA
    const cuda::Stream s = gpu_->gpu->stream();
    if (c_.host_staged) {
      dev_comm_ = dist::host_staged(tcp_, s);
      gpu_->gpu->set_collectives(dist::collectives_of(*dev_comm_, false));
      description_ += "\ncollectives: host-staged over TCP";
      return;
    }
#if SPARSEMLA_HAVE_NCCL
    dist::NcclUniqueId id{};
    if (c_.nccl_id.size() != id.size()) fail("tensor parallel: rank 0 sent an NCCL id of {} bytes", c_.nccl_id.size());
    std::copy(c_.nccl_id.begin(), c_.nccl_id.end(), id.begin());
    dev_comm_ = std::make_unique<dist::NcclCommunicator>(id, boot_.rank(), boot_.size(), gpu_device(), s);
    gpu_->gpu->set_collectives(dist::collectives_of(*dev_comm_, true));
    dist::Communicator* comm = dev_comm_.get();
    watchdog_ = std::make_unique<StepWatchdog>(boot_, [comm](const std::string& why) { comm->abort(why); });
    description_ += "\ncollectives: NCCL";
#else
    fail("tensor parallel over NCCL: this sparsemla was built without NCCL (use --tp-transport host)");
#endif
#endif
  }

  kv::BlockAllocator& blocks() {
#if SPARSEMLA_HAVE_CUDA
    if (gpu_) return *gpu_cache_;
#endif
    return *cpu_cache_;
  }

  // Throws for a batch that the ranks would refuse, before any rank is told of it.
  void check(const std::vector<model::SeqInput>& batch) {
#if SPARSEMLA_HAVE_CUDA
    if (gpu_) {
      (void)model::GpuModel::check_batch(batch, *gpu_cache_, m_.hparams().n_vocab);
      return;
    }
#endif
    (void)model::flatten_batch(batch, *cpu_cache_, m_.hparams().n_vocab);
  }

  void forward(const std::vector<model::SeqInput>& batch, std::vector<float>& logits) {
#if SPARSEMLA_HAVE_CUDA
    if (gpu_) {
      model::gpu::set_device(gpu_device());
      const size_t base = logits.size();
      const Armed armed(watchdog_.get());
      gpu_->gpu->forward(batch, *gpu_cache_, logits);
      if (boot_.rank() != 0) logits.resize(base);
      return;
    }
#endif
    cpu_->forward_rank(tcp_, batch, *cpu_cache_, logits);
  }

#if SPARSEMLA_HAVE_CUDA
  void sample(const std::vector<model::SeqInput>& batch, const std::vector<cuda::RowSampling>& rows,
              std::vector<int32_t>& ids) {
    if (!gpu_) fail("tensor parallel: device sampling on a CPU rank");
    model::gpu::set_device(gpu_device());
    const Armed armed(watchdog_.get());
    gpu_->gpu->sample(batch, *gpu_cache_, rows, ids);
  }

  // One all-reduce of n values, timed on this rank as ShardedGpuModel::all_reduce_us times it.
  double all_reduce_us(int64_t n) {
    if (!gpu_) return -1.0;
    model::gpu::set_device(gpu_device());
    const cuda::Stream s = gpu_->gpu->stream();
    cuda::DeviceBuffer buf(size_t(std::max<int64_t>(n, 1)) * sizeof(float));
    model::gpu::fill_bytes(buf.get(), 0, buf.bytes(), s);
    const int iters = c_.host_staged ? 20 : 200;
    const Armed armed(watchdog_.get());
    for (int i = 0; i < 5; ++i) dev_comm_->all_reduce_sum(buf.as<float>(), n);
    dev_comm_->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) dev_comm_->all_reduce_sum(buf.as<float>(), n);
    model::gpu::synchronize(s);
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
  }
#endif

  const std::string& description() const { return description_; }

  // The model before its communicator: its CUDA graphs hold NCCL's captured kernel plans, and
  // destroying the communicator waits until those graphs are gone.
  ~LocalRank() {
#if SPARSEMLA_HAVE_CUDA
    watchdog_.reset();
    gpu_cache_.reset();
    gpu_.reset();
    dev_comm_.reset();
#endif
  }

 private:
  int gpu_device() const {
#if SPARSEMLA_HAVE_CUDA
    return gpu_ ? gpu_->gpu->device() : 0;
#else
    return 0;
#endif
  }
  model::Model& m_;
  RankConfig c_;
  TcpBootstrap& boot_;
  dist::TcpCommunicator tcp_;
  std::string description_;
  std::unique_ptr<dist::ShardedModel> cpu_;
  std::unique_ptr<kv::PagedCache> cpu_cache_;
#if SPARSEMLA_HAVE_CUDA
  std::unique_ptr<dist::GpuRank> gpu_;
  std::unique_ptr<model::GpuCache> gpu_cache_;
  std::unique_ptr<dist::Communicator> dev_comm_;
  std::unique_ptr<StepWatchdog> watchdog_;  // NCCL only: the TCP collectives notice a lost peer themselves
#endif
};

// After loading, every rank says whether it can go on ("" or its error); any error stops every
// rank with the failing ranks named. Waits as long as the ranks stay connected (loading a large
// model takes minutes).
void agree_loaded(TcpBootstrap& boot, const std::string& my_error) {
  const auto all = boot.all_gather({reinterpret_cast<const uint8_t*>(my_error.data()), my_error.size()},
                                   TcpBootstrap::kForever);
  std::string errors;
  for (int r = 0; r < boot.size(); ++r)
    if (!all[size_t(r)].empty())
      errors += fmt::format("{}rank {}: {}", errors.empty() ? "" : "; ", r,
                            std::string(all[size_t(r)].begin(), all[size_t(r)].end()));
  if (!errors.empty()) fail("tensor parallel over {} processes: a rank could not start: {}", boot.size(), errors);
}

// The worker's model must be rank 0's: same architecture, sizes and file bytes.
std::string model_mismatch(const model::Model& m, const RankConfig& c) {
  uint64_t bytes = 0;
  for (uint64_t b : m.file().file_sizes()) bytes += b;
  const model::HParams& hp = m.hparams();
  if (hp.arch_name != c.arch || bytes != c.file_bytes || int64_t(hp.n_vocab) != c.n_vocab || hp.n_layer != c.n_layer)
    return fmt::format(
        "its model is not rank 0's: {} ({} layers, vocabulary {}, {} bytes) against rank 0's {} ({} layers, "
        "vocabulary {}, {} bytes)",
        hp.arch_name, hp.n_layer, hp.n_vocab, bytes, c.arch, c.n_layer, c.n_vocab, c.file_bytes);
  return "";
}

#if SPARSEMLA_HAVE_CUDA
std::vector<dist::StepSampling> wire_rows(const std::vector<cuda::RowSampling>& rows) {
  std::vector<dist::StepSampling> out;
  for (const cuda::RowSampling& p : rows) out.push_back({p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.step});
  return out;
}
std::vector<cuda::RowSampling> device_rows(const std::vector<dist::StepSampling>& rows) {
  std::vector<cuda::RowSampling> out;
  for (const dist::StepSampling& p : rows) out.push_back({p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.step});
  return out;
}
#endif

class LeaderBackend final : public Backend {
 public:
  LeaderBackend(model::Model& m, const BackendOptions& opts, int32_t kv_blocks, int32_t block_size,
                int64_t batch_tokens)
      : Backend(m.hparams().n_vocab),
        boot_(accept(m, opts, kv_blocks, block_size, batch_tokens, &config_)) {
    std::string error;
    try {
      local_ = std::make_unique<LocalRank>(m, config_, boot_, opts.device == Device::Cuda ? gpu_of(opts) : 0);
    } catch (const Error& e) {
      error = e.what();
    }
    agree_loaded(boot_, error);
    local_->connect();
    description_ = fmt::format("tensor parallel over {} processes (rank 0 here; workers joined at {}), {}",
                               boot_.size(), boot_.root_address(), local_->description());
  }
  ~LeaderBackend() override {
    try {
      send({RankStep::Kind::Stop, {}, {}, 0});
    } catch (const Error&) {  // the workers are gone already: nothing to stop
    }
  }
  kv::BlockAllocator& blocks() override { return local_->blocks(); }
  void forward(const std::vector<model::SeqInput>& batch, std::vector<float>& logits) override {
    local_->check(batch);
    send(RankStep::of(RankStep::Kind::Forward, batch));
    local_->forward(batch, logits);
  }
#if SPARSEMLA_HAVE_CUDA
  bool samples_on_device() const override { return config_.cuda; }
  void forward_sample(const std::vector<model::SeqInput>& batch, const std::vector<cuda::RowSampling>& rows,
                      std::vector<int32_t>& ids) override {
    if (!config_.cuda) Backend::forward_sample(batch, rows, ids);
    local_->check(batch);
    RankStep step = RankStep::of(RankStep::Kind::Sample, batch);
    step.rows = wire_rows(rows);
    send(step);
    local_->sample(batch, rows, ids);
  }
  double all_reduce_us(int64_t n) override {
    if (!config_.cuda) return -1.0;
    send({RankStep::Kind::AllReduceTiming, {}, {}, n});
    return local_->all_reduce_us(n);
  }
#endif

 private:
  static TcpBootstrap accept(const model::Model& m, const BackendOptions& opts, int32_t kv_blocks, int32_t block_size,
                             int64_t batch_tokens, RankConfig* config) {
    if (opts.tensor_parallel < 2) fail("--tp-master: tensor parallelism over processes needs --tensor-parallel >= 2");
    if (opts.procs.rank != 0) fail("--tp-rank {}: the command runs rank 0; start ranks >= 1 with `sparsemla worker`", opts.procs.rank);
    RankConfig& c = *config;
    c.arch = m.hparams().arch_name;
    for (uint64_t b : m.file().file_sizes()) c.file_bytes += b;
    c.n_vocab = m.hparams().n_vocab;
    c.n_layer = m.hparams().n_layer;
    c.cuda = opts.device == Device::Cuda;
    c.host_staged = opts.procs.host_staged;
    c.dense_attention = m.attention() == model::AttentionMode::Dense;
    c.kv_blocks = kv_blocks;
    c.block_size = block_size;
    c.batch_tokens = batch_tokens;
    c.threads = opts.threads;
#if SPARSEMLA_HAVE_CUDA
    c.kv_dtype = uint8_t(opts.gpu.kv_cache);
    c.precise = opts.gpu.precise;
    c.cuda_graphs = opts.gpu.cuda_graphs;
    c.int8_activations = opts.gpu.int8_activations;
    c.q8_two_level = opts.gpu.q8_two_level && !env_off("SPARSEMLA_Q8_ACTIVATIONS");
#if SPARSEMLA_HAVE_NCCL
    if (c.cuda && !c.host_staged) {
      const dist::NcclUniqueId id = dist::nccl_unique_id();
      c.nccl_id.assign(id.begin(), id.end());
    }
#endif
#endif
    dist::TcpListener listener(opts.procs.master);
    std::fprintf(stderr, "tensor parallel: rank 0 of %d waiting for the workers at %s\n", opts.tensor_parallel,
                 listener.address().c_str());
    return TcpBootstrap::accept(std::move(listener), opts.tensor_parallel, dist::encode(c), opts.procs.timeout);
  }
  static int gpu_of(const BackendOptions& opts) {
#if SPARSEMLA_HAVE_CUDA
    return opts.gpu.device;
#else
    (void)opts;
    return 0;
#endif
  }
  void send(const RankStep& step) {
    const std::vector<uint8_t> bytes = dist::encode(step);
    (void)boot_.all_gather(bytes);
  }

  RankConfig config_;
  TcpBootstrap boot_;
  std::unique_ptr<LocalRank> local_;
};

}  // namespace

std::unique_ptr<Backend> make_leader_backend(model::Model& model, const BackendOptions& opts, int32_t kv_blocks,
                                             int32_t block_size, int64_t batch_tokens) {
  return std::make_unique<LeaderBackend>(model, opts, kv_blocks, block_size, batch_tokens);
}

void run_worker(const WorkerOptions& o) {
  auto log = [&](const std::string& line) {
    if (o.log) o.log(line);
  };
  if (o.n_ranks < 2) fail("worker: --tensor-parallel must be >= 2, got {}", o.n_ranks);
  if (o.procs.rank < 1 || o.procs.rank >= o.n_ranks)
    fail("worker: --tp-rank {} is not a worker rank of {} (1..{}; rank 0 runs the command)", o.procs.rank, o.n_ranks,
         o.n_ranks - 1);
  if (o.procs.master.empty()) fail("worker: --tp-master HOST:PORT (rank 0's address) is required");
  log(fmt::format("rank {} of {}: joining rank 0 at {} (waiting up to {} s)", o.procs.rank, o.n_ranks, o.procs.master,
                  o.procs.timeout.count() / 1000));
  TcpBootstrap boot = TcpBootstrap::join(o.procs.master, o.procs.rank, o.n_ranks, o.procs.timeout);
  const RankConfig c = dist::decode_config(boot.blob());
  log(fmt::format("rank {} of {}: joined {}; loading {} ({})", boot.rank(), boot.size(), boot.root_address(),
                  o.model_path, c.cuda ? "GPU" : "CPU"));

  std::unique_ptr<model::Model> m;
  std::unique_ptr<LocalRank> local;
  std::string error;
  try {
    model::ModelOptions mo;
    mo.attention = c.dense_attention ? model::AttentionMode::Dense : model::AttentionMode::Sparse;
    mo.threads = o.threads > 0 ? o.threads : c.threads;
    m = model::Model::load(o.model_path, mo);
    error = model_mismatch(*m, c);
    if (error.empty()) {
      int gpu = o.gpu;
      if (c.cuda && gpu < 0) {
        const size_t n = ops::list_devices().size();
        gpu = n > 0 ? int(size_t(o.procs.rank) % n) : 0;
      }
      local = std::make_unique<LocalRank>(*m, RankConfig(c), boot, gpu);
    }
  } catch (const Error& e) {
    error = e.what();
  }
  agree_loaded(boot, error);
  local->connect();
  log(fmt::format("rank {} of {}: ready; {}", boot.rank(), boot.size(), local->description()));

  int64_t steps = 0;
  while (true) {
    // Rank 0's next step: as long as it takes (an idle server sends none), unless rank 0 goes away.
    const auto all = boot.all_gather({}, TcpBootstrap::kForever);
    const RankStep step = dist::decode_step(all[0]);
    if (step.kind == RankStep::Kind::Stop) break;
    const std::vector<model::SeqInput> batch = step.inputs();
    std::vector<float> logits;
    switch (step.kind) {
      case RankStep::Kind::Forward: local->forward(batch, logits); break;
#if SPARSEMLA_HAVE_CUDA
      case RankStep::Kind::Sample: {
        std::vector<int32_t> ids;
        local->sample(batch, device_rows(step.rows), ids);
        break;
      }
      case RankStep::Kind::AllReduceTiming: (void)local->all_reduce_us(step.n); break;
#endif
      default: fail("rank {}: rank 0 sent a step this build cannot run (kind {})", boot.rank(), uint32_t(step.kind));
    }
    ++steps;
  }
  log(fmt::format("rank {} of {}: rank 0 stopped after {} steps", boot.rank(), boot.size(), steps));
}

}  // namespace sparsemla::engine
