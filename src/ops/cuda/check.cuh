// Error checking for CUDA runtime calls and kernel launches inside .cu files: a failure becomes a
// sparsemla::Error naming the call, the file and line, and the driver's message.
#pragma once
#include <cuda_runtime.h>

#include "util/error.h"

#define SPARSEMLA_CUDA_CHECK(call)                                                                          \
  do {                                                                                                      \
    cudaError_t err_ = (call);                                                                              \
    if (err_ != cudaSuccess)                                                                                \
      ::sparsemla::fail("CUDA error in {} ({}:{}): {}", #call, __FILE__, __LINE__, cudaGetErrorString(err_)); \
  } while (0)

// After a kernel launch: reports a bad launch configuration at once (not at the next sync).
#define SPARSEMLA_CUDA_LAUNCH_CHECK() SPARSEMLA_CUDA_CHECK(cudaGetLastError())

namespace sparsemla::cuda {

inline int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

}  // namespace sparsemla::cuda
