// Top-k selection per row, written in ascending position order. A radix select over an
// order-preserving 32-bit key of each score finds the k-th largest key thr, digit by digit (11 + 11 +
// 10 bits), and need_eq: how many of the keys equal to thr are taken (the CPU top_k gives ties at
// the boundary to the lower index). An ordered compaction then writes every position whose key is
// above thr and the first need_eq whose key equals it, each at its rank among the selected (a block
// scan of per-thread counts), so the attention reads a token's positions in one order on every run
// without a sort.
//
// Four paths:
//  - block (topk_block.cu; rows of up to 4K scores, or 16K when asked for): one block per row holds
//    the row's keys in registers and runs the whole selection in shared memory.
//  - rows: one block per row runs the whole selection, reading the row once per pass (many long
//    rows without a workspace).
//  - team (topk_team.cu; with a workspace, long rows, few enough that one block per span of every
//    row fits on the device at once): one cooperative launch; each block holds its keys in
//    registers, the row's blocks add each digit's histogram in global memory and meet at a barrier
//    (an arrival count, no block waiting on another's serial work), and each finds the digit
//    itself. After two digits, the keys on thr's 22-bit prefix are usually few: the blocks list
//    them, and after a third barrier each finds thr and its own output offset from the list;
//    otherwise (heavy ties) the last digit and the blocks' counts take two more barriers. Each
//    block writes its own positions. Measured on an H200: 10.8 us for a row of 131K scores (the
//    span path: 13.8).
//  - spans (with a workspace, long rows the team path does not take): each row is shared among
//    blocks, a run of spans of kSpan scores each (more rows: fewer, longer runs, about one wave of
//    blocks in all). Three launches over the row's blocks: (1) the histogram of the key's first
//    digit, added into the row's histogram in global memory; (2) every block finds thr's first
//    digit from it and adds the histogram of the second digit over the keys that start with it; (3)
//    every block finds thr's first 22 bits (P), adds the histogram of the last digit over the keys
//    with prefix P, and writes its share of two bit masks over the row: keys whose first 22 bits
//    are above P (selected whatever their last digit) and keys with prefix P (the boundary). The
//    row's last block (a counter) finds thr from the last histogram, splits the boundary into keys
//    above, equal to and below thr (without reading a score when every boundary key is thr, as in a
//    run of ties), compacts the masks in order with the output slots spread over its threads
//    (compact_slots), and leaves the row's histograms and counter zeroed for the next call. The
//    three launches are chained by programmatic dependent launch (pdl.cuh): each one's blocks are
//    scheduled while the one before drains, and the second and third load their first scores before
//    they wait. Measured on an H200 (docs/PERFORMANCE.md): each dependent step of the last block
//    costs 0.4-1 us, so that block's serial work (~5 us) and the three launches set a long row's
//    time.
// The first histogram can come with the scores (top_k_counts, for few scores in all): the indexer
// adds each score it writes into the row's first-digit histogram in the workspace (a table per block
// in shared memory, then one global add per digit it saw), so the team path starts at the first
// digit's search, one barrier and one histogram pass fewer, and the span path skips its launch 1.
// Ties cost little on every path: a warp whose keys share a histogram bin adds them with one
// atomic, and the compaction stops once the k positions are written.
#include <algorithm>

#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/topk_common.cuh"
#include "util/env.h"

namespace sparsemla::cuda {
namespace {

using namespace topk;

constexpr int kWordsPerThread = 4;  // mask words per thread per round of the span path's compaction

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
// that start with it. `counted`: the first histograms were filled by the scores' kernel, launched
// just before this one (top_k_counts), and launch 1 did not run.
__global__ void __launch_bounds__(kThreads) topk_span_second_kernel(const float* scores, int64_t stride,
                                                                    const int32_t* nn, int k, int spans_per_block,
                                                                    RowState* state, bool counted) {
  __shared__ SelectSmem sm;
  if (counted) pdl::wait();  // the scores are the output of the kernel just before
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
    // so the first span's scores were loaded before this wait; the histogram only after it. (When
    // counted, the wait above came first.)
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


// The shape of the long-row paths (team or span, both with a workspace) for T rows of `stride`
// scores, and the workspace (grown on demand); false when the rows take the one-block path.
struct LongRowPlan {
  RowState* state = nullptr;
  uint32_t* masks = nullptr;  // span path: [T, 2, mask_words]; team path: the counts, then the list, per row
  int64_t mask_words = 0;
  int spans_per_block = 0;
  bool team = false;
  int threads = kThreads;  // team path: threads per block
  int list_cap = 0;  // team path: entries of the boundary list per row
  dim3 grid;
};

// Whether the team path may be taken: TopKWorkspace::path, where kAuto also asks the environment
// (SPARSEMLA_TOPK_TEAM=0 turns it off, to compare the paths in a benchmark).
bool team_allowed(const TopKWorkspace& ws) {
  static const bool off = env_off("SPARSEMLA_TOPK_TEAM");
  return ws.path == TopKPath::kTeam || (ws.path == TopKPath::kAuto && !off);
}

bool plan_long_rows(const float* scores, int64_t T, int64_t stride, TopKWorkspace* ws, cudaStream_t st,
                LongRowPlan* plan) {
  const int spans = ceil_div(stride, kSpan);
  // Spans pay off once a row is long enough to share among blocks.
  if (!ws || spans < 2 || T > 65535 || ws->path == TopKPath::kRows) return false;
  if (ws->sm_count == 0) {
    int dev = 0;
    SPARSEMLA_CUDA_CHECK(cudaGetDevice(&dev));
    SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&ws->sm_count, cudaDevAttrMultiProcessorCount, dev));
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
  // counts (two words a block) and the boundary list (up to one entry per kThreads of a block) share
  // the row's 2 * mask_words. Blocks of 1024 threads where the rows' blocks fit on the device at once
  // (one per SM), else of 512 or 256 (more per SM; each thread holds more of the span's scores, which
  // costs per key: H200, one row of 128K scores, top-k alone, 11.2 / 11.7 / 14.4 us on 1024 / 512 /
  // 256 threads; 8 rows, which take the team path on 512 threads and not on 1024: 15.0 us against
  // 18.8 on the span path, docs/PERFORMANCE.md, session 21). TopKWorkspace::threads asks for one size.
  const int team_parts = ceil_div(stride + 3, kSpan);
  const int asked = path_threads(ws->threads);
  ws->team_blocks = 0;
  for (int threads : {1024, 512, 256}) {
    if (asked && threads != asked) continue;
    ws->team_blocks = team_blocks_per_sm(threads) * ws->sm_count;
    plan->threads = threads;
    if (T * team_parts <= ws->team_blocks) break;
  }
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

// The team path's one cooperative launch, or the span path's three, each one's blocks scheduled while
// the kernel before it drains (programmatic dependent launch: each waits for the one before it
// before reading anything).
// `counted`: the rows' first histograms were filled by the scores' kernel (top_k_counts).
void launch_long_rows(const float* scores, int64_t stride, const int32_t* n, int k, int32_t* out, const LongRowPlan& p,
                      bool counted, cudaStream_t st) {
  if (p.team)
    return launch_team(scores, p.grid.y, stride, n, k, p.state, p.masks, p.mask_words, int(p.grid.x), p.list_cap,
                       counted, out, p.threads, st);
  if (!counted)
    pdl::launch(topk_span_first_kernel, p.grid, dim3(kThreads), 0, st, scores, stride, n, k, p.spans_per_block,
                p.state);
  pdl::launch(topk_span_second_kernel, p.grid, dim3(kThreads), 0, st, scores, stride, n, k, p.spans_per_block,
              p.state, counted);
  pdl::launch(topk_span_last_kernel, p.grid, dim3(kThreads), 0, st, scores, stride, n, k, p.spans_per_block, p.state,
              p.masks, p.mask_words, out);
}

// Whether rows of `stride` scores take the block path: kBlock, rows up to 16K scores; kAuto (unless
// SPARSEMLA_TOPK_BLOCK=0, to compare the paths in a benchmark), rows of 4 scores per thread (4K).
// Measured on an H200 (docs/PERFORMANCE.md, session 16), one row, top-k alone: 4K 8.6 us against
// 11.2 for the team path; 16K (16 per thread) 14.2 against 10.7: the serial per-thread counting of
// 16 keys per pass outweighs the team's global barriers there.
// SPARSEMLA_TOPK_BLOCK_PER=8 / 16 lets kAuto take rows of up to 8 / 16 scores per thread too (A/B).
bool takes_block(const float* scores, int64_t stride, const TopKWorkspace* ws) {
  static const bool off = env_off("SPARSEMLA_TOPK_BLOCK");
  static const long long max_per = env_int("SPARSEMLA_TOPK_BLOCK_PER", 4);
  const TopKPath p = ws ? ws->path : TopKPath::kAuto;
  const int per = block_path_per_thread(scores, stride);
  return (p == TopKPath::kBlock && per > 0) || (p == TopKPath::kAuto && !off && per > 0 && per <= max_per);
}

// Forgets top_k_counts' pending call and zeroes every row's state: what the scores' kernel may have
// counted into the histograms for a top_k that will not read them (so no later call sees them).
void drop_counted(TopKWorkspace& ws, cudaStream_t st) {
  ws.counted = {};
  if (ws.rows > 0)
    SPARSEMLA_CUDA_CHECK(cudaMemsetAsync(ws.candidates.get(), 0, size_t(ws.rows) * sizeof(RowState), st));
}

}  // namespace

namespace topk {
int path_threads(int asked) {
  static const int env = [] {  // SPARSEMLA_TOPK_THREADS=256|512|1024: for A/B runs
    const int v = int(env_int("SPARSEMLA_TOPK_THREADS", 0));
    return v == 256 || v == 512 || v == 1024 ? v : 0;
  }();
  if (asked == 0) return env;
  if (asked != 256 && asked != 512 && asked != 1024)
    fail("top_k: TopKWorkspace::threads must be 0, 256, 512 or 1024, got {}", asked);
  return asked;
}
}  // namespace topk

void top_k(const float* scores, int64_t T, int64_t stride, const int32_t* n, int k, int32_t* out, Stream s,
           TopKWorkspace* ws) {
  if (T == 0) return;
  if (k <= 0) fail("top_k: k must be > 0, got {}", k);
  if (ws) path_threads(ws->threads);  // (refuses a size the paths do not take, whichever path the rows take)
  auto st = static_cast<cudaStream_t>(s);
  const bool block = takes_block(scores, stride, ws);
  LongRowPlan plan;
  const bool long_rows = !block && plan_long_rows(scores, T, stride, ws, st, &plan);
  bool counted = false;
  if (ws && ws->counted.scores) {  // top_k_counts' call: its histograms hold these scores' first digits
    const TopKWorkspace::Counted c = ws->counted;
    if (c.scores != scores || c.T != T || c.stride != stride || c.k != k || !long_rows) {
      drop_counted(*ws, st);  // (the next calls start clean)
      fail("top_k: the workspace's first histograms were counted (top_k_counts) for {} rows of stride {}, k = {}; "
           "this call has {} rows of stride {}, k = {}{}",
           c.T, c.stride, c.k, T, stride, k, c.scores != scores ? ", at another address" : "");
    }
    ws->counted = {};
    counted = true;
  }
  if (ws) {
    ws->last_path = block ? TopKPath::kBlock : !long_rows ? TopKPath::kRows : plan.team ? TopKPath::kTeam : TopKPath::kSpans;
    ws->last_counted = counted;
  }
  if (block) return launch_block(scores, T, stride, n, k, out, path_threads(ws ? ws->threads : 0), st);
  if (long_rows) return launch_long_rows(scores, stride, n, k, out, plan, counted, st);
  topk_rows_kernel<<<unsigned(T), kThreads, 0, st>>>(scores, stride, n, k, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

TopKCounts top_k_counts(const float* scores, int64_t T, int64_t stride, int k, Stream s, TopKWorkspace* ws) {
  if (!ws) return {};
  // A pending call whose top_k never ran (an error in between): its counts are dropped.
  if (ws->counted.scores) drop_counted(*ws, static_cast<cudaStream_t>(s));
  if (T == 0 || k <= 0 || !scores || T * stride > (ws->count_max < 0 ? kTopKCountMax : ws->count_max) ||
      takes_block(scores, stride, ws))
    return {};
  LongRowPlan plan;
  if (!plan_long_rows(scores, T, stride, ws, static_cast<cudaStream_t>(s), &plan)) return {};
  ws->counted = {scores, T, stride, k};
  static_assert(sizeof(RowState) % sizeof(uint32_t) == 0);
  return {plan.state->hist0, int64_t(sizeof(RowState) / sizeof(uint32_t)), k};
}

}  // namespace sparsemla::cuda
