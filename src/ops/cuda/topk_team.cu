// The top-k's team path (topk.cu describes the paths): a few long rows in one cooperative
// launch, the row's blocks meeting at barriers in global memory.
#include <atomic>

#include "ops/cuda/check.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/topk_common.cuh"

namespace sparsemla::cuda::topk {
namespace {

// Team path, the barriers among the row's blocks: barrier number i (1, 2, ...) of a call waits until
// st.n_done, to which every block adds 1 at each barrier, reaches i * parts (a release add and
// acquire loads: about one memory round trip once the last block arrives). After the last barrier
// each block adds 1 once more when it has read the row's state for the last time (team_leave); the
// block that brings the count to (barriers + 1) * parts sets it and the list's count back to 0 for
// the next call. Every thread of the block calls both; global writes before a barrier (the
// histogram atomics) are visible to the row's blocks after it, and so is what thread 0 writes in
// `publish` (after the block's threads have arrived).
template <class Publish>
__device__ void team_barrier(RowState& st, uint32_t target, Publish publish) {
  __syncthreads();
  if (threadIdx.x == 0) {
    publish();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(&st.n_done) : "memory");
    uint32_t v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(&st.n_done) : "memory");
    } while (v < target);
  }
  __syncthreads();
}
__device__ void team_barrier(RowState& st, uint32_t target) {
  team_barrier(st, target, [] {});
}
// After a block barrier that follows the block's last read of the row's state: thread 0's add (the
// other threads need not wait for it).
__device__ void team_leave(RowState& st, uint32_t end) {
  if (threadIdx.x == 0 && atomicAdd(&st.n_done, 1u) == end - 1) {
    st.list_n = 0;
    atomicExch(&st.n_done, 0u);
  }
}

// Team path: one launch for a few rows, every block of the grid resident at once (a cooperative
// launch). Block x of row t (blockIdx.y) holds one span of the row in registers: of THREADS threads
// (1024, 512 or 256: topk.cu chooses), thread j the PER = kSpan / THREADS consecutive scores at PER j
// of it (16-byte loads: the row is taken from the 16-byte boundary at or before its start, shifted
// by a = row start mod 4). The row's blocks meet at barriers: after
// adding the histograms of the first and second digit (each block then finds the digit of thr
// itself, from the row's histogram in global memory), which gives P, thr's first 22 bits. Then, when
// the keys with prefix P (the boundary) are few (<= list_cap, as on any row but one of heavy ties),
// each block lists its boundary keys (position and last digit) and publishes its count of keys above
// P; after the third barrier every block finds thr's last digit from the list and its own output
// offset from the list and the counts of the blocks before it. Otherwise a third barrier after the
// last digit's histogram, and a fourth after the blocks' counts above and equal to thr. Each block
// then writes its own selected positions at their ranks (its offset plus a block scan). When the
// scores' kernel filled the first histogram (counted), the first barrier is not needed: every block
// starts at the first digit's search. Every step is
// spread over the row's blocks: nothing waits on one block's serial work. Each histogram is zeroed,
// a share per block, once every block has read it (after the next barrier).
//   counts: [T, counts_stride] per block (above P; or above | equal to thr << 32)
//   list: [T, list_stride] (position << 10 | last digit), list_cap of them used
template <int THREADS>
__global__ void __launch_bounds__(THREADS, 1)
    topk_team_kernel(const float* scores, int64_t stride, const int32_t* nn, int k, RowState* state,
                     uint64_t* counts, int64_t counts_stride, uint32_t* list, int64_t list_stride, int list_cap,
                     bool counted, int32_t* out) {
  constexpr int PER = kSpan / THREADS;  // consecutive scores per thread
  static_assert(PER % 4 == 0 && PER <= 32, "whole 16-byte loads, a bit per score");
  constexpr int B0 = 2048 / THREADS;  // bins of the first digit per thread in its search
  __shared__ SelectSmem sm;
  __shared__ uint64_t s_base;
  __shared__ uint32_t s_above;
  const int t = blockIdx.y, x = blockIdx.x, tid = threadIdx.x;
  for (int b = tid; b < kMaxBins; b += THREADS) sm.hist[b] = 0;
  if (tid == 0) s_above = 0;
  pdl::wait();  // the scores come from the kernel just before (pdl.cuh)
  pdl::launch_dependents();
  const int64_t row0 = int64_t(t) * stride;
  const int a = int(row0 & 3);
  const float* row = scores + (row0 - a);  // shifted index i is position i - a
  RowState& st = state[t];
  // Loaded before the row's length is known, in one round trip: this thread's scores anywhere in
  // the row's stride (those past n are dropped below), where counted the first digit's bins this
  // thread searches, and n.
  const int i0 = x * kSpan + PER * tid;  // shifted index of this thread's first score
  uint32_t key[PER];
  load_stride_keys<PER>(row, a, stride, i0, key);
  const int hi0 = top_bin_of<THREADS>(2048);
  uint32_t c0[B0];
#pragma unroll
  for (int i = 0; i < B0; ++i) c0[i] = counted ? __ldcg(st.hist0 + hi0 - i) : 0u;
  const int n = nn[t];
  int32_t* o = out + int64_t(t) * k;
  if (n <= k) return write_short_row<THREADS>(n, k, o, x, gridDim.x);
  const uint32_t parts = uint32_t((n + a + kSpan - 1) / kSpan);
  if (uint32_t(x) >= parts) return;
  uint32_t live = 0;  // bit j: score j of this thread is one of the row's
#pragma unroll
  for (int j = 0; j < PER; ++j) live |= uint32_t(i0 + j >= a && i0 + j < n + a) << j;
  auto is_live = [&](int j) { return ((live >> j) & 1u) != 0u; };
  __syncthreads();  // (the local histogram's zeros)

  uint32_t prefix = 0, rank = uint32_t(k);  // thr's digits found so far; its rank among their keys
  uint32_t barriers = 0;
  // The row's histogram of digit `pass` over the keys on the prefix, added into g; then a barrier.
  auto count_digit = [&](int pass, uint32_t* g) {
    const int nb = digit_bins(pass);
#pragma unroll
    for (int j = 0; j < PER; ++j)
      count_bin(sm.hist, (key[j] >> digit_shift(pass)) & uint32_t(nb - 1),
                is_live(j) && (key[j] & prefix_mask(pass)) == prefix);
    __syncthreads();
    for (int b = tid; b < nb; b += THREADS) {
      if (sm.hist[b]) atomicAdd(&g[b], sm.hist[b]);
      sm.hist[b] = 0;
    }
    team_barrier(st, parts * ++barriers);
  };
  auto select_digit = [&](int pass, const uint32_t* g) {
    find_bucket_from<THREADS>(sm, digit_bins(pass), rank, [&](int b) { return __ldcg(g + b); });
    rank -= sm.above;
    prefix |= sm.bucket << digit_shift(pass);
    __syncthreads();  // sm.bucket and sm.above are written again by the next search
  };
  // This block's share of the zeros that g must hold for the next call (every block has read it).
  auto zero_share = [&](uint32_t* g, int nb) {
    for (int b = x * THREADS + tid; b < nb; b += int(parts) * THREADS) g[b] = 0;
  };

  if (!counted) {  // (else the scores' kernel filled it: top_k_counts, and c0 holds its bins)
    count_digit(0, st.hist0);
#pragma unroll
    for (int i = 0; i < B0; ++i) c0[i] = __ldcg(st.hist0 + hi0 - i);
  }
  find_bucket_in<THREADS, B0>(sm, hi0, c0, rank);
  rank -= sm.above;
  prefix = sm.bucket << digit_shift(0);
  __syncthreads();  // sm.bucket and sm.above are written again by the next search
  count_digit(1, st.hist1);
  zero_share(st.hist0, digit_bins(0));
  select_digit(1, st.hist1);
  const uint32_t n_on_p = sm.count;  // keys with prefix P: thr is the rank-th largest of them
  uint64_t* row_counts = counts + int64_t(t) * counts_stride;
  uint64_t total, before;  // this block's counts (above thr | equal to it << 32); those of its threads before
  uint32_t thr, need_eq;
  auto own_counts = [&] {  // this thread's keys above thr | equal to it << 32
    uint32_t c_gt = 0, c_eq = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      c_gt += is_live(j) && key[j] > thr;
      c_eq += is_live(j) && key[j] == thr;
    }
    return uint64_t(c_gt) | uint64_t(c_eq) << 32;
  };
  auto scan_counts = [&] {  // this block's counts: total, and before each thread
    before = block_exclusive_sum<uint64_t, THREADS>(own_counts(), sm.totals, &total);
  };
  if (n_on_p <= uint32_t(list_cap)) {
    // The boundary list: this block's keys with prefix P, at slots taken by one atomic per warp for
    // all its keys (one per key's round of ballots cost a dependent round trip each).
    uint32_t* row_list = list + int64_t(t) * list_stride;
    uint32_t above = 0, on_warp[PER], n_warp = 0;
    const int lane = tid % 32;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const uint32_t p = key[j] & prefix_mask(2);
      above += is_live(j) && p > prefix;
      on_warp[j] = __ballot_sync(0xffffffffu, is_live(j) && p == prefix);
      n_warp += uint32_t(__popc(on_warp[j]));
    }
    uint32_t slot = 0;
    if (n_warp && lane == 0) slot = atomicAdd(&st.list_n, n_warp);
    slot = __shfl_sync(0xffffffffu, slot, 0);
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      if ((on_warp[j] >> lane) & 1u)
        row_list[slot + uint32_t(__popc(on_warp[j] & ((1u << lane) - 1u)))] = uint32_t(i0 + j - a) << 10 | (key[j] & 1023u);
      slot += uint32_t(__popc(on_warp[j]));
    }
    // The block's count above P: warp sums added in shared memory, published at the barrier.
    const uint32_t w_above = __reduce_add_sync(0xffffffffu, above);
    if (lane == 0 && w_above) atomicAdd(&s_above, w_above);
    team_barrier(st, parts * ++barriers, [&] { row_counts[x] = s_above; });
    zero_share(st.hist1, digit_bins(1));
    // thr's last digit from the list's histogram (sm.hist is zero: count_digit leaves it so); the
    // list's entries tid + u THREADS (list_cap <= kThreads).
    constexpr int LP = kThreads / THREADS;
    uint32_t e[LP];
#pragma unroll
    for (int u = 0; u < LP; ++u) {
      const uint32_t i = uint32_t(tid + u * THREADS);
      e[u] = i < n_on_p ? __ldcg(row_list + i) : 0u;
      if (i < n_on_p) atomicAdd(&sm.hist[e[u] & 1023u], 1u);
    }
    uint64_t earlier = 0;  // the counts above P of the blocks before this one
    for (int b = tid; b < x; b += THREADS) earlier += __ldcg(row_counts + b);
    __syncthreads();
    find_bucket_from<THREADS>(sm, 1024, rank, [&](int b) { return sm.hist[b]; });
    thr = prefix | sm.bucket;
    need_eq = rank - sm.above;
    // This block's offset: the keys above thr and equal to it before its first position, from the
    // counts above P of the blocks before it and the boundary keys before it.
    uint64_t mine = earlier;
#pragma unroll
    for (int u = 0; u < LP; ++u) {
      const bool first = uint32_t(tid + u * THREADS) < n_on_p && int(e[u] >> 10) < x * kSpan - a;
      const uint32_t d = e[u] & 1023u;
      mine += (first && d > sm.bucket) + (uint64_t(first && d == sm.bucket) << 32);
    }
    // The block's offset (the sum of mine) and each thread's own counts' prefix in one scan.
    Pair sums;
    before = block_exclusive_sum<Pair, THREADS>({mine, own_counts()}, reinterpret_cast<Pair*>(sm.totals), &sums).v;
    total = sums.v;
    if (tid == 0) s_base = sums.u;
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
  __syncthreads();  // (publishes s_base; no thread reads the row's state after it)
  const uint64_t at = s_base + before;  // (the two halves never carry: each count is below 2^32)
  uint32_t r_gt = uint32_t(at), r_eq = uint32_t(at >> 32);
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    if (!is_live(j)) continue;
    write_selected(key[j], i0 + j - a, thr, need_eq, r_gt, r_eq, o);
  }
  team_leave(st, parts * (barriers + 1));  // (thread 0's writes are not held up by its round trip)
}

template <class F>
decltype(auto) with_team_kernel(int threads, F&& f) {
  switch (threads) {
    case 256: return f(topk_team_kernel<256>, 256);
    case 512: return f(topk_team_kernel<512>, 512);
    default: return f(topk_team_kernel<1024>, 1024);
  }
}

}  // namespace

int team_blocks_per_sm(int threads) {
  static std::atomic<int> cached[3] = {-1, -1, -1};  // 256, 512, 1024 (the same on every device)
  std::atomic<int>& c = cached[threads == 256 ? 0 : threads == 512 ? 1 : 2];
  if (c.load() < 0)
    c = with_team_kernel(threads, [](auto kernel, int th) {
      int per_sm = 0;
      SPARSEMLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, th, 0));
      return per_sm;
    });
  return c.load();
}

void launch_team(const float* scores, int64_t T, int64_t stride, const int32_t* n, int k, RowState* state,
                 uint32_t* masks, int64_t mask_words, int parts, int list_cap, bool counted, int32_t* out, int threads,
                 cudaStream_t st) {
  with_team_kernel(threads, [&](auto kernel, int th) {
    pdl::launch_as(pdl::Cooperative::kYes, kernel, dim3{unsigned(parts), unsigned(T)}, dim3(th), 0, st, scores,
                   stride, n, k, state, reinterpret_cast<uint64_t*>(masks), mask_words, masks + 2 * parts,
                   2 * mask_words, list_cap, counted, out);
  });
}

}  // namespace sparsemla::cuda::topk
