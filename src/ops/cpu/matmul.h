// Matrix products that read GGUF weights in place: each row is dequantized block by block inside
// the dot product, so no float copy of a weight ever exists beyond one block per thread.
#pragma once
#include <cstdint>

#include "gguf/ggml_types.h"
#include "ops/cpu/thread_pool.h"

namespace sparsemla::gguf {
struct TensorInfo;
}

namespace sparsemla::ops {

// A 2-D view of a weight: n_rows rows of n_cols values (ne0 = n_cols), stored in `type`.
// Rows are row_bytes apart: a column slice (cols()) keeps the whole row's stride, so its rows are
// narrower than row_bytes and not contiguous with each other (see contiguous()).
struct Weight {
  gguf::GgmlType type = gguf::GgmlType::F32;
  int64_t n_cols = 0;      // ne0: the input dimension of y = W x
  int64_t n_rows = 0;      // output dimension
  uint64_t row_bytes = 0;  // stride between rows
  const uint8_t* data = nullptr;

  // The whole tensor as rows of ne0 (a 3-D tensor {ne0, ne1, ne2} gives ne1*ne2 rows).
  static Weight of(const gguf::TensorInfo& t);
  // Rows [first, first + count).
  Weight rows(int64_t first, int64_t count) const;
  // Columns [first, first + count) of every row, for a tensor-parallel shard of an input dimension.
  // Both must be multiples of the type's block size: a quantized block is never cut.
  Weight cols(int64_t first, int64_t count) const;
  // Rows follow each other with no gap (false for a column slice).
  bool contiguous() const { return row_bytes == gguf::row_bytes(type, uint64_t(n_cols)); }
  const uint8_t* row(int64_t r) const { return data + uint64_t(r) * row_bytes; }
};

// y[t][r] = sum_c W[r][c] * x[t][c] for t < n_tokens.   x: [n_tokens, n_cols]   y: [n_tokens, n_rows]
void matmul(const Weight& w, const float* x, int64_t n_tokens, float* y, ThreadPool& pool);

// y[c] += sum_r x[r] * W[r][c]: the transposed product, for weights stored the other way round
// (the legacy attn_kv_b absorbed into the query).   x: [n_rows]   y: [n_cols]
void matmul_transposed_acc(const Weight& w, const float* x, float* y);

// Dequantizes row r (an embedding lookup).   out: [n_cols]
void dequantize_row(const Weight& w, int64_t r, float* out);

}  // namespace sparsemla::ops
