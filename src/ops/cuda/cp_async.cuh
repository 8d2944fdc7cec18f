// cp.async: 16- and 4-byte copies from global into shared memory that run while the thread goes
// on (SM80 and later), committed in groups and waited for by group. A header of its own so that
// kernels needing nothing else of mma.cuh can be built by the host emulation
// (tests/host_emulation, which stands in for this header with copies made at the wait).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace sparsemla::cuda {

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(addr), "l"(gmem));
}
// The same through L1 (cached there): for data many blocks of an SM read, such as a token's queries.
__device__ __forceinline__ void cp_async16_l1(void* smem, const void* gmem) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

}  // namespace sparsemla::cuda
