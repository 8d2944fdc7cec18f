// Kernel instantiations for the Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS weights (see quant_matmul_kernels.cuh).
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/gemv.cuh"

namespace sparsemla::cuda {

namespace {
using gguf::GgmlType;
constexpr TypeKernels kKernels[] = {
    kernels_of<GgmlType::Q2_K>(),
    kernels_of<GgmlType::Q3_K>(),
    kernels_of<GgmlType::Q4_K>(),
    kernels_of<GgmlType::Q5_K>(),
    kernels_of<GgmlType::Q6_K>(),
    kernels_of<GgmlType::IQ4_XS>(),
};
}  // namespace

KernelFamily kquant_kernels() { return {kKernels, sizeof(kKernels) / sizeof(kKernels[0])}; }

}  // namespace sparsemla::cuda
