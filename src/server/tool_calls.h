// Tool calls as models write them, turned into OpenAI's {name, arguments (a JSON string)}.
#pragma once
#include <optional>
#include <string>
#include <string_view>

#include "server/json_fields.h"

namespace sparsemla::server {

struct ToolCall {
  std::string id;  // "call_..." (random)
  std::string name;
  std::string arguments;  // JSON text of an object (as written when it is not valid JSON)
};

// The text between <tool_call> and </tool_call> in GLM's format:
//   name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>...   or a JSON {"name", "arguments"} object.
// A value stays a string when the tool's schema says so (`tools` as the request gave them), and is
// read as JSON otherwise when it parses. Nothing when there is no function name.
std::optional<ToolCall> parse_glm_tool_call(std::string_view body, const Json& tools);

// The text between <｜tool▁call▁begin｜> and <｜tool▁call▁end｜>: "name<｜tool▁sep｜>{json}" (V3.1)
// or "function<｜tool▁sep｜>name\n```json\n{json}\n```" (V3).
std::optional<ToolCall> parse_deepseek_tool_call(std::string_view body);

// One DSML invoke of DeepSeek-V3.2, from <｜DSML｜invoke name="..."> to </｜DSML｜invoke>:
// <｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter> per argument.
std::optional<ToolCall> parse_dsml_invoke(std::string_view invoke);

std::string new_tool_call_id();

}  // namespace sparsemla::server
