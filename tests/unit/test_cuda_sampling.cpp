// The GPU sampler against the CPU sampler's logic (engine/sampler.cpp): greedy picks, the tokens the
// filters keep and their probabilities, the frequencies of seeded draws, and the independence of a
// seeded row's draw from its batch neighbours.
//
// Tolerances: the filters must keep exactly the CPU's tokens (the GPU's weights are the CPU's but
// for one ulp on ~0.06% of tokens, where glibc's expf is not correctly rounded, which moves a cut
// only if it falls within that ulp; ties are broken the same way); probabilities agree to 1e-6
// relative (fp32 rounding of a double quotient); draw frequencies pass a chi-square test at a
// bound far above chance (p ~ 1e-6) and far below what a biased sampler gives.
#include <gtest/gtest.h>

#if SPARSEMLA_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "gpu_test_util.h"
#include "test_util.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/sampling.h"

namespace sparsemla::cuda {
namespace {

using test::randn;

// Logits on a grid of 0.5: the best token and the cut points tie with many others.
std::vector<float> tied_logits(size_t n, uint32_t seed) {
  auto v = randn(n, seed, 2.0f);
  for (float& x : v) x = std::round(x * 2.0f) / 2.0f;
  return v;
}

engine::SamplingParams cpu_params(const RowSampling& p) {
  engine::SamplingParams sp;
  sp.temperature = p.temperature;
  sp.top_p = p.top_p;
  sp.top_k = p.top_k;
  sp.min_p = p.min_p;
  sp.seed = p.seed;
  return sp;
}

int32_t cpu_argmax(const float* logits, int64_t V) {
  engine::SamplingParams greedy;
  greedy.temperature = 0.0f;
  engine::Sampler s(greedy, {});
  return s.sample(std::span<const float>(logits, size_t(V))).id;
}

// The distribution the CPU sampler draws from, from its own filter (engine::filter_candidates).
std::vector<double> cpu_distribution(const float* logits, int64_t V, const RowSampling& p) {
  std::vector<double> q(size_t(V), 0.0);
  if (p.temperature <= 0.0f || p.top_k == 1) {
    q[size_t(cpu_argmax(logits, V))] = 1.0;
    return q;
  }
  std::vector<float> work(logits, logits + V);
  std::vector<int32_t> order;
  engine::filter_candidates(work, cpu_params(p), order);
  if (order.empty()) {
    q[size_t(cpu_argmax(logits, V))] = 1.0;
    return q;
  }
  double total = 0;
  for (int32_t id : order) total += work[size_t(id)];
  for (int32_t id : order) q[size_t(id)] = work[size_t(id)] / total;
  return q;
}

std::vector<int32_t> gpu_sample(const std::vector<float>& logits, int64_t V, const std::vector<RowSampling>& params) {
  const int64_t B = int64_t(params.size());
  DeviceBuffer dl = to_device(logits), dp = to_device(params), dids(size_t(B) * 4),
      ws(std::max<size_t>(1, sampling_workspace_bytes(B, V)));
  sample(dl.as<float>(), B, V, dp.as<RowSampling>(), ws.get(), dids.as<int32_t>(), nullptr);
  return to_host<int32_t>(dids, size_t(B));
}

std::vector<float> gpu_probs(const std::vector<float>& logits, int64_t V, const std::vector<RowSampling>& params) {
  const int64_t B = int64_t(params.size());
  DeviceBuffer dl = to_device(logits), dp = to_device(params), dprobs(size_t(B * V) * 4),
      ws(std::max<size_t>(1, sampling_workspace_bytes(B, V)));
  sampling_probs(dl.as<float>(), B, V, dp.as<RowSampling>(), ws.get(), dprobs.as<float>(), nullptr);
  return to_host<float>(dprobs, size_t(B * V));
}

RowSampling row(float temperature, int32_t top_k, float top_p, float min_p, uint64_t seed = 1, uint64_t step = 0) {
  RowSampling p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.seed = seed;
  p.step = step;
  return p;
}

const std::vector<int64_t> kVocabs = {1, 7, 1000, 154880};  // 154880: GLM-5's vocabulary

TEST(CudaSampling, GreedyIsTheCpuArgmaxLowestIdOnTies) {
  SPARSEMLA_REQUIRE_GPU();
  for (int64_t V : kVocabs) {
    const int64_t B = 16;
    std::vector<float> logits;
    std::vector<RowSampling> params;
    for (int64_t b = 0; b < B; ++b) {
      const auto r = b % 2 ? tied_logits(size_t(V), uint32_t(V + b)) : randn(size_t(V), uint32_t(V + b), 3.0f);
      logits.insert(logits.end(), r.begin(), r.end());
      // temperature 0, or top_k 1 at any temperature: both are greedy
      params.push_back(b % 4 < 2 ? row(0.0f, 0, 1.0f, 0.0f) : row(0.8f, 1, 0.9f, 0.1f, uint64_t(b)));
    }
    std::fill(logits.end() - V, logits.end(), 0.25f);  // all equal: id 0
    const auto ids = gpu_sample(logits, V, params);
    for (int64_t b = 0; b < B; ++b)
      EXPECT_EQ(ids[size_t(b)], cpu_argmax(logits.data() + b * V, V)) << "V=" << V << " row " << b;
  }
}

TEST(CudaSampling, TopKOneOrTinyTopPDrawsTheArgmax) {
  SPARSEMLA_REQUIRE_GPU();
  for (int64_t V : kVocabs) {
    std::vector<float> logits;
    std::vector<RowSampling> params;
    for (int b = 0; b < 24; ++b) {
      const uint32_t seed = uint32_t(b * 7 + V);
      const auto r = b % 3 == 2 ? tied_logits(size_t(V), seed) : randn(size_t(V), seed, 2.0f);
      logits.insert(logits.end(), r.begin(), r.end());
      params.push_back(b % 2 ? row(1.0f, 1, 1.0f, 0.0f, uint64_t(b), uint64_t(b))
                             : row(1.2f, 0, 1e-6f, 0.0f, uint64_t(b), uint64_t(b)));
    }
    const auto ids = gpu_sample(logits, V, params);
    for (size_t b = 0; b < params.size(); ++b)
      EXPECT_EQ(ids[b], cpu_argmax(logits.data() + b * size_t(V), V)) << "V=" << V << " row " << b;
  }
}

// Compares sampling_probs with the CPU's filtered distribution, row by row: same kept set, same
// probabilities.
void check_filtered(const std::vector<float>& logits, int64_t V, const std::vector<RowSampling>& params) {
  const auto probs = gpu_probs(logits, V, params);
  for (size_t b = 0; b < params.size(); ++b) {
    const auto want = cpu_distribution(logits.data() + b * size_t(V), V, params[b]);
    const RowSampling& p = params[b];
    const std::string what = "V=" + std::to_string(V) + " row " + std::to_string(b) + " (t " +
                             std::to_string(p.temperature) + ", top_k " + std::to_string(p.top_k) + ", top_p " +
                             std::to_string(p.top_p) + ", min_p " + std::to_string(p.min_p) + ")";
    std::set<int64_t> kept_want, kept_got;
    for (int64_t i = 0; i < V; ++i) {
      if (want[size_t(i)] > 0) kept_want.insert(i);
      if (probs[b * size_t(V) + size_t(i)] > 0) kept_got.insert(i);
    }
    ASSERT_EQ(kept_got, kept_want) << what;
    for (int64_t i : kept_want)
      ASSERT_NEAR(probs[b * size_t(V) + size_t(i)], want[size_t(i)], 1e-6 * want[size_t(i)]) << what << " token " << i;
  }
}

// Temperatures x top-k x top-p x min-p; every 6th combination when not `full`.
std::vector<RowSampling> filter_grid(bool full) {
  std::vector<RowSampling> out;
  int i = 0;
  for (float t : {0.7f, 1.0f, 1.5f})
    for (int32_t k : {0, 3, 40, 5000})
      for (float top_p : {1.0f, 0.95f, 0.6f, 0.05f})
        for (float min_p : {0.0f, 0.02f, 0.2f})
          if (full || i++ % 6 == 0) out.push_back(row(t, k, top_p, min_p));
  return out;
}

TEST(CudaSampling, KeptTokensAndProbabilitiesMatchCpuFilters) {
  SPARSEMLA_REQUIRE_GPU();
  for (int64_t V : kVocabs) {
    // every combination on the small vocabularies, a sample of them on the large one
    const auto grid = filter_grid(V <= 1000);
    for (bool ties : {false, true}) {
      std::vector<float> logits;
      for (size_t b = 0; b < grid.size(); ++b) {
        const auto r = ties ? tied_logits(size_t(V), uint32_t(b + 5 * V)) : randn(size_t(V), uint32_t(b + 3 * V), 2.5f);
        logits.insert(logits.end(), r.begin(), r.end());
      }
      check_filtered(logits, V, grid);
    }
  }
}

TEST(CudaSampling, FilterEdgeCases) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t V = 10;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits;
  std::vector<RowSampling> params;
  auto add = [&](std::vector<float> l, RowSampling p) {
    logits.insert(logits.end(), l.begin(), l.end());
    params.push_back(p);
  };
  const std::vector<float> equal(size_t(V), 1.0f);
  add(equal, row(1.0f, 0, 0.3f, 0.0f));   // ties: top-p keeps the 4 lowest ids (3.0000001 of 10)
  add(equal, row(1.0f, 0, 0.5f, 0.0f));   // exactly half: 5
  add(equal, row(1.0f, 4, 1.0f, 0.0f));   // top-k through a tie: the 4 lowest ids
  add(equal, row(1.0f, 0, 1.0f, 1.0f));   // min-p 1 keeps every token tied with the best
  add({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, row(1.0f, 0, 1.0f, 1.0f));  // min-p 1: only the best
  add({-inf, 2, -inf, 2, 1, -inf, 0, 0, 0, -inf}, row(0.9f, 0, 1.0f, 0.0f));  // masked tokens never kept
  add(std::vector<float>(size_t(V), -inf), row(1.0f, 0, 0.9f, 0.0f));           // nothing finite: argmax (0)
  add({3, 1, 3, 2, 2, 0, 1, 3, 2, 1}, row(1.0f, 5, 0.7f, 0.1f));               // all three filters on ties
  add({3, 1, 3, 2, 2, 0, 1, 3, 2, 1}, row(1.0f, 20, 0.0f, 0.0f));              // top_p 0: the best one
  check_filtered(logits, V, params);
}

// Chi-square of the counts of draws against the CPU's filtered distribution, bins with fewer than 5
// expected draws pooled. Tokens the filters drop must never be drawn.
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& q, int64_t n, int* df) {
  double chi2 = 0, pooled_count = 0, pooled_expect = 0;
  *df = -1;
  for (size_t i = 0; i < q.size(); ++i) {
    const double e = q[i] * double(n);
    if (q[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " is filtered out but was drawn";
      continue;
    }
    if (e < 5) {
      pooled_count += double(counts[i]);
      pooled_expect += e;
      continue;
    }
    chi2 += (double(counts[i]) - e) * (double(counts[i]) - e) / e;
    ++*df;
  }
  if (pooled_expect > 0) {
    chi2 += (pooled_count - pooled_expect) * (pooled_count - pooled_expect) / std::max(pooled_expect, 1.0);
    ++*df;
  }
  return chi2;
}

TEST(CudaSampling, DrawFrequenciesFollowTheFilteredSoftmax) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t V = 64, N = 20000;
  const auto logits_row = randn(size_t(V), 2024, 1.5f);
  const std::vector<RowSampling> settings = {row(1.0f, 0, 1.0f, 0.0f), row(0.7f, 10, 1.0f, 0.0f),
                                             row(1.3f, 0, 0.8f, 0.0f), row(1.0f, 20, 0.9f, 0.05f)};
  for (size_t c = 0; c < settings.size(); ++c) {
    std::vector<float> logits;
    std::vector<RowSampling> params;
    for (int64_t r = 0; r < N; ++r) {  // one draw per row: seeds and steps both vary
      logits.insert(logits.end(), logits_row.begin(), logits_row.end());
      RowSampling p = settings[c];
      p.seed = uint64_t(c * 1000003 + size_t(r) / 7);
      p.step = uint64_t(r % 7);
      params.push_back(p);
    }
    const auto ids = gpu_sample(logits, V, params);
    std::vector<int64_t> counts(size_t(V), 0);
    for (int32_t id : ids) {
      ASSERT_TRUE(id >= 0 && id < V) << id;
      ++counts[size_t(id)];
    }
    const auto q = cpu_distribution(logits_row.data(), V, settings[c]);
    int df = 0;
    const double chi2 = chi_square(counts, q, N, &df);
    ASSERT_GE(df, 3) << "setting " << c << ": too few bins for a meaningful test";
    // p ~ 1e-6 under the right distribution; a sampler that always gave the argmax would be far above.
    const double bound = df + 6.0 * std::sqrt(2.0 * df) + 10.0;
    EXPECT_LT(chi2, bound) << "setting " << c << ": df " << df;
    std::vector<int64_t> argmax_only(size_t(V), 0);
    argmax_only[size_t(std::max_element(q.begin(), q.end()) - q.begin())] = N;
    int df_control = 0;
    EXPECT_GT(chi_square(argmax_only, q, N, &df_control), 10 * bound) << "setting " << c << ": the bound is too loose";
  }
}

TEST(CudaSampling, SameSeedAndStepSameTokenWhateverTheBatch) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t V = 1000, steps = 32;
  const auto probe = randn(size_t(V), 77, 2.0f);
  // The probe row alone, once per step.
  std::vector<int32_t> alone;
  for (int64_t s = 0; s < steps; ++s)
    alone.push_back(gpu_sample(probe, V, {row(1.0f, 0, 0.95f, 0.0f, 1234, uint64_t(s))})[0]);
  EXPECT_GE(std::set<int32_t>(alone.begin(), alone.end()).size(), 3u) << "the steps should not all draw one token";

  // The same rows scattered among 100 others of other logits, seeds and settings.
  std::mt19937 rng(5);
  std::vector<float> logits;
  std::vector<RowSampling> params;
  std::vector<size_t> where;
  for (int64_t s = 0, other = 0; s < steps || other < 100;) {
    if (s < steps && (other >= 100 || rng() % 4 == 0)) {
      where.push_back(params.size());
      logits.insert(logits.end(), probe.begin(), probe.end());
      params.push_back(row(1.0f, 0, 0.95f, 0.0f, 1234, uint64_t(s++)));
    } else {
      const auto r = randn(size_t(V), uint32_t(1000 + other), 3.0f);
      logits.insert(logits.end(), r.begin(), r.end());
      const float t = 0.5f + float(rng() % 10) / 10.0f;
      const int32_t k = int32_t(rng() % 50);
      params.push_back(row(t, k, 0.9f, 0.01f, rng(), uint64_t(other++)));
    }
  }
  const auto batched = gpu_sample(logits, V, params);
  for (int64_t s = 0; s < steps; ++s) EXPECT_EQ(batched[where[size_t(s)]], alone[size_t(s)]) << "step " << s;
  EXPECT_EQ(gpu_sample(logits, V, params), batched) << "a second run of the same batch";
}

}  // namespace
}  // namespace sparsemla::cuda

#else

TEST(CudaSampling, Skipped) { GTEST_SKIP() << "built without CUDA"; }

#endif
