// The top-k's shared pieces: the keys and their digits, a block's histogram, scan and bucket
// search, the per-row state in global memory, and the block and team paths' host sides. topk.cu
// holds the rows and span paths and the choice among the paths; topk_block.cu the block path,
// topk_team.cu the team path (the paths are described at the top of topk.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace sparsemla::cuda::topk {

constexpr int kThreads = 1024;
constexpr int kMaxBins = 2048;
constexpr int kPerThread = 4;                 // scores per thread per span
constexpr int kSpan = kThreads * kPerThread;  // scores per span (the span path's unit of work)

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

// The keys of a thread's PER consecutive scores at shifted index i0 of a row (row: the 16-byte
// boundary at or before the row's start, which is a scores further on; shifted index i is position
// i - a), read anywhere in the row's stride, before its length is known (those past it are the
// caller's to drop): whole 16-byte loads where they lie inside the row, else one score at a time;
// 0 outside the row.
template <int PER>
__device__ __forceinline__ void load_stride_keys(const float* row, int a, int64_t stride, int i0,
                                                 uint32_t (&key)[PER]) {
  static_assert(PER % 4 == 0, "whole 16-byte loads");
#pragma unroll
  for (int q = 0; q < PER / 4; ++q) {
    const int i = i0 + 4 * q;
    if (i >= a && int64_t(i) + 4 <= stride + a) {
      const float4 v = *reinterpret_cast<const float4*>(row + i);
      const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) key[4 * q + j] = order_key(f[j]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        key[4 * q + j] = i + j >= a && int64_t(i + j) < stride + a ? order_key(row[i + j]) : 0u;
    }
  }
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

// Two sums carried through one block scan (block_exclusive_sum<Pair>): one pass of shuffles and one
// barrier for both.
struct Pair {
  uint64_t u, v;
};
__device__ __forceinline__ Pair operator+(Pair a, Pair b) { return {a.u + b.u, a.v + b.v}; }
__device__ __forceinline__ Pair operator-(Pair a, Pair b) { return {a.u - b.u, a.v - b.v}; }
__device__ __forceinline__ Pair& operator+=(Pair& a, Pair b) { return a = a + b; }
template <class T>
__device__ __forceinline__ T shfl_up(T x, int o) { return __shfl_up_sync(0xffffffffu, x, o); }
__device__ __forceinline__ Pair shfl_up(Pair x, int o) { return {shfl_up(x.u, o), shfl_up(x.v, o)}; }
template <class T>
__device__ __forceinline__ T shfl_from(T x, int lane) { return __shfl_sync(0xffffffffu, x, lane); }
__device__ __forceinline__ Pair shfl_from(Pair x, int lane) { return {shfl_from(x.u, lane), shfl_from(x.v, lane)}; }

// Exclusive prefix sum of v over the block's THREADS threads, and the block's total: a shuffle scan
// per warp, then every warp scans the warp totals itself (one barrier). As fast as cub's raking block
// scan on an H200 (~0.4 us a boundary search at 1024 threads; cub's warp-scans variant took twice
// that) with 256 bytes of shared memory instead of 8 KB, which the span path's compaction uses.
// `totals`: THREADS / 32 values of shared memory, free again after the next barrier.
template <class T, int THREADS = kThreads>
__device__ __forceinline__ T block_exclusive_sum(T v, T* totals, T* total) {
  constexpr int WARPS = THREADS / 32;
  static_assert(WARPS >= 1 && WARPS <= 32 && THREADS % 32 == 0, "whole warps, at most 32");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T y = shfl_up(x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) totals[warp] = x;
  __syncthreads();
  T w = lane < WARPS ? totals[lane] : T{};
#pragma unroll
  for (int o = 1; o < WARPS; o <<= 1) {
    const T y = shfl_up(w, o);
    if (lane >= o) w += y;
  }
  *total = shfl_from(w, WARPS - 1);
  const T before_warp = warp == 0 ? T{} : shfl_from(w, warp == 0 ? 0 : warp - 1);
  return before_warp + x - v;
}

struct SelectSmem {
  uint64_t totals[2 * kWarps];  // block scans' warp totals (of a Pair at most)
  uint32_t hist[kMaxBins];
  uint32_t bucket, above, count;  // find_bucket's bin, the count above it, its own count
  uint32_t run_gt, run_eq;  // positions above / equal to thr counted by the compaction's earlier rounds
};

// Over a histogram of nb bins, the bin holding the `rank`-th largest (1-based) key: sm.bucket,
// sm.above = the count in the bins above it, sm.count = its own. Thread j of THREADS gives the counts
// of its B = nb / THREADS bins, counted from the top down: c[i] of bin hi - i, hi = nb - 1 - B j
// (top_bin_of). Ends with a barrier.
template <int THREADS = kThreads>
__device__ __forceinline__ int top_bin_of(int nb) { return nb - 1 - (nb / THREADS) * int(threadIdx.x); }
template <int THREADS, int B>
__device__ inline void find_bucket_in(SelectSmem& sm, int hi, const uint32_t (&c)[B], uint32_t rank) {
  uint32_t sum = 0;
#pragma unroll
  for (int i = 0; i < B; ++i) sum += c[i];
  uint32_t total;
  uint32_t above = block_exclusive_sum<uint32_t, THREADS>(sum, reinterpret_cast<uint32_t*>(sm.totals), &total);
  if (above < rank && rank <= above + sum) {
#pragma unroll
    for (int i = 0; i < B; ++i) {
      if (above < rank && rank <= above + c[i]) {
        sm.bucket = uint32_t(hi - i);
        sm.above = above;
        sm.count = c[i];
      }
      above += c[i];
    }
  }
  __syncthreads();
}
// find_bucket_in over a histogram of nb = 1024 or 2048 bins, bin b read as bin_of(b) (from shared or
// global memory; a reader may also zero the bin, which only this thread reads).
template <int THREADS, class BinOf>
__device__ inline void find_bucket_from(SelectSmem& sm, int nb, uint32_t rank, BinOf bin_of) {
  auto search = [&](auto bins_per_thread) {
    constexpr int B = decltype(bins_per_thread)::value;
    const int hi = top_bin_of<THREADS>(B * THREADS);
    uint32_t c[B];
#pragma unroll
    for (int i = 0; i < B; ++i) c[i] = bin_of(hi - i);
    find_bucket_in<THREADS, B>(sm, hi, c, rank);
  };
  if (nb == 2048) search(std::integral_constant<int, 2048 / THREADS>{});
  else search(std::integral_constant<int, 1024 / THREADS>{});
}
__device__ inline void find_bucket(SelectSmem& sm, const uint32_t* hist, int nb, uint32_t rank) {
  find_bucket_from<kThreads>(sm, nb, rank, [&](int b) { return hist[b]; });
}

// The ordered write of the block and team paths: position pos with key `key` at its rank among the
// selected (the keys above thr and the first need_eq equal to it), r_gt / r_eq counting those above
// / equal to thr before it in the row.
__device__ __forceinline__ void write_selected(uint32_t key, int32_t pos, uint32_t thr, uint32_t need_eq,
                                               uint32_t& r_gt, uint32_t& r_eq, int32_t* out) {
  if (key > thr) {
    out[r_gt + min(r_eq, need_eq)] = pos;
    ++r_gt;
  } else if (key == thr) {
    if (r_eq < need_eq) out[r_gt + r_eq] = pos;
    ++r_eq;
  }
}

// Rows with n <= k list 0 .. n-1, then -1; `part` of `parts` blocks (of THREADS) of the row writes its share.
template <int THREADS = kThreads>
__device__ inline void write_short_row(int n, int k, int32_t* out, int part, int parts) {
  for (int i = part * THREADS + threadIdx.x; i < k; i += parts * THREADS) out[i] = i < n ? i : -1;
}

// Per row of the span and team paths, in global memory (zero between calls).
struct RowState {
  uint32_t hist0[2048];  // the first digit of every key of the row
  uint32_t hist1[2048];  // the second digit of the keys that start with thr's first digit
  uint32_t hist2[1024];  // the last digit of the keys that start with thr's first 22 bits
  uint32_t n_done;       // span path: blocks of the row past the last histogram; team path: arrivals
                         // at its barriers
  uint32_t list_n;       // team path: entries of the boundary list
  uint32_t pad[2];       // the masks after the states stay 16-byte aligned
};

// Threads per block of the team path and of the block path's 4K rows: `asked` (TopKWorkspace::threads:
// 256, 512 or 1024; anything else is refused), or where it is 0 SPARSEMLA_TOPK_THREADS; 0 where
// neither is set: the paths' own choice (topk.cu).
int path_threads(int asked);

// The block path (topk_block.cu): scores per thread for rows of `stride` at `scores` (4, 8 or 16; 0
// where a row with its shift to the 16-byte boundary before it is longer than 16 * kThreads), and
// its one launch for T rows.
int block_path_per_thread(const float* scores, int64_t stride);
void launch_block(const float* scores, int64_t T, int64_t stride, const int32_t* n, int k, int32_t* out, int threads,
                  cudaStream_t st);  // threads: 0 (1024), or 256 / 512 for rows of 4K

// The team path (topk_team.cu). Blocks of its kernel (of `threads`) resident at once per multiprocessor.
int team_blocks_per_sm(int threads);
// One cooperative launch for T rows of `stride` scores, `parts` blocks per row: per row, RowState
// state[t] and the 2 * mask_words words at masks + 2 * mask_words * t (the blocks' counts, then a
// boundary list of up to list_cap entries). `counted`: the rows' first histograms were filled by the
// scores' kernel (top_k_counts).   out: [T, k]
void launch_team(const float* scores, int64_t T, int64_t stride, const int32_t* n, int k, RowState* state,
                 uint32_t* masks, int64_t mask_words, int parts, int list_cap, bool counted, int32_t* out, int threads,
                 cudaStream_t st);

}  // namespace sparsemla::cuda::topk
