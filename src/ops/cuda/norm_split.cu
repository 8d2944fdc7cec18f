// The RMS norms of rows of 1024 values and more, split over a thread-block cluster (SM90 and later):
// C blocks each take a contiguous slice of n / C values of the row, add their
// squares, read every block's partial sum over distributed shared memory in rank order (so all C
// agree to the bit) and scale their own slice; with int8 output they quantize it as they write it
// (q8_quantize.cuh: each warp's 32 values of a step are one activation block).
//
// One 512-thread block per 6144-value row (small_ops.cu) pulls the row, the residual and the weights
// through one multiprocessor and then quantizes 192 blocks of 32 with 16 warps in turn; the decode
// step's norms took 4-5 us each that way plus 2-2.5 us for the separate quantization (H200,
// docs/PERFORMANCE.md, sessions 25-26). Split over 8 multiprocessors, a 6144-value norm with its
// two-level quantization takes 4.9 us and q_a's 2048-value one 4.2 (against 7.7 and 6.0), three
// launches fewer per layer; the 3-layer Q8_0 GLM-5-width step 0.950 -> 0.943 ms, Q4_K_M within
// the runs' spread (session 26).
//
// Sums: each thread adds its values in order j = 0, 1, ... (position tid + threads j of its slice), the
// block reduces them as block_sum does, and the C partial sums are added in rank order: a fixed
// order that does not depend on T, so the result is batch invariant (but not the bits of the
// one-block kernel, whose tree differs).
#include "ops/cuda/norm_split.h"

#include <algorithm>

#include "ops/cuda/check.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/q8_quantize.cuh"
#include "ops/cuda/small_ops_reduce.cuh"
#include "util/env.h"

namespace sparsemla::cuda {

namespace {

constexpr int kSplitMaxThreads = 1024;
constexpr int kSplitMaxPerThread = 8;  // values a thread holds in registers

struct SplitArgs {
  const float* x = nullptr;  // rms_norm: the rows; add_rms_norm: delta
  int64_t x_stride = 0;
  float* h = nullptr;        // add_rms_norm: the residual rows (stride n), h += delta
  const float* w = nullptr;
  float* out = nullptr;
  int64_t out_stride = 0;
  int64_t n = 0;
  float eps = 0.0f;
  Q8Out q;                   // with int8 output (L > 0)
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t split_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void split_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// Block `rank`'s value at the shared address of `p` in this block.
__device__ __forceinline__ float split_read(const float* p, uint32_t rank) {
  const uint32_t local = uint32_t(__cvta_generic_to_shared(p));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
#endif

// Grid (C, T), clusters of (C, 1, 1); kAdd: h += x first; L: int8 levels of the output (0: none).
template <bool kAdd, int L>
__global__ void __launch_bounds__(kSplitMaxThreads) norm_split_kernel(const SplitArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float partial;
  const uint32_t rank = split_rank(), C = gridDim.x;
  const int64_t t = blockIdx.y, per = a.n / C, start = int64_t(rank) * per;
  const int threads = blockDim.x, steps = int(per / threads);
  const float* xr = a.x + t * a.x_stride;
  float* hr = kAdd ? a.h + t * a.n : nullptr;
  float v[kSplitMaxPerThread], wv[kSplitMaxPerThread];
#pragma unroll
  for (int j = 0; j < kSplitMaxPerThread; ++j) {
    if (j >= steps) break;
    const int64_t i = start + threadIdx.x + int64_t(j) * threads;
    v[j] = kAdd ? hr[i] + xr[i] : xr[i];
    wv[j] = a.w[i];
  }
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kSplitMaxPerThread; ++j) {
    if (j >= steps) break;
    if (kAdd) hr[start + threadIdx.x + int64_t(j) * threads] = v[j];
    ss += v[j] * v[j];
  }
  ss = block_sum(ss);
  if (threadIdx.x == 0) partial = ss;
  split_cluster_sync();  // every block's partial is written
  float total = 0.0f;
  for (uint32_t r = 0; r < C; ++r) total += split_read(&partial, r);
  split_cluster_sync();  // no block leaves while another may still read its partial
  const float scale = 1.0f / sqrtf(total / float(a.n) + a.eps);
  float* orow = a.out + t * a.out_stride;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int j = 0; j < kSplitMaxPerThread; ++j) {
    if (j >= steps) break;
    const int64_t i = start + threadIdx.x + int64_t(j) * threads;
    const float o = v[j] * scale * wv[j];
    orow[i] = o;
    if constexpr (L > 0) {  // the warp's 32 values of this step: activation block (t n + i - lane) / 32
      const int64_t blk = (t * a.n + start + int64_t(j) * threads + 32 * warp) / 32;
      quantize_q8_warp<L>(o, blk, lane, a.q.q, a.q.r, a.q.blocks);
    }
  }
#else
  __trap();  // the host launches it only on SM90 and later
#endif
}

bool g_split_norms = true;

// The split of a row: C blocks (the most of 8, 4, 2) of `threads` threads, each thread taking `steps`
// values of its block's slice, as few steps as fit 1024 threads (each step's warps quantize their
// 32 values in parallel: with 128 threads and 6 steps a 6144-value norm took 8.0 us, H200).
struct Split {
  int C = 0, threads = 0;
};
Split split_of(int64_t n) {
  for (int c : {8, 4, 2}) {
    if (n % c != 0) continue;
    const int64_t per = n / c;
    for (int64_t steps = 1; steps <= kSplitMaxPerThread; ++steps)
      if (per % steps == 0 && per / steps <= kSplitMaxThreads && (per / steps) % 32 == 0)
        return {c, int(per / steps)};
  }
  return {};
}

template <bool kAdd, int L>
void launch_split(const SplitArgs& a, Split sp, int64_t T, cudaStream_t s) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(sp.C);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(sp.C), unsigned(T));
  cfg.blockDim = dim3(unsigned(sp.threads));
  cfg.stream = s;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  SPARSEMLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, norm_split_kernel<kAdd, L>, a));
}

}  // namespace

void set_split_norms(bool on) { g_split_norms = on; }

bool split_norm_fits(int64_t T, int64_t n) {
  // Up to 128 rows: at prefill sizes one block per row already fills the device, and the split
  // form's clusters cost more (4096 rows of 6144: 288 us a call against ~10 for the one-block norm,
  // H100, docs/PERFORMANCE.md session 38). SPARSEMLA_SPLIT_NORM_MAX_ROWS moves the limit (measurements).
  static const long long max_rows = env_int("SPARSEMLA_SPLIT_NORM_MAX_ROWS", 128);
  if (!g_split_norms || T < 1 || T > std::min<long long>(65535, max_rows) || n < 1024 || split_of(n).C == 0)
    return false;
  return compute_capability().first >= 9;
}

void split_norm(const float* x, int64_t x_stride, float* h, const float* w, int64_t T, int64_t n, float eps,
                float* out, int64_t out_stride, Q8Activations* q, int levels, const char* op, Stream st) {
  const cudaStream_t s = static_cast<cudaStream_t>(st);
  if (!split_norm_fits(T, n)) fail("cuda::{}: internal error: no split norm for {} x {}", op, T, n);
  SplitArgs a{x, x_stride, h, w, out, out_stride, n, eps, q ? q8_output(op, T, n, *q, levels) : Q8Out{}};
  const Split sp = split_of(n);
  const int lv = q ? levels : 0;
  if (h) {
    if (lv == 2) launch_split<true, 2>(a, sp, T, s);
    else if (lv == 1) launch_split<true, 1>(a, sp, T, s);
    else launch_split<true, 0>(a, sp, T, s);
  } else {
    if (lv == 2) launch_split<false, 2>(a, sp, T, s);
    else if (lv == 1) launch_split<false, 1>(a, sp, T, s);
    else launch_split<false, 0>(a, sp, T, s);
  }
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
