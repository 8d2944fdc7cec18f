// Tensor-core building blocks every NVIDIA GPU from SM80 has (mma.sync, ldmatrix, and cp.async from
// cp_async.cuh), named barriers and the fast 2^x: the inline assembly the attention kernels share,
// which the host emulation (tests/host_emulation) stands in for with a header of the same path.
// The number conversions beside them are in convert.cuh (included). Fragment layouts
// (m16n8k16, 32 lanes, g = lane / 4, q = lane % 4):
//   A (16x16, row-major)  a0: [g][2q..2q+1]  a1: [g+8][2q..]  a2: [g][2q+8..]  a3: [g+8][2q+8..]
//   B (16x8, k x n)       b0: [k=2q..2q+1][n=g]               b1: [k=2q+8..2q+9][n=g]
//   C (16x8, fp32)        c0,c1: [g][2q, 2q+1]                c2,c3: [g+8][2q, 2q+1]
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cstdint>

#include "ops/cuda/convert.cuh"
#include "ops/cuda/cp_async.cuh"

namespace sparsemla::cuda {

__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2], __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2], __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The bf16 product without `volatile`, so that the compiler may schedule it among the code around
// it (the prefill tiles of gemm_kernel.cuh, the tensor-core decode kernels): d += a b, a row-major
// 16x16 (4 regs), b column-major 16x8 (b0, b1).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices, transposed: lane i gives the address of row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* smem) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Four 8x8 b16 matrices as stored (A fragments, or B fragments of a [n][k] array).
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* smem) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Named barrier `id` (1..15; 0 is __syncthreads) of `threads` threads: sync waits for all of them;
// arrive counts this thread without waiting (a producer), its shared-memory writes ordered before the
// reads of the threads that sync.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// 2^x with the multi-function unit's approximation (2 ulp), results below 2^-126 flushed to zero:
// exp2f's subnormal fix-up costs more instructions than the step's other arithmetic, and a P that
// small vanishes in the fp16 / bf16 products anyway.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace sparsemla::cuda
