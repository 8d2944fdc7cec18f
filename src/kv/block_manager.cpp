#include "kv/block_manager.h"

#include <algorithm>

#include "util/error.h"

namespace sparsemla::kv {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t block_hash(uint64_t parent, std::span<const int32_t> block_tokens) {
  uint64_t h = mix(parent);
  for (int32_t t : block_tokens) h = mix(h ^ uint64_t(uint32_t(t)));
  return h;
}

std::vector<uint64_t> block_hashes(std::span<const int32_t> tokens, int32_t block_size) {
  std::vector<uint64_t> out;
  uint64_t h = kRootHash;
  for (size_t b = 0; (b + 1) * size_t(block_size) <= tokens.size(); ++b) {
    h = block_hash(h, tokens.subspan(b * size_t(block_size), size_t(block_size)));
    out.push_back(h);
  }
  return out;
}

BlockManager::BlockManager(BlockAllocator& cache) : cache_(cache), blocks_(size_t(cache.n_blocks())) {
  if (cache.n_free() != cache.n_blocks())
    fail("block manager: the cache already has {} of its {} blocks handed out", cache.n_blocks() - cache.n_free(),
         cache.n_blocks());
}

BlockManager::PrefixMatch BlockManager::match(std::span<const uint64_t> hashes, std::span<const int32_t> tokens) const {
  PrefixMatch m;
  const size_t bs = size_t(block_size());
  for (size_t k = 0; k < hashes.size() && (k + 1) * bs <= tokens.size(); ++k) {
    auto it = by_hash_.find(hashes[k]);
    if (it == by_hash_.end()) break;
    const Block& b = blocks_[size_t(it->second)];
    // The hash names the content; the tokens confirm it (a 64-bit collision must not leak rows).
    if (!std::equal(b.tokens.begin(), b.tokens.end(), tokens.begin() + int64_t(k * bs))) break;
    ++m.blocks;
    if (b.refs == 0) ++m.idle;
  }
  return m;
}

void BlockManager::acquire(std::span<const uint64_t> hashes, int32_t n_blocks, std::vector<int32_t>& table) {
  for (int32_t k = 0; k < n_blocks; ++k) {
    auto it = by_hash_.find(hashes[size_t(k)]);
    if (it == by_hash_.end()) fail("block manager: block {} of the prefix is not cached", k);
    Block& b = blocks_[size_t(it->second)];
    if (b.refs++ == 0) idle_.erase(b.idle_pos);
    table.push_back(it->second);
  }
}

int32_t BlockManager::take_fresh() {
  int32_t id = cache_.alloc();
  if (id >= 0) return id;
  // Evict the least recently used cached block: its content is forgotten.
  id = idle_.front();
  idle_.pop_front();
  Block& b = blocks_[size_t(id)];
  by_hash_.erase(b.hash);
  b.published = false;
  b.tokens.clear();
  return id;
}

int32_t BlockManager::grow(std::vector<int32_t>& table, int64_t n_tokens) {
  const int64_t need = (n_tokens + block_size() - 1) / block_size() - int64_t(table.size());
  if (need <= 0) return 0;
  if (need > n_available()) return -1;
  for (int64_t i = 0; i < need; ++i) {
    const int32_t id = take_fresh();
    blocks_[size_t(id)].refs = 1;
    table.push_back(id);
  }
  return int32_t(need);
}

void BlockManager::publish(int32_t block, uint64_t hash, std::span<const int32_t> block_tokens) {
  Block& b = blocks_[size_t(block)];
  if (b.published || by_hash_.count(hash)) return;
  b.published = true;
  b.hash = hash;
  b.tokens.assign(block_tokens.begin(), block_tokens.end());
  by_hash_[hash] = block;
}

void BlockManager::release(std::vector<int32_t>& table) {
  // Last block first: a prefix's tail is evicted before its head, which more sequences share.
  for (auto it = table.rbegin(); it != table.rend(); ++it) {
    const int32_t id = *it;
    Block& b = blocks_[size_t(id)];
    if (b.refs <= 0) fail("block manager: block {} released more often than referenced", id);
    if (--b.refs > 0) continue;
    if (b.published) b.idle_pos = idle_.insert(idle_.end(), id);
    else cache_.free(id);
  }
  table.clear();
}

}  // namespace sparsemla::kv
