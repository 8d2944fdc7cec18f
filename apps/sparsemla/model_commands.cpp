// `sparsemla logits` and `sparsemla run`: the engine on token ids, through the backend the device
// options name (CPU or GPU, whole or split over --tensor-parallel ranks).
#include <climits>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "default_model.h"
#include "device_options.h"
#include "engine/backend.h"
#include "model/model.h"
#include "server/chat_format.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace sparsemla::app {
namespace {

struct ModelArgs {
  std::string model;
  std::string attention = "sparse";
  int threads = 0;
  DeviceArgs dev;
};

void add_model_options(CLI::App* cmd, ModelArgs& a, bool model_required = true) {
  auto* opt = cmd->add_option("--model,-m", a.model,
                              model_required ? "GGUF model (any part of a split model)"
                                             : "GGUF model (any part of a split model; default: the bundled model)");
  if (model_required) opt->required();
  cmd->add_option("--attention", a.attention, "sparse (the model's DSA top-k, default) or dense (every position)")
      ->check(CLI::IsMember({"sparse", "dense"}));
  cmd->add_option("--threads,-t", a.threads, "CPU threads (default: all)");
  add_device_options(cmd, a.dev);
}

std::unique_ptr<model::Model> load(ModelArgs& a) {
  check_device_args(a.dev);
  if (a.model.empty()) a.model = default_model_path();
  model::ModelOptions o;
  o.attention = a.attention == "dense" ? model::AttentionMode::Dense : model::AttentionMode::Sparse;
  o.threads = a.threads;
  return model::Model::load(a.model, o);
}

std::vector<int32_t> read_i32_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() % 4 != 0) fail("{}: {} bytes is not a whole number of int32 token ids", path, bytes.size());
  std::vector<int32_t> ids(bytes.size() / 4);
  std::memcpy(ids.data(), bytes.data(), bytes.size());
  return ids;
}

// "1 2 3", "1,2,3" or "[1, 2, 3]"
std::vector<int32_t> parse_ids(const std::string& text) {
  std::string s = text;
  for (char& c : s)
    if (c == ',' || c == '[' || c == ']') c = ' ';
  std::istringstream in(s);
  std::vector<int32_t> ids;
  std::string tok;
  while (in >> tok) {
    char* end = nullptr;
    const long v = std::strtol(tok.c_str(), &end, 10);
    if (*end != '\0' || v < 0 || v > INT32_MAX) fail("--tokens: '{}' is not a token id", tok);
    ids.push_back(int32_t(v));
  }
  if (ids.empty()) fail("--tokens: no token ids given");
  return ids;
}

// The backend for `m` with room for `n_tokens` positions of one sequence, run in one forward at most.
std::unique_ptr<engine::Backend> backend_for(model::Model& m, const ModelArgs& a, int64_t n_tokens) {
  const int32_t bs = 16;
  auto b = engine::make_backend(m, backend_options(a.dev, a.threads), int32_t((n_tokens + bs - 1) / bs), bs, n_tokens);
  std::fprintf(stderr, "%s\n", b->description().c_str());
  return b;
}

int run_logits(ModelArgs& a, const std::string& tokens_path, const std::string& out_path) {
  const std::vector<int32_t> ids = read_i32_file(tokens_path);
  if (ids.empty()) fail("{}: no token ids", tokens_path);
  auto m = load(a);
  auto backend = backend_for(*m, a, int64_t(ids.size()));
  std::vector<int32_t> table;
  if (!backend->blocks().reserve(table, int64_t(ids.size()))) fail("KV cache too small");
  model::SeqInput in{ids, 0, &table, true};
  std::vector<float> logits;
  backend->forward({in}, logits);
  std::ofstream out(out_path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * sizeof(float)));
  if (!out) fail("{}: write failed", out_path);
  std::fprintf(stderr, "wrote %s: [%zu, %u] float32 logits\n", out_path.c_str(), ids.size(), m->hparams().n_vocab);
  return 0;
}

int32_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}

struct GenerateArgs {
  std::string tokens;
  std::string prompt;
  bool chat = false;
  std::string chat_template_file;
  int max_tokens = 64;
  float temperature = 0.0f;
  bool json = false;
  bool add_bos = false;
};

int run_generate(ModelArgs& a, const GenerateArgs& g) {
  if (g.temperature != 0.0f) fail("--temperature: only greedy decoding (0) is available in `run` yet; `serve` samples");
  if (g.max_tokens < 0) fail("--max-tokens must be >= 0, got {}", g.max_tokens);
  if (g.tokens.empty() == g.prompt.empty()) fail("give exactly one of --tokens and --prompt");
  if (g.chat && g.prompt.empty()) fail("--chat needs --prompt");
  auto m = load(a);
  std::unique_ptr<tokenizer::Tokenizer> tok;
  std::vector<int32_t> prompt;
  if (!g.prompt.empty()) {
    tok = tokenizer::Tokenizer::from_gguf(m->file());
    std::string text = g.prompt;
    if (g.chat) {
      server::ChatFormat format = server::ChatFormat::for_model(m->file(), *tok);
      if (!g.chat_template_file.empty()) {
        std::ifstream in(g.chat_template_file);
        if (!in) fail("{}: cannot open", g.chat_template_file);
        const std::string source((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        format = server::ChatFormat(source, format.tool_syntax(), tok->bos() >= 0 ? tok->token_text(tok->bos()) : "",
                                    tok->eos() >= 0 ? tok->token_text(tok->eos()) : "", false);
      }
      const auto messages = nlohmann::json::array({{{"role", "user"}, {"content", g.prompt}}});
      text = format.render(messages, nlohmann::json::array(), nlohmann::json::object());
    }
    // A chat template writes its own BOS ([gMASK] for GLM); a plain prompt follows the file.
    prompt = tok->encode(text, !g.chat && (g.add_bos || tok->add_bos_default()));
  } else {
    prompt = parse_ids(g.tokens);
  }
  const int64_t total = int64_t(prompt.size()) + g.max_tokens;
  if (total > int64_t(m->hparams().n_ctx_train))
    fail("prompt ({} tokens) + --max-tokens {} exceeds the model's context of {}", prompt.size(), g.max_tokens,
         m->hparams().n_ctx_train);
  auto backend = backend_for(*m, a, total);
  std::vector<int32_t> table;
  if (!backend->blocks().reserve(table, total)) fail("KV cache too small");
  std::vector<int32_t> out;
  std::vector<float> logits;
  std::unique_ptr<tokenizer::StreamDecoder> stream;
  if (tok && !g.json) stream = std::make_unique<tokenizer::StreamDecoder>(*tok, true);
  // Prefill once, then one token per step through the cache.
  model::SeqInput in{prompt, 0, &table, false};
  for (int i = 0; i < g.max_tokens; ++i) {
    int32_t next = 0;
#if SPARSEMLA_HAVE_CUDA
    if (backend->samples_on_device()) {  // greedy on the GPU: only the id comes back
      std::vector<cuda::RowSampling> greedy(1);
      greedy[0].temperature = 0.0f;
      std::vector<int32_t> ids;
      backend->forward_sample({in}, greedy, ids);
      next = ids.at(0);
    } else
#endif
    {
      logits.clear();
      backend->forward({in}, logits);
      next = argmax(logits.data(), m->hparams().n_vocab);
    }
    if (tok && tok->is_eog(next)) break;
    out.push_back(next);
    if (stream) {
      const std::string piece = stream->push(next);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
    in = model::SeqInput{{next}, in.pos0 + int64_t(in.tokens.size()), &table, false};
  }
  if (stream) {
    const std::string rest = stream->flush();
    std::printf("%s\n", rest.c_str());
    return 0;
  }
  nlohmann::json j = {{"tokens", out}};
  if (tok) j["text"] = tok->decode(out, true);
  if (g.json || !tok) std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

Runner add_logits(CLI::App& app) {
  auto a = std::make_shared<ModelArgs>();
  auto tokens = std::make_shared<std::string>();
  auto output = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("logits", "Run int32 token ids as one prompt and write float32 logits [n_tokens, vocab]");
  add_model_options(cmd, *a);
  cmd->add_option("--tokens", *tokens, "file of little-endian int32 token ids")->required();
  cmd->add_option("--output,-o", *output, "file to write the logits to")->required();
  return [=] { return run_logits(*a, *tokens, *output); };
}

Runner add_run(CLI::App& app) {
  auto a = std::make_shared<ModelArgs>();
  auto g = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("run", "Generate from a prompt: prefill once, then decode token by token");
  add_model_options(cmd, *a, false);
  cmd->add_option("--prompt,-p", g->prompt, "prompt text");
  cmd->add_flag("--chat", g->chat, "wrap --prompt in the model's chat template as a user turn");
  cmd->add_option("--chat-template-file", g->chat_template_file, "Jinja chat template to use instead of the model's");
  cmd->add_option("--tokens", g->tokens, "prompt token ids instead of text: \"1 2 3\"");
  cmd->add_flag("--add-bos", g->add_bos, "add BOS before a plain --prompt");
  cmd->add_option("--max-tokens,-n", g->max_tokens, "tokens to generate (stops earlier at end of generation)");
  cmd->add_option("--temperature", g->temperature, "0: greedy");
  cmd->add_flag("--json", g->json, "print {\"tokens\": [...], \"text\": ...}");
  return [=] { return run_generate(*a, *g); };
}

}  // namespace sparsemla::app
