// The paged KV cache of MLA + DSA models. Per layer and token it holds the latent row
// [kv_lora | k_pe] (576 values for GLM-5 / DeepSeek) and, for layers with an indexer, the
// indexer key [idx_dim]. Memory is cut into fixed-size blocks of `block_size` tokens; each
// sequence owns a block table mapping its positions to blocks.
#pragma once
#include <cstdint>
#include <vector>

namespace sparsemla::kv {

struct CacheShape {
  int32_t n_layers = 0;      // layers that attend (main layers)
  int32_t latent_dim = 0;    // kv_lora_rank + qk_rope
  int32_t idx_dim = 0;       // indexer key dims; 0 without an indexer
  int32_t block_size = 16;   // tokens per block
  int32_t n_blocks = 0;
};

class PagedCache {
 public:
  explicit PagedCache(const CacheShape& shape);
  const CacheShape& shape() const { return shape_; }

  // Physical slot (block * block_size + offset) of position `pos` through a block table.
  int64_t slot(const std::vector<int32_t>& block_table, int64_t pos) const;
  float* latent(int32_t layer, int64_t slot) {            // [latent_dim]
    return latent_.data() + (int64_t(layer) * n_slots() + slot) * shape_.latent_dim;
  }
  float* index_key(int32_t layer, int64_t slot) {         // [idx_dim]
    return index_keys_.data() + (int64_t(layer) * n_slots() + slot) * shape_.idx_dim;
  }
  int64_t n_slots() const { return int64_t(shape_.n_blocks) * shape_.block_size; }

  // Block allocation. alloc() returns -1 when no block is free.
  int32_t alloc();
  void free(int32_t block);
  int32_t n_free() const { return int32_t(free_.size()); }
  // Grows `block_table` to cover `n_tokens` positions; false (and no change) when blocks run out.
  bool reserve(std::vector<int32_t>& block_table, int64_t n_tokens);
  void release(std::vector<int32_t>& block_table);

 private:
  CacheShape shape_;
  std::vector<float> latent_;      // [n_layers, n_slots, latent_dim]
  std::vector<float> index_keys_;  // [n_layers, n_slots, idx_dim]
  std::vector<int32_t> free_;
};

}  // namespace sparsemla::kv
