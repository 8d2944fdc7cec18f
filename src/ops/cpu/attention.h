// Attention of one query over latent rows, the CPU reference of the GPU attention kernels.
#pragma once
#include <cstdint>
#include <vector>

namespace sparsemla::ops {

// out[c] = sum_s softmax_s(scale * (q_lat . row_s[0..kv_lora) + q_pe . row_s[kv_lora..))) * row_s[c]
// for c < kv_lora. Rows hold kv_lora + rope values; `logits` is scratch.   out: [kv_lora], overwritten
void latent_attention(const float* q_lat, const float* q_pe, const float* const* rows, int64_t n_rows, int64_t kv_lora,
                      int64_t rope, float scale, float* out, std::vector<float>& logits);

}  // namespace sparsemla::ops
