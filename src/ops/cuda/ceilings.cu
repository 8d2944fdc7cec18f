#include "ops/cuda/ceilings.h"

#include <cublas_v2.h>

#include <algorithm>

#include "ops/cuda/buffer.h"
#include "ops/cuda/check.cuh"

namespace sparsemla::cuda {
namespace {

__device__ __forceinline__ uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_uniform_kernel(float* x, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t r = mix(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
    x[i] = (float(r >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale;
  }
}

struct CopyCtx {
  void* dst;
  const void* src;
  size_t bytes;
};

}  // namespace

void fill_uniform(float* x, int64_t n, uint64_t seed, float scale) {
  if (n == 0) return;
  fill_uniform_kernel<<<unsigned(std::min<int64_t>((n + 255) / 256, 8192)), 256>>>(x, n, seed, scale);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

double graph_time_us(int reps, int calls, void (*fn)(void*, void*), void* ctx) {
  cudaStream_t st;
  SPARSEMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  fn(ctx, st);  // warm-up: workspaces are allocated outside the capture
  SPARSEMLA_CUDA_CHECK(cudaStreamSynchronize(st));
  cudaGraph_t graph;
  SPARSEMLA_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
  for (int i = 0; i < calls; ++i) fn(ctx, st);
  SPARSEMLA_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  cudaGraphExec_t exec;
  SPARSEMLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  struct Replay {
    cudaGraphExec_t exec;
    cudaStream_t st;
  } replay{exec, st};
  const double best = time_ms(
      reps, [](void* p) { SPARSEMLA_CUDA_CHECK(cudaGraphLaunch(static_cast<Replay*>(p)->exec, static_cast<Replay*>(p)->st)); },
      &replay, st);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  return double(best) * 1e3 / calls;
}

double measure_copy_bytes_per_s(uint64_t bytes) {
  DeviceBuffer a(bytes), b(bytes);
  a.zero();
  CopyCtx ctx{b.get(), a.get(), bytes};
  const double ms = time_ms(
      5, [](void* p) {
        auto* c = static_cast<CopyCtx*>(p);
        SPARSEMLA_CUDA_CHECK(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice));
      },
      &ctx);
  return 2.0 * double(bytes) / (ms * 1e-3);
}

double measure_bf16_gemm_flops(int n) {
  const size_t elems = size_t(n) * n;
  DeviceBuffer a(elems * 2), b(elems * 2), c(elems * 2);
  a.zero();
  b.zero();
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) fail("cuBLAS: cannot create a handle");
  struct Ctx {
    cublasHandle_t h;
    int n;
    void *a, *b, *c;
  } ctx{h, n, a.get(), b.get(), c.get()};
  const double ms = time_ms(
      5, [](void* p) {
        auto* x = static_cast<Ctx*>(p);
        const float one = 1.0f, zero = 0.0f;
        cublasGemmEx(x->h, CUBLAS_OP_N, CUBLAS_OP_N, x->n, x->n, x->n, &one, x->a, CUDA_R_16BF, x->n, x->b,
                     CUDA_R_16BF, x->n, &zero, x->c, CUDA_R_16BF, x->n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      },
      &ctx);
  cublasDestroy(h);
  return 2.0 * double(n) * n * n / (ms * 1e-3);
}

}  // namespace sparsemla::cuda
