// The bf16 copies of the cuBLAS prefill (prefill_blas.cu): a weight's rows dequantized to bf16, and
// fp32 activations rounded to bf16. Kernels only, no launches, so that the host emulation
// (tests/host_emulation) builds them; quant_matmul_kernels.cuh and prefill_blas.cu launch them.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/cuda/dequant.cuh"

namespace sparsemla::cuda {

// Rows of a weight as bf16: each value as dq::dequantize_exact (the CPU's dequantization) gives it,
// rounded to nearest even. One thread per unit of D::kUnit values, kDequantUnitsPerThread units per
// thread and round (a block's round takes that many blocks' worth of consecutive units, so a warp's
// loads and stores stay coalesced, and both units' loads are in flight before either is decoded),
// grid-stride; 32-bit indices: n_rows * (cols / D::kUnit) < 2^31 (the launcher's row ranges).
//   w: [n_rows][row_bytes] (the rows to convert)   out: [n_rows, cols]
constexpr int kDequantUnitsPerThread = 2;
template <class D>
__global__ void dequantize_bf16_kernel(const uint8_t* __restrict__ w, uint64_t row_bytes, int64_t n_rows, int cols,
                                       QuantTables tables, __nv_bfloat16* __restrict__ out) {
  constexpr int kPer = kDequantUnitsPerThread;
  const uint32_t units = uint32_t(cols / D::kUnit);
  const uint32_t n = uint32_t(n_rows) * units;
  const uint32_t step = blockDim.x, stride = gridDim.x * blockDim.x * kPer;
  for (uint32_t first = blockIdx.x * blockDim.x * kPer + threadIdx.x; first < n; first += stride) {
    float v[kPer][D::kUnit];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const uint32_t i = first + k * step;
      if (i >= n) break;
      const uint32_t r = i / units, iu = i - r * units;
      dq::dequantize_exact<D>(w + r * row_bytes + uint64_t(iu / D::kUnitsPerBlock) * D::kBytes,
                              int(iu % D::kUnitsPerBlock), v[k], tables);
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const uint32_t i = first + k * step;
      if (i >= n) break;
      const uint32_t r = i / units, iu = i - r * units, u = iu % D::kUnitsPerBlock;
      __nv_bfloat16* o = out + uint64_t(r) * uint32_t(cols) + (iu / D::kUnitsPerBlock) * uint32_t(D::kBlock);
#pragma unroll
      for (int run = 0; run < D::kUnit / 8; ++run) {
        uint32_t p[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const __nv_bfloat162 two = __floats2bfloat162_rn(v[k][8 * run + 2 * q], v[k][8 * run + 2 * q + 1]);
          p[q] = *reinterpret_cast<const uint32_t*>(&two);
        }
        *reinterpret_cast<uint4*>(o + D::run(int(u), run)) = make_uint4(p[0], p[1], p[2], p[3]);
      }
    }
  }
}

// out[i] = bf16(x[i]) for i < n, rounded to nearest even; 8 values per step (two 16-byte loads, one
// 16-byte store: x and out 16-byte aligned), then the last n % 8 one by one (grid-stride). (A
// template, Bf16 = __nv_bfloat16, so that every file may include it.)
template <class Bf16>
__global__ void round_bf16_kernel(const float* __restrict__ x, int64_t n, Bf16* __restrict__ out) {
  const int64_t n8 = n / 8, stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n8; i += stride) {
    const float4 a = reinterpret_cast<const float4*>(x)[2 * i], b = reinterpret_cast<const float4*>(x)[2 * i + 1];
    const __nv_bfloat162 p[4] = {__floats2bfloat162_rn(a.x, a.y), __floats2bfloat162_rn(a.z, a.w),
                                 __floats2bfloat162_rn(b.x, b.y), __floats2bfloat162_rn(b.z, b.w)};
    reinterpret_cast<uint4*>(out)[i] = *reinterpret_cast<const uint4*>(p);
  }
  for (int64_t i = 8 * n8 + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride)
    out[i] = __float2bfloat16_rn(x[i]);
}

}  // namespace sparsemla::cuda
