#include "server/chat_output.h"

#include <algorithm>

namespace sparsemla::server {
namespace {

constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";
constexpr std::string_view kGlmOpen = "<tool_call>", kGlmClose = "</tool_call>";
constexpr std::string_view kDsCallsOpen = "<｜tool▁calls▁begin｜>", kDsCallsClose = "<｜tool▁calls▁end｜>";
constexpr std::string_view kDsCallOpen = "<｜tool▁call▁begin｜>", kDsCallClose = "<｜tool▁call▁end｜>";
constexpr std::string_view kDsmlOpen = "<｜DSML｜function_calls>", kDsmlClose = "</｜DSML｜function_calls>";
constexpr std::string_view kDsmlInvokeOpen = "<｜DSML｜invoke", kDsmlInvokeClose = "</｜DSML｜invoke>";

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

// The length of the longest tail of `s` that is a proper prefix of one of `markers`.
size_t partial_marker(std::string_view s, const std::vector<std::string>& markers) {
  size_t best = 0;
  for (const auto& m : markers)
    for (size_t k = std::min(m.size() - 1, s.size()); k > best; --k)
      if (s.substr(s.size() - k) == std::string_view(m).substr(0, k)) {
        best = k;
        break;
      }
  return best;
}

}  // namespace

ChatOutputParser::ChatOutputParser(ToolSyntax syntax, Json tools, bool in_reasoning)
    : syntax_(syntax), tools_(std::move(tools)), state_(in_reasoning ? State::Reasoning : State::Content) {
  openers_.emplace_back(kThinkOpen);
  if (!tools_.empty()) {
    if (syntax_ == ToolSyntax::Glm) {
      openers_.emplace_back(kGlmOpen);
    } else {
      openers_.emplace_back(kDsCallsOpen);
      openers_.emplace_back(kDsCallOpen);
      openers_.emplace_back(kDsmlOpen);
    }
  }
}

void ChatOutputParser::emit(std::string_view text, std::string& to, std::string& held, bool& started) {
  if (!started) {
    while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
    if (text.empty()) return;
    started = true;
  }
  size_t end = text.size();
  while (end > 0 && is_space(text[end - 1])) --end;
  if (end == 0) {
    held += text;
    return;
  }
  to += held;
  to += text.substr(0, end);
  held.assign(text.substr(end));
}

void ChatOutputParser::close_tool_block(std::string_view body, ChatDelta& out) {
  std::vector<ToolCall> calls;
  size_t pos = 0;
  auto each = [&](std::string_view open, std::string_view close, auto parse) {
    for (;;) {
      const size_t a = body.find(open, pos);
      if (a == std::string_view::npos) return;
      const size_t b = body.find(close, a + open.size());
      if (b == std::string_view::npos) return;
      if (auto c = parse(body.substr(a, b - a))) calls.push_back(std::move(*c));
      pos = b + close.size();
    }
  };
  if (opener_ == kGlmOpen) {
    if (auto c = parse_glm_tool_call(body, tools_)) calls.push_back(std::move(*c));
  } else if (opener_ == kDsCallOpen) {
    if (auto c = parse_deepseek_tool_call(body)) calls.push_back(std::move(*c));
  } else if (opener_ == kDsCallsOpen) {
    each(kDsCallOpen, kDsCallClose,
         [](std::string_view s) { return parse_deepseek_tool_call(s.substr(kDsCallOpen.size())); });
  } else {
    each(kDsmlInvokeOpen, kDsmlInvokeClose, parse_dsml_invoke);
  }
  if (calls.empty()) {  // not a call after all: the model's text goes out as it was
    emit(opener_ + std::string(body) + closer_, out.content, content_ws_, content_started_);
    return;
  }
  content_ws_.clear();  // whitespace between calls is layout, not content
  n_tool_calls_ += int(calls.size());
  for (auto& c : calls) out.tool_calls.push_back(std::move(c));
}

void ChatOutputParser::run(ChatDelta& out, bool final) {
  for (;;) {
    if (state_ == State::Content) {
      size_t at = std::string::npos;
      const std::string* marker = nullptr;
      for (const auto& m : openers_) {
        const size_t p = buf_.find(m);
        if (p < at) at = p, marker = &m;
      }
      if (!marker) {
        const size_t hold = final ? 0 : partial_marker(buf_, openers_);
        emit(std::string_view(buf_).substr(0, buf_.size() - hold), out.content, content_ws_, content_started_);
        buf_.erase(0, buf_.size() - hold);
        return;
      }
      emit(std::string_view(buf_).substr(0, at), out.content, content_ws_, content_started_);
      buf_.erase(0, at + marker->size());
      if (*marker == kThinkOpen) {
        state_ = State::Reasoning;
        continue;
      }
      opener_ = *marker;
      closer_ = opener_ == kGlmOpen       ? kGlmClose
                : opener_ == kDsCallsOpen ? kDsCallsClose
                : opener_ == kDsCallOpen  ? kDsCallClose
                                          : kDsmlClose;
      state_ = State::Tool;
    } else if (state_ == State::Reasoning) {
      const size_t p = buf_.find(kThinkClose);
      if (p == std::string::npos) {
        const size_t hold = final ? 0 : partial_marker(buf_, {std::string(kThinkClose)});
        emit(std::string_view(buf_).substr(0, buf_.size() - hold), out.reasoning, reasoning_ws_, reasoning_started_);
        buf_.erase(0, buf_.size() - hold);
        if (final) out.reasoning += reasoning_ws_;
        return;
      }
      emit(std::string_view(buf_).substr(0, p), out.reasoning, reasoning_ws_, reasoning_started_);
      reasoning_ws_.clear();
      buf_.erase(0, p + kThinkClose.size());
      content_started_ = false;  // the answer's leading newlines are layout
      state_ = State::Content;
    } else {
      const size_t p = buf_.find(closer_);
      if (p == std::string::npos) {
        if (!final) return;
        // Cut off before the call ended (max_tokens): the text is content, not a call.
        emit(opener_ + buf_, out.content, content_ws_, content_started_);
        buf_.clear();
        state_ = State::Content;
        continue;
      }
      close_tool_block(std::string_view(buf_).substr(0, p), out);
      buf_.erase(0, p + closer_.size());
      state_ = State::Content;
    }
  }
}

ChatDelta ChatOutputParser::push(std::string_view text) {
  buf_ += text;
  ChatDelta out;
  run(out, false);
  return out;
}

ChatDelta ChatOutputParser::finish() {
  ChatDelta out;
  run(out, true);
  if (!made_tool_calls()) out.content += content_ws_;
  content_ws_.clear();
  return out;
}

}  // namespace sparsemla::server
