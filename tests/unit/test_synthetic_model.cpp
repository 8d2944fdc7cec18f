// Synthetic models (make-model): the Q4_K_M mix puts each tensor in the type llama.cpp's Q4_K_M
// would, zero matrices are written as holes and still load and run, and GLM-5's widths come out as
// MODEL_SPEC.md gives them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <sys/stat.h>

#include "gguf/quants.h"
#include "gguf/reader.h"
#include "model/decisions.h"
#include "model/model.h"
#include "model/synthetic.h"
#include "test_util.h"

namespace sparsemla::model {
namespace {

// Runs five tokens through a two-layer zero-matrix model on the CPU: every logit is exactly 0 (a
// zero output head); returns how many distinct routed expert sets the tokens got in layer 1 (layer 0
// is dense).
size_t zero_model_expert_sets(const std::string& path, const std::string& what) {
  auto m = Model::load(path, {AttentionMode::Sparse, 2});
  kv::PagedCache cache(m->cache_shape(4, 16));
  std::vector<int32_t> table;
  EXPECT_TRUE(cache.reserve(table, 8)) << what;
  std::vector<float> logits;
  Decisions d;
  m->forward({SeqInput{{1, 2, 3, 4, 5}, 0, &table, true}}, cache, logits, nullptr, &d);
  EXPECT_EQ(logits.size(), size_t(5) * m->hparams().n_vocab) << what;
  EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float x) { return x == 0.0f; })) << what;
  if (d.layers.size() != 2 || d.layers[1].experts.size() != 5) {
    ADD_FAILURE() << what << ": " << d.layers.size() << " layers of routing decisions";
    return 0;
  }
  std::set<std::vector<int32_t>> distinct;
  for (std::vector<int32_t> e : d.layers[1].experts) {
    std::sort(e.begin(), e.end());
    distinct.insert(e);
  }
  return distinct.size();
}

TEST(SyntheticModel, Q4KMMixAndZeroMatricesLoadAndRun) {
  test::TempDir dir("synth");
  SyntheticSpec s = SyntheticSpec::glm5_small();
  s.n_layer = 2;
  s.q4_k_m = true;
  s.zero_matrices = true;
  const std::string path = dir.file("m.gguf");
  write_synthetic_model(s, path);
  auto f = gguf::File::open(path);
  const auto type = [&](const std::string& name) { return f->tensor(name)->type; };
  EXPECT_EQ(type("blk.1.ffn_down_exps.weight"), gguf::GgmlType::Q6_K);
  EXPECT_EQ(type("blk.0.ffn_down.weight"), gguf::GgmlType::Q6_K);
  EXPECT_EQ(type("output.weight"), gguf::GgmlType::Q6_K);
  EXPECT_EQ(type("blk.1.ffn_gate_exps.weight"), gguf::GgmlType::Q4_K);
  EXPECT_EQ(type("blk.0.attn_q_a.weight"), gguf::GgmlType::Q4_K);
  // attn_k_b rows hold qk_nope = 64 values: not a whole 256-block, so Q8_0.
  EXPECT_EQ(type("blk.0.attn_k_b.weight"), gguf::GgmlType::Q8_0);
  EXPECT_EQ(type("blk.1.ffn_gate_inp.weight"), gguf::GgmlType::F32);  // the router stays random fp32
  // Holes: the file's blocks on disk are far fewer than its size.
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_LT(uint64_t(st.st_blocks) * 512, uint64_t(st.st_size) / 2);

  // The embedding rows are random, so the five tokens do not all go to the same experts (with a
  // zero embedding every hidden state was 0 and the router's bias alone chose).
  EXPECT_GE(zero_model_expert_sets(path, "q4_k_m"), size_t(3)) << "routed expert sets of 5 tokens";
}

// One K-quant for every matrix (make-model --type q5_k): rows that are not whole 256-blocks fall
// back to Q8_0 instead of failing to write, the rest keep the type, and the model loads and runs.
TEST(SyntheticModel, SingleKQuantFallsBackToQ80WhereRowsAreNotWholeBlocks) {
  test::TempDir dir("synth");
  SyntheticSpec s = SyntheticSpec::glm5_small();
  s.n_layer = 2;
  s.matrix_type = gguf::GgmlType::Q5_K;
  const std::string path = dir.file("m.gguf");
  write_synthetic_model(s, path);
  auto f = gguf::File::open(path);
  const auto type = [&](const std::string& name) { return f->tensor(name)->type; };
  EXPECT_EQ(type("blk.1.ffn_down_exps.weight"), gguf::GgmlType::Q5_K);
  EXPECT_EQ(type("blk.0.attn_q_a.weight"), gguf::GgmlType::Q5_K);
  EXPECT_EQ(type("blk.0.attn_k_b.weight"), gguf::GgmlType::Q8_0);  // rows of qk_nope = 64 values
  auto m = Model::load(path, {AttentionMode::Sparse, 2});
  kv::PagedCache cache(m->cache_shape(4, 16));
  std::vector<int32_t> table;
  ASSERT_TRUE(cache.reserve(table, 8));
  std::vector<float> logits;
  m->forward({SeqInput{{1, 2, 3}, 0, &table, true}}, cache, logits);
  ASSERT_EQ(logits.size(), size_t(3) * m->hparams().n_vocab);
  for (float x : logits) ASSERT_TRUE(std::isfinite(x));
}

// Zero matrices take any ggml type, also those the writer cannot quantize (make-model --type q2_k
// --zeros, for timing the int8 kernels of such files): the matrices keep the type (Q8_0 where rows
// are not whole blocks of it), the embedding is random Q8_0 rows so tokens still route apart, and
// the model loads and runs on the CPU. Without --zeros such a type is refused by name.
TEST(SyntheticModel, ZeroMatricesTakeAnyType) {
  test::TempDir dir("synth");
  for (gguf::GgmlType t : {gguf::GgmlType::Q2_K, gguf::GgmlType::Q3_K, gguf::GgmlType::IQ4_XS, gguf::GgmlType::IQ2_XXS}) {
    const std::string what(gguf::type_name(t));
    EXPECT_FALSE(gguf::can_quantize(t)) << what;
    SyntheticSpec s = SyntheticSpec::glm5_small();
    s.n_layer = 2;
    s.matrix_type = t;
    s.zero_matrices = true;
    const std::string path = dir.file(what + ".gguf");
    write_synthetic_model(s, path);
    auto f = gguf::File::open(path);
    const auto type = [&](const std::string& name) { return f->tensor(name)->type; };
    EXPECT_EQ(type("blk.1.ffn_gate_exps.weight"), t) << what;
    EXPECT_EQ(type("blk.1.ffn_down_exps.weight"), t) << what;
    EXPECT_EQ(type("output.weight"), t) << what;
    EXPECT_EQ(type("blk.0.attn_k_b.weight"), gguf::GgmlType::Q8_0) << what;  // rows of 64 values
    EXPECT_EQ(type("token_embd.weight"), gguf::GgmlType::Q8_0) << what;
    EXPECT_GE(zero_model_expert_sets(path, what), size_t(3)) << what << ": routed expert sets of 5 tokens";
  }
  EXPECT_TRUE(gguf::can_quantize(gguf::GgmlType::Q4_K));
  SyntheticSpec s = SyntheticSpec::glm5_small();
  s.n_layer = 2;
  s.matrix_type = gguf::GgmlType::Q2_K;
  const std::string refused = test::error_of([&] { write_synthetic_model(s, dir.file("r.gguf")); });
  EXPECT_NE(refused.find("q2_K"), std::string::npos) << refused;
}

TEST(SyntheticModel, Glm5WidthIsGlm5sShape) {
  const SyntheticSpec s = SyntheticSpec::glm5_width(4);
  EXPECT_EQ(s.n_embd, 6144u);
  EXPECT_EQ(s.n_head, 64u);
  EXPECT_EQ(s.kv_lora + s.qk_rope, 576u);
  EXPECT_EQ(s.n_expert, 256u);
  EXPECT_EQ(s.n_expert_used, 8u);
  EXPECT_EQ(s.idx_heads, 32u);
  EXPECT_EQ(s.idx_dim, 128u);
  EXPECT_EQ(s.idx_top_k, 2048u);
}

}  // namespace
}  // namespace sparsemla::model
