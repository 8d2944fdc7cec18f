// Elementwise activations shared by the kernels that apply them (small_ops.cu's silu_mul, the
// one-token expert pair's SwiGLU in gemv_mma_one.cu): one definition, so both give the same bits.
#pragma once
#include <cuda_runtime.h>

namespace sparsemla::cuda {

// silu(g) * u = g / (1 + e^-g) * u
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

}  // namespace sparsemla::cuda
