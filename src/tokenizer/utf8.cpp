#include "tokenizer/utf8.h"

namespace sparsemla::tokenizer::utf8 {

Step next(const unsigned char* p, size_t n) {
  const unsigned char b0 = p[0];
  if (b0 < 0x80) return {Status::kValid, 1, b0};
  // Length and the allowed range of the second byte (table 3-7 excludes overlong forms,
  // surrogates and code points above U+10FFFF through that range).
  uint32_t len;
  unsigned char lo = 0x80, hi = 0xBF;
  uint32_t cp;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2, cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3, cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4, cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {Status::kInvalid, 1, 0};  // a continuation byte, C0, C1 or F5..FF
  }
  for (uint32_t k = 1; k < len; ++k) {
    if (k >= n) return {Status::kTruncated, k, 0};
    const unsigned char b = p[k];
    if (b < lo || b > hi) return {Status::kInvalid, k, 0};
    cp = (cp << 6) | (b & 0x3F);
    lo = 0x80, hi = 0xBF;
  }
  return {Status::kValid, len, cp};
}

void append_codepoint(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

namespace {

// Appends bytes up to the end or, when `keep_truncated`, up to a truncated tail; returns bytes used.
size_t append_checked(std::string& out, std::string_view bytes, bool keep_truncated) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0, clean = 0;  // bytes [clean, i) are valid and not yet appended
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    const Step s = next(p + i, n - i);
    if (s.status == Status::kValid) {
      i += s.len;
      continue;
    }
    out.append(bytes.data() + clean, i - clean);
    if (s.status == Status::kTruncated && keep_truncated) return i;
    out += kReplacement;
    i += s.len;
    clean = i;
  }
  out.append(bytes.data() + clean, n - clean);
  return n;
}

}  // namespace

void append_lossy(std::string& out, std::string_view bytes) { append_checked(out, bytes, false); }

size_t append_complete(std::string& out, std::string_view bytes) { return append_checked(out, bytes, true); }

bool is_valid(std::string_view bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  for (size_t i = 0; i < bytes.size();) {
    const Step s = next(p + i, bytes.size() - i);
    if (s.status != Status::kValid) return false;
    i += s.len;
  }
  return true;
}

}  // namespace sparsemla::tokenizer::utf8
