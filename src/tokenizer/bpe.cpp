#include "tokenizer/bpe.h"

#include <algorithm>
#include <bit>
#include <queue>

namespace sparsemla::tokenizer {
namespace {

uint64_t pair_key(int32_t left, int32_t right) { return (uint64_t(uint32_t(left)) << 32) | uint32_t(right); }

}  // namespace

Bpe::Bpe(const std::array<int32_t, 256>& byte_tokens, const std::vector<Merge>& merges) : byte_tokens_(byte_tokens) {
  const size_t size = std::bit_ceil(std::max<size_t>(16, merges.size() * 2));
  shift_ = uint32_t(64 - std::countr_zero(size));
  table_.assign(size, Entry{kEmpty, 0, 0});
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const Merge& m = merges[rank];
    const uint64_t key = pair_key(m.left, m.right);
    size_t slot = size_t((key * 0x9E3779B97F4A7C15ull) >> shift_);
    while (table_[slot].key != kEmpty && table_[slot].key != key) slot = (slot + 1) & (size - 1);
    table_[slot] = Entry{key, uint32_t(rank), m.result};
  }
}

const Bpe::Entry* Bpe::find(int32_t left, int32_t right) const {
  const uint64_t key = pair_key(left, right);
  const size_t mask = table_.size() - 1;
  for (size_t slot = size_t((key * 0x9E3779B97F4A7C15ull) >> shift_);; slot = (slot + 1) & mask) {
    const Entry& e = table_[slot];
    if (e.key == key) return &e;
    if (e.key == kEmpty) return nullptr;
  }
}

void Bpe::merge(std::string_view piece, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // neighbours still alive, -1 at the ends
    bool alive;
  };
  std::vector<Symbol> sym;
  sym.reserve(piece.size());
  for (unsigned char b : piece) {
    if (byte_tokens_[b] < 0) continue;
    const int32_t n = int32_t(sym.size());
    sym.push_back({byte_tokens_[b], n - 1, n + 1, true});
  }
  if (sym.empty()) return;
  sym.back().next = -1;

  struct Candidate {
    uint32_t rank;
    int32_t pos;     // the left symbol
    int32_t result;  // to recognise candidates made stale by other merges
  };
  auto later = [](const Candidate& a, const Candidate& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
  auto consider = [&](int32_t pos) {
    if (pos < 0 || sym[pos].next < 0) return;
    if (const Entry* e = find(sym[pos].id, sym[sym[pos].next].id)) queue.push({e->rank, pos, e->result});
  };
  for (int32_t i = 0; i + 1 < int32_t(sym.size()); ++i) consider(i);

  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = sym[c.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = sym[left.next];
    const Entry* e = find(left.id, right.id);
    if (!e || e->result != c.result) continue;
    left.id = c.result;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = c.pos;
    consider(left.prev);
    consider(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
}

void Bpe::encode(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    if (const int32_t id = byte_tokens_[uint8_t(piece[0])]; id >= 0) out.push_back(id);
    return;
  }
  if (piece.size() > kMaxCachedBytes) return merge(piece, out);
  const std::string key(piece);
  {
    std::lock_guard lock(cache_mutex_);
    if (auto it = cache_.find(key); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge(piece, out);
  std::lock_guard lock(cache_mutex_);
  if (cache_.size() >= kMaxCacheEntries) cache_.clear();
  cache_.emplace(key, std::vector<int32_t>(out.begin() + first, out.end()));
}

}  // namespace sparsemla::tokenizer
