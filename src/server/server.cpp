#include "server/server.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <filesystem>

#include "server/api_error.h"
#include "server/auth.h"
#include "server/chat_page.h"
#include "server/metrics_text.h"
#include "server/openai_request.h"
#include "server/openai_response.h"

namespace sparsemla::server {
namespace {

HttpResponse json_response(int status, const Json& body) {
  HttpResponse r;
  r.status = status;
  r.body = dump(body);
  return r;
}

HttpResponse error_response(int status, const std::string& message, const std::string& param = {},
                            const std::string& code = {}) {
  HttpResponse r = json_response(status, error_object(status, message, param, code));
  if (status == 401) r.headers["WWW-Authenticate"] = "Bearer";
  return r;
}

// Errors escaping a handler become OpenAI error objects; nothing a client sends ends the process.
HttpResponse guarded(const std::function<HttpResponse()>& fn) {
  try {
    return fn();
  } catch (const ApiError& e) {
    return error_response(e.status, e.what(), e.param, e.code);
  } catch (const Error& e) {  // user-caused by convention (util/error.h): a bad token id, a bad text
    return error_response(400, e.what());
  } catch (const std::bad_alloc&) {
    return error_response(500, "out of memory");
  } catch (const std::exception& e) {
    return error_response(500, std::string("internal error: ") + e.what());
  }
}

}  // namespace

Server::Server(ServerOptions opts) : opts_(std::move(opts)) {}

Server::~Server() { stop(); }

void Server::add(const std::string& method, const std::string& path, Route route, bool needs_key) {
  http_->route(method, path, [this, route, needs_key](const HttpRequest& req) {
    return guarded([&] {
      if (needs_key && !opts_.api_key.empty()) check_api_key(req, opts_.api_key);
      if (req.body_too_large)
        throw ApiError(413, fmt::format("the request body is larger than the limit of {} bytes", opts_.max_body_bytes));
      if (!ready_.load(std::memory_order_acquire)) throw ApiError(503, "the model is loading", {}, "model_loading");
      return (this->*route)(req, *engine_);
    });
  });
}

int Server::listen() {
  HttpOptions ho;
  ho.max_body_bytes = opts_.max_body_bytes;
  // A streaming client holds a connection thread for as long as it generates: room for every
  // running and some waiting ones, and a few for /health and /metrics.
  ho.threads = std::clamp(2 * opts_.max_seqs + 8, 16, 512);
  http_ = make_http_server(ho);
  add("POST", "/v1/chat/completions", &Server::chat_completions, true);
  add("POST", "/v1/completions", &Server::completions, true);
  add("GET", "/v1/models", &Server::models, true);
  add("POST", "/tokenize", &Server::tokenize, true);
  add("POST", "/detokenize", &Server::detokenize, true);
  http_->route("GET", "/health", [this](const HttpRequest& req) { return guarded([&] { return health(req); }); });
  http_->route("GET", "/metrics", [this](const HttpRequest& req) { return guarded([&] { return metrics(req); }); });
  http_->route("GET", "/", [](const HttpRequest&) {
    HttpResponse r;
    r.content_type = "text/html; charset=utf-8";
    r.body = std::string(kChatPage);
    return r;
  });
  const size_t limit = opts_.max_body_bytes;
  http_->error_body([limit](int status) {
    const std::string msg = status == 404 ? "no such route"
                            : status == 413
                                ? fmt::format("the request body is larger than the limit of {} bytes", limit)
                                : "the request could not be read";
    return dump(error_object(status, msg));
  });
  http_->observe([this](int status) {
    std::lock_guard lk(status_mu_);
    ++responses_by_status_[status];
  });
  const int port = http_->bind(opts_.host, opts_.port);
  if (port <= 0) fail("cannot listen on {}:{}", opts_.host, opts_.port);
  http_thread_ = std::thread([this] { http_->serve(); });
  return port;
}

void Server::load() {
  auto e = std::make_unique<Engine>();
  e->model = model::Model::load(opts_.model_path, {opts_.attention, opts_.backend.threads});
  e->tok = tokenizer::Tokenizer::from_gguf(e->model->file());
  e->format = std::make_unique<ChatFormat>(ChatFormat::for_model(e->model->file(), *e->tok));
  const uint32_t trained = e->model->hparams().n_ctx_train;
  const int32_t ctx = opts_.ctx_size > 0 ? opts_.ctx_size : int32_t(std::min<uint32_t>(trained ? trained : 4096, 8192));
  const int64_t kv_tokens = opts_.kv_cache_tokens > 0 ? opts_.kv_cache_tokens : int64_t(opts_.max_seqs) * ctx;
  engine::SchedulerConfig& c = e->config;
  c.max_seqs = opts_.max_seqs;
  const int32_t batch_tokens =
      opts_.batch_tokens > 0 ? opts_.batch_tokens : engine::default_batch_tokens(opts_.backend.device);
  c.batch_tokens = std::max(batch_tokens, opts_.max_seqs);
  c.ctx_size = ctx;
  c.block_size = opts_.block_size;
  const int64_t kv_blocks = (kv_tokens + c.block_size - 1) / c.block_size;
  if (kv_blocks > INT32_MAX) fail("a KV cache of {} tokens is {} blocks of {}: too many", kv_tokens, kv_blocks, c.block_size);
  c.kv_blocks = int32_t(kv_blocks);
  c.max_waiting = opts_.max_waiting;
  c.visible_special = ChatFormat::marker_tokens(*e->tok);
  c.backend = opts_.backend;
  e->scheduler = std::make_unique<engine::Scheduler>(*e->model, *e->tok, c, &metrics_);
  e->scheduler->start();
  e->name = !opts_.served_name.empty() ? opts_.served_name : std::filesystem::path(opts_.model_path).stem().string();
  e->created = unix_time();
  std::fprintf(stderr, "%s\nmodel '%s' ready: context %d, up to %d sequences, chat format: %s\n",
               e->scheduler->backend().description().c_str(), e->name.c_str(), ctx, c.max_seqs,
               e->format->builtin() ? "built-in" : "the model's chat template");
  engine_ = std::move(e);
  ready_.store(true, std::memory_order_release);
}

void Server::stop() {
  // The scheduler first: it ends every pending request, so that handlers waiting on one return.
  if (engine_ && engine_->scheduler) engine_->scheduler->stop();
  if (http_) http_->stop();
  if (http_thread_.joinable()) http_thread_.join();
}

HttpResponse Server::models(const HttpRequest&, const Engine& e) {
  return json_response(200, {{"object", "list"},
                             {"data", Json::array({{{"id", e.name},
                                                    {"object", "model"},
                                                    {"created", e.created},
                                                    {"owned_by", "sparsemla"},
                                                    {"max_model_len", e.config.ctx_size}}})}});
}

HttpResponse Server::tokenize(const HttpRequest& req, const Engine& e) {
  const Json j = parse_body(req.body);
  std::vector<int32_t> ids;
  if (j.contains("messages")) {
    const ChatRequest r = parse_chat_request(req.body);
    ids = e.tok->encode(e.format->render(r.messages, r.tools, r.template_kwargs), false, true);
  } else {
    auto text = get_string(j, "content");
    if (!text) text = get_string(j, "prompt");
    if (!text) invalid("content", "'content' (the text to tokenize) is required");
    const bool add_special = get_bool(j, "add_special").value_or(get_bool(j, "add_special_tokens").value_or(false));
    ids = e.tok->encode(*text, add_special && e.tok->bos() >= 0, true);
  }
  return json_response(200, {{"tokens", ids}, {"count", ids.size()}, {"max_model_len", e.config.ctx_size}});
}

HttpResponse Server::detokenize(const HttpRequest& req, const Engine& e) {
  const Json j = parse_body(req.body);
  const Json* tokens = get_array(j, "tokens");
  if (!tokens) invalid("tokens", "'tokens' (an array of token ids) is required");
  std::vector<int32_t> ids;
  for (const auto& t : *tokens) {
    if (!t.is_number_integer()) invalid("tokens", "'tokens' must hold integers, got {}", json_type(t));
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= e.tok->n_vocab())
      invalid("tokens", "token id {} is outside the vocabulary of {} tokens", id, e.tok->n_vocab());
    ids.push_back(int32_t(id));
  }
  return json_response(200, {{"content", e.tok->decode(ids)}});
}

HttpResponse Server::health(const HttpRequest&) {
  if (!ready_.load(std::memory_order_acquire)) return json_response(503, {{"status", "loading"}});
  return json_response(200, {{"status", "ok"}});
}

HttpResponse Server::metrics(const HttpRequest&) {
  engine::SchedulerStats st;
  if (ready_.load(std::memory_order_acquire)) st = engine_->scheduler->stats();
  std::map<int, uint64_t> by_status;
  {
    std::lock_guard lk(status_mu_);
    by_status = responses_by_status_;
  }
  HttpResponse r;
  r.content_type = "text/plain; version=0.0.4; charset=utf-8";
  r.body = metrics_text(metrics_, st, by_status);
  return r;
}

}  // namespace sparsemla::server
