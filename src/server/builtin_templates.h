// Chat formats for a GGUF without tokenizer.chat_template, written as Jinja so that they go through
// the same renderer as a model's own template. Each is a minimal version of its family's format:
// role markers, reasoning, tools in the system turn, tool calls and results.
#pragma once
#include <string_view>

namespace sparsemla::server {

// GLM-4.5 / GLM-5: [gMASK]<sop>, <|system|> <|user|> <|assistant|> <|observation|>, <think>,
// <tool_call>name <arg_key>k</arg_key> <arg_value>v</arg_value></tool_call>.
extern const std::string_view kGlmTemplate;
// DeepSeek-V3.1 / V3.2: BOS, system text, <｜User｜> <｜Assistant｜>, </think> or <think> after the
// assistant marker, <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{json}...
extern const std::string_view kDeepSeekTemplate;

}  // namespace sparsemla::server
