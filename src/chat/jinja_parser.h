// Parser from tokens to the syntax tree, following jinja2's grammar and operator precedence.
#pragma once
#include <memory>
#include <string_view>

#include "chat/jinja_ast.h"
#include "chat/jinja_lexer.h"

namespace sparsemla::chat::jinja {

// Parses a whole template and resolves its filter and test names. Like jinja2, an unknown filter or
// test is an error here unless it sits directly in an if statement or an inline if, where it is an
// error only when evaluated. Throws TemplateError "line L, column C: expected ..., found ...".
std::unique_ptr<Program> parse_program(std::string_view source, const LexOptions& options);

}  // namespace sparsemla::chat::jinja
