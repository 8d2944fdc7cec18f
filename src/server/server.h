// The OpenAI-compatible server: HTTP routes over one model, one tokenizer and one scheduler, whose
// backend runs the model on the CPU or the GPU, whole or split over ranks. It listens before the
// model is loaded, so that /health can say 503 until it is ready.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "engine/metrics.h"
#include "engine/scheduler.h"
#include "model/model.h"
#include "server/chat_format.h"
#include "server/http.h"
#include "tokenizer/tokenizer.h"

namespace sparsemla::server {

struct ServerOptions {
  std::string model_path;
  std::string host = "127.0.0.1";
  int port = 8080;          // 0: any free port
  std::string api_key;      // empty: no authentication
  std::string served_name;  // the model id clients name; empty: the file name without .gguf
  int32_t max_seqs = 8;
  int32_t ctx_size = 0;         // 0: the model's training context, at most 8192
  int64_t kv_cache_tokens = 0;  // 0: max_seqs * ctx_size (on the GPU too: a cache that does not fit is a load error)
  int32_t batch_tokens = 0;     // tokens per forward; 0: engine::default_batch_tokens(backend.device)
  int32_t block_size = 16;
  int32_t max_waiting = 256;
  size_t max_body_bytes = 8 << 20;
  model::AttentionMode attention = model::AttentionMode::Sparse;
  engine::BackendOptions backend;  // device, tensor parallelism, CPU threads, the GPU's cache format
};

class Server {
 public:
  explicit Server(ServerOptions opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and serves on a thread of its own; returns the port. Until load() ends, every route but
  // /health, /metrics and the page answers 503.
  int listen();
  // Loads the model, the tokenizer and the chat format and starts the scheduler. Throws Error.
  void load();
  void stop();

 private:
  // What load() builds; read-only afterwards.
  struct Engine {
    std::unique_ptr<model::Model> model;
    std::unique_ptr<tokenizer::Tokenizer> tok;
    std::unique_ptr<ChatFormat> format;
    engine::SchedulerConfig config;
    std::unique_ptr<engine::Scheduler> scheduler;
    std::string name;
    int64_t created = 0;
  };
  using Route = HttpResponse (Server::*)(const HttpRequest&, const Engine&);
  void add(const std::string& method, const std::string& path, Route route, bool needs_key);

  HttpResponse chat_completions(const HttpRequest& req, const Engine& e);
  HttpResponse completions(const HttpRequest& req, const Engine& e);
  HttpResponse models(const HttpRequest& req, const Engine& e);
  HttpResponse tokenize(const HttpRequest& req, const Engine& e);
  HttpResponse detokenize(const HttpRequest& req, const Engine& e);
  HttpResponse health(const HttpRequest& req);
  HttpResponse metrics(const HttpRequest& req);

  ServerOptions opts_;
  engine::EngineMetrics metrics_;  // before engine_: the scheduler writes to it
  std::unique_ptr<HttpServer> http_;
  std::thread http_thread_;
  std::unique_ptr<Engine> engine_;
  std::atomic<bool> ready_{false};
  std::mutex status_mu_;
  std::map<int, uint64_t> responses_by_status_;
};

}  // namespace sparsemla::server
