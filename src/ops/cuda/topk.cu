// Top-k selection per row by radix select: three histogram passes (11 + 11 + 10 bits of an
// order-preserving 32-bit key) find the exact k-th largest value; a last pass writes every index
// above it and, of the indices equal to it, the lowest ones (the CPU top_k's tie rule).
#include <cub/block/block_scan.cuh>

#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"

namespace sparsemla::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxBins = 2048;

// Larger float -> larger unsigned key; -0 and +0 are the same key (the CPU compares them equal).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kThreads) topk_kernel(const float* scores, int64_t stride, const int32_t* nn,
                                                        int k, int32_t* out) {
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ uint32_t hist[kMaxBins];
  __shared__ uint32_t s_bucket, s_above, s_gt, s_eq, s_seen;
  const int t = blockIdx.x, tid = threadIdx.x;
  const float* row = scores + int64_t(t) * stride;
  const int n = nn[t];
  int32_t* o = out + int64_t(t) * k;
  if (n <= k) {
    for (int i = tid; i < k; i += kThreads) o[i] = i < n ? i : -1;
    return;
  }

  uint32_t prefix = 0, mask = 0, remaining = uint32_t(k), last_count = 0;
  const int shifts[3] = {21, 10, 0}, bits[3] = {11, 11, 10};
  for (int pass = 0; pass < 3; ++pass) {
    const int nb = 1 << bits[pass], shift = shifts[pass];
    for (int b = tid; b < nb; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += kThreads) {
      const uint32_t key = order_key(row[i]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & uint32_t(nb - 1)], 1u);
    }
    __syncthreads();
    // Counts from the top bin down: thread j holds bins nb-1-2j and nb-2-2j (or one bin when nb = 1024).
    const int per = nb / kThreads;  // 1 or 2
    const int hi = nb - 1 - per * tid;
    uint32_t c_hi = hist[hi], c_lo = per == 2 ? hist[hi - 1] : 0u;
    uint32_t incl;
    Scan(scan_tmp).InclusiveSum(c_hi + c_lo, incl);
    const uint32_t excl = incl - c_hi - c_lo;
    if (excl < remaining && remaining <= incl) {
      if (excl + c_hi >= remaining) {
        s_bucket = uint32_t(hi);
        s_above = excl;
      } else {
        s_bucket = uint32_t(hi - 1);
        s_above = excl + c_hi;
      }
    }
    __syncthreads();
    remaining -= s_above;
    prefix |= s_bucket << shift;
    mask |= uint32_t(nb - 1) << shift;
    last_count = hist[s_bucket];
    __syncthreads();
  }
  // prefix is now the k-th largest key; `remaining` of the keys equal to it are taken.
  const uint32_t thr = prefix, need_eq = remaining, n_gt = uint32_t(k) - need_eq;
  if (tid == 0) {
    s_gt = 0;
    s_eq = 0;
    s_seen = 0;
  }
  __syncthreads();
  const bool all_eq = last_count == need_eq;
  for (int i = tid; i < n; i += kThreads) {
    const uint32_t key = order_key(row[i]);
    if (key > thr) o[atomicAdd(&s_gt, 1u)] = i;
    else if (all_eq && key == thr) o[n_gt + atomicAdd(&s_eq, 1u)] = i;
  }
  if (all_eq) return;
  // Ties straddle the boundary: walk the row in index order and keep the first need_eq equal keys.
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + tid;
    const uint32_t flag = (i < n && order_key(row[i]) == thr) ? 1u : 0u;
    uint32_t rank, total;
    Scan(scan_tmp).ExclusiveSum(flag, rank, total);
    const uint32_t seen = s_seen;
    if (flag && seen + rank < need_eq) o[n_gt + seen + rank] = i;
    __syncthreads();
    if (tid == 0) s_seen = seen + total;
    __syncthreads();
    if (s_seen >= need_eq) break;
  }
}

}  // namespace

void top_k(const float* scores, int64_t T, int64_t stride, const int32_t* n, int k, int32_t* out, Stream s) {
  if (T == 0) return;
  if (k <= 0) fail("top_k: k must be > 0, got {}", k);
  topk_kernel<<<unsigned(T), kThreads, 0, static_cast<cudaStream_t>(s)>>>(scores, stride, n, k, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
