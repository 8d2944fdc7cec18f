// Rotary position embedding: frequencies (plain or YaRN, as transformers computes them) and the
// two pairings used by this model family.
#pragma once
#include <cstdint>
#include <vector>

namespace sparsemla::model {
struct HParams;
}

namespace sparsemla::ops {

enum class RopeStyle {
  Interleaved,  // pairs (x0,x1), (x2,x3), ...  (ggml's "normal" mode)
  HalfSplit,    // pairs (x_i, x_{i+d/2})       (NeoX / rotate_half)
};

class Rope {
 public:
  Rope() = default;
  // Frequencies for `dims` rotary dims from the model's theta and scaling.
  explicit Rope(const model::HParams& hp);
  int64_t dims() const { return int64_t(inv_freq_.size()) * 2; }
  // Rotates x[0..dims) in place for position `pos`.
  void apply(float* x, int64_t pos, RopeStyle style) const;
  const std::vector<float>& inv_freq() const { return inv_freq_; }
  float attn_factor() const { return attn_factor_; }

 private:
  std::vector<float> inv_freq_;  // [dims / 2]
  float attn_factor_ = 1.0f;     // multiplies cos and sin (YaRN's attention_factor)
};

}  // namespace sparsemla::ops
