#include "chat/jinja_lexer.h"

#include <algorithm>
#include <cctype>
#include <charconv>

#include "chat/jinja.h"
#include "chat/jinja_pystr.h"

namespace sparsemla::chat::jinja {

namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// jinja2 reads its source split into lines and joined with \n, without the final newline.
std::string normalize_newlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

class Lexer {
 public:
  Lexer(std::string_view source, const LexOptions& options) : src_(normalize_newlines(source)), opt_(options) {
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
    }
  }

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      const size_t t = find_opener(pos_);
      if (t == std::string::npos) {
        emit_text(src_.substr(pos_), pos_);
        break;
      }
      const char kind = src_[t + 1];
      size_t after = t + 2;
      char sign = 0;
      if (after < src_.size() && (src_[after] == '-' || src_[after] == '+')) sign = src_[after++];
      size_t raw_body = 0;
      const bool raw = kind == '%' && match_raw_begin(t, raw_body);
      std::string text = src_.substr(pos_, t - pos_);
      strip_before_tag(text, sign, kind != '{');
      emit_text(std::move(text), pos_);
      if (raw) {
        lex_raw(t, raw_body);
      } else if (kind == '#') {
        lex_comment(t, after);
      } else {
        push(kind == '{' ? Tok::VarBegin : Tok::BlockBegin, t);
        lex_tag(kind == '%', after);
      }
    }
    // jinja2 reports the end of the template on the line of the last token.
    Token end;
    end.pos = toks_.empty() ? Pos{1, 1} : toks_.back().pos;
    toks_.push_back(std::move(end));
    return std::move(toks_);
  }

 private:
  [[noreturn]] void fail(size_t at, const std::string& message) {
    const Pos p = pos_at(at);
    throw TemplateError(p.line, p.column, message);
  }

  // Tokens come in order, so the column is counted on from the previous token when it is on the
  // same line: a template that is one long line stays linear to lex.
  Pos pos_at(size_t offset) {
    const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    const auto line = size_t(it - line_starts_.begin());
    size_t from = line_starts_[line - 1];
    int column = 1;
    if (size_t(last_pos_.line) == line && last_offset_ <= offset && last_offset_ >= from) {
      from = last_offset_;
      column = last_pos_.column;
    }
    last_pos_ = Pos{int(line), column + int(py::length(std::string_view(src_).substr(from, offset - from)))};
    last_offset_ = offset;
    return last_pos_;
  }

  Token& push(Tok type, size_t at) {
    Token t;
    t.type = type;
    t.pos = pos_at(at);
    toks_.push_back(std::move(t));
    return toks_.back();
  }

  void emit_text(std::string text, size_t at) {
    if (!text.empty()) push(Tok::Text, at).text = std::move(text);
  }

  bool starts_with(size_t p, std::string_view s) const { return std::string_view(src_).substr(p, s.size()) == s; }

  size_t skip_space(size_t p) const {
    while (p < src_.size()) {
      size_t next = p;
      if (!py::is_space(py::next_code_point(src_, next))) break;
      p = next;
    }
    return p;
  }

  size_t find_opener(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) return p;
    }
    return std::string::npos;
  }

  // The text before a tag loses its trailing whitespace for a "-" marker, or with lstrip_blocks the
  // spaces and tabs between the start of its last line and a block or comment tag ("+" opts out).
  void strip_before_tag(std::string& text, char sign, bool block_or_comment) const {
    if (sign == '-') {
      text = py::strip(text, std::nullopt, false, true);
      return;
    }
    if (sign == '+' || !opt_.lstrip_blocks || !block_or_comment) return;
    const size_t nl = text.rfind('\n');
    const size_t line = nl == std::string::npos ? 0 : nl + 1;
    if ((line > 0 || line_starting_) && line < text.size() && skip_space_in(text, line) == text.size()) {
      text.resize(line);
    }
  }

  static size_t skip_space_in(std::string_view s, size_t p) {
    while (p < s.size()) {
      size_t next = p;
      if (!py::is_space(py::next_code_point(s, next))) break;
      p = next;
    }
    return p;
  }

  // After a tag's closing delimiter: trim_blocks drops one newline after %} and #}, "-" drops all
  // whitespace and "+" keeps everything.
  void finish_tag(size_t end) {
    pos_ = end;
    line_starting_ = end > 0 && src_[end - 1] == '\n';
  }

  size_t block_end_at(size_t p, std::string_view close) const {
    if (starts_with(p, "+") && starts_with(p + 1, close)) return p + 1 + close.size();
    if (starts_with(p, "-") && starts_with(p + 1, close)) return skip_space(p + 1 + close.size());
    if (starts_with(p, close)) {
      size_t end = p + close.size();
      if (opt_.trim_blocks && end < src_.size() && src_[end] == '\n') ++end;
      return end;
    }
    return std::string::npos;
  }

  bool match_raw_begin(size_t t, size_t& body) const {
    size_t p = t + 2;
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
    p = skip_space(p);
    if (!starts_with(p, "raw")) return false;
    p = skip_space(p + 3);
    if (starts_with(p, "-%}")) {
      body = skip_space(p + 3);
      return true;
    }
    if (starts_with(p, "%}")) {
      body = p + 2;
      return true;
    }
    return false;
  }

  void lex_raw(size_t tag, size_t body) {
    line_starting_ = src_[body - 1] == '\n';
    for (size_t p = src_.find("{%", body); p != std::string::npos; p = src_.find("{%", p + 1)) {
      size_t q = p + 2;
      char sign = 0;
      if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) sign = src_[q++];
      q = skip_space(q);
      if (!starts_with(q, "endraw")) continue;
      const size_t end = block_end_at(skip_space(q + 6), "%}");
      if (end == std::string::npos) continue;
      std::string text = src_.substr(body, p - body);
      strip_before_tag(text, sign, true);
      emit_text(std::move(text), body);
      finish_tag(end);
      return;
    }
    fail(tag, "missing {% endraw %} for this {% raw %}");
  }

  void lex_comment(size_t tag, size_t body) {
    const size_t q = src_.find("#}", body);
    if (q == std::string::npos) fail(tag, "missing '#}' at the end of this comment");
    size_t end = q + 2;
    const char before = q > body ? src_[q - 1] : 0;
    if (before == '-') {
      end = skip_space(end);
    } else if (before != '+' && opt_.trim_blocks && end < src_.size() && src_[end] == '\n') {
      ++end;
    }
    finish_tag(end);
  }

  void lex_tag(bool block, size_t p) {
    std::vector<char> closers;  // brackets still open: their closing characters
    while (true) {
      if (closers.empty()) {
        const size_t end = block ? block_end_at(p, "%}")
                           : starts_with(p, "-}}") ? skip_space(p + 3)
                           : starts_with(p, "}}")  ? p + 2
                                                   : std::string::npos;
        if (end != std::string::npos) {
          push(block ? Tok::BlockEnd : Tok::VarEnd, p);
          finish_tag(end);
          return;
        }
      }
      if (p >= src_.size()) {  // the parser reports the missing end of the tag
        pos_ = p;
        return;
      }
      size_t next = p;
      const char32_t c = py::next_code_point(src_, next);
      if (py::is_space(c)) {
        p = next;
      } else if (c < 0x80 && is_digit(char(c))) {
        p = lex_number(p);
      } else if (c == '_' || (c < 0x80 && std::isalpha(int(c))) || c >= 0x80) {
        p = lex_name(p);
      } else if (c == '\'' || c == '"') {
        p = lex_string(p);
      } else {
        p = lex_operator(p, closers);
      }
    }
  }

  size_t lex_name(size_t p) {
    const size_t start = p;
    while (p < src_.size()) {
      size_t next = p;
      const char32_t c = py::next_code_point(src_, next);
      const bool ok = c == '_' || (c < 0x80 && std::isalnum(int(c))) || (c >= 0x80 && !py::is_space(c));
      if (!ok) break;
      p = next;
    }
    push(Tok::Name, start).text = src_.substr(start, p - start);
    return p;
  }

  // Digits with single underscores between them: (\d+_)*\d+
  size_t digits_at(size_t p) const {
    if (p >= src_.size() || !is_digit(src_[p])) return p;
    while (p < src_.size() && is_digit(src_[p])) {
      ++p;
      if (p + 1 < src_.size() && src_[p] == '_' && is_digit(src_[p + 1])) ++p;
    }
    return p;
  }

  size_t lex_number(size_t start) {
    // A float needs a fraction or an exponent, and jinja2 does not read one right after a dot (x.0.1).
    size_t end = std::string::npos;
    if (start == 0 || src_[start - 1] != '.') {
      size_t p = digits_at(start);
      bool fraction = false;
      if (p + 1 < src_.size() && src_[p] == '.' && is_digit(src_[p + 1])) {
        p = digits_at(p + 1);
        fraction = true;
      }
      size_t e = p;
      if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
        ++e;
        if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
        const size_t digits_end = digits_at(e);
        if (digits_end > e) end = digits_end;
      }
      if (end == std::string::npos && fraction) end = p;
    }
    if (end != std::string::npos) {
      std::string text;
      for (size_t i = start; i < end; ++i) {
        if (src_[i] != '_') text += src_[i];
      }
      double value = 0;
      std::from_chars(text.data(), text.data() + text.size(), value);  // out of range: inf, as Python
      push(Tok::Float, start).float_value = value;
      return end;
    }
    int base = 10;
    size_t p = start;
    const char prefix = start + 1 < src_.size() ? char(std::tolower(src_[start + 1])) : 0;
    if (src_[start] == '0' && (prefix == 'b' || prefix == 'o' || prefix == 'x')) {
      base = prefix == 'b' ? 2 : prefix == 'o' ? 8 : 16;
      size_t q = start + 2;
      const auto digit_ok = [&](size_t i) { return i < src_.size() && hex_value(src_[i]) >= 0 && hex_value(src_[i]) < base; };
      while (true) {  // (_?digit)+
        if (digit_ok(q)) {
          ++q;
        } else if (q < src_.size() && src_[q] == '_' && digit_ok(q + 1)) {
          q += 2;
        } else {
          break;
        }
      }
      if (q > start + 2) p = q;
    }
    if (p == start) {  // [1-9](_?\d)* or 0(_?0)*
      const bool zero = src_[start] == '0';
      p = start + 1;
      while (p < src_.size()) {
        const size_t q = src_[p] == '_' ? p + 1 : p;
        if (q >= src_.size() || !is_digit(src_[q]) || (zero && src_[q] != '0')) break;
        p = q + 1;
      }
    }
    int64_t value = 0;
    for (size_t i = (base == 10 ? start : start + 2); i < p; ++i) {
      if (src_[i] == '_') continue;
      const int d = hex_value(src_[i]);
      if (value > (INT64_MAX - d) / base) fail(start, "integer literal is too large");
      value = value * base + d;
    }
    push(Tok::Integer, start).int_value = value;
    return p;
  }

  size_t lex_string(size_t start) {
    const char quote = src_[start];
    size_t q = start + 1;
    while (q < src_.size() && src_[q] != quote) q += src_[q] == '\\' ? 2 : 1;
    if (q >= src_.size()) fail(start, "unterminated string literal");
    push(Tok::String, start).text = unescape(start + 1, q);
    return q + 1;
  }

  // Python's unicode-escape decoding, which jinja2 applies to string literals.
  std::string unescape(size_t b, size_t e) {
    std::string out;
    for (size_t i = b; i < e;) {
      if (src_[i] != '\\') {
        out += src_[i++];
        continue;
      }
      const size_t at = i;
      const char c = src_[i + 1];
      i += 2;
      const auto hex_escape = [&](int digits) {
        char32_t v = 0;
        for (int k = 0; k < digits; ++k, ++i) {
          const int h = i < e ? hex_value(src_[i]) : -1;
          if (h < 0) fail(at, "truncated \\" + std::string(1, c) + " escape in a string literal");
          v = v * 16 + char32_t(h);
        }
        if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) fail(at, "invalid code point in a \\u or \\U escape");
        py::append_code_point(out, v);
      };
      switch (c) {
        case '\n':
          break;
        case '\\':
        case '\'':
        case '"':
          out += c;
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
          hex_escape(2);
          break;
        case 'u':
          hex_escape(4);
          break;
        case 'U':
          hex_escape(8);
          break;
        case 'N':
          fail(at, "\\N{...} escapes are not supported");
        default:
          if (c >= '0' && c <= '7') {
            char32_t v = char32_t(c - '0');
            for (int k = 0; k < 2 && i < e && src_[i] >= '0' && src_[i] <= '7'; ++k) v = v * 8 + char32_t(src_[i++] - '0');
            py::append_code_point(out, v);
          } else {  // an unknown escape keeps its backslash
            out += '\\';
            out += c;
          }
      }
    }
    return out;
  }

  size_t lex_operator(size_t p, std::vector<char>& closers) {
    static constexpr std::string_view kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
    for (std::string_view op : kTwo) {
      if (starts_with(p, op)) {
        push(Tok::Operator, p).text = std::string(op);
        return p + 2;
      }
    }
    const char c = src_[p];
    if (std::string_view("+-/*%~[](){}><=.:|,;").find(c) == std::string_view::npos) {
      size_t next = p;
      std::string ch;
      py::append_code_point(ch, py::next_code_point(src_, next));
      fail(p, "unexpected character '" + ch + "'");
    }
    if (c == '(' || c == '[' || c == '{') {
      closers.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    } else if (c == ')' || c == ']' || c == '}') {
      if (closers.empty()) fail(p, std::string("unexpected '") + c + "'");
      if (closers.back() != c) fail(p, std::string("unexpected '") + c + "', expected '" + closers.back() + "'");
      closers.pop_back();
    }
    push(Tok::Operator, p).text = std::string(1, c);
    return p + 1;
  }

  std::string src_;
  LexOptions opt_;
  std::vector<size_t> line_starts_;
  std::vector<Token> toks_;
  size_t last_offset_ = 0;
  Pos last_pos_;
  size_t pos_ = 0;
  bool line_starting_ = true;  // the last tag ended with a newline: lstrip_blocks may strip what follows
};

}  // namespace

std::vector<Token> tokenize(std::string_view source, const LexOptions& options) {
  return Lexer(source, options).run();
}

}  // namespace sparsemla::chat::jinja
