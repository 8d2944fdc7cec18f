// The top-k's block path (topk.cu describes the paths): one block per row of up to 16K scores, every
// key in registers, the whole selection in shared memory.
//
// Thread j holds the PER consecutive scores at PER j of the row (taken from the 16-byte boundary at
// or before its start, shifted by a = row start mod 4, as the team path does), read once: every
// score of the row's stride, loaded before the row's length is known so that the two loads are one
// round trip (session 54; not yet timed), those past the length dropped (topk_block_kernel.cuh). Three
// radix passes (11 + 11 + 10 bits) count the keys on thr's prefix into a shared histogram and find
// the next digit by one block scan each; a thread zeroes the bins it read as it reads them, so a
// pass costs two barriers and no clearing loop. A last block scan of each thread's counts above and
// equal to thr gives every thread the ranks of its own selected positions, which it writes in
// order: no second read of the row, no global memory between the passes. The row path reads the
// row once per pass and the team path meets at global barriers. Measured on an H200 (one row, top-k
// alone; docs/PERFORMANCE.md, session 16): 4K 8.6 us against 11.2 for the team path, so top_k takes
// it for rows of up to 4K; at 16K (16 keys per thread counted one after another per pass) 14.2
// against 10.7, so longer rows take it only when asked for (TopKPath::kBlock).
#include "ops/cuda/check.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/topk_block_kernel.cuh"
#include "ops/cuda/topk_common.cuh"

namespace sparsemla::cuda::topk {

int block_path_per_thread(const float* scores, int64_t stride) {
  // Every row starts on a 16-byte boundary where the scores and the stride allow; else a row may be
  // shifted by up to 3.
  const int64_t slack = reinterpret_cast<uintptr_t>(scores) % 16 == 0 && stride % 4 == 0 ? 0 : 3;
  for (int per : {4, 8, 16})
    if (stride + slack <= int64_t(per) * kThreads) return per;
  return 0;
}

void launch_block(const float* scores, int64_t T, int64_t stride, const int32_t* n, int k, int32_t* out, int threads,
                  cudaStream_t st) {
  const int per = block_path_per_thread(scores, stride);
  const dim3 grid{unsigned(T)};
  if (per == 4 && threads == 256)
    pdl::launch(topk_block_kernel<16, 256>, grid, dim3(256), 0, st, scores, stride, n, k, out);
  else if (per == 4 && threads == 512)
    pdl::launch(topk_block_kernel<8, 512>, grid, dim3(512), 0, st, scores, stride, n, k, out);
  else if (per == 4) pdl::launch(topk_block_kernel<4>, grid, dim3(kThreads), 0, st, scores, stride, n, k, out);
  else if (per == 8) pdl::launch(topk_block_kernel<8>, grid, dim3(kThreads), 0, st, scores, stride, n, k, out);
  else if (per == 16) pdl::launch(topk_block_kernel<16>, grid, dim3(kThreads), 0, st, scores, stride, n, k, out);
  else fail("top_k: rows of {} scores are longer than the block path takes ({})", stride, 16 * kThreads);
}

}  // namespace sparsemla::cuda::topk
