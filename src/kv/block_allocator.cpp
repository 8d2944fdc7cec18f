#include "kv/block_allocator.h"

#include "util/error.h"

namespace sparsemla::kv {

BlockAllocator::BlockAllocator(int32_t block_size, int32_t n_blocks) : block_size_(block_size), n_blocks_(n_blocks) {
  if (block_size <= 0 || n_blocks <= 0) fail("KV cache: {} blocks of {} tokens", n_blocks, block_size);
  for (int32_t b = n_blocks - 1; b >= 0; --b) free_.push_back(b);
}

int64_t BlockAllocator::slot(const std::vector<int32_t>& block_table, int64_t pos) const {
  const int64_t b = pos / block_size_;
  if (pos < 0 || b >= int64_t(block_table.size()))
    fail("KV cache: position {} is beyond the {} blocks of the sequence", pos, block_table.size());
  return int64_t(block_table[size_t(b)]) * block_size_ + pos % block_size_;
}

int32_t BlockAllocator::alloc() {
  if (free_.empty()) return -1;
  const int32_t b = free_.back();
  free_.pop_back();
  return b;
}

void BlockAllocator::free(int32_t block) { free_.push_back(block); }

bool BlockAllocator::reserve(std::vector<int32_t>& block_table, int64_t n_tokens) {
  const int64_t need = (n_tokens + block_size_ - 1) / block_size_ - int64_t(block_table.size());
  if (need <= 0) return true;
  if (need > int64_t(free_.size())) return false;
  for (int64_t i = 0; i < need; ++i) block_table.push_back(alloc());
  return true;
}

void BlockAllocator::release(std::vector<int32_t>& block_table) {
  for (int32_t b : block_table) free(b);
  block_table.clear();
}

}  // namespace sparsemla::kv
