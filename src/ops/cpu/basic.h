// Small CPU operations of the forward pass, on fp32 rows.
#pragma once
#include <cstdint>
#include <vector>

namespace sparsemla::ops {

// out = x / sqrt(mean(x^2) + eps) * w, computed in fp32 as the reference does.   x, out: [n]
void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out);
// out = (x - mean) / sqrt(var + eps) * w + b   (biased variance, as torch.nn.LayerNorm)
void layer_norm(const float* x, const float* w, const float* b, int64_t n, float eps, float* out);
// gate[i] = silu(gate[i]) * up[i]
void silu_mul(float* gate, const float* up, int64_t n);
// In-place softmax over n values (max-subtracted).
void softmax(float* x, int64_t n);
inline float sigmoid(float x) { return 1.0f / (1.0f + __builtin_expf(-x)); }

// Indices of the k largest values of x[0..n), largest first; ties keep the lower index first.
std::vector<int32_t> top_k(const float* x, int64_t n, int64_t k);

}  // namespace sparsemla::ops
