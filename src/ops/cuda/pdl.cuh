// Programmatic dependent launch (PDL, SM90 and later): a kernel launched with pdl::launch may start
// while the kernel before it in the stream is still running, once every block of that kernel has
// called pdl::launch_dependents() (or exited). Until its own pdl::wait() returns, which is when
// the kernel before it has finished and its writes are visible, it may only read what no kernel
// of the step writes (the weights) and must write nothing: the decode products use that time to
// prefetch their weight rows into L2, so that the launch, the ramp-up and the first memory
// latency of a small product overlap the kernel before it.
//
// Rules for this project's kernels:
//  - a kernel launched through pdl::launch calls pdl::wait() before it reads any activation,
//    routing or cache data and before its first global write (launching one that does not would
//    race with the kernel before it). Before the wait it may read what kernels two or more launches
//    back wrote: those have finished (next rule), as have plain launches before them. The indexer
//    reads its key rows that way, the top-k's second and third launches the indexer's scores;
//  - pdl::launch_dependents() is called after pdl::wait() (so at most two kernels overlap), and
//    any kernel may call it: it only lets the next kernel's prologue start;
//  - "launches back" counts the launches on the kernel's own stream. Where the model forks work to
//    a second stream (model/cuda's SideStream) or joins it back, the event wait is a full
//    dependency: the first kernel after it may assume what the other stream did before the fork or
//    join is done, but nothing else that other stream does;
//  - on devices before SM90, and with SPARSEMLA_PDL=0 in the environment, pdl::launch is a plain
//    launch and the device calls do nothing.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "ops/cuda/check.cuh"

namespace sparsemla::cuda::pdl {

// Blocks until the kernel before this one in the stream has finished and its writes are visible.
__device__ __forceinline__ void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel in the stream (if launched through pdl::launch) start its prologue.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Asks for bytes [p, p + n) to be brought into L2 (a hint: nothing is loaded into registers and
// nothing waits for it); p and n are rounded inwards to 16 bytes. Does nothing before SM90.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint64_t a = (reinterpret_cast<uint64_t>(p) + 15) & ~uint64_t(15);
  const uint64_t e = (reinterpret_cast<uint64_t>(p) + n) & ~uint64_t(15);
  if (e > a) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(uint32_t(e - a)) : "memory");
#else
  (void)p;
  (void)n;
#endif
}

// Whether launches on the current device use PDL: compute capability 9.0 or later and
// SPARSEMLA_PDL not set to 0. Asked once per device.
bool enabled();

// Whether the decode products prefetch their weight rows into L2 before pdl::wait():
// SPARSEMLA_GEMV_PREFETCH (default 1 where PDL is on; 0 turns it off, 1 forces it without PDL).
bool prefetch();

// kernel<<<grid, block, smem, s>>>(args...), with the programmatic-serialization attribute when
// enabled(), and as a cooperative launch (every block resident at once, or the launch fails) with
// Cooperative::kYes. The kernel must follow the rules above.
enum class Cooperative { kNo, kYes };
template <class... Params, class... Args>
void launch_as(Cooperative cooperative, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
               cudaStream_t s, Args&&... args) {
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cooperative == Cooperative::kYes) {
    attr[n].id = cudaLaunchAttributeCooperative;
    attr[n++].val.cooperative = 1;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  SPARSEMLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  launch_as(Cooperative::kNo, kernel, grid, block, smem, s, std::forward<Args>(args)...);
}

}  // namespace sparsemla::cuda::pdl
