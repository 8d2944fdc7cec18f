// A loaded model and its forward pass on the CPU: the reference every other backend is compared with.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gguf/reader.h"
#include "kv/paged_cache.h"
#include "model/arch/arch.h"
#include "model/batch.h"
#include "model/forward.h"
#include "model/hparams.h"
#include "model/weights.h"
#include "ops/cpu/rope.h"
#include "ops/cpu/thread_pool.h"

namespace sparsemla::model {

struct ModelOptions {
  AttentionMode attention = AttentionMode::Sparse;
  int threads = 0;  // 0: one per hardware thread
};

class Model {
 public:
  static std::unique_ptr<Model> load(const std::string& path, const ModelOptions& opts = {});

  const HParams& hparams() const { return hp_; }
  const ArchSpec& spec() const { return *spec_; }
  const gguf::File& file() const { return *file_; }
  AttentionMode attention() const { return attention_; }
  const ModelWeights& weights() const { return w_; }
  const ops::Rope& rope() const { return rope_; }

  // Cache geometry for `n_blocks` blocks of `block_size` tokens.
  kv::CacheShape cache_shape(int32_t n_blocks, int32_t block_size = 16) const;

  // Runs the new tokens of every sequence through the model, writing their cache rows, and appends
  // logits rows ([n_vocab] each) in batch order: every token of a sequence with all_logits, else
  // its last token. `force`: discrete choices to follow instead of the model's own; `record`:
  // receives the choices made (model/decisions.h); both for tests and debugging.
  void forward(const std::vector<SeqInput>& batch, kv::PagedCache& cache, std::vector<float>& logits,
               const Decisions* force = nullptr, Decisions* record = nullptr);

 private:
  Model() = default;
  std::unique_ptr<gguf::File> file_;
  HParams hp_;
  const ArchSpec* spec_ = nullptr;
  ModelWeights w_;
  ops::Rope rope_;
  AttentionMode attention_ = AttentionMode::Sparse;
  std::unique_ptr<ops::ThreadPool> pool_;
};

}  // namespace sparsemla::model
