// `sparsemla bench`: prefill and decode tokens/s of a model on this machine (CPU or --device cuda,
// whole or split over --tensor-parallel ranks) next to its bound, and
// `sparsemla make-model`: random-weight models of chosen widths to benchmark.
#include <algorithm>
#include <chrono>
#include <cstdlib>
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
#include "gguf/quants.h"
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
  std::string prompt = "128";  // one size or a comma list
  int gen = 32;
  std::string batch = "1";     // one size or a comma list
  std::string chunk;           // prefill tokens per forward: one size or a comma list ("": serve's default)
  int threads = 0;
  std::string attention = "sparse";
  bool host_logits = false;  // decode: copy every logits row to the host instead of sampling on the GPU
  float temperature = 0.0f;  // the GPU draw's parameters (0: greedy)
  float top_p = 1.0f;
  int top_k = 0;
  DeviceArgs dev;
};

std::vector<int32_t> random_prompt(int n, uint32_t n_vocab) {
  std::mt19937 rng(1);
  std::vector<int32_t> prompt(static_cast<size_t>(n));
  for (int32_t& t : prompt) t = int32_t(rng() % n_vocab);
  return prompt;
}

// "1,8,32" -> {1, 8, 32}; every entry a positive integer.
std::vector<int> parse_sizes(const std::string& text, const char* option) {
  std::vector<int> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t end = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, end - at);
    char* stop = nullptr;
    const long v = std::strtol(item.c_str(), &stop, 10);
    if (item.empty() || *stop != '\0' || v <= 0 || v > (1 << 30))
      fail("{} {}: '{}' is not a positive size (give one, or a comma list such as 1,8,32)", option, text, item);
    out.push_back(int(v));
    at = end + 1;
  }
  return out;
}

struct BenchRow {
  int prompt = 0, batch = 0, chunk = 0;
  double prefill_tps = 0, decode_tps = 0, ms_per_step = 0, pct_of_bound = 0;
};

// Prefill of `prompt` random tokens for each of `batch` sequences, then --gen decode steps of one
// token per sequence, on the backend the device options name (made once for the largest case).
// The bound is the weight bytes one decode step reads (once for the whole batch: a lower bound on
// what a MoE step reads, whose sequences may route to different experts) over the copy rate: one
// CPU thread's memcpy (the ranks of a split CPU model share the memory), or the device-to-device
// copy of each GPU.
BenchRow bench_case(const BenchArgs& a, const model::Model& m, engine::Backend& backend, int prompt_n, int batch,
                    int chunk, double bw, const std::string& bound_of, const model::TokenCost& cost) {
  const auto& hp = m.hparams();
  const int64_t total = int64_t(prompt_n) + a.gen;
  kv::BlockAllocator& blocks = backend.blocks();
  std::vector<float> logits;
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(batch));
  for (auto& table : tables)
    if (!blocks.reserve(table, total)) fail("bench: KV cache too small");
  const std::vector<int32_t> prompt = random_prompt(prompt_n, hp.n_vocab);
  auto t0 = Clock::now();
  for (auto& table : tables)
    for (int at = 0; at < prompt_n; at += chunk) {  // chunks of --batch-tokens, as serve's forwards take them
      const int n = std::min(chunk, prompt_n - at);
      logits.clear();
      backend.forward({model::SeqInput{{prompt.begin() + at, prompt.begin() + at + n}, at, &table, false}}, logits);
    }
  const double prefill_s = seconds_since(t0);
  // Decode as the server does: a GPU backend draws the tokens on the device (greedy, or
  // --temperature/--top-p/--top-k) and only the ids come back; the CPU, or --host-logits, copies
  // every logits row to the host (at batch 32 and GLM-5's vocabulary that is 20 MB per step, ~1.5
  // ms of the step on an H200's PCIe link).
  bool on_device = false;
#if SPARSEMLA_HAVE_CUDA
  on_device = backend.samples_on_device() && !a.host_logits;
  std::vector<cuda::RowSampling> draw(tables.size());
  for (size_t s = 0; s < draw.size(); ++s) {
    draw[s].temperature = a.temperature;
    draw[s].top_p = a.top_p;
    draw[s].top_k = a.top_k;
    draw[s].seed = s + 1;
  }
  std::vector<int32_t> ids;
#endif
  t0 = Clock::now();
  for (int i = 0; i < a.gen; ++i) {
    std::vector<model::SeqInput> step;
    for (size_t s = 0; s < tables.size(); ++s)
      step.push_back(model::SeqInput{{int32_t((i * 31 + int(s) * 7) % hp.n_vocab)}, prompt_n + i, &tables[s], false});
#if SPARSEMLA_HAVE_CUDA
    if (on_device) {
      ids.clear();
      for (auto& d : draw) d.step = uint64_t(i);
      backend.forward_sample(step, draw, ids);
      continue;
    }
#endif
    logits.clear();
    backend.forward(step, logits);
  }
  const double decode_s = seconds_since(t0);
  for (auto& table : tables) blocks.release(table);
  BenchRow row{prompt_n, batch, chunk, double(prompt_n) * batch / prefill_s, double(a.gen) * batch / decode_s, 0, 0};
  if (a.dev.cuda())
    std::printf("prefill %d x %d tokens in chunks of %d: %.1f tokens/s (%.2f TFLOP/s)\n", batch, prompt_n,
                std::min(chunk, prompt_n), row.prefill_tps, row.prefill_tps * cost.flops / 1e12);
  else
    std::printf("prefill %d x %d tokens in chunks of %d: %.1f tokens/s (%.2f GFLOP/s)\n", batch, prompt_n,
                std::min(chunk, prompt_n), row.prefill_tps, row.prefill_tps * cost.flops / 1e9);
  const double steps_per_s = a.gen / decode_s;
  const double bound_steps = bw / double(cost.weight_bytes);
  row.ms_per_step = 1e3 / steps_per_s;
  row.pct_of_bound = 100.0 * steps_per_s / bound_steps;
  std::string how = on_device ? "tokens drawn on the GPU" : "logits to the host";
  if (on_device && a.temperature > 0)
    how += fmt::format(", temperature {:g}, top-p {:g}, top-k {}", a.temperature, a.top_p, a.top_k);
  std::printf("decode %d steps of batch %d, context %d..%d (%s): %.2f tokens/s, %.3f ms per step (%.2f GB/s of "
              "weights); bound %.2f steps/s (%s): %.1f%% of it\n",
              a.gen, batch, prompt_n + 1, prompt_n + a.gen,
              how.c_str(), row.decode_tps, row.ms_per_step,
              steps_per_s * cost.weight_bytes / 1e9, bound_steps, bound_of.c_str(), row.pct_of_bound);
  if (const double us = backend.all_reduce_us(int64_t(batch) * hp.n_embd); us >= 0) {
    std::printf("all-reduce of [%d, %u] fp32 between the ranks: %.1f us; 2 per layer: %.3f ms per step over %u layers "
                "(%.1f%% of the step)\n",
                batch, hp.n_embd, us, 2 * us * hp.n_layer / 1e3, hp.n_layer,
                100.0 * 2 * us * hp.n_layer / 1e3 / row.ms_per_step);
    // The other way to split the indexer (its heads across the ranks) would all-reduce each layer's
    // weighted scores, [batch, context] fp32, before the top-k: its price, to set next to the
    // replicated indexer's own time (bench attention, or the step profile).
    if (hp.has_indexer()) {
      const int64_t ctx = int64_t(prompt_n) + a.gen;
      std::printf("indexer split by heads would all-reduce [%d, %lld] fp32 scores per indexer layer: %.1f us\n", batch,
                  static_cast<long long>(ctx), backend.all_reduce_us(int64_t(batch) * ctx));
    }
  }
  std::fflush(stdout);
  return row;
}

int run_bench(const BenchArgs& a) {
  const std::vector<int> prompts = parse_sizes(a.prompt, "--prompt"), batches = parse_sizes(a.batch, "--batch"),
                         chunks = a.chunk.empty() ? std::vector<int>{engine::default_batch_tokens(
                                                        a.dev.cuda() ? engine::Device::Cuda : engine::Device::Cpu)}
                                                  : parse_sizes(a.chunk, "--batch-tokens");
  if (a.gen <= 0) fail("--gen must be > 0");
  check_device_args(a.dev);
  model::ModelOptions o;
  o.threads = a.threads;
  o.attention = a.attention == "dense" ? model::AttentionMode::Dense : model::AttentionMode::Sparse;
  auto m = model::Model::load(a.model, o);
  const auto& hp = m->hparams();
  const model::TokenCost cost = model::token_cost(m->file(), hp);
  const int max_prompt = *std::max_element(prompts.begin(), prompts.end());
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int max_chunk = std::min(max_prompt, *std::max_element(chunks.begin(), chunks.end()));
  const int32_t blocks_per_seq = int32_t((int64_t(max_prompt) + a.gen + 15) / 16);
  engine::BackendOptions bo = backend_options(a.dev, a.threads);
#if SPARSEMLA_HAVE_CUDA
  bo.gpu.max_logit_rows = max_batch;  // (logits of each sequence's last row: the workspace estimate)
#endif
  auto backend = engine::make_backend(*m, bo, blocks_per_seq * max_batch + 4, 16, max_chunk);
  {  // warm-up: first launches, cuBLAS's setup, the GPU workspace at its largest; pages of the weights
    kv::BlockAllocator& blocks = backend->blocks();
    std::vector<float> logits;
    // On a GPU, for each --batch-tokens size, a prompt of two chunks of it (as far as the longest
    // prompt goes), so that the first launch of every prefill kernel (loaded lazily: the experts'
    // tile and cuBLAS kernels at their group sizes, the attention and indexer over earlier chunks)
    // is not in the figures: a running server has them loaded. On the CPU a short prompt does.
    std::vector<int> warm_chunks = a.dev.cuda() ? chunks : std::vector<int>{32};
    std::sort(warm_chunks.begin(), warm_chunks.end());
    warm_chunks.erase(std::unique(warm_chunks.begin(), warm_chunks.end()), warm_chunks.end());
    for (const int c : warm_chunks) {
      const int warm_n = std::min(max_prompt, a.dev.cuda() ? 2 * c : c);
      std::vector<int32_t> warm;
      blocks.reserve(warm, warm_n + 1);
      const std::vector<int32_t> ids = random_prompt(warm_n, hp.n_vocab);
      for (int at = 0; at < warm_n; at += c) {
        logits.clear();
        backend->forward({model::SeqInput{{ids.begin() + at, ids.begin() + std::min(at + c, warm_n)}, at, &warm, false}},
                         logits);
      }
      logits.clear();
      backend->forward({model::SeqInput{{ids[0]}, warm_n, &warm, false}}, logits);
      blocks.release(warm);
    }
  }
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
#endif
  } else {
    bw = memcpy_rate();
    bound_of = "weight bytes per token / memcpy rate";
    std::printf("threads: %d, memcpy: %.2f GB/s\n",
                int(o.threads ? o.threads : int(std::thread::hardware_concurrency())), bw / 1e9);
  }
  std::vector<BenchRow> rows;
  for (int p : prompts)
    for (int b : batches)
      for (int c : chunks) rows.push_back(bench_case(a, *m, *backend, p, b, c, bw, bound_of, cost));
  if (rows.size() > 1) {
    std::printf("\n%9s %6s %7s %14s %14s %12s %10s\n", "context", "batch", "chunk", "prefill tok/s", "decode tok/s",
                "ms/step", "% bound");
    for (const BenchRow& r : rows)
      std::printf("%9d %6d %7d %14.1f %14.1f %12.3f %9.1f%%\n", r.prompt, r.batch, std::min(r.chunk, r.prompt),
                  r.prefill_tps, r.decode_tps, r.ms_per_step, r.pct_of_bound);
    std::fflush(stdout);
  }
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
  if (!a.zeros && !gguf::can_quantize(*t))
    fail("--type {}: the writer has no quantizer for it (f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k, q4_k_m); "
         "with --zeros any ggml type is written (zero matrices, for timing)",
         gguf::type_name(*t));
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
  cmd->add_option("--prompt", a->prompt,
                  "prompt tokens (random ids), or a comma list of sizes to run in turn (e.g. 1024,32768,131072)");
  cmd->add_option("--gen", a->gen, "decode steps");
  cmd->add_option("--batch", a->batch,
                  "sequences decoding together (each with its own --prompt), or a comma list (e.g. 1,8,32): every "
                  "prompt size with every batch, one model load, and a table at the end");
  cmd->add_option("--batch-tokens", a->chunk,
                  fmt::format("prompt tokens per forward, as serve's --batch-tokens takes them (default as serve's: {} "
                              "on a GPU, {} on the CPU), or a comma list to compare",
                              engine::kGpuBatchTokens, engine::kCpuBatchTokens));
  cmd->add_option("--attention", a->attention, "sparse (the model's DSA top-k, default) or dense (every position)")
      ->check(CLI::IsMember({"sparse", "dense"}));
  cmd->add_option("--threads,-t", a->threads, "CPU threads (default: all)");
  cmd->add_flag("--host-logits", a->host_logits,
                "decode: copy every logits row to the host (what logits/ppl do) instead of drawing the tokens on the "
                "GPU (what serve does)");
  cmd->add_option("--temperature", a->temperature,
                  "decode on a GPU: draw the tokens at this temperature (default 0: greedy); the step's time then "
                  "includes the sampler's filters")
      ->check(CLI::Range(0.0f, 100.0f));
  cmd->add_option("--top-p", a->top_p, "decode on a GPU: nucleus filter of the draws (default 1: off)")
      ->check(CLI::Range(0.0f, 1.0f));
  cmd->add_option("--top-k", a->top_k, "decode on a GPU: keep the k most likely tokens (default 0: off)")
      ->check(CLI::NonNegativeNumber);
  add_device_options(cmd, a->dev);
  // `bench model --model FILE ...` says the same as `bench --model FILE ...` (the spelling beside
  // `bench attention`): the subcommand has no options of its own and hands every one to bench.
  cmd->add_subcommand("model", "The model's prefill and decode (bench's own options: bench model --model FILE ...)")
      ->fallthrough();
  Runner attention = add_bench_attention(*cmd);
  CLI::App* att = cmd->get_subcommand("attention");
  return [a, att, attention] {
    if (att->parsed()) return attention();
    if (a->model.empty()) fail("bench needs --model FILE (or a subcommand: model, attention)");
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
                  "ffn_down/attn_v_b/output and Q8_0 where rows are not whole 256-blocks); with --zeros any ggml "
                  "type (q2_k, q3_k, iq4_xs, iq2_xxs, ...)");
  cmd->add_flag("--zeros", a->zeros,
                "write the matrices as zero bytes (sparse, instant): for timing GLM-5-width layers, not for outputs");
  cmd->add_option("--arch", a->arch, "glm-dsa or deepseek32");
  cmd->add_option("--output,-o", a->output, "output .gguf")->required();
  return [a] { return run_make_model(*a); };
}

}  // namespace sparsemla::app
