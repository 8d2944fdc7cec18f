// The per-head absorption products of MLA and the choice among their paths (head_path): decode
// batches of bf16 rows on the tensor-core kernel (head_mma_kernel.cuh, 2-8 tokens and one token of
// long rows), of f16 rows and W_UK's one token on a head-batched GEMV (head_gemv_kernel.cuh), both
// reading the weights as stored (quantized weights: absorb_q8.cu); everything else on cuBLAS
// (strided batched GEMM, bf16 x bf16 -> fp32 with f16 weights widened first, or fp32 pedantic for
// the reference's arithmetic).
#include <cublas_v2.h>
#include <cuda_fp16.h>

#include "ops/cuda/absorb_q8.cuh"
#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/cublas_check.cuh"
#include "ops/cuda/head_gemv_kernel.cuh"
#include "ops/cuda/head_mma_kernel.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/small_ops_reduce.cuh"
#include "ops/cuda/pdl.cuh"
#include "util/env.h"

namespace sparsemla::cuda {
namespace {

using namespace headgemv;

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

// f16 weights widened to bf16 (rounded to nearest even) for cuBLAS: one thread per chunk of 8.
__global__ void widen_f16_kernel(const uint8_t* __restrict__ w, int64_t n_rows, int cols,
                                 __nv_bfloat16* __restrict__ out) {
  const int chunks = cols / 8;
  const int64_t n = n_rows * chunks;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks;
    const int ch = int(i % chunks);
    float f[8];
    F16Row::to_f(F16Row::load(w + r * cols * 2, ch), f);
    *reinterpret_cast<uint4*>(out + r * cols + 8 * ch) =
        make_uint4(pack_bf16(f[0], f[1]), pack_bf16(f[2], f[3]), pack_bf16(f[4], f[5]), pack_bf16(f[6], f[7]));
  }
}

bool aligned_to(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }

bool head_gemv_fits(const HeadBatchedGemm& g, int64_t T) {
  return !g.f32 && T <= kHgMaxTokens && g.cols % 8 == 0 && T * g.cols <= kHgMaxStaged && aligned_to(g.w, 16) &&
         g.heads <= 65535;
}

template <class WR, int RPW>
void launch_head_gemv(const HeadBatchedGemm& g, const float* x, int64_t x_stride, int64_t T, float* out,
                      int64_t out_stride, const HeadRope& rope, cudaStream_t s) {
  const dim3 grid(unsigned((g.rows + kHgWarps * RPW - 1) / (kHgWarps * RPW)), unsigned(g.heads));
  const size_t smem = size_t(T * g.cols) * sizeof(float);
  const auto* w = static_cast<const uint8_t*>(g.w);
  const auto kernel = T == 1   ? (rope.out ? head_gemv_kernel<WR, 1, RPW, true> : head_gemv_kernel<WR, 1, RPW>)
                      : T == 2 ? head_gemv_kernel<WR, 2, RPW>
                               : head_gemv_kernel<WR, 4, RPW>;
  pdl::launch(kernel, grid, kHgWarps * 32, smem, s, w, g.heads, g.rows, g.cols, x, x_stride, int(T), out, out_stride,
              rope);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

template <class WR>
void launch_head_gemv(const HeadBatchedGemm& g, const float* x, int64_t x_stride, int64_t T, float* out,
                      int64_t out_stride, const HeadRope& rope, cudaStream_t s) {
  if (g.cols <= 256) launch_head_gemv<WR, kHgShortRowsPerWarp>(g, x, x_stride, T, out, out_stride, rope, s);
  else launch_head_gemv<WR, kHgRowsPerWarp>(g, x, x_stride, T, out, out_stride, rope, s);
}

// rope: a rotation to do in the same launch (rope.out null: none).
void head_gemv(const HeadBatchedGemm& g, const float* x, int64_t x_stride, int64_t T, float* out, int64_t out_stride,
               const HeadRope& rope, cudaStream_t s) {
  switch (g.form) {
    case HeadWeights::BF16: return launch_head_gemv<Bf16Row>(g, x, x_stride, T, out, out_stride, rope, s);
    case HeadWeights::F16: return launch_head_gemv<F16Row>(g, x, x_stride, T, out, out_stride, rope, s);
    case HeadWeights::Quant: break;  // (absorb_q8.cu)
  }
  fail("cuda::head_gemv: internal error: quantized weights");
}

bool head_mma_fits(const HeadBatchedGemm& g, int64_t T) {
  return !g.f32 && g.form == HeadWeights::BF16 && headmma::hm_takes(g.cols, T, g.w) && g.heads <= 65535;
}

void head_mma(const HeadBatchedGemm& g, const float* x, int64_t x_stride, int64_t T, float* out, int64_t out_stride,
              cudaStream_t s) {
  using namespace headmma;
  HeadMmaArgs a;
  a.w = static_cast<const __nv_bfloat16*>(g.w);
  a.heads = g.heads;
  a.rows = g.rows;
  a.cols = g.cols;
  a.x = x;
  a.x_stride = x_stride;
  a.T = int(T);
  a.out = out;
  a.out_stride = out_stride;
  const HmLaunch l = hm_launch(g.heads, g.rows, g.cols, T);
  allow_smem(l.kernel, l.smem);
  pdl::launch(l.kernel, l.grid, kHmWarps * 32, l.smem, s, a);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

// The automatic path of bf16 rows (H200, bench_cuda_matmul --absorb, us; session 32): the
// tensor-core kernel at 2-8 tokens (GLM-5 W_UK / W_UV at 8 tokens 6.4 / 9.0 against the GEMV's
// 22.8 / 27.3 and cuBLAS's 7.5 / 8.6), and at one token for rows of 256 columns or more (W_UV
// 6.6 against 6.9; W_UK's 192 columns 5.6 against the GEMV's 5.3); cuBLAS from 9 tokens (W_UV at
// 16 tokens 9.8 against 14.1). SPARSEMLA_ABSORB_TC=0: the GEMV up to 16 tokens, as before (A/B).
bool absorb_tc_off() {
  static const bool off = env_off("SPARSEMLA_ABSORB_TC");
  return off;
}
bool tensor_core_takes(const HeadBatchedGemm& g, int64_t T) {
  return !absorb_tc_off() && head_mma_fits(g, T) && T <= 8 && (T >= 2 || g.cols >= 256);
}

// The path of a product of T tokens: the one asked for where it takes the shape; else (Auto)
// tensor_core_takes', cuBLAS for bf16 rows past 8 tokens, the head GEMVs (bf16 / f16 up to 16
// tokens; quantized rows read in place up to 16) where they fit, cuBLAS for the rest.
Blas::Path head_path(const HeadBatchedGemm& g, int64_t T, Blas::Path asked) {
  using Path = Blas::Path;
  const bool kernel = g.form == HeadWeights::Quant ? head_q8_fits(g, T) : head_gemv_fits(g, T);
  if (asked == Path::Gemm) return Path::Gemm;
  if (asked == Path::TensorCore && head_mma_fits(g, T)) return Path::TensorCore;
  if (asked == Path::Auto) {
    if (tensor_core_takes(g, T)) return Path::TensorCore;
    if (g.form == HeadWeights::BF16 && T > 8 && !absorb_tc_off()) return Path::Gemm;
  }
  return kernel ? Path::Kernel : Path::Gemm;
}

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

bool Blas::takes_rope(const HeadBatchedGemm& g, int64_t T) const {
  return !g.f32 && g.form != HeadWeights::Quant && T == 1 && head_path(g, T, path) == Path::Kernel;
}

void Blas::per_head(const HeadBatchedGemm& g, const float* x, int64_t x_stride, int64_t T, float* out,
                    int64_t out_stride, Stream s, const HeadRope* rope) {
  if (T == 0) return;
  if (rope && !takes_rope(g, T))
    fail("Blas::per_head: internal error: a rotation asked of a product of {} tokens that does not take it", T);
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
  switch (head_path(g, T, path)) {
    case Path::Kernel:
      if (g.form == HeadWeights::Quant) head_gemv_q8(g, x, x_stride, T, out, out_stride, st);
      else head_gemv(g, x, x_stride, T, out, out_stride, rope ? *rope : HeadRope{}, st);
      return;
    case Path::TensorCore: return head_mma(g, x, x_stride, T, out, out_stride, st);
    case Path::Auto:
    case Path::Gemm: break;
  }
  const void* wbf = g.w;
  if (g.form == HeadWeights::Quant) {  // dequantized into the scratch copy
    const size_t n = size_t(g.heads) * g.rows * g.cols;
    if (wbf_.bytes() < n * 2) wbf_ = DeviceBuffer(n * 2);
    dequantize_heads_bf16(g, wbf_.get(), st);
    wbf = wbf_.get();
  } else if (g.form == HeadWeights::F16) {  // widened into the scratch copy
    const int64_t n_rows = int64_t(g.heads) * g.rows, n = n_rows * g.cols;
    if (g.cols % 8 != 0) fail("Blas::per_head: f16 weights of {} columns (a multiple of 8 is needed)", g.cols);
    if (wbf_.bytes() < size_t(n) * 2) wbf_ = DeviceBuffer(size_t(n) * 2);
    auto* dst = wbf_.as<__nv_bfloat16>();
    widen_f16_kernel<<<grid_for(n / 8), 256, 0, st>>>(static_cast<const uint8_t*>(g.w), n_rows, g.cols, dst);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
    wbf = dst;
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
      h, CUBLAS_OP_T, CUBLAS_OP_N, g.rows, int(T), g.cols, &one, wbf, CUDA_R_16BF, g.cols,
      int64_t(g.rows) * g.cols, xbf_.get(), CUDA_R_16BF, int64_t(g.heads) * g.cols, g.cols, &zero, out, CUDA_R_32F,
      int64_t(g.heads) * out_stride, out_stride, g.heads, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace sparsemla::cuda
