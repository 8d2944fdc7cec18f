// Splits a chat reply, as it streams, into reasoning (<think>...</think>), content and tool calls.
// Text that could be the start of a marker is held back until it is known not to be one; the whole
// reply pushed at once gives the same result as the same text pushed piece by piece.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "server/chat_format.h"
#include "server/tool_calls.h"

namespace sparsemla::server {

struct ChatDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

class ChatOutputParser {
 public:
  // `tools` as the request gave them, empty when tool calls are not to be parsed; `in_reasoning`
  // when the prompt already opened <think>.
  ChatOutputParser(ToolSyntax syntax, Json tools, bool in_reasoning);

  ChatDelta push(std::string_view text);
  // The end of the reply: whatever was held back.
  ChatDelta finish();
  bool made_tool_calls() const { return n_tool_calls_ > 0; }

 private:
  enum class State { Content, Reasoning, Tool };
  void run(ChatDelta& out, bool final);
  void emit(std::string_view text, std::string& to, std::string& held, bool& started);
  void close_tool_block(std::string_view body, ChatDelta& out);

  ToolSyntax syntax_;
  Json tools_;
  std::vector<std::string> openers_;  // markers that leave the content state
  State state_;
  std::string buf_;     // text not yet given out
  std::string opener_;  // the marker that opened the current tool block
  std::string closer_;  // the marker that ends it
  // Leading whitespace of content and reasoning is dropped, trailing whitespace held until more
  // text follows (after a tool call or a </think> it is dropped).
  std::string content_ws_, reasoning_ws_;
  bool content_started_ = false, reasoning_started_ = false;
  int n_tool_calls_ = 0;
};

}  // namespace sparsemla::server
