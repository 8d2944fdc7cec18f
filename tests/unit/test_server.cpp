// The server end to end, in process, on 127.0.0.1 and a free port, over HTTP with cpp-httplib's
// client, on the glm_pub fixture (no chat template: the built-in GLM format applies): chat and
// completions, streamed and not, stop strings across token boundaries, usage, every bad-input case
// with its status and error object, the API key, /health while loading, /metrics, concurrent seeded
// requests against the same requests alone, and a client that leaves mid-stream.
#include <gtest/gtest.h>
#include <httplib.h>

#include <regex>
#include <sstream>
#include <thread>

#include "server/server.h"
#include "test_util.h"

namespace sparsemla::server {
namespace {

using Json = nlohmann::json;

ServerOptions options() {
  ServerOptions o;
  o.model_path = test::fixture_path("glm_pub/model-f32.gguf");
  o.port = 0;
  o.backend.threads = 2;
  o.ctx_size = 512;
  o.max_seqs = 4;
  o.max_body_bytes = 64 << 10;
  o.served_name = "glm-pub";
  return o;
}

class Running {
 public:
  explicit Running(ServerOptions o = options()) : srv(o) {
    port = srv.listen();
    srv.load();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(30, 0);
    return c;
  }
  Server srv;
  int port = 0;
};

// One server for the tests that do not need their own.
Running& shared() {
  static Running r;
  return r;
}

struct Reply {
  int status = 0;
  std::string body;
  Json json() const { return Json::parse(body); }
};

Reply post(const Running& r, const std::string& path, const std::string& body, const httplib::Headers& h = {}) {
  auto c = r.client();
  auto res = c.Post(path.c_str(), h, body, "application/json");
  if (!res) return {-1, httplib::to_string(res.error())};
  return {res->status, res->body};
}

Reply get(const Running& r, const std::string& path, const httplib::Headers& h = {}) {
  auto c = r.client();
  auto res = c.Get(path.c_str(), h);
  if (!res) return {-1, httplib::to_string(res.error())};
  return {res->status, res->body};
}

// The JSON of each `data:` event, and whether [DONE] closed the stream.
std::vector<Json> sse_events(const std::string& body, bool* done) {
  std::vector<Json> out;
  *done = false;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) end = body.size();
    const std::string ev = body.substr(pos, end - pos);
    pos = end + 2;
    if (ev.rfind("data: ", 0) != 0) continue;
    const std::string data = ev.substr(6);
    if (data == "[DONE]") {
      *done = true;
      EXPECT_GE(pos, body.size()) << "events after [DONE]";
    } else {
      out.push_back(Json::parse(data));
    }
  }
  return out;
}

std::string chat_body(const std::string& user, Json extra = Json::object()) {
  Json j = {{"model", "glm-pub"},
            {"messages", {{{"role", "user"}, {"content", user}}}},
            {"max_tokens", 12},
            {"temperature", 0}};
  for (auto& [k, v] : extra.items()) j[k] = v;
  return j.dump();
}

void expect_error(const Reply& r, int status, const std::string& param = {}, const std::string& code = {}) {
  EXPECT_EQ(r.status, status) << r.body;
  Json j = Json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j.contains("error")) << r.body;
  EXPECT_TRUE(j["error"]["message"].is_string() && !j["error"]["message"].get<std::string>().empty()) << r.body;
  EXPECT_TRUE(j["error"]["type"].is_string()) << r.body;
  if (!param.empty()) EXPECT_EQ(j["error"]["param"], param) << r.body;
  if (!code.empty()) EXPECT_EQ(j["error"]["code"], code) << r.body;
}

TEST(Server, HealthIs503WhileLoadingThen200) {
  Server srv(options());
  const int port = srv.listen();
  httplib::Client c("127.0.0.1", port);
  auto r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  r = c.Post("/v1/chat/completions", chat_body("hi"), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  srv.load();
  r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(Json::parse(r->body)["status"], "ok");
}

TEST(Server, ChatCompletion) {
  const Reply r = post(shared(), "/v1/chat/completions", chat_body("Hello there"));
  ASSERT_EQ(r.status, 200) << r.body;
  const Json j = r.json();
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_TRUE(j["id"].get<std::string>().starts_with("chatcmpl-"));
  EXPECT_EQ(j["model"], "glm-pub");
  const Json& c = j["choices"][0];
  EXPECT_EQ(c["message"]["role"], "assistant");
  EXPECT_TRUE(c["message"]["content"].is_string());
  EXPECT_TRUE(c["finish_reason"] == "length" || c["finish_reason"] == "stop");
  EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 0);
  EXPECT_EQ(j["usage"]["total_tokens"],
            j["usage"]["prompt_tokens"].get<int>() + j["usage"]["completion_tokens"].get<int>());
  if (c["finish_reason"] == "length") EXPECT_EQ(j["usage"]["completion_tokens"], 12);
}

TEST(Server, StreamedChatEqualsTheWholeReply) {
  const Json whole =
      post(shared(), "/v1/chat/completions", chat_body("Tell me more", {{"logprobs", true}, {"top_logprobs", 2}}))
          .json();
  const Reply r = post(
      shared(), "/v1/chat/completions",
      chat_body(
          "Tell me more",
          {{"stream", true}, {"stream_options", {{"include_usage", true}}}, {"logprobs", true}, {"top_logprobs", 2}}));
  ASSERT_EQ(r.status, 200) << r.body;
  bool done = false;
  const auto events = sse_events(r.body, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events[0]["choices"][0]["delta"]["role"], "assistant");
  std::string content;
  std::string finish;
  size_t n_logprobs = 0;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const Json& e = events[i];
    EXPECT_EQ(e["object"], "chat.completion.chunk");
    EXPECT_TRUE(e["usage"].is_null()) << "usage comes only in the last chunk";
    const Json& c = e["choices"][0];
    if (c["delta"].contains("content")) content += c["delta"]["content"].get<std::string>();
    if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
    if (c["logprobs"].is_object()) n_logprobs += c["logprobs"]["content"].size();
  }
  const Json& last = events.back();
  EXPECT_TRUE(last["choices"].empty());
  EXPECT_EQ(last["usage"], whole["usage"]);
  EXPECT_EQ(content, whole["choices"][0]["message"]["content"]);
  EXPECT_EQ(finish, whole["choices"][0]["finish_reason"]);
  EXPECT_EQ(n_logprobs, whole["choices"][0]["logprobs"]["content"].size());
  EXPECT_EQ(n_logprobs, whole["usage"]["completion_tokens"].get<size_t>());
  EXPECT_EQ(whole["choices"][0]["logprobs"]["content"][0]["top_logprobs"].size(), 2u);
}

TEST(Server, CompletionsStreamedAndWhole) {
  const Json body = {{"prompt", "The cat sat on"}, {"max_tokens", 10}, {"temperature", 0}, {"logprobs", 3}};
  const Reply whole = post(shared(), "/v1/completions", body.dump());
  ASSERT_EQ(whole.status, 200) << whole.body;
  const Json w = whole.json();
  EXPECT_EQ(w["object"], "text_completion");
  EXPECT_EQ(w["choices"][0]["logprobs"]["tokens"].size(), w["usage"]["completion_tokens"].get<size_t>());
  EXPECT_EQ(w["choices"][0]["logprobs"]["top_logprobs"][0].size(), 3u);

  Json sbody = body;
  sbody["stream"] = true;
  const Reply s = post(shared(), "/v1/completions", sbody.dump());
  bool done = false;
  std::string text, finish;
  for (const Json& e : sse_events(s.body, &done)) {
    text += e["choices"][0]["text"].get<std::string>();
    if (!e["choices"][0]["finish_reason"].is_null()) finish = e["choices"][0]["finish_reason"];
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(text, w["choices"][0]["text"]);
  EXPECT_EQ(finish, w["choices"][0]["finish_reason"]);

  Json echo = body;
  echo["echo"] = true;
  EXPECT_EQ(post(shared(), "/v1/completions", echo.dump()).json()["choices"][0]["text"],
            "The cat sat on" + w["choices"][0]["text"].get<std::string>());
  // Token ids as the prompt.
  const Json tokens = post(shared(), "/tokenize", Json{{"content", "The cat sat on"}}.dump()).json()["tokens"];
  Json by_ids = body;
  by_ids["prompt"] = tokens;
  EXPECT_EQ(post(shared(), "/v1/completions", by_ids.dump()).json()["choices"][0]["text"], w["choices"][0]["text"]);
}

TEST(Server, StopStringsAcrossTokenBoundariesAreNeverStreamed) {
  const Json base = {{"prompt", "Once upon a time"}, {"max_tokens", 24}, {"temperature", 0}, {"logprobs", 0}};
  const Json full = post(shared(), "/v1/completions", base.dump()).json();
  const std::string text = full["choices"][0]["text"];
  const Json& toks = full["choices"][0]["logprobs"]["tokens"];
  // A stop string made of the last byte of one token and the first byte of the next.
  std::string stop;
  for (size_t i = 0; i + 1 < toks.size() && stop.empty(); ++i) {
    const std::string a = toks[i], b = toks[i + 1];
    if (!a.empty() && !b.empty() && uint8_t(a.back()) < 0x80 && uint8_t(b.front()) < 0x80 && a.back() != '<' &&
        text.find(std::string(1, a.back()) + b.front()) != std::string::npos)
      stop = std::string(1, a.back()) + b.front();
  }
  ASSERT_FALSE(stop.empty()) << text;
  const std::string want = text.substr(0, text.find(stop));
  Json with_stop = base;
  with_stop["stop"] = {stop};
  const Json got = post(shared(), "/v1/completions", with_stop.dump()).json();
  EXPECT_EQ(got["choices"][0]["text"], want);
  EXPECT_EQ(got["choices"][0]["finish_reason"], "stop");

  with_stop["stream"] = true;
  bool done = false;
  std::string streamed;
  for (const Json& e : sse_events(post(shared(), "/v1/completions", with_stop.dump()).body, &done))
    streamed += e["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(streamed, want);
}

TEST(Server, ToolsAreRenderedIntoThePrompt) {
  const Json tools =
      Json::parse(R"([{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");
  const Json tok =
      post(shared(), "/tokenize", Json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"tools", tools}}.dump())
          .json();
  const std::string prompt = post(shared(), "/detokenize", Json{{"tokens", tok["tokens"]}}.dump()).json()["content"];
  EXPECT_NE(prompt.find("# Tools"), std::string::npos) << prompt;
  EXPECT_NE(prompt.find("get_weather"), std::string::npos) << prompt;
  EXPECT_TRUE(prompt.ends_with("<|user|>\nhi<|assistant|>")) << prompt;
  const Reply r = post(shared(), "/v1/chat/completions", chat_body("weather?", {{"tools", tools}}));
  EXPECT_EQ(r.status, 200) << r.body;
}

TEST(Server, BadInputGetsAnOpenAIError) {
  const Running& s = shared();
  const std::string ok_messages = R"("messages": [{"role": "user", "content": "hi"}])";
  expect_error(post(s, "/v1/chat/completions", "{\"messages\": [1,"), 400);
  expect_error(post(s, "/v1/chat/completions", "[]"), 400);
  expect_error(post(s, "/v1/chat/completions", R"({"messages": []})"), 400, "messages");
  expect_error(post(s, "/v1/chat/completions", R"({"messages": "hi"})"), 400, "messages");
  expect_error(post(s, "/v1/chat/completions", "{" + ok_messages + R"(, "temperature": "warm"})"), 400, "temperature");
  expect_error(post(s, "/v1/chat/completions", "{" + ok_messages + R"(, "temperature": -1})"), 400, "temperature");
  expect_error(post(s, "/v1/chat/completions", "{" + ok_messages + R"(, "max_tokens": 0})"), 400, "max_tokens");
  expect_error(post(s, "/v1/chat/completions", "{" + ok_messages + R"(, "max_tokens": -5})"), 400, "max_tokens");
  expect_error(post(s, "/v1/chat/completions", "{" + ok_messages + R"(, "stream": 1})"), 400, "stream");
  expect_error(post(s, "/v1/chat/completions", "{" + ok_messages + R"(, "model": "gpt-4"})"), 404, "model",
               "model_not_found");
  expect_error(post(s, "/v1/completions", R"({"prompt": 5})"), 400, "prompt");
  expect_error(post(s, "/v1/completions", R"({"prompt": [1, 5000000]})"), 400, "prompt");
  expect_error(post(s, "/detokenize", R"({"tokens": [1, -1]})"), 400, "tokens");
  // A prompt longer than the context (512 tokens here), and one that leaves no room for max_tokens.
  std::string long_text;
  for (int i = 0; i < 400; ++i) long_text += "lorem ipsum ";
  expect_error(post(s, "/v1/completions", Json{{"prompt", long_text}}.dump()), 400, "prompt",
               "context_length_exceeded");
  expect_error(post(s, "/v1/completions", Json{{"prompt", "hi"}, {"max_tokens", 600}}.dump()), 400, "max_tokens",
               "context_length_exceeded");
  // A body over the configured limit (64 KiB).
  expect_error(post(s, "/v1/completions", Json{{"prompt", std::string(100 << 10, 'a')}}.dump()), 413);
  {  // the same in chunks, without a Content-Length
    auto c = s.client();
    const std::string big = Json{{"prompt", std::string(100 << 10, 'a')}}.dump();
    auto res = c.Post(
        "/v1/completions",
        [&](size_t offset, httplib::DataSink& sink) {
          sink.write(big.data() + offset, std::min<size_t>(4096, big.size() - offset));
          if (offset + 4096 >= big.size()) sink.done();
          return true;
        },
        "application/json");
    ASSERT_TRUE(res);
    expect_error({res->status, res->body}, 413);
  }
  expect_error(get(s, "/v1/nothing-here"), 404);
  // Unknown fields are ignored.
  EXPECT_EQ(post(s, "/v1/chat/completions", "{" + ok_messages + R"(, "max_tokens": 2, "frobnicate": [1, {"a": null}]})")
                .status,
            200);
  // And the server is still there.
  EXPECT_EQ(get(s, "/health").status, 200);
}

TEST(Server, ApiKeyIsRequiredOnTheApi) {
  ServerOptions o = options();
  o.api_key = "sk-test-0123456789";
  Running r(o);
  expect_error(post(r, "/v1/chat/completions", chat_body("hi")), 401, {}, "invalid_api_key");
  expect_error(post(r, "/v1/chat/completions", chat_body("hi"), {{"Authorization", "Bearer sk-test-0123456788"}}), 401);
  expect_error(post(r, "/v1/chat/completions", chat_body("hi"), {{"Authorization", "Bearer sk-test-01234567890"}}),
               401);
  expect_error(get(r, "/v1/models", {{"Authorization", "Basic sk-test-0123456789"}}), 401);
  EXPECT_EQ(post(r, "/v1/chat/completions", chat_body("hi"), {{"Authorization", "Bearer sk-test-0123456789"}}).status,
            200);
  const Reply models = get(r, "/v1/models", {{"Authorization", "Bearer sk-test-0123456789"}});
  EXPECT_EQ(models.json()["data"][0]["id"], "glm-pub");
  EXPECT_EQ(get(r, "/health").status, 200);  // health and metrics stay open for probes
}

TEST(Server, MetricsArePrometheusText) {
  post(shared(), "/v1/chat/completions", chat_body("count me"));
  auto c = shared().client();
  auto res = c.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_TRUE(res->get_header_value("Content-Type").starts_with("text/plain"));
  const std::string m = res->body;
  const std::regex sample(R"(^[a-z_]+(\{[a-z_]+="[^"]*"\})? -?[0-9.e+]+(inf)?$)");
  std::istringstream lines(m);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.starts_with("# HELP ") || line.starts_with("# TYPE ")) continue;
    EXPECT_TRUE(std::regex_match(line, sample)) << line;
  }
  for (const char* want :
       {"# TYPE sparsemla_requests_total counter", "sparsemla_requests_total{status=\"200\"}",
        "sparsemla_prompt_tokens_total", "sparsemla_generation_tokens_total", "sparsemla_requests_waiting",
        "sparsemla_kv_blocks_used", "sparsemla_kv_blocks_free",
        "# TYPE sparsemla_time_to_first_token_seconds histogram",
        "sparsemla_time_to_first_token_seconds_bucket{le=\"+Inf\"}", "sparsemla_inter_token_latency_seconds_count"})
    EXPECT_NE(m.find(want), std::string::npos) << want;
  std::smatch count;
  ASSERT_TRUE(std::regex_search(m, count, std::regex(R"(sparsemla_time_to_first_token_seconds_count (\d+))")));
  EXPECT_GE(std::stoi(count[1]), 1);
}

TEST(Server, ConcurrentSeededRequestsEqualTheSameRequestsAlone) {
  std::vector<std::string> bodies;
  for (int i = 0; i < 4; ++i)
    bodies.push_back(chat_body(
        "story number " + std::to_string(i),
        {{"temperature", 0.9}, {"top_p", 0.95}, {"seed", 100 + i}, {"max_tokens", 16}, {"stream", i % 2 == 1}}));
  std::vector<std::string> alone;
  for (const auto& b : bodies) alone.push_back(post(shared(), "/v1/chat/completions", b).body);
  std::vector<std::string> together(bodies.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < bodies.size(); ++i)
    threads.emplace_back([&, i] { together[i] = post(shared(), "/v1/chat/completions", bodies[i]).body; });
  for (auto& t : threads) t.join();
  auto content = [](const std::string& body) {
    if (!body.starts_with("data: ")) return Json::parse(body)["choices"][0]["message"]["content"].get<std::string>();
    bool done = false;
    std::string s;
    for (const Json& e : sse_events(body, &done))
      if (!e["choices"].empty() && e["choices"][0]["delta"].contains("content"))
        s += e["choices"][0]["delta"]["content"].get<std::string>();
    return s;
  };
  for (size_t i = 0; i < bodies.size(); ++i) EXPECT_EQ(content(together[i]), content(alone[i])) << "request " << i;
}

TEST(Server, AClientThatLeavesFreesItsBlocks) {
  ServerOptions o = options();
  o.ctx_size = 4096;  // room for a generation far longer than the test waits
  Running r(o);
  auto metric = [&](const std::string& name) {
    const std::string m = get(r, "/metrics").body;
    std::smatch v;
    if (!std::regex_search(m, v, std::regex("\n" + name + " ([0-9.e+]+)"))) return -1.0;
    return std::stod(v[1]);
  };
  httplib::Client c("127.0.0.1", r.port);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = Json{{"prompt", "go on"}, {"max_tokens", 4000}, {"stream", true}, {"ignore_eos", true}}.dump();
  req.set_header("Content-Type", "application/json");
  int chunks = 0;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };
  c.send(req);  // ends with "canceled": the client hung up after 3 chunks
  bool freed = false;
  for (int i = 0; i < 100 && !freed; ++i) {
    freed = metric("sparsemla_kv_blocks_used") == 0 && metric("sparsemla_requests_running") == 0;
    if (!freed) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(freed);
  EXPECT_LT(metric("sparsemla_generation_tokens_total"), 4000);
}

TEST(Server, TokenizeAndDetokenizeRoundTrip) {
  const Json t = post(shared(), "/tokenize", Json{{"content", "Hello, world!"}}.dump()).json();
  EXPECT_EQ(t["count"], t["tokens"].size());
  EXPECT_EQ(t["max_model_len"], 512);
  EXPECT_EQ(post(shared(), "/detokenize", Json{{"tokens", t["tokens"]}}.dump()).json()["content"], "Hello, world!");
}

TEST(Server, ASharedSystemPromptIsReused) {
  std::string system;
  for (int i = 0; i < 20; ++i) system += "You are a careful assistant. ";
  auto body = [&](const std::string& q) {
    return Json{{"messages", {{{"role", "system"}, {"content", system}}, {{"role", "user"}, {"content", q}}}},
                {"max_tokens", 2}}
        .dump();
  };
  post(shared(), "/v1/chat/completions", body("first question"));
  const Json j = post(shared(), "/v1/chat/completions", body("second question")).json();
  EXPECT_GE(j["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 32) << j.dump();
}

// The bundled trained model through its own chat template: it answers and ends its turn itself.
TEST(Server, TheBundledModelAnswersThroughItsOwnTemplate) {
  ServerOptions o = options();
  o.model_path = std::string(SPARSEMLA_FIXTURES) + "/../../models/tiny-glm5-q8_0.gguf";
  o.served_name.clear();
  Running r(o);
  const Json body = {{"messages", {{{"role", "user"}, {"content", "Give me a fortune cookie."}}}},
                     {"max_tokens", 64},
                     {"temperature", 0}};
  const Json whole = post(r, "/v1/chat/completions", body.dump()).json();
  EXPECT_EQ(whole["model"], "tiny-glm5-q8_0");
  const Json& c = whole["choices"][0];
  EXPECT_EQ(c["finish_reason"], "stop") << whole.dump();  // the model's own end-of-turn token
  const std::string content = c["message"]["content"];
  EXPECT_GT(content.size(), 5u);
  EXPECT_EQ(content.find("<|"), std::string::npos) << content;
  EXPECT_LT(whole["usage"]["completion_tokens"].get<int>(), 64);

  Json sbody = body;
  sbody["stream"] = true;
  bool done = false;
  std::string streamed;
  for (const Json& e : sse_events(post(r, "/v1/chat/completions", sbody.dump()).body, &done))
    if (e["choices"][0]["delta"].contains("content"))
      streamed += e["choices"][0]["delta"]["content"].get<std::string>();
  EXPECT_TRUE(done);
  EXPECT_EQ(streamed, content);
}

TEST(Server, ThePageIsServed) {
  const Reply r = get(shared(), "/");
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(r.body.find("/v1/chat/completions"), std::string::npos);
  EXPECT_NE(r.body.find("createElement(\"details\")"), std::string::npos);
}

}  // namespace
}  // namespace sparsemla::server
