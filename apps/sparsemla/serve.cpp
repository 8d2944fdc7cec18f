// `sparsemla serve`: the OpenAI-compatible server, on the backend the device options name (CPU or
// GPU, whole or split over --tensor-parallel ranks).
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "commands.h"
#include "default_model.h"
#include "device_options.h"
#include "server/server.h"
#include "util/error.h"

namespace sparsemla::app {
namespace {

int run_serve(server::ServerOptions opts, const std::string& attention, const DeviceArgs& dev, int threads) {
  check_device_args(dev);
  opts.attention = attention == "dense" ? model::AttentionMode::Dense : model::AttentionMode::Sparse;
  opts.backend = backend_options(dev, threads);
  // SIGINT and SIGTERM are taken by sigwait() below; every thread started from here inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  server::Server srv(opts);
  const int port = srv.listen();
  std::printf("listening on http://%s:%d\n", opts.host.c_str(), port);
  std::fflush(stdout);
  // /health answers 503 while this thread loads the model.
  std::string load_error;
  std::thread loader([&] {
    try {
      srv.load();
      std::printf("ready\n");
      std::fflush(stdout);
    } catch (const std::exception& e) {
      load_error = e.what();
      kill(getpid(), SIGTERM);
    }
  });
  int sig = 0;
  sigwait(&signals, &sig);
  loader.join();
  srv.stop();
  if (!load_error.empty()) fail("{}", load_error);
  return 0;
}

}  // namespace

Runner add_serve(CLI::App& app) {
  auto o = std::make_shared<server::ServerOptions>();
  auto attention = std::make_shared<std::string>("sparse");
  auto dev = std::make_shared<DeviceArgs>();
  auto threads = std::make_shared<int>(0);
  CLI::App* cmd =
      app.add_subcommand("serve", "OpenAI-compatible HTTP server with continuous batching and a chat page at /");
  cmd->add_option("--model,-m", o->model_path, "GGUF model (any part of a split model; default: the bundled model)");
  cmd->add_option("--host", o->host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", o->port, "port (0: any free port, printed at start)")->capture_default_str();
  cmd->add_option("--api-key", o->api_key, "require 'Authorization: Bearer KEY' on the API routes");
  cmd->add_option("--served-model-name", o->served_name, "the model id clients use (default: the file name)");
  cmd->add_option("--max-seqs", o->max_seqs, "sequences generating at once")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--ctx-size", o->ctx_size, "context per sequence (default: the model's, at most 8192)")
      ->check(CLI::Range(1, 1 << 24));
  cmd->add_option("--kv-cache-tokens", o->kv_cache_tokens,
                  "KV cache size in tokens (default: max-seqs x ctx-size; on the GPU it must fit beside the weights)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 32));
  cmd->add_option("--batch-tokens", o->batch_tokens,
                  fmt::format("tokens per forward pass: decodes, then prompt chunks (default: {} on a GPU, {} on the "
                              "CPU; larger chunks take long prompts in faster but need more GPU workspace)",
                              engine::kGpuBatchTokens, engine::kCpuBatchTokens))
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--max-body-bytes", o->max_body_bytes, "largest request body accepted")->capture_default_str();
  cmd->add_option("--threads,-t", *threads, "CPU threads (default: all)");
  cmd->add_option("--attention", *attention, "sparse (the model's DSA top-k, default) or dense (every position)")
      ->check(CLI::IsMember({"sparse", "dense"}));
  add_device_options(cmd, *dev);
  return [=] {
    if (o->model_path.empty()) o->model_path = default_model_path();
    return run_serve(*o, *attention, *dev, *threads);
  };
}

}  // namespace sparsemla::app
