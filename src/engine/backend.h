// Where the model's forward runs, with the KV cache it runs over. One interface, five variants:
//   CPU              model::Model over a kv::PagedCache (fp32 rows): the reference
//   CPU, N ranks     dist::ShardedModel over a dist::ReplicatedCache (threads, in-process communicator)
//   GPU              model::GpuModel over a model::GpuCache (bf16, fp8 or f32 rows in device memory)
//   GPU, N ranks     dist::ShardedGpuModel over a dist::ShardedGpuCache (a GPU per rank, NCCL)
//   N processes      rank 0 here, ranks 1.. `sparsemla worker` processes (engine/remote_ranks.h),
//                    CPU or GPU, each step's batch sent to them over TCP
// Every cache is a kv::BlockAllocator with the same slot numbering, so a block table (and the
// scheduler's kv::BlockManager on top of blocks()) means the same thing on all of them.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kv/block_allocator.h"
#include "model/batch.h"
#include "model/model.h"

#if SPARSEMLA_HAVE_CUDA
#include "dist/cuda/sharded_gpu_model.h"
#include "model/cuda/gpu_model.h"
#endif

namespace sparsemla::engine {

enum class Device { Cpu, Cuda };

// The ranks of a split model in separate processes (engine/remote_ranks.h): set `master` to make
// this process rank 0 of a multi-process group listening there.
struct ProcessGroupOptions {
  int rank = 0;
  std::string master;  // rank 0's host:port ("" : every rank in this process)
  bool host_staged = false;  // --device cuda: collectives over the TCP star instead of NCCL
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // joining, and each exchange
};

struct BackendOptions {
  Device device = Device::Cpu;
  int tensor_parallel = 1;  // ranks the model is split over (1: not split)
  int threads = 0;          // CPU threads (0: all): the model's at load, the sharded CPU forward's
  ProcessGroupOptions procs;  // procs.master set: ranks 1.. are other processes (`sparsemla worker`)
#if SPARSEMLA_HAVE_CUDA
  // Device::Cuda: cache format, precise mode, the printed kernel table, the GPU of an unsplit model.
  // min_cache_tokens and max_batch_tokens are make_backend's to set, from the cache it makes.
  model::GpuModelOptions gpu;
  std::vector<int> tp_devices;  // split over ranks: the GPU of each (empty: rank r on GPU r, host-staged
                                // ranks wrapping around the GPUs there are)
  dist::TpTransport tp_transport = dist::TpTransport::Nccl;
#endif
};

class Backend {
 public:
  virtual ~Backend() = default;

  // The cache's blocks: hand them out (reserve, or a kv::BlockManager) to build block tables.
  virtual kv::BlockAllocator& blocks() = 0;
  // As model::Model::forward: runs the new tokens of every sequence, writing their cache rows, and
  // appends logits rows ([n_vocab] each) in batch order. Throws Error for a bad batch.
  virtual void forward(const std::vector<model::SeqInput>& batch, std::vector<float>& logits) = 0;

#if SPARSEMLA_HAVE_CUDA
  // The GPU backends draw tokens on the device: forward() and one token per logits row with that
  // row's parameters (ops/cuda/sampling.h: temperature, top-k, top-p, min-p, seed and draw number),
  // the logits never leaving the GPU. Only the ids come back, appended to `ids`.
  virtual bool samples_on_device() const { return false; }
  virtual void forward_sample(const std::vector<model::SeqInput>& batch, const std::vector<cuda::RowSampling>& rows,
                              std::vector<int32_t>& ids);
#endif

  // Microseconds one all-reduce of n fp32 values takes between the ranks of a split GPU model (two
  // per layer at n = tokens x hidden size); -1 where there is no device all-reduce.
  virtual double all_reduce_us(int64_t /*n*/) { return -1.0; }

  int64_t n_vocab() const { return n_vocab_; }
  // What runs where, for the log: the device, the sharding plan, memory and the KV cache (one line
  // per GPU rank after the plan on the sharded GPU model).
  const std::string& description() const { return description_; }

 protected:
  explicit Backend(int64_t n_vocab) : n_vocab_(n_vocab) {}
  int64_t n_vocab_;
  std::string description_;
};

// Builds the variant `opts` names for `model` (which must outlive it), with a KV cache of
// `kv_blocks` blocks of `block_size` tokens, for forwards of up to `batch_tokens` tokens (the GPU's
// workspace estimate). Throws Error when it cannot run: --device cuda without CUDA or a GPU, a
// model that does not divide by the ranks, fewer GPUs than ranks, or a cache that does not fit
// (the GPU's message has the numbers).
std::unique_ptr<Backend> make_backend(model::Model& model, const BackendOptions& opts, int32_t kv_blocks,
                                      int32_t block_size, int64_t batch_tokens);

// Tokens per forward that serve (and bench) take when --batch-tokens is not given: decodes, then
// prompt chunks up to it. On the CPU 512. On a GPU kGpuBatchTokens: the cuBLAS prefill decodes each
// weight once per forward and the experts' products reach its sizes only in large chunks, so a
// prompt goes through several times faster in 4096-token forwards than in 512-token ones on the
// GLM-5-width model (docs/PERFORMANCE.md, session 39); the price is the workspace for such a
// forward (~1.1 MB per token at GLM-5's widths) and, for the other sequences, one longer step.
inline constexpr int32_t kCpuBatchTokens = 512, kGpuBatchTokens = 4096;
inline int32_t default_batch_tokens(Device d) { return d == Device::Cuda ? kGpuBatchTokens : kCpuBatchTokens; }

}  // namespace sparsemla::engine
