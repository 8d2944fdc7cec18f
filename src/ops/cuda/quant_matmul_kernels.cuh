// What quant_matmul.cu dispatches to: per ggml type, a launcher for the decode kernel (gemv.cuh),
// the prefill kernel (gemm.cuh) and the row lookup (below). The instantiations are spread over one
// .cu file per family of types (quant_matmul_{plain,legacy,kquants,iq}.cu) so that they compile in
// parallel; each file lists its types in an explicit table.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "gguf/ggml_types.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/dequant.cuh"
#include "ops/cuda/dequant_bf16.cuh"
#include "ops/cuda/expert_tiles.h"
#include "ops/cuda/mat_args.cuh"

namespace sparsemla::cuda {

using MatmulLauncher = void (*)(const MatArgs& a, cudaStream_t s);
// out: [n, n_cols], 16-byte aligned; ids: [n] device.
using RowsLauncher = void (*)(const MatArgs& a, const int32_t* ids, int64_t n, float* out, cudaStream_t s);
// The grouped prefill launch (matmul_expert_tiles; gemm.cuh).
using GroupsLauncher = void (*)(const MatArgs& a, const ExpertTile* tiles, int n_tiles, int width, cudaStream_t s);
// Rows [row0, row0 + n) of a.w as bf16 into out: [n, n_cols], 16-byte aligned.
using Bf16Launcher = void (*)(const MatArgs& a, int64_t row0, int64_t n, __nv_bfloat16* out, cudaStream_t s);

struct TypeKernels {
  gguf::GgmlType type;
  MatmulLauncher decode;
  MatmulLauncher prefill;
  RowsLauncher rows;
  Bf16Launcher to_bf16;
  GroupsLauncher prefill_groups;
};

struct KernelFamily {
  const TypeKernels* kernels;
  size_t count;
};
KernelFamily plain_kernels();    // F32, F16, BF16
KernelFamily legacy_kernels();   // Q8_0, Q4_0, IQ4_NL, MXFP4
KernelFamily kquant_kernels();   // Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS
KernelFamily iq_kernels();       // IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M

// ---- row lookup ----

// One block per requested row; threads take consecutive units and store their runs as float4.
template <class D>
__global__ void __launch_bounds__(128) dequantize_rows_kernel(const MatArgs a, const int32_t* ids, float* out) {
  const int64_t i = blockIdx.x;
  const int32_t r = ids[i];
  float* o = out + i * a.n_cols;  // [n_cols]
  if (r < 0 || r >= a.n_rows) {  // -1: a row another rank holds (zeros); past the end: NaN
    const float fill = r < 0 ? 0.0f : __int_as_float(0x7fc00000);
    for (int64_t c = threadIdx.x; c < a.n_cols; c += blockDim.x) o[c] = fill;
    return;
  }
  const uint8_t* w = a.w + uint64_t(r) * a.row_bytes;
  const int n_units = int(a.n_cols / D::kUnit);
  for (int iu = threadIdx.x; iu < n_units; iu += blockDim.x) {
    const int b = iu / D::kUnitsPerBlock, u = iu % D::kUnitsPerBlock;
    float v[D::kUnit];
    dq::dequantize_exact<D>(w + int64_t(b) * D::kBytes, u, v, a.tables);
#pragma unroll
    for (int run = 0; run < D::kUnit / 8; ++run) {
      float4* p = reinterpret_cast<float4*>(o + int64_t(b) * D::kBlock + D::run(u, run));
      p[0] = make_float4(v[8 * run], v[8 * run + 1], v[8 * run + 2], v[8 * run + 3]);
      p[1] = make_float4(v[8 * run + 4], v[8 * run + 5], v[8 * run + 6], v[8 * run + 7]);
    }
  }
}

template <class D>
void launch_dequantize_rows(const MatArgs& a, const int32_t* ids, int64_t n, float* out, cudaStream_t s) {
  dequantize_rows_kernel<D><<<unsigned(n), 128, 0, s>>>(a, ids, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

template <class D>
void launch_dequantize_bf16(const uint8_t* w, uint64_t row_bytes, int64_t n_rows, int cols, const QuantTables& tb,
                            __nv_bfloat16* out, cudaStream_t s) {
  const int64_t units = cols / D::kUnit;
  const int64_t per_launch = std::max<int64_t>(1, (int64_t(1) << 31) / std::max<int64_t>(units, 1) - 1);
  for (int64_t r0 = 0; r0 < n_rows; r0 += per_launch) {  // (32-bit indices in the kernel)
    const int64_t rows = std::min(per_launch, n_rows - r0);
    const int64_t per_block = 256 * kDequantUnitsPerThread;
    const unsigned grid = unsigned(std::min<int64_t>((rows * units + per_block - 1) / per_block, 65535));
    dequantize_bf16_kernel<D><<<grid, 256, 0, s>>>(w + uint64_t(r0) * row_bytes, row_bytes, rows, cols, tb,
                                                    out + r0 * cols);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
  }
}

template <class D>
void launch_rows_bf16(const MatArgs& a, int64_t row0, int64_t n, __nv_bfloat16* out, cudaStream_t s) {
  if (n > 0)
    launch_dequantize_bf16<D>(a.w + uint64_t(row0) * a.row_bytes, a.row_bytes, n, int(a.n_cols), a.tables, out, s);
}

// The tensor-core decode kernel (gemv_mma.cu) for the types mma_decode_supported() names.
void launch_gemv_mma(gguf::GgmlType t, const MatArgs& a, cudaStream_t s);
// Its one-token form (Q4_K; one token, or one per expert pair).
void launch_gemv_mma_one(gguf::GgmlType t, const MatArgs& a, cudaStream_t s);
// Its blocks take 16 rows each (times the pairs or groups of an expert product); with at least two
// blocks per multiprocessor it runs three per multiprocessor (registers capped), else one.
constexpr int64_t kMmaRowsPerBlock = 16;
inline bool mma_takes_three_blocks(int64_t n_rows, int64_t n_items, int sm_count) {
  return (n_rows + kMmaRowsPerBlock - 1) / kMmaRowsPerBlock * n_items >= 2 * int64_t(sm_count);
}

// The int8-activation decode kernel (gemv_q8.cu) for the types q8_supported() names: a.xq, a.xr and
// a.xb instead of a.x; one token, or one per expert pair, with several products.
void launch_q8(gguf::GgmlType t, const MatArgs& a, cudaStream_t s);
// The names of the types it takes, comma separated (for errors).
std::string q8_type_names();
// Its one-token tensor-core form (gemv_q8_mma.cu; the types q8_one_token_supported() names): one
// token, or one per expert pair, with several products.
void launch_q8_one(gguf::GgmlType t, const MatArgs& a, cudaStream_t s);

// The codebooks on the current device (uploaded on first use; MatArgs::tables of every product).
const QuantTables& device_quant_tables();

// Defined in gemv.cuh and gemm.cuh, which the family files include.
template <class D>
void launch_gemv(const MatArgs& a, cudaStream_t s);
template <class D>
void launch_gemm(const MatArgs& a, cudaStream_t s);
template <class D>
void launch_gemm_groups(const MatArgs& a, const ExpertTile* tiles, int n_tiles, int width, cudaStream_t s);

// The table entry of type T: its launchers, instantiated in the including file.
template <gguf::GgmlType T>
constexpr TypeKernels kernels_of() {
  using D = dq::Dq<T>;
  return {T, &launch_gemv<D>, &launch_gemm<D>, &launch_dequantize_rows<D>, &launch_rows_bf16<D>, &launch_gemm_groups<D>};
}

}  // namespace sparsemla::cuda
