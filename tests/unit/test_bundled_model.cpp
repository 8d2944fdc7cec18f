// The bundled default model (models/, trained by scripts/train_tiny/train.py) against the numbers
// transformers recorded for it in models/reference.json, on the weights exactly as the Q8_0 GGUF
// holds them: the tokenizer, greedy generation through the KV cache (sparse attention, a prompt
// longer than the indexer's top-k), and `sparsemla ppl` on a held-out slice in sparse and dense mode.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kv/paged_cache.h"
#include "model/model.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace sparsemla::model {
namespace {

std::string models_path(const std::string& rel) { return std::string(SPARSEMLA_FIXTURES) + "/../../models/" + rel; }

const nlohmann::json& reference() {
  static const nlohmann::json j = [] {
    std::ifstream in(models_path("reference.json"));
    return in ? nlohmann::json::parse(in) : nlohmann::json();
  }();
  return j;
}

std::string gguf_path() { return models_path(reference().at("gguf").get<std::string>()); }

// Runs a command and returns what it printed on stdout.
std::string run(const std::string& cmd) {
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  if (!p) return {};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p.get())) > 0) out.append(buf, n);
  return out;
}

class BundledModel : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_FALSE(reference().is_null()) << "models/reference.json is missing"; }
};

TEST_F(BundledModel, TokenizerMatchesTransformers) {
  const auto& s = reference().at("sample");
  auto m = Model::load(gguf_path(), {AttentionMode::Sparse, 2});
  auto tok = tokenizer::Tokenizer::from_gguf(m->file());
  const std::string text = test::read_file(models_path("heldout_sample.txt"));
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(tok->encode(text, false, false), s.at("token_ids").get<std::vector<int32_t>>());
  const auto& g = reference().at("greedy");
  EXPECT_EQ(tok->encode(g.at("prompt_text").get<std::string>(), true, false),
            g.at("prompt_ids").get<std::vector<int32_t>>());
  EXPECT_EQ(tok->pre_name(), "glm4");
  EXPECT_EQ(tok->token_text(tok->bos()), "[gMASK]");
}

TEST_F(BundledModel, GreedyMatchesTransformers) {
  const auto& g = reference().at("greedy");
  const auto prompt = g.at("prompt_ids").get<std::vector<int32_t>>();
  const auto want = g.at("tokens").get<std::vector<int32_t>>();
  auto m = Model::load(gguf_path(), {AttentionMode::Sparse, 2});
  ASSERT_GT(int64_t(prompt.size()), int64_t(m->hparams().idx_top_k)) << "the prompt should exceed the top-k";
  const int64_t total = int64_t(prompt.size() + want.size());
  kv::PagedCache cache(m->cache_shape(int32_t((total + 15) / 16), 16));
  std::vector<int32_t> table;
  ASSERT_TRUE(cache.reserve(table, total));
  std::vector<int32_t> got;
  SeqInput in{prompt, 0, &table, false};
  std::vector<float> logits;
  for (size_t i = 0; i < want.size(); ++i) {
    logits.clear();
    m->forward({in}, cache, logits);
    got.push_back(test::argmax(logits.data(), m->hparams().n_vocab));
    in = SeqInput{{got.back()}, in.pos0 + int64_t(in.tokens.size()), &table, false};
  }
  EXPECT_EQ(got, want);
  auto tok = tokenizer::Tokenizer::from_gguf(m->file());
  EXPECT_EQ(tok->decode(got), g.at("text").get<std::string>());
}

TEST_F(BundledModel, PerplexityMatchesTransformers) {
  const auto& s = reference().at("sample");
  const int ctx = s.at("ctx").get<int>();
  double ppl[2] = {0, 0};
  const char* modes[2] = {"sparse", "dense"};
  for (int i = 0; i < 2; ++i) {
    const std::string out = run(std::string(SPARSEMLA_BINARY) + " ppl --json -t 2 --model '" + gguf_path() +
                                "' --file '" + models_path("heldout_sample.txt") + "' --ctx " + std::to_string(ctx) +
                                " --attention " + modes[i]);
    const auto j = nlohmann::json::parse(out, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << "ppl printed: " << out;
    ppl[i] = j.at("ppl").get<double>();
    EXPECT_EQ(j.at("scored").get<int64_t>(), s.at("n_scored").get<int64_t>());
    const double want = s.at(std::string("ppl_") + modes[i]).get<double>();
    EXPECT_NEAR(ppl[i], want, 0.005 * want) << modes[i];
  }
  EXPECT_NEAR(ppl[0], ppl[1], 0.02 * ppl[1]) << "sparse vs dense";
}

}  // namespace
}  // namespace sparsemla::model
