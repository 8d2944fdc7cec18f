// Kernel instantiations for the Q8_0, Q4_0, IQ4_NL, MXFP4 weights (see quant_matmul_kernels.cuh).
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/gemv.cuh"

namespace sparsemla::cuda {

namespace {
using gguf::GgmlType;
constexpr TypeKernels kKernels[] = {
    kernels_of<GgmlType::Q8_0>(),
    kernels_of<GgmlType::Q4_0>(),
    kernels_of<GgmlType::IQ4_NL>(),
    kernels_of<GgmlType::MXFP4>(),
};
}  // namespace

KernelFamily legacy_kernels() { return {kKernels, sizeof(kKernels) / sizeof(kKernels[0])}; }

}  // namespace sparsemla::cuda
