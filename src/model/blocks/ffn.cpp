#include "model/blocks/ffn.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/cpu/basic.h"
#include "ops/cpu/matmul.h"
#include "util/error.h"

namespace sparsemla::model {

void mlp_forward(const Weight& gate, const Weight& up, const Weight& down, const float* y, int64_t T, float* out,
                 ops::ThreadPool& pool) {
  const int64_t F = gate.n_rows;
  std::vector<float> g(size_t(T * F)), u(size_t(T * F));
  ops::matmul(gate, y, T, g.data(), pool);
  ops::matmul(up, y, T, u.data(), pool);
  ops::silu_mul(g.data(), u.data(), T * F);
  ops::matmul(down, g.data(), T, out, pool);
}

Routing route(const HParams& hp, const float* logits, const float* bias) {
  const int64_t E = hp.n_expert;
  std::vector<float> scores(logits, logits + E);
  if (hp.expert_gating == 2) {
    for (float& s : scores) s = ops::sigmoid(s);
  } else {
    ops::softmax(scores.data(), E);
  }
  std::vector<float> choice(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) choice[size_t(e)] = scores[size_t(e)] + bias[e];

  // Group-limited choice: keep the topk_group groups with the best group scores (sum of the two
  // best choice scores for sigmoid routers, the best one for softmax routers).
  const int64_t G = hp.n_expert_groups, per = E / G;
  if (G > 1 && hp.n_group_used < G) {
    std::vector<float> gscore(static_cast<size_t>(G));
    for (int64_t g = 0; g < G; ++g) {
      std::vector<float> c(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      std::sort(c.begin(), c.end(), std::greater<float>());
      gscore[size_t(g)] = hp.expert_gating == 2 ? c[0] + (per > 1 ? c[1] : 0.0f) : c[0];
    }
    const auto keep = ops::top_k(gscore.data(), G, hp.n_group_used);
    std::vector<bool> kept(size_t(G), false);
    for (int32_t g : keep) kept[size_t(g)] = true;
    for (int64_t e = 0; e < E; ++e)
      if (!kept[size_t(e / per)]) choice[size_t(e)] = -std::numeric_limits<float>::infinity();
  }
  Routing r;
  r.experts = ops::top_k(choice.data(), E, hp.n_expert_used);
  float sum = 0.0f;
  for (int32_t e : r.experts) {
    r.weights.push_back(scores[size_t(e)]);
    sum += scores[size_t(e)];
  }
  for (float& wgt : r.weights) {
    if (hp.expert_weights_norm) wgt /= sum + 1e-20f;
    wgt *= hp.expert_weights_scale;
  }
  return r;
}

void moe_forward(const FfnWeights& w, const HParams& hp, const float* y, int64_t T, float* out, ops::ThreadPool& pool,
                 ExpertRange experts, const std::vector<Routing>* forced, std::vector<Routing>* chosen) {
  const int64_t H = hp.n_embd, E = hp.n_expert, Fe = hp.n_ff_exp;
  const int64_t e0 = experts.first, e1 = experts.count < 0 ? E : experts.first + experts.count;
  if (e0 < 0 || e1 > E || e0 > e1) fail("moe_forward: experts [{}, {}) out of range (the model has {})", e0, e1, E);
  // Router logits in fp32.   [T, E]
  std::vector<float> logits(size_t(T * E));
  ops::matmul(w.gate_inp, y, T, logits.data(), pool);
  std::vector<std::vector<std::pair<int64_t, float>>> by_expert(static_cast<size_t>(E));  // (token, weight)
  if (forced && forced->size() != size_t(T)) fail("moe_forward: forced routing for {} tokens, {} given", forced->size(), T);
  if (chosen) chosen->resize(size_t(T));
  for (int64_t t = 0; t < T; ++t) {
    const Routing r = forced ? (*forced)[size_t(t)] : route(hp, logits.data() + t * E, w.exp_probs_b.data());
    if (chosen) (*chosen)[size_t(t)] = r;
    for (size_t i = 0; i < r.experts.size(); ++i) {
      if (r.experts[i] < 0 || r.experts[i] >= E) fail("moe_forward: token {} is routed to expert {} of {}", t, r.experts[i], E);
      by_expert[size_t(r.experts[i])].emplace_back(t, r.weights[i]);
    }
  }

  // Shared experts over every token, then each routed expert over the tokens routed to it.
  if (w.gate_shexp.data) mlp_forward(w.gate_shexp, w.up_shexp, w.down_shexp, y, T, out, pool);
  else std::fill(out, out + T * H, 0.0f);

  std::vector<float> ye, oe;
  for (int64_t e = e0; e < e1; ++e) {
    const auto& routed = by_expert[size_t(e)];
    if (routed.empty()) continue;
    const int64_t n = int64_t(routed.size());
    ye.resize(size_t(n * H));
    oe.resize(size_t(n * H));
    for (int64_t i = 0; i < n; ++i) std::copy_n(y + routed[size_t(i)].first * H, H, ye.data() + i * H);
    const int64_t local = e - e0;  // index into this range's weights
    mlp_forward(w.gate_exps.rows(local * Fe, Fe), w.up_exps.rows(local * Fe, Fe), w.down_exps.rows(local * H, H),
                ye.data(), n, oe.data(), pool);
    for (int64_t i = 0; i < n; ++i) {
      float* dst = out + routed[size_t(i)].first * H;
      const float wgt = routed[size_t(i)].second;
      for (int64_t c = 0; c < H; ++c) dst[c] += wgt * oe[size_t(i * H + c)];
    }
  }
}

}  // namespace sparsemla::model
