// The CPU engine against transformers' float64 logits on the fixtures converted by llama.cpp:
// whole prompts, greedy generation through the KV cache, chunked and batched forwards, dense mode
// where sparse and dense coincide, and the legacy attn_kv_b layout.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "gguf/reader.h"
#include "gguf/writer.h"
#include "model/model.h"
#include "legacy_kv_b.h"
#include "test_util.h"
#include "util/error.h"

namespace sparsemla::model {
namespace {

// max |got - ref| <= tol * max |ref| over rows [0, rows), and the argmax equal in every row.
void expect_logits_match(const std::vector<float>& got, const std::vector<float>& ref, int64_t vocab, int64_t rows,
                         double tol, const std::string& what) {
  ASSERT_GE(got.size(), size_t(rows * vocab)) << what;
  ASSERT_GE(ref.size(), size_t(rows * vocab)) << what;
  double max_ref = 0, max_diff = 0;
  for (int64_t i = 0; i < rows * vocab; ++i) {
    ASSERT_TRUE(std::isfinite(got[size_t(i)])) << what << ": non-finite logit at " << i;
    max_ref = std::max(max_ref, std::fabs(double(ref[size_t(i)])));
    max_diff = std::max(max_diff, std::fabs(double(got[size_t(i)]) - ref[size_t(i)]));
  }
  EXPECT_LE(max_diff, tol * max_ref) << what << ": max diff " << max_diff << ", max |ref| " << max_ref;
  for (int64_t r = 0; r < rows; ++r)
    EXPECT_EQ(test::argmax(got.data() + r * vocab, vocab), test::argmax(ref.data() + r * vocab, vocab)) << what << " row " << r;
}

struct Runner {
  explicit Runner(const std::string& path, AttentionMode mode = AttentionMode::Sparse)
      : m(Model::load(path, {mode, 2})), cache(m->cache_shape(64, 4)) {}
  // One prompt, logits for every position.
  std::vector<float> prompt_logits(const std::vector<int32_t>& ids) {
    std::vector<int32_t> table;
    EXPECT_TRUE(cache.reserve(table, int64_t(ids.size())));
    std::vector<float> logits;
    m->forward({SeqInput{ids, 0, &table, true}}, cache, logits);
    cache.release(table);
    return logits;
  }
  std::unique_ptr<Model> m;
  kv::PagedCache cache;
};

class FixtureModel : public ::testing::TestWithParam<std::string> {
 protected:
  std::string dir() const { return test::fixture_path(GetParam()); }
  // llama.cpp's converter named its output model-f32.gguf; the project's fixtures are model.gguf.
  std::string model() const {
    const std::string converted = dir() + "/model-f32.gguf";
    return std::filesystem::exists(converted) ? converted : dir() + "/model.gguf";
  }
};

TEST_P(FixtureModel, SparseLogitsMatchTransformers) {
  Runner r(model());
  const int64_t V = r.m->hparams().n_vocab;
  for (const char* seq : {"seq0", "seq1"}) {
    const auto ids = test::read_values<int32_t>(dir() + "/" + seq + ".tokens");
    ASSERT_GT(ids.size(), r.m->hparams().idx_top_k) << "the prompt must be longer than top-k for the indexer to select";
    expect_logits_match(r.prompt_logits(ids), test::read_values<float>(dir() + "/" + seq + ".logits.f32"), V, int64_t(ids.size()),
                        1e-3, GetParam() + " " + seq);
  }
}

TEST_P(FixtureModel, GreedyGenerationThroughTheCacheMatchesTransformers) {
  std::ifstream file(dir() + "/greedy.json");
  const auto j = nlohmann::json::parse(file);
  const std::vector<int32_t> prompt = j["prompt"], want = j["greedy"];
  Runner r(model());
  std::vector<int32_t> table;
  ASSERT_TRUE(r.cache.reserve(table, int64_t(prompt.size() + want.size())));
  std::vector<int32_t> got;
  SeqInput in{prompt, 0, &table, false};
  for (size_t i = 0; i < want.size(); ++i) {
    std::vector<float> logits;
    r.m->forward({in}, r.cache, logits);
    got.push_back(test::argmax(logits.data(), r.m->hparams().n_vocab));
    in = SeqInput{{got.back()}, in.pos0 + int64_t(in.tokens.size()), &table, false};
  }
  EXPECT_EQ(got, want);
}

// Prefill in chunks of 7 equals the whole prompt at once (and so the reference).
TEST_P(FixtureModel, ChunkedPrefillMatchesTransformers) {
  Runner r(model());
  const int64_t V = r.m->hparams().n_vocab;
  const auto ids = test::read_values<int32_t>(dir() + "/seq1.tokens");
  std::vector<int32_t> table;
  ASSERT_TRUE(r.cache.reserve(table, int64_t(ids.size())));
  std::vector<float> logits;
  for (size_t b = 0; b < ids.size(); b += 7) {
    std::vector<int32_t> chunk(ids.begin() + b, ids.begin() + std::min(ids.size(), b + 7));
    r.m->forward({SeqInput{chunk, int64_t(b), &table, true}}, r.cache, logits);
  }
  expect_logits_match(logits, test::read_values<float>(dir() + "/seq1.logits.f32"), V, int64_t(ids.size()), 1e-3, "chunked");
}

// Several sequences in one forward, at different stages, give each sequence's own results.
TEST_P(FixtureModel, BatchedForwardEqualsEachSequenceAlone) {
  Runner r(model());
  const int64_t V = r.m->hparams().n_vocab;
  const auto a = test::read_values<int32_t>(dir() + "/seq0.tokens");
  const auto b = test::read_values<int32_t>(dir() + "/seq1.tokens");
  const std::vector<float> alone_a = r.prompt_logits(a), alone_b = r.prompt_logits(b);

  std::vector<int32_t> ta, tb, tc;
  ASSERT_TRUE(r.cache.reserve(ta, int64_t(a.size())));
  ASSERT_TRUE(r.cache.reserve(tb, int64_t(b.size())));
  ASSERT_TRUE(r.cache.reserve(tc, 5));
  // step 1: a's first 30 tokens, b's first 20, and a short third prompt
  std::vector<int32_t> c = {b[3], b[9], a[1], 7, 11};
  std::vector<float> l1;
  r.m->forward({SeqInput{{a.begin(), a.begin() + 30}, 0, &ta, true}, SeqInput{{b.begin(), b.begin() + 20}, 0, &tb, true},
                SeqInput{c, 0, &tc, false}},
               r.cache, l1);
  // step 2: the rest of a as one chunk, one decode token of b, nothing of c
  std::vector<float> l2;
  r.m->forward({SeqInput{{a.begin() + 30, a.end()}, 30, &ta, true}, SeqInput{{b[20]}, 20, &tb, false}}, r.cache, l2);

  std::vector<float> got_a(l1.begin(), l1.begin() + 30 * V);
  got_a.insert(got_a.end(), l2.begin(), l2.begin() + int64_t(a.size() - 30) * V);
  expect_logits_match(got_a, alone_a, V, int64_t(a.size()), 1e-5, "batched a");
  std::vector<float> got_b(l1.begin() + 30 * V, l1.begin() + 50 * V);
  got_b.insert(got_b.end(), l2.end() - V, l2.end());
  expect_logits_match(got_b, alone_b, V, 21, 1e-5, "batched b");

  Runner solo(model());
  const std::vector<float> alone_c = solo.prompt_logits(c);
  std::vector<float> got_c(l1.end() - V, l1.end());
  std::vector<float> ref_c(alone_c.end() - V, alone_c.end());
  expect_logits_match(got_c, ref_c, V, 1, 1e-5, "batched c");
}

// Where every earlier position fits in top-k (pos + 1 <= top_k), sparse and dense attention are
// the same computation, so dense mode must match the reference there.
TEST_P(FixtureModel, DenseModeMatchesTheReferenceWhereTopKCoversThePrompt) {
  Runner r(model(), AttentionMode::Dense);
  const int64_t V = r.m->hparams().n_vocab;
  const int64_t k = r.m->hparams().idx_top_k;
  const auto ids = test::read_values<int32_t>(dir() + "/seq0.tokens");
  std::vector<int32_t> prefix(ids.begin(), ids.begin() + k);
  expect_logits_match(r.prompt_logits(prefix), test::read_values<float>(dir() + "/seq0.logits.f32"), V, k, 1e-3, "dense prefix");
  // Beyond top-k the two modes differ: the indexer really selects.
  const auto full = r.prompt_logits(ids);
  const auto ref = test::read_values<float>(dir() + "/seq0.logits.f32");
  double diff = 0;
  for (size_t i = size_t(k * V); i < full.size(); ++i) diff = std::max(diff, std::fabs(double(full[i]) - ref[i]));
  EXPECT_GT(diff, 1e-2);
}

// Dense mode against transformers run with top-k >= the prompt (the fixtures made by
// scripts/reference/make_fixtures.py carry these references).
TEST_P(FixtureModel, DenseModeMatchesTransformersWithTopKCoveringThePrompt) {
  if (!std::filesystem::exists(dir() + "/seq0.dense.logits.f32"))
    GTEST_SKIP() << GetParam() << " has no dense reference (converted by llama.cpp, not made by make_fixtures.py)";
  Runner r(model(), AttentionMode::Dense);
  const int64_t V = r.m->hparams().n_vocab;
  for (const char* seq : {"seq0", "seq1"}) {
    const auto ids = test::read_values<int32_t>(dir() + "/" + seq + ".tokens");
    expect_logits_match(r.prompt_logits(ids), test::read_values<float>(dir() + "/" + seq + ".dense.logits.f32"), V,
                        int64_t(ids.size()), 1e-3, GetParam() + " dense " + seq);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureModel,
                         ::testing::Values("glm_pub", "dsv32_pub", "glm_share", "glm_share_q8_0", "dsv32_groups",
                                           "glm_q4_k"));

// A file with the legacy fused attn_kv_b ({kv_lora, n_head*(nope+v)}: per head nope k-rows then
// v v-rows) instead of attn_k_b / attn_v_b computes the same logits.
TEST(LegacyKvB, FusedKvBGivesTheSameLogits) {
  test::TempDir dir("kvb");
  const std::string src = test::fixture_path("glm_pub/model-f32.gguf");
  const HParams hp = load_hparams(*gguf::File::open(src));
  test::write_legacy_kv_b(src, dir.file("legacy.gguf"));
  Runner r(dir.file("legacy.gguf"));
  const auto ids = test::read_values<int32_t>(test::fixture_path("glm_pub/seq0.tokens"));
  expect_logits_match(r.prompt_logits(ids), test::read_values<float>(test::fixture_path("glm_pub/seq0.logits.f32")), hp.n_vocab,
                      int64_t(ids.size()), 1e-3, "legacy kv_b");
}

TEST(ModelLoad, MissingTensorsAreListed) {
  test::TempDir dir("missing");
  auto f = gguf::File::open(test::fixture_path("dsv32_pub/model-f32.gguf"));
  gguf::Writer w;
  for (const auto& [k, v] : f->metadata()) w.set(k, v);
  for (const auto& t : f->tensors())
    if (t.name != "blk.1.attn_q_b.weight" && t.name != "output_norm.weight")
      w.add_tensor_bytes(t.name, t.type, std::vector<int64_t>(t.ne, t.ne + t.n_dims),
                         std::vector<uint8_t>(t.data, t.data + t.nbytes));
  w.write(dir.file("m.gguf"));
  try {
    Model::load(dir.file("m.gguf"));
    FAIL() << "loaded a model with missing tensors";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("2 missing: output_norm.weight blk.1.attn_q_b.weight"), std::string::npos) << msg;
  }
}

TEST(ModelLoad, UnsupportedArchitectureIsRefused) {
  test::TempDir dir("arch");
  gguf::Writer w;
  w.set("general.architecture", gguf::Value::string("llama"));
  w.write(dir.file("l.gguf"));
  try {
    Model::load(dir.file("l.gguf"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("architecture 'llama' is not supported"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace sparsemla::model
