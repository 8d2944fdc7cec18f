// The CPU forward's recorded and imposed choices (model/decisions.h), and the CPU cache rounded as
// the GPU cache formats store rows (kv::RowRounding): the two tools the GPU model's tests rest on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "model/model.h"
#include "test_util.h"
#include "util/half.h"

namespace sparsemla::model {
namespace {

std::vector<float> prompt_logits(Model& m, kv::PagedCache& cache, const std::vector<int32_t>& ids,
                                 const Decisions* force, Decisions* record) {
  std::vector<int32_t> table;
  EXPECT_TRUE(cache.reserve(table, int64_t(ids.size())));
  std::vector<float> logits;
  m.forward({SeqInput{ids, 0, &table, true}}, cache, logits, force, record);
  cache.release(table);
  return logits;
}

// Following the choices a forward recorded gives that forward's logits bit for bit, on a fixture
// with IndexShare layers (the shared layers record the selection they reuse).
TEST(ModelDecisions, FollowingRecordedChoicesReproducesTheForward) {
  auto m = Model::load(test::fixture_path("glm_share/model.gguf"), {AttentionMode::Sparse, 2});
  kv::PagedCache cache(m->cache_shape(64, 4));
  const auto ids = test::read_values<int32_t>(test::fixture_path("glm_share/seq1.tokens"));
  Decisions d;
  const std::vector<float> free_run = prompt_logits(*m, cache, ids, nullptr, &d);
  ASSERT_EQ(d.layers.size(), m->hparams().n_layer);
  for (uint32_t l = 0; l < m->hparams().n_layer; ++l) {
    ASSERT_EQ(d.layers[l].selected.size(), ids.size()) << l;
    EXPECT_EQ(d.layers[l].selected.back().size(), m->hparams().idx_top_k) << l;
    EXPECT_EQ(d.layers[l].selected[3].size(), 4u) << "position 3 sees 4 positions";
    EXPECT_EQ(d.layers[l].experts.size(), m->hparams().is_moe_layer(l) ? ids.size() : 0u) << l;
  }
  EXPECT_EQ(d.layers[1].selected, d.layers[0].selected) << "layer 1 shares layer 0's selection";
  Decisions again;
  EXPECT_EQ(prompt_logits(*m, cache, ids, &d, &again), free_run);
  EXPECT_EQ(again.layers[2].experts, d.layers[2].experts);

  // Other choices change the result; choices for another batch are refused.
  Decisions other = d;
  std::vector<int32_t>& routed = other.layers[2].experts[10];  // token 10 goes to experts it was not routed to
  std::vector<int32_t> fresh;
  for (int32_t e = 0; fresh.size() < routed.size(); ++e)
    if (std::find(routed.begin(), routed.end(), e) == routed.end()) fresh.push_back(e);
  routed = fresh;
  EXPECT_NE(prompt_logits(*m, cache, ids, &other, nullptr), free_run);
  const std::vector<int32_t> shorter(ids.begin(), ids.begin() + 10);
  EXPECT_NE(test::error_of([&] { prompt_logits(*m, cache, shorter, &d, nullptr); }).find("forced selection of layer 0"),
            std::string::npos);
}

// Rounded rows hold what the GPU formats hold: bf16 everywhere, or e4m3 with one scale per 128
// latent values (amax / 448) and the rope part in bf16.
TEST(ModelDecisions, RoundedCacheRowsHoldTheGpuFormats) {
  const int32_t kv_lora = 160, rope = 16, dim = 64;
  kv::PagedCache cache({1, kv_lora + rope, dim, 4, 2});
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> row(static_cast<size_t>(kv_lora + rope)), key(static_cast<size_t>(dim));
  for (float& v : row) v = nd(rng);
  for (float& v : key) v = nd(rng);
  auto write = [&](kv::RowRounding r) {
    cache.set_rounding(r, kv_lora);
    std::memcpy(cache.latent(0, 5), row.data(), row.size() * 4);
    std::memcpy(cache.index_key(0, 5), key.data(), key.size() * 4);
    cache.round_latent(0, 5);
    cache.round_index_key(0, 5);
  };
  write(kv::RowRounding::None);
  EXPECT_EQ(std::vector<float>(cache.latent(0, 5), cache.latent(0, 5) + row.size()), row);
  write(kv::RowRounding::BF16);
  for (size_t i = 0; i < row.size(); ++i) ASSERT_EQ(cache.latent(0, 5)[i], bf16_to_f32(f32_to_bf16(row[i]))) << i;
  for (size_t i = 0; i < key.size(); ++i) ASSERT_EQ(cache.index_key(0, 5)[i], bf16_to_f32(f32_to_bf16(key[i]))) << i;
  write(kv::RowRounding::FP8);
  auto fp8 = [](const float* x, int64_t g0, int64_t g1, int64_t i) {
    float amax = 0.0f;
    for (int64_t j = g0; j < g1; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float scale = amax / 448.0f;
    return fp8_e4m3_to_f32(f32_to_fp8_e4m3(x[i] / scale)) * scale;
  };
  for (int64_t i = 0; i < kv_lora; ++i)
    ASSERT_EQ(cache.latent(0, 5)[i], fp8(row.data(), i < 128 ? 0 : 128, i < 128 ? 128 : kv_lora, i)) << i;
  for (int64_t i = kv_lora; i < kv_lora + rope; ++i)
    ASSERT_EQ(cache.latent(0, 5)[i], bf16_to_f32(f32_to_bf16(row[size_t(i)]))) << i;
  for (int64_t i = 0; i < dim; ++i) ASSERT_EQ(cache.index_key(0, 5)[i], fp8(key.data(), 0, dim, i)) << i;
}

}  // namespace
}  // namespace sparsemla::model
