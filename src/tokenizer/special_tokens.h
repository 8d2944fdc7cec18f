// Finding control and user-defined tokens in text before BPE, as Hugging Face's added-vocabulary
// split does: the leftmost occurrence wins and, at one position, the longest token.
#pragma once
#include <array>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace sparsemla::tokenizer {

class SpecialTokenMatcher {
 public:
  // `always`: matched even when the caller does not parse special tokens (user-defined tokens).
  void add(std::string_view text, int32_t id, bool always);

  struct Match {
    int32_t id;
    size_t len;
  };
  // The longest token that `text` starts with; id -1 when none. Tokens added with always=false
  // count only when `all` is set.
  Match longest_at(std::string_view text, bool all) const;
  // Whether a token can start with byte b (a quick test before longest_at).
  bool may_start(unsigned char b) const { return first_[b]; }
  bool empty() const { return nodes_.size() <= 1; }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
    int32_t id = -1;
    bool always = false;
  };
  std::vector<Node> nodes_ = std::vector<Node>(1);  // nodes_[0] is the root
  std::array<bool, 256> first_{};
};

}  // namespace sparsemla::tokenizer
