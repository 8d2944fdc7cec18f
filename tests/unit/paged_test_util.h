// Inputs of the attention and indexer tests, on the GPU (test_cuda_attention.cpp, which adds the
// tables' device copy) and in the host emulation: Gaussian vectors, and sequences over a paged
// cache with shuffled blocks. Host code only.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace sparsemla::cuda::test_paged {

inline std::vector<float> random_vec(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The power of two index_queries scales a head's fp16 queries by (attention.h), computed here
// independently of the kernels' q_factor: 2^(12 - e) for the row's largest magnitude in
// [2^e, 2^(e+1)), e within [-64, 64]; 1 for a row of zeros.
inline float fp16_query_factor(const float* row, int dim) {
  float amax = 0.0f;
  for (int i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(row[i]));
  if (amax == 0.0f || !std::isfinite(amax)) return 1.0f;
  return std::ldexp(1.0f, -std::clamp(std::ilogb(amax) - 12, -64, 64));
}

// Position p of sequence s lives at slot(s, p); the block tables are a shuffled permutation.
struct Paged {
  int block_size = 16, max_blocks = 0, n_blocks = 0;
  std::vector<int32_t> tables;  // [n_seq, max_blocks]
  Paged(const std::vector<int>& lens, int bs, std::mt19937& rng) : block_size(bs) {
    for (int len : lens) max_blocks = std::max(max_blocks, (len + bs - 1) / bs);
    max_blocks = std::max(max_blocks, 1);
    n_blocks = int(lens.size()) * max_blocks;
    tables.resize(size_t(n_blocks));
    std::iota(tables.begin(), tables.end(), 0);
    std::shuffle(tables.begin(), tables.end(), rng);
  }
  int64_t slot(int seq, int pos) const {
    return int64_t(tables[size_t(seq * max_blocks + pos / block_size)]) * block_size + pos % block_size;
  }
  int64_t n_slots() const { return int64_t(n_blocks) * block_size; }
};

}  // namespace sparsemla::cuda::test_paged
