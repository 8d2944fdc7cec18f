// Byte-pair encoding of one pre-tokenized piece: start from one token per byte, then apply merges
// in rank order, exactly as Hugging Face tokenizers' BPE model does (lowest rank first, leftmost
// first among equal ranks). Results for short pieces are cached, since words repeat a lot.
#pragma once
#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace sparsemla::tokenizer {

class Bpe {
 public:
  struct Merge {
    int32_t left, right, result;  // token ids; `result` is the token of left's text + right's text
  };

  // `byte_tokens[b]`: the token of byte b alone, -1 when the vocabulary lacks it (such bytes are
  // dropped, as Hugging Face does for a BPE model without an unknown token). `merges` in rank
  // order; when a pair appears twice the later rank wins, as in Hugging Face.
  Bpe(const std::array<int32_t, 256>& byte_tokens, const std::vector<Merge>& merges);

  // Appends the tokens of `piece` (raw bytes).
  void encode(std::string_view piece, std::vector<int32_t>& out) const;

 private:
  struct Entry {
    uint64_t key;  // (left << 32) | right; kEmpty for a free slot
    uint32_t rank;
    int32_t result;
  };
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  const Entry* find(int32_t left, int32_t right) const;
  void merge(std::string_view piece, std::vector<int32_t>& out) const;

  std::array<int32_t, 256> byte_tokens_;
  std::vector<Entry> table_;  // open addressing, power-of-two size
  uint32_t shift_ = 0;

  static constexpr size_t kMaxCachedBytes = 64;
  static constexpr size_t kMaxCacheEntries = 1 << 16;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace sparsemla::tokenizer
