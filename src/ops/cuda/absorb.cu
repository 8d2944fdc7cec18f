// The per-head absorption products of MLA on cuBLAS (strided batched GEMM, bf16 x bf16 -> fp32).
#include <cublas_v2.h>

#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/mma.cuh"

#define SPARSEMLA_CUBLAS_CHECK(call)                                                                      \
  do {                                                                                                    \
    cublasStatus_t st_ = (call);                                                                          \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                     \
      ::sparsemla::fail("cuBLAS error in {} ({}:{}): {}", #call, __FILE__, __LINE__, cublasGetStatusString(st_)); \
  } while (0)

namespace sparsemla::cuda {
namespace {

__global__ void to_bf16_kernel(const float* x, int64_t n, __nv_bfloat16* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(x[i]);
}

// Packs the first `cols` values of each [T, H, stride] head row into a dense [T, H, cols] bf16 array.
__global__ void pack_bf16_kernel(const float* x, int64_t rows, int cols, int64_t stride, __nv_bfloat16* out) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(x[(i / cols) * stride + i % cols]);
}

unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>((n + 255) / 256, 65535)); }

}  // namespace

void to_bf16(const float* x, int64_t n, void* out, Stream s) {
  if (n == 0) return;
  to_bf16_kernel<<<grid_for(n), 256, 0, static_cast<cudaStream_t>(s)>>>(x, n, static_cast<__nv_bfloat16*>(out));
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

Blas::Blas() {
  cublasHandle_t h = nullptr;
  SPARSEMLA_CUBLAS_CHECK(cublasCreate(&h));
  handle_ = h;
  // A workspace of its own, set once: cuBLAS then never allocates inside a CUDA graph capture.
  workspace_ = DeviceBuffer(kWorkspaceBytes);
  SPARSEMLA_CUBLAS_CHECK(cublasSetWorkspace(h, workspace_.get(), workspace_.bytes()));
}

Blas::~Blas() {
  if (handle_) cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

void Blas::per_head(const HeadBatchedGemm& g, const float* x, int64_t x_stride, int64_t T, float* out,
                    int64_t out_stride, Stream s) {
  if (T == 0) return;
  auto h = static_cast<cublasHandle_t>(handle_);
  auto st = static_cast<cudaStream_t>(s);
  const float one = 1.0f, zero = 0.0f;
  if (g.f32) {  // x read in place: head h's columns start at h * x_stride, tokens heads * x_stride apart
    SPARSEMLA_CUBLAS_CHECK(cublasSetStream(h, st));
    SPARSEMLA_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));
    SPARSEMLA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        h, CUBLAS_OP_T, CUBLAS_OP_N, g.rows, int(T), g.cols, &one, g.w, CUDA_R_32F, g.cols,
        int64_t(g.rows) * g.cols, x, CUDA_R_32F, int64_t(g.heads) * x_stride, x_stride, &zero, out, CUDA_R_32F,
        int64_t(g.heads) * out_stride, out_stride, g.heads, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
    SPARSEMLA_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
    return;
  }
  const int64_t n = T * g.heads * g.cols;
  if (xbf_.bytes() < size_t(n) * 2) xbf_ = DeviceBuffer(size_t(n) * 2);
  pack_bf16_kernel<<<grid_for(n), 256, 0, st>>>(x, T * g.heads, g.cols, x_stride, xbf_.as<__nv_bfloat16>());
  SPARSEMLA_CUDA_LAUNCH_CHECK();
  SPARSEMLA_CUBLAS_CHECK(cublasSetStream(h, st));
  // cuBLAS is column-major. W_h, row-major [rows][cols], is column-major cols x rows: op(A) = A^T is
  // rows x cols. B = x_h is column-major cols x T (tokens H * cols apart); C = out_h is rows x T
  // (tokens H * out_stride apart). Heads are the batch: strides rows*cols, cols and out_stride.
  SPARSEMLA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h, CUBLAS_OP_T, CUBLAS_OP_N, g.rows, int(T), g.cols, &one, g.w, CUDA_R_16BF, g.cols,
      int64_t(g.rows) * g.cols, xbf_.get(), CUDA_R_16BF, int64_t(g.heads) * g.cols, g.cols, &zero, out, CUDA_R_32F,
      int64_t(g.heads) * out_stride, out_stride, g.heads, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace sparsemla::cuda
