// Host stand-in for the device half of src/ops/cuda/pdl.cuh: blocks run one launch at a time in the
// emulation, so the wait for the kernel before and the early start of the next do nothing (as on
// devices before SM90).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace sparsemla::cuda::pdl {

inline void wait() {}
inline void launch_dependents() {}
inline void prefetch_l2(const void*, uint32_t) {}

}  // namespace sparsemla::cuda::pdl
