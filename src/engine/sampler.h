// Turns one row of logits into the next token, per request: penalties, temperature, min-p, top-k,
// top-p, then a draw from the request's own random generator, so that a seeded request samples the
// same tokens whether it runs alone or batched with others.
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <unordered_map>
#include <vector>

namespace sparsemla::engine {

struct SamplingParams {
  float temperature = 1.0f;         // 0: greedy
  float top_p = 1.0f;               // (0, 1]; 1: off
  int32_t top_k = 0;                // <= 0: off
  float min_p = 0.0f;               // [0, 1]; 0: off
  float presence_penalty = 0.0f;    // OpenAI: minus this once for every token already generated
  float frequency_penalty = 0.0f;   // OpenAI: minus this times the token's count in the output
  float repetition_penalty = 1.0f;  // CTRL / vLLM: tokens of prompt or output, logit / p if > 0, else * p
  uint64_t seed = 0;
  int32_t top_logprobs = -1;  // -1: no logprobs; k >= 0: the chosen token's and the k best
};

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0.0f;
};

// What was sampled, with the model's log-probabilities when asked for: log-softmax of the raw logits,
// before penalties and temperature (what the model thinks, whatever the sampling settings).
struct Sampled {
  int32_t id = 0;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;  // the top_logprobs best, most likely first
};

class Sampler {
 public:
  Sampler(const SamplingParams& params, std::span<const int32_t> prompt);

  // `logits` is the model's row ([n_vocab]); it is not modified.
  Sampled sample(std::span<const float> logits);
  // Records a generated token for the penalties (sample() does not: the caller decides what counts).
  void accept(int32_t id);
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int32_t> prompt_ids_;                 // sorted, unique: for the repetition penalty
  std::unordered_map<int32_t, int32_t> out_count_;  // generated token -> times
  std::vector<float> work_;                         // [n_vocab] penalized logits
  std::vector<int32_t> order_;                      // candidate ids
};

// The penalized logits (in place): repetition on prompt and output tokens, then frequency and
// presence on output tokens, as vLLM applies them.
void apply_penalties(std::span<float> logits, const SamplingParams& p, std::span<const int32_t> prompt_ids,
                     const std::unordered_map<int32_t, int32_t>& out_count);

// The filters of a sampled (not greedy) draw, as Sampler::sample() applies them: `work` holds the
// penalized logits on entry and each token's probability at the temperature relative to the most
// likely token's (which is 1) on return; `order` receives the ids that survive min-p, top-k and
// top-p, most likely first when top-k or top-p sorted them, else in id order. Empty only with
// non-finite logits. (The GPU sampler is tested against it.)
void filter_candidates(std::span<float> work, const SamplingParams& p, std::vector<int32_t>& order);

// log-softmax of `logits` at `id`, and the `k` most likely ids with theirs.
float log_softmax_at(std::span<const float> logits, int32_t id);
std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, int32_t k);

// A uniform double in [0, 1) from 53 bits of the generator: the same on every platform, unlike
// std::uniform_real_distribution.
double uniform01(std::mt19937_64& rng);

}  // namespace sparsemla::engine
