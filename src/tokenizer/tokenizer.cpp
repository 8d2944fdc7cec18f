#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <array>

#include "gguf/reader.h"
#include "tokenizer/bpe.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

namespace sparsemla::tokenizer {
namespace {

constexpr std::string_view kModelKey = "tokenizer.ggml.model";
constexpr std::string_view kPreKey = "tokenizer.ggml.pre";
constexpr std::string_view kTokensKey = "tokenizer.ggml.tokens";
constexpr std::string_view kTypesKey = "tokenizer.ggml.token_type";
constexpr std::string_view kMergesKey = "tokenizer.ggml.merges";
constexpr std::string_view kAddBosKey = "tokenizer.ggml.add_bos_token";
constexpr std::string_view kBosKey = "tokenizer.ggml.bos_token_id";

const gguf::Value::Array& require_array(const gguf::File& f, std::string_view key, gguf::ValueType elem) {
  const gguf::Value::Array* a = f.get_array(key);
  if (!a) fail("{}: key '{}' is missing", f.paths()[0], key);
  if (a->elem != elem)
    fail("{}: key '{}' must be an array of {}, found an array of {}", f.paths()[0], key, gguf::value_type_name(elem),
         gguf::value_type_name(a->elem));
  return *a;
}

// llama.cpp adds BOS by default only for these pre-tokenizers (when add_bos_token is absent; here
// also only when the model has a BOS); they are also the ones whose tokenizer.json sets
// ignore_merges.
bool is_llama3_family(std::string_view pre) { return pre == "llama3" || pre == "llama-v3" || pre == "llama-bpe"; }

}  // namespace

Tokenizer::Tokenizer(PreTokenizer pre) : pre_(std::move(pre)) {}
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const gguf::File& f, std::string_view pre_override) {
  const std::string& path = f.paths()[0];
  const std::optional<std::string> model = f.get_string(kModelKey);
  if (!model) fail("{}: key '{}' is missing: the file has no tokenizer", path, kModelKey);
  if (*model != "gpt2") fail("{}: {} is '{}'; only 'gpt2' (byte-level BPE) is supported", path, kModelKey, *model);

  std::string pre_name(pre_override);
  if (pre_name.empty()) {
    const std::optional<std::string> pre = f.get_string(kPreKey);
    if (!pre) fail("{}: key '{}' is missing: the pre-tokenizer is unknown", path, kPreKey);
    pre_name = *pre;
  }
  std::unique_ptr<Tokenizer> t(new Tokenizer([&] {
    try {
      return PreTokenizer::from_name(pre_name);
    } catch (const Error& e) {
      fail("{}: {}", path, e.what());
    }
  }()));
  t->pre_name_ = pre_name;
  t->ignore_merges_ = is_llama3_family(pre_name);

  const gguf::Value::Array& tokens = require_array(f, kTokensKey, gguf::ValueType::STRING);
  const size_t n = tokens.items.size();
  if (n == 0) fail("{}: key '{}' is empty", path, kTokensKey);
  if (n > size_t(INT32_MAX)) fail("{}: key '{}' has {} tokens, too many", path, kTokensKey, n);
  t->texts_.reserve(n);
  t->ids_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    t->texts_.push_back(tokens.items[i].as_string());
    if (t->texts_.back().empty()) continue;  // cannot be matched or looked up; decodes to nothing
    auto [it, added] = t->ids_.emplace(t->texts_.back(), int32_t(i));
    if (!added) fail("{}: {} has '{}' twice, as ids {} and {}", path, kTokensKey, t->texts_.back(), it->second, i);
  }

  t->types_.assign(n, TokenType::kNormal);
  if (f.find(kTypesKey)) {
    const gguf::Value::Array& types = require_array(f, kTypesKey, gguf::ValueType::INT32);
    if (types.items.size() != n)
      fail("{}: {} has {} entries but {} has {}", path, kTypesKey, types.items.size(), kTokensKey, n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t v = types.items[i].as_i64();
      t->types_[i] = v >= 0 && v <= int64_t(TokenType::kByte) ? TokenType(v) : TokenType::kUndefined;
    }
  }

  t->bytes_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string& text = t->texts_[i];
    switch (t->types_[i]) {
      case TokenType::kControl:
      case TokenType::kUnknown:
        t->specials_.add(text, int32_t(i), false);
        t->bytes_[i] = text;
        break;
      case TokenType::kUserDefined:
        // llama.cpp's converter stores user-defined tokens as plain text, not in byte-level form.
        t->specials_.add(text, int32_t(i), true);
        t->bytes_[i] = text;
        break;
      case TokenType::kUnused:
        break;
      default:
        // A text outside the byte-level alphabet stands for its own UTF-8, as in Hugging Face's
        // ByteLevel decoder.
        if (!byte_level::decode(text, t->bytes_[i])) t->bytes_[i] = text;
    }
  }

  std::array<int32_t, 256> byte_tokens;
  for (int b = 0; b < 256; ++b) {
    std::string s;
    byte_level::encode(std::string_view(reinterpret_cast<const char*>(&b), 1), s);
    auto it = t->ids_.find(s);
    byte_tokens[b] = it == t->ids_.end() ? -1 : it->second;
  }

  const gguf::Value::Array& merges = require_array(f, kMergesKey, gguf::ValueType::STRING);
  std::vector<Bpe::Merge> rules;
  rules.reserve(merges.items.size());
  auto id_of = [&](const std::string& s, size_t i) {
    auto it = t->ids_.find(s);
    if (it == t->ids_.end())
      fail("{}: {}[{}] = '{}' needs token '{}', which is not in {}", path, kMergesKey, i, merges.items[i].as_string(), s,
           kTokensKey);
    return it->second;
  };
  for (size_t i = 0; i < merges.items.size(); ++i) {
    const std::string& m = merges.items[i].as_string();
    // Tokens in byte-level form hold no space; the search starts at 1 as llama.cpp's does.
    const size_t sp = m.find(' ', 1);
    if (sp == std::string::npos) fail("{}: {}[{}] = '{}' is not two tokens separated by a space", path, kMergesKey, i, m);
    const std::string left = m.substr(0, sp), right = m.substr(sp + 1);
    rules.push_back({id_of(left, i), id_of(right, i), id_of(left + right, i)});
  }
  t->bpe_ = std::make_unique<Bpe>(byte_tokens, rules);

  const std::pair<std::string_view, int32_t*> ids[] = {
      {kBosKey, &t->bos_},
      {"tokenizer.ggml.eos_token_id", &t->eos_},
      {"tokenizer.ggml.eot_token_id", &t->eot_},
      {"tokenizer.ggml.eom_token_id", &t->eom_},
  };
  for (auto [key, id] : ids) {
    const std::optional<uint64_t> v = f.get_uint(key);
    if (!v) continue;
    if (*v >= n) fail("{}: {} = {} is outside the vocabulary of {} tokens", path, key, *v, n);
    *id = int32_t(*v);
  }
  const std::optional<bool> add_bos = f.get_bool(kAddBosKey);
  t->add_bos_ = add_bos ? *add_bos : is_llama3_family(pre_name) && t->bos_ >= 0;
  if (t->add_bos_ && t->bos_ < 0) fail("{}: {} is true but {} is missing", path, kAddBosKey, kBosKey);
  return t;
}

void Tokenizer::check_id(int32_t id) const {
  if (id < 0 || id >= n_vocab())
    fail("token id {} is out of range: the vocabulary has {} tokens (ids 0..{})", id, n_vocab(), n_vocab() - 1);
}

const std::string& Tokenizer::token_text(int32_t id) const {
  check_id(id);
  return texts_[size_t(id)];
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  check_id(id);
  return bytes_[size_t(id)];
}

TokenType Tokenizer::token_type(int32_t id) const {
  check_id(id);
  return types_[size_t(id)];
}

bool Tokenizer::is_special(int32_t id) const {
  const TokenType type = token_type(id);
  return type == TokenType::kControl || type == TokenType::kUnknown;
}

std::vector<int32_t> Tokenizer::eog_ids() const {
  std::vector<int32_t> out;
  for (int32_t id : {eos_, eot_, eom_})
    if (id >= 0 && std::find(out.begin(), out.end(), id) == out.end()) out.push_back(id);
  return out;
}

bool Tokenizer::is_eog(int32_t id) const { return id >= 0 && (id == eos_ || id == eot_ || id == eom_); }

std::optional<int32_t> Tokenizer::find_token(std::string_view text) const {
  auto it = ids_.find(std::string(text));
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

void Tokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  CodepointText cps;
  cps.assign(text);
  PreTokenizer::Pieces pieces;
  pre_.split(cps, pieces);
  std::string word;
  for (auto [b, e] : pieces) {
    const std::string_view piece = text.substr(b, e - b);
    if (ignore_merges_) {
      word.clear();
      byte_level::encode(piece, word);
      if (auto it = ids_.find(word); it != ids_.end()) {
        out.push_back(it->second);
        continue;
      }
    }
    bpe_->encode(piece, out);
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
  std::vector<int32_t> out;
  if (add_bos) {
    if (bos_ < 0) fail("cannot add BOS: the model has no {}", kBosKey);
    out.push_back(bos_);
  }
  size_t segment = 0;  // start of the text not yet tokenized
  if (!specials_.empty()) {
    for (size_t i = 0; i < text.size();) {
      if (!specials_.may_start(uint8_t(text[i]))) {
        ++i;
        continue;
      }
      const SpecialTokenMatcher::Match m = specials_.longest_at(text.substr(i), parse_special);
      if (m.id < 0) {
        ++i;
        continue;
      }
      encode_text(text.substr(segment, i - segment), out);
      out.push_back(m.id);
      i += m.len;
      segment = i;
    }
  }
  encode_text(text.substr(segment), out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (skip_special && is_special(id)) continue;
    bytes += token_bytes(id);
  }
  std::string out;
  utf8::append_lossy(out, bytes);
  return out;
}

}  // namespace sparsemla::tokenizer
