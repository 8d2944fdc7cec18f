// The tokenizer of a GGUF model: byte-level BPE (tokenizer.ggml.model = gpt2) with the
// pre-tokenizer named by tokenizer.ggml.pre. Encoding follows Hugging Face tokenizers with
// add_special_tokens=False (plus an optional BOS); decoding turns ids back into UTF-8 text.
// A Tokenizer is immutable after loading and may be used from several threads at once.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/pretokenizer.h"
#include "tokenizer/special_tokens.h"

namespace sparsemla::gguf {
class File;
}

namespace sparsemla::tokenizer {

class Bpe;

// tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,      // chat markers, BOS/EOS: matched in text only when parsing special tokens
  kUserDefined = 4,  // added tokens: always matched in text
  kUnused = 5,       // padding rows of the vocabulary; decode to nothing
  kByte = 6,
};

class Tokenizer {
 public:
  // Reads tokenizer.ggml.{model,pre,tokens,token_type,merges,*_token_id,add_bos_token}. Throws
  // sparsemla::Error naming the key when one is missing or inconsistent. `pre_override`, when not
  // empty, replaces tokenizer.ggml.pre (for files converted with a wrong or missing name).
  static std::unique_ptr<Tokenizer> from_gguf(const gguf::File& f, std::string_view pre_override = {});
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Token ids of `text` (any bytes; ill-formed UTF-8 is tokenized byte by byte). Control tokens
  // written in the text become their ids when `parse_special`; user-defined ones always do.
  // `add_bos` puts the BOS token first (Error if the model has none).
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special = true) const;

  // The text of `ids`; ill-formed UTF-8 (a character cut between ids) becomes U+FFFD.
  // `skip_special` leaves out control and unknown tokens. Error for an id out of range.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // The token's text as stored in the vocabulary (byte-level form for normal tokens: "Ġthe").
  const std::string& token_text(int32_t id) const;
  // The raw bytes the token decodes to (may be part of a UTF-8 character; empty for unused ones).
  const std::string& token_bytes(int32_t id) const;
  TokenType token_type(int32_t id) const;
  // Whether decode(skip_special = true) leaves the token out.
  bool is_special(int32_t id) const;
  int32_t n_vocab() const { return int32_t(texts_.size()); }

  // -1 when the model has none.
  int32_t bos() const { return bos_; }
  int32_t eos() const { return eos_; }
  int32_t eot() const { return eot_; }
  int32_t eom() const { return eom_; }
  // Tokens that end generation: eos, eot, eom (those the model has), without repeats.
  std::vector<int32_t> eog_ids() const;
  bool is_eog(int32_t id) const;
  // The token whose vocabulary text is exactly `text`.
  std::optional<int32_t> find_token(std::string_view text) const;
  // tokenizer.ggml.add_bos_token; when absent, true only for the llama3 pre-tokenizers (as in
  // llama.cpp) and a model with a BOS.
  bool add_bos_default() const { return add_bos_; }
  const std::string& pre_name() const { return pre_name_; }
  const PreTokenizer& pre_tokenizer() const { return pre_; }

 private:
  explicit Tokenizer(PreTokenizer pre);
  void check_id(int32_t id) const;
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;

  std::vector<std::string> texts_;
  std::vector<std::string> bytes_;
  std::vector<TokenType> types_;
  std::unordered_map<std::string, int32_t> ids_;  // vocabulary text -> id
  std::string pre_name_;
  PreTokenizer pre_;
  std::unique_ptr<Bpe> bpe_;
  // Llama 3's tokenizer.json sets ignore_merges: a piece that is itself a token is not merged.
  bool ignore_merges_ = false;
  SpecialTokenMatcher specials_;
  int32_t bos_ = -1, eos_ = -1, eot_ = -1, eom_ = -1;
  bool add_bos_ = false;
};

// Turns ids into text one at a time, for streaming generated tokens. A UTF-8 character split
// across tokens is held back until it is complete, so that every returned chunk is valid UTF-8 and
// the chunks (with flush()) add up to decode() of all the ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = false) : tok_(tok), skip_special_(skip_special) {}

  // The text that `id` completes (often empty or one token's worth). Error for an id out of range.
  std::string push(int32_t id);
  // Whatever is held back, as U+FFFD (a character that never completed); resets the decoder.
  std::string flush();

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  std::string pending_;  // the start of a character that has not ended yet
};

}  // namespace sparsemla::tokenizer
