// Kernel instantiations for the F32, F16, BF16 weights (see quant_matmul_kernels.cuh).
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/gemv.cuh"

namespace sparsemla::cuda {

namespace {
using gguf::GgmlType;
constexpr TypeKernels kKernels[] = {
    kernels_of<GgmlType::F32>(),
    kernels_of<GgmlType::F16>(),
    kernels_of<GgmlType::BF16>(),
};
}  // namespace

KernelFamily plain_kernels() { return {kKernels, sizeof(kKernels) / sizeof(kKernels[0])}; }

}  // namespace sparsemla::cuda
