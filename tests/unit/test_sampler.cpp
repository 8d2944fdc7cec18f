// The sampler against independent formulas: penalties as OpenAI / vLLM define them, the token sets
// top-k, top-p and min-p keep, the frequencies of seeded draws against the filtered softmax, seeded
// reproducibility, and logprobs of the raw logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>

#include "engine/sampler.h"

namespace sparsemla::engine {
namespace {

const std::vector<float> kLogits = {1.0f, 3.0f, -2.0f, 2.5f, 0.0f, 2.9f, -1.0f, 1.5f};

// The distribution the sampler should draw from, written out directly: softmax at temperature t,
// then min-p, top-k, top-p on the sorted probabilities, renormalized. [n_vocab]
std::vector<double> reference_distribution(const std::vector<float>& logits, double t, int top_k, double top_p,
                                           double min_p) {
  const size_t n = logits.size();
  std::vector<double> p(n);
  double z = 0;
  for (size_t i = 0; i < n; ++i) z += p[i] = std::exp(logits[i] / t);
  for (double& x : p) x /= z;
  const double pmax = *std::max_element(p.begin(), p.end());
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] > p[b]; });
  std::vector<bool> keep(n, false);
  std::vector<size_t> kept;
  for (size_t i : order)
    if (p[i] >= min_p * pmax) kept.push_back(i);
  if (top_k > 0 && kept.size() > size_t(top_k)) kept.resize(size_t(top_k));
  double mass = 0;
  for (size_t i : kept) mass += p[i];
  double cum = 0;
  size_t m = 0;
  while (m < kept.size()) {
    cum += p[kept[m++]];
    if (cum >= top_p * mass) break;
  }
  kept.resize(m);
  double total = 0;
  for (size_t i : kept) total += p[i];
  std::vector<double> q(n, 0.0);
  for (size_t i : kept) q[i] = p[i] / total;
  return q;
}

std::vector<double> frequencies(SamplingParams params, int draws) {
  Sampler s(params, {});
  std::vector<double> f(kLogits.size(), 0.0);
  for (int i = 0; i < draws; ++i) f[size_t(s.sample(kLogits).id)] += 1.0 / draws;
  return f;
}

struct FilterCase {
  const char* name;
  float temperature;
  int top_k;
  float top_p;
  float min_p;
};

void PrintTo(const FilterCase& c, std::ostream* os) { *os << c.name; }

class SamplerFilters : public ::testing::TestWithParam<FilterCase> {};

// Every kept token is drawn about as often as the reference says, and no other token ever is.
TEST_P(SamplerFilters, DrawsFollowTheFilteredSoftmax) {
  const FilterCase c = GetParam();
  SamplingParams p;
  p.temperature = c.temperature;
  p.top_k = c.top_k;
  p.top_p = c.top_p;
  p.min_p = c.min_p;
  p.seed = 1234;
  const auto want = reference_distribution(kLogits, c.temperature, c.top_k, c.top_p, c.min_p);
  const auto got = frequencies(p, 40000);
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == 0.0) EXPECT_EQ(got[i], 0.0) << c.name << ": token " << i << " is filtered out but was drawn";
    else EXPECT_NEAR(got[i], want[i], 0.012) << c.name << ": token " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sampler, SamplerFilters,
    ::testing::Values(FilterCase{"plain", 1.0f, 0, 1.0f, 0.0f}, FilterCase{"hot", 2.0f, 0, 1.0f, 0.0f},
                      FilterCase{"cold", 0.5f, 0, 1.0f, 0.0f}, FilterCase{"top_k3", 1.0f, 3, 1.0f, 0.0f},
                      FilterCase{"top_p0.7", 1.0f, 0, 0.7f, 0.0f}, FilterCase{"min_p0.3", 1.0f, 0, 1.0f, 0.3f},
                      FilterCase{"all", 1.5f, 5, 0.9f, 0.05f}),
    [](const auto& info) {
      std::string n = info.param.name;
      std::replace(n.begin(), n.end(), '.', '_');
      return n;
    });

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  // Probabilities at t=1: token 1 ~0.33, 5 ~0.30, 3 ~0.20: top_p 0.5 keeps exactly {1, 5}.
  const auto q = reference_distribution(kLogits, 1.0, 0, 0.5, 0.0);
  std::set<int32_t> want;
  for (size_t i = 0; i < q.size(); ++i)
    if (q[i] > 0) want.insert(int32_t(i));
  ASSERT_EQ(want, (std::set<int32_t>{1, 5}));
  SamplingParams p;
  p.top_p = 0.5f;
  std::set<int32_t> got;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    p.seed = seed;
    got.insert(Sampler(p, {}).sample(kLogits).id);
  }
  EXPECT_EQ(got, want);
}

TEST(Sampler, GreedyTakesTheArgmaxAfterPenalties) {
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(Sampler(p, {}).sample(kLogits).id, 1);
  // Token 1 in the prompt: a repetition penalty of 1.5 gives 3/1.5 = 2, below 2.9 (token 5).
  p.repetition_penalty = 1.5f;
  const std::vector<int32_t> prompt = {1};
  EXPECT_EQ(Sampler(p, prompt).sample(kLogits).id, 5);
  // top_k 1 is greedy too, whatever the temperature.
  SamplingParams k1;
  k1.top_k = 1;
  k1.temperature = 5;
  EXPECT_EQ(Sampler(k1, {}).sample(kLogits).id, 1);
}

TEST(Sampler, PenaltiesFollowTheOpenAIAndVllmFormulas) {
  SamplingParams p;
  p.repetition_penalty = 1.3f;
  p.frequency_penalty = 0.4f;
  p.presence_penalty = 0.25f;
  const std::vector<int32_t> prompt = {0, 2};  // sorted, unique
  const std::unordered_map<int32_t, int32_t> out = {{2, 3}, {3, 1}, {6, 2}};
  std::vector<float> got = kLogits;
  apply_penalties(got, p, prompt, out);
  for (size_t i = 0; i < kLogits.size(); ++i) {
    double want = kLogits[i];
    const bool in_prompt = i == 0 || i == 2;
    const int count = out.count(int32_t(i)) ? out.at(int32_t(i)) : 0;
    // repetition (CTRL, as vLLM): divide positive logits, multiply negative ones, for tokens seen anywhere
    if (in_prompt || count > 0) want = want > 0 ? want / 1.3 : want * 1.3;
    // OpenAI: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence, over generated tokens only
    want -= count * 0.4 + (count > 0 ? 0.25 : 0.0);
    EXPECT_NEAR(got[i], want, 1e-6) << "token " << i;
  }
}

TEST(Sampler, AcceptedTokensArePenalized) {
  SamplingParams p;
  p.temperature = 0;
  p.presence_penalty = 0.5f;  // 3.0 - 0.5 = 2.5 < 2.9
  Sampler s(p, {});
  EXPECT_EQ(s.sample(kLogits).id, 1);
  s.accept(1);
  EXPECT_EQ(s.sample(kLogits).id, 5);
}

TEST(Sampler, SameSeedSameTokensOtherSeedOtherTokens) {
  const std::vector<float> flat(64, 0.0f);
  auto draw = [&](uint64_t seed) {
    SamplingParams p;
    p.seed = seed;
    Sampler s(p, {});
    std::vector<int32_t> ids;
    for (int i = 0; i < 50; ++i) ids.push_back(s.sample(flat).id);
    return ids;
  };
  EXPECT_EQ(draw(42), draw(42));
  EXPECT_NE(draw(42), draw(43));
}

TEST(Sampler, LogprobsAreThoseOfTheRawLogits) {
  double lse = 0;
  for (float l : kLogits) lse += std::exp(double(l));
  lse = std::log(lse);
  SamplingParams p;
  p.temperature = 0.3f;        // neither temperature
  p.frequency_penalty = 1.0f;  // nor penalties change what the model thinks
  p.top_logprobs = 3;
  const Sampled s = Sampler(p, {}).sample(kLogits);
  EXPECT_NEAR(s.logprob, kLogits[size_t(s.id)] - lse, 1e-5);
  ASSERT_EQ(s.top.size(), 3u);
  const int32_t want_ids[] = {1, 5, 3};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(s.top[size_t(i)].id, want_ids[i]);
    EXPECT_NEAR(s.top[size_t(i)].logprob, kLogits[size_t(want_ids[i])] - lse, 1e-5);
  }
  // Without a request for them, none are computed.
  SamplingParams none;
  EXPECT_TRUE(Sampler(none, {}).sample(kLogits).top.empty());
  EXPECT_NEAR(log_softmax_at(kLogits, 2), -2.0 - lse, 1e-5);
}

TEST(Sampler, UniformDrawsStayInTheUnitInterval) {
  std::mt19937_64 rng(7);
  double lo = 1, hi = 0, sum = 0;
  for (int i = 0; i < 100000; ++i) {
    const double u = uniform01(rng);
    lo = std::min(lo, u);
    hi = std::max(hi, u);
    sum += u;
  }
  EXPECT_GE(lo, 0.0);
  EXPECT_LT(hi, 1.0);
  EXPECT_NEAR(sum / 100000, 0.5, 0.01);
}

TEST(Sampler, NonFiniteLogitsStillGiveAToken) {
  std::vector<float> bad(8, -INFINITY);
  bad[3] = NAN;
  SamplingParams p;
  const Sampled s = Sampler(p, {}).sample(bad);
  EXPECT_GE(s.id, 0);
  EXPECT_LT(s.id, 8);
}

}  // namespace
}  // namespace sparsemla::engine
