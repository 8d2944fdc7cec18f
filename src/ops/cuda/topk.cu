// Top-k selection per row, written in ascending position order. A radix select over an
// order-preserving 32-bit key of each score finds the k-th largest key thr, digit by digit (11 + 11 +
// 10 bits), and need_eq: how many of the keys equal to thr are taken (the CPU top_k gives ties at
// the boundary to the lower index). An ordered compaction then writes every position whose key is
// above thr and the first need_eq whose key equals it, each at its rank among the selected (a block
// scan of per-thread counts), so the attention reads a token's positions in one order on every run
// without a sort.
//
// Three paths:
//  - rows: one block per row runs the whole selection (many rows, or short ones).
//  - team (with a workspace, long rows, few enough that one block per span of every row fits on the
//    device at once): one cooperative launch; each block holds its span's keys in registers, the
//    row's blocks add each digit's histogram in global memory and meet at a barrier (an arrival
//    count, no block waiting on another's serial work), and each finds the digit itself. After two
//    digits, the keys on thr's 22-bit prefix are usually few: the blocks list them, and after a third
//    barrier each finds thr and its own output offset from the list; otherwise (heavy ties) the
//    last digit and the blocks' counts take two more barriers. Each block writes its own positions.
//    Measured on an H200: 10.8 us for a row of 131K scores (the span path: 13.8).
//  - spans (with a workspace, long rows the team path does not take): each row is shared among
//    blocks, a run of spans of kSpan scores each (more rows: fewer, longer runs, about one wave of blocks in all). Three launches
//    over the row's blocks: (1) the histogram of the key's first digit, added into the row's
//    histogram in global memory; (2) every block finds thr's first digit from it and adds the
//    histogram of the second digit over the keys that start with it; (3) every block finds thr's
//    first 22 bits (P), adds the histogram of the last digit over the keys with prefix P, and writes
//    its share of two bit masks over the row: keys whose first 22 bits are above P (selected
//    whatever their last digit) and keys with prefix P (the boundary). The row's last block (a
//    counter) finds thr from the last histogram, splits the boundary into keys above, equal to and
//    below thr (without reading a score when every boundary key is thr, as in a run of ties),
//    compacts the masks in order with the output slots spread over its threads (compact_slots),
//    and leaves the row's histograms and counter zeroed for the next call. The three launches are
//    chained by programmatic dependent launch (pdl.cuh): each one's blocks are scheduled while the
//    one before drains, and the second and third load their first scores before they wait.
//    Measured on an H200 (docs/PERFORMANCE.md): each dependent step of the last block costs
//    0.4-1 us, so that block's serial work (~5 us) and the three launches set a long row's time.
// Ties cost little on either path: a warp whose keys share a histogram bin adds them with one
// atomic, and the compaction stops once the k positions are written.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/pdl.cuh"

namespace sparsemla::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxBins = 2048;
constexpr int kPerThread = 4;                 // scores per thread per span
constexpr int kSpan = kThreads * kPerThread;  // scores per span (the span path's unit of work)
constexpr int kWordsPerThread = 4;            // mask words per thread per round of the span path's compaction

// The digits of a key: pass 0 its bits 31..21, pass 1 bits 20..10, pass 2 bits 9..0.
__host__ __device__ constexpr int digit_shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
__host__ __device__ constexpr int digit_bins(int pass) { return pass == 2 ? 1024 : 2048; }
// The key bits fixed by the passes before `pass`.
__host__ __device__ constexpr uint32_t prefix_mask(int pass) { return pass == 0 ? 0u : ~0u << digit_shift(pass - 1); }

// Larger float -> larger unsigned key; -0 and +0 are the same key (the CPU compares them equal).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// hist[bin] += 1 for every lane with `live`: one shared atomic for the warp when all its live lanes
// share a bin (a run of equal scores would otherwise put the whole warp's atomics on one address),
// else one per lane (a shuffle and a vote; __match_any_sync costs more than the atomics it saves on
// scattered bins). Every lane of the warp calls it.
__device__ __forceinline__ void count_bin(uint32_t* hist, uint32_t bin, bool live) {
  const uint32_t active = __ballot_sync(0xffffffffu, live);
  if (active == 0) return;
  const int leader = __ffs(active) - 1;
  const uint32_t leader_bin = __shfl_sync(0xffffffffu, bin, leader);
  if (__all_sync(0xffffffffu, !live || bin == leader_bin)) {
    if (int(threadIdx.x % 32) == leader) atomicAdd(&hist[bin], uint32_t(__popc(active)));
  } else if (live) {
    atomicAdd(&hist[bin], 1u);
  }
}

constexpr int kWarps = kThreads / 32;

// Exclusive prefix sum of v over the block's threads, and the block's total: a shuffle scan per warp,
// then every warp scans the warp totals itself (one barrier). As fast as cub's raking block scan on
// an H200 (~0.4 us a boundary search at 1024 threads; cub's warp-scans variant took twice that) with
// 256 bytes of shared memory instead of 8 KB, which the span path's compaction uses. `totals`:
// kWarps values of shared memory, free again after the next barrier.
template <class T>
__device__ __forceinline__ T block_exclusive_sum(T v, T* totals, T* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) totals[warp] = x;
  __syncthreads();
  T w = lane < kWarps ? totals[lane] : T(0);
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, w, o);
    if (lane >= o) w += y;
  }
  *total = __shfl_sync(0xffffffffu, w, kWarps - 1);
  const T before_warp = warp == 0 ? T(0) : __shfl_sync(0xffffffffu, w, warp == 0 ? 0 : warp - 1);
  return before_warp + x - v;
}

struct SelectSmem {
  uint64_t totals[kWarps];  // block_exclusive_sum's warp totals (a pair of counts in the compactions)
  uint32_t hist[kMaxBins];
  uint32_t bucket, above, count;  // find_bucket's bin, the count above it, its own count
  uint32_t run_gt, run_eq;  // positions above / equal to thr counted by the compaction's earlier rounds
};

// Over a histogram of nb bins (1024 or 2048), the bin holding the `rank`-th largest (1-based) key:
// sm.bucket, sm.above = the count in the bins above it, sm.count = its own. Thread j gives the counts of its bins,
// counted from the top down: c_hi of bin hi = nb - 1 - (nb / kThreads) j and, when nb = 2048, c_lo
// of bin hi - 1 (top_bin_of gives hi). Ends with a barrier.
__device__ __forceinline__ int top_bin_of(int nb) { return nb - 1 - (nb / kThreads) * int(threadIdx.x); }
__device__ void find_bucket_of(SelectSmem& sm, int nb, uint32_t c_hi, uint32_t c_lo, uint32_t rank) {
  const int hi = top_bin_of(nb);
  uint32_t total;
  const uint32_t excl = block_exclusive_sum(c_hi + c_lo, reinterpret_cast<uint32_t*>(sm.totals), &total);
  const uint32_t incl = excl + c_hi + c_lo;
  if (excl < rank && rank <= incl) {
    if (excl + c_hi >= rank) {
      sm.bucket = uint32_t(hi);
      sm.above = excl;
      sm.count = c_hi;
    } else {
      sm.bucket = uint32_t(hi - 1);
      sm.above = excl + c_hi;
      sm.count = c_lo;
    }
  }
  __syncthreads();
}
__device__ void find_bucket(SelectSmem& sm, const uint32_t* hist, int nb, uint32_t rank) {
  const int hi = top_bin_of(nb);
  find_bucket_of(sm, nb, hist[hi], nb == 2 * kThreads ? hist[hi - 1] : 0u, rank);
}

// The `rank`-th largest (1-based) of the keys key_of(i), i < n, by one block: the key, and in
// *need_eq how many of the keys equal to it are within the rank.
template <class KeyOf>
__device__ uint32_t radix_select(SelectSmem& sm, int n, uint32_t rank, KeyOf key_of, uint32_t* need_eq) {
  const int tid = threadIdx.x;
  uint32_t prefix = 0;
#pragma unroll 1
  for (int pass = 0; pass < 3; ++pass) {
    const int nb = digit_bins(pass), shift = digit_shift(pass);
    const uint32_t mask = prefix_mask(pass);
    for (int b = tid; b < nb; b += kThreads) sm.hist[b] = 0;
    __syncthreads();
    for (int i0 = 0; i0 < n; i0 += kSpan) {
      uint32_t key[kPerThread];
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {  // every load in flight at once
        const int i = i0 + j * kThreads + tid;
        key[j] = i < n ? key_of(i) : 0u;
      }
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int i = i0 + j * kThreads + tid;
        count_bin(sm.hist, (key[j] >> shift) & uint32_t(nb - 1), i < n && (key[j] & mask) == prefix);
      }
    }
    __syncthreads();
    find_bucket(sm, sm.hist, nb, rank);
    rank -= sm.above;
    prefix |= sm.bucket << shift;
    __syncthreads();  // sm.bucket, sm.above and the histogram are reused by the next pass
  }
  *need_eq = rank;
  return prefix;
}

// A compaction round's counts: this thread's positions above thr (c_gt) and equal to it (c_eq), and
// those before its words in the row (earlier rounds, then lower threads: r_gt, r_eq); total: the
// round's, both halves. Called by every thread of the block.
struct RoundCounts {
  uint32_t c_gt = 0, c_eq = 0, r_gt = 0, r_eq = 0;
  uint64_t total = 0;
};
template <int W>
__device__ RoundCounts count_round(SelectSmem& sm, const uint32_t (&gt)[W], const uint32_t (&eq)[W]) {
  RoundCounts c;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    c.c_gt += uint32_t(__popc(gt[w]));
    c.c_eq += uint32_t(__popc(eq[w]));
  }
  const uint64_t before = block_exclusive_sum(uint64_t(c.c_gt) | uint64_t(c.c_eq) << 32, sm.totals, &c.total);
  c.r_gt = sm.run_gt + uint32_t(before);
  c.r_eq = sm.run_eq + uint32_t(before >> 32);
  return c;
}

// Ends a compaction round (every thread has read the run counts and the scan storage is free once
// all arrive): adds its totals to the run; whether all k = n_gt + need_eq positions are written.
__device__ bool end_round(SelectSmem& sm, uint64_t total, uint32_t need_eq, uint32_t n_gt) {
  __syncthreads();
  if (threadIdx.x == 0) {
    sm.run_gt += uint32_t(total);
    sm.run_eq += uint32_t(total >> 32);
  }
  __syncthreads();
  return sm.run_gt == n_gt && sm.run_eq >= need_eq;
}

// One round of the ordered compaction, called by every thread of the block. Each thread holds W
// bit words of consecutive 32-position groups, the first at position `first` (bit b of word w:
// position first + 32 w + b); a lower thread holds earlier positions, and earlier rounds earlier
// ones still. gt: positions whose key is above thr; eq: positions whose key equals it. Writes every
// gt position and every eq position among the first need_eq of them (counted from the row's start),
// each at its rank among the selected. Returns whether all k = n_gt + need_eq are written.
template <int W>
__device__ bool compact_round(SelectSmem& sm, const uint32_t (&gt)[W], const uint32_t (&eq)[W], int first,
                              uint32_t need_eq, uint32_t n_gt, int32_t* out) {
  const RoundCounts c = count_round(sm, gt, eq);
  uint32_t r_gt = c.r_gt, r_eq = c.r_eq;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    // Positions in order; once need_eq equal ones are out, only those above thr.
    uint32_t m = gt[w] | (r_eq < need_eq ? eq[w] : 0u);
    while (m) {
      const int b = __ffs(m) - 1;
      m &= m - 1;
      const int32_t pos = first + 32 * w + b;
      if ((gt[w] >> b) & 1u) {
        out[r_gt + min(r_eq, need_eq)] = pos;
        ++r_gt;
      } else {
        out[r_gt + r_eq] = pos;
        if (++r_eq == need_eq) m &= gt[w];
      }
    }
  }
  return end_round(sm, c.total, need_eq, n_gt);
}

// The span path's ordered compaction (its row's last block), one round of kThreads * W mask words:
// thread x holds words first_word + W x .. + W, gt (above thr) and eq (equal to it). A block scan
// gives each thread the output index of its first selected position; the threads' selected words
// and those indices go to shared memory, and each thread then fills output slots (j = tid, tid +
// kThreads, ...): the owner of slot j by a binary search over the indices, its position by the
// rank-th set bit of the owner's words. So the writes are spread over the block however the
// selection lies (a run of ties puts all k positions in a few threads' words). Returns whether all
// k = n_gt + need_eq are written.
template <int W>
__device__ bool compact_slots(SelectSmem& sm, uint32_t* s_words, uint32_t* s_first, const uint32_t (&gt)[W],
                              const uint32_t (&eq)[W], int first_word, uint32_t need_eq, uint32_t n_gt, int32_t* out) {
  const int tid = threadIdx.x;
  const RoundCounts c = count_round(sm, gt, eq);
  // The equal keys taken are the first need_eq of the row: here the lowest `take` of this thread's.
  uint32_t take = c.r_eq < need_eq ? min(c.c_eq, need_eq - c.r_eq) : 0u;
  const uint32_t first = c.r_gt + min(c.r_eq, need_eq);  // output index of this thread's first selected position
  const uint32_t n_sel = c.c_gt + take;
#pragma unroll
  for (int w = 0; w < W; ++w) {
    uint32_t e = eq[w];
    if (uint32_t(__popc(e)) > take) e = take == 0 ? 0u : e & (0xffffffffu >> (31 - __fns(e, 0, int(take))));
    take -= uint32_t(__popc(e));
    s_words[tid * W + w] = gt[w] | e;
  }
  s_first[tid] = first;
  if (tid == kThreads - 1) s_first[kThreads] = first + n_sel;  // the round's end
  __syncthreads();
  const uint32_t end = s_first[kThreads];
  for (uint32_t j = s_first[0] + uint32_t(tid); j < end; j += kThreads) {
    int x = 0;  // the last thread whose first index is <= j: its selection holds slot j
#pragma unroll
    for (int step = kThreads / 2; step > 0; step >>= 1)
      if (s_first[x + step] <= j) x += step;
    uint32_t r = j - s_first[x];
    int pos = 0;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const uint32_t m = s_words[x * W + w], c = uint32_t(__popc(m));
      if (r < c) {
        pos = 32 * w + int(__fns(m, 0, int(r) + 1));
        break;
      }
      r -= c;
    }
    out[j] = (first_word + x * W) * 32 + pos;
  }
  return end_round(sm, c.total, need_eq, n_gt);  // (its first barrier also frees the shared words)
}

// The ordered compaction over the keys of a row [0, n), in rounds of kThreads * 32 positions: warp
// w's 32 ballots cover positions base + 1024 w .. + 1024 and lane j keeps the j-th, so that thread
// x holds positions base + 32 x .. + 32.
template <class KeyOf>
__device__ void compact_keys(SelectSmem& sm, int n, KeyOf key_of, uint32_t thr, uint32_t need_eq, uint32_t n_gt,
                             int32_t* out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    sm.run_gt = 0;
    sm.run_eq = 0;
  }
  __syncthreads();
  for (int base = 0; base < n; base += kThreads * 32) {
    const int wbase = base + warp * 1024;
    uint32_t gt[1] = {0u}, eq[1] = {0u};
#pragma unroll 8
    for (int j = 0; j < 32; ++j) {
      const int i = wbase + 32 * j + lane;
      const bool in = i < n;
      const uint32_t key = in ? key_of(i) : 0u;
      const uint32_t b_gt = __ballot_sync(0xffffffffu, in && key > thr);
      const uint32_t b_eq = __ballot_sync(0xffffffffu, in && key == thr);
      if (lane == j) {
        gt[0] = b_gt;
        eq[0] = b_eq;
      }
    }
    if (compact_round<1>(sm, gt, eq, wbase + 32 * lane, need_eq, n_gt, out)) break;
  }
}

// Rows with n <= k list 0 .. n-1, then -1; `part` of `parts` blocks of the row writes its share.
__device__ void write_short_row(int n, int k, int32_t* out, int part, int parts) {
  for (int i = part * kThreads + threadIdx.x; i < k; i += parts * kThreads) out[i] = i < n ? i : -1;
}

__global__ void __launch_bounds__(kThreads) topk_rows_kernel(const float* scores, int64_t stride, const int32_t* nn,
                                                             int k, int32_t* out) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  __shared__ SelectSmem sm;
  const int t = blockIdx.x;
  const int n = nn[t];
  int32_t* o = out + int64_t(t) * k;
  if (n <= k) return write_short_row(n, k, o, 0, 1);
  const float* row = scores + int64_t(t) * stride;
  auto key_of = [&](int i) { return order_key(row[i]); };
  uint32_t need_eq;
  const uint32_t thr = radix_select(sm, n, uint32_t(k), key_of, &need_eq);
  compact_keys(sm, n, key_of, thr, need_eq, uint32_t(k) - need_eq, o);
}

// Per row of the span path, in global memory (zero between calls).
struct RowState {
  uint32_t hist0[2048];  // the first digit of every key of the row
  uint32_t hist1[2048];  // the second digit of the keys that start with thr's first digit
  uint32_t hist2[1024];  // the last digit of the keys that start with thr's first 22 bits
  uint32_t n_done;       // span path: blocks of the row past the last histogram; team path: arrivals
                         // at its barriers
  uint32_t list_n;       // team path: entries of the boundary list
  uint32_t pad[2];       // the masks after the states stay 16-byte aligned
};

// The span path's loop over a block's share [begin, end) of a row: f(span, v) with v[j] the score at
// span + j * kThreads + threadIdx.x (0 past end), the next span's scores in flight meanwhile.
// `prologue` runs once the first span's loads are issued (also when the share is empty). Every
// thread of the block runs the same iterations.
template <class Prologue, class F>
__device__ void for_each_span(const float* row, int begin, int end, Prologue&& prologue, F&& f) {
  float next[kPerThread];
  auto load = [&](int span) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = span + j * kThreads + int(threadIdx.x);
      next[j] = i < end ? row[i] : 0.0f;
    }
  };
  if (begin < end) load(begin);
  prologue();
  for (int span = begin; span < end; span += kSpan) {
    float v[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) v[j] = next[j];
    if (span + kSpan < end) load(span + kSpan);
    f(span, v);
  }
}

// Block x of row t (blockIdx.y) takes spans x * spans_per_block .. + spans_per_block of the row.
__device__ void share_of(int n, int spans_per_block, int* begin, int* end) {
  *begin = int(blockIdx.x) * spans_per_block * kSpan;
  *end = min(n, *begin + spans_per_block * kSpan);
}

// Span path, launch 1: the row histograms of the first digit.   state: [T]
__global__ void __launch_bounds__(kThreads) topk_span_first_kernel(const float* scores, int64_t stride,
                                                                   const int32_t* nn, int k, int spans_per_block,
                                                                   RowState* state) {
  pdl::wait();  // launched after the kernel that wrote the scores (pdl.cuh)
  pdl::launch_dependents();
  __shared__ uint32_t hist[kMaxBins];
  const int t = blockIdx.y, tid = threadIdx.x;
  const int n = nn[t];
  int begin, end;
  share_of(n, spans_per_block, &begin, &end);
  if (n <= k || begin >= end) return;
  const float* row = scores + int64_t(t) * stride;
  auto zero = [&] {
    for (int b = tid; b < kMaxBins; b += kThreads) hist[b] = 0;
    __syncthreads();
  };
  for_each_span(row, begin, end, zero, [&](int span, const float (&v)[kPerThread]) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j)
      count_bin(hist, order_key(v[j]) >> digit_shift(0), span + j * kThreads + tid < end);
  });
  __syncthreads();
  uint32_t* g = state[t].hist0;
  for (int b = tid; b < kMaxBins; b += kThreads)
    if (hist[b]) atomicAdd(&g[b], hist[b]);
}

// Span path, launch 2: thr's first digit, and the row histograms of the second digit over the keys
// that start with it.
__global__ void __launch_bounds__(kThreads) topk_span_second_kernel(const float* scores, int64_t stride,
                                                                    const int32_t* nn, int k, int spans_per_block,
                                                                    RowState* state) {
  __shared__ SelectSmem sm;
  const int t = blockIdx.y, tid = threadIdx.x;
  const int n = nn[t];
  int begin, end;
  share_of(n, spans_per_block, &begin, &end);
  if (n <= k || begin >= end) return;
  const RowState& st = state[t];
  const float* row = scores + int64_t(t) * stride;
  uint32_t first = 0;  // thr's first digit, in place
  auto find_first = [&] {
    // Launched after the first histogram's kernel (pdl.cuh): the scores' kernel came before that one,
    // so the first span's scores were loaded before this wait; the histogram only after it.
    pdl::wait();
    pdl::launch_dependents();
    for (int b = tid; b < kMaxBins; b += kThreads) sm.hist[b] = st.hist0[b];
    __syncthreads();
    find_bucket(sm, sm.hist, kMaxBins, uint32_t(k));
    first = sm.bucket << digit_shift(0);
    __syncthreads();
    for (int b = tid; b < kMaxBins; b += kThreads) sm.hist[b] = 0;
    __syncthreads();
  };
  for_each_span(row, begin, end, find_first, [&](int span, const float (&v)[kPerThread]) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const uint32_t key = order_key(v[j]);
      count_bin(sm.hist, (key >> digit_shift(1)) & uint32_t(digit_bins(1) - 1),
                span + j * kThreads + tid < end && (key & prefix_mask(1)) == first);
    }
  });
  __syncthreads();
  uint32_t* g = state[t].hist1;
  for (int b = tid; b < kMaxBins; b += kThreads)
    if (sm.hist[b]) atomicAdd(&g[b], sm.hist[b]);
}

// Span path, launch 3: thr's first 22 bits P; the row histograms of the last digit over the keys
// with prefix P; this block's share of the masks. The row's last block finds thr and compacts.
//   masks: [T, 2, mask_words] (above P, then on P)   out: [T, k]
__global__ void __launch_bounds__(kThreads) topk_span_last_kernel(const float* scores, int64_t stride,
                                                                  const int32_t* nn, int k, int spans_per_block,
                                                                  RowState* state, uint32_t* masks,
                                                                  int64_t mask_words, int32_t* out) {
  __shared__ SelectSmem sm;
  __shared__ union {
    struct {
      uint32_t hist1[kMaxBins];  // the row's second-digit histogram
      uint32_t hist2[1024];      // this block's last-digit histogram, then the row's
    };
    uint32_t words[kThreads * kWordsPerThread];  // then the compaction's selected words
  } u;
  __shared__ uint32_t s_first[kThreads + 1];  // and its threads' first output indices
  uint32_t* hist1 = u.hist1;
  uint32_t* hist2 = u.hist2;
  __shared__ bool s_last;
  const int t = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n = nn[t];
  int32_t* o = out + int64_t(t) * k;
  if (n <= k) {
    pdl::wait();  // (pdl.cuh: nothing is written before the kernel before this one has finished)
    return write_short_row(n, k, o, blockIdx.x, gridDim.x);
  }
  RowState& st = state[t];
  const float* row = scores + int64_t(t) * stride;
  uint32_t* above_p = masks + 2 * int64_t(t) * mask_words;
  uint32_t* on_p = above_p + mask_words;
  int begin, end;
  share_of(n, spans_per_block, &begin, &end);

  uint32_t prefix = 0, rank = 0, n_on_p = 0;  // P; thr's rank among the keys with prefix P; their count
  auto find_prefix = [&] {
    pdl::wait();  // after the second histogram's kernel; the first span's scores are already loading
    pdl::launch_dependents();
    for (int b = tid; b < kMaxBins; b += kThreads) {
      sm.hist[b] = st.hist0[b];
      hist1[b] = st.hist1[b];
    }
    for (int b = tid; b < 1024; b += kThreads) hist2[b] = 0;
    __syncthreads();
    find_bucket(sm, sm.hist, kMaxBins, uint32_t(k));
    prefix = sm.bucket << digit_shift(0);
    rank = uint32_t(k) - sm.above;
    __syncthreads();
    find_bucket(sm, hist1, kMaxBins, rank);
    prefix |= sm.bucket << digit_shift(1);
    rank -= sm.above;
    n_on_p = hist1[sm.bucket];
    __syncthreads();
  };
  for_each_span(row, begin, end, find_prefix, [&](int span, const float (&v)[kPerThread]) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int group = span + j * kThreads + warp * 32;  // the warp's 32 positions, one mask word
      const bool live = group + lane < end;
      const uint32_t key = order_key(v[j]), p = key & prefix_mask(2);
      count_bin(hist2, key & 1023u, live && p == prefix);
      const uint32_t b_above = __ballot_sync(0xffffffffu, live && p > prefix);
      const uint32_t b_on = __ballot_sync(0xffffffffu, live && p == prefix);
      if (lane == 0 && group < end) {
        above_p[group / 32] = b_above;
        on_p[group / 32] = b_on;
      }
    }
  });
  __syncthreads();
  for (int b = tid; b < 1024; b += kThreads)
    if (hist2[b]) atomicAdd(&st.hist2[b], hist2[b]);
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&st.n_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;

  // The last block of the row: every other block's histogram and masks are visible (their fences
  // came first).
  __threadfence();
  for (int b = tid; b < 1024; b += kThreads) hist2[b] = __ldcg(&st.hist2[b]);
  __syncthreads();
  find_bucket(sm, hist2, 1024, rank);
  const uint32_t thr = prefix | sm.bucket, need_eq = rank - sm.above;
  const bool all_on_p_equal = hist2[sm.bucket] == n_on_p;  // every key with prefix P is thr
  if (tid == 0) {
    sm.run_gt = 0;
    sm.run_eq = 0;
  }
  __syncthreads();
  const int n_words = (n + 31) / 32;
  for (int w0 = 0; w0 < n_words; w0 += kThreads * kWordsPerThread) {
    const int w = w0 + tid * kWordsPerThread;
    uint32_t gt[kWordsPerThread] = {}, eq[kWordsPerThread] = {};
    if (w < n_words) {
      const uint4 a = __ldcg(reinterpret_cast<const uint4*>(above_p + w));
      const uint4 b = __ldcg(reinterpret_cast<const uint4*>(on_p + w));
      const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int q = 0; q < kWordsPerThread; ++q) {
        gt[q] = w + q < n_words ? av[q] : 0u;
        eq[q] = w + q < n_words ? bv[q] : 0u;
      }
    }
    if (!all_on_p_equal) {  // the keys with prefix P: above, equal to or below thr by their last digit
#pragma unroll
      for (int q = 0; q < kWordsPerThread; ++q) {
        uint32_t m = eq[q], on_thr = 0;
        while (m) {
          const int b = __ffs(m) - 1;
          m &= m - 1;
          const uint32_t key = order_key(row[(w + q) * 32 + b]);
          if (key > thr) gt[q] |= 1u << b;
          else if (key == thr) on_thr |= 1u << b;
        }
        eq[q] = on_thr;
      }
    }
      if (compact_slots<kWordsPerThread>(sm, u.words, s_first, gt, eq, w0, need_eq, uint32_t(k) - need_eq, o)) break;
  }
  // Leave the row's state zeroed for the next call.
  for (int b = tid; b < kMaxBins; b += kThreads) {
    st.hist0[b] = 0;
    st.hist1[b] = 0;
  }
  for (int b = tid; b < 1024; b += kThreads) st.hist2[b] = 0;
  if (tid == 0) st.n_done = 0;
}


// Team path, the barriers among the row's blocks: barrier number i (1, 2, ...) of a call waits until
// st.n_done, to which every block adds 1 at each barrier, reaches i * parts (a release add and
// acquire loads: about one memory round trip once the last block arrives). After the last barrier
// each block adds 1 once more when it has read the row's state for the last time (team_leave); the
// block that brings the count to (barriers + 1) * parts sets it and the list's count back to 0 for
// the next call. Every
// thread of the block calls both; global writes before a barrier (the histogram atomics) are
// visible to the row's blocks after it.
__device__ void team_barrier(RowState& st, uint32_t target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(&st.n_done) : "memory");
    uint32_t v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(&st.n_done) : "memory");
    } while (v < target);
  }
  __syncthreads();
}
__device__ void team_leave(RowState& st, uint32_t end) {
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(&st.n_done, 1u) == end - 1) {
    st.list_n = 0;
    atomicExch(&st.n_done, 0u);
  }
}

// Team path: one launch for a few rows, every block of the grid resident at once (a cooperative
// launch). Block x of row t (blockIdx.y) holds one span of the row in registers, thread j the four
// consecutive scores at 4 j of it (one 16-byte load: the row is taken from the 16-byte boundary at
// or before its start, shifted by a = row start mod 4). The row's blocks meet at barriers: after
// adding the histograms of the first and second digit (each block then finds the digit of thr
// itself, from the row's histogram in global memory), which gives P, thr's first 22 bits. Then, when
// the keys with prefix P (the boundary) are few (<= list_cap, as on any row but one of heavy ties),
// each block lists its boundary keys (position and last digit) and publishes its count of keys above
// P; after the third barrier every block finds thr's last digit from the list and its own output
// offset from the list and the counts of the blocks before it. Otherwise a third barrier after the
// last digit's histogram, and a fourth after the blocks' counts above and equal to thr. Each block
// then writes its own selected positions at their ranks (its offset plus a block scan). Every step is
// spread over the row's blocks: nothing waits on one block's serial work. Each histogram is zeroed,
// a share per block, once every block has read it (after the next barrier).
//   counts: [T, counts_stride] per block (above P; or above | equal to thr << 32)
//   list: [T, list_stride] (position << 10 | last digit), list_cap of them used
__global__ void __launch_bounds__(kThreads, 1)
    topk_team_kernel(const float* scores, int64_t stride, const int32_t* nn, int k, RowState* state,
                     uint64_t* counts, int64_t counts_stride, uint32_t* list, int64_t list_stride, int list_cap,
                     int32_t* out) {
  __shared__ SelectSmem sm;
  __shared__ uint64_t s_base;
  const int t = blockIdx.y, x = blockIdx.x, tid = threadIdx.x;
  for (int b = tid; b < kMaxBins; b += kThreads) sm.hist[b] = 0;
  pdl::wait();  // the scores come from the kernel just before (pdl.cuh)
  pdl::launch_dependents();
  const int n = nn[t];
  int32_t* o = out + int64_t(t) * k;
  if (n <= k) return write_short_row(n, k, o, x, gridDim.x);
  const int64_t row0 = int64_t(t) * stride;
  const int a = int(row0 & 3);
  const float* row = scores + (row0 - a);  // shifted index i is position i - a
  const uint32_t parts = uint32_t((n + a + kSpan - 1) / kSpan);
  if (uint32_t(x) >= parts) return;
  RowState& st = state[t];

  const int i0 = x * kSpan + kPerThread * tid;  // shifted index of this thread's first score
  uint32_t key[kPerThread];
  bool live[kPerThread];
  if (i0 >= a && i0 + kPerThread <= n + a) {
    const float4 v = *reinterpret_cast<const float4*>(row + i0);
    const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      key[j] = order_key(f[j]);
      live[j] = true;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      live[j] = i0 + j >= a && i0 + j < n + a;
      key[j] = live[j] ? order_key(row[i0 + j]) : 0u;
    }
  }
  __syncthreads();  // (the local histogram's zeros)

  uint32_t prefix = 0, rank = uint32_t(k);  // thr's digits found so far; its rank among their keys
  uint32_t barriers = 0;
  // The row's histogram of digit `pass` over the keys on the prefix, added into g; then a barrier.
  auto count_digit = [&](int pass, uint32_t* g) {
    const int nb = digit_bins(pass);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j)
      count_bin(sm.hist, (key[j] >> digit_shift(pass)) & uint32_t(nb - 1),
                live[j] && (key[j] & prefix_mask(pass)) == prefix);
    __syncthreads();
    for (int b = tid; b < nb; b += kThreads) {
      if (sm.hist[b]) atomicAdd(&g[b], sm.hist[b]);
      sm.hist[b] = 0;
    }
    team_barrier(st, parts * ++barriers);
  };
  // Digit `pass` of thr, from the row's histogram g.
  auto select_digit = [&](int pass, const uint32_t* g) {
    const int nb = digit_bins(pass), hi = top_bin_of(nb);
    find_bucket_of(sm, nb, __ldcg(g + hi), nb == 2 * kThreads ? __ldcg(g + hi - 1) : 0u, rank);
    rank -= sm.above;
    prefix |= sm.bucket << digit_shift(pass);
    __syncthreads();  // sm.bucket and sm.above are written again by the next search
  };
  // This block's share of the zeros that g must hold for the next call (every block has read it).
  auto zero_share = [&](uint32_t* g, int nb) {
    for (int b = x * kThreads + tid; b < nb; b += int(parts) * kThreads) g[b] = 0;
  };

  count_digit(0, st.hist0);
  select_digit(0, st.hist0);
  count_digit(1, st.hist1);
  zero_share(st.hist0, digit_bins(0));
  select_digit(1, st.hist1);
  const uint32_t n_on_p = sm.count;  // keys with prefix P: thr is the rank-th largest of them
  uint64_t* row_counts = counts + int64_t(t) * counts_stride;
  uint64_t total, before;  // this block's counts (above thr | equal to it << 32); those of its threads before
  uint32_t thr, need_eq;
  auto scan_counts = [&] {  // this block's keys above and equal to thr: total, and before each thread
    uint32_t c_gt = 0, c_eq = 0;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      c_gt += live[j] && key[j] > thr;
      c_eq += live[j] && key[j] == thr;
    }
    before = block_exclusive_sum(uint64_t(c_gt) | uint64_t(c_eq) << 32, sm.totals, &total);
  };
  if (n_on_p <= uint32_t(list_cap)) {
    // The boundary list: this block's keys with prefix P, at slots taken one atomic per warp.
    uint32_t* row_list = list + int64_t(t) * list_stride;
    uint32_t above = 0;
    const int lane = tid % 32;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const uint32_t p = key[j] & prefix_mask(2);
      above += live[j] && p > prefix;
      const bool on = live[j] && p == prefix;
      const uint32_t m = __ballot_sync(0xffffffffu, on);
      const int leader = m ? __ffs(m) - 1 : 0;
      uint32_t slot = 0;
      if (m && lane == leader) slot = atomicAdd(&st.list_n, uint32_t(__popc(m)));
      slot = __shfl_sync(0xffffffffu, slot, leader) + uint32_t(__popc(m & ((1u << lane) - 1u)));
      if (on) row_list[slot] = uint32_t(i0 + j - a) << 10 | (key[j] & 1023u);
    }
    uint64_t n_above;
    block_exclusive_sum(uint64_t(above), sm.totals, &n_above);
    if (tid == 0) row_counts[x] = n_above;
    team_barrier(st, parts * ++barriers);
    zero_share(st.hist1, digit_bins(1));
    // thr's last digit from the list's histogram (sm.hist is zero: count_digit leaves it so).
    const uint32_t e = uint32_t(tid) < n_on_p ? __ldcg(row_list + tid) : 0u;
    if (uint32_t(tid) < n_on_p) atomicAdd(&sm.hist[e & 1023u], 1u);
    const uint64_t earlier = uint32_t(tid) < uint32_t(x) ? __ldcg(row_counts + tid) : 0u;
    __syncthreads();
    find_bucket(sm, sm.hist, 1024, rank);
    thr = prefix | sm.bucket;
    need_eq = rank - sm.above;
    // This block's offset: the keys above thr and equal to it before its first position, from the
    // counts above P of the blocks before it and the boundary keys before it.
    const bool first = uint32_t(tid) < n_on_p && int(e >> 10) < x * kSpan - a;
    const uint32_t d = e & 1023u;
    uint64_t base;
    block_exclusive_sum(earlier + (first && d > sm.bucket) + (uint64_t(first && d == sm.bucket) << 32), sm.totals, &base);
    if (tid == 0) s_base = base;
    __syncthreads();  // (the scan's storage is free again)
    scan_counts();
  } else {
    count_digit(2, st.hist2);
    zero_share(st.hist1, digit_bins(1));
    select_digit(2, st.hist2);
    thr = prefix;
    need_eq = rank;
    scan_counts();
    if (tid == 0) row_counts[x] = total;
    team_barrier(st, parts * ++barriers);
    zero_share(st.hist2, digit_bins(2));
    if (tid < 32) {  // the counts of the row's blocks before this one
      uint64_t sum = 0;
      for (int b = tid; b < x; b += 32) sum += __ldcg(row_counts + b);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (tid == 0) s_base = sum;
    }
  }
  team_leave(st, parts * (barriers + 1));  // (its barrier also publishes s_base)
  const uint64_t at = s_base + before;  // (the two halves never carry: each count is below 2^32)
  uint32_t r_gt = uint32_t(at), r_eq = uint32_t(at >> 32);
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    if (!live[j]) continue;
    const int32_t pos = i0 + j - a;
    if (key[j] > thr) {
      o[r_gt + min(r_eq, need_eq)] = pos;
      ++r_gt;
    } else if (key[j] == thr) {
      if (r_eq < need_eq) o[r_gt + r_eq] = pos;
      ++r_eq;
    }
  }
}

// The shape of the paths with a workspace for T rows of `stride` scores, and the workspace (grown on
// demand); false when the rows take the one-block path.
struct SpanPlan {
  RowState* state = nullptr;
  uint32_t* masks = nullptr;  // span path: [T, 2, mask_words]; team path: the counts, then the list, per row
  int64_t mask_words = 0;
  int spans_per_block = 0;
  bool team = false;
  int list_cap = 0;  // team path: entries of the boundary list per row
  dim3 grid;
};

// Whether the team path may be taken: TopKWorkspace::path, where kAuto also asks the environment
// (SPARSEMLA_TOPK_TEAM=0 turns it off, to compare the paths in a benchmark).
bool team_allowed(const TopKWorkspace& ws) {
  static const bool env_off = [] {
    const char* v = std::getenv("SPARSEMLA_TOPK_TEAM");
    return v && std::strcmp(v, "0") == 0;
  }();
  return ws.path == TopKPath::kTeam || (ws.path == TopKPath::kAuto && !env_off);
}

bool plan_spans(const float* scores, int64_t T, int64_t stride, TopKWorkspace* ws, cudaStream_t st,
                SpanPlan* plan) {
  const int spans = ceil_div(stride, kSpan);
  // Spans pay off once a row is long enough to share among blocks.
  if (!ws || spans < 2 || T > 65535 || ws->path == TopKPath::kRows) return false;
  if (ws->sm_count == 0) {
    int dev = 0;
    SPARSEMLA_CUDA_CHECK(cudaGetDevice(&dev));
    SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&ws->sm_count, cudaDevAttrMultiProcessorCount, dev));
    int per_sm = 0;
    SPARSEMLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, topk_team_kernel, kThreads, 0));
    ws->team_blocks = per_sm * ws->sm_count;
  }
  const int64_t words = ceil_div(stride, 128) * 4;  // mask words per row, whole 16-byte groups
  if (T > ws->rows || words > ws->cap) {  // grown (both ways at once); the state rows start zero
    ws->rows = std::max<int64_t>(ws->rows, T);
    ws->cap = std::max(ws->cap, words);
    ws->candidates = DeviceBuffer(size_t(ws->rows) * (sizeof(RowState) + size_t(ws->cap) * 2 * sizeof(uint32_t)));
    SPARSEMLA_CUDA_CHECK(cudaMemsetAsync(ws->candidates.get(), 0, size_t(ws->rows) * sizeof(RowState), st));
  }
  plan->state = ws->candidates.as<RowState>();
  plan->masks = reinterpret_cast<uint32_t*>(plan->state + ws->rows);
  plan->mask_words = ws->cap;
  // Team path: one block per span of a row shifted by up to 3 (a row that starts off a 16-byte
  // boundary), every block of the grid resident at once, positions within 22 bits (the list's). Its
  // counts (two words a block) and the boundary list (up to one entry per thread of a block) share
  // the row's 2 * mask_words.
  const int team_parts = ceil_div(stride + 3, kSpan);
  if (team_allowed(*ws) && reinterpret_cast<uintptr_t>(scores) % 16 == 0 && T * team_parts <= ws->team_blocks &&
      stride + 3 < (int64_t(1) << 22)) {
    plan->team = true;
    plan->list_cap = int(std::min<int64_t>(kThreads, 2 * ws->cap - 2 * team_parts));
    plan->grid = dim3{unsigned(team_parts), unsigned(T)};
    return true;
  }
  // About one wave of blocks (two of 1024 threads per SM): a row gets fewer, longer shares as rows are
  // added, so that each block's fixed costs (the boundary searches, the counter) stay few.
  const int parts = int(std::clamp<int64_t>((2 * int64_t(ws->sm_count) + T - 1) / T, 1, spans));
  plan->spans_per_block = ceil_div(spans, parts);
  plan->grid = dim3{unsigned(ceil_div(spans, plan->spans_per_block)), unsigned(T)};
  return true;
}

// The span path's three launches, each one's blocks scheduled while the kernel before it drains
// (programmatic dependent launch: each waits for the one before it before reading anything); the
// team path's one cooperative launch.
void launch_spans(const float* scores, int64_t stride, const int32_t* n, int k, int32_t* out, const SpanPlan& p,
                  cudaStream_t st) {
  if (p.team) {
    const int parts = int(p.grid.x);
    pdl::launch_as(pdl::Cooperative::kYes, topk_team_kernel, p.grid, dim3(kThreads), 0, st, scores, stride, n, k,
                   p.state, reinterpret_cast<uint64_t*>(p.masks), p.mask_words, p.masks + 2 * parts, 2 * p.mask_words,
                   p.list_cap, out);
    return;
  }
  pdl::launch(topk_span_first_kernel, p.grid, dim3(kThreads), 0, st, scores, stride, n, k, p.spans_per_block,
              p.state);
  pdl::launch(topk_span_second_kernel, p.grid, dim3(kThreads), 0, st, scores, stride, n, k, p.spans_per_block,
              p.state);
  pdl::launch(topk_span_last_kernel, p.grid, dim3(kThreads), 0, st, scores, stride, n, k, p.spans_per_block, p.state,
              p.masks, p.mask_words, out);
}

}  // namespace

void top_k(const float* scores, int64_t T, int64_t stride, const int32_t* n, int k, int32_t* out, Stream s,
           TopKWorkspace* ws) {
  if (T == 0) return;
  if (k <= 0) fail("top_k: k must be > 0, got {}", k);
  auto st = static_cast<cudaStream_t>(s);
  SpanPlan plan;
  const bool spans = plan_spans(scores, T, stride, ws, st, &plan);
  if (ws) ws->last_path = !spans ? TopKPath::kRows : plan.team ? TopKPath::kTeam : TopKPath::kSpans;
  if (spans) return launch_spans(scores, stride, n, k, out, plan, st);
  topk_rows_kernel<<<unsigned(T), kThreads, 0, st>>>(scores, stride, n, k, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
