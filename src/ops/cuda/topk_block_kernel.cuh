// The top-k's block path kernel (topk_block.cu describes the path and launches it): in a header of
// its own so that the host emulation (tests/host_emulation) runs it in CI, where there is no GPU.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/pdl.cuh"
#include "ops/cuda/topk_common.cuh"

namespace sparsemla::cuda::topk {

// PER (4, 8 or 16) scores per thread: rows of up to PER * kThreads scores from their 16-byte boundary.
template <int PER, int THREADS = kThreads>
__global__ void __launch_bounds__(THREADS) topk_block_kernel(const float* scores, int64_t stride, const int32_t* nn,
                                                              int k, int32_t* out) {
  __shared__ SelectSmem sm;
  const int t = blockIdx.x, tid = threadIdx.x;
  for (int b = tid; b < kMaxBins; b += THREADS) sm.hist[b] = 0;
  pdl::wait();  // the scores come from the kernel just before (pdl.cuh)
  pdl::launch_dependents();
  const float* start = scores + int64_t(t) * stride;
  const int a = int((reinterpret_cast<uintptr_t>(start) / sizeof(float)) & 3);
  const float* row = start - a;  // 16-byte aligned; shifted index i is position i - a
  const int i0 = PER * tid;                // shifted index of this thread's first score

  // Loaded before the row's length is known, in one round trip with it (as the team path does):
  // this thread's scores anywhere in the row's stride; those past n are dropped below.
  uint32_t key[PER];
  load_stride_keys<PER>(row, a, stride, i0, key);
  const int n = nn[t];
  int32_t* o = out + int64_t(t) * k;
  if (n <= k) return write_short_row<THREADS>(n, k, o, 0, 1);
  uint32_t live = 0;  // bit j: score j of this thread is one of the row's
#pragma unroll
  for (int j = 0; j < PER; ++j) live |= uint32_t(i0 + j >= a && i0 + j < n + a) << j;
  __syncthreads();  // (the histogram's zeros)

  uint32_t prefix = 0, rank = uint32_t(k);  // thr's digits found so far; its rank among their keys
#pragma unroll 1
  for (int pass = 0; pass < 3; ++pass) {
    const int nb = digit_bins(pass), shift = digit_shift(pass);
    const uint32_t mask = prefix_mask(pass);
#pragma unroll
    for (int j = 0; j < PER; ++j)
      count_bin(sm.hist, (key[j] >> shift) & uint32_t(nb - 1), ((live >> j) & 1u) && (key[j] & mask) == prefix);
    __syncthreads();
    // (each bin read by one thread alone, which zeroes it; the next pass counts after the search's barrier)
    find_bucket_from<THREADS>(sm, nb, rank, [&](int b) {
      const uint32_t c = sm.hist[b];
      sm.hist[b] = 0;
      return c;
    });
    rank -= sm.above;
    prefix |= sm.bucket << shift;
    __syncthreads();  // sm.bucket and sm.above are written again by the next search
  }
  const uint32_t thr = prefix, need_eq = rank;  // take the keys above thr and the first need_eq equal to it

  uint32_t c_gt = 0, c_eq = 0;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    c_gt += ((live >> j) & 1u) && key[j] > thr;
    c_eq += ((live >> j) & 1u) && key[j] == thr;
  }
  uint64_t total;
  const uint64_t before = block_exclusive_sum<uint64_t, THREADS>(uint64_t(c_gt) | uint64_t(c_eq) << 32, sm.totals, &total);
  uint32_t r_gt = uint32_t(before), r_eq = uint32_t(before >> 32);
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    if (!((live >> j) & 1u)) continue;
    write_selected(key[j], i0 + j - a, thr, need_eq, r_gt, r_eq, o);
  }
}

}  // namespace sparsemla::cuda::topk
