#include "kv/paged_cache.h"

#include "util/error.h"

namespace sparsemla::kv {

PagedCache::PagedCache(const CacheShape& shape) : shape_(shape) {
  if (shape.block_size <= 0 || shape.n_blocks <= 0 || shape.n_layers <= 0 || shape.latent_dim <= 0)
    fail("KV cache: invalid shape ({} layers, latent {}, {} blocks of {})", shape.n_layers, shape.latent_dim,
         shape.n_blocks, shape.block_size);
  latent_.assign(size_t(shape.n_layers) * size_t(n_slots()) * size_t(shape.latent_dim), 0.0f);
  index_keys_.assign(size_t(shape.n_layers) * size_t(n_slots()) * size_t(shape.idx_dim), 0.0f);
  for (int32_t b = shape.n_blocks - 1; b >= 0; --b) free_.push_back(b);
}

int64_t PagedCache::slot(const std::vector<int32_t>& block_table, int64_t pos) const {
  const int64_t b = pos / shape_.block_size;
  if (pos < 0 || b >= int64_t(block_table.size()))
    fail("KV cache: position {} is beyond the {} blocks of the sequence", pos, block_table.size());
  return int64_t(block_table[size_t(b)]) * shape_.block_size + pos % shape_.block_size;
}

int32_t PagedCache::alloc() {
  if (free_.empty()) return -1;
  const int32_t b = free_.back();
  free_.pop_back();
  return b;
}

void PagedCache::free(int32_t block) { free_.push_back(block); }

bool PagedCache::reserve(std::vector<int32_t>& block_table, int64_t n_tokens) {
  const int64_t need = (n_tokens + shape_.block_size - 1) / shape_.block_size - int64_t(block_table.size());
  if (need <= 0) return true;
  if (need > int64_t(free_.size())) return false;
  for (int64_t i = 0; i < need; ++i) block_table.push_back(alloc());
  return true;
}

void PagedCache::release(std::vector<int32_t>& block_table) {
  for (int32_t b : block_table) free(b);
  block_table.clear();
}

}  // namespace sparsemla::kv
