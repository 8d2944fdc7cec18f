#include "tokenizer/unicode.h"

#include <array>
#include <map>
#include <string_view>
#include <vector>

namespace sparsemla::tokenizer::unicode {
namespace {

constexpr uint32_t kBlockBits = 8;
constexpr uint32_t kBlockSize = 1u << kBlockBits;
constexpr uint32_t kBlockCount = (kMaxCodepoint + 1) >> kBlockBits;

// stage1[cp >> 8] picks a 256-entry block of stage2; identical blocks are stored once, which
// keeps the table near 150 KB instead of 1.1 MB for one byte per code point.
struct Table {
  std::array<uint16_t, kBlockCount> stage1{};
  std::vector<uint8_t> stage2;

  Table() {
    std::vector<uint8_t> all(kMaxCodepoint + 1, 0);
    for (size_t i = 0; i < kRangeCount; ++i)
      for (uint32_t cp = kRanges[i].first; cp <= kRanges[i].last; ++cp) all[cp] = kRanges[i].flags;
    std::map<std::string_view, uint16_t> seen;
    for (uint32_t b = 0; b < kBlockCount; ++b) {
      const std::string_view block(reinterpret_cast<const char*>(all.data()) + b * kBlockSize, kBlockSize);
      auto [it, added] = seen.emplace(block, uint16_t(seen.size()));
      if (added) stage2.insert(stage2.end(), block.begin(), block.end());
      stage1[b] = it->second;
    }
  }
};

const Table& table() {
  static const Table t;
  return t;
}

}  // namespace

uint8_t flags(uint32_t cp) {
  if (cp > kMaxCodepoint) return 0;
  const Table& t = table();
  return t.stage2[size_t(t.stage1[cp >> kBlockBits]) * kBlockSize + (cp & (kBlockSize - 1))];
}

}  // namespace sparsemla::tokenizer::unicode
