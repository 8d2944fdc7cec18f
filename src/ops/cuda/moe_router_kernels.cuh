// The MoE router's kernels (moe_router.cu has the host side): the routing of each token and the
// grouping of the routed pairs by expert, in a header of their own so that the host emulation
// (tests/host_emulation) builds and runs them where there is no GPU.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/cuda/dynamic_smem.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/small_ops_reduce.cuh"

namespace sparsemla::cuda::router {

constexpr int kRouterThreads = 256;

// exp of an fp32 value, correctly rounded to fp32 (double exp, rounded once). glibc's expf agrees
// on all but ~0.06% of inputs (by one ulp), where CUDA's expf (2 ulp) would differ far more often:
// scores, and with them the choice and its ties, are the CPU's.
__device__ __forceinline__ float expf_as_cpu(float x) { return float(exp(double(x))); }

struct RouterShape {
  int E, k, groups, groups_used;
  bool sigmoid, norm;
  float scale;
};

// The router's dynamic shared memory (route_kernel's layout).
inline size_t route_smem_bytes(const RouterShape& sh) {
  return size_t(2 * sh.E + sh.groups) * sizeof(float) + size_t(sh.E + sh.groups);
}

// One block per token. Shared memory: score [E] | choice [E] | group score [G] | taken [E] | group kept [G].
__global__ void route_kernel(RouterShape sh, const float* __restrict__ logits, const float* __restrict__ bias,
                             int32_t* __restrict__ ids, float* __restrict__ weights) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  SPARSEMLA_DYNAMIC_SMEM(smem);
  const int E = sh.E, G = sh.groups;
  float* score = reinterpret_cast<float*>(smem);
  float* choice = score + E;
  float* gscore = choice + E;
  bool* taken = reinterpret_cast<bool*>(gscore + G);
  bool* gkept = taken + E;
  __shared__ int32_t chosen[64];  // k <= 64, checked on the host

  const int64_t t = blockIdx.x;
  const float* row = logits + t * E;
  // The bias of this thread's first expert, loaded with the logits (not one round trip later).
  const float bias0 = bias && int(threadIdx.x) < E ? bias[threadIdx.x] : 0.0f;
  if (sh.sigmoid) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) score[e] = 1.0f / (1.0f + expf_as_cpu(-row[e]));
  } else {  // ops::softmax: max-subtracted exp in fp32, the sum in double
    float m = -INFINITY;
    for (int e = threadIdx.x; e < E; e += blockDim.x) m = fmaxf(m, row[e]);
    m = block_max(m, -INFINITY);
    double sum = 0.0;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      score[e] = expf_as_cpu(row[e] - m);
      sum += score[e];
    }
    const float inv = float(1.0 / block_sum(sum));
    for (int e = threadIdx.x; e < E; e += blockDim.x) score[e] *= inv;
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    choice[e] = score[e] + (e == int(threadIdx.x) ? bias0 : bias ? bias[e] : 0.0f);
    taken[e] = false;
  }
  __syncthreads();

  if (G > 1 && sh.groups_used < G) {
    // A group's score: its best choice, plus its second best for sigmoid routers.
    const int per = E / G;
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
      float c0 = -INFINITY, c1 = -INFINITY;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        const float c = choice[e];
        if (c > c0) {
          c1 = c0;
          c0 = c;
        } else if (c > c1) {
          c1 = c;
        }
      }
      gscore[g] = sh.sigmoid ? c0 + (per > 1 ? c1 : 0.0f) : c0;
      gkept[g] = false;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // G is small (8): the best groups_used of them, ties to the lower group
      for (int r = 0; r < sh.groups_used; ++r) {
        int best = -1;
        for (int g = 0; g < G; ++g)
          if (!gkept[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
        gkept[best] = true;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (!gkept[e / per]) choice[e] = -INFINITY;
    __syncthreads();
  }

  // k rounds of argmax by the first warp alone (no block barrier per round: 8 rounds of two block
  // barriers each were most of the kernel's time). Each lane only reads and marks its own experts
  // (e = lane + 32 j), so `taken` needs no barrier between rounds.
  if (threadIdx.x >= 32) return;
  const int lane = int(threadIdx.x);
  for (int r = 0; r < sh.k; ++r) {
    ArgMax a{-INFINITY, INT32_MAX};
    for (int e = lane; e < E; e += 32)
      if (!taken[e] && better(ArgMax{choice[e], e}, a)) a = ArgMax{choice[e], e};
    a = warp_argmax(a);
    if (a.index < E && a.index % 32 == lane) taken[a.index] = true;
    if (lane == 0) chosen[r] = a.index;
  }

  if (lane == 0) {  // as route(): the sum in selection order
    float sum = 0.0f;
    for (int r = 0; r < sh.k; ++r) sum += score[chosen[r]];
    for (int r = 0; r < sh.k; ++r) {
      float w = score[chosen[r]];
      if (sh.norm) w /= sum + 1e-20f;
      w *= sh.scale;
      ids[t * sh.k + r] = chosen[r];
      weights[t * sh.k + r] = w;
    }
  }
}

// ---- grouping by expert: a counting sort over chunks of kChunk entries ----
// workspace: base [E, n_chunks] int32, first the pairs of each (expert, chunk), then, scanned in
// expert-major order, where each (expert, chunk) starts in perm.

constexpr int kChunk = 256;
constexpr int kScanThreads = 1024;

__global__ void count_chunks_kernel(const int32_t* __restrict__ ids, int64_t n, int E, int n_chunks,
                                    int32_t* __restrict__ base) {
  SPARSEMLA_DYNAMIC_SMEM(smem);
  int32_t* counts = reinterpret_cast<int32_t*>(smem);  // [E]
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int64_t j = int64_t(blockIdx.x) * kChunk + threadIdx.x;
  if (j < n) {
    const int32_t e = ids[j];
    if (e >= 0 && e < E) atomicAdd(&counts[e], 1);  // counts only: the order is settled by rank below
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) base[int64_t(e) * n_chunks + blockIdx.x] = counts[e];
}

// One block: exclusive scan of base in place, then counts and offsets per expert.
__global__ void scan_chunks_kernel(int32_t* base, int E, int n_chunks, int32_t* __restrict__ counts,
                                   int32_t* __restrict__ offsets, int64_t n, int32_t* __restrict__ perm,
                                   int32_t* __restrict__ active, int32_t* __restrict__ n_active) {
  const int64_t M = int64_t(E) * n_chunks;
  const int64_t per = (M + blockDim.x - 1) / blockDim.x;
  const int64_t lo = min(M, per * threadIdx.x), hi = min(M, lo + per);
  int32_t local = 0;
  for (int64_t i = lo; i < hi; ++i) local += base[i];
  int32_t total = 0;
  int32_t run = block_exclusive_scan(local, &total);
  for (int64_t i = lo; i < hi; ++i) {
    const int32_t c = base[i];
    base[i] = run;
    run += c;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int32_t start = base[int64_t(e) * n_chunks];
    const int32_t end = e + 1 < E ? base[int64_t(e + 1) * n_chunks] : total;
    offsets[e] = start;
    counts[e] = end - start;
  }
  if (threadIdx.x == 0) offsets[E] = total;
  if (!active) return;
  // The experts with pairs, in order: each thread counts its range, one scan places them.
  const int per_e = (E + int(blockDim.x) - 1) / int(blockDim.x);
  const int e_lo = min(E, per_e * int(threadIdx.x)), e_hi = min(E, e_lo + per_e);
  int32_t mine = 0;
  for (int e = e_lo; e < e_hi; ++e) {
    const int32_t end = e + 1 < E ? base[int64_t(e + 1) * n_chunks] : total;
    mine += end > base[int64_t(e) * n_chunks];
  }
  int32_t n_act = 0;
  int32_t at = block_exclusive_scan(mine, &n_act);
  for (int e = e_lo; e < e_hi; ++e) {
    const int32_t end = e + 1 < E ? base[int64_t(e + 1) * n_chunks] : total;
    if (end > base[int64_t(e) * n_chunks]) active[at++] = e;
  }
  if (threadIdx.x == 0) *n_active = n_act;
  for (int64_t j = total + int64_t(threadIdx.x); j < n; j += blockDim.x) perm[j] = -1;
}

// Entry j goes to base[e][chunk] + (entries before j in its chunk routed to the same expert).
__global__ void scatter_chunks_kernel(const int32_t* __restrict__ ids, int64_t n, int E, int n_chunks,
                                      const int32_t* __restrict__ base, int32_t* __restrict__ perm) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  __shared__ int32_t tile[kChunk];
  const int64_t j = int64_t(blockIdx.x) * kChunk + threadIdx.x;
  const int32_t e = j < n ? ids[j] : -1;
  tile[threadIdx.x] = e;
  __syncthreads();
  if (e < 0 || e >= E) return;
  int32_t rank = 0;
  for (int i = 0; i < int(threadIdx.x); ++i) rank += tile[i] == e;
  perm[base[int64_t(e) * n_chunks + blockIdx.x] + rank] = int32_t(j);
}

}  // namespace sparsemla::cuda::router
