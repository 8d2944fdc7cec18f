// Device-side decoders of the ggml block formats, one struct per type, used by the matrix products
// (gemv.cuh, gemm.cuh) and the row lookup. Each decodes one "unit" of a block straight from the
// weight bytes into registers:
//
//   Dq<T>::kBlock          elements per block (8 for the plain types, which are cut into blocks of 8)
//   Dq<T>::kBytes          bytes per block
//   Dq<T>::kUnit           elements per unit: 8 or 16, always runs of 8 consecutive elements
//   Dq<T>::kUnitsPerBlock  kBlock / kUnit
//   Dq<T>::run(u, r)       column (within the block) of run r of unit u
//   Dq<T>::unit(blk, u, q, sc, mn, tables)
//        element run(u, r) + i of the block is  sc[r] * q[8 r + i] - mn[r]  (r < kUnit / 8), with
//        q[] small values held exactly (integers, ±grid, grid ± delta) and sc / mn one scale and
//        one offset per run (mn only where kHasMin; the plain types leave both unset, !kScaled)
//
// The split lets the decode product form sc * sum(q x) - mn * sum(x) per run (three instructions
// per weight element instead of five), while dequantize_exact() below rebuilds each element as
// the CPU does.
//
// Units of a 256-element block are laid out so that units [4q, 4q + 4) cover exactly the quarter
// [64q, 64q + 64): the prefill kernel's 64-column tiles take whole units. Consecutive threads take
// consecutive units, so a warp's loads stay within one or two blocks.
//
// dequantize_exact() computes every element with the float operations of quants.cpp in the same
// order, with explicitly rounded intrinsics (no contraction into FMA), so the values equal the
// CPU's bit for bit (multiplying a sign into the grid value commutes with the rounding). Small integers become floats by the 2^23 trick (an integer add or byte permute and one
// float subtract) instead of the quarter-rate I2F conversion.
//
// Alignment: a block starts at a multiple of its byte size from a 16-byte aligned base, so a
// field at offset o of a block of B bytes is aligned to gcd(o, B, 16); loads never assume more.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "gguf/ggml_types.h"

namespace sparsemla::cuda {

// Codebooks of the IQ and FP4 formats (gguf/quant_tables.h) as the kernels read them: the large
// grids in device memory (read through the L1 cache), the 16-entry tables by value as 4 words of
// int8 each, for byte-permute lookups. One copy per device, uploaded on first use.
struct QuantTables {
  const uint2* iq2xxs = nullptr;     // [256]  8 uint8 magnitudes each
  const uint2* iq2xs = nullptr;      // [512]
  const uint2* iq2s = nullptr;       // [1024]
  const uint32_t* iq3xxs = nullptr;  // [256]  4 uint8 magnitudes each
  const uint32_t* iq3s = nullptr;    // [512]
  const uint2* iq1s = nullptr;       // [2048] 8 int8 in {-1, 0, 1}
  uint32_t iq4nl[4] = {};            // 16 int8 levels
  uint32_t mxfp4[4] = {};            // 16 int8 doubled E2M1 values
  float iq1_delta = 0.0f;
  // A grid entry (the IQ units read their tables through this: SharedTables, q8_units.cuh, reads
  // a block's copy in shared memory instead).
  template <class T>
  __device__ static T ld(const T* p) {
    return __ldg(p);
  }
};

namespace dq {

using gguf::GgmlType;

// ---- loads (p aligned as the suffix says) ----

__device__ __forceinline__ uint32_t ld8(const uint8_t* p) { return *p; }
__device__ __forceinline__ uint32_t ld16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ uint32_t ld32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint2 ld64(const uint8_t* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ uint4 ld128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }

// 4 bytes at a 2-byte aligned address: two halves.
__device__ __forceinline__ uint32_t ld32_a2(const uint8_t* p) { return ld16(p) | (ld16(p + 2) << 16); }

// 8 bytes at a 2-byte aligned address in three loads: the two aligned words from p rounded down
// and the last half-word, shifted into place by byte permutes. Reads only bytes in
// [p - 2, p + 8), and nothing before a 4-byte aligned buffer start.
__device__ __forceinline__ uint2 ld64_a2(const uint8_t* p) {
  const uint8_t* a = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t(3));
  const uint32_t w0 = ld32(a), w1 = ld32(a + 4), h = ld16(p + 6);
  const uint32_t sel = (reinterpret_cast<uintptr_t>(p) & 2) ? 0x5432u : 0x3210u;
  return make_uint2(__byte_perm(w0, w1, sel), __byte_perm(w1, h, sel));
}

// 16 bytes at a 2-byte aligned address as 4 words: 5 aligned words from p rounded down to 4,
// shifted into place by byte permutes. Reads bytes [p - 2, p + 20): callers keep them inside
// one weight block (never before a 4-byte aligned buffer start).
__device__ __forceinline__ uint4 ld128_a2(const uint8_t* p) {
  const uint8_t* a = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t(3));
  const uint32_t w0 = ld32(a), w1 = ld32(a + 4), w2 = ld32(a + 8), w3 = ld32(a + 12), w4 = ld32(a + 16);
  const uint32_t sel = (reinterpret_cast<uintptr_t>(p) & 2) ? 0x5432u : 0x3210u;
  return make_uint4(__byte_perm(w0, w1, sel), __byte_perm(w1, w2, sel), __byte_perm(w2, w3, sel),
                    __byte_perm(w3, w4, sel));
}

// 8 bytes at any address.
__device__ __forceinline__ uint2 ld64_a1(const uint8_t* p) {
  uint32_t w[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i / 4] |= ld8(p + i) << (8 * (i % 4));
  return make_uint2(w[0], w[1]);
}

// ---- conversions ----

__device__ __forceinline__ float half_to_f(uint32_t h) { return __half2float(__ushort_as_half(uint16_t(h))); }

// Small integer v (|v| < 2^22) as float, exactly: 1.5 * 2^23 + v has the integer in its mantissa.
__device__ __forceinline__ float int_to_f(int v) {
  return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.0f);
}

// Byte i of w as a float, minus `bias` (exact): byte i is permuted under 0x4B (2^23), then
// 2^23 + bias is subtracted.
template <int i>
__device__ __forceinline__ float byte_to_f(uint32_t w, float two23_plus_bias) {
  return __fsub_rn(__uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | i)), two23_plus_bias);
}

// Eight bytes (two words) as floats minus bias into v[0..8).
__device__ __forceinline__ void bytes8_to_f(uint32_t w0, uint32_t w1, int bias, float* v) {
  const float c = 8388608.0f + float(bias);
  v[0] = byte_to_f<0>(w0, c);
  v[1] = byte_to_f<1>(w0, c);
  v[2] = byte_to_f<2>(w0, c);
  v[3] = byte_to_f<3>(w0, c);
  v[4] = byte_to_f<0>(w1, c);
  v[5] = byte_to_f<1>(w1, c);
  v[6] = byte_to_f<2>(w1, c);
  v[7] = byte_to_f<3>(w1, c);
}

// Eight signed bytes as floats.
__device__ __forceinline__ void sbytes8_to_f(uint32_t w0, uint32_t w1, float* v) {
  bytes8_to_f(w0 ^ 0x80808080u, w1 ^ 0x80808080u, 128, v);
}

// Looks up the four 4-bit indices held in the low nibbles of the bytes of `idx` in a 16-entry
// int8 table (4 words); returns the four int8 values in the same byte positions.
__device__ __forceinline__ uint32_t lookup16(const uint32_t (&t)[4], uint32_t idx) {
  const uint32_t x = idx & 0x0F0F0F0Fu;
  // Selector nibbles from the bytes: nibble n = index of byte n (low 3 bits), plus a second
  // selector that picks the upper table's byte for indices >= 8.
  const uint32_t s = (x & 0x7) | ((x >> 4) & 0x70) | ((x >> 8) & 0x700) | ((x >> 12) & 0x7000);
  const uint32_t hi = (x & 0x8) | ((x >> 4) & 0x80) | ((x >> 8) & 0x800) | ((x >> 12) & 0x8000);
  const uint32_t lo_vals = __byte_perm(t[0], t[1], s);
  const uint32_t hi_vals = __byte_perm(t[2], t[3], s);
  return __byte_perm(lo_vals, hi_vals, 0x3210u | (hi >> 1));
}

// IQ2/IQ3 sign byte of a 7-bit index: bit 7 makes the parity even (gguf's ksigns table).
__device__ __forceinline__ uint32_t iq_signs(uint32_t idx7) { return idx7 | ((__popc(idx7) & 1u) << 7); }

// x, negated when bit j of `signs` is set (the CPU multiplies by -1.0f: the same bits).
__device__ __forceinline__ float flip(float x, uint32_t signs, int j) {
  return __uint_as_float(__float_as_uint(x) ^ (((signs >> j) & 1u) << 31));
}

// ---- the types ----

template <GgmlType T>
struct Dq;

// Plain types: blocks of 8 elements, one unit each; q holds the values themselves.
struct Plain8 {
  static constexpr int kBlock = 8, kUnit = 8, kUnitsPerBlock = 1;
  static constexpr bool kScaled = false, kHasMin = false;
  __device__ static int run(int, int) { return 0; }
};

template <>
struct Dq<GgmlType::F32> : Plain8 {
  static constexpr int kBytes = 32;
  __device__ static void unit(const uint8_t* b, int, float (&q)[8], float (&)[1], float (&)[1], const QuantTables&) {
    const uint4 a = ld128(b), c = ld128(b + 16);
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = __uint_as_float(w[i]);
  }
};

template <>
struct Dq<GgmlType::F16> : Plain8 {
  static constexpr int kBytes = 16;
  __device__ static void unit(const uint8_t* b, int, float (&q)[8], float (&)[1], float (&)[1], const QuantTables&) {
    const uint4 a = ld128(b);
    const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      q[2 * i] = half_to_f(w[i] & 0xFFFF);
      q[2 * i + 1] = half_to_f(w[i] >> 16);
    }
  }
};

template <>
struct Dq<GgmlType::BF16> : Plain8 {
  static constexpr int kBytes = 16;
  __device__ static void unit(const uint8_t* b, int, float (&q)[8], float (&)[1], float (&)[1], const QuantTables&) {
    const uint4 a = ld128(b);
    const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      q[2 * i] = __uint_as_float(w[i] << 16);
      q[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  }
};

// Q8_0, 34 bytes: fp16 d | int8 qs[32]. Unit u: elements 8u..8u+8. x = q * d
template <>
struct Dq<GgmlType::Q8_0> {
  static constexpr int kBlock = 32, kBytes = 34, kUnit = 8, kUnitsPerBlock = 4;
  static constexpr bool kScaled = true, kHasMin = false;
  __device__ static int run(int u, int) { return 8 * u; }
  __device__ static void unit(const uint8_t* b, int u, float (&q)[8], float (&sc)[1], float (&)[1], const QuantTables&) {
    sc[0] = half_to_f(ld16(b));
    const uint2 w = ld64_a2(b + 2 + 8 * u);
    sbytes8_to_f(w.x, w.y, q);
  }
};

// Q4_0 / IQ4_NL / MXFP4 share the layout of 16 bytes of nibbles: byte j holds element j (low)
// and j + 16 (high). Unit u (0, 1): bytes 8u..8u+8, runs at 8u and 16 + 8u; one scale.
struct Nibbles32 {
  static constexpr int kBlock = 32, kUnit = 16, kUnitsPerBlock = 2;
  static constexpr bool kScaled = true, kHasMin = false;
  __device__ static int run(int u, int r) { return 16 * r + 8 * u; }
};

// Q4_0, 18 bytes: fp16 d | qs[16]. x = (q - 8) * d
template <>
struct Dq<GgmlType::Q4_0> : Nibbles32 {
  static constexpr int kBytes = 18;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables&) {
    sc[0] = sc[1] = half_to_f(ld16(b));
    const uint2 w = ld64_a2(b + 2 + 8 * u);
    bytes8_to_f(w.x & 0x0F0F0F0Fu, w.y & 0x0F0F0F0Fu, 8, q);
    bytes8_to_f((w.x >> 4) & 0x0F0F0F0Fu, (w.y >> 4) & 0x0F0F0F0Fu, 8, q + 8);
  }
};

// IQ4_NL, 18 bytes: fp16 d | qs[16] indices into the IQ4_NL levels. x = d * level
template <>
struct Dq<GgmlType::IQ4_NL> : Nibbles32 {
  static constexpr int kBytes = 18;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables& t) {
    sc[0] = sc[1] = half_to_f(ld16(b));
    const uint2 w = ld64_a2(b + 2 + 8 * u);
    sbytes8_to_f(lookup16(t.iq4nl, w.x), lookup16(t.iq4nl, w.y), q);
    sbytes8_to_f(lookup16(t.iq4nl, w.x >> 4), lookup16(t.iq4nl, w.y >> 4), q + 8);
  }
};

// MXFP4, 17 bytes: E8M0 exponent e | qs[16] E2M1 codes. x = e2m1 * 2^(e - 128) (doubled table)
template <>
struct Dq<GgmlType::MXFP4> : Nibbles32 {
  static constexpr int kBytes = 17;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables& t) {
    const uint32_t e = ld8(b);
    sc[0] = sc[1] = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
    const uint2 w = ld64_a1(b + 1 + 8 * u);
    sbytes8_to_f(lookup16(t.mxfp4, w.x), lookup16(t.mxfp4, w.y), q);
    sbytes8_to_f(lookup16(t.mxfp4, w.x >> 4), lookup16(t.mxfp4, w.y >> 4), q + 8);
  }
};

// 256-element blocks in 16 units of 16: unit u lies in quarter q = u / 4 at l0 = 8 (u % 4), with
// runs at 64q + l0 and 64q + 32 + l0. In Q4_K/Q5_K the two runs are the low and high nibbles of
// the same bytes; in Q2_K/Q3_K/Q6_K they are consecutive bit planes of the same bytes.
struct Quarters256 {
  static constexpr int kBlock = 256, kUnit = 16, kUnitsPerBlock = 16;
  __device__ static int run(int u, int r) { return 64 * (u / 4) + 32 * r + 8 * (u % 4); }
};

// Q4_K/Q5_K scale and min of group g (0..7) from the 12 scale bytes held in s0 (bytes 0..3),
// s1 (4..7), s2 (8..11); see k4_scale_min in quants.cpp. Branch-free: lanes of a warp hold
// different groups.
__device__ __forceinline__ void k4_scale_min(uint32_t s0, uint32_t s1, uint32_t s2, int g, int* sc, int* m) {
  const int j = 8 * (g & 3);
  const int lo_sc = (s0 >> j) & 63, lo_m = (s1 >> j) & 63;
  const int hi_sc = ((s2 >> j) & 0x0F) | (((s0 >> j) >> 6 & 3) << 4);
  const int hi_m = ((s2 >> j) >> 4 & 0x0F) | (((s1 >> j) >> 6 & 3) << 4);
  *sc = g < 4 ? lo_sc : hi_sc;
  *m = g < 4 ? lo_m : hi_m;
}

// Q4_K, 144 bytes: fp16 d | fp16 dmin | scales[12] | qs[128]. x = d*sc * q - dmin*m
template <>
struct Dq<GgmlType::Q4_K> : Quarters256 {
  static constexpr int kBytes = 144;
  static constexpr bool kScaled = true, kHasMin = true;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&mn)[2], const QuantTables&) {
    const int k = u / 4, l0 = 8 * (u % 4);
    const uint4 hd = ld128(b);  // fp16 d, dmin | scales[12]: 144-byte blocks are 16-byte aligned
    const float d = half_to_f(hd.x & 0xFFFF), dmin = half_to_f(hd.x >> 16);
    const uint32_t s0 = hd.y, s1 = hd.z, s2 = hd.w;
    const uint2 w = ld64(b + 16 + 32 * k + l0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int s, m;
      k4_scale_min(s0, s1, s2, 2 * k + r, &s, &m);
      sc[r] = __fmul_rn(d, int_to_f(s));
      mn[r] = __fmul_rn(dmin, int_to_f(m));
      bytes8_to_f((w.x >> (4 * r)) & 0x0F0F0F0Fu, (w.y >> (4 * r)) & 0x0F0F0F0Fu, 0, q + 8 * r);
    }
  }
};

// Q5_K, 176 bytes: fp16 d | fp16 dmin | scales[12] | qh[32] | qs[128]. As Q4_K with the fifth
// bit of element 32g + l in bit g of qh[l].
template <>
struct Dq<GgmlType::Q5_K> : Quarters256 {
  static constexpr int kBytes = 176;
  static constexpr bool kScaled = true, kHasMin = true;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&mn)[2], const QuantTables&) {
    const int k = u / 4, l0 = 8 * (u % 4);
    const uint4 hd = ld128(b);  // fp16 d, dmin | scales[12]: 176-byte blocks are 16-byte aligned
    const float d = half_to_f(hd.x & 0xFFFF), dmin = half_to_f(hd.x >> 16);
    const uint32_t s0 = hd.y, s1 = hd.z, s2 = hd.w;
    const uint2 h = ld64(b + 16 + l0);
    const uint2 w = ld64(b + 48 + 32 * k + l0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int g = 2 * k + r;
      int s, m;
      k4_scale_min(s0, s1, s2, g, &s, &m);
      sc[r] = __fmul_rn(d, int_to_f(s));
      mn[r] = __fmul_rn(dmin, int_to_f(m));
      const uint32_t w0 = ((w.x >> (4 * r)) & 0x0F0F0F0Fu) | (((h.x >> g) & 0x01010101u) << 4);
      const uint32_t w1 = ((w.y >> (4 * r)) & 0x0F0F0F0Fu) | (((h.y >> g) & 0x01010101u) << 4);
      bytes8_to_f(w0, w1, 0, q + 8 * r);
    }
  }
};

// Q6_K, 210 bytes: ql[128] | qh[64] | int8 scales[16] | fp16 d. Quarter q = 2h + kk holds
// k = 2kk (run 0) and 2kk + 1 (run 1) of half h: low nibble kk of ql[64h + 32 (k % 2) + l], bits
// 2k of qh[32h + l], scale sc[8h + l / 16 + 2k]. x = d * sc * (q - 32)
template <>
struct Dq<GgmlType::Q6_K> : Quarters256 {
  static constexpr int kBytes = 210;
  static constexpr bool kScaled = true, kHasMin = false;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables&) {
    const int qq = u / 4, h = qq / 2, kk = qq % 2, l0 = 8 * (u % 4);
    const float d = half_to_f(ld16(b + 208));
    const uint2 hb = ld64_a2(b + 128 + 32 * h + l0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int k = 2 * kk + r;
      const uint2 lb = ld64_a2(b + 64 * h + 32 * r + l0);
      sc[r] = __fmul_rn(d, int_to_f(int(int8_t(ld8(b + 192 + 8 * h + l0 / 16 + 2 * k)))));
      const uint32_t w0 = ((lb.x >> (4 * kk)) & 0x0F0F0F0Fu) | (((hb.x >> (2 * k)) & 0x03030303u) << 4);
      const uint32_t w1 = ((lb.y >> (4 * kk)) & 0x0F0F0F0Fu) | (((hb.y >> (2 * k)) & 0x03030303u) << 4);
      bytes8_to_f(w0, w1, 32, q + 8 * r);
    }
  }
};

// Q2_K, 84 bytes: scales[16] | qs[64] | fp16 d | fp16 dmin. Quarter q = 2h + kk holds passes
// p = 2kk (run 0) and 2kk + 1 (run 1): bits 2p of qs[32h + l], scale byte scales[8h + 2p + l / 16]
// (low nibble scale, high nibble min). x = d*sc * q - dmin*m
template <>
struct Dq<GgmlType::Q2_K> : Quarters256 {
  static constexpr int kBytes = 84;
  static constexpr bool kScaled = true, kHasMin = true;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&mn)[2], const QuantTables&) {
    const int qq = u / 4, h = qq / 2, l0 = 8 * (u % 4), sub = l0 / 16;
    const uint32_t dd = ld32(b + 80);
    const float d = half_to_f(dd & 0xFFFF), dmin = half_to_f(dd >> 16);
    const uint32_t sw = ld32(b + 4 * qq);  // scales[8h + 4kk .. +4]: bytes sub and sub + 2
    const uint2 w = make_uint2(ld32(b + 16 + 32 * h + l0), ld32(b + 20 + 32 * h + l0));  // 4-byte aligned
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int p = 2 * (qq % 2) + r;
      const uint32_t s = (sw >> (8 * (sub + 2 * r))) & 0xFF;
      sc[r] = __fmul_rn(d, int_to_f(int(s & 0x0F)));
      mn[r] = __fmul_rn(dmin, int_to_f(int(s >> 4)));
      bytes8_to_f((w.x >> (2 * p)) & 0x03030303u, (w.y >> (2 * p)) & 0x03030303u, 0, q + 8 * r);
    }
  }
};

// Q3_K, 110 bytes: hmask[32] | qs[64] | scales[12] | fp16 d. Quarter as in Q2_K; the high bit
// of element 128h + 32p + l is bit 4h + p of hmask[l]; scale i = 8h + 2p + l / 16 is 6 bits with
// a +32 bias. x = d * (sc - 32) * (q - (high bit ? 0 : 4))
template <>
struct Dq<GgmlType::Q3_K> : Quarters256 {
  static constexpr int kBytes = 110;
  static constexpr bool kScaled = true, kHasMin = false;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables&) {
    const int qq = u / 4, h = qq / 2, kk = qq % 2, l0 = 8 * (u % 4), sub = l0 / 16;
    const float d = half_to_f(ld16(b + 108));
    const uint2 hm = ld64_a2(b + l0);
    const uint2 w = ld64_a2(b + 32 + 32 * h + l0);
    const uint8_t* s = b + 96;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int p = 2 * kk + r;
      const int i = 8 * h + 2 * p + sub;  // i % 8 = 4kk + 2r + sub, i / 8 = h, i % 4 = 2r + sub
      const int lo = (ld8(s + i % 8) >> (4 * h)) & 0x0F;
      const int hi = (ld8(s + 8 + i % 4) >> (2 * (i / 4))) & 3;
      sc[r] = __fmul_rn(d, int_to_f((lo | (hi << 4)) - 32));
      const int hbit = 4 * h + p;
      const uint32_t w0 = ((w.x >> (2 * p)) & 0x03030303u) | (((hm.x >> hbit) & 0x01010101u) << 2);
      const uint32_t w1 = ((w.y >> (2 * p)) & 0x03030303u) | (((hm.y >> hbit) & 0x01010101u) << 2);
      bytes8_to_f(w0, w1, 4, q + 8 * r);  // low + 4 * high - 4 = low - (high ? 0 : 4)
    }
  }
};

// The IQ formats and IQ4_XS: 8 groups of 32; unit u is half u % 2 of group g = u / 2.
struct Groups256 {
  static constexpr int kBlock = 256, kUnit = 16, kUnitsPerBlock = 16;
  static constexpr bool kScaled = true, kHasMin = false;
};

// IQ4_XS, 136 bytes: fp16 d | scales_h (u16) | scales_l[4] | qs[128]; group g's 16 bytes are an
// IQ4_NL block. Unit (g, i): bytes 8i..8i+8 of the group, runs at 32g + 8i (low) and
// 32g + 16 + 8i (high). x = d * (s - 32) * level
template <>
struct Dq<GgmlType::IQ4_XS> : Groups256 {
  static constexpr int kBytes = 136;
  __device__ static int run(int u, int r) { return 32 * (u / 2) + 16 * r + 8 * (u % 2); }
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables& t) {
    const int g = u / 2, i = u % 2;
    const uint2 hdr = ld64(b);
    const float d = half_to_f(hdr.x & 0xFFFF);
    const int ls = ((hdr.y >> (4 * g)) & 0x0F) | (((hdr.x >> (16 + 2 * g)) & 3) << 4);
    sc[0] = sc[1] = __fmul_rn(d, int_to_f(ls - 32));
    const uint2 w = ld64(b + 8 + 16 * g + 8 * i);
    sbytes8_to_f(lookup16(t.iq4nl, w.x), lookup16(t.iq4nl, w.y), q);
    sbytes8_to_f(lookup16(t.iq4nl, w.x >> 4), lookup16(t.iq4nl, w.y >> 4), q + 8);
  }
};

// Units of 16 consecutive elements (two grid entries of 8): runs at 32g + 16i and + 8.
struct Consecutive16 : Groups256 {
  __device__ static int run(int u, int r) { return 16 * u + 8 * r; }
};

// Eight grid magnitudes (the bytes of e), negated where `signs` has a bit set.
__device__ __forceinline__ void grid8(uint2 e, uint32_t signs, float* q) {
  bytes8_to_f(e.x, e.y, 0, q);
#pragma unroll
  for (int j = 0; j < 8; ++j) q[j] = flip(q[j], signs, j);
}

// IQ2_XXS, 66 bytes: fp16 d | 8 groups of 8 bytes: 4 grid indices, u32 with four 7-bit sign
// indices and a 4-bit scale. x = d * (0.5 + s) / 4 * grid * sign
template <>
struct Dq<GgmlType::IQ2_XXS> : Consecutive16 {
  static constexpr int kBytes = 66;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables& t) {
    const int g = u / 2, i = u % 2;
    const float d = half_to_f(ld16(b));
    const uint8_t* p = b + 2 + 8 * g;
    const uint32_t aux = ld32_a2(p + 4);
    const uint32_t idx = ld16(p + 2 * i);
    sc[0] = sc[1] = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, int_to_f(int(aux >> 28)))), 0.25f);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int l = 2 * i + r;
      grid8(__ldg(t.iq2xxs + ((idx >> (8 * r)) & 0xFF)), iq_signs((aux >> (7 * l)) & 127), q + 8 * r);
    }
  }
};

// IQ2_XS, 74 bytes: fp16 d | u16 qs[32]: grid index bits 0..8, sign index 9..15 | scales[8]:
// a nibble per 16 elements. x = d * (0.5 + s) / 4 * grid * sign
template <>
struct Dq<GgmlType::IQ2_XS> : Consecutive16 {
  static constexpr int kBytes = 74;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables& t) {
    const int g = u / 2, i = u % 2;
    const float d = half_to_f(ld16(b));
    const uint32_t qs = ld32_a2(b + 2 + 8 * g + 4 * i);
    const int s = (ld8(b + 66 + g) >> (4 * i)) & 0x0F;
    sc[0] = sc[1] = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, int_to_f(s))), 0.25f);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t e = (qs >> (16 * r)) & 0xFFFF;
      grid8(__ldg(t.iq2xs + (e & 511)), iq_signs(e >> 9), q + 8 * r);
    }
  }
};

// IQ2_S, 82 bytes: fp16 d | qs[32] low index bits | signs[32] | qh[8]: top 2 index bits per
// entry | scales[8]. x = d * (0.5 + s) / 4 * grid * sign
template <>
struct Dq<GgmlType::IQ2_S> : Consecutive16 {
  static constexpr int kBytes = 82;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables& t) {
    const int g = u / 2, i = u % 2;
    const float d = half_to_f(ld16(b));
    const uint32_t qs = ld16(b + 2 + 4 * g + 2 * i);
    const uint32_t sg = ld16(b + 34 + 4 * g + 2 * i);
    const uint32_t qh = ld8(b + 66 + g);
    const int s = (ld8(b + 74 + g) >> (4 * i)) & 0x0F;
    sc[0] = sc[1] = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, int_to_f(s))), 0.25f);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int l = 2 * i + r;
      const uint32_t index = ((qs >> (8 * r)) & 0xFF) | (((qh >> (2 * l)) & 3) << 8);
      grid8(__ldg(t.iq2s + index), (sg >> (8 * r)) & 0xFF, q + 8 * r);
    }
  }
};

// IQ3_XXS, 98 bytes: fp16 d | qs[64], a grid index per 4 elements | 8 u32: four 7-bit sign
// indices and a 4-bit scale per group. x = d * (0.5 + s) / 2 * grid * sign
template <>
struct Dq<GgmlType::IQ3_XXS> : Consecutive16 {
  static constexpr int kBytes = 98;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables& t) {
    const int g = u / 2, i = u % 2;
    const float d = half_to_f(ld16(b));
    const uint32_t aux = ld32_a2(b + 66 + 4 * g);
    const uint32_t qs = ld32_a2(b + 2 + 8 * g + 4 * i);
    sc[0] = sc[1] = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, int_to_f(int(aux >> 28)))), 0.5f);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int l = 2 * i + r;
      const uint32_t g1 = __ldg(t.iq3xxs + ((qs >> (16 * r)) & 0xFF));
      const uint32_t g2 = __ldg(t.iq3xxs + ((qs >> (16 * r + 8)) & 0xFF));
      grid8(make_uint2(g1, g2), iq_signs((aux >> (7 * l)) & 127), q + 8 * r);
    }
  }
};

// IQ3_S, 110 bytes: fp16 d | qs[64] low index bits | qh[8]: ninth bits | signs[32] |
// scales[4]: a nibble per group. x = d * (1 + 2s) * grid * sign
template <>
struct Dq<GgmlType::IQ3_S> : Consecutive16 {
  static constexpr int kBytes = 110;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables& t) {
    const int g = u / 2, i = u % 2;
    const float d = half_to_f(ld16(b));
    const uint32_t qs = ld32_a2(b + 2 + 8 * g + 4 * i);
    const uint32_t qh = ld8(b + 66 + g);
    const uint32_t sg = ld16(b + 74 + 4 * g + 2 * i);
    const int s = (ld8(b + 106 + g / 2) >> (4 * (g % 2))) & 0x0F;
    sc[0] = sc[1] = __fmul_rn(d, int_to_f(1 + 2 * s));
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int l = 2 * i + r;
      const uint32_t i1 = ((qs >> (16 * r)) & 0xFF) | (((qh >> (2 * l)) & 1) << 8);
      const uint32_t i2 = ((qs >> (16 * r + 8)) & 0xFF) | (((qh >> (2 * l + 1)) & 1) << 8);
      grid8(make_uint2(__ldg(t.iq3s + i1), __ldg(t.iq3s + i2)), (sg >> (8 * r)) & 0xFF, q + 8 * r);
    }
  }
};

// Eight ternary grid values (int8 bytes of e) plus delta: exact (|grid ± delta| <= 1.125).
__device__ __forceinline__ void grid8_ternary(uint2 e, float delta, float* q) {
  sbytes8_to_f(e.x, e.y, q);
#pragma unroll
  for (int j = 0; j < 8; ++j) q[j] = __fadd_rn(q[j], delta);
}

// IQ1_S, 50 bytes: fp16 d | qs[32] low index bits | u16 qh[8]: top 3 index bits per entry,
// scale bits 12..14, delta sign bit 15. x = d * (2s + 1) * (grid ± delta)
template <>
struct Dq<GgmlType::IQ1_S> : Consecutive16 {
  static constexpr int kBytes = 50;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables& t) {
    const int g = u / 2, i = u % 2;
    const float d = half_to_f(ld16(b));
    const uint32_t qs = ld16(b + 2 + 4 * g + 2 * i);
    const uint32_t qh = ld16(b + 34 + 2 * g);
    sc[0] = sc[1] = __fmul_rn(d, int_to_f(int(2 * ((qh >> 12) & 7) + 1)));
    const float delta = qh & 0x8000 ? -t.iq1_delta : t.iq1_delta;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int l = 2 * i + r;
      const uint32_t index = ((qs >> (8 * r)) & 0xFF) | (((qh >> (3 * l)) & 7) << 8);
      grid8_ternary(__ldg(t.iq1s + index), delta, q + 8 * r);
    }
  }
};

// IQ1_M, 56 bytes: qs[32] low index bits | qh[16]: a nibble per entry (top 3 index bits, delta
// sign) | u16 scales[4]: two 3-bit scales per group in bits 0..11, fp16 d in the top nibbles.
// x = d * (2s + 1) * (grid ± delta)
template <>
struct Dq<GgmlType::IQ1_M> : Consecutive16 {
  static constexpr int kBytes = 56;
  __device__ static void unit(const uint8_t* b, int u, float (&q)[16], float (&sc)[2], float (&)[2], const QuantTables& t) {
    const int g = u / 2, i = u % 2;
    const uint2 s4 = ld64(b + 48);  // scales[0..1] in x, [2..3] in y
    const uint32_t d_bits = (s4.x >> 12 & 0x000F) | (s4.x >> 24 & 0x00F0) | (s4.y >> 4 & 0x0F00) | (s4.y >> 16 & 0xF000);
    const float d = half_to_f(d_bits);
    const uint32_t word = (g < 4 ? s4.x : s4.y) >> (16 * ((g / 2) % 2));  // scales[g / 2] in bits 0..15
    sc[0] = sc[1] = __fmul_rn(d, int_to_f(int(2 * ((word >> (6 * (g % 2) + 3 * i)) & 7) + 1)));
    const uint32_t qs = ld16(b + 4 * g + 2 * i);
    const uint32_t qh = ld8(b + 32 + 2 * g + i);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t nib = (qh >> (4 * r)) & 0x0F;
      const uint32_t index = ((qs >> (8 * r)) & 0xFF) | ((nib & 7) << 8);
      grid8_ternary(__ldg(t.iq1s + index), nib & 8 ? -t.iq1_delta : t.iq1_delta, q + 8 * r);
    }
  }
};

// ---- wide units for the decode product ----
//
// The decode product (gemv.cuh) is limited by the L1 requests of its small scattered weight loads
// when a unit is 16 elements; these views of Q4_K and Q6_K take 32 elements per unit (4 runs) from
// the bytes that two of the units above share, in fewer and wider loads. They have the interface
// of Dq<T> (kRuns = 4) and serve only the decode product; GemvUnits<D> names the view it uses.

// Q4_K in 8 units of 32: unit w = 2k + j takes qs bytes 16 + 16w .. + 16 (one 16-byte load) of
// quarter k: run 0 / 1 the low nibbles of bytes 0..7 / 8..15 (group 2k), run 2 / 3 the high
// nibbles (group 2k + 1). Run r is at 64k + 32 (r / 2) + 16j + 8 (r % 2).
struct Q4KWide {
  static constexpr int kBlock = 256, kBytes = 144, kUnit = 32, kUnitsPerBlock = 8;
  static constexpr bool kScaled = true, kHasMin = true;
  __device__ static int run(int w, int r) { return 64 * (w / 2) + 32 * (r / 2) + 16 * (w % 2) + 8 * (r % 2); }
  __device__ static void unit(const uint8_t* b, int w, float (&q)[32], float (&sc)[4], float (&mn)[4], const QuantTables&) {
    const int k = w / 2;
    const uint4 hd = ld128(b);
    const uint4 qs = ld128(b + 16 + 16 * w);
    const float d = half_to_f(hd.x & 0xFFFF), dmin = half_to_f(hd.x >> 16);
#pragma unroll
    for (int n = 0; n < 2; ++n) {  // nibble n: group 2k + n, runs 2n and 2n + 1
      int s, m;
      k4_scale_min(hd.y, hd.z, hd.w, 2 * k + n, &s, &m);
      sc[2 * n] = sc[2 * n + 1] = __fmul_rn(d, int_to_f(s));
      mn[2 * n] = mn[2 * n + 1] = __fmul_rn(dmin, int_to_f(m));
      bytes8_to_f((qs.x >> (4 * n)) & 0x0F0F0F0Fu, (qs.y >> (4 * n)) & 0x0F0F0F0Fu, 0, q + 16 * n);
      bytes8_to_f((qs.z >> (4 * n)) & 0x0F0F0F0Fu, (qs.w >> (4 * n)) & 0x0F0F0F0Fu, 0, q + 16 * n + 8);
    }
  }
};

// Q6_K in 8 units of 32: unit w (half h = w / 4, l0 = 8 (w % 4)) takes runs k = 0..3 of half h
// at 128h + 32k + l0, which share their ql bytes (k and k + 2: two nibbles of ql[64h + 32 (k % 2)
// + l]) and their qh bytes (bits 2k of qh[32h + l]); the four scales sc[8h + l0 / 16 + 2k] lie in
// one 8-byte span. 13 loads for 32 elements instead of 24.
struct Q6KWide {
  static constexpr int kBlock = 256, kBytes = 210, kUnit = 32, kUnitsPerBlock = 8;
  static constexpr bool kScaled = true, kHasMin = false;
  __device__ static int run(int w, int r) { return 128 * (w / 4) + 32 * r + 8 * (w % 4); }
  __device__ static void unit(const uint8_t* b, int w, float (&q)[32], float (&sc)[4], float (&)[4], const QuantTables&) {
    const int h = w / 4, l0 = 8 * (w % 4), sub = l0 / 16;
    const float d = half_to_f(ld16(b + 208));
    const uint2 hb = ld64_a2(b + 128 + 32 * h + l0);
    const uint2 lb[2] = {ld64_a2(b + 64 * h + l0), ld64_a2(b + 64 * h + 32 + l0)};
    const uint2 sw = ld64_a2(b + 192 + 8 * h);  // scales 8h .. 8h + 8: run k's is byte sub + 2k
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t word = k < 2 ? sw.x : sw.y;
      sc[k] = __fmul_rn(d, int_to_f(int(int8_t((word >> (8 * (sub + 2 * (k % 2)))) & 0xFF))));
      const uint2 l = lb[k % 2];
      const uint32_t w0 = ((l.x >> (4 * (k / 2))) & 0x0F0F0F0Fu) | (((hb.x >> (2 * k)) & 0x03030303u) << 4);
      const uint32_t w1 = ((l.y >> (4 * (k / 2))) & 0x0F0F0F0Fu) | (((hb.y >> (2 * k)) & 0x03030303u) << 4);
      bytes8_to_f(w0, w1, 32, q + 8 * k);
    }
  }
};

// The units the decode product takes for weights of decoder D.
template <class D>
struct GemvUnits {
  using type = D;
};
template <>
struct GemvUnits<Dq<GgmlType::Q4_K>> {
  using type = Q4KWide;
};
template <>
struct GemvUnits<Dq<GgmlType::Q6_K>> {
  using type = Q6KWide;
};

// ---- consumers' helpers ----

template <class D>
constexpr int kRuns = D::kUnit / 8;

// Unit u of block blk as the CPU's float values (bit for bit).
template <class D>
__device__ __forceinline__ void dequantize_exact(const uint8_t* blk, int u, float (&v)[D::kUnit], const QuantTables& t) {
  float sc[kRuns<D>], mn[kRuns<D>];
  D::unit(blk, u, v, sc, mn, t);
  if constexpr (D::kScaled) {
#pragma unroll
    for (int i = 0; i < D::kUnit; ++i) {
      v[i] = __fmul_rn(sc[i / 8], v[i]);
      if constexpr (D::kHasMin) v[i] = __fsub_rn(v[i], mn[i / 8]);
    }
  }
}

// Unit u of block blk as values for a low-precision consumer: one FMA per element.
template <class D>
__device__ __forceinline__ void dequantize_fast(const uint8_t* blk, int u, float (&v)[D::kUnit], const QuantTables& t) {
  float sc[kRuns<D>], mn[kRuns<D>];
  D::unit(blk, u, v, sc, mn, t);
  if constexpr (D::kScaled) {
#pragma unroll
    for (int i = 0; i < D::kUnit; ++i) v[i] = D::kHasMin ? __fmaf_rn(sc[i / 8], v[i], -mn[i / 8]) : sc[i / 8] * v[i];
  }
}

}  // namespace dq
}  // namespace sparsemla::cuda
