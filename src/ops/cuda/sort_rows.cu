// Each row of int32 values sorted ascending, in one block per row (cub's block radix sort). The
// top-k lists its selection in whatever order its threads wrote it; sorting it makes the positions a
// token attends to, and so the order in which the attention sums them, the same on every run.
#include <cub/block/block_radix_sort.cuh>

#include "ops/cuda/check.cuh"
#include "ops/cuda/small_ops.h"
#include "util/error.h"

namespace sparsemla::cuda {
namespace {

constexpr int kThreads = 256;

template <int kItems>
__global__ void __launch_bounds__(kThreads) sort_rows_kernel(int32_t* data, int n) {
  using Sort = cub::BlockRadixSort<int32_t, kThreads, kItems>;
  __shared__ typename Sort::TempStorage tmp;
  int32_t* row = data + int64_t(blockIdx.x) * n;
  int32_t v[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {  // blocked arrangement; padding sorts last
    const int at = threadIdx.x * kItems + i;
    v[i] = at < n ? row[at] : INT32_MAX;
  }
  Sort(tmp).Sort(v);
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int at = threadIdx.x * kItems + i;
    if (at < n) row[at] = v[i];
  }
}

template <int kItems>
void launch(int32_t* data, int64_t rows, int n, cudaStream_t s) {
  sort_rows_kernel<kItems><<<unsigned(rows), kThreads, 0, s>>>(data, n);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace

void sort_rows(int32_t* data, int64_t rows, int64_t n, Stream s) {
  if (rows <= 0 || n <= 1) return;
  if (n > int64_t(kMaxSortRow) || rows > INT32_MAX) fail("cuda::sort_rows: {} rows of {} (at most {} per row)", rows, n, kMaxSortRow);
  const auto st = static_cast<cudaStream_t>(s);
  const int per = int((n + kThreads - 1) / kThreads);
  if (per <= 1) launch<1>(data, rows, int(n), st);
  else if (per <= 2) launch<2>(data, rows, int(n), st);
  else if (per <= 4) launch<4>(data, rows, int(n), st);
  else if (per <= 8) launch<8>(data, rows, int(n), st);
  else launch<16>(data, rows, int(n), st);
}

}  // namespace sparsemla::cuda
