#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace sparsemla::engine {

double uniform01(std::mt19937_64& rng) { return double(rng() >> 11) * 0x1.0p-53; }

void apply_penalties(std::span<float> logits, const SamplingParams& p, std::span<const int32_t> prompt_ids,
                     const std::unordered_map<int32_t, int32_t>& out_count) {
  const int64_t n = int64_t(logits.size());
  auto in_range = [n](int32_t id) { return id >= 0 && id < n; };
  if (p.repetition_penalty != 1.0f) {
    auto penalize = [&](int32_t id) {
      float& l = logits[size_t(id)];
      l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
    };
    for (int32_t id : prompt_ids)
      if (in_range(id)) penalize(id);
    for (const auto& [id, count] : out_count)
      if (in_range(id) && !std::binary_search(prompt_ids.begin(), prompt_ids.end(), id)) penalize(id);
  }
  if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f)
    for (const auto& [id, count] : out_count)
      if (in_range(id)) logits[size_t(id)] -= p.frequency_penalty * float(count) + p.presence_penalty;
}

namespace {

int32_t argmax(std::span<const float> x) {
  size_t best = 0;
  for (size_t i = 1; i < x.size(); ++i)
    if (x[i] > x[best]) best = i;
  return int32_t(best);
}

double log_sum_exp(std::span<const float> x) {
  const float m = *std::max_element(x.begin(), x.end());
  double s = 0;
  for (float v : x) s += std::exp(double(v) - m);
  return double(m) + std::log(s);
}

}  // namespace

float log_softmax_at(std::span<const float> logits, int32_t id) {
  return float(double(logits[size_t(id)]) - log_sum_exp(logits));
}

std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, int32_t k) {
  const double lse = log_sum_exp(logits);
  std::vector<int32_t> ids(logits.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i);
  const size_t kk = std::min(ids.size(), size_t(std::max(k, 0)));
  std::partial_sort(ids.begin(), ids.begin() + int64_t(kk), ids.end(), [&](int32_t a, int32_t b) {
    return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
  });
  std::vector<TokenLogprob> out;
  for (size_t i = 0; i < kk; ++i) out.push_back({ids[i], float(double(logits[size_t(ids[i])]) - lse)});
  return out;
}

void filter_candidates(std::span<float> work, const SamplingParams& p, std::vector<int32_t>& order) {
  // Probabilities at the temperature, unnormalized (relative to the most likely token).
  const float inv_t = 1.0f / p.temperature;
  const float top = *std::max_element(work.begin(), work.end());
  for (float& v : work) v = std::exp((v - top) * inv_t);  // the best token has 1
  order.clear();
  // min-p: a floor relative to the most likely token's probability, which is 1 here.
  for (size_t i = 0; i < work.size(); ++i)
    if (work[i] >= p.min_p && work[i] > 0.0f) order.push_back(int32_t(i));
  auto more_likely = [&](int32_t a, int32_t b) {
    return work[size_t(a)] > work[size_t(b)] || (work[size_t(a)] == work[size_t(b)] && a < b);
  };
  if (p.top_k > 0 && size_t(p.top_k) < order.size()) {
    std::partial_sort(order.begin(), order.begin() + p.top_k, order.end(), more_likely);
    order.resize(size_t(p.top_k));
  } else if (p.top_p < 1.0f) {  // (partial_sort above leaves its k sorted)
    std::sort(order.begin(), order.end(), more_likely);
  }
  if (p.top_p < 1.0f) {
    double total = 0;
    for (int32_t id : order) total += work[size_t(id)];
    // The smallest set of most likely tokens whose probability reaches top_p.
    double cum = 0;
    size_t keep = 0;
    while (keep < order.size()) {
      cum += work[size_t(order[keep++])];
      if (cum >= p.top_p * total) break;
    }
    order.resize(keep);
  }
}

Sampler::Sampler(const SamplingParams& params, std::span<const int32_t> prompt)
    : params_(params), rng_(params.seed), prompt_ids_(prompt.begin(), prompt.end()) {
  std::sort(prompt_ids_.begin(), prompt_ids_.end());
  prompt_ids_.erase(std::unique(prompt_ids_.begin(), prompt_ids_.end()), prompt_ids_.end());
}

void Sampler::accept(int32_t id) { ++out_count_[id]; }

Sampled Sampler::sample(std::span<const float> logits) {
  Sampled out;
  work_.assign(logits.begin(), logits.end());
  apply_penalties(work_, params_, prompt_ids_, out_count_);

  if (params_.temperature <= 0.0f || params_.top_k == 1) {
    out.id = argmax(work_);
  } else {
    filter_candidates(work_, params_, order_);
    if (order_.empty()) order_.push_back(argmax(logits));  // only with non-finite logits
    double total = 0;
    for (int32_t id : order_) total += work_[size_t(id)];
    const double u = uniform01(rng_) * total;
    double cum = 0;
    out.id = order_.back();
    for (int32_t id : order_) {
      cum += work_[size_t(id)];
      if (u < cum) {
        out.id = id;
        break;
      }
    }
  }
  if (params_.top_logprobs >= 0) {
    out.logprob = log_softmax_at(logits, out.id);
    out.top = top_logprobs(logits, params_.top_logprobs);
  }
  return out;
}

}  // namespace sparsemla::engine
