#include "ops/cuda/moe_router.h"

#include <algorithm>

#include "ops/cuda/check.cuh"
#include "ops/cuda/moe_router_kernels.cuh"

namespace sparsemla::cuda {

namespace {

using namespace router;

cudaStream_t stream_of(Stream s) { return static_cast<cudaStream_t>(s); }

}  // namespace

void moe_route(const model::HParams& hp, const float* logits, const float* bias, int64_t T, int32_t* ids,
               float* weights, Stream s) {
  RouterShape sh{};
  sh.E = int(hp.n_expert);
  sh.k = int(hp.n_expert_used);
  sh.groups = int(std::max<uint32_t>(hp.n_expert_groups, 1));
  sh.groups_used = int(hp.n_group_used);
  sh.sigmoid = hp.expert_gating == 2;
  sh.norm = hp.expert_weights_norm;
  sh.scale = hp.expert_weights_scale;
  if (sh.E <= 0 || sh.k <= 0 || sh.k > sh.E || sh.k > 64)
    fail("cuda::moe_route: {} experts with {} used is not supported (1 <= used <= min(64, experts))", sh.E, sh.k);
  if (sh.E % sh.groups != 0) fail("cuda::moe_route: {} experts do not split into {} groups", sh.E, sh.groups);
  if (sh.groups > 1 && (sh.groups_used < 1 || sh.groups_used > sh.groups))
    fail("cuda::moe_route: {} of {} expert groups used", sh.groups_used, sh.groups);
  if (hp.expert_gating != 1 && hp.expert_gating != 2)
    fail("cuda::moe_route: expert gating function {} (1 softmax, 2 sigmoid)", hp.expert_gating);
  if (T < 0 || T > INT32_MAX) fail("cuda::moe_route: {} tokens", T);
  if (T == 0) return;
  route_kernel<<<int(T), kRouterThreads, route_smem_bytes(sh), stream_of(s)>>>(sh, logits, bias, ids, weights);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

size_t moe_group_workspace_bytes(int64_t n, int64_t E) {
  return size_t(E) * size_t((n + kChunk - 1) / kChunk) * sizeof(int32_t);
}

void moe_group(const int32_t* ids, int64_t n, int64_t E, int32_t* counts, int32_t* offsets, int32_t* perm,
               void* workspace, Stream s, int32_t* active, int32_t* n_active) {
  // E counters live in shared memory while a chunk is counted.
  if (n < 0 || n > INT32_MAX || E <= 0 || E > 8192) fail("cuda::moe_group: {} entries over {} experts", n, E);
  if (bool(active) != bool(n_active)) fail("cuda::moe_group: the active list needs both active and n_active");
  const cudaStream_t st = stream_of(s);
  if (n == 0) {
    SPARSEMLA_CUDA_CHECK(cudaMemsetAsync(counts, 0, size_t(E) * sizeof(int32_t), st));
    SPARSEMLA_CUDA_CHECK(cudaMemsetAsync(offsets, 0, size_t(E + 1) * sizeof(int32_t), st));
    if (n_active) SPARSEMLA_CUDA_CHECK(cudaMemsetAsync(n_active, 0, sizeof(int32_t), st));
    return;
  }
  const int n_chunks = int((n + kChunk - 1) / kChunk);
  int32_t* base = static_cast<int32_t*>(workspace);
  count_chunks_kernel<<<n_chunks, kChunk, size_t(E) * sizeof(int32_t), st>>>(ids, n, int(E), n_chunks, base);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
  scan_chunks_kernel<<<1, kScanThreads, 0, st>>>(base, int(E), n_chunks, counts, offsets, n, perm, active, n_active);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
  scatter_chunks_kernel<<<n_chunks, kChunk, 0, st>>>(ids, n, int(E), n_chunks, base, perm);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
