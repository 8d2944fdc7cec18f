// A Jinja2 interpreter for GGUF chat templates. It renders tokenizer.chat_template the way Hugging Face
// transformers does: jinja2's ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and the
// loopcontrols extension, transformers' tojson filter and its raise_exception / strftime_now globals.
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <string_view>

#include "util/error.h"

namespace sparsemla::chat {

namespace jinja {
struct Program;
}

// A syntax error found by Template::parse or an error while rendering (including raise_exception()).
// what() reads "line L, column C: <message>"; line and column are 1-based, 0 when there is no position.
struct TemplateError : Error {
  TemplateError(int line, int column, const std::string& message);
  int line;
  int column;
  std::string message;  // what() without the position: for raise_exception(msg) it is msg
};

struct TemplateOptions {
  bool trim_blocks = true;    // drop the first newline after a block or comment tag
  bool lstrip_blocks = true;  // drop spaces and tabs between the start of a line and a block or comment tag
};

// A parsed template: immutable, cheap to copy, and renderable from several threads at once.
class Template {
 public:
  // Throws TemplateError naming the line and column of the first syntax error.
  static Template parse(std::string_view source, const TemplateOptions& options = {});

  // `context` must be a JSON object; each key becomes a template variable (messages, tools,
  // add_generation_prompt, bos_token, ...). Throws TemplateError; never crashes on any input.
  std::string render(const nlohmann::ordered_json& context) const;

 private:
  explicit Template(std::shared_ptr<const jinja::Program> program);
  std::shared_ptr<const jinja::Program> program_;
};

}  // namespace sparsemla::chat
