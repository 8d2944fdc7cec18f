// `sparsemla bench`: prefill and decode tokens/s of a model on this machine next to its bound, and
// `sparsemla make-model`: random-weight models of chosen widths to benchmark.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "commands.h"
#include "gguf/ggml_types.h"
#include "kv/paged_cache.h"
#include "model/cost.h"
#include "model/model.h"
#include "model/synthetic.h"
#include "util/error.h"

namespace sparsemla::app {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Single-thread memcpy rate over buffers far larger than the caches, in bytes copied per second.
double memcpy_rate() {
  const size_t n = size_t(256) << 20;
  std::vector<char> a(n, 1), b(n, 2);
  std::memcpy(b.data(), a.data(), n);  // fault the pages in
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t = Clock::now();
    std::memcpy(b.data(), a.data(), n);
    best = std::max(best, double(n) / seconds_since(t));
  }
  return best;
}

struct BenchArgs {
  std::string model;
  int prompt = 128;
  int gen = 32;
  int threads = 0;
};

int run_bench(const BenchArgs& a) {
  if (a.prompt <= 0 || a.gen <= 0) fail("--prompt and --gen must be > 0");
  model::ModelOptions o;
  o.threads = a.threads;
  auto m = model::Model::load(a.model, o);
  const auto& hp = m->hparams();
  const model::TokenCost cost = model::token_cost(m->file(), hp);
  const int64_t total = a.prompt + a.gen;
  kv::PagedCache cache(m->cache_shape(int32_t((total + 15) / 16), 16));
  std::vector<int32_t> table;
  cache.reserve(table, total);
  std::mt19937 rng(1);
  std::vector<int32_t> prompt(size_t(a.prompt));
  for (int32_t& t : prompt) t = int32_t(rng() % hp.n_vocab);

  std::vector<float> logits;
  auto t0 = Clock::now();
  m->forward({model::SeqInput{prompt, 0, &table, false}}, cache, logits);
  const double prefill_s = seconds_since(t0);
  t0 = Clock::now();
  for (int i = 0; i < a.gen; ++i) {
    logits.clear();
    m->forward({model::SeqInput{{int32_t(i % hp.n_vocab)}, a.prompt + i, &table, false}}, cache, logits);
  }
  const double decode_s = seconds_since(t0);
  const double bw = memcpy_rate();
  const double prefill_tps = a.prompt / prefill_s, decode_tps = a.gen / decode_s;
  const double bound_tps = bw / double(cost.weight_bytes);
  std::printf("model: %s (%s, %u layers), %.1f MB of weights read per decode token, %.2f GFLOP per token\n",
              a.model.c_str(), m->spec().name, hp.n_layer, cost.weight_bytes / 1e6, cost.flops / 1e9);
  std::printf("threads: %d, memcpy: %.2f GB/s\n", int(o.threads ? o.threads : int(std::thread::hardware_concurrency())),
              bw / 1e9);
  std::printf("prefill %d tokens: %.1f tokens/s (%.2f GFLOP/s)\n", a.prompt, prefill_tps,
              prefill_tps * cost.flops / 1e9);
  std::printf("decode %d tokens:  %.2f tokens/s (%.2f GB/s of weights); bound %.2f tokens/s "
              "(weight bytes per token / memcpy rate): %.0f%% of it\n",
              a.gen, decode_tps, decode_tps * cost.weight_bytes / 1e9, bound_tps, 100.0 * decode_tps / bound_tps);
  return 0;
}

struct MakeModelArgs {
  std::string preset = "small";
  std::string output;
  std::string type = "q8_0";
  int layers = 0;
  std::string arch = "glm-dsa";
};

int run_make_model(const MakeModelArgs& a) {
  model::SyntheticSpec s = a.preset == "glm5-width" ? model::SyntheticSpec::glm5_width(a.layers ? a.layers : 4)
                                                    : model::SyntheticSpec::glm5_small();
  if (a.layers) s.n_layer = uint32_t(a.layers);
  if (!model::arch_from_name(a.arch, &s.arch)) fail("--arch: '{}' is not glm-dsa or deepseek32", a.arch);
  const auto t = gguf::type_from_name(a.type);
  if (!t) fail("--type: unknown ggml type '{}'", a.type);
  s.matrix_type = *t;
  model::write_synthetic_model(s, a.output);
  std::printf("wrote %s\n", a.output.c_str());
  return 0;
}

}  // namespace

Runner add_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand("bench", "Prefill and decode tokens/s on the CPU, next to the memory-bandwidth bound");
  cmd->add_option("--model,-m", a->model, "GGUF model");
  cmd->add_option("--prompt", a->prompt, "prompt tokens (random ids)");
  cmd->add_option("--gen", a->gen, "decode steps");
  cmd->add_option("--threads,-t", a->threads, "CPU threads (default: all)");
  Runner attention = add_bench_attention(*cmd);
  CLI::App* att = cmd->get_subcommand("attention");
  return [a, att, attention] {
    if (att->parsed()) return attention();
    if (a->model.empty()) fail("bench needs --model FILE (or a subcommand: attention)");
    return run_bench(*a);
  };
}

Runner add_make_model(CLI::App& app) {
  auto a = std::make_shared<MakeModelArgs>();
  CLI::App* cmd = app.add_subcommand("make-model", "Write a random-weight model in llama.cpp's GGUF layout");
  cmd->add_option("--preset", a->preset, "small (GLM-5 shaped, ~40M parameters) or glm5-width (GLM-5's real widths)")
      ->check(CLI::IsMember({"small", "glm5-width"}));
  cmd->add_option("--layers", a->layers, "main layers (the first is dense)");
  cmd->add_option("--type", a->type, "matrix type: f32, f16, bf16, q8_0");
  cmd->add_option("--arch", a->arch, "glm-dsa or deepseek32");
  cmd->add_option("--output,-o", a->output, "output .gguf")->required();
  return [a] { return run_make_model(*a); };
}

}  // namespace sparsemla::app
