// `sparsemla bench`: prefill and decode tokens/s of a model on this machine (CPU or --device cuda,
// whole or split over --tensor-parallel ranks) next to its bound, and
// `sparsemla make-model`: random-weight models of chosen widths to benchmark.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "device_options.h"
#include "engine/backend.h"
#include "gguf/ggml_types.h"
#include "model/cost.h"
#include "model/model.h"
#include "model/synthetic.h"
#include "util/error.h"

#if SPARSEMLA_HAVE_CUDA
#include "ops/cuda/ceilings.h"
#endif

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
  int batch = 1;
  int threads = 0;
  std::string attention = "sparse";
  DeviceArgs dev;
};

std::vector<int32_t> random_prompt(int n, uint32_t n_vocab) {
  std::mt19937 rng(1);
  std::vector<int32_t> prompt(static_cast<size_t>(n));
  for (int32_t& t : prompt) t = int32_t(rng() % n_vocab);
  return prompt;
}

// Prefill of --prompt random tokens for each of --batch sequences, then --gen decode steps of one
// token per sequence, on the backend the device options name. The bound is the weight bytes one
// decode step reads (once for the whole batch: a lower bound on what a MoE step reads, whose
// sequences may route to different experts) over the copy rate: one CPU thread's memcpy (the ranks
// of a split CPU model share the memory), or the device-to-device copy of each GPU.
int run_bench(const BenchArgs& a) {
  if (a.prompt <= 0 || a.gen <= 0 || a.batch <= 0) fail("--prompt, --gen and --batch must be > 0");
  check_device_args(a.dev);
  model::ModelOptions o;
  o.threads = a.threads;
  o.attention = a.attention == "dense" ? model::AttentionMode::Dense : model::AttentionMode::Sparse;
  auto m = model::Model::load(a.model, o);
  const auto& hp = m->hparams();
  const model::TokenCost cost = model::token_cost(m->file(), hp);
  const int64_t total = int64_t(a.prompt) + a.gen;
  const int32_t blocks_per_seq = int32_t((total + 15) / 16);
  // Prompts go through in chunks of at most kChunk tokens, as a server's batches would take them.
  constexpr int kChunk = 4096;
  auto backend = engine::make_backend(*m, backend_options(a.dev, a.threads), blocks_per_seq * a.batch + 4, 16,
                                      std::min(a.prompt, kChunk));
  kv::BlockAllocator& blocks = backend->blocks();
  std::vector<float> logits;
  {  // warm-up: first launches, cuBLAS's setup, the GPU workspace at its largest; pages of the weights
    const int warm_n = std::min(a.prompt, 32);
    std::vector<int32_t> warm;
    blocks.reserve(warm, warm_n + 1);
    const std::vector<int32_t> ids = random_prompt(warm_n, hp.n_vocab);
    backend->forward({model::SeqInput{ids, 0, &warm, false}}, logits);
    logits.clear();
    backend->forward({model::SeqInput{{ids[0]}, warm_n, &warm, false}}, logits);
    blocks.release(warm);
  }
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(a.batch));
  for (auto& table : tables)
    if (!blocks.reserve(table, total)) fail("bench: KV cache too small");
  const std::vector<int32_t> prompt = random_prompt(a.prompt, hp.n_vocab);
  auto t0 = Clock::now();
  for (auto& table : tables)
    for (int at = 0; at < a.prompt; at += kChunk) {
      const int n = std::min(kChunk, a.prompt - at);
      logits.clear();
      backend->forward({model::SeqInput{{prompt.begin() + at, prompt.begin() + at + n}, at, &table, false}}, logits);
    }
  const double prefill_s = seconds_since(t0);
  t0 = Clock::now();
  for (int i = 0; i < a.gen; ++i) {
    std::vector<model::SeqInput> step;
    for (size_t s = 0; s < tables.size(); ++s)
      step.push_back(model::SeqInput{{int32_t((i * 31 + int(s) * 7) % hp.n_vocab)}, a.prompt + i, &tables[s], false});
    logits.clear();
    backend->forward(step, logits);
  }
  const double decode_s = seconds_since(t0);
  const double prefill_tps = double(a.prompt) * a.batch / prefill_s, decode_tps = double(a.gen) * a.batch / decode_s;
  std::printf("model: %s (%s, %u layers), %.1f MB of weights read per decode token, %.2f GFLOP per token\n",
              a.model.c_str(), m->spec().name, hp.n_layer, cost.weight_bytes / 1e6, cost.flops / 1e9);
  std::printf("%s\n", backend->description().c_str());
  double bw = 0;
  std::string bound_of;
  if (a.dev.cuda()) {
#if SPARSEMLA_HAVE_CUDA
    const int gpus = a.dev.tensor_parallel;
    bw = cuda::measure_copy_bytes_per_s() * gpus;
    bound_of = gpus > 1 ? fmt::format("weight bytes per token / copy rate of {} GPUs", gpus)
                        : "weight bytes per token / copy rate";
    std::printf("device: %s KV cache, %s attention; device-to-device copy %.0f GB/s (read + write)%s\n",
                a.dev.kv_cache.empty() ? "bf16" : a.dev.kv_cache.c_str(), a.attention.c_str(), bw / gpus / 1e9,
                gpus > 1 ? " per GPU" : "");
    std::printf("prefill %d x %d tokens: %.1f tokens/s (%.2f TFLOP/s)\n", a.batch, a.prompt, prefill_tps,
                prefill_tps * cost.flops / 1e12);
#endif
  } else {
    bw = memcpy_rate();
    bound_of = "weight bytes per token / memcpy rate";
    std::printf("threads: %d, memcpy: %.2f GB/s\n",
                int(o.threads ? o.threads : int(std::thread::hardware_concurrency())), bw / 1e9);
    std::printf("prefill %d x %d tokens: %.1f tokens/s (%.2f GFLOP/s)\n", a.batch, a.prompt, prefill_tps,
                prefill_tps * cost.flops / 1e9);
  }
  const double steps_per_s = a.gen / decode_s;
  const double bound_steps = bw / double(cost.weight_bytes);
  std::printf("decode %d steps of batch %d, context %d..%d: %.2f tokens/s, %.3f ms per step (%.2f GB/s of weights); "
              "bound %.2f steps/s (%s): %.1f%% of it\n",
              a.gen, a.batch, a.prompt + 1, a.prompt + a.gen, decode_tps, 1e3 / steps_per_s,
              steps_per_s * cost.weight_bytes / 1e9, bound_steps, bound_of.c_str(), 100.0 * steps_per_s / bound_steps);
  if (const double us = backend->all_reduce_us(int64_t(a.batch) * hp.n_embd); us >= 0)
    std::printf("all-reduce of [%d, %u] fp32 between the ranks: %.1f us; 2 per layer: %.3f ms per step over %u layers "
                "(%.1f%% of the step)\n",
                a.batch, hp.n_embd, us, 2 * us * hp.n_layer / 1e3, hp.n_layer,
                100.0 * 2 * us * hp.n_layer / 1e3 / (1e3 / steps_per_s));
  return 0;
}

struct MakeModelArgs {
  std::string preset = "small";
  std::string output;
  std::string type = "q8_0";
  int layers = 0;
  std::string arch = "glm-dsa";
  bool q4_k_m = false;
  bool zeros = false;
};

int run_make_model(const MakeModelArgs& a) {
  model::SyntheticSpec s = a.preset == "glm5-width" ? model::SyntheticSpec::glm5_width(a.layers ? a.layers : 4)
                                                    : model::SyntheticSpec::glm5_small();
  if (a.layers) s.n_layer = uint32_t(a.layers);
  if (!model::arch_from_name(a.arch, &s.arch)) fail("--arch: '{}' is not glm-dsa or deepseek32", a.arch);
  const bool mix = a.type == "q4_k_m";
  const auto t = mix ? std::optional<gguf::GgmlType>(gguf::GgmlType::Q4_K) : gguf::type_from_name(a.type);
  if (!t) fail("--type: unknown ggml type '{}'", a.type);
  s.matrix_type = *t;
  s.q4_k_m = mix;
  s.zero_matrices = a.zeros;
  model::write_synthetic_model(s, a.output);
  std::printf("wrote %s\n", a.output.c_str());
  return 0;
}

}  // namespace

Runner add_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand("bench", "Prefill and decode tokens/s on the CPU or the GPU, next to the memory-bandwidth bound");
  cmd->add_option("--model,-m", a->model, "GGUF model");
  cmd->add_option("--prompt", a->prompt, "prompt tokens (random ids)");
  cmd->add_option("--gen", a->gen, "decode steps");
  cmd->add_option("--batch", a->batch, "sequences decoding together (each with its own --prompt)");
  cmd->add_option("--attention", a->attention, "sparse (the model's DSA top-k, default) or dense (every position)")
      ->check(CLI::IsMember({"sparse", "dense"}));
  cmd->add_option("--threads,-t", a->threads, "CPU threads (default: all)");
  add_device_options(cmd, a->dev);
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
  cmd->add_option("--type", a->type,
                  "matrix type: f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k, or q4_k_m (Q4_K with Q6_K for "
                  "ffn_down/attn_v_b/output and Q8_0 where rows are not whole 256-blocks)");
  cmd->add_flag("--zeros", a->zeros,
                "write the matrices as zero bytes (sparse, instant): for timing GLM-5-width layers, not for outputs");
  cmd->add_option("--arch", a->arch, "glm-dsa or deepseek32");
  cmd->add_option("--output,-o", a->output, "output .gguf")->required();
  return [a] { return run_make_model(*a); };
}

}  // namespace sparsemla::app
