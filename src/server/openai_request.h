// The bodies of POST /v1/chat/completions and /v1/completions, checked and normalized. Unknown
// fields are ignored; a known field with a wrong type or value is a 400 naming it.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "server/json_fields.h"

namespace sparsemla::server {

// What both endpoints share.
struct GenerationOptions {
  std::string model;                // as the client named it; empty when absent
  engine::SamplingParams sampling;  // top_logprobs -1 unless logprobs were asked for
  std::optional<uint64_t> seed;
  std::optional<int32_t> max_tokens;  // max_completion_tokens or max_tokens
  std::vector<std::string> stop;
  bool ignore_eos = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

struct ChatRequest {
  GenerationOptions gen;
  // Messages as the chat template reads them: role, content as one string, and tool_calls (with
  // arguments as objects where they parse), tool_call_id, name, reasoning_content when given.
  Json messages = Json::array();
  Json tools = Json::array();             // empty when none were given or tool_choice is "none"
  Json template_kwargs = Json::object();  // chat_template_kwargs: enable_thinking, ...
};

struct CompletionRequest {
  GenerationOptions gen;
  std::optional<std::string> prompt_text;
  std::vector<int32_t> prompt_tokens;  // when the prompt came as token ids
  bool echo = false;
};

// Throw ApiError (400) on the first problem.
ChatRequest parse_chat_request(const std::string& body);
CompletionRequest parse_completion_request(const std::string& body);

// The JSON object in `body`, or a 400.
Json parse_body(const std::string& body);

}  // namespace sparsemla::server
