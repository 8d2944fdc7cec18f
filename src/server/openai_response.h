// Pieces of OpenAI responses: ids, usage, logprobs in the chat and the completions shapes, SSE.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/request.h"
#include "server/json_fields.h"

namespace sparsemla::tokenizer {
class Tokenizer;
}

namespace sparsemla::server {

// JSON text; bytes that are not UTF-8 (a token that is part of a character) become U+FFFD.
std::string dump(const Json& j);
// One server-sent event: "data: <json>\n\n".
std::string sse(const Json& j);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

std::string new_response_id(const char* prefix);  // "chatcmpl-...", "cmpl-..."
int64_t unix_time();

Json usage_json(const engine::Usage& u);

// {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}
Json chat_logprobs(const tokenizer::Tokenizer& tok, const std::vector<engine::Sampled>& tokens);
// {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}; offsets count from
// `text_offset`, the length of the text before these tokens.
Json completion_logprobs(const tokenizer::Tokenizer& tok, const std::vector<engine::Sampled>& tokens,
                         size_t text_offset);

// The bytes of a token (empty for an id the tokenizer does not have).
std::string token_piece(const tokenizer::Tokenizer& tok, int32_t id);

}  // namespace sparsemla::server
