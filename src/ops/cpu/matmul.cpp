#include "ops/cpu/matmul.h"

#include <cstring>
#include <vector>

#include "gguf/quants.h"
#include "gguf/reader.h"
#include "util/error.h"
#include "util/half.h"

namespace sparsemla::ops {

Weight Weight::of(const gguf::TensorInfo& t) {
  Weight w;
  w.type = t.type;
  w.n_cols = t.ne[0];
  w.n_rows = t.n_rows();
  w.row_bytes = t.row_bytes();
  w.data = t.data;
  return w;
}

Weight Weight::rows(int64_t first, int64_t count) const {
  if (first < 0 || count < 0 || first + count > n_rows)
    fail("weight rows [{}, {}) out of range (the weight has {} rows)", first, first + count, n_rows);
  Weight w = *this;
  w.data = row(first);
  w.n_rows = count;
  return w;
}

Weight Weight::cols(int64_t first, int64_t count) const {
  const gguf::TypeTraits& tr = gguf::traits(type);
  if (first < 0 || count < 0 || first + count > n_cols)
    fail("weight columns [{}, {}) out of range (the weight has {} columns)", first, first + count, n_cols);
  if (first % tr.block_size != 0 || count % tr.block_size != 0)
    fail("weight columns [{}, {}) cut a {} block of {} values", first, first + count, tr.name, tr.block_size);
  Weight w = *this;
  w.data = data + uint64_t(first / tr.block_size) * tr.type_size;
  w.n_cols = count;
  return w;
}

namespace {

// Dot products with 8 independent partial sums: the compiler keeps them in one vector register
// (strict IEEE order forbids it to reassociate a single running sum).
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += a[i + l] * b[i + l];
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int l = 0; l < 8; ++l) s += lanes[l];
  return s;
}


// Tokens are processed in groups so that each dequantized block is reused across a group while
// it is in L1, and each group's activations stay in cache across the rows of a thread's range.
constexpr int64_t kTokenGroup = 8;

void matmul_rows(const Weight& w, const float* x, int64_t n_tokens, float* y, int64_t r0, int64_t r1) {
  const gguf::TypeTraits& tr = gguf::traits(w.type);
  const int64_t bs = tr.block_size;
  const int64_t n_blocks = w.n_cols / bs;
  if (w.type == gguf::GgmlType::F32) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* wr = reinterpret_cast<const float*>(w.row(r));
      for (int64_t t = 0; t < n_tokens; ++t) {
        y[t * w.n_rows + r] = dot(wr, x + t * w.n_cols, w.n_cols);
      }
    }
    return;
  }
  if (w.type == gguf::GgmlType::Q8_0) {
    // The most common weight type: d * sum(q_i * x_i) per block of 32, each block widened once per
    // token group. Every token's sum is formed in the same order whatever the group size, so a
    // token's result does not depend on what else is in the batch.
    float qf[32];
    float acc[kTokenGroup];
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* wr = w.row(r);
      for (int64_t t0 = 0; t0 < n_tokens; t0 += kTokenGroup) {
        const int64_t nt = std::min(kTokenGroup, n_tokens - t0);
        for (int64_t t = 0; t < nt; ++t) acc[t] = 0.0f;
        for (int64_t b = 0; b < n_blocks; ++b) {
          const uint8_t* blk = wr + b * 34;  // fp16 d, int8 q[32]
          const float d = fp16_to_f32(uint16_t(blk[0] | (blk[1] << 8)));
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
          for (int i = 0; i < 32; ++i) qf[i] = float(q[i]);
          for (int64_t t = 0; t < nt; ++t) acc[t] += d * dot(qf, x + (t0 + t) * w.n_cols + b * 32, 32);
        }
        for (int64_t t = 0; t < nt; ++t) y[(t0 + t) * w.n_rows + r] = acc[t];
      }
    }
    return;
  }
  std::vector<float> block(static_cast<size_t>(bs));
  float acc[kTokenGroup];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wr = w.row(r);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += kTokenGroup) {
      const int64_t nt = std::min(kTokenGroup, n_tokens - t0);
      for (int64_t t = 0; t < nt; ++t) acc[t] = 0.0f;
      for (int64_t b = 0; b < n_blocks; ++b) {
        gguf::dequantize_row(w.type, wr + b * tr.type_size, block.data(), bs);
        for (int64_t t = 0; t < nt; ++t) {
          acc[t] += dot(block.data(), x + (t0 + t) * w.n_cols + b * bs, bs);
        }
      }
      for (int64_t t = 0; t < nt; ++t) y[(t0 + t) * w.n_rows + r] = acc[t];
    }
  }
}

}  // namespace

void matmul(const Weight& w, const float* x, int64_t n_tokens, float* y, ThreadPool& pool) {
  pool.parallel_for(
      w.n_rows, [&](int64_t r0, int64_t r1) { matmul_rows(w, x, n_tokens, y, r0, r1); }, 16);
}

void matmul_transposed_acc(const Weight& w, const float* x, float* y) {
  std::vector<float> row(size_t(w.n_cols));
  for (int64_t r = 0; r < w.n_rows; ++r) {
    if (x[r] == 0.0f) continue;
    gguf::dequantize_row(w.type, w.row(r), row.data(), w.n_cols);
    for (int64_t c = 0; c < w.n_cols; ++c) y[c] += x[r] * row[c];
  }
}

void dequantize_row(const Weight& w, int64_t r, float* out) {
  if (r < 0 || r >= w.n_rows) fail("row {} out of range (the weight has {} rows)", r, w.n_rows);
  gguf::dequantize_row(w.type, w.row(r), out, w.n_cols);
}

}  // namespace sparsemla::ops
