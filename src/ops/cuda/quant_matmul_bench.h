// Timing of the CUDA matrix products, for bench/bench_cuda_matmul and `sparsemla bench`: time per
// call by CUDA events and the weight bandwidth it reaches, beside a measured copy bandwidth.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ops/cuda/attention.h"
#include "ops/cuda/quant_matmul.h"
#include "ops/cuda/quant_matmul_q8.h"

namespace sparsemla::cuda {

struct MatmulTiming {
  double us_per_call = 0;  // mean over a graph of back-to-back calls, best replay
  double weight_gbs = 0;   // weight bytes / time (10^9 bytes per second)
  double tflops = 0;       // 2 * rows * cols * tokens / time
};

// Times `calls` back-to-back matmul calls, captured once into a CUDA graph and replayed (GPU time,
// not the host's launch rate), best of `runs`. Call i reads copies[i % n_copies] (same shape and
// type), so that weights larger than a fraction of the L2 cache are read from memory as in a
// model's forward pass; pass enough copies to exceed L2.
// kernel: which entry point the calls go through (matmul's own choice by default).
// Prefill: the tile kernel (matmul_prefill); Blas: matmul_prefill_blas (fails where it does not run);
// DequantBf16: only its dequantization (dequantize_bf16 of the whole weight; n_tokens unused), whose
// weight_gbs counts the bytes read and the bf16 written, as the copy bandwidth does.
enum class BenchKernel { Auto, Fp32Decode, TensorCoreDecode, OneTokenTensorCore, Prefill, Blas, DequantBf16 };
MatmulTiming bench_matmul(const QuantMatrix* copies, int n_copies, int64_t n_tokens, int calls, int runs,
                          BenchKernel kernel = BenchKernel::Auto);

// Times `calls` back-to-back matmul_experts calls of n_pairs (token, expert) pairs on one token,
// captured and replayed as bench_matmul does. Each call takes its own n_pairs distinct experts
// drawn at random (seed 1) from w's n_rows / rows_per_expert, so that the expert weights come from
// memory; weight_gbs counts the bytes of the experts read.
// kernel: matmul_experts' kernel.
MatmulTiming bench_matmul_experts(const QuantMatrix& w, int64_t rows_per_expert, int n_pairs, int calls, int runs,
                                  ExpertKernel kernel = ExpertKernel::kFp32);

// The int8-activation products (quant_matmul_q8.h), timed as bench_matmul / bench_matmul_experts
// time the fp32 ones: the product only, on activations of `levels` int8 levels quantized once
// before the capture (a model quantizes a layer input once for all the products that read it).
// one_token: the one-token int8 tensor-core kernel (q8_one_token_supported types, one token).
MatmulTiming bench_matmul_q8(const QuantMatrix* copies, int n_copies, int64_t n_tokens, int calls, int runs,
                             int levels = 1, bool one_token = false);
MatmulTiming bench_matmul_experts_q8(const QuantMatrix& w, int64_t rows_per_expert, int n_pairs, int calls, int runs,
                                     int levels = 1, bool one_token = false);

// The MLA absorption products (attention.h: Blas::per_head) on T tokens, timed as bench_matmul
// times matmul: call i multiplies copies[i % n_copies] (one shape and form); weight_gbs counts the
// weights' bytes as stored (bf16 / f16: 2 per value; Quant: its type's rows).
MatmulTiming bench_per_head(Blas& blas, const HeadBatchedGemm* copies, int n_copies, int64_t n_tokens, int calls,
                            int runs);

// Microseconds per quantize_activations call of n_tokens x n_cols (graph replay, best of runs).
double bench_quantize_us(int64_t n_tokens, int64_t n_cols, int calls, int runs, int levels = 1);

// Device-to-device cudaMemcpy of `bytes`, best of `runs`: GB/s counting bytes read plus bytes
// written, the memory traffic a streaming kernel can hope for.
double bench_copy_gbs(size_t bytes, int runs);

}  // namespace sparsemla::cuda
