#include "ops/cuda/sampling.h"

#include <curand_kernel.h>

#include <algorithm>

#include "ops/cuda/check.cuh"
#include "ops/cuda/small_ops_reduce.cuh"

// One block per row. The filters never sort: each cut (top-k, top-p) is found by a radix select
// over the bits of the row's weights (positive floats order as their bit patterns), 4 bits a pass,
// walking from the most likely end until the count (top-k) or the mass (top-p) reaches its target;
// ties at the cut keep the lower ids, as the CPU's (weight desc, id asc) order does. A top-k or
// top-p row runs them on a copy of its candidates (compact_candidates: the tokens down to a binade
// bound of the cut, in id order), the others on the whole row. A row is read 8 float4 loads per
// thread at a time: a block's pass over 154,880 logits is a chain of memory round trips, ~300
// with one scalar load at a time (docs/PERFORMANCE.md, session 8).

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

// The weight of logit li as filter_candidates computes it: (l - top) / T in fp32, its exp correctly
// rounded to fp32, which is glibc's expf on all but ~0.06% of inputs (those by one ulp): the
// filters see the CPU's weights.
__device__ __forceinline__ float weight_of(float li, float top, float inv_t) {
  return float(exp(double((li - top) * inv_t)));
}

// Which binade of the weight a logit falls in, estimated from the logit alone (fp32: an edge may
// come out one binade off): 0 for (1/2, 1], b for (2^-(b+1), 2^-b], 63 for anything smaller (and
// NaN, -inf).
constexpr int kBinades = 64;
__device__ __forceinline__ int binade_of(float li, float top, float inv_t) {
  const float z = (top - li) * inv_t * 1.44269504f;  // -log2(weight)
  return z < float(kBinades - 1) ? max(int(z), 0) : kBinades - 1;
}

// f(r[i], i) for i in [lo, hi) in order, float4 loads kLoadsInFlight at a time where r + lo .. is
// 16-byte aligned (a scalar head and tail around them).
template <class F>
__device__ __forceinline__ void for_range(const float* r, int32_t lo, int32_t hi, F&& f) {
  int32_t i = lo;
  for (; i < hi && (reinterpret_cast<uintptr_t>(r + i) & 15) != 0; ++i) f(r[i], i);
  for (; i + 4 * kLoadsInFlight <= hi; i += 4 * kLoadsInFlight) {
    float4 v[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) v[u] = reinterpret_cast<const float4*>(r + i)[u];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      f(v[u].x, i + 4 * u);
      f(v[u].y, i + 4 * u + 1);
      f(v[u].z, i + 4 * u + 2);
      f(v[u].w, i + 4 * u + 3);
    }
  }
  for (; i < hi; ++i) f(r[i], i);
}

// The row's tokens per binade of their weight (estimated from the logits): hist[b] their count and
// amount[b] the sum of amount_of(li) over them (integers: the same sums in any order). Every thread
// gets both (shared).
template <class Amount>
__device__ void count_binades(const float* l, int32_t V, float top, float inv_t, int32_t (&hist)[kBinades],
                              uint64_t (&amount)[kBinades], Amount&& amount_of) {
  __shared__ int32_t counts[kThreads / 32][kBinades];
  __shared__ uint64_t sums[kThreads / 32][kBinades];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  for (int b = threadIdx.x; b < n_warps * kBinades; b += blockDim.x) {
    counts[b / kBinades][b % kBinades] = 0;
    sums[b / kBinades][b % kBinades] = 0;
  }
  __syncthreads();
  // Shared-memory adds per token; a warp whose tokens share one binade (ties) adds once.
  for_row(l, V, [&](float li, int32_t) {
    const uint64_t a = amount_of(li);
    const int b = binade_of(li, top, inv_t);
    const unsigned active = __activemask();
    if (active == kFullWarp && __all_sync(kFullWarp, b == __shfl_sync(kFullWarp, b, 0))) {
      const uint64_t t = warp_sum(a);
      if (lane == 0) {
        atomicAdd(&counts[warp][b], 32);
        if (t) atomicAdd(reinterpret_cast<unsigned long long*>(&sums[warp][b]), (unsigned long long)t);
      }
    } else {
      atomicAdd(&counts[warp][b], 1);
      if (a) atomicAdd(reinterpret_cast<unsigned long long*>(&sums[warp][b]), (unsigned long long)a);
    }
  });
  __syncthreads();
  for (int b = threadIdx.x; b < kBinades; b += blockDim.x) {
    int32_t c = 0;
    uint64_t m = 0;
    for (int k = 0; k < n_warps; ++k) {
      c += counts[k][b];
      m += sums[k][b];
    }
    hist[b] = c;
    amount[b] = m;
  }
  __syncthreads();
}

// The tokens of binades 0 .. last in id order: exact weights to w[0, n), ids to id_of[0, n);
// returns n, and *n_cand = the min-p candidates among them. Contiguous id ranges per thread, their
// offsets by a block scan.
__device__ int32_t copy_binades(const float* l, int32_t V, float top, float inv_t, int last, float min_p, float* w,
                                int32_t* id_of, int32_t* n_cand) {
  const int32_t per = (V + int32_t(blockDim.x) - 1) / int32_t(blockDim.x);
  const int32_t lo = min(V, per * int32_t(threadIdx.x)), hi = min(V, lo + per);
  int32_t mine = 0;
  for_range(l, lo, hi, [&](float li, int32_t) { mine += binade_of(li, top, inv_t) <= last; });
  int32_t all = 0;
  int32_t at = block_exclusive_scan(mine, &all);
  int32_t cand = 0;
  for_range(l, lo, hi, [&](float li, int32_t i) {
    if (binade_of(li, top, inv_t) > last) return;
    const float v = weight_of(li, top, inv_t);
    w[at] = v;
    id_of[at] = i;
    ++at;
    cand += candidate(v, min_p);
  });
  *n_cand = block_sum(cand);  // (its barriers also publish w and id_of)
  return all;
}

// A row's candidates for the filters without the whole row's weights: the tokens of the binades
// down to one past the binade where the cut must fall (one binade of margin for the estimate's
// edges and for weights that tie across logits), copied in id order (copy_binades). Every token a
// filter can keep is among them. Returns n, or -1 when no binade bounds the cut or more than `cap`
// tokens would be copied (rows of near ties): the caller filters the whole row.
//  - top-k (k > 0): the binade where the count reaches k; top-k keeps the k largest weights, and
//    the min-p and top-p cuts fall inside them. *n_cand counts the min-p candidates among the copy:
//    all of the row's when a copied token fails min-p (every smaller weight fails too); when none
//    fails, n_cand >= k and the row's count can only exceed k where the copy holds more than k, so
//    top_k < n_cand decides as the whole row's count would.
//  - top-p alone: the row's min-p count (*n_cand) and mass (*mass, summed as the whole-row filter
//    sums it: the same target) are computed in the counting pass; the cut falls where the mass of
//    the min-p candidates counted from the top (each weight truncated to 2^-32: a lower bound)
//    reaches top_p x mass.
constexpr double kMassUnit = 4294967296.0;  // 2^32: fixed-point weights of the top-p bound
__device__ int32_t compact_candidates(const float* l, int32_t V, float top, float inv_t, const RowSampling& p,
                                      int32_t cap, float* w, int32_t* id_of, int32_t* n_cand, double* mass) {
  __shared__ int32_t hist[kBinades];
  __shared__ uint64_t amount[kBinades];
  __shared__ int s_last;
  const int lane = threadIdx.x & 31;
  const bool by_count = p.top_k > 0;
  double m = 0.0;
  int32_t c = 0;
  count_binades(l, V, top, inv_t, hist, amount, [&](float li) -> uint64_t {
    if (by_count) return 0;
    const float v = weight_of(li, top, inv_t);
    if (!candidate(v, p.min_p)) return 0;
    m += v;
    ++c;
    return uint64_t(double(v) * kMassUnit);
  });
  if (!by_count) {
    *mass = block_sum(m);
    *n_cand = block_sum(c);
  }
  if (threadIdx.x < 32) {  // lane j holds binades 2j, 2j + 1; the first binade where the target is reached
    double v[2];
    for (int h = 0; h < 2; ++h) {
      const int b = 2 * lane + h;
      v[h] = by_count ? double(hist[b]) : b < kBinades - 1 ? double(amount[b]) : 0.0;
    }
    double incl = v[0] + v[1];
    for (int o = 1; o < 32; o <<= 1) {
      const double up = __shfl_up_sync(kFullWarp, incl, o);
      if (lane >= o) incl += up;
    }
    const double before = incl - v[0] - v[1];
    const double target = by_count ? double(p.top_k) : double(p.top_p) * *mass * kMassUnit;
    const unsigned reach = __ballot_sync(kFullWarp, incl >= target);
    int last = kBinades;  // never reached: no binade bounds the cut
    if (reach) {
      const int f = __ffs(reach) - 1;
      const double bf = __shfl_sync(kFullWarp, before, f), v0 = __shfl_sync(kFullWarp, v[0], f);
      last = (bf + v0 >= target ? 2 * f : 2 * f + 1) + 1;
    }
    if (lane == 0) s_last = last;
  }
  __syncthreads();
  const int last = s_last;
  if (last >= kBinades - 1) return -1;
  int32_t n = 0;
  for (int b = 0; b <= last; ++b) n += hist[b];
  if (n > cap) return -1;
  int32_t copied_cand = 0;
  n = copy_binades(l, V, top, inv_t, last, p.min_p, w, id_of, &copied_cand);
  if (by_count) *n_cand = copied_cand;
  return n;
}

// w: [V] scratch for the row (the weights at the temperature). Writes ids[row], or the row's probs.
// work and probs are distinct (sampling_probs has its own scratch).
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

  // The filters run on n tokens: a top-k or top-p row's candidates copied in id order
  // (compact_candidates; index j stands for id_of[j], and j's order is the ids'), or the whole row
  // (j is the id).
  const float inv_t = 1.0f / p.temperature, top = best.value;
  const int32_t cap = V / 2;
  int32_t* id_of = reinterpret_cast<int32_t*>(w + (V - cap));
  int32_t n_cand = 0;
  double p_mass = -1.0;  // top-p alone, copied: the whole row's mass the target is taken of
  int32_t n = p.top_k > 0 || p.top_p < 1.0f
                  ? compact_candidates(l, V, top, inv_t, p, cap, w, id_of, &n_cand, &p_mass)
                  : -1;
  if (n < 0) {
    n = V;
    n_cand = 0;
    p_mass = -1.0;
    id_of = nullptr;
    for_row(l, V, [&](float li, int32_t i) {
      const float v = weight_of(li, top, inv_t);
      w[i] = v;
      n_cand += candidate(v, p.min_p);
    });
    n_cand = block_sum(n_cand);  // (its barriers also publish w)
  }
  if (n_cand == 0) return one_hot(best.index);  // only with non-finite logits, as the CPU
  RowFilter f{p.min_p, p.top_k > 0 && p.top_k < n_cand, p.top_p < 1.0f, Cut{}, Cut{}};
  if (f.k_on)
    f.k_cut = radix_cut(w, n, true, double(p.top_k), [&](float v, int32_t) { return candidate(v, f.min_p); });
  if (f.p_on) {
    double mass = 0.0;
    if (p_mass < 0.0)
      for_row(w, n, [&](float v, int32_t i) {
        if (after_top_k(v, i, f)) mass += v;
      });
    const double target = double(p.top_p) * (p_mass < 0.0 ? block_sum(mass) : p_mass);
    f.p_cut = radix_cut(w, n, false, target, [&](float v, int32_t i) { return after_top_k(v, i, f); });
  }

  // The kept mass per contiguous range of j, scanned: the ranges tile [0, total) in id order.
  const int32_t per = (n + int32_t(blockDim.x) - 1) / int32_t(blockDim.x);
  const int32_t lo = min(n, per * int32_t(threadIdx.x)), hi = min(n, lo + per);
  double mass = 0.0;
  for_range(w, lo, hi, [&](float v, int32_t j) {
    if (kept(v, j, f)) mass += v;
  });
  double total = 0.0;
  const double start = block_exclusive_scan(mass, &total);

  if (probs) {
    if (!id_of) {
      for (int32_t i = threadIdx.x; i < V; i += blockDim.x)
        probs[row * V + i] = kept(w[i], i, f) ? float(double(w[i]) / total) : 0.0f;
      return;
    }
    for (int32_t i = threadIdx.x; i < V; i += blockDim.x) probs[row * V + i] = 0.0f;
    __syncthreads();
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x)
      if (kept(w[j], j, f)) probs[row * V + id_of[j]] = float(double(w[j]) / total);
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
    for (int32_t j = lo; j < hi; ++j) {
      if (!kept(w[j], j, f)) continue;
      id = j;  // the last kept one, should rounding carry u past the range's own sum
      cum += w[j];
      if (u < cum) break;
    }
    ids[row] = id_of && id >= 0 ? id_of[id] : id;
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

void sampling_probs(const float* logits, int64_t B, int64_t V, const RowSampling* params, void* workspace,
                    float* probs, Stream s) {
  check_shape("sampling_probs", B, V);
  if (B == 0) return;
  sample_kernel<<<int(B), row_threads(V), 0, stream_of(s)>>>(logits, int32_t(V), params, static_cast<float*>(workspace),
                                                        nullptr, probs);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
