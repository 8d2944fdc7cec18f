// The MoE router cases that the GPU router tests (test_cuda_small_ops.cpp, on a GPU) and the host
// emulation's (test_small_ops_host.cpp, the same kernels on the host) both run: the routers and the
// logits they are given. Each test passes its own check, which routes on its side and compares
// against model::route().
#pragma once
#include <cstdint>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "model/hparams.h"
#include "test_util.h"

namespace sparsemla::test {

struct RouterCase {
  std::string name;
  uint32_t experts, used, groups, groups_used, gating;
};

// GLM-5 and DeepSeek-V3.2 as published, the fixtures' small routers (tests/fixtures/README.md), and
// a softmax router with groups (DeepSeek-V2's gating).
inline const std::vector<RouterCase>& router_cases() {
  static const std::vector<RouterCase> cases = {
      {"glm5", 256, 8, 1, 1, 2},    {"deepseek_v32", 256, 8, 8, 4, 2}, {"glm_pub", 8, 2, 1, 1, 2},
      {"dsv32_pub", 8, 2, 2, 1, 2}, {"dsv32_groups", 8, 4, 4, 2, 2},   {"softmax_groups", 64, 6, 8, 3, 1},
  };
  return cases;
}

inline model::HParams router_params(const RouterCase& c) {
  model::HParams hp;
  hp.n_expert = c.experts;
  hp.n_expert_used = c.used;
  hp.n_expert_groups = c.groups;
  hp.n_group_used = c.groups_used;
  hp.expert_gating = c.gating;
  hp.expert_weights_norm = c.gating == 2;
  hp.expert_weights_scale = c.gating == 2 ? 2.5f : 1.0f;
  return hp;
}

// check(case, hp, logits, bias, T, what) for every router and token count on random logits
// (N(0, 2)) and biases (N(0, 0.1)).
template <class Check>
void for_random_router_logits(std::initializer_list<int64_t> token_counts, Check&& check) {
  for (const RouterCase& c : router_cases())
    for (int64_t T : token_counts) {
      const auto logits = randn(size_t(T * c.experts), uint32_t(T * 101 + c.experts), 2.0f, 0.0f);
      const auto bias = randn(c.experts, uint32_t(c.experts + 77), 0.1f);
      check(c, router_params(c), logits, bias, T, c.name + " T=" + std::to_string(T));
    }
}

// check(...) as above on logits and biases from a handful of values, so that scores, group scores
// and choices tie everywhere (the lower id and lower group must win every tie, as on the CPU), and
// on logits that are all equal (every router takes its first k experts); T tokens each.
template <class Check>
void for_tied_router_logits(int64_t T, Check&& check) {
  std::mt19937 rng(42);
  for (const RouterCase& c : router_cases())
    for (bool with_bias : {false, true}) {
      const model::HParams hp = router_params(c);
      std::vector<float> logits(size_t(T * c.experts)), bias(c.experts, 0.0f);
      for (float& l : logits) l = float(int(rng() % 3)) - 1.0f;
      if (with_bias)
        for (float& b : bias) b = 0.25f * float(int(rng() % 2));
      check(c, hp, logits, bias, T, c.name + " tied" + (with_bias ? " with bias" : ""));
      const std::vector<float> flat(size_t(T * c.experts), 0.5f);
      check(c, hp, flat, std::vector<float>(c.experts, 0.0f), T, c.name + " all equal");
    }
}

}  // namespace sparsemla::test
