// The per-head absorption products of MLA: decode-sized batches of the bf16 path on a head-batched
// GEMV of this file's own, everything else on cuBLAS (strided batched GEMM, bf16 x bf16 -> fp32, or
// fp32 pedantic for the reference's arithmetic).
#include <cublas_v2.h>

#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/small_ops_reduce.cuh"
#include "ops/cuda/pdl.cuh"

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

// Decode-sized batches: cuBLAS's batched GEMM with n = 1..16 columns reads the weights (12.6 MB for
// GLM-5's W_UK) at a small fraction of the memory bandwidth, so these take a GEMV that reads each
// weight once, in 16-byte loads. A block computes the 4 x RPW rows of one head for all tokens: its
// head's activations, rounded to bf16 as the GEMM path rounds them, are staged in shared memory;
// each of the 4 warps takes RPW rows, its lanes split every row into 8-column chunks (chunk i:
// lanes i, i + 32, ...), and a butterfly sums the lanes. A token's sum is formed in the same order
// whatever the batch size (tokens are taken NT at a time with separate accumulators) and whatever
// RPW. The lane's first chunk of each row is loaded before the wait for the kernel before (weights
// are no kernel's output; pdl.cuh), so that its latency overlaps that kernel's end and the staging.
// Rows of at most 32 chunks (256 columns: GLM-5's W_UK, 192) take 4 rows per warp, so the lane's
// only chunks are those first loads and twice the blocks share the device (H200, Nsight Compute,
// one decode step: 8.3 -> 7.1 us); wider rows keep 8 (GLM-5's W_UV, 512 columns: 8.0 us, against
// 8.4 with 4 rows and 8.6 with both of the lane's chunks loaded first).
constexpr int kHgWarps = 4;
constexpr int kHgShortRowsPerWarp = 4, kHgRowsPerWarp = 8;  // rows of <= 256 columns, and wider ones
constexpr int kHgMaxTokens = 16;
constexpr int kHgMaxStaged = 12288;  // T * cols floats (48 KB of shared memory)

__device__ __forceinline__ void bf16x8_to_f(const uint4& v, float (&f)[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
  }
}

template <int NT, int RPW>
__global__ void __launch_bounds__(kHgWarps * 32) head_gemv_kernel(const __nv_bfloat16* __restrict__ w, int heads,
                                                                   int rows, int cols, const float* __restrict__ x,
                                                                   int64_t x_stride, int T, float* __restrict__ out,
                                                                   int64_t out_stride) {
  extern __shared__ float xs[];  // [T][cols]
  const int h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, chunks = cols / 8;
  const int r0 = (blockIdx.x * kHgWarps + warp) * RPW;
  const __nv_bfloat16* wh = w + int64_t(h) * rows * cols;
  auto load_w = [&](int r, int ch) {
    return __ldg(reinterpret_cast<const uint4*>(wh + int64_t(min(r0 + r, rows - 1)) * cols) + ch);
  };
  uint4 first[RPW];
  if (r0 < rows && lane < chunks)
#pragma unroll
    for (int r = 0; r < RPW; ++r) first[r] = load_w(r, lane);
  pdl::wait();
  pdl::launch_dependents();  // the next decode product may prefetch its weights
  for (int i = threadIdx.x; i < T * cols; i += blockDim.x) {
    const int t = i / cols, c = i % cols;
    xs[i] = __bfloat162float(__float2bfloat16(x[(int64_t(t) * heads + h) * x_stride + c]));
  }
  __syncthreads();
  if (r0 >= rows) return;
  for (int t0 = 0; t0 < T; t0 += NT) {
    float acc[RPW][NT];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
    // acc[r][t] += chunk ch of row r . chunk ch of token t0 + t.
    auto chunk_dot = [&](const uint4 (&wv)[RPW], int ch) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float4* xp = reinterpret_cast<const float4*>(xs + min(t0 + t, T - 1) * cols + 8 * ch);
        const float4 a = xp[0], b = xp[1];
        const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          float wf[8];
          bf16x8_to_f(wv[r], wf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][t] = fmaf(wf[i], xv[i], acc[r][t]);
        }
      }
    };
    if constexpr (RPW == kHgShortRowsPerWarp) {  // rows of at most 32 chunks: the first loads are all
      if (lane < chunks) chunk_dot(first, lane);
    } else {
      for (int ch = lane; ch < chunks; ch += 32) {
        uint4 wv[RPW];
#pragma unroll
        for (int r = 0; r < RPW; ++r) wv[r] = ch == lane ? first[r] : load_w(r, ch);
        chunk_dot(wv, ch);
      }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float v = warp_sum(acc[r][t]);
        if (lane == 0 && r0 + r < rows && t0 + t < T) out[(int64_t(t0 + t) * heads + h) * out_stride + r0 + r] = v;
      }
  }
}

bool head_gemv_fits(const HeadBatchedGemm& g, int64_t T) {
  return !g.f32 && T <= kHgMaxTokens && g.cols % 8 == 0 && T * g.cols <= kHgMaxStaged &&
         (reinterpret_cast<uintptr_t>(g.w) & 15) == 0 && g.heads <= 65535;
}

void head_gemv(const HeadBatchedGemm& g, const float* x, int64_t x_stride, int64_t T, float* out, int64_t out_stride,
               cudaStream_t s) {
  const int rpw = g.cols <= 256 ? kHgShortRowsPerWarp : kHgRowsPerWarp;
  const dim3 grid(unsigned((g.rows + kHgWarps * rpw - 1) / (kHgWarps * rpw)), unsigned(g.heads));
  const size_t smem = size_t(T * g.cols) * sizeof(float);
  const auto* w = static_cast<const __nv_bfloat16*>(g.w);
  using Kernel = decltype(&head_gemv_kernel<1, 4>);
  static constexpr Kernel kKernels[2][3] = {{head_gemv_kernel<1, 4>, head_gemv_kernel<2, 4>, head_gemv_kernel<4, 4>},
                                            {head_gemv_kernel<1, 8>, head_gemv_kernel<2, 8>, head_gemv_kernel<4, 8>}};
  const Kernel kernel = kKernels[rpw == kHgRowsPerWarp][T == 1 ? 0 : T == 2 ? 1 : 2];
  pdl::launch(kernel, grid, kHgWarps * 32, smem, s, w, g.heads, g.rows, g.cols, x, x_stride, int(T), out, out_stride);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
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
  if (head_gemv_fits(g, T)) {
    head_gemv(g, x, x_stride, T, out, out_stride, st);
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
