#include "ops/cpu/rope.h"

#include <algorithm>
#include <cmath>

#include "model/hparams.h"

namespace sparsemla::ops {

namespace {
// YaRN's correction dimension: the rotary dim whose wavelength fits `rotations` times in the
// original context (Peng et al. 2023; transformers' find_correction_dim).
double correction_dim(double rotations, double dim, double base, double orig_ctx) {
  return dim * std::log(orig_ctx / (rotations * 2.0 * M_PI)) / (2.0 * std::log(base));
}
}  // namespace

Rope::Rope(const model::HParams& hp) {
  const int64_t dim = hp.qk_rope;
  const double base = hp.rope_theta;
  inv_freq_.resize(size_t(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    // transformers computes base ** (2i / dim) in float32
    const float pos_freq = std::pow(float(base), float(2 * i) / float(dim));
    inv_freq_[size_t(i)] = 1.0f / pos_freq;
  }
  if (hp.rope_scaling == model::RopeScaling::Linear) {
    for (float& f : inv_freq_) f /= hp.rope_factor;
  } else if (hp.rope_scaling == model::RopeScaling::Yarn && hp.rope_factor > 1.0f) {
    const double factor = hp.rope_factor;
    const double orig = hp.rope_orig_ctx ? hp.rope_orig_ctx : hp.n_ctx_train;
    double low = std::floor(correction_dim(hp.yarn_beta_fast, double(dim), base, orig));
    double high = std::ceil(correction_dim(hp.yarn_beta_slow, double(dim), base, orig));
    low = std::max(low, 0.0);
    high = std::min(high, double(dim - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < dim / 2; ++i) {
      const float extrapolation = inv_freq_[size_t(i)];
      const float interpolation = float(extrapolation / factor);
      const float ramp = float(std::clamp((double(i) - low) / (high - low), 0.0, 1.0));
      const float extrapolation_weight = 1.0f - ramp;
      inv_freq_[size_t(i)] = interpolation * (1.0f - extrapolation_weight) + extrapolation * extrapolation_weight;
    }
    // DeepSeek's configs set mscale == mscale_all_dim, which makes transformers' attention_factor
    // 1: the magnitude correction lives in the softmax scale (HParams::softmax_scale) instead.
    attn_factor_ = 1.0f;
  }
}

void Rope::apply(float* x, int64_t pos, RopeStyle style) const {
  const int64_t half = int64_t(inv_freq_.size());
  for (int64_t i = 0; i < half; ++i) {
    const float angle = float(pos) * inv_freq_[size_t(i)];
    const float c = std::cos(angle) * attn_factor_;
    const float s = std::sin(angle) * attn_factor_;
    const int64_t a = style == RopeStyle::Interleaved ? 2 * i : i;
    const int64_t b = style == RopeStyle::Interleaved ? 2 * i + 1 : i + half;
    const float x0 = x[a], x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x0 * s + x1 * c;
  }
}

}  // namespace sparsemla::ops
