#include "tokenizer/byte_level.h"

#include <array>

#include "tokenizer/utf8.h"

namespace sparsemla::tokenizer::byte_level {
namespace {

struct Tables {
  std::array<uint32_t, 256> to_cp{};
  std::array<int16_t, 0x144> to_byte{};  // code point -> byte, -1 outside the alphabet

  Tables() {
    to_byte.fill(-1);
    auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
    uint32_t moved = 0x100;
    for (int b = 0; b < 256; ++b) {
      to_cp[b] = printable(b) ? uint32_t(b) : moved++;
      to_byte[to_cp[b]] = int16_t(b);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

uint32_t byte_to_codepoint(uint8_t b) { return tables().to_cp[b]; }

void encode(std::string_view bytes, std::string& out) {
  const Tables& t = tables();
  for (unsigned char b : bytes) utf8::append_codepoint(out, t.to_cp[b]);
}

bool decode(std::string_view text, std::string& out) {
  const Tables& t = tables();
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = 0; i < text.size();) {
    const utf8::Step s = utf8::next(p + i, text.size() - i);
    if (s.status != utf8::Status::kValid || s.cp >= t.to_byte.size() || t.to_byte[s.cp] < 0) return false;
    out += char(t.to_byte[s.cp]);
    i += s.len;
  }
  return true;
}

}  // namespace sparsemla::tokenizer::byte_level
