#include "engine/backend.h"

#include <new>

#include "dist/sharded_model.h"
#include "engine/remote_ranks.h"
#include "kv/paged_cache.h"
#include "util/error.h"

namespace sparsemla::engine {
namespace {

std::string bytes_str(uint64_t bytes) {
  return bytes >= (uint64_t(1) << 30) ? fmt::format("{:.1f} GiB", double(bytes) / double(1 << 30))
                                      : fmt::format("{:.1f} MiB", double(bytes) / double(1 << 20));
}

uint64_t cpu_cache_bytes(const kv::CacheShape& s) {
  return uint64_t(s.n_layers) * uint64_t(s.latent_dim + s.idx_dim) * sizeof(float) * uint64_t(s.n_blocks) *
         uint64_t(s.block_size);
}

std::string cache_line(const kv::BlockAllocator& c, const char* format, uint64_t bytes, const char* per) {
  return fmt::format("KV cache {} block{} of {} tokens ({}, {}{})", c.n_blocks(), c.n_blocks() == 1 ? "" : "s",
                     c.block_size(), format, bytes_str(bytes), per);
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(model::Model& m, int32_t kv_blocks, int32_t block_size)
      : Backend(m.hparams().n_vocab), model_(m), cache_(m.cache_shape(kv_blocks, block_size)) {
    description_ = "CPU: " + cache_line(cache_, "fp32", cpu_cache_bytes(cache_.shape()), "");
  }
  kv::BlockAllocator& blocks() override { return cache_; }
  void forward(const std::vector<model::SeqInput>& batch, std::vector<float>& logits) override {
    model_.forward(batch, cache_, logits);
  }

 private:
  model::Model& model_;
  kv::PagedCache cache_;
};

// Blocks come from replica 0's allocator, as dist::ReplicatedCache hands them out.
class CpuShardedBackend final : public Backend {
 public:
  CpuShardedBackend(model::Model& m, int n_ranks, int threads, int32_t kv_blocks, int32_t block_size)
      : Backend(m.hparams().n_vocab), tp_(m, n_ranks, threads), cache_(tp_.make_cache(kv_blocks, block_size)) {
    description_ = fmt::format("CPU, {}\n{} on each of the {} ranks", tp_.plan().summary(),
                               cache_line(cache_.replica(0), "fp32", cpu_cache_bytes(cache_.replica(0).shape()), ""),
                               n_ranks);
  }
  kv::BlockAllocator& blocks() override { return cache_.replica(0); }
  void forward(const std::vector<model::SeqInput>& batch, std::vector<float>& logits) override {
    tp_.forward(batch, cache_, logits);
  }

 private:
  dist::ShardedModel tp_;
  dist::ReplicatedCache cache_;
};

#if SPARSEMLA_HAVE_CUDA
model::GpuModelOptions sized(model::GpuModelOptions o, int32_t kv_blocks, int32_t block_size, int64_t batch_tokens) {
  o.min_cache_tokens = int64_t(kv_blocks) * block_size;
  o.max_batch_tokens = batch_tokens;
  return o;
}

class GpuBackend final : public Backend {
 public:
  GpuBackend(const model::Model& m, const model::GpuModelOptions& o, int32_t kv_blocks, int32_t block_size)
      : Backend(m.hparams().n_vocab), gpu_(model::GpuModel::load(m, o)), cache_(gpu_->make_cache(kv_blocks, block_size)) {
    description_ = gpu_->memory_report() + "\n" +
                   cache_line(cache_, cuda::kv_dtype_name(cache_.dtype()), cache_.bytes(), "");
  }
  kv::BlockAllocator& blocks() override { return cache_; }
  void forward(const std::vector<model::SeqInput>& batch, std::vector<float>& logits) override {
    gpu_->forward(batch, cache_, logits);
  }
  bool samples_on_device() const override { return true; }
  void forward_sample(const std::vector<model::SeqInput>& batch, const std::vector<cuda::RowSampling>& rows,
                      std::vector<int32_t>& ids) override {
    gpu_->sample(batch, cache_, rows, ids);
  }

 private:
  std::unique_ptr<model::GpuModel> gpu_;
  model::GpuCache cache_;
};

class GpuShardedBackend final : public Backend {
 public:
  GpuShardedBackend(const model::Model& m, int n_ranks, const dist::ShardedGpuOptions& o, int32_t kv_blocks,
                    int32_t block_size)
      : Backend(m.hparams().n_vocab),
        tp_(dist::ShardedGpuModel::load(m, n_ranks, o)),
        cache_(tp_->make_cache(kv_blocks, block_size)) {
    description_ = tp_->memory_report() + "\n" +
                   cache_line(cache_, cuda::kv_dtype_name(cache_.replica(0).dtype()), cache_.replica(0).bytes(),
                              " on each rank");
  }
  kv::BlockAllocator& blocks() override { return cache_; }
  void forward(const std::vector<model::SeqInput>& batch, std::vector<float>& logits) override {
    tp_->forward(batch, cache_, logits);
  }
  double all_reduce_us(int64_t n) override { return tp_->all_reduce_us(n); }
  bool samples_on_device() const override { return true; }
  void forward_sample(const std::vector<model::SeqInput>& batch, const std::vector<cuda::RowSampling>& rows,
                      std::vector<int32_t>& ids) override {
    tp_->sample(batch, cache_, rows, ids);
  }

 private:
  std::unique_ptr<dist::ShardedGpuModel> tp_;
  dist::ShardedGpuCache cache_;
};
#endif

}  // namespace

#if SPARSEMLA_HAVE_CUDA
void Backend::forward_sample(const std::vector<model::SeqInput>&, const std::vector<cuda::RowSampling>&,
                             std::vector<int32_t>&) {
  fail("this backend samples on the host: forward() and the engine's sampler");
}
#endif

std::unique_ptr<Backend> make_backend(model::Model& model, const BackendOptions& opts, int32_t kv_blocks,
                                      int32_t block_size, int64_t batch_tokens) {
  if (opts.tensor_parallel < 1) fail("tensor parallel over {} ranks: at least 1 is needed", opts.tensor_parallel);
  if (kv_blocks <= 0 || block_size <= 0 || batch_tokens <= 0)
    fail("backend: a KV cache of {} blocks of {} tokens for {}-token forwards", kv_blocks, block_size, batch_tokens);
  if (!opts.procs.master.empty()) return make_leader_backend(model, opts, kv_blocks, block_size, batch_tokens);
  if (opts.device == Device::Cpu) {
    try {
      if (opts.tensor_parallel == 1) return std::make_unique<CpuBackend>(model, kv_blocks, block_size);
      return std::make_unique<CpuShardedBackend>(model, opts.tensor_parallel, opts.threads, kv_blocks, block_size);
    } catch (const std::bad_alloc&) {
      fail("KV cache of {} tokens ({} blocks of {}): {} of host memory{} could not be allocated",
           int64_t(kv_blocks) * block_size, kv_blocks, block_size,
           bytes_str(cpu_cache_bytes(model.cache_shape(kv_blocks, block_size))),
           opts.tensor_parallel > 1 ? fmt::format(" for each of {} ranks", opts.tensor_parallel) : "");
    }
  }
#if SPARSEMLA_HAVE_CUDA
  const model::GpuModelOptions gpu = sized(opts.gpu, kv_blocks, block_size, batch_tokens);
  if (opts.tensor_parallel == 1) return std::make_unique<GpuBackend>(model, gpu, kv_blocks, block_size);
  const dist::ShardedGpuOptions tp{gpu, opts.tp_devices, opts.tp_transport};
  return std::make_unique<GpuShardedBackend>(model, opts.tensor_parallel, tp, kv_blocks, block_size);
#else
  (void)batch_tokens;
  fail("--device cuda: this sparsemla was built without CUDA (nvcc was not found at configure time); rebuild "
       "with the CUDA toolkit or use --device cpu");
#endif
}

}  // namespace sparsemla::engine
