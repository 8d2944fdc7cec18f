// Top-k selection per row by radix select over an order-preserving 32-bit key of each score: three
// histogram passes (11 + 11 + 10 bits) find the exact k-th largest key; a last pass writes every
// index above it and, of the indices equal to it, the lowest ones (the CPU top_k's tie rule, found
// by a second radix select over the tied indices when the ties straddle the boundary).
//
// Two paths:
//  - rows: one block per row runs the whole selection (many rows, or short ones).
//  - spans (with a workspace, long rows): each row is shared among blocks, a run of spans of kSpan
//    scores each (more rows: fewer, longer runs, about one wave of blocks in all). (1) every block
//    adds its share's histogram of the key's top 11 bits into the row's histogram in global
//    memory; (2) every block finds the boundary digit d from that histogram,
//    writes the indices whose digit is above d straight to the output (they are in the top-k
//    whatever the rest holds) and appends those with digit d to the row's candidate list. The
//    last block of the row to finish (a counter) selects the remaining k - above among the
//    candidates with the rows path's block selection, from shared memory when they fit, and
//    leaves the row's histogram and counters zeroed for the next call. When the candidates
//    overflow their buffer (massive ties), that block selects over the whole row instead.
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"

namespace sparsemla::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxBins = 2048;
constexpr int kPerThread = 4;                     // scores per thread in the span kernels
constexpr int kSpan = kThreads * kPerThread;      // scores per block on the span path
constexpr int kTopShift = 21;                     // the first digit: the key's top 11 bits
constexpr int kStagedCandidates = 6144;           // candidates the last block stages in shared memory
constexpr int64_t kCandidatesPerRow = 16384;      // candidate buffer per row (global memory)

// Larger float -> larger unsigned key; -0 and +0 are the same key (the CPU compares them equal).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

using Scan = cub::BlockScan<uint32_t, kThreads>;

struct SelectSmem {
  typename Scan::TempStorage scan;
  uint32_t hist[kMaxBins];
  uint32_t bucket, above, n_gt, n_eq;
};

// Per row of the span path, in global memory (zero between calls).
struct RowState {
  uint32_t hist[kMaxBins];  // counts of the first digit over the row
  uint32_t n_win;           // indices written so far with a digit above the boundary
  uint32_t n_cand;          // candidates appended so far (may exceed the buffer)
  uint32_t n_done;          // blocks of the row finished
  uint32_t pad;
};

// Over the histogram sm.hist of nb bins (nb = 1024 or 2048), the bin holding the `rank`-th largest
// (1-based) key: sm.bucket, and sm.above = the count in the bins above it. Ends with a barrier.
__device__ void find_bucket(SelectSmem& sm, int nb, uint32_t rank) {
  const int tid = threadIdx.x;
  // Counts from the top bin down: thread j holds bins nb-1-2j and nb-2-2j (or one bin when nb = 1024).
  const int per = nb / kThreads;
  const int hi = nb - 1 - per * tid;
  const uint32_t c_hi = sm.hist[hi], c_lo = per == 2 ? sm.hist[hi - 1] : 0u;
  uint32_t incl;
  Scan(sm.scan).InclusiveSum(c_hi + c_lo, incl);
  const uint32_t excl = incl - c_hi - c_lo;
  if (excl < rank && rank <= incl) {
    if (excl + c_hi >= rank) {
      sm.bucket = uint32_t(hi);
      sm.above = excl;
    } else {
      sm.bucket = uint32_t(hi - 1);
      sm.above = excl + c_hi;
    }
  }
  __syncthreads();
}

// Finds the `rank`-th largest (1-based) of the keys key_of(i) for i < n with accept(i), by three
// radix passes (from `first_pass` on, when every accepted key starts with the digits in `prefix`).
// Returns the key; *count_eq receives how many accepted keys equal it and *need_eq how many of
// those are within the rank.
template <class KeyOf, class Accept>
__device__ uint32_t radix_select(SelectSmem& sm, int n, uint32_t rank, KeyOf key_of, Accept accept, uint32_t* need_eq,
                                 uint32_t* count_eq, int first_pass = 0, uint32_t prefix = 0) {
  const int tid = threadIdx.x;
  uint32_t mask = first_pass == 0 ? 0u : ~0u << (32 - 11 * first_pass), remaining = rank, last = 0;
#pragma unroll 1
  for (int pass = first_pass; pass < 3; ++pass) {
    const int nb = pass == 2 ? 1024 : 2048, shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
    for (int b = tid; b < nb; b += kThreads) sm.hist[b] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += kThreads) {
      if (!accept(i)) continue;
      const uint32_t key = key_of(i);
      if ((key & mask) == prefix) atomicAdd(&sm.hist[(key >> shift) & uint32_t(nb - 1)], 1u);
    }
    __syncthreads();
    find_bucket(sm, nb, remaining);
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

// The k best of items 0..n) (n >= k) by (value desc, index asc), value_of(i) and index_of(i),
// written to out[0..k) in no particular order. `top_digit`: every key's first digit, when known.
template <class ValueOf, class IndexOf>
__device__ void block_top_k(SelectSmem& sm, int n, int k, ValueOf value_of, IndexOf index_of, int32_t* out,
                            int top_digit = -1) {
  const int tid = threadIdx.x;
  auto value_key = [&](int i) { return order_key(value_of(i)); };
  auto all = [](int) { return true; };
  uint32_t need_eq, count_eq;
  const uint32_t thr = top_digit < 0 ? radix_select(sm, n, uint32_t(k), value_key, all, &need_eq, &count_eq)
                                     : radix_select(sm, n, uint32_t(k), value_key, all, &need_eq, &count_eq, 1,
                                                    uint32_t(top_digit) << kTopShift);
  const uint32_t n_gt = uint32_t(k) - need_eq;
  // Among the values equal to the threshold, the need_eq lowest indices: all of them when they fit,
  // else those up to the need_eq-th smallest index (a second selection, on inverted indices).
  uint32_t idx_thr = 0;  // inverted-index threshold: take tied i with ~index >= idx_thr
  if (count_eq != need_eq) {
    uint32_t need2, count2;
    idx_thr = radix_select(
        sm, n, need_eq, [&](int i) { return ~uint32_t(index_of(i)); }, [&](int i) { return value_key(i) == thr; },
        &need2, &count2);
  }
  if (tid == 0) {
    sm.n_gt = 0;
    sm.n_eq = 0;
  }
  __syncthreads();
  // Slots by one shared atomic per warp (thousands of winners on one counter would serialize).
  const int lane = tid % 32;
  const uint32_t lanes_below = (1u << lane) - 1u;
  for (int i0 = 0; i0 < n; i0 += kThreads) {
    const int i = i0 + tid;
    bool gt = false, eq = false;
    if (i < n) {
      const uint32_t key = value_key(i);
      gt = key > thr;
      eq = key == thr && ~uint32_t(index_of(i)) >= idx_thr;
    }
    const uint32_t m_gt = __ballot_sync(0xffffffffu, gt), m_eq = __ballot_sync(0xffffffffu, eq);
    uint32_t base_gt = 0, base_eq = 0;
    if (lane == 0) {
      if (m_gt) base_gt = atomicAdd(&sm.n_gt, uint32_t(__popc(m_gt)));
      if (m_eq) base_eq = atomicAdd(&sm.n_eq, uint32_t(__popc(m_eq)));
    }
    base_gt = __shfl_sync(0xffffffffu, base_gt, 0);
    base_eq = __shfl_sync(0xffffffffu, base_eq, 0);
    if (gt) out[base_gt + __popc(m_gt & lanes_below)] = index_of(i);
    if (eq) out[n_gt + base_eq + __popc(m_eq & lanes_below)] = index_of(i);
  }
  __syncthreads();
}

// Rows with n <= k list 0 .. n-1, then -1; `part` of `parts` blocks of the row writes its share.
__device__ void write_short_row(int n, int k, int32_t* out, int part, int parts) {
  for (int i = part * kThreads + threadIdx.x; i < k; i += parts * kThreads) out[i] = i < n ? i : -1;
}

__global__ void __launch_bounds__(kThreads) topk_rows_kernel(const float* scores, int64_t stride, const int32_t* nn,
                                                             int k, int32_t* out) {
  __shared__ SelectSmem sm;
  const int t = blockIdx.x;
  const int n = nn[t];
  int32_t* o = out + int64_t(t) * k;
  if (n <= k) return write_short_row(n, k, o, 0, 1);
  const float* row = scores + int64_t(t) * stride;
  block_top_k(sm, n, k, [&](int i) { return row[i]; }, [](int i) { return i; }, o);
}

// Span path, step 1: the row histograms of the first digit. Block x of row t takes spans
// x * spans_per_block .. +spans_per_block of the row.   state: [T]
__global__ void __launch_bounds__(kThreads) topk_span_hist_kernel(const float* scores, int64_t stride,
                                                                  const int32_t* nn, int k, int spans_per_block,
                                                                  RowState* state) {
  __shared__ uint32_t hist[kMaxBins];
  const int t = blockIdx.y, tid = threadIdx.x;
  const int n = nn[t];
  const int begin = blockIdx.x * spans_per_block * kSpan, end = min(n, begin + spans_per_block * kSpan);
  if (n <= k || begin >= n) return;
  const float* row = scores + int64_t(t) * stride;
  for (int b = tid; b < kMaxBins; b += kThreads) hist[b] = 0;
  __syncthreads();
  for (int span = begin; span < end; span += kSpan) {
    float v[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = span + j * kThreads + tid;
      v[j] = i < end ? row[i] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j)
      if (span + j * kThreads + tid < end) atomicAdd(&hist[order_key(v[j]) >> kTopShift], 1u);
  }
  __syncthreads();
  uint32_t* g = state[t].hist;
  for (int b = tid; b < kMaxBins; b += kThreads)
    if (hist[b]) atomicAdd(&g[b], hist[b]);
}

// Span path, step 2: the indices above the boundary digit out, those on it to the candidates, and
// the row's last block selects among the candidates.
//   cand_val, cand_idx: [T, kCandidatesPerRow]   dynamic shared memory: kStagedCandidates * 8 bytes
__global__ void __launch_bounds__(kThreads) topk_span_select_kernel(const float* scores, int64_t stride,
                                                                    const int32_t* nn, int k, int spans_per_block,
                                                                    RowState* state,
                                                                    float* cand_val, int32_t* cand_idx,
                                                                    int64_t cand_cap, int32_t* out) {
  __shared__ SelectSmem sm;
  __shared__ uint32_t s_base_win, s_base_cand;
  __shared__ bool s_last;
  extern __shared__ __align__(16) unsigned char staged[];
  const int t = blockIdx.y, tid = threadIdx.x;
  const int n = nn[t];
  int32_t* o = out + int64_t(t) * k;
  if (n <= k) return write_short_row(n, k, o, blockIdx.x, gridDim.x);
  RowState& st = state[t];
  const float* row = scores + int64_t(t) * stride;
  float* cv = cand_val + int64_t(t) * cand_cap;
  int32_t* ci = cand_idx + int64_t(t) * cand_cap;

  const int begin = blockIdx.x * spans_per_block * kSpan, end = min(n, begin + spans_per_block * kSpan);
  float v[kPerThread];
  bool live[kPerThread];  // positions past the block's share take no part
  auto load_span = [&](int span) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = span + j * kThreads + tid;
      live[j] = i < end;
      v[j] = live[j] ? row[i] : 0.0f;
    }
  };
  load_span(begin);  // in flight while the boundary is found
  // The boundary digit: the row's histogram is complete (the previous kernel).
  for (int b = tid; b < kMaxBins; b += kThreads) sm.hist[b] = st.hist[b];
  __syncthreads();
  find_bucket(sm, kMaxBins, uint32_t(k));
  const uint32_t digit = sm.bucket, above = sm.above;

  for (int span = begin; span < end; span += kSpan) {
    if (span != begin) load_span(span);
    uint32_t d[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) d[j] = order_key(v[j]) >> kTopShift;
    uint32_t n_win = 0, n_cand = 0;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      n_win += live[j] && d[j] > digit;
      n_cand += live[j] && d[j] == digit;
    }
    // Offsets of this thread's entries in the span's share (both counts packed: each <= kSpan).
    uint32_t off, total;
    Scan(sm.scan).ExclusiveSum(n_win | (n_cand << 16), off, total);
    if (tid == 0) {
      s_base_win = (total & 0xffffu) ? atomicAdd(&st.n_win, total & 0xffffu) : 0u;
      s_base_cand = (total >> 16) ? atomicAdd(&st.n_cand, total >> 16) : 0u;
    }
    __syncthreads();
    uint32_t w = s_base_win + (off & 0xffffu), c = s_base_cand + (off >> 16);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if (!live[j]) continue;
      const int i = span + j * kThreads + tid;
      if (d[j] > digit) {
        o[w++] = i;
      } else if (d[j] == digit) {
        if (c < cand_cap) {
          cv[c] = v[j];
          ci[c] = i;
        }
        ++c;
      }
    }
    __syncthreads();  // the scan storage and the bases are reused by the next span
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&st.n_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;

  // The last block of the row: every other block's entries are visible (their fences came first).
  __threadfence();
  const int n_c = int(__ldcg(&st.n_cand));
  const int need = k - int(above);  // 1 <= need <= n_c
  if (n_c <= kStagedCandidates) {
    float* sv = reinterpret_cast<float*>(staged);
    int32_t* si = reinterpret_cast<int32_t*>(sv + kStagedCandidates);
    constexpr int kPer = (kStagedCandidates + kThreads - 1) / kThreads;
    float v[kPer];
    int32_t x[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {  // every load in flight at once
      const int i = j * kThreads + tid;
      if (i < n_c) {
        v[j] = __ldcg(cv + i);
        x[j] = __ldcg(ci + i);
      }
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = j * kThreads + tid;
      if (i < n_c) {
        sv[i] = v[j];
        si[i] = x[j];
      }
    }
    __syncthreads();
    block_top_k(sm, n_c, need, [&](int i) { return sv[i]; }, [&](int i) { return si[i]; }, o + above, int(digit));
  } else if (n_c <= cand_cap) {
    block_top_k(sm, n_c, need, [&](int i) { return __ldcg(cv + i); }, [&](int i) { return __ldcg(ci + i); },
                o + above, int(digit));
  } else {  // too many candidates for the buffer: the whole row, as the rows path selects it
    block_top_k(sm, n, k, [&](int i) { return row[i]; }, [](int i) { return i; }, o);
  }
  // Leave the row's state zeroed for the next call.
  for (int b = tid; b < kMaxBins; b += kThreads) st.hist[b] = 0;
  if (tid == 0) {
    st.n_win = 0;
    st.n_cand = 0;
    st.n_done = 0;
  }
}

}  // namespace

void top_k(const float* scores, int64_t T, int64_t stride, const int32_t* n, int k, int32_t* out, Stream s,
           TopKWorkspace* ws) {
  if (T == 0) return;
  if (k <= 0) fail("top_k: k must be > 0, got {}", k);
  auto st = static_cast<cudaStream_t>(s);
  const int spans = ceil_div(stride, kSpan);
  // Spans pay off once a row is long enough to share among blocks.
  if (ws && spans >= 2 && T <= 65535) {
    if (ws->sm_count == 0) {
      int dev = 0;
      SPARSEMLA_CUDA_CHECK(cudaGetDevice(&dev));
      SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&ws->sm_count, cudaDevAttrMultiProcessorCount, dev));
    }
    const int64_t cap = std::min<int64_t>(stride, kCandidatesPerRow);
    if (T > ws->rows || cap > ws->cap) {  // grown (both ways at once); the state rows start zero
      ws->rows = std::max<int64_t>(ws->rows, T);
      ws->cap = std::max(ws->cap, cap);
      ws->candidates = DeviceBuffer(size_t(ws->rows) * (sizeof(RowState) + size_t(ws->cap) * 8));
      SPARSEMLA_CUDA_CHECK(cudaMemsetAsync(ws->candidates.get(), 0, size_t(ws->rows) * sizeof(RowState), st));
    }
    auto* state = ws->candidates.as<RowState>();
    float* cv = reinterpret_cast<float*>(state + ws->rows);
    auto* ci = reinterpret_cast<int32_t*>(cv + size_t(ws->rows) * size_t(ws->cap));
    // About one wave of blocks (two of 1024 threads per SM): a row gets fewer, longer shares as rows
    // are added, so that each block's fixed costs (the boundary search, the counters) stay few.
    const int parts = int(std::clamp<int64_t>((2 * int64_t(ws->sm_count) + T - 1) / T, 1, spans));
    const int spans_per_block = ceil_div(spans, parts);
    const dim3 grid{unsigned(ceil_div(spans, spans_per_block)), unsigned(T)};
    topk_span_hist_kernel<<<grid, kThreads, 0, st>>>(scores, stride, n, k, spans_per_block, state);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
    const int smem = kStagedCandidates * 8;
    SPARSEMLA_CUDA_CHECK(cudaFuncSetAttribute(topk_span_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    topk_span_select_kernel<<<grid, kThreads, smem, st>>>(scores, stride, n, k, spans_per_block, state, cv, ci,
                                                          ws->cap, out);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
    return;
  }
  topk_rows_kernel<<<unsigned(T), kThreads, 0, st>>>(scores, stride, n, k, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
