// Hyperparameters from GGUF metadata: the fixtures' values (from their README, i.e. the
// transformers configs they were made from), the defaults published files rely on, and the errors.
#include <gtest/gtest.h>

#include <cmath>

#include "gguf/reader.h"
#include "gguf/writer.h"
#include "model/hparams.h"
#include "test_util.h"
#include "util/error.h"

namespace sparsemla::model {
namespace {

TEST(HParams, GlmFixture) {
  auto f = gguf::File::open(test::fixture_path("glm_pub/model-f32.gguf"));
  const HParams hp = load_hparams(*f);
  EXPECT_EQ(hp.arch, Arch::GlmDsa);
  EXPECT_EQ(hp.n_layer, 3u);
  EXPECT_EQ(hp.n_nextn, 1u);
  EXPECT_EQ(hp.n_leading_dense, 1u);
  EXPECT_EQ(hp.n_head, 2u);
  EXPECT_EQ(hp.q_lora_rank, 48u);
  EXPECT_EQ(hp.kv_lora_rank, 24u);
  EXPECT_EQ(hp.qk_nope, 16u);
  EXPECT_EQ(hp.qk_rope, 8u);
  EXPECT_EQ(hp.v_head, 24u);
  EXPECT_EQ(hp.n_expert, 8u);
  EXPECT_EQ(hp.n_expert_used, 2u);
  EXPECT_EQ(hp.n_expert_shared, 1u);
  EXPECT_EQ(hp.idx_heads, 8u);
  EXPECT_EQ(hp.idx_dim, 64u);
  EXPECT_EQ(hp.idx_top_k, 12u);
  EXPECT_TRUE(hp.idx_rope_interleaved);
  EXPECT_FLOAT_EQ(hp.softmax_scale(), 1.0f / std::sqrt(24.0f));
}

TEST(HParams, DeepSeekFixtureYarnAndGroups) {
  auto f = gguf::File::open(test::fixture_path("dsv32_pub/model-f32.gguf"));
  const HParams hp = load_hparams(*f);
  EXPECT_EQ(hp.arch, Arch::DeepSeek32);
  EXPECT_EQ(hp.n_expert_groups, 2u);
  EXPECT_EQ(hp.n_group_used, 1u);
  EXPECT_EQ(hp.rope_scaling, RopeScaling::Yarn);
  EXPECT_FLOAT_EQ(hp.rope_factor, 4.0f);
  EXPECT_EQ(hp.rope_orig_ctx, 32u);
  EXPECT_FALSE(hp.idx_rope_interleaved);
  // transformers: qk_head_dim^-0.5 * yarn_get_mscale(factor, mscale_all_dim = 1)^2
  const double mscale = 0.1 * std::log(4.0) + 1.0;
  EXPECT_NEAR(hp.softmax_scale(), mscale * mscale / std::sqrt(16.0), 1e-6);
}

// A minimal glm-dsa metadata set; tests remove or change keys from it.
gguf::Writer glm_writer(uint32_t blocks = 4) {
  gguf::Writer w;
  auto u = [&](const char* k, uint32_t v) { w.set(std::string("glm-dsa.") + k, gguf::Value::u32(v)); };
  w.set("general.architecture", gguf::Value::string("glm-dsa"));
  u("block_count", blocks);
  u("nextn_predict_layers", 1);
  u("context_length", 4096);
  u("embedding_length", 64);
  u("feed_forward_length", 128);
  u("attention.head_count", 2);
  u("attention.kv_lora_rank", 16);
  u("attention.q_lora_rank", 32);
  u("attention.key_length_mla", 24);
  u("attention.value_length_mla", 16);
  u("rope.dimension_count", 8);
  u("expert_count", 4);
  u("expert_used_count", 2);
  u("expert_feed_forward_length", 32);
  u("attention.indexer.head_count", 4);
  u("attention.indexer.key_length", 32);
  u("attention.indexer.top_k", 8);
  return w;
}

HParams load(gguf::Writer& w, const test::TempDir& dir) {
  w.write(dir.file("h.gguf"));
  return load_hparams(*gguf::File::open(dir.file("h.gguf")));
}

std::string error_of(gguf::Writer& w, const test::TempDir& dir) {
  try {
    load(w, dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(HParams, DefaultsArePublishedFilesAssumptionsAndAreMarked) {
  test::TempDir dir("hp");
  gguf::Writer w = glm_writer();
  const HParams hp = load(w, dir);
  EXPECT_EQ(hp.expert_gating, 2u);  // absent expert_gating_func: sigmoid
  EXPECT_EQ(hp.idx_full, std::vector<bool>({true, true, true, true}));  // absent types: all full
  EXPECT_EQ(hp.n_layer, 3u);
  EXPECT_EQ(hp.qk_nope, 16u);  // key_length_mla - rope
  auto marked = [&](const std::string& s) {
    for (const auto& d : hp.defaulted)
      if (d.find(s) != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(marked("expert_gating_func = 2"));
  EXPECT_TRUE(marked("indexer.types = all full"));
}

TEST(HParams, IndexerTypesShorterThanBlockCountAreFullAfter) {
  test::TempDir dir("hp2");
  gguf::Writer w = glm_writer();
  w.set("glm-dsa.attention.indexer.types", gguf::Value::bool_array({true, false}));
  const HParams hp = load(w, dir);
  EXPECT_EQ(hp.idx_full, std::vector<bool>({true, false, true, true}));
}

TEST(HParams, MissingKeysAreListedTogether) {
  test::TempDir dir("hp3");
  gguf::Writer w;
  w.set("general.architecture", gguf::Value::string("deepseek32"));
  w.set("deepseek32.block_count", gguf::Value::u32(2));
  const std::string msg = error_of(w, dir);
  for (const char* k : {"deepseek32.embedding_length", "deepseek32.attention.kv_lora_rank",
                        "deepseek32.attention.indexer.top_k", "deepseek32.context_length"})
    EXPECT_NE(msg.find(k), std::string::npos) << k << " not in: " << msg;
}

TEST(HParams, FirstLayerSharedIsRefused) {
  test::TempDir dir("hp4");
  gguf::Writer w = glm_writer();
  w.set("glm-dsa.attention.indexer.types", gguf::Value::bool_array({false, true, true}));
  EXPECT_NE(error_of(w, dir).find("layer 0 is 'shared'"), std::string::npos);
}

TEST(HParams, IndexerWithoutQaIsRefused) {
  test::TempDir dir("hp7");
  gguf::Writer w = glm_writer();
  w.set("glm-dsa.attention.q_lora_rank", gguf::Value::u32(0));
  EXPECT_NE(error_of(w, dir).find("attention.q_lora_rank is 0"), std::string::npos) << error_of(w, dir);
}

TEST(HParams, InconsistentKeysAreRefused) {
  test::TempDir dir("hp5");
  gguf::Writer w = glm_writer();
  w.set("glm-dsa.expert_used_count", gguf::Value::u32(9));
  w.set("glm-dsa.attention.head_count_kv", gguf::Value::u32(2));
  const std::string msg = error_of(w, dir);
  EXPECT_NE(msg.find("expert_used_count 9 is not in 1..expert_count 4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("head_count_kv is 2"), std::string::npos) << msg;
}

TEST(HParams, LegacyLayoutWithoutMlaKeys) {
  test::TempDir dir("hp6");
  gguf::Writer w;
  auto u = [&](const char* k, uint32_t v) { w.set(std::string("deepseek2.") + k, gguf::Value::u32(v)); };
  w.set("general.architecture", gguf::Value::string("deepseek2"));
  u("block_count", 2);
  u("context_length", 4096);
  u("embedding_length", 64);
  u("feed_forward_length", 128);
  u("attention.head_count", 2);
  u("attention.kv_lora_rank", 16);
  u("attention.key_length", 24);  // old files: nope + rope
  u("attention.value_length", 16);
  u("rope.dimension_count", 8);
  const HParams hp = load(w, dir);
  EXPECT_TRUE(hp.legacy_kv_b);
  EXPECT_EQ(hp.qk_nope, 16u);
  EXPECT_EQ(hp.v_head, 16u);
  EXPECT_EQ(hp.q_lora_rank, 0u);
  EXPECT_FALSE(hp.has_indexer());
}

}  // namespace
}  // namespace sparsemla::model
