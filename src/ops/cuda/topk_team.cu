// The top-k's team path (topk.cu describes the paths): a few long rows in one cooperative
// launch, the row's blocks meeting at barriers in global memory.
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
// histogram atomics) are visible to the row's blocks after it.
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
// then writes its own selected positions at their ranks (its offset plus a block scan). When the
// scores' kernel filled the first histogram (counted), the first barrier is not needed: every block
// starts at the first digit's search. Every step is
// spread over the row's blocks: nothing waits on one block's serial work. Each histogram is zeroed,
// a share per block, once every block has read it (after the next barrier).
//   counts: [T, counts_stride] per block (above P; or above | equal to thr << 32)
//   list: [T, list_stride] (position << 10 | last digit), list_cap of them used
__global__ void __launch_bounds__(kThreads, 1)
    topk_team_kernel(const float* scores, int64_t stride, const int32_t* nn, int k, RowState* state,
                     uint64_t* counts, int64_t counts_stride, uint32_t* list, int64_t list_stride, int list_cap,
                     bool counted, int32_t* out) {
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

  if (!counted) count_digit(0, st.hist0);  // (else the scores' kernel filled it: top_k_counts)
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
    // The boundary list: this block's keys with prefix P, at slots taken by one atomic per warp for
    // all its keys (one per key's round of ballots cost a dependent round trip each).
    uint32_t* row_list = list + int64_t(t) * list_stride;
    uint32_t above = 0, on_warp[kPerThread], n_warp = 0;
    const int lane = tid % 32;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const uint32_t p = key[j] & prefix_mask(2);
      above += live[j] && p > prefix;
      on_warp[j] = __ballot_sync(0xffffffffu, live[j] && p == prefix);
      n_warp += uint32_t(__popc(on_warp[j]));
    }
    uint32_t slot = 0;
    if (n_warp && lane == 0) slot = atomicAdd(&st.list_n, n_warp);
    slot = __shfl_sync(0xffffffffu, slot, 0);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if ((on_warp[j] >> lane) & 1u)
        row_list[slot + uint32_t(__popc(on_warp[j] & ((1u << lane) - 1u)))] = uint32_t(i0 + j - a) << 10 | (key[j] & 1023u);
      slot += uint32_t(__popc(on_warp[j]));
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
    const uint64_t mine = earlier + (first && d > sm.bucket) + (uint64_t(first && d == sm.bucket) << 32);
    block_exclusive_sum(mine, sm.totals, &base);
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
    write_selected(key[j], i0 + j - a, thr, need_eq, r_gt, r_eq, o);
  }
}

}  // namespace

int team_blocks_per_sm() {
  int per_sm = 0;
  SPARSEMLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, topk_team_kernel, kThreads, 0));
  return per_sm;
}

void launch_team(const float* scores, int64_t T, int64_t stride, const int32_t* n, int k, RowState* state,
                 uint32_t* masks, int64_t mask_words, int parts, int list_cap, bool counted, int32_t* out,
                 cudaStream_t st) {
  pdl::launch_as(pdl::Cooperative::kYes, topk_team_kernel, dim3{unsigned(parts), unsigned(T)}, dim3(kThreads), 0, st,
                 scores, stride, n, k, state, reinterpret_cast<uint64_t*>(masks), mask_words, masks + 2 * parts,
                 2 * mask_words, list_cap, counted, out);
}

}  // namespace sparsemla::cuda::topk
