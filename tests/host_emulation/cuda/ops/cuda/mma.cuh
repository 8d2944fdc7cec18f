// Host stand-in for src/ops/cuda/mma.cuh, its inline assembly done on the host (the conversions
// are the real convert.cuh's, against the stand-ins for cuda_bf16.h, cuda_fp16.h and cuda_fp8.h):
//  - mma.sync m16n8k16 (bf16 or fp16 into fp32) and ldmatrix .x4 (.trans) are warp collectives, as
//    on the device: every lane's fragments or row addresses go to every lane (emu.h's
//    warp_exchange), so a lane that does not take part stops the launch as a stuck barrier;
//  - fast_exp2 is exp2f with ex2.approx.ftz's flushes (the device's approximation is within 2 ulp).
//  - named barriers (bar.sync / bar.arrive id, threads) are emu.h's named barriers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "ops/cuda/convert.cuh"
#include "ops/cuda/cp_async.cuh"

namespace sparsemla::cuda {

namespace emu_mma {

struct Fragments {
  uint32_t a[4], b[2];
};

inline double widen(uint16_t v, __nv_bfloat16) { return double(__bfloat162float(__nv_bfloat16{v})); }
inline double widen(uint16_t v, __half) { return double(__half2float(__ushort_as_half(v))); }

// c += A B of the warp's fragments (layouts in the real mma.cuh): each lane gathers its rows g and
// g + 8 of A (a0..a3 of lanes 4g..4g+3) and its columns 2q and 2q+1 of B (b0, b1 of lanes
// 4(2q)+.. and 4(2q+1)+..). Products of 16-bit values are exact in double and so is their sum but
// for the rare spreads of magnitude beyond double's 53 bits; c is added in double and the result
// rounded once to fp32. (The tensor cores add with their own internal width and truncation: the
// results differ from these in the last bits of fp32, which no test's bound comes near.)
template <class T16>
void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  Fragments mine;
  std::memcpy(mine.a, a, sizeof mine.a);
  std::memcpy(mine.b, b, sizeof mine.b);
  Fragments all[32];
  emu::Runner::current().warp_exchange(mine, all);
  const int lane = emu::lane_id(), g = lane / 4, q = lane % 4;
  double A[2][16], B[2][16];  // [row g, g + 8][k], [column 2q, 2q + 1][k]
  const auto lo = [](uint32_t w) { return uint16_t(w & 0xffffu); };
  const auto hi = [](uint32_t w) { return uint16_t(w >> 16); };
  for (int qq = 0; qq < 4; ++qq) {
    const Fragments& fa = all[4 * g + qq];
    for (int r = 0; r < 2; ++r) {
      A[r][2 * qq] = widen(lo(fa.a[r]), T16());
      A[r][2 * qq + 1] = widen(hi(fa.a[r]), T16());
      A[r][2 * qq + 8] = widen(lo(fa.a[r + 2]), T16());
      A[r][2 * qq + 9] = widen(hi(fa.a[r + 2]), T16());
    }
    for (int n = 0; n < 2; ++n) {
      const Fragments& fb = all[4 * (2 * q + n) + qq];
      B[n][2 * qq] = widen(lo(fb.b[0]), T16());
      B[n][2 * qq + 1] = widen(hi(fb.b[0]), T16());
      B[n][2 * qq + 8] = widen(lo(fb.b[1]), T16());
      B[n][2 * qq + 9] = widen(hi(fb.b[1]), T16());
    }
  }
  for (int r = 0; r < 2; ++r)
    for (int n = 0; n < 2; ++n) {
      double s = c[2 * r + n];
      for (int k = 0; k < 16; ++k) s += A[r][k] * B[n][k];
      c[2 * r + n] = float(s);
    }
}

// ldmatrix .x4 .b16: lane i gives the address of row i % 8 of matrix i / 8 (16-byte aligned, as
// the device requires); lane t gets of matrix j the 32 bits of row t / 4, columns 2 (t % 4) and
// 2 (t % 4) + 1, or with .trans those of the transposed matrix: column t / 4 of rows 2 (t % 4) and
// 2 (t % 4) + 1, the lower row in the low half.
inline void ldmatrix_x4(uint32_t r[4], const void* smem, bool trans) {
  if (reinterpret_cast<uintptr_t>(smem) % 16 != 0) {
    std::fprintf(stderr, "emu: ldmatrix row address %p is not 16-byte aligned\n", smem);
    std::abort();
  }
  const unsigned char* rows[32];
  emu::Runner::current().warp_exchange(static_cast<const unsigned char*>(smem), rows);
  const int t = emu::lane_id();
  for (int j = 0; j < 4; ++j) {
    if (!trans) {
      std::memcpy(&r[j], rows[8 * j + t / 4] + 4 * (t % 4), 4);
    } else {
      uint16_t v0, v1;
      std::memcpy(&v0, rows[8 * j + 2 * (t % 4)] + 2 * (t / 4), 2);
      std::memcpy(&v1, rows[8 * j + 2 * (t % 4) + 1] + 2 * (t / 4), 2);
      r[j] = uint32_t(v0) | (uint32_t(v1) << 16);
    }
  }
}

}  // namespace emu_mma

inline void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2], __nv_bfloat16) {
  emu_mma::mma_16816<__nv_bfloat16>(c, a, b);
}
inline void mma_16816(float c[4], const uint32_t a[4], const uint32_t b[2], __half) {
  emu_mma::mma_16816<__half>(c, a, b);
}
inline void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t b[2] = {b0, b1};
  emu_mma::mma_16816<__nv_bfloat16>(d, a, b);
}
inline void ldmatrix_x4_trans(uint32_t r[4], const void* smem) { emu_mma::ldmatrix_x4(r, smem, true); }
inline void ldmatrix_x4(uint32_t r[4], const void* smem) { emu_mma::ldmatrix_x4(r, smem, false); }

inline void named_sync(int id, int threads) { emu::Runner::current().named_barrier(id, threads, true); }
inline void named_arrive(int id, int threads) { emu::Runner::current().named_barrier(id, threads, false); }

inline float fast_exp2(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.0f;  // (.ftz: subnormal inputs are zeros)
  const float y = std::exp2(x);
  return y < 0x1p-126f ? 0.0f : y;  // results below the smallest normal flushed to zero
}

}  // namespace sparsemla::cuda
