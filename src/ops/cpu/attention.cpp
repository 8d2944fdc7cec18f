#include "ops/cpu/attention.h"

#include <algorithm>

#include "ops/cpu/basic.h"

namespace sparsemla::ops {

void latent_attention(const float* q_lat, const float* q_pe, const float* const* rows, int64_t n_rows, int64_t kv_lora,
                      int64_t rope, float scale, float* out, std::vector<float>& logits) {
  logits.resize(size_t(n_rows));
  for (int64_t s = 0; s < n_rows; ++s) {
    const float* row = rows[s];
    float dot = 0.0f;
    for (int64_t c = 0; c < kv_lora; ++c) dot += q_lat[c] * row[c];
    for (int64_t r = 0; r < rope; ++r) dot += q_pe[r] * row[kv_lora + r];
    logits[size_t(s)] = dot * scale;
  }
  softmax(logits.data(), n_rows);
  std::fill(out, out + kv_lora, 0.0f);
  for (int64_t s = 0; s < n_rows; ++s) {
    const float* row = rows[s];
    for (int64_t c = 0; c < kv_lora; ++c) out[c] += logits[size_t(s)] * row[c];
  }
}

}  // namespace sparsemla::ops
