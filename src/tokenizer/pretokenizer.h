// Pre-tokenizers of byte-level BPE models: they cut text into pieces ("words") before BPE, each
// exactly as Hugging Face tokenizers' Split(Regex, behavior="isolated") steps do with Oniguruma,
// but written as small matchers over code points (std::regex has no Unicode classes and is slow).
// Supported tokenizer.ggml.pre names:
//   glm4, chatglm-bpe, llama3, llama-v3, llama-bpe  one regex (GLM-4/5 use Llama 3's)
//   deepseek-v3                                      three regexes applied in turn
//   deepseek-llm                                     six regexes applied in turn
//   gpt-2 (also gpt2)                                GPT-2's regex
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace sparsemla::tokenizer {

// A text decoded once for matching: code points, their Unicode flags and byte offsets. Bytes that
// are not well-formed UTF-8 become one pseudo code point each (kInvalidByte + byte, no flags), so
// that any byte string can be tokenized and decodes back to itself.
struct CodepointText {
  static constexpr uint32_t kInvalidByte = 0x110000;
  std::vector<uint32_t> cps;
  std::vector<uint8_t> flags;
  std::vector<uint32_t> offsets;  // byte offset of each code point, plus the text size at the end

  // Error for texts of 4 GiB or more.
  void assign(std::string_view text);
  size_t size() const { return cps.size(); }
};

class PreTokenizer {
 public:
  // Error naming `name` and the supported names when it is not one of them.
  static PreTokenizer from_name(std::string_view name);
  static std::span<const std::string_view> names();

  // Byte ranges [first, second) of the pieces of `text`, in order, covering it entirely.
  using Pieces = std::vector<std::pair<uint32_t, uint32_t>>;
  void split(const CodepointText& text, Pieces& pieces) const;
  // The pieces as strings (for tests and tools).
  std::vector<std::string> split(std::string_view text) const;

  enum class Stage : uint8_t;  // one regex step, defined in pretokenizer.cpp

 private:
  explicit PreTokenizer(std::vector<Stage> stages) : stages_(std::move(stages)) {}
  void split_range(const CodepointText& t, size_t stage, size_t begin, size_t end, Pieces& out) const;
  std::vector<Stage> stages_;  // each splits the pieces of the one before
};

}  // namespace sparsemla::tokenizer
