#include "server/chat_format.h"

#include "gguf/reader.h"
#include "server/api_error.h"
#include "server/builtin_templates.h"
#include "tokenizer/tokenizer.h"

namespace sparsemla::server {
namespace {

// Markers the output parsers look for; each may be one special token of the vocabulary.
const char* const kMarkers[] = {
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
};

std::string token_or_empty(const tokenizer::Tokenizer& tok, int32_t id) { return id >= 0 ? tok.token_text(id) : ""; }

}  // namespace

ChatFormat::ChatFormat(const std::string& source, ToolSyntax syntax, std::string bos, std::string eos, bool builtin)
    : tmpl_(chat::Template::parse(source)),
      syntax_(syntax),
      bos_(std::move(bos)),
      eos_(std::move(eos)),
      builtin_(builtin) {}

ChatFormat ChatFormat::for_model(const gguf::File& file, const tokenizer::Tokenizer& tok) {
  const std::string arch = file.get_string("general.architecture").value_or("");
  const auto source = file.get_string("tokenizer.chat_template");
  // The markup a model writes shows in its vocabulary (or its template); the arch decides otherwise.
  ToolSyntax syntax = arch == "glm-dsa" ? ToolSyntax::Glm : ToolSyntax::DeepSeek;
  if (tok.find_token("<｜tool▁calls▁begin｜>") || (source && source->find("tool▁call") != std::string::npos))
    syntax = ToolSyntax::DeepSeek;
  else if (tok.find_token("<tool_call>") || (source && source->find("<tool_call>") != std::string::npos))
    syntax = ToolSyntax::Glm;
  const std::string bos = token_or_empty(tok, tok.bos()), eos = token_or_empty(tok, tok.eos());
  if (source) return ChatFormat(*source, syntax, bos, eos, false);
  return ChatFormat(std::string(syntax == ToolSyntax::Glm ? kGlmTemplate : kDeepSeekTemplate), syntax, bos, eos, true);
}

std::string ChatFormat::render(const Json& messages, const Json& tools, const Json& kwargs) const {
  Json ctx = Json::object();
  for (const auto& [k, v] : kwargs.items()) ctx[k] = v;
  ctx["messages"] = messages;
  if (!tools.empty()) ctx["tools"] = tools;
  ctx["add_generation_prompt"] = true;
  ctx["bos_token"] = bos_;
  ctx["eos_token"] = eos_;
  try {
    return tmpl_.render(ctx);
  } catch (const chat::TemplateError& e) {
    throw ApiError(400, "the chat template refused the messages: " + e.message);
  }
}

bool ChatFormat::opens_reasoning(const std::string& prompt) {
  size_t end = prompt.find_last_not_of(" \t\r\n");
  if (end == std::string::npos) return false;
  const std::string_view open = "<think>";
  return end + 1 >= open.size() && std::string_view(prompt).substr(end + 1 - open.size(), open.size()) == open;
}

std::vector<int32_t> ChatFormat::marker_tokens(const tokenizer::Tokenizer& tok) {
  std::vector<int32_t> ids;
  for (const char* m : kMarkers)
    if (auto id = tok.find_token(m)) ids.push_back(*id);
  return ids;
}

}  // namespace sparsemla::server
