// The per-head absorption products of MLA and the choice among their paths (head_path): decode
// batches of bf16 rows on the tensor-core kernel (head_mma_kernel.cuh, 2-8 tokens and one token of
// long rows), of f16 rows and W_UK's one token on a head-batched GEMV of this file's own, both
// reading the weights as stored (quantized weights: absorb_q8.cu); everything else on cuBLAS
// (strided batched GEMM, bf16 x bf16 -> fp32 with f16 weights widened first, or fp32 pedantic for
// the reference's arithmetic).
#include <cublas_v2.h>
#include <cuda_fp16.h>

#include "ops/cuda/absorb_q8.cuh"
#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/cublas_check.cuh"
#include "ops/cuda/head_mma_kernel.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/small_ops_reduce.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/rope.cuh"
#include "util/env.h"

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

// The GEMV (head_path says where it runs; session 32 timed cuBLAS at 2-16 tokens at 7.3-11.3 us, not
// the small fraction of bandwidth first thought, and the tensor-core kernel below both): it reads
// each weight once per pass of NT tokens, in 16-byte loads. A block computes the 4 x RPW rows of one head for all tokens: its
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

// A lane's chunk ch of a weight row (columns 8 ch .. 8 ch + 8) as the row stores it, and its values
// in fp32 (exact).
struct Bf16Row {
  using Raw = uint4;
  __device__ static Raw load(const uint8_t* row, int ch) { return __ldg(reinterpret_cast<const uint4*>(row) + ch); }
  __device__ static void to_f(const Raw& v, float (&f)[8]) { bf16x8_to_f(v, f); }
};
struct F16Row {
  using Raw = uint4;
  __device__ static Raw load(const uint8_t* row, int ch) { return __ldg(reinterpret_cast<const uint4*>(row) + ch); }
  __device__ static void to_f(const Raw& v, float (&f)[8]) {
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&u[i]));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
};
template <class WR, int NT, int RPW>
__global__ void __launch_bounds__(kHgWarps * 32) head_gemv_kernel(const uint8_t* __restrict__ w, int heads, int rows,
                                                                   int cols, const float* __restrict__ x,
                                                                   int64_t x_stride, int T, float* __restrict__ out,
                                                                   int64_t out_stride, HeadRope rope) {
  extern __shared__ float xs[];  // [T][cols]
  const int h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, chunks = cols / 8;
  const int64_t row_bytes = int64_t(cols) * 2;  // (16-bit values)
  const int r0 = (blockIdx.x * kHgWarps + warp) * RPW;
  const uint8_t* wh = w + int64_t(h) * rows * row_bytes;
  auto load_w = [&](int r, int ch) { return WR::load(wh + int64_t(min(r0 + r, rows - 1)) * row_bytes, ch); };
  typename WR::Raw first[RPW];
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
  // The head's rotation (HeadRope), by the last block of its rows: rope_kernel's arithmetic.
  if (rope.out && blockIdx.x == gridDim.x - 1) {
    const int64_t half = rope.table.half;
    for (int64_t i = threadIdx.x; i < T * half; i += blockDim.x) {
      const int64_t t = i / half, j = i % half;
      const RopeAngle ang = rope_angle(rope.table, float(rope.pos[t]), j);
      const int64_t ia = rope_a(rope.table, j), ib = rope_b(rope.table, j);
      const float* row = rope.x + (t * heads + h) * rope.x_stride;
      float x0 = row[ia], x1 = row[ib];
      rope_rotate(ang, &x0, &x1);
      float* orow = rope.out + (t * heads + h) * rope.out_stride;
      orow[ia] = x0;
      orow[ib] = x1;
    }
  }
  if (r0 >= rows) return;
  for (int t0 = 0; t0 < T; t0 += NT) {
    float acc[RPW][NT];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
    // acc[r][t] += chunk ch of row r . chunk ch of token t0 + t.
    auto chunk_dot = [&](const typename WR::Raw (&wv)[RPW], int ch) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float4* xp = reinterpret_cast<const float4*>(xs + min(t0 + t, T - 1) * cols + 8 * ch);
        const float4 a = xp[0], b = xp[1];
        const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          float wf[8];
          WR::to_f(wv[r], wf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][t] = fmaf(wf[i], xv[i], acc[r][t]);
        }
      }
    };
    if constexpr (RPW == kHgShortRowsPerWarp) {  // rows of at most 32 chunks: the first loads are all
      if (lane < chunks) chunk_dot(first, lane);
    } else {
      for (int ch = lane; ch < chunks; ch += 32) {
        typename WR::Raw wv[RPW];
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
  const auto kernel = T == 1   ? head_gemv_kernel<WR, 1, RPW>
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
  return !g.f32 && g.form != HeadWeights::Quant && T > 0 && head_path(g, T, path) == Path::Kernel;
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
