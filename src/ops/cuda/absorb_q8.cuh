// The absorption products on quantized weights read in place (absorb_q8.cu), for absorb.cu's
// Blas::per_head.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/attention.h"

namespace sparsemla::cuda {

// The most tokens the head-batched int8 product takes; larger batches dequantize the rows into a
// bf16 copy for cuBLAS.
constexpr int64_t kHqMaxTokens = 16;

// Whether g (HeadWeights::Quant) at T tokens takes head_gemv_q8: head_q8_supported, T in [1,
// kHqMaxTokens] and its shared memory within what every device allows.
bool head_q8_fits(const HeadBatchedGemm& g, int64_t T);

// out[t][h][r] = W_h[r] . x_hat[t][h] (per_head's shapes and strides), x_hat the two-level int8
// quantization of x's first g.cols values per head. Only where head_q8_fits.
void head_gemv_q8(const HeadBatchedGemm& g, const float* x, int64_t x_stride, int64_t T, float* out,
                  int64_t out_stride, cudaStream_t s);

// The rows of every head ([heads * rows][cols]) into out as bf16 (each value as the CPU dequantizes
// it, rounded to nearest even); out 16-byte aligned.
void dequantize_heads_bf16(const HeadBatchedGemm& g, void* out, cudaStream_t s);

}  // namespace sparsemla::cuda
