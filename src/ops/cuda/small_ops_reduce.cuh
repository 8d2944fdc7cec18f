// Block-wide reductions and scans for the row kernels (small ops, router, sampler). Every one works
// in a fixed order, so that the same input gives the same bits on every run, and returns the same
// value to every thread. blockDim.x must be a multiple of 32 and at most 1024; every thread of the
// block must call them.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace sparsemla::cuda {

constexpr unsigned kFullWarp = 0xffffffffu;

// Butterfly sum: each lane adds the same two operands (in swapped order), so all lanes agree bit for bit.
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullWarp, v, o);
  return v;
}

template <class T>
__device__ __forceinline__ T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFullWarp, v, o));
  return v;
}

template <class T>
__device__ T block_sum(T v) {
  __shared__ T part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // a previous call may still be reading part
  if (lane == 0) part[warp] = v;
  __syncthreads();
  return warp_sum(lane < n_warps ? part[lane] : T(0));
}

template <class T>
__device__ T block_max(T v, T lowest) {
  __shared__ T part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  return warp_max(lane < n_warps ? part[lane] : lowest);
}

// A candidate for the largest value: ties go to the lower index, as ops::top_k and the CPU
// sampler's argmax decide them.
struct ArgMax {
  float value;
  int32_t index;
};

__device__ __forceinline__ bool better(ArgMax a, ArgMax b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

__device__ __forceinline__ ArgMax warp_argmax(ArgMax a) {
  for (int o = 16; o > 0; o >>= 1) {
    ArgMax b{__shfl_xor_sync(kFullWarp, a.value, o), __shfl_xor_sync(kFullWarp, a.index, o)};
    if (better(b, a)) a = b;
  }
  return a;
}

// `a` from each thread; threads with nothing pass {-inf, INT32_MAX}.
__device__ inline ArgMax block_argmax(ArgMax a) {
  __shared__ ArgMax part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  a = warp_argmax(a);
  __syncthreads();
  if (lane == 0) part[warp] = a;
  __syncthreads();
  return warp_argmax(lane < n_warps ? part[lane] : ArgMax{-__int_as_float(0x7f800000), INT32_MAX});
}

// Exclusive prefix sum over the threads in thread order; `*total` receives the sum of all.
template <class T>
__device__ T block_exclusive_scan(T v, T* total) {
  __shared__ T part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  T incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const T up = __shfl_up_sync(kFullWarp, incl, o);
    if (lane >= o) incl += up;
  }
  __syncthreads();
  if (lane == 31) part[warp] = incl;
  __syncthreads();
  T warp_base = T(0), all = T(0);
  for (int w = 0; w < n_warps; ++w) {  // at most 32 values, the same order in every thread
    if (w == warp) warp_base = all;
    all += part[w];
  }
  *total = all;
  const T before = __shfl_up_sync(kFullWarp, incl, 1);
  return lane == 0 ? warp_base : warp_base + before;
}

}  // namespace sparsemla::cuda
