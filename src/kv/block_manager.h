// Shared blocks over a paged cache's BlockAllocator (kv::PagedCache, the GPU caches): reference
// counts, and a prefix cache keyed by block hash. A full block whose rows are written is published
// under the chained hash of every token up to its end; a later sequence that starts with the same
// tokens references it instead of computing it again (the rows of a position depend only on the
// tokens before it). A block no sequence references stays cached until its memory is needed,
// oldest first.
#pragma once
#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "kv/block_allocator.h"

namespace sparsemla::kv {

// The hash of a block of tokens following the blocks hashed by `parent` (kRootHash for the first).
inline constexpr uint64_t kRootHash = 0xcbf29ce484222325ull;
uint64_t block_hash(uint64_t parent, std::span<const int32_t> block_tokens);
// The chained hashes of the full blocks of `tokens`.
std::vector<uint64_t> block_hashes(std::span<const int32_t> tokens, int32_t block_size);

class BlockManager {
 public:
  // Takes over the allocation of every block of `cache` (which must have none handed out).
  explicit BlockManager(BlockAllocator& cache);

  int32_t block_size() const { return cache_.block_size(); }
  int32_t n_blocks() const { return cache_.n_blocks(); }
  // Blocks that can be handed out now: never used, or cached without a reference.
  int32_t n_available() const { return cache_.n_free() + int32_t(idle_.size()); }
  int32_t n_used() const { return n_blocks() - n_available(); }
  int32_t n_cached() const { return int32_t(idle_.size()); }

  struct PrefixMatch {
    int32_t blocks = 0;  // leading blocks found in the cache
    int32_t idle = 0;    // of those, how many no sequence references (acquiring them takes them from n_available)
  };
  // The leading run of `hashes` (with `tokens` to confirm each block's content) that the cache holds.
  PrefixMatch match(std::span<const uint64_t> hashes, std::span<const int32_t> tokens) const;
  // References the first `n_blocks` blocks of a match, appending them to `table`.
  void acquire(std::span<const uint64_t> hashes, int32_t n_blocks, std::vector<int32_t>& table);
  // Appends fresh blocks until `table` covers `n_tokens` positions, evicting cached blocks when no
  // free one is left. Returns how many were added, or -1 (and no change) when there are too few.
  int32_t grow(std::vector<int32_t>& table, int64_t n_tokens);
  // Records that `block`, whose rows are all written, holds `block_tokens` after the prefix hashed
  // into `hash`. A content already cached in another block is not recorded twice.
  void publish(int32_t block, uint64_t hash, std::span<const int32_t> block_tokens);
  // Drops the sequence's references; unreferenced blocks become free or, when published, idle.
  void release(std::vector<int32_t>& table);

  int32_t ref_count(int32_t block) const { return blocks_[size_t(block)].refs; }

 private:
  struct Block {
    int32_t refs = 0;
    bool published = false;
    uint64_t hash = 0;
    std::vector<int32_t> tokens;            // [block_size] when published
    std::list<int32_t>::iterator idle_pos;  // where it sits in idle_ when refs == 0 and published
  };
  int32_t take_fresh();

  BlockAllocator& cache_;
  std::vector<Block> blocks_;                      // [n_blocks]
  std::unordered_map<uint64_t, int32_t> by_hash_;  // published hash -> block
  std::list<int32_t> idle_;                        // published, unreferenced; least recently used first
};

}  // namespace sparsemla::kv
