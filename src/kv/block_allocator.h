// Block allocation of a paged cache, apart from what the blocks hold: a free list of fixed-size
// blocks and the mapping of a sequence's positions to physical slots through its block table.
// kv::PagedCache (fp32 rows on the CPU) and the GPU cache (bf16 / fp8 rows in device memory) share
// it, so one host block table means the same slots in both.
#pragma once
#include <cstdint>
#include <vector>

namespace sparsemla::kv {

class BlockAllocator {
 public:
  // Every block free; alloc() hands them out in ascending order. Throws Error unless both are > 0.
  BlockAllocator(int32_t block_size, int32_t n_blocks);

  int32_t block_size() const { return block_size_; }
  int32_t n_blocks() const { return n_blocks_; }
  int64_t n_slots() const { return int64_t(n_blocks_) * block_size_; }

  // Physical slot (block * block_size + offset) of position `pos` through a block table.
  int64_t slot(const std::vector<int32_t>& block_table, int64_t pos) const;

  // alloc() returns -1 when no block is free.
  int32_t alloc();
  void free(int32_t block);
  int32_t n_free() const { return int32_t(free_.size()); }
  // Grows `block_table` to cover `n_tokens` positions; false (and no change) when blocks run out.
  bool reserve(std::vector<int32_t>& block_table, int64_t n_tokens);
  void release(std::vector<int32_t>& block_table);

 private:
  int32_t block_size_ = 0;
  int32_t n_blocks_ = 0;
  std::vector<int32_t> free_;  // a stack: the next block handed out is at the back
};

}  // namespace sparsemla::kv
