// Reference-counted blocks with a prefix cache: sharing, confirmation of content, eviction order,
// and that no block is ever handed out twice.
#include <gtest/gtest.h>

#include <map>

#include "kv/block_manager.h"
#include "kv/paged_cache.h"

namespace sparsemla::kv {
namespace {

CacheShape shape(int32_t n_blocks) {
  CacheShape s;
  s.n_layers = 1;
  s.latent_dim = 2;
  s.block_size = 4;
  s.n_blocks = n_blocks;
  return s;
}

std::vector<int32_t> iota_tokens(int n, int32_t start = 0) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) v.push_back(start + i);
  return v;
}

// Publishes every full block of `tokens` held by `table`.
void publish_all(BlockManager& bm, const std::vector<int32_t>& table, const std::vector<int32_t>& tokens) {
  const auto hashes = block_hashes(tokens, 4);
  for (size_t k = 0; k < hashes.size(); ++k) bm.publish(table[k], hashes[k], std::span(tokens).subspan(k * 4, 4));
}

TEST(BlockHash, ChainsOverTheWholePrefix) {
  const auto a = block_hashes(iota_tokens(12), 4);
  ASSERT_EQ(a.size(), 3u);
  auto other = iota_tokens(12);
  other[1] = 99;  // the first block differs: every later hash does too
  const auto b = block_hashes(other, 4);
  for (size_t k = 0; k < 3; ++k) EXPECT_NE(a[k], b[k]);
  EXPECT_EQ(block_hashes(iota_tokens(11), 4).size(), 2u);  // only full blocks
}

TEST(BlockManager, SharesPublishedPrefixBlocks) {
  PagedCache cache(shape(8));
  BlockManager bm(cache);
  const auto tokens = iota_tokens(10);
  std::vector<int32_t> a;
  ASSERT_EQ(bm.grow(a, 10), 3);
  publish_all(bm, a, tokens);
  EXPECT_EQ(bm.n_used(), 3);

  const auto hashes = block_hashes(tokens, 4);
  const auto m = bm.match(hashes, tokens);
  EXPECT_EQ(m.blocks, 2);
  EXPECT_EQ(m.idle, 0);  // a still holds them
  std::vector<int32_t> b;
  bm.acquire(hashes, m.blocks, b);
  EXPECT_EQ(b, std::vector<int32_t>(a.begin(), a.begin() + 2));
  EXPECT_EQ(bm.ref_count(a[0]), 2);
  EXPECT_EQ(bm.n_used(), 3);

  bm.release(a);
  EXPECT_EQ(bm.ref_count(b[0]), 1);
  EXPECT_EQ(bm.n_used(), 2);
  bm.release(b);
  EXPECT_EQ(bm.n_used(), 0);
  EXPECT_EQ(bm.n_cached(), 2);  // the published blocks stay for the next request
  EXPECT_EQ(bm.n_available(), 8);
  EXPECT_EQ(bm.match(hashes, tokens).idle, 2);
}

TEST(BlockManager, ContentIsConfirmedNotJustHashed) {
  PagedCache cache(shape(4));
  BlockManager bm(cache);
  const auto tokens = iota_tokens(8);
  std::vector<int32_t> a;
  bm.grow(a, 8);
  const auto hashes = block_hashes(tokens, 4);
  // A block published under the right hash with other tokens (as a collision would) is not reused.
  bm.publish(a[0], hashes[0], iota_tokens(4, 100));
  EXPECT_EQ(bm.match(hashes, tokens).blocks, 0);
}

TEST(BlockManager, EvictsTheLeastRecentlyReleasedTailFirst) {
  PagedCache cache(shape(4));
  BlockManager bm(cache);
  const auto t1 = iota_tokens(8), t2 = iota_tokens(8, 50);
  std::vector<int32_t> a, b;
  bm.grow(a, 8);
  publish_all(bm, a, t1);
  bm.grow(b, 8);
  publish_all(bm, b, t2);
  bm.release(a);
  bm.release(b);
  EXPECT_EQ(bm.n_cached(), 4);
  // One fresh block: a's second block goes first (a was released first, tail before head).
  std::vector<int32_t> c;
  ASSERT_EQ(bm.grow(c, 4), 1);
  EXPECT_EQ(c[0], a[1]);
  EXPECT_EQ(bm.match(block_hashes(t1, 4), t1).blocks, 1);
  EXPECT_EQ(bm.match(block_hashes(t2, 4), t2).blocks, 2);
}

TEST(BlockManager, NeverHandsOutABlockTwice) {
  PagedCache cache(shape(6));
  BlockManager bm(cache);
  std::vector<std::vector<int32_t>> tables(3);
  for (int round = 0; round < 20; ++round) {
    for (size_t s = 0; s < tables.size(); ++s) {
      const auto tokens = iota_tokens(8, int32_t((round + s) % 3) * 10);
      if (!tables[s].empty() && (round + s) % 2 == 0) {
        bm.release(tables[s]);
        continue;
      }
      if (tables[s].empty()) {
        const auto hashes = block_hashes(tokens, 4);
        const auto m = bm.match(hashes, tokens);
        bm.acquire(hashes, std::min(m.blocks, 1), tables[s]);
        if (bm.grow(tables[s], 8) < 0) {
          bm.release(tables[s]);
          continue;
        }
        publish_all(bm, tables[s], tokens);
      }
    }
    // A block in two tables must be a shared, published prefix block with a count for each.
    std::map<int32_t, int> seen;
    for (const auto& t : tables)
      for (int32_t b : t) ++seen[b];
    int used = 0;
    for (const auto& [b, n] : seen) {
      EXPECT_EQ(bm.ref_count(b), n) << "round " << round << " block " << b;
      ++used;
    }
    EXPECT_EQ(bm.n_used(), used);
  }
}

TEST(BlockManager, GrowFailsWithoutChangeWhenShort) {
  PagedCache cache(shape(2));
  BlockManager bm(cache);
  std::vector<int32_t> a;
  EXPECT_EQ(bm.grow(a, 12), -1);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(bm.n_available(), 2);
}

}  // namespace
}  // namespace sparsemla::kv
