// The paged KV cache of MLA + DSA models. Per layer and token it holds the latent row
// [kv_lora | k_pe] (576 values for GLM-5 / DeepSeek) and, for layers with an indexer, the
// indexer key [idx_dim]. Memory is cut into fixed-size blocks of `block_size` tokens; each
// sequence owns a block table mapping its positions to blocks (kv::BlockAllocator).
#pragma once
#include <cstdint>
#include <vector>

#include "kv/block_allocator.h"

namespace sparsemla::kv {

struct CacheShape {
  int32_t n_layers = 0;      // layers that attend (main layers)
  int32_t latent_dim = 0;    // kv_lora_rank + qk_rope
  int32_t idx_dim = 0;       // indexer key dims; 0 without an indexer
  int32_t block_size = 16;   // tokens per block
  int32_t n_blocks = 0;
};

// Throws Error for a shape no cache can have (no layers, no latent, no blocks).
const CacheShape& checked_cache_shape(const CacheShape& shape);

// How the GPU cache stores a row, for a CPU cache that emulates it (ops/cuda/attention.h):
//   BF16: every value rounded to bf16.
//   FP8:  the first kv_lora latent values (every index-key value) in groups of 128 with one fp32
//         scale amax / 448, each value v -> e4m3(v / scale) * scale; the rope part of a latent row bf16.
enum class RowRounding { None, BF16, FP8 };

// fp32 rows on the CPU.
class PagedCache : public BlockAllocator {
 public:
  explicit PagedCache(const CacheShape& shape);
  const CacheShape& shape() const { return shape_; }

  // Rows written from now on hold the values the GPU cache of that format would hold (so that the
  // CPU forward is a reference for the GPU's); None (the default) keeps them exact.
  void set_rounding(RowRounding r, int32_t kv_lora);
  RowRounding rounding() const { return rounding_; }
  // Applies the rounding to a row just written (no-op without rounding).
  void round_latent(int32_t layer, int64_t slot);
  void round_index_key(int32_t layer, int64_t slot);

  float* latent(int32_t layer, int64_t slot) {            // [latent_dim]
    return latent_.data() + (int64_t(layer) * n_slots() + slot) * shape_.latent_dim;
  }
  float* index_key(int32_t layer, int64_t slot) {         // [idx_dim]
    return index_keys_.data() + (int64_t(layer) * n_slots() + slot) * shape_.idx_dim;
  }

 private:
  CacheShape shape_;
  RowRounding rounding_ = RowRounding::None;
  int32_t kv_lora_ = 0;            // latent values that FP8 quantizes (the rest is rope, bf16)
  std::vector<float> latent_;      // [n_layers, n_slots, latent_dim]
  std::vector<float> index_keys_;  // [n_layers, n_slots, idx_dim]
};

}  // namespace sparsemla::kv
