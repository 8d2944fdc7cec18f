// UTF-8 as the tokenizer needs it: reading one character with the exact well-formedness rules of
// the Unicode standard (table 3-7), and turning arbitrary bytes into valid UTF-8 the way Hugging
// Face's decoder does (Rust's String::from_utf8_lossy: one U+FFFD per maximal ill-formed subpart).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace sparsemla::tokenizer::utf8 {

enum class Status : uint8_t {
  kValid,      // a whole character of `len` bytes
  kInvalid,    // `len` bytes form a maximal subpart of an ill-formed sequence: replace by one U+FFFD
  kTruncated,  // all remaining bytes (`len`) are a valid start of a character that has not ended
};

struct Step {
  Status status;
  uint32_t len;
  uint32_t cp;  // for kValid only
};

// Reads the character starting at p[0]; n >= 1 bytes are available.
Step next(const unsigned char* p, size_t n);

inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

void append_codepoint(std::string& out, uint32_t cp);

// Appends `bytes` with every ill-formed subpart (a truncated tail included) replaced by U+FFFD.
void append_lossy(std::string& out, std::string_view bytes);

// Like append_lossy, but stops before a truncated character at the end, which more bytes could
// still complete. Returns the number of bytes consumed.
size_t append_complete(std::string& out, std::string_view bytes);

bool is_valid(std::string_view bytes);

}  // namespace sparsemla::tokenizer::utf8
