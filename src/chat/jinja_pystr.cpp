#include "chat/jinja_pystr.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace sparsemla::chat::jinja::py {

char32_t next_code_point(std::string_view s, size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  size_t len = 0;
  char32_t cp = 0;
  char32_t min = 0;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2, cp = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, cp = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, cp = b0 & 0x07, min = 0x10000;
  }
  const auto invalid = [&] {
    ++i;
    return char32_t(0xDC00 + b0);
  };
  if (len == 0 || i + len > s.size()) return invalid();
  for (size_t k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return invalid();
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return invalid();
  i += len;
  return cp;
}

void append_code_point(std::string& out, char32_t c) {
  if (c >= 0xDC80 && c <= 0xDCFF) {  // an undecodable byte, restored
    out.push_back(static_cast<char>(c - 0xDC00));
    return;
  }
  if (c >= 0xD800 && c <= 0xDFFF) c = 0xFFFD;
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::u32string decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) out.push_back(next_code_point(s, i));
  return out;
}

std::string encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) append_code_point(out, c);
  return out;
}

bool is_ascii(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

size_t length(std::string_view s) {
  if (is_ascii(s)) return s.size();
  size_t n = 0;
  for (size_t i = 0; i < s.size(); ++n) next_code_point(s, i);
  return n;
}

size_t byte_offset(std::string_view s, size_t code_points) {
  size_t i = 0;
  for (size_t k = 0; k < code_points && i < s.size(); ++k) next_code_point(s, i);
  return i;
}

bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

bool is_printable(char32_t c) {
  struct Range {
    char32_t lo, hi;
  };
  // Control (Cc), format (Cf), separator (Zs but the space, Zl, Zp), surrogate (Cs), private use (Co)
  // and noncharacters: what Python's repr() escapes.
  static constexpr Range kNonPrintable[] = {
      {0x00, 0x1F},       {0x7F, 0xA0},       {0xAD, 0xAD},       {0x600, 0x605},     {0x61C, 0x61C},
      {0x6DD, 0x6DD},     {0x70F, 0x70F},     {0x890, 0x891},     {0x8E2, 0x8E2},     {0x1680, 0x1680},
      {0x180E, 0x180E},   {0x2000, 0x200F},   {0x2028, 0x202F},   {0x205F, 0x2064},   {0x2066, 0x206F},
      {0x3000, 0x3000},   {0xD800, 0xF8FF},   {0xFDD0, 0xFDEF},   {0xFEFF, 0xFEFF},   {0xFFF9, 0xFFFB},
      {0xFFFE, 0xFFFF},   {0x110BD, 0x110BD}, {0x110CD, 0x110CD}, {0x13430, 0x1343F}, {0x1BCA0, 0x1BCA3},
      {0x1D173, 0x1D17A}, {0xE0001, 0xE0001}, {0xE0020, 0xE007F}, {0xF0000, 0x10FFFF},
  };
  for (const Range& r : kNonPrintable) {
    if (c < r.lo) return true;
    if (c <= r.hi) return false;
  }
  return true;
}

namespace {

char32_t lower_cp(char32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 32;
  if (c >= 0x100 && c <= 0x17F) {
    if (c == 0x130) return 'i';
    if (c == 0x178) return 0xFF;
    if ((c <= 0x137) || (c >= 0x14A && c <= 0x177)) return c % 2 == 0 ? c + 1 : c;
    if ((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) return c % 2 == 1 ? c + 1 : c;
    return c;
  }
  if (c >= 0x391 && c <= 0x3AB && c != 0x3A2) return c + 32;
  if (c == 0x386) return 0x3AC;
  if (c >= 0x388 && c <= 0x38A) return c + 37;
  if (c == 0x38C) return 0x3CC;
  if (c == 0x38E || c == 0x38F) return c + 63;
  if (c >= 0x400 && c <= 0x40F) return c + 80;
  if (c >= 0x410 && c <= 0x42F) return c + 32;
  if ((c >= 0x460 && c <= 0x481) || (c >= 0x48A && c <= 0x4BF) || (c >= 0x4D0 && c <= 0x52F))
    return c % 2 == 0 ? c + 1 : c;
  if (c == 0x4C0) return 0x4CF;
  if (c >= 0x4C1 && c <= 0x4CE) return c % 2 == 1 ? c + 1 : c;
  if (c >= 0x531 && c <= 0x556) return c + 48;
  if ((c >= 0x1E00 && c <= 0x1E95) || (c >= 0x1EA0 && c <= 0x1EFF)) return c % 2 == 0 ? c + 1 : c;
  if (c == 0x1E9E) return 0xDF;
  if (c >= 0xFF21 && c <= 0xFF3A) return c + 32;
  return c;
}

char32_t upper_cp(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
  if (c >= 0xE0 && c <= 0xFE && c != 0xF7) return c - 32;
  if (c == 0xFF) return 0x178;
  if (c == 0xB5) return 0x39C;
  if (c >= 0x100 && c <= 0x17F) {
    if (c == 0x131) return 'I';
    if (c == 0x17F) return 'S';
    if ((c >= 0x101 && c <= 0x137) || (c >= 0x14B && c <= 0x177)) return c % 2 == 1 ? c - 1 : c;
    if ((c >= 0x13A && c <= 0x148) || (c >= 0x17A && c <= 0x17E)) return c % 2 == 0 ? c - 1 : c;
    return c;
  }
  if (c >= 0x3B1 && c <= 0x3CB && c != 0x3C2) return c - 32;
  if (c == 0x3C2) return 0x3A3;
  if (c == 0x3AC) return 0x386;
  if (c >= 0x3AD && c <= 0x3AF) return c - 37;
  if (c == 0x3CC) return 0x38C;
  if (c == 0x3CD || c == 0x3CE) return c - 63;
  if (c >= 0x430 && c <= 0x44F) return c - 32;
  if (c >= 0x450 && c <= 0x45F) return c - 80;
  if ((c >= 0x461 && c <= 0x481) || (c >= 0x48B && c <= 0x4BF) || (c >= 0x4D1 && c <= 0x52F))
    return c % 2 == 1 ? c - 1 : c;
  if (c == 0x4CF) return 0x4C0;
  if (c >= 0x4C2 && c <= 0x4CE) return c % 2 == 0 ? c - 1 : c;
  if (c >= 0x561 && c <= 0x586) return c - 48;
  if ((c >= 0x1E01 && c <= 0x1E95) || (c >= 0x1EA1 && c <= 0x1EFF)) return c % 2 == 1 ? c - 1 : c;
  if (c >= 0xFF41 && c <= 0xFF5A) return c - 32;
  return c;
}

bool is_upper_cp(char32_t c) { return lower_cp(c) != c; }
bool is_lower_cp(char32_t c) { return upper_cp(c) != c || c == 0xDF; }
bool is_cased(char32_t c) { return is_upper_cp(c) || is_lower_cp(c); }

void append_upper(std::string& out, char32_t c) {
  if (c == 0xDF) {
    out += "SS";  // the one full case mapping templates may meet: German sharp s
  } else {
    append_code_point(out, upper_cp(c));
  }
}

void append_title(std::string& out, char32_t c) {
  if (c == 0xDF) {
    out += "Ss";
  } else {
    append_code_point(out, upper_cp(c));
  }
}

template <class F>
std::string map_code_points(std::string_view s, F&& f) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) f(out, next_code_point(s, i));
  return out;
}

bool in_chars(char32_t c, const std::optional<std::u32string>& chars) {
  if (!chars) return is_space(c);
  return chars->find(c) != std::u32string::npos;
}

}  // namespace

bool is_alpha(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  return is_cased(c) || c == 0xAA || c == 0xBA || (c >= 0x5D0 && c <= 0x5EA) || (c >= 0x620 && c <= 0x64A) ||
         (c >= 0x904 && c <= 0x939) || (c >= 0xE01 && c <= 0xE30) || (c >= 0x3041 && c <= 0x3096) ||
         (c >= 0x30A1 && c <= 0x30FA) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x4E00 && c <= 0x9FFF) ||
         (c >= 0xAC00 && c <= 0xD7A3) || (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x20000 && c <= 0x2FFFF);
}

bool is_digit(char32_t c) {
  return (c >= '0' && c <= '9') || (c >= 0x660 && c <= 0x669) || (c >= 0xFF10 && c <= 0xFF19);
}

bool is_word(char32_t c) { return c == '_' || is_alpha(c) || is_digit(c); }

std::string upper(std::string_view s) {
  return map_code_points(s, [](std::string& out, char32_t c) { append_upper(out, c); });
}

std::string lower(std::string_view s) {
  return map_code_points(s, [](std::string& out, char32_t c) { append_code_point(out, lower_cp(c)); });
}

std::string swapcase(std::string_view s) {
  return map_code_points(s, [](std::string& out, char32_t c) {
    if (is_upper_cp(c)) {
      append_code_point(out, lower_cp(c));
    } else {
      append_upper(out, c);
    }
  });
}

std::string capitalize(std::string_view s) {
  bool first = true;
  return map_code_points(s, [&](std::string& out, char32_t c) {
    if (first) {
      append_title(out, c);
    } else {
      append_code_point(out, lower_cp(c));
    }
    first = false;
  });
}

std::string title(std::string_view s) {
  bool previous_cased = false;
  return map_code_points(s, [&](std::string& out, char32_t c) {
    if (previous_cased) {
      append_code_point(out, lower_cp(c));
    } else {
      append_title(out, c);
    }
    previous_cased = is_cased(c);
  });
}

bool islower(std::string_view s) {
  bool cased = false;
  for (size_t i = 0; i < s.size();) {
    const char32_t c = next_code_point(s, i);
    if (is_upper_cp(c)) return false;
    cased = cased || is_lower_cp(c);
  }
  return cased;
}

bool isupper(std::string_view s) {
  bool cased = false;
  for (size_t i = 0; i < s.size();) {
    const char32_t c = next_code_point(s, i);
    if (is_lower_cp(c)) return false;
    cased = cased || is_upper_cp(c);
  }
  return cased;
}

std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right) {
  std::optional<std::u32string> set;
  if (chars) set = decode(*chars);
  const std::u32string cps = decode(s);
  size_t b = 0;
  size_t e = cps.size();
  if (left) {
    while (b < e && in_chars(cps[b], set)) ++b;
  }
  if (right) {
    while (e > b && in_chars(cps[e - 1], set)) --e;
  }
  return encode(std::u32string_view(cps).substr(b, e - b));
}

std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    size_t pos = 0;
    for (size_t k; (maxsplit < 0 || int64_t(out.size()) < maxsplit) && (k = s.find(*sep, pos)) != s.npos;) {
      out.emplace_back(s.substr(pos, k - pos));
      pos = k + sep->size();
    }
    out.emplace_back(s.substr(pos));
    return out;
  }
  size_t i = 0;
  while (true) {
    while (i < s.size()) {
      size_t next = i;
      if (!is_space(next_code_point(s, next))) break;
      i = next;
    }
    const size_t word = i;
    if (i >= s.size()) break;
    if (maxsplit >= 0 && int64_t(out.size()) == maxsplit) {
      out.emplace_back(s.substr(i));
      break;
    }
    while (i < s.size()) {
      size_t next = i;
      if (is_space(next_code_point(s, next))) break;
      i = next;
    }
    out.emplace_back(s.substr(word, i - word));
  }
  return out;
}

std::vector<std::string> rsplit(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    size_t end = s.size();
    while ((maxsplit < 0 || int64_t(out.size()) < maxsplit) && end >= sep->size()) {
      const size_t k = s.rfind(*sep, end - sep->size());
      if (k == s.npos) break;
      out.emplace_back(s.substr(k + sep->size(), end - k - sep->size()));
      end = k;
    }
    out.emplace_back(s.substr(0, end));
  } else {
    const std::u32string cps = decode(s);
    size_t end = cps.size();
    while (true) {
      while (end > 0 && is_space(cps[end - 1])) --end;
      if (end == 0) break;
      if (maxsplit >= 0 && int64_t(out.size()) == maxsplit) {
        out.push_back(encode(std::u32string_view(cps).substr(0, end)));
        break;
      }
      size_t b = end;
      while (b > 0 && !is_space(cps[b - 1])) --b;
      out.push_back(encode(std::u32string_view(cps).substr(b, end - b)));
      end = b;
    }
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> splitlines(std::string_view s, bool keepends) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t at = i;
    const char32_t c = next_code_point(s, i);
    const bool brk = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) || c == 0x85 ||
                     c == 0x2028 || c == 0x2029;
    if (!brk) continue;
    if (c == '\r' && i < s.size() && s[i] == '\n') ++i;
    out.emplace_back(s.substr(start, (keepends ? i : at) - start));
    start = i;
  }
  if (start < s.size()) out.emplace_back(s.substr(start));
  return out;
}

std::string replace(std::string_view s, std::string_view old, std::string_view repl, int64_t count) {
  std::string out;
  if (old.empty()) {  // Python inserts `repl` before every code point and at the end
    int64_t done = 0;
    size_t i = 0;
    while (i <= s.size()) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (i == s.size()) break;
      const size_t b = i;
      next_code_point(s, i);
      out += s.substr(b, i - b);
    }
    return out;
  }
  size_t pos = 0;
  for (int64_t done = 0; count < 0 || done < count; ++done) {
    const size_t k = s.find(old, pos);
    if (k == s.npos) break;
    out += s.substr(pos, k - pos);
    out += repl;
    pos = k + old.size();
  }
  out += s.substr(pos);
  return out;
}

size_t count(std::string_view s, std::string_view sub) {
  if (sub.empty()) return length(s) + 1;
  size_t n = 0;
  for (size_t pos = 0; (pos = s.find(sub, pos)) != s.npos; pos += sub.size()) ++n;
  return n;
}

int64_t find(std::string_view s, std::string_view sub, std::optional<int64_t> start, std::optional<int64_t> end,
             bool reverse) {
  const std::u32string hay = decode(s);
  const std::u32string needle = decode(sub);
  const auto n = int64_t(hay.size());
  const auto clamp = [n](std::optional<int64_t> v, int64_t dflt) {
    if (!v) return dflt;
    int64_t x = *v < 0 ? *v + n : *v;
    return std::clamp<int64_t>(x, 0, n);
  };
  const int64_t b = start && *start > n ? n + 1 : clamp(start, 0);
  const int64_t e = clamp(end, n);
  if (e - b < int64_t(needle.size())) return -1;
  const std::u32string_view window = std::u32string_view(hay).substr(b, e - b);
  const size_t k = reverse ? window.rfind(needle) : window.find(needle);
  return k == window.npos ? -1 : b + int64_t(k);
}

std::string repr(std::string_view s) {
  const bool has_single = s.find('\'') != s.npos;
  const bool has_double = s.find('"') != s.npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  char buf[16];
  for (size_t i = 0; i < s.size();) {
    const char32_t c = next_code_point(s, i);
    if (c == char32_t(quote) || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      std::snprintf(buf, sizeof buf, "\\x%02x", unsigned(c));
      out += buf;
    } else if (c < 0x7F || is_printable(c)) {
      append_code_point(out, c);
    } else {
      const char* fmt = c <= 0xFF ? "\\x%02x" : c <= 0xFFFF ? "\\u%04x" : "\\U%08x";
      std::snprintf(buf, sizeof buf, fmt, unsigned(c));
      out += buf;
    }
  }
  out += quote;
  return out;
}

std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string_view sci(buf, size_t(res.ptr - buf));  // shortest round-trip digits, e.g. "-1.25e-05"
  std::string out;
  if (sci.front() == '-') {
    out += '-';
    sci.remove_prefix(1);
  }
  const size_t e = sci.find('e');
  std::string digits;
  for (char ch : sci.substr(0, e)) {
    if (ch != '.') digits += ch;
  }
  int exp10 = 0;
  std::string_view exp_text = sci.substr(e + 1);
  if (!exp_text.empty() && exp_text.front() == '+') exp_text.remove_prefix(1);
  std::from_chars(exp_text.data(), exp_text.data() + exp_text.size(), exp10);
  const int decpt = exp10 + 1;  // digits are d.ddd x 10^exp10
  const auto ndigits = int(digits.size());
  if (decpt > -4 && decpt <= 16) {  // Python switches to exponent notation outside this window
    if (decpt <= 0) {
      out += "0.";
      out.append(size_t(-decpt), '0');
      out += digits;
    } else if (decpt >= ndigits) {
      out += digits;
      out.append(size_t(decpt - ndigits), '0');
      out += ".0";
    } else {
      out.append(digits, 0, size_t(decpt));
      out += '.';
      out.append(digits, size_t(decpt));
    }
    return out;
  }
  out += digits[0];
  if (ndigits > 1) {
    out += '.';
    out.append(digits, 1);
  }
  out += exp10 < 0 ? "e-" : "e+";
  const std::string mag = std::to_string(std::abs(exp10));
  if (mag.size() < 2) out += '0';
  out += mag;
  return out;
}

}  // namespace sparsemla::chat::jinja::py
