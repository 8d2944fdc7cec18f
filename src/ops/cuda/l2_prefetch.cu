#include "ops/cuda/l2_prefetch.h"

#include <cuda_runtime.h>

#include <atomic>

#include "ops/cuda/check.cuh"

namespace sparsemla::cuda {

namespace {

struct Spans {
  const char* p[kMaxL2Spans];
  uint64_t bytes[kMaxL2Spans];
  int n;
};

// Bulk prefetches of this many bytes each, spread over the launch's threads (SM90: TMA units of
// every SM the blocks land on issue them).
constexpr uint64_t kChunk = 32 * 1024;
constexpr int kThreads = 128;
constexpr int kBlocks = 8;

std::atomic<int64_t> g_launches{0};

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(Spans sp) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int i = 0; i < sp.n; ++i) {
    const uint64_t a = (reinterpret_cast<uint64_t>(sp.p[i]) + 15) & ~uint64_t(15);
    const uint64_t e = (reinterpret_cast<uint64_t>(sp.p[i]) + sp.bytes[i]) & ~uint64_t(15);
    if (e <= a) continue;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    for (uint64_t c = a + tid * kChunk; c < e; c += stride * kChunk) {
      const uint32_t n = uint32_t(e - c < kChunk ? e - c : kChunk);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c), "r"(n) : "memory");
    }
#else
    // One line each (128 bytes; the first from a, which may sit inside a line).
    for (uint64_t c = a + tid * 128; c < e; c += stride * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(c) : "memory");
#endif
  }
}

}  // namespace

void l2_prefetch(const L2Span* spans, int n, Stream s) {
  if (n < 0 || n > kMaxL2Spans) fail("cuda::l2_prefetch: {} spans (at most {})", n, kMaxL2Spans);
  Spans sp{};
  for (int i = 0; i < n; ++i) {
    if (!spans[i].p && spans[i].bytes > 0) fail("cuda::l2_prefetch: span {} of {} bytes has no address", i, spans[i].bytes);
    sp.p[sp.n] = static_cast<const char*>(spans[i].p);
    sp.bytes[sp.n++] = spans[i].bytes;
  }
  if (sp.n == 0) return;
  l2_prefetch_kernel<<<kBlocks, kThreads, 0, static_cast<cudaStream_t>(s)>>>(sp);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
  ++g_launches;
}

int64_t l2_prefetch_launches() { return g_launches.load(); }

}  // namespace sparsemla::cuda
