// Kernel instantiations for the IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M weights (see quant_matmul_kernels.cuh).
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/gemv.cuh"

namespace sparsemla::cuda {

namespace {
using gguf::GgmlType;
constexpr TypeKernels kKernels[] = {
    kernels_of<GgmlType::IQ2_XXS>(),
    kernels_of<GgmlType::IQ2_XS>(),
    kernels_of<GgmlType::IQ2_S>(),
    kernels_of<GgmlType::IQ3_XXS>(),
    kernels_of<GgmlType::IQ3_S>(),
    kernels_of<GgmlType::IQ1_S>(),
    kernels_of<GgmlType::IQ1_M>(),
};
}  // namespace

KernelFamily iq_kernels() { return {kKernels, sizeof(kKernels) / sizeof(kKernels[0])}; }

}  // namespace sparsemla::cuda
