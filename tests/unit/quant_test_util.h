// Test helpers for quantized weights and int8 activations on the host, shared by the CUDA
// product tests (test_cuda_matmul.cpp) and the absorption tests (test_cuda_attention.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/quants.h"
#include "ops/cuda/quant_matmul_q8.h"
#include "test_util.h"
#include "util/half.h"

namespace sparsemla::cuda::test_q8 {

using gguf::GgmlType;
using ::sparsemla::test::randn;

inline void put_fp16(uint8_t* p, float v) {
  const uint16_t h = f32_to_fp16(v);
  std::memcpy(p, &h, 2);
}

// Weight bytes of n_rows x n_cols: the formats the project can write are quantized from N(0, 1)
// rows; the others are random bytes (every grid index and sign pattern is valid) with their fp16
// scales (or MXFP4's exponent) replaced by small finite values.
inline std::vector<uint8_t> make_weight(GgmlType t, int64_t n_rows, int64_t n_cols, uint32_t seed) {
  const auto& tr = gguf::traits(t);
  const uint64_t rb = gguf::row_bytes(t, uint64_t(n_cols));
  std::vector<uint8_t> w(size_t(rb * n_rows));
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: case GgmlType::Q8_0: case GgmlType::Q4_0:
    case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K: {
      const std::vector<float> x = randn(size_t(n_rows * n_cols), seed);
      for (int64_t r = 0; r < n_rows; ++r) gguf::quantize_row(t, x.data() + r * n_cols, w.data() + r * rb, n_cols);
      return w;
    }
    default: break;
  }
  std::mt19937 rng(seed);
  for (uint8_t& b : w) b = uint8_t(rng());
  std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
  std::vector<int> fp16_at;  // offsets of fp16 scales within a block
  switch (t) {
    case GgmlType::Q2_K: fp16_at = {80, 82}; break;
    case GgmlType::Q3_K: fp16_at = {108}; break;
    case GgmlType::IQ4_NL: case GgmlType::IQ4_XS: case GgmlType::IQ2_XXS: case GgmlType::IQ2_XS:
    case GgmlType::IQ2_S: case GgmlType::IQ3_XXS: case GgmlType::IQ3_S: case GgmlType::IQ1_S: fp16_at = {0}; break;
    default: break;
  }
  for (size_t at = 0; at < w.size(); at += tr.type_size) {
    uint8_t* blk = w.data() + at;
    for (int o : fp16_at) put_fp16(blk + o, scale(rng));
    if (t == GgmlType::MXFP4) blk[0] = uint8_t(120 + rng() % 10);
    if (t == GgmlType::IQ1_M) {  // fp16 d in the top nibbles of the four u16 scales
      const uint16_t d = f32_to_fp16(scale(rng));
      for (int k = 0; k < 4; ++k) blk[49 + 2 * k] = uint8_t((blk[49 + 2 * k] & 0x0F) | (((d >> (4 * k)) & 0xF) << 4));
    }
  }
  return w;
}

// The CPU side of quantize_activations, with the same rule: per block of 32, d = max|x| / 127
// (float division), q = clamp(round-half-even(x / d), -127, 127), or 0 when d == 0; with two
// levels also s = d / 254, r = clamp(round-half-even(fma(-d, q, x) / s), -127, 127) (0 when s is 0),
// the block's scale s and its sum over 254 q + r.
struct HostQ8 {
  int levels = 1;
  std::vector<int8_t> q;    // [T][n_cols]
  std::vector<int8_t> r;    // [T][n_cols], two levels
  std::vector<float> d;     // [T][n_cols / 32]: the block's scale
  std::vector<int32_t> sum; // [T][n_cols / 32]
};

inline HostQ8 quantize_on_host(const std::vector<float>& x, int levels = 1) {
  HostQ8 h;
  h.levels = levels;
  const size_t nb = x.size() / 32;
  h.q.resize(x.size());
  if (levels == 2) h.r.resize(x.size());
  h.d.resize(nb);
  h.sum.resize(nb);
  for (size_t b = 0; b < nb; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    const float d = amax / 127.0f, d2 = d / float(kQ8LevelRatio);
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) {
      const float v = x[b * 32 + i];
      const int q = d == 0.0f ? 0 : std::clamp(int(std::nearbyint(v / d)), -127, 127);
      h.q[b * 32 + i] = int8_t(q);
      if (levels == 2) {
        const float e = std::fma(-d, float(q), v);
        const int r = d2 == 0.0f ? 0 : std::clamp(int(std::nearbyint(e / d2)), -127, 127);
        h.r[b * 32 + i] = int8_t(r);
        s += kQ8LevelRatio * q + r;
      } else {
        s += q;
      }
    }
    h.d[b] = levels == 2 ? d2 : d;
    h.sum[b] = s;
  }
  return h;
}

inline std::vector<double> dequantized(const HostQ8& h) {
  std::vector<double> v(h.q.size());
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = double(h.d[i / 32]) * (h.levels == 2 ? double(kQ8LevelRatio) * h.q[i] + h.r[i] : double(h.q[i]));
  return v;
}

}  // namespace sparsemla::cuda::test_q8
