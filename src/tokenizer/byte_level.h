// GPT-2's byte-level alphabet: every byte is stored in the vocabulary as one printable code point
// (bytes_to_unicode in GPT-2's encoder.py): printable Latin-1 bytes stand for themselves, the 68
// others are moved to U+0100..U+0143 in byte order (space becomes 'Ġ' U+0120, \n 'Ċ' U+010A).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace sparsemla::tokenizer::byte_level {

uint32_t byte_to_codepoint(uint8_t b);

// Appends the vocabulary form of `bytes` (UTF-8 of the mapped code points).
void encode(std::string_view bytes, std::string& out);

// Appends the bytes that vocabulary text `text` stands for. Returns false (leaving `out` with a
// partial result) when `text` holds a code point outside the alphabet or is not UTF-8.
bool decode(std::string_view text, std::string& out);

}  // namespace sparsemla::tokenizer::byte_level
