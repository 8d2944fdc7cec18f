// The activation quantization of quant_matmul_q8.h as one warp's step: the warp holds one block of
// 32 values (lane l value l) and writes its int8 values, its second level (two levels) and its
// {scale, sum}. quantize_q8_kernel (gemv_q8.cu) runs it on a row already in memory; the split norms
// (norm_split.cu) on the values they have just normalized, so both give the same bits.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/quant_matmul_q8.h"

namespace sparsemla::cuda {

// Block blk (of all tokens' blocks): v is lane l's value; q, r: the levels' rows; blocks: {scale, sum}.
template <int L>
__device__ __forceinline__ void quantize_q8_warp(float v, int64_t blk, int lane, int8_t* q, int8_t* r, int2* blocks) {
  // |v| as bits: non-negative floats order as their bit patterns.
  const float amax = __uint_as_float(__reduce_max_sync(0xFFFFFFFFu, __float_as_uint(fabsf(v))));
  const float d = __fdiv_rn(amax, 127.0f);
  const int qi = d == 0.0f ? 0 : max(-127, min(127, __float2int_rn(__fdiv_rn(v, d))));
  q[blk * 32 + lane] = int8_t(qi);
  float scale = d;
  int value = qi;
  if constexpr (L == 2) {
    scale = __fdiv_rn(d, float(kQ8LevelRatio));
    const float e = __fmaf_rn(-d, float(qi), v);
    const int ri = scale == 0.0f ? 0 : max(-127, min(127, __float2int_rn(__fdiv_rn(e, scale))));
    r[blk * 32 + lane] = int8_t(ri);
    value = kQ8LevelRatio * qi + ri;
  }
  const int sum = __reduce_add_sync(0xFFFFFFFFu, value);
  if (lane == 0) blocks[blk] = make_int2(__float_as_int(scale), sum);
}

// Where the levels and the blocks' {scale, sum} of a Q8Activations buffer lie (its layout).
struct Q8Out {
  int8_t* q = nullptr;
  int8_t* r = nullptr;   // two levels only
  int2* blocks = nullptr;
};

// Host: checks `out` for T x n_cols values on `levels` levels (naming `op` in the error), sets its
// n_tokens, n_cols and levels, and returns where its parts lie (gemv_q8.cu).
Q8Out q8_output(const char* op, int64_t n_tokens, int64_t n_cols, Q8Activations& out, int levels);

}  // namespace sparsemla::cuda
