#include "server/openai_response.h"

#include <fmt/format.h>

#include <chrono>
#include <mutex>
#include <random>

#include "tokenizer/tokenizer.h"

namespace sparsemla::server {

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

std::string sse(const Json& j) { return "data: " + dump(j) + "\n\n"; }

std::string new_response_id(const char* prefix) {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard lk(mu);
  return fmt::format("{}-{:016x}{:08x}", prefix, rng(), uint32_t(rng()));
}

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

Json usage_json(const engine::Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

std::string token_piece(const tokenizer::Tokenizer& tok, int32_t id) {
  return id >= 0 && id < tok.n_vocab() ? tok.token_bytes(id) : std::string();
}

namespace {

Json bytes_of(const std::string& s) {
  Json b = Json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}

}  // namespace

Json chat_logprobs(const tokenizer::Tokenizer& tok, const std::vector<engine::Sampled>& tokens) {
  Json content = Json::array();
  for (const auto& t : tokens) {
    const std::string piece = token_piece(tok, t.id);
    Json top = Json::array();
    for (const auto& alt : t.top) {
      const std::string p = token_piece(tok, alt.id);
      top.push_back({{"token", p}, {"logprob", alt.logprob}, {"bytes", bytes_of(p)}});
    }
    content.push_back({{"token", piece}, {"logprob", t.logprob}, {"bytes", bytes_of(piece)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

Json completion_logprobs(const tokenizer::Tokenizer& tok, const std::vector<engine::Sampled>& tokens,
                         size_t text_offset) {
  Json toks = Json::array(), lps = Json::array(), tops = Json::array(), offsets = Json::array();
  for (const auto& t : tokens) {
    const std::string piece = token_piece(tok, t.id);
    toks.push_back(piece);
    lps.push_back(t.logprob);
    Json top = Json::object();
    for (const auto& alt : t.top) top[token_piece(tok, alt.id)] = alt.logprob;
    tops.push_back(top);
    offsets.push_back(text_offset);
    text_offset += piece.size();
  }
  return {{"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

}  // namespace sparsemla::server
