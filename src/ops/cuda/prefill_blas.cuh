// The cuBLAS form of the prefill product (prefill_blas.cu describes it), called by
// quant_matmul.cu's matmul_prefill_blas and matmul_many once they have checked the arguments.
#pragma once
#include <cuda_runtime.h>

#include "ops/cuda/quant_matmul_kernels.cuh"

namespace sparsemla::cuda {

// One product: a.y = W a.x for a.n_tokens tokens, W's rows dequantized to bf16 by to_bf16 (or,
// bf16_in_place, read as they are: BF16 rows).
struct BlasProduct {
  MatArgs a;
  Bf16Launcher to_bf16 = nullptr;
  bool bf16_in_place = false;
};
// n products of one input (every p[i].a with the same x, n_tokens and n_cols): the activations
// rounded to bf16 once for all, then each product by cuBLAS's bf16 GEMM (fp32 accumulation) over
// its rows in chunks (chunk_rows > 0: at most that many rows per chunk; else 64 MiB of bf16 rows).
// False where it could not run (no scratch memory; no cuBLAS handle, or a capture before the device
// has one; a dimension past INT_MAX; inputs that differ): nothing was enqueued, and the caller takes
// the tile kernel.
bool prefill_blas_many(const BlasProduct* p, int n, cudaStream_t s, int64_t chunk_rows = 0);

// a.y = W a.x in fp32 arithmetic (CUBLAS_COMPUTE_32F_PEDANTIC) for F32 rows (a.row_bytes a
// multiple of 4). False as prefill_blas_many.
bool prefill_blas_f32(const MatArgs& a, cudaStream_t s);

// The device's handle made and one small bf16 and one fp32 GEMM run on s, then waited for
// (quant_matmul.h: prefill_blas_warm_up). Nothing where the handle cannot be made.
void warm_up_blas(cudaStream_t s);

}  // namespace sparsemla::cuda
