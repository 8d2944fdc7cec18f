// Every CPU operation against a plain double-precision formula written here, independently of the
// engine's code: matrix products on every quantized type (using gguf-py's dequantized values as
// the weights), norms, softmax, SwiGLU, top-k, RoPE, the MoE router, the indexer score, the
// thread pool and the paged cache.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <numeric>
#include <random>
#include <set>

#include "gguf/ggml_types.h"
#include "kv/paged_cache.h"
#include "model/blocks/ffn.h"
#include "model/blocks/indexer.h"
#include "model/hparams.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/matmul.h"
#include "ops/cpu/rope.h"
#include "ops/cpu/thread_pool.h"
#include "test_util.h"
#include "util/error.h"

namespace sparsemla::ops {
namespace {

using test::randn;

// For each quantized type, the random blocks of tests/data/quants (from gguf-py) are the weight
// rows, and gguf-py's dequantization of them is the reference matrix.
class MatmulOnQuantType : public ::testing::TestWithParam<std::string> {};

TEST_P(MatmulOnQuantType, MatchesDoubleProductOfGgufPyValues) {
  const auto type = gguf::type_from_name(GetParam());
  ASSERT_TRUE(type.has_value());
  const std::string base = test::data_path("quants/dequant_" + GetParam());
  const std::vector<uint8_t> blocks = test::read_values<uint8_t>(base + ".bin");
  const std::vector<uint8_t> ref_bytes = test::read_values<uint8_t>(base + ".f32");
  ASSERT_FALSE(blocks.empty()) << base;
  const auto& tr = gguf::traits(*type);
  const int64_t n_blocks = int64_t(blocks.size() / tr.type_size);
  // Rows of 2 blocks each (64 values for the plain types).
  const int64_t per_row = tr.block_size == 1 ? 64 : 2;
  Weight w;
  w.type = *type;
  w.n_cols = per_row * tr.block_size;
  w.n_rows = n_blocks / per_row;
  w.row_bytes = per_row * tr.type_size;
  w.data = blocks.data();
  const float* ref = reinterpret_cast<const float*>(ref_bytes.data());
  const int64_t T = 5;
  const std::vector<float> x = randn(size_t(T * w.n_cols), 3);
  std::vector<float> y(size_t(T * w.n_rows));
  ThreadPool pool(2);
  matmul(w, x.data(), T, y.data(), pool);
  // Rows holding NaN or inf (random f32/f16 bits, MXFP4's extreme exponents) are left out: their
  // products are not comparable numbers.
  std::vector<bool> finite(size_t(w.n_rows), true);
  for (int64_t i = 0; i < w.n_rows * w.n_cols; ++i)
    if (!std::isfinite(ref[i]) || std::fabs(ref[i]) > 1e30f) finite[size_t(i / w.n_cols)] = false;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < w.n_rows; ++r) {
      if (!finite[size_t(r)]) continue;
      double want = 0, mag = 0;
      for (int64_t c = 0; c < w.n_cols; ++c) {
        want += double(ref[r * w.n_cols + c]) * x[size_t(t * w.n_cols + c)];
        mag += std::fabs(double(ref[r * w.n_cols + c]) * x[size_t(t * w.n_cols + c)]);
      }
      EXPECT_NEAR(y[size_t(t * w.n_rows + r)], want, 1e-5 * mag + 1e-6) << GetParam() << " t" << t << " r" << r;
    }
  // The transposed product and the row lookup read the same values.
  std::vector<float> xt = randn(size_t(w.n_rows), 5), yt(size_t(w.n_cols), 0.0f);
  for (int64_t r = 0; r < w.n_rows; ++r)
    if (!finite[size_t(r)]) xt[size_t(r)] = 0.0f;  // skipped by matmul_transposed_acc
  matmul_transposed_acc(w, xt.data(), yt.data());
  for (int64_t c = 0; c < w.n_cols; ++c) {
    double want = 0, mag = 0;
    for (int64_t r = 0; r < w.n_rows; ++r) {
      if (!finite[size_t(r)]) continue;
      want += double(ref[r * w.n_cols + c]) * xt[size_t(r)];
      mag += std::fabs(double(ref[r * w.n_cols + c]) * xt[size_t(r)]);
    }
    EXPECT_NEAR(yt[size_t(c)], want, 1e-5 * mag + 1e-6);
  }
  std::vector<float> row(size_t(w.n_cols));
  dequantize_row(w, 1, row.data());
  for (int64_t c = 0; c < w.n_cols; ++c)
    if (std::isfinite(ref[w.n_cols + c])) EXPECT_EQ(row[size_t(c)], ref[w.n_cols + c]);
}

// A token's product must not depend on the other tokens of the call: batched requests must give
// exactly what each gives alone (the server promises it).
TEST_P(MatmulOnQuantType, EachTokenIsIndependentOfTheBatch) {
  const auto type = gguf::type_from_name(GetParam());
  const std::vector<uint8_t> blocks = test::read_values<uint8_t>(test::data_path("quants/dequant_" + GetParam() + ".bin"));
  const auto& tr = gguf::traits(*type);
  const int64_t per_row = tr.block_size == 1 ? 64 : 2;
  Weight w;
  w.type = *type;
  w.n_cols = per_row * tr.block_size;
  w.n_rows = int64_t(blocks.size() / tr.type_size) / per_row;
  w.row_bytes = per_row * tr.type_size;
  w.data = blocks.data();
  ThreadPool pool(2);
  for (int64_t T : {2, 3, 5, 9, 17}) {
    const std::vector<float> x = randn(size_t(T * w.n_cols), uint32_t(T));
    std::vector<float> y(size_t(T * w.n_rows)), y1(size_t(w.n_rows));
    matmul(w, x.data(), T, y.data(), pool);
    for (int64_t t = 0; t < T; ++t) {
      matmul(w, x.data() + t * w.n_cols, 1, y1.data(), pool);
      for (int64_t r = 0; r < w.n_rows; ++r) {
        const float a = y[size_t(t * w.n_rows + r)], b = y1[size_t(r)];
        EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << GetParam() << " T=" << T << " t" << t << " r" << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, MatmulOnQuantType,
                         ::testing::Values("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K",
                                           "q3_K", "q4_K", "q5_K", "q6_K", "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs",
                                           "iq2_s", "iq3_xxs", "iq3_s", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0",
                                           "mxfp4"));

TEST(Norms, RmsNormAndLayerNormMatchTheirFormulas) {
  const int n = 96;
  const auto x = randn(n, 1, 3.0f), w = randn(n, 2), b = randn(n, 3);
  std::vector<float> out(n);
  rms_norm(x.data(), w.data(), n, 1e-5f, out.data());
  double ms = 0;
  for (float v : x) ms += double(v) * v;
  ms /= n;
  for (int i = 0; i < n; ++i) EXPECT_NEAR(out[i], x[i] / std::sqrt(ms + 1e-5) * w[i], 1e-5);
  layer_norm(x.data(), w.data(), b.data(), n, 1e-6f, out.data());
  double mean = std::accumulate(x.begin(), x.end(), 0.0) / n, var = 0;
  for (float v : x) var += (v - mean) * (v - mean);
  var /= n;
  for (int i = 0; i < n; ++i) EXPECT_NEAR(out[i], (x[i] - mean) / std::sqrt(var + 1e-6) * w[i] + b[i], 1e-5);
}

TEST(Elementwise, SoftmaxAndSiluMul) {
  std::vector<float> x = {1000.0f, 999.0f, -5.0f, 0.0f};
  softmax(x.data(), 4);
  const double z = 1 + std::exp(-1.0) + std::exp(-1005.0) + std::exp(-1000.0);
  EXPECT_NEAR(x[0], 1 / z, 1e-7);
  EXPECT_NEAR(x[1], std::exp(-1.0) / z, 1e-7);
  std::vector<float> g = {-2.0f, 0.5f, 3.0f}, u = {1.5f, -1.0f, 2.0f};
  silu_mul(g.data(), u.data(), 3);
  const double gi[] = {-2.0, 0.5, 3.0}, ui[] = {1.5, -1.0, 2.0};
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(g[i], gi[i] / (1 + std::exp(-gi[i])) * ui[i], 1e-6);
}

TEST(TopK, LargestFirstTiesByLowerIndex) {
  const std::vector<float> x = {0.5f, 2.0f, -1.0f, 2.0f, 7.0f, 0.5f};
  EXPECT_EQ(top_k(x.data(), 6, 3), (std::vector<int32_t>{4, 1, 3}));
  EXPECT_EQ(top_k(x.data(), 6, 10).size(), 6u);
  // Random: the selected set is exactly the k largest.
  const auto r = randn(5000, 9);
  const auto sel = top_k(r.data(), 5000, 200);
  std::vector<float> sorted(r);
  std::sort(sorted.begin(), sorted.end(), std::greater<float>());
  for (size_t i = 0; i < sel.size(); ++i) EXPECT_EQ(r[size_t(sel[i])], sorted[i]);
}

model::HParams rope_params(float theta, int dims) {
  model::HParams hp;
  hp.qk_rope = uint32_t(dims);
  hp.rope_theta = theta;
  return hp;
}

TEST(Rope, InterleavedAndHalfSplitRotatePairsByPositionTimesFrequency) {
  const int d = 8;
  Rope rope(rope_params(10000.0f, d));
  const auto x = randn(d, 4);
  for (RopeStyle style : {RopeStyle::Interleaved, RopeStyle::HalfSplit}) {
    std::vector<float> y(x);
    rope.apply(y.data(), 37, style);
    for (int i = 0; i < d / 2; ++i) {
      const double freq = std::pow(10000.0, -2.0 * i / d), a = 37 * freq;
      const int p = style == RopeStyle::Interleaved ? 2 * i : i;
      const int q = style == RopeStyle::Interleaved ? 2 * i + 1 : i + d / 2;
      EXPECT_NEAR(y[p], x[p] * std::cos(a) - x[q] * std::sin(a), 2e-5);
      EXPECT_NEAR(y[q], x[p] * std::sin(a) + x[q] * std::cos(a), 2e-5);
    }
  }
}

// YaRN (Peng et al. 2023): dims rotating faster than beta_fast times over the original context
// keep their frequency, dims slower than beta_slow times are divided by the factor, a linear ramp
// in between.
TEST(Rope, YarnFrequenciesFollowTheRamp) {
  model::HParams hp = rope_params(10000.0f, 64);
  hp.rope_scaling = model::RopeScaling::Yarn;
  hp.rope_factor = 40.0f;
  hp.rope_orig_ctx = 4096;
  hp.yarn_beta_fast = 32.0f;
  hp.yarn_beta_slow = 1.0f;
  Rope rope(hp);
  const int d = 64;
  auto corr = [&](double rot) { return d * std::log(4096 / (rot * 2 * M_PI)) / (2 * std::log(10000.0)); };
  const double low = std::max(0.0, std::floor(corr(32))), high = std::min(d - 1.0, std::ceil(corr(1)));
  for (int i = 0; i < d / 2; ++i) {
    const double base = std::pow(10000.0, -2.0 * i / d);
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double want = base / 40.0 * ramp + base * (1 - ramp);
    EXPECT_NEAR(rope.inv_freq()[size_t(i)], want, 1e-6 * base) << i;
  }
}

TEST(Router, SigmoidGroupLimitedNormalizedScaled) {
  model::HParams hp;
  hp.n_expert = 8;
  hp.n_expert_used = 2;
  hp.n_expert_groups = 4;
  hp.n_group_used = 2;
  hp.expert_gating = 2;
  hp.expert_weights_norm = true;
  hp.expert_weights_scale = 2.5f;
  // scores s = sigmoid(logit); choice = s + bias. Groups {0,1} {2,3} {4,5} {6,7}.
  const std::vector<float> logits = {2.0f, -1.0f, 0.5f, 0.4f, 3.0f, -3.0f, 0.0f, 0.1f};
  const std::vector<float> bias = {0.0f, 0.0f, 0.3f, 0.3f, 0.0f, 0.0f, 0.0f, 0.0f};
  auto sig = [](double v) { return 1 / (1 + std::exp(-v)); };
  // group sums of the top two choices: g0 .881+.269=1.150, g1 .922+.899=1.821, g2 .953+.047=1.000,
  // g3 .5+.525=1.025 -> groups 1 and 0 are kept; the best two experts there are 2 (0.922) and 3 (0.899).
  const model::Routing r = model::route(hp, logits.data(), bias.data());
  ASSERT_EQ(r.experts, (std::vector<int32_t>{2, 3}));
  const double s2 = sig(0.5), s3 = sig(0.4);
  EXPECT_NEAR(r.weights[0], s2 / (s2 + s3) * 2.5, 1e-6);  // weights use the unbiased scores
  EXPECT_NEAR(r.weights[1], s3 / (s2 + s3) * 2.5, 1e-6);
}

TEST(Indexer, ScoreIsWeightedSumOfReluDots) {
  const int heads = 3, dim = 5;
  const auto q = randn(heads * dim, 6), k = randn(dim, 7), w = randn(heads, 8);
  double want = 0;
  for (int h = 0; h < heads; ++h) {
    double dot = 0;
    for (int i = 0; i < dim; ++i) dot += double(q[size_t(h * dim + i)]) * k[size_t(i)];
    want += w[size_t(h)] * std::max(dot, 0.0);
  }
  EXPECT_NEAR(model::indexer_score(q.data(), w.data(), k.data(), heads, dim), want, 1e-5);
}

TEST(ThreadPool, EveryIndexExactlyOnce) {
  ThreadPool pool(3);
  for (int64_t n : {1, 2, 3, 7, 100, 1001}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    for (int rep = 0; rep < 20; ++rep)
      pool.parallel_for(n, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
      });
    for (auto& h : hits) EXPECT_EQ(h.load(), 20);
  }
}

TEST(PagedCache, SlotsFollowTheBlockTableAndBlocksAreReused) {
  kv::PagedCache cache({2, 4, 3, 4, 5});
  std::vector<int32_t> a, b;
  ASSERT_TRUE(cache.reserve(a, 9));  // 3 blocks
  ASSERT_TRUE(cache.reserve(b, 4));  // 1 block
  EXPECT_FALSE(cache.reserve(b, 9)); // needs 2 more, 1 free
  EXPECT_EQ(b.size(), 1u);
  std::set<int32_t> all(a.begin(), a.end());
  all.insert(b.begin(), b.end());
  EXPECT_EQ(all.size(), 4u);
  EXPECT_EQ(cache.slot(a, 5), int64_t(a[1]) * 4 + 1);
  EXPECT_THROW(cache.slot(a, 12), Error);
  cache.latent(1, cache.slot(a, 8))[3] = 42.0f;
  EXPECT_EQ(cache.latent(1, int64_t(a[2]) * 4)[3], 42.0f);
  cache.release(a);
  EXPECT_EQ(cache.n_free(), 4);
  EXPECT_TRUE(cache.reserve(b, 20));
}

}  // namespace
}  // namespace sparsemla::ops
