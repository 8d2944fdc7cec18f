// Top-k selection per row by radix select: three histogram passes (11 + 11 + 10 bits of an
// order-preserving 32-bit key) find the exact k-th largest value; a last pass writes every index
// above it and, of the indices equal to it, the lowest ones (the CPU top_k's tie rule, found by a
// second radix select over the tied indices when the ties straddle the boundary).
// Long rows with few of them (a decode step at 128K context) are cut into segments: each segment's
// own top-k is selected by its own block, then one block selects among those candidates. The
// order (value descending, index ascending) makes this exact: the row's top-k is the top-k of
// the union of the segments' top-k.
#include <cub/block/block_scan.cuh>

#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"

namespace sparsemla::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxBins = 2048;
constexpr int kSegment = 16384;

// Larger float -> larger unsigned key; -0 and +0 are the same key (the CPU compares them equal).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct SelectSmem {
  typename cub::BlockScan<uint32_t, kThreads>::TempStorage scan;
  uint32_t hist[kMaxBins];
  uint32_t bucket, above, n_gt, n_eq;
};

// Finds the `rank`-th largest (1-based) of the keys key_of(i) for i < n with accept(i), by three
// radix passes. Returns the key; *count_eq receives how many accepted keys equal it and
// *need_eq how many of those are within the rank.
template <class KeyOf, class Accept>
__device__ uint32_t radix_select(SelectSmem& sm, int n, uint32_t rank, KeyOf key_of, Accept accept, uint32_t* need_eq,
                                 uint32_t* count_eq) {
  using Scan = cub::BlockScan<uint32_t, kThreads>;
  const int tid = threadIdx.x;
  uint32_t prefix = 0, mask = 0, remaining = rank, last = 0;
  const int shifts[3] = {21, 10, 0}, bits[3] = {11, 11, 10};
  for (int pass = 0; pass < 3; ++pass) {
    const int nb = 1 << bits[pass], shift = shifts[pass];
    for (int b = tid; b < nb; b += kThreads) sm.hist[b] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += kThreads) {
      if (!accept(i)) continue;
      const uint32_t key = key_of(i);
      if ((key & mask) == prefix) atomicAdd(&sm.hist[(key >> shift) & uint32_t(nb - 1)], 1u);
    }
    __syncthreads();
    // Counts from the top bin down: thread j holds bins nb-1-2j and nb-2-2j (or one bin when nb = 1024).
    const int per = nb / kThreads;
    const int hi = nb - 1 - per * tid;
    const uint32_t c_hi = sm.hist[hi], c_lo = per == 2 ? sm.hist[hi - 1] : 0u;
    uint32_t incl;
    Scan(sm.scan).InclusiveSum(c_hi + c_lo, incl);
    const uint32_t excl = incl - c_hi - c_lo;
    if (excl < remaining && remaining <= incl) {
      if (excl + c_hi >= remaining) {
        sm.bucket = uint32_t(hi);
        sm.above = excl;
      } else {
        sm.bucket = uint32_t(hi - 1);
        sm.above = excl + c_hi;
      }
    }
    __syncthreads();
    remaining -= sm.above;
    prefix |= sm.bucket << shift;
    mask |= uint32_t(nb - 1) << shift;
    last = sm.hist[sm.bucket];
    __syncthreads();
  }
  *need_eq = remaining;
  *count_eq = last;
  return prefix;
}

// The k best of vals[0..n) (n > k) by (value desc, index asc), index = idx[i] or base + i, written
// to out_idx[0..k) (and their values to out_val when given), in no particular order.
__device__ void block_top_k(SelectSmem& sm, const float* vals, const int32_t* idx, int base, int n, int k,
                            int32_t* out_idx, float* out_val) {
  const int tid = threadIdx.x;
  auto index_of = [&](int i) { return idx ? idx[i] : base + i; };
  auto value_key = [&](int i) { return order_key(vals[i]); };
  auto all = [](int) { return true; };
  uint32_t need_eq, count_eq;
  const uint32_t thr = radix_select(sm, n, uint32_t(k), value_key, all, &need_eq, &count_eq);
  const uint32_t n_gt = uint32_t(k) - need_eq;
  // Among the values equal to the threshold, the need_eq lowest indices: all of them when they fit,
  // else those up to the need_eq-th smallest index (a second selection, on inverted indices).
  uint32_t idx_thr = 0xffffffffu;  // inverted-index threshold: take tied i with ~index >= idx_thr
  if (count_eq != need_eq) {
    uint32_t need2, count2;
    idx_thr = radix_select(
        sm, n, need_eq, [&](int i) { return ~uint32_t(index_of(i)); }, [&](int i) { return value_key(i) == thr; },
        &need2, &count2);
  } else {
    idx_thr = 0;
  }
  if (tid == 0) {
    sm.n_gt = 0;
    sm.n_eq = 0;
  }
  __syncthreads();
  for (int i = tid; i < n; i += kThreads) {
    const uint32_t key = value_key(i);
    int slot = -1;
    if (key > thr) slot = int(atomicAdd(&sm.n_gt, 1u));
    else if (key == thr && ~uint32_t(index_of(i)) >= idx_thr) slot = int(n_gt + atomicAdd(&sm.n_eq, 1u));
    if (slot >= 0) {
      out_idx[slot] = index_of(i);
      if (out_val) out_val[slot] = vals[i];
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) topk_rows_kernel(const float* scores, int64_t stride, const int32_t* nn,
                                                             int k, int32_t* out) {
  __shared__ SelectSmem sm;
  const int t = blockIdx.x;
  const int n = nn[t];
  int32_t* o = out + int64_t(t) * k;
  if (n <= k) {
    for (int i = threadIdx.x; i < k; i += kThreads) o[i] = i < n ? i : -1;
    return;
  }
  block_top_k(sm, scores + int64_t(t) * stride, nullptr, 0, n, k, o, nullptr);
}

// Phase 1 of a long row: segment s's own top-k candidates (indices and values); short segments
// pass every element, padded with (-inf, -1).
__global__ void __launch_bounds__(kThreads) topk_segments_kernel(const float* scores, int64_t stride,
                                                                 const int32_t* nn, int k, int n_seg, int32_t* cand_idx,
                                                                 float* cand_val) {
  __shared__ SelectSmem sm;
  const int t = blockIdx.y, s = blockIdx.x;
  const int n = nn[t];
  const int begin = s * kSegment, len = max(0, min(kSegment, n - begin));
  int32_t* ci = cand_idx + (int64_t(t) * n_seg + s) * k;
  float* cv = cand_val + (int64_t(t) * n_seg + s) * k;
  if (len <= k) {
    for (int i = threadIdx.x; i < k; i += kThreads) {
      ci[i] = i < len ? begin + i : -1;
      cv[i] = i < len ? scores[int64_t(t) * stride + begin + i] : -INFINITY;
    }
    return;
  }
  block_top_k(sm, scores + int64_t(t) * stride + begin, nullptr, begin, len, k, ci, cv);
}

// Phase 2: the row's top-k among its segments' candidates.
__global__ void __launch_bounds__(kThreads) topk_merge_kernel(const int32_t* nn, int k, int n_seg,
                                                              const int32_t* cand_idx, const float* cand_val,
                                                              int32_t* out) {
  __shared__ SelectSmem sm;
  const int t = blockIdx.x;
  const int n = nn[t];
  int32_t* o = out + int64_t(t) * k;
  if (n <= k) {
    for (int i = threadIdx.x; i < k; i += kThreads) o[i] = i < n ? i : -1;
    return;
  }
  // Padding entries (-1) carry -inf and the largest inverted index... keep them out by ordering:
  // they can only be chosen if fewer than k real candidates exist, which n > k rules out, except for
  // real -inf scores, which the indexer never produces.
  block_top_k(sm, cand_val + int64_t(t) * n_seg * k, cand_idx + int64_t(t) * n_seg * k, 0, n_seg * k, k, o, nullptr);
}

}  // namespace

void top_k(const float* scores, int64_t T, int64_t stride, const int32_t* n, int k, int32_t* out, Stream s,
           TopKWorkspace* ws) {
  if (T == 0) return;
  if (k <= 0) fail("top_k: k must be > 0, got {}", k);
  auto st = static_cast<cudaStream_t>(s);
  // Segments pay off when a few long rows would leave most of the GPU idle.
  const int n_seg = int((stride + kSegment - 1) / kSegment);
  if (ws && n_seg >= 4 && T <= 32 && k <= kSegment / 2) {
    const size_t need = size_t(T) * n_seg * k * 8;
    if (ws->candidates.bytes() < need) ws->candidates = DeviceBuffer(need);
    int32_t* ci = ws->candidates.as<int32_t>();
    float* cv = reinterpret_cast<float*>(ci + size_t(T) * n_seg * k);
    topk_segments_kernel<<<dim3(unsigned(n_seg), unsigned(T)), kThreads, 0, st>>>(scores, stride, n, k, n_seg, ci, cv);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
    topk_merge_kernel<<<unsigned(T), kThreads, 0, st>>>(n, k, n_seg, ci, cv, out);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
    return;
  }
  topk_rows_kernel<<<unsigned(T), kThreads, 0, st>>>(scores, stride, n, k, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
