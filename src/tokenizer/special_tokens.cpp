#include "tokenizer/special_tokens.h"

#include <algorithm>

namespace sparsemla::tokenizer {

void SpecialTokenMatcher::add(std::string_view text, int32_t id, bool always) {
  if (text.empty()) return;
  first_[uint8_t(text[0])] = true;
  size_t node = 0;
  for (unsigned char b : text) {
    auto& ch = nodes_[node].children;
    auto it = std::lower_bound(ch.begin(), ch.end(), b, [](const auto& c, unsigned char x) { return c.first < x; });
    if (it != ch.end() && it->first == b) {
      node = size_t(it->second);
      continue;
    }
    const int32_t child = int32_t(nodes_.size());
    ch.insert(it, {b, child});  // `ch` is not used after nodes_ grows below
    nodes_.emplace_back();
    node = size_t(child);
  }
  nodes_[node].id = id;
  nodes_[node].always = always;
}

SpecialTokenMatcher::Match SpecialTokenMatcher::longest_at(std::string_view text, bool all) const {
  Match best{-1, 0};
  size_t node = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const auto& ch = nodes_[node].children;
    const unsigned char b = uint8_t(text[i]);
    auto it = std::lower_bound(ch.begin(), ch.end(), b, [](const auto& c, unsigned char x) { return c.first < x; });
    if (it == ch.end() || it->first != b) break;
    node = size_t(it->second);
    if (nodes_[node].id >= 0 && (all || nodes_[node].always)) best = {nodes_[node].id, i + 1};
  }
  return best;
}

}  // namespace sparsemla::tokenizer
