// How a model's chat turns become a prompt, and how its replies mark tool calls: the GGUF's
// tokenizer.chat_template when it has one, else the built-in format of the model's family.
#pragma once
#include <string>
#include <vector>

#include "chat/jinja.h"
#include "server/json_fields.h"

namespace sparsemla::gguf {
class File;
}
namespace sparsemla::tokenizer {
class Tokenizer;
}

namespace sparsemla::server {

// The tool-call markup a model writes.
enum class ToolSyntax {
  Glm,  // <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>
  DeepSeek,  // <｜tool▁call▁begin｜>name<｜tool▁sep｜>{json}<｜tool▁call▁end｜> (V3.1), the V3 and DSML forms
};

class ChatFormat {
 public:
  static ChatFormat for_model(const gguf::File& file, const tokenizer::Tokenizer& tok);
  // A given template (tests, or a --chat-template file).
  ChatFormat(const std::string& source, ToolSyntax syntax, std::string bos, std::string eos, bool builtin);

  // The prompt for `messages` (normalized by parse_chat_request) with `tools`, ending where the
  // assistant's reply starts. `kwargs` (chat_template_kwargs) become template variables too.
  // Throws ApiError 400 when the template refuses the conversation (raise_exception).
  std::string render(const Json& messages, const Json& tools, const Json& kwargs) const;

  ToolSyntax tool_syntax() const { return syntax_; }
  bool builtin() const { return builtin_; }

  // Whether generation starts inside <think>: the prompt ends with an open <think>.
  static bool opens_reasoning(const std::string& prompt);
  // The special tokens the output parsers read, which must appear in the generated text.
  static std::vector<int32_t> marker_tokens(const tokenizer::Tokenizer& tok);

 private:
  chat::Template tmpl_;
  ToolSyntax syntax_;
  std::string bos_, eos_;
  bool builtin_;
};

}  // namespace sparsemla::server
