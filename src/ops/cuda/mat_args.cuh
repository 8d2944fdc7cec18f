// The arguments of one quantized product (MatArgs) and what a block of a decode kernel reads and
// writes by mode (block_mat, block_view): shared by every product kernel (quant_matmul_kernels.cuh
// and the kernel headers), in a header of its own with no launches, so that the host emulation
// (tests/host_emulation) can build the kernels that use it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/dequant.cuh"

namespace sparsemla::cuda {

// One product y = W x, validated by quant_matmul.cu.
struct MatArgs {
  const uint8_t* w = nullptr;  // [n_rows][row_bytes], 16-byte aligned
  uint64_t row_bytes = 0;
  int64_t n_rows = 0;
  int64_t n_cols = 0;          // a whole number of blocks
  const float* x = nullptr;    // [n_tokens, n_cols], 16-byte aligned
  // Or the activations quantized to int8 (the int8 kernels of gemv_q8.cu; quant_matmul_q8.h): token
  // j's values at xq + j * n_cols, its second level at xr + j * n_cols (two levels; else null), its
  // blocks' {scale, sum} at xb + j * n_cols / 32.
  const int8_t* xq = nullptr;
  const int8_t* xr = nullptr;
  const int2* xb = nullptr;
  float* y = nullptr;          // [n_tokens, n_rows]
  int64_t n_tokens = 0;
  int sm_count = 0;            // multiprocessors of the device: the prefill grid, the tensor-core decode launch
  bool prefetch = false;       // the decode kernel's weight prefetch (gemv_prologue)
  QuantTables tables;
  // Expert mode (matmul_experts, decode kernel only): grid row p is one (token, expert) pair; it
  // reads rows [ids[p] * n_rows, (ids[p] + 1) * n_rows) of w, activation row p / x_div, and writes
  // output row p. n_tokens is then the number of pairs.
  const int32_t* expert_ids = nullptr;
  int64_t x_div = 1;
  // ... with a shared expert (matmul_experts' SharedPair): grid row shared_pair (the routed pairs'
  // count) multiplies the shared matrix (shared_w; more[i].shared_w for product i; one expert's
  // shape) with activation row shared_x_row into output row shared_pair; it reads no id.
  const uint8_t* shared_w = nullptr;
  int64_t shared_pair = -1, shared_x_row = 0;
  // Grouped mode (matmul_expert_groups, decode kernel only): grid row g is the expert
  // group_active[g] (rows g >= *group_count return); its grouped slots j in [offsets[e],
  // offsets[e + 1]) read activation row group_perm[j] / x_div (row j when group_perm is null) and
  // write output row j. Each slot is summed as the one-token product sums it.
  const int32_t* group_offsets = nullptr;
  const int32_t* group_active = nullptr;
  const int32_t* group_count = nullptr;
  const int32_t* group_perm = nullptr;
  int64_t group_tokens_max = 0;  // the most slots one group can have (sets the tokens per pass)
  // Several products of one input (matmul_many, matmul_pair, matmul_experts_pair; the fp32 and
  // one-token decode kernels, one token or expert pairs): the blocks of grid z = i >= 1 multiply
  // more[i - 1] (same type and columns; its own rows and row stride, equal to the first's in expert
  // mode) into its own output; the activations are shared. Each product is summed as it is alone.
  struct Mat {
    const uint8_t* w = nullptr;
    float* y = nullptr;
    int64_t n_rows = 0;
    uint64_t row_bytes = 0;
    const uint8_t* shared_w = nullptr;
  };
  static constexpr int kMaxMore = 3;
  Mat more[kMaxMore];
  int n_more = 0;
  // Host: the rows of product i (0: the first) and the most rows of any.
  int64_t rows_of(int i) const { return i == 0 ? n_rows : more[i - 1].n_rows; }
  int64_t max_rows() const {
    int64_t m = n_rows;
    for (int i = 0; i < n_more; ++i) m = m > more[i].n_rows ? m : more[i].n_rows;
    return m;
  }
  // Blocks of `rows_per_block` rows over every product's rows.
  int64_t blocks_of_all(int64_t rows_per_block) const {
    int64_t b = 0;
    for (int i = 0; i <= n_more; ++i) b += (rows_of(i) + rows_per_block - 1) / rows_per_block;
    return b;
  }
};

// The product of this block (grid z): its matrix, output, rows and row stride.
struct BlockMat {
  const uint8_t* w;
  float* y;
  int64_t n_rows;
  uint64_t row_bytes;
  const uint8_t* shared_w;
};
__device__ __forceinline__ BlockMat block_mat(const MatArgs& a) {
  static_assert(MatArgs::kMaxMore == 3, "one case per product");
  switch (blockIdx.z) {  // (constant indices: the arguments stay in the parameter bank)
    case 0: return {a.w, a.y, a.n_rows, a.row_bytes, a.shared_w};
    case 1: return {a.more[0].w, a.more[0].y, a.more[0].n_rows, a.more[0].row_bytes, a.more[0].shared_w};
    case 2: return {a.more[1].w, a.more[1].y, a.more[1].n_rows, a.more[1].row_bytes, a.more[1].shared_w};
    default: return {a.more[2].w, a.more[2].y, a.more[2].n_rows, a.more[2].row_bytes, a.more[2].shared_w};
  }
}

// What one block of a decode product reads and writes, by mode: the matrix (or the expert's rows),
// the activations of its tokens and where their outputs go. Resolved on the device, after
// pdl::wait() (the expert ids and groups are the previous kernels' outputs).
struct BlockView {
  const uint8_t* w = nullptr;      // row 0 of the matrix or of the block's expert
  int64_t n_rows = 0;              // the product's rows (its output row stride) and row stride
  uint64_t row_bytes = 0;
  int64_t x_row = 0;               // token j's activations are row x_row + j of the input (when xrows is null)
  const int32_t* xrows = nullptr;  // grouped with a permutation: token j's row is xrows[j] / x_div
  float* y = nullptr;              // token j's outputs at y + j * n_rows
  int64_t n_tokens = 0;
  __device__ int64_t token_row(const MatArgs& a, int64_t j) const {
    return xrows ? int64_t(xrows[j] / a.x_div) : x_row + j;
  }
  __device__ const float* token(const MatArgs& a, int64_t j) const { return a.x + token_row(a, j) * a.n_cols; }
};

// The view of the block at grid row blockIdx.y; false when it has nothing to do (an unused
// expert pair or a grid row past the active groups).
__device__ __forceinline__ bool block_view(const MatArgs& a, BlockView& v) {
  const BlockMat m = block_mat(a);
  v.w = m.w;
  v.n_rows = m.n_rows;
  v.row_bytes = m.row_bytes;
  v.y = m.y;
  v.n_tokens = a.n_tokens;
  if (a.expert_ids) {  // the pair's expert rows, activation row and output row: a one-token product
    const int64_t pair = blockIdx.y;
    if (pair == a.shared_pair) {  // the shared expert's matrix
      v.w = m.shared_w;
      v.x_row = a.shared_x_row;
    } else {
      const int32_t e = a.expert_ids[pair];
      if (e < 0) return false;  // an unused slot: its output row is not written
      v.w += uint64_t(e) * uint64_t(v.n_rows) * v.row_bytes;
      v.x_row = pair / a.x_div;
    }
    v.y += pair * v.n_rows;
    v.n_tokens = 1;
  }
  if (a.group_offsets) {  // the group's expert, its slots' activation rows and output rows
    if (int(blockIdx.y) >= *a.group_count) return false;
    const int32_t e = a.group_active[blockIdx.y];
    const int32_t j0 = a.group_offsets[e];
    v.w += uint64_t(e) * uint64_t(v.n_rows) * v.row_bytes;
    v.n_tokens = a.group_offsets[e + 1] - j0;
    v.y += int64_t(j0) * v.n_rows;
    if (a.group_perm) v.xrows = a.group_perm + j0;
    else v.x_row = j0;
  }
  return true;
}

}  // namespace sparsemla::cuda
