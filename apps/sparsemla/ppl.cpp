// `sparsemla ppl --model FILE --file TEXT [--ctx N]`: perplexity of a model on a text file, on the
// backend the device options name (CPU or GPU, whole or split over --tensor-parallel ranks).
//
// The text is tokenized whole (control tokens written in it are plain text) and cut into chunks of
// ctx - 1 tokens; each chunk runs as one prompt [BOS] + chunk (BOS omitted with --no-bos, or when
// the model has none), and the logits at each position score the next token of the chunk. So every
// token of the text is predicted exactly once, from at most ctx - 1 tokens of context within its
// chunk. perplexity = exp(mean negative log-likelihood), computed in double precision.
// scripts/train_tiny/train.py computes transformers' perplexity the same way.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "commands.h"
#include "device_options.h"
#include "engine/backend.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace sparsemla::app {
namespace {

struct PplArgs {
  std::string model;
  std::string file;
  int ctx = 512;
  std::string attention = "sparse";
  int threads = 0;
  bool no_bos = false;
  bool json = false;
  int max_chunks = 0;
  DeviceArgs dev;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// -log softmax(row)[target], in double.
double nll_of(const float* row, int64_t n, int32_t target) {
  float mx = row[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, row[i]);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(double(row[i]) - mx);
  return std::log(sum) + mx - double(row[target]);
}

int run_ppl(const PplArgs& a) {
  if (a.ctx < 2) fail("--ctx must be at least 2, got {}", a.ctx);
  check_device_args(a.dev);
  model::ModelOptions o;
  o.attention = a.attention == "dense" ? model::AttentionMode::Dense : model::AttentionMode::Sparse;
  o.threads = a.threads;
  auto m = model::Model::load(a.model, o);
  auto tok = tokenizer::Tokenizer::from_gguf(m->file());
  const std::string text = read_text(a.file);
  const std::vector<int32_t> ids = tok->encode(text, false, false);
  if (ids.empty()) fail("{}: no tokens", a.file);
  const bool bos = !a.no_bos && tok->bos() >= 0;
  // Without BOS a chunk is ctx tokens whose first is context only (the previous chunk's last).
  const int64_t step = a.ctx - 1;
  const int64_t n_vocab = m->hparams().n_vocab;

  const int32_t bs = 16;
  auto backend =
      engine::make_backend(*m, backend_options(a.dev, a.threads), int32_t((int64_t(a.ctx) + bs - 1) / bs), bs, a.ctx);
  if (!a.json) std::fprintf(stderr, "%s\n", backend->description().c_str());
  double nll = 0;
  int64_t scored = 0, chunks = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t start = 0; start < int64_t(ids.size()); start += step) {
    if (a.max_chunks > 0 && chunks >= a.max_chunks) break;
    std::vector<int32_t> in;
    if (bos) in.push_back(tok->bos());
    const int64_t end = std::min<int64_t>(int64_t(ids.size()), start + (bos ? step : a.ctx));
    in.insert(in.end(), ids.begin() + start, ids.begin() + end);
    if (in.size() < 2) break;  // a lone trailing token without BOS: nothing to predict
    std::vector<int32_t> table;
    if (!backend->blocks().reserve(table, int64_t(in.size()))) fail("KV cache too small");
    std::vector<float> logits;
    backend->forward({model::SeqInput{in, 0, &table, true}}, logits);
    backend->blocks().release(table);
    for (size_t i = 0; i + 1 < in.size(); ++i) nll += nll_of(logits.data() + i * n_vocab, n_vocab, in[i + 1]);
    scored += int64_t(in.size()) - 1;
    ++chunks;
    if (!bos && end == int64_t(ids.size())) break;  // without BOS, chunks overlap by one token
    if (!a.json)
      std::fprintf(stderr, "\rchunk %lld: ppl %.4f", static_cast<long long>(chunks), std::exp(nll / double(scored)));
  }
  if (scored == 0) fail("{}: one token and no BOS: nothing to predict", a.file);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double ppl = std::exp(nll / double(scored));
  if (a.json) {
    std::printf(
        "{\"ppl\": %.6f, \"nll\": %.8f, \"tokens\": %lld, \"scored\": %lld, \"chunks\": %lld, \"ctx\": %d, "
        "\"attention\": \"%s\", \"bos\": %s, \"seconds\": %.3f}\n",
        ppl, nll / double(scored), static_cast<long long>(ids.size()), static_cast<long long>(scored),
        static_cast<long long>(chunks), a.ctx, a.attention.c_str(), bos ? "true" : "false", secs);
  } else {
    std::fprintf(stderr, "\n");
    std::printf("perplexity %.4f over %lld tokens (%lld chunks of at most %d, %s attention), %.1f tokens/s\n", ppl,
                static_cast<long long>(scored), static_cast<long long>(chunks), a.ctx, a.attention.c_str(),
                double(scored) / secs);
  }
  return 0;
}

}  // namespace

Runner add_ppl(CLI::App& app) {
  auto a = std::make_shared<PplArgs>();
  CLI::App* cmd = app.add_subcommand("ppl", "Perplexity of the model on a text file");
  cmd->add_option("--model,-m", a->model, "GGUF model (any part of a split model)")->required();
  cmd->add_option("--file,-f", a->file, "text file")->required();
  cmd->add_option("--ctx,-c", a->ctx, "tokens per chunk, BOS included (default 512)");
  cmd->add_option("--attention", a->attention, "sparse (the model's DSA top-k, default) or dense (every position)")
      ->check(CLI::IsMember({"sparse", "dense"}));
  cmd->add_option("--threads,-t", a->threads, "CPU threads (default: all)");
  cmd->add_option("--max-chunks", a->max_chunks, "stop after this many chunks (0: the whole file)");
  cmd->add_flag("--no-bos", a->no_bos, "do not start each chunk with the BOS token");
  cmd->add_flag("--json", a->json, "print one JSON object");
  add_device_options(cmd, a->dev);
  return [a] { return run_ppl(*a); };
}

}  // namespace sparsemla::app
