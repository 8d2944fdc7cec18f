// Tokenizer for Jinja2 templates, with jinja2's whitespace control.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace sparsemla::chat::jinja {

struct Pos {
  int line = 0;
  int column = 0;  // 1-based, in code points
};

enum class Tok : uint8_t {
  Text,        // template data between tags
  VarBegin,    // {{
  VarEnd,      // }}
  BlockBegin,  // {%
  BlockEnd,    // %}
  Name,
  String,
  Integer,
  Float,
  Operator,
  End,  // end of the template
};

struct Token {
  Tok type = Tok::End;
  Pos pos;
  std::string text;  // Text: the data; Name: the identifier; String: the unescaped value; Operator: its spelling
  int64_t int_value = 0;
  double float_value = 0;
};

struct LexOptions {
  bool trim_blocks = true;
  bool lstrip_blocks = true;
};

// Splits a template into tokens the way jinja2's lexer does: newlines normalized to \n, one trailing
// newline dropped, comments removed, {% raw %} blocks turned into text, and the whitespace control of
// {%- -%} {{- -}} {#- -#} {%+ +%}, trim_blocks and lstrip_blocks applied to the text tokens. The last
// token is End. Throws TemplateError naming the line and column.
std::vector<Token> tokenize(std::string_view source, const LexOptions& options);

}  // namespace sparsemla::chat::jinja
