// POST /v1/chat/completions and /v1/completions: parse, render, tokenize, submit to the scheduler,
// then stream (SSE) or collect the result while watching for the client to leave.
#include <chrono>
#include <random>

#include "server/api_error.h"
#include "server/chat_output.h"
#include "server/openai_request.h"
#include "server/openai_response.h"
#include "server/server.h"

namespace sparsemla::server {
namespace {

using engine::Event;
using engine::FinishReason;
using Clock = std::chrono::steady_clock;

// Cancels the request when the response is dropped without having finished it (a client that left
// before the body started, a server stopping).
struct Job {
  std::shared_ptr<engine::RequestStream> stream;
  Job() = default;
  Job(const Job&) = delete;
  ~Job() {
    if (stream) stream->cancel();
  }
};

std::shared_ptr<Job> submit(engine::Scheduler& sched, int32_t ctx, std::vector<int32_t> ids, const GenerationOptions& g,
                            const char* prompt_param) {
  const int64_t n = int64_t(ids.size());
  if (n == 0) invalid(prompt_param, "the prompt has no tokens");
  if (n >= ctx)
    throw ApiError(
        400, fmt::format("This model's maximum context length is {} tokens, but the prompt has {} tokens", ctx, n),
        prompt_param, "context_length_exceeded");
  const int32_t max_tokens = g.max_tokens.value_or(int32_t(ctx - n));
  if (n + max_tokens > ctx)
    throw ApiError(400,
                   fmt::format("This model's maximum context length is {} tokens, but {} were requested ({} in the "
                               "prompt, {} for the completion)",
                               ctx, n + max_tokens, n, max_tokens),
                   "max_tokens", "context_length_exceeded");
  engine::GenerationRequest gr;
  gr.prompt = std::move(ids);
  gr.sampling = g.sampling;
  gr.sampling.seed = g.seed ? *g.seed : std::random_device{}() * 0x100000001ull + std::random_device{}();
  gr.max_tokens = max_tokens;
  gr.stop = g.stop;
  gr.ignore_eos = g.ignore_eos;
  try {
    auto job = std::make_shared<Job>();
    job->stream = sched.submit(std::move(gr));
    return job;
  } catch (const engine::Refused& r) {
    if (r.kind == engine::Refused::Kind::QueueFull) throw ApiError(503, r.what(), {}, "queue_full");
    if (r.kind == engine::Refused::Kind::Stopping) throw ApiError(503, r.what());
    throw ApiError(400, r.what(), "max_tokens", "kv_cache_exceeded");
  } catch (const Error& e) {
    throw ApiError(400, e.what(), prompt_param);
  }
}

// Hands each event to `on_event` until the request ends (true), or until the client is gone or a
// write fails (false; the request is cancelled and its blocks freed at the next step).
bool pump(engine::RequestStream& s, ResponseWriter& w, const std::function<bool(Event&)>& on_event) {
  auto checked = Clock::now();
  for (;;) {
    auto ev = s.next(std::chrono::milliseconds(50));
    if (!ev || Clock::now() - checked > std::chrono::milliseconds(100)) {
      checked = Clock::now();
      if (!w.alive()) {
        s.cancel();
        return false;
      }
      if (!ev) continue;
    }
    const bool last = ev->finish != FinishReason::None;
    if (!on_event(*ev)) {
      s.cancel();
      return false;
    }
    if (last) return true;
  }
}

const char* finish_name(FinishReason r, bool tool_calls) {
  if (r == FinishReason::Stop && tool_calls) return "tool_calls";
  return engine::finish_reason_name(r);
}

Json tool_calls_json(const std::vector<ToolCall>& calls, size_t first_index, bool with_index) {
  Json out = Json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    Json c = {{"id", calls[i].id},
              {"type", "function"},
              {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (with_index) c["index"] = first_index + i;
    out.push_back(std::move(c));
  }
  return out;
}

void merge(ChatDelta& into, ChatDelta&& more) {
  into.reasoning += more.reasoning;
  into.content += more.content;
  for (auto& c : more.tool_calls) into.tool_calls.push_back(std::move(c));
}

void check_model(const std::string& asked, const std::string& served) {
  if (!asked.empty() && asked != served)
    throw ApiError(404, fmt::format("The model '{}' does not exist; this server serves '{}'", asked, served), "model",
                   "model_not_found");
}

}  // namespace

HttpResponse Server::chat_completions(const HttpRequest& req, const Engine& e) {
  const ChatRequest r = parse_chat_request(req.body);
  check_model(r.gen.model, e.name);
  const std::string prompt = e.format->render(r.messages, r.tools, r.template_kwargs);
  auto job = submit(*e.scheduler, e.config.ctx_size, e.tok->encode(prompt, false, true), r.gen, "messages");
  auto parser =
      std::make_shared<ChatOutputParser>(e.format->tool_syntax(), r.tools, ChatFormat::opens_reasoning(prompt));
  const bool want_logprobs = r.gen.sampling.top_logprobs >= 0;
  const std::string id = new_response_id("chatcmpl"), model = e.name;
  const int64_t created = unix_time();
  const tokenizer::Tokenizer& tok = *e.tok;

  HttpResponse res;
  if (!r.gen.stream) {
    res.stream = [job, parser, want_logprobs, id, model, created, &tok](ResponseWriter& w) {
      std::string text;
      std::vector<engine::Sampled> tokens;
      Event last;
      const bool finished = pump(*job->stream, w, [&](Event& ev) {
        text += ev.text;
        if (want_logprobs) tokens.insert(tokens.end(), ev.tokens.begin(), ev.tokens.end());
        last = std::move(ev);
        return true;
      });
      if (!finished) return;
      if (last.finish == FinishReason::Error) {
        w.write(dump(error_object(500, last.error)));
        return;
      }
      ChatDelta d = parser->push(text);
      merge(d, parser->finish());
      Json msg = {{"role", "assistant"}};
      msg["content"] = d.content.empty() && !d.tool_calls.empty() ? Json() : Json(d.content);
      if (!d.reasoning.empty()) msg["reasoning_content"] = d.reasoning;
      if (!d.tool_calls.empty()) msg["tool_calls"] = tool_calls_json(d.tool_calls, 0, false);
      Json choice = {{"index", 0},
                     {"message", msg},
                     {"logprobs", want_logprobs ? chat_logprobs(tok, tokens) : Json()},
                     {"finish_reason", finish_name(last.finish, !d.tool_calls.empty())}};
      w.write(dump({{"id", id},
                    {"object", "chat.completion"},
                    {"created", created},
                    {"model", model},
                    {"choices", Json::array({choice})},
                    {"usage", usage_json(last.usage)}}));
    };
    return res;
  }

  const bool include_usage = r.gen.include_usage;
  res.content_type = "text/event-stream";
  res.headers["Cache-Control"] = "no-cache";
  res.stream = [job, parser, want_logprobs, include_usage, id, model, created, &tok](ResponseWriter& w) {
    auto chunk = [&](Json delta, Json logprobs, Json finish) {
      Json c = {{"id", id},
                {"object", "chat.completion.chunk"},
                {"created", created},
                {"model", model},
                {"choices", Json::array({{{"index", 0},
                                          {"delta", std::move(delta)},
                                          {"logprobs", std::move(logprobs)},
                                          {"finish_reason", std::move(finish)}}})}};
      if (include_usage) c["usage"] = nullptr;
      return w.write(sse(c));
    };
    if (!chunk({{"role", "assistant"}, {"content", ""}}, nullptr, nullptr)) {
      job->stream->cancel();
      return;
    }
    std::vector<engine::Sampled> pending;  // tokens whose logprobs have not gone out with a chunk
    size_t n_calls = 0;
    pump(*job->stream, w, [&](Event& ev) {
      const bool last = ev.finish != FinishReason::None;
      if (want_logprobs) pending.insert(pending.end(), ev.tokens.begin(), ev.tokens.end());
      ChatDelta d = parser->push(ev.text);
      if (last) merge(d, parser->finish());
      auto logprobs = [&]() -> Json {
        if (!want_logprobs || pending.empty()) return nullptr;
        Json j = chat_logprobs(tok, pending);
        pending.clear();
        return j;
      };
      bool ok = true;
      if (!d.reasoning.empty()) ok = ok && chunk({{"reasoning_content", d.reasoning}}, logprobs(), nullptr);
      if (!d.content.empty()) ok = ok && chunk({{"content", d.content}}, logprobs(), nullptr);
      if (!d.tool_calls.empty()) {
        ok = ok && chunk({{"tool_calls", tool_calls_json(d.tool_calls, n_calls, true)}}, logprobs(), nullptr);
        n_calls += d.tool_calls.size();
      }
      if (!last || !ok) return ok;
      if (ev.finish == FinishReason::Error) return w.write(sse(error_object(500, ev.error))) && w.write(kSseDone);
      ok = chunk(Json::object(), logprobs(), finish_name(ev.finish, n_calls > 0));
      if (ok && include_usage)
        ok = w.write(sse({{"id", id},
                          {"object", "chat.completion.chunk"},
                          {"created", created},
                          {"model", model},
                          {"choices", Json::array()},
                          {"usage", usage_json(ev.usage)}}));
      return ok && w.write(kSseDone);
    });
  };
  return res;
}

HttpResponse Server::completions(const HttpRequest& req, const Engine& e) {
  const CompletionRequest r = parse_completion_request(req.body);
  check_model(r.gen.model, e.name);
  const tokenizer::Tokenizer& tok = *e.tok;
  std::vector<int32_t> ids =
      r.prompt_text ? tok.encode(*r.prompt_text, tok.add_bos_default() && tok.bos() >= 0, true) : r.prompt_tokens;
  for (int32_t id : ids)
    if (id >= tok.n_vocab()) invalid("prompt", "token id {} is outside the vocabulary of {} tokens", id, tok.n_vocab());
  const std::string echo = !r.echo ? std::string() : r.prompt_text ? *r.prompt_text : tok.decode(ids);
  auto job = submit(*e.scheduler, e.config.ctx_size, std::move(ids), r.gen, "prompt");
  const bool want_logprobs = r.gen.sampling.top_logprobs >= 0;
  const std::string id = new_response_id("cmpl"), model = e.name;
  const int64_t created = unix_time();

  auto completion = [id, model, created](Json choice) {
    return Json{{"id", id},
                {"object", "text_completion"},
                {"created", created},
                {"model", model},
                {"choices", Json::array({std::move(choice)})}};
  };
  HttpResponse res;
  if (!r.gen.stream) {
    res.stream = [job, echo, want_logprobs, completion, &tok](ResponseWriter& w) {
      std::string text = echo;
      std::vector<engine::Sampled> tokens;
      Event last;
      if (!pump(*job->stream, w, [&](Event& ev) {
            text += ev.text;
            if (want_logprobs) tokens.insert(tokens.end(), ev.tokens.begin(), ev.tokens.end());
            last = std::move(ev);
            return true;
          }))
        return;
      if (last.finish == FinishReason::Error) {
        w.write(dump(error_object(500, last.error)));
        return;
      }
      Json body = completion({{"index", 0},
                              {"text", text},
                              {"logprobs", want_logprobs ? completion_logprobs(tok, tokens, echo.size()) : Json()},
                              {"finish_reason", engine::finish_reason_name(last.finish)}});
      body["usage"] = usage_json(last.usage);
      w.write(dump(body));
    };
    return res;
  }

  const bool include_usage = r.gen.include_usage;
  res.content_type = "text/event-stream";
  res.headers["Cache-Control"] = "no-cache";
  res.stream = [job, echo, want_logprobs, include_usage, completion, &tok](ResponseWriter& w) {
    size_t offset = echo.size();  // of the next token in the text, for logprobs
    std::string pending_echo = echo;
    pump(*job->stream, w, [&](Event& ev) {
      const bool last = ev.finish != FinishReason::None;
      if (last && ev.finish == FinishReason::Error)
        return w.write(sse(error_object(500, ev.error))) && w.write(kSseDone);
      const std::string text = pending_echo + ev.text;
      pending_echo.clear();
      Json choice = {{"index", 0},
                     {"text", text},
                     {"logprobs", want_logprobs ? completion_logprobs(tok, ev.tokens, offset) : Json()},
                     {"finish_reason", last ? Json(engine::finish_reason_name(ev.finish)) : Json()}};
      for (const auto& t : ev.tokens) offset += token_piece(tok, t.id).size();
      Json c = completion(std::move(choice));
      if (include_usage) c["usage"] = nullptr;
      if ((!text.empty() || last || want_logprobs) && !w.write(sse(c))) return false;
      if (!last) return true;
      if (include_usage) {
        Json u = completion(nullptr);
        u["choices"] = Json::array();
        u["usage"] = usage_json(ev.usage);
        if (!w.write(sse(u))) return false;
      }
      return w.write(kSseDone);
    });
  };
  return res;
}

}  // namespace sparsemla::server
