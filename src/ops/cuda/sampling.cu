#include "ops/cuda/sampling.h"

#include <curand_kernel.h>

#include <algorithm>

#include "ops/cuda/check.cuh"
#include "ops/cuda/small_ops_reduce.cuh"

// One block per row. The filters never sort: each cut (top-k, top-p) is found by a radix select
// over the bits of the row's weights (positive floats order as their bit patterns), 4 bits a pass,
// walking from the most likely end until the count (top-k) or the mass (top-p) reaches its target;
// ties at the cut keep the lower ids, as the CPU's (weight desc, id asc) order does.

namespace sparsemla::cuda {

namespace {

constexpr int kThreads = 512;  // the most; short rows take fewer (row_threads)
constexpr int kDigitBits = 4, kDigits = 1 << kDigitBits;
constexpr int kLoadsInFlight = 8;  // float4 loads a thread issues before using the first

cudaStream_t stream_of(Stream s) { return static_cast<cudaStream_t>(s); }

// f(r[i], i) for every i < V that this thread owns, in a fixed order. A pass over a row is a chain
// of memory round trips, one per load a thread waits on: with one scalar load at a time a greedy
// row of 154,880 logits cost 113 us (H200), so a 16-byte aligned row is read kLoadsInFlight float4
// loads at a time (the tail, or a misaligned row, one value at a time).
template <class F>
__device__ __forceinline__ void for_row(const float* r, int32_t V, F&& f) {
  const int32_t tid = threadIdx.x, nt = blockDim.x;
  int32_t done = 0;
  if ((reinterpret_cast<uintptr_t>(r) & 15) == 0) {
    const float4* r4 = reinterpret_cast<const float4*>(r);
    const int32_t n4 = V / 4;
    for (int32_t base = 0; base < n4; base += nt * kLoadsInFlight) {
      float4 v[kLoadsInFlight];
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        const int32_t j = base + u * nt + tid;
        if (j < n4) v[u] = r4[j];
      }
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        const int32_t j = base + u * nt + tid;
        if (j >= n4) continue;
        f(v[u].x, 4 * j);
        f(v[u].y, 4 * j + 1);
        f(v[u].z, 4 * j + 2);
        f(v[u].w, 4 * j + 3);
      }
    }
    done = n4 * 4;
  }
  for (int32_t i = done + tid; i < V; i += nt) f(r[i], i);
}

// Keeps keys above `key`, and those equal to it up to id `id`.
struct Cut {
  uint32_t key = 0;
  int32_t id = INT32_MAX;
};

__device__ __forceinline__ bool passes(uint32_t key, int32_t id, Cut c) {
  return key > c.key || (key == c.key && id <= c.id);
}

// What the filters of a row decided.
struct RowFilter {
  float min_p;
  bool k_on, p_on;
  Cut k_cut, p_cut;
};

// A candidate of min-p (every filter starts from these); w is the weight relative to the best token.
__device__ __forceinline__ bool candidate(float w, float min_p) { return w >= min_p && w > 0.0f; }

__device__ __forceinline__ bool after_top_k(float w, int32_t i, const RowFilter& f) {
  return candidate(w, f.min_p) && (!f.k_on || passes(__float_as_uint(w), i, f.k_cut));
}

__device__ __forceinline__ bool kept(float w, int32_t i, const RowFilter& f) {
  return after_top_k(w, i, f) && (!f.p_on || passes(__float_as_uint(w), i, f.p_cut));
}

// Sum of acc[0..kDigits) over the block, in a fixed order; the result is in tot[] for every thread.
__device__ void block_sum_digits(const double (&acc)[kDigits], double* tot) {
  __shared__ double part[kThreads / 32][kDigits];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
  for (int d = 0; d < kDigits; ++d) {
    const double v = warp_sum(acc[d]);
    if (lane == 0) part[warp][d] = v;
  }
  __syncthreads();
  if (threadIdx.x < kDigits) {
    double sum = 0.0;
    for (int w = 0; w < n_warps; ++w) sum += part[w][threadIdx.x];
    tot[threadIdx.x] = sum;
  }
  __syncthreads();
}

// The cut at which the weight (1 per token when by_count, else its w) of the eligible tokens, taken
// from the most likely down, first reaches `target`.
template <class Eligible>
__device__ Cut radix_cut(const float* w, int32_t V, bool by_count, double target, Eligible eligible) {
  __shared__ double tot[kDigits];
  uint32_t prefix = 0;
  double above = 0.0;  // weight of the eligible keys above the range the prefix leaves open
  for (int shift = 32 - kDigitBits; shift >= 0; shift -= kDigitBits) {
    const uint32_t fixed = shift + kDigitBits >= 32 ? 0u : ~0u << (shift + kDigitBits);
    double acc[kDigits] = {};
    for_row(w, V, [&](float v, int32_t i) {
      const uint32_t key = __float_as_uint(v);
      if ((key & fixed) == prefix && eligible(v, i)) acc[(key >> shift) & (kDigits - 1)] += by_count ? 1.0 : v;
    });
    block_sum_digits(acc, tot);
    // Every thread walks the same totals to the same digit. Should rounding leave the target just
    // out of reach, the lowest non-empty digit is the cut.
    int chosen = -1, lowest = -1;
    for (int d = kDigits - 1; d >= 0; --d) {
      if (tot[d] == 0.0) continue;
      lowest = d;
      if (above + tot[d] >= target) {
        chosen = d;
        break;
      }
      above += tot[d];
    }
    if (chosen < 0) {
      chosen = lowest;
      above -= tot[lowest];
    }
    prefix |= uint32_t(chosen) << shift;
  }
  // Ties at the key: as many of the lowest ids as the target still needs.
  const float wcut = __uint_as_float(prefix);
  double need = by_count ? target - above : ceil((target - above) / double(wcut));
  need = fmax(need, 1.0);
  // The need-th eligible token with that key, in id order: contiguous id ranges per thread.
  const int32_t per = (V + int32_t(blockDim.x) - 1) / int32_t(blockDim.x);
  const int32_t lo = min(V, per * int32_t(threadIdx.x)), hi = min(V, lo + per);
  int32_t n_eq = 0;
  for (int32_t i = lo; i < hi; ++i) n_eq += __float_as_uint(w[i]) == prefix && eligible(w[i], i);
  int32_t all = 0;
  const int32_t before = block_exclusive_scan(n_eq, &all);
  __shared__ int32_t id_cut;
  if (threadIdx.x == 0) id_cut = INT32_MAX;  // fewer ties than needed (rounding): keep them all
  __syncthreads();
  if (need <= double(all) && double(before) < need && need <= double(before + n_eq)) {
    int32_t seen = before;
    for (int32_t i = lo; i < hi; ++i)
      if (__float_as_uint(w[i]) == prefix && eligible(w[i], i) && double(++seen) >= need) {
        id_cut = i;
        break;
      }
  }
  __syncthreads();
  return Cut{prefix, id_cut};
}

__device__ double uniform01(uint64_t seed, uint64_t step) {
  curandStatePhilox4_32_10_t st;
  curand_init(seed, step, 0, &st);
  const uint4 r = curand4(&st);
  return double(((uint64_t(r.x) << 32) | r.y) >> 11) * 0x1.0p-53;  // 53 bits, as engine::uniform01
}

// w: [V] scratch for the row (the weights at the temperature). Writes ids[row], or the row's probs.
// sampling_probs passes its output as the scratch too: no __restrict__ on work and probs.
__global__ void __launch_bounds__(kThreads) sample_kernel(const float* __restrict__ logits, int32_t V, const RowSampling* __restrict__ params,
                              float* work, int32_t* __restrict__ ids, float* probs) {
  const int64_t row = blockIdx.x;
  const float* l = logits + row * V;
  float* w = work + row * V;
  const RowSampling p = params[row];

  ArgMax best{-INFINITY, INT32_MAX};
  for_row(l, V, [&](float v, int32_t i) {
    if (better(ArgMax{v, i}, best)) best = ArgMax{v, i};
  });
  best = block_argmax(best);
  if (best.index == INT32_MAX) best.index = 0;  // every logit NaN: the CPU's argmax keeps id 0

  auto one_hot = [&](int32_t id) {
    if (ids && threadIdx.x == 0) ids[row] = id;
    if (probs)
      for (int32_t i = threadIdx.x; i < V; i += blockDim.x) probs[row * V + i] = i == id ? 1.0f : 0.0f;
  };
  if (p.temperature <= 0.0f || p.top_k == 1) return one_hot(best.index);

  // As filter_candidates: (l - top) / T in fp32, its exp correctly rounded to fp32, which is
  // glibc's expf on all but ~0.06% of inputs (those by one ulp): the filters see the CPU's weights.
  const float inv_t = 1.0f / p.temperature, top = best.value;
  int32_t n_cand = 0;
  for_row(l, V, [&](float li, int32_t i) {
    const float v = float(exp(double((li - top) * inv_t)));
    w[i] = v;
    n_cand += candidate(v, p.min_p);
  });
  n_cand = block_sum(n_cand);  // (its barriers also publish w)
  if (n_cand == 0) return one_hot(best.index);  // only with non-finite logits, as the CPU

  RowFilter f{p.min_p, p.top_k > 0 && p.top_k < n_cand, p.top_p < 1.0f, Cut{}, Cut{}};
  if (f.k_on)
    f.k_cut = radix_cut(w, V, true, double(p.top_k), [&](float v, int32_t) { return candidate(v, f.min_p); });
  if (f.p_on) {
    double mass = 0.0;
    for_row(w, V, [&](float v, int32_t i) {
      if (after_top_k(v, i, f)) mass += v;
    });
    const double target = double(p.top_p) * block_sum(mass);
    f.p_cut = radix_cut(w, V, false, target, [&](float v, int32_t i) { return after_top_k(v, i, f); });
  }

  // The kept mass per contiguous id range, scanned: the ranges tile [0, total) in id order.
  const int32_t per = (V + int32_t(blockDim.x) - 1) / int32_t(blockDim.x);
  const int32_t lo = min(V, per * int32_t(threadIdx.x)), hi = min(V, lo + per);
  double mass = 0.0;
  for (int32_t i = lo; i < hi; ++i)
    if (kept(w[i], i, f)) mass += w[i];
  double total = 0.0;
  const double start = block_exclusive_scan(mass, &total);

  if (probs) {
    for (int32_t i = threadIdx.x; i < V; i += blockDim.x)
      probs[row * V + i] = kept(w[i], i, f) ? float(double(w[i]) / total) : 0.0f;
    return;
  }
  __shared__ double starts[kThreads + 1];
  __shared__ double u;
  starts[threadIdx.x] = start;
  if (threadIdx.x == 0) {
    starts[blockDim.x] = total;
    u = uniform01(p.seed, p.step) * total;
    if (u >= total) u = nextafter(total, 0.0);  // the product can round up to total
  }
  __syncthreads();
  if (starts[threadIdx.x] <= u && u < starts[threadIdx.x + 1]) {  // exactly one range holds u
    double cum = start;
    int32_t id = -1;
    for (int32_t i = lo; i < hi; ++i) {
      if (!kept(w[i], i, f)) continue;
      id = i;  // the last kept one, should rounding carry u past the range's own sum
      cum += w[i];
      if (u < cum) break;
    }
    ids[row] = id;
  }
}

// About one round of float4 loads a thread (32 tokens), a warp at least.
int row_threads(int64_t V) {
  return int(std::min<int64_t>(kThreads, std::max<int64_t>(32, (V / (4 * kLoadsInFlight) + 31) / 32 * 32)));
}

void check_shape(const char* op, int64_t B, int64_t V) {
  if (B < 0 || B > INT32_MAX || V <= 0 || V > INT32_MAX) fail("cuda::{}: bad logits shape [{}, {}]", op, B, V);
}

}  // namespace

size_t sampling_workspace_bytes(int64_t B, int64_t V) { return size_t(B) * size_t(V) * sizeof(float); }

void sample(const float* logits, int64_t B, int64_t V, const RowSampling* params, void* workspace, int32_t* ids,
            Stream s) {
  check_shape("sample", B, V);
  if (B == 0) return;
  sample_kernel<<<int(B), row_threads(V), 0, stream_of(s)>>>(logits, int32_t(V), params, static_cast<float*>(workspace),
                                                        ids, nullptr);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

void sampling_probs(const float* logits, int64_t B, int64_t V, const RowSampling* params, float* probs, Stream s) {
  check_shape("sampling_probs", B, V);
  if (B == 0) return;
  // The weights are computed in probs itself, then overwritten by the normalized probabilities.
  sample_kernel<<<int(B), row_threads(V), 0, stream_of(s)>>>(logits, int32_t(V), params, probs, nullptr, probs);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
