// The int8-activation decode units (gemv_q8.cu's dp4a kernels, absorb_q8.cu's head-batched
// product): for each weight type, the bytes of whole activation blocks that one thread decodes
// (W, load), the token's activations of those blocks (X, load_x) and their product (fma). The
// header of gemv_q8.cu describes the scheme and the units of each type.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ops/cuda/dequant.cuh"
#include "ops/cuda/quant_matmul_q8.h"

namespace sparsemla::cuda::q8units {

// The IQ units read their grid tables (QuantTables) through TB::ld: QuantTables's from global
// memory, SharedTables's from a block's copy in shared memory (gemv_q8_staged_runs_kernel: a warp's
// 32 gathers of a grid entry touch ~30 sectors of the table through L1, where from shared memory
// they take a few wavefronts; H100, Nsight, one-token IQ1_S / IQ2_XXS heads: L1/TEX 80-83% busy,
// 64-70% of the global sectors excess). GridTable names a unit's table and its size.
struct SharedTables : QuantTables {
  template <class T>
  __device__ static T ld(const T* p) {
    return *p;
  }
};
template <class V, class = void>
struct GridOf {  // (units without a table)
  static constexpr int kBytes = 0;
};
template <class V>
struct GridOf<V, std::void_t<decltype(V::kGridBytes)>> {
  static constexpr int kBytes = V::kGridBytes;
};
template <class T, const T* QuantTables::*Field, int N>
struct GridTable {
  static constexpr int kGridBytes = N * int(sizeof(T));
  __device__ static const void* grid(const QuantTables& t) { return t.*Field; }
  __device__ static void set_grid(QuantTables& t, const void* p) { t.*Field = static_cast<const T*>(p); }
};

using dq::half_to_f;
using dq::int_to_f;
using dq::ld128;
using dq::ld128_a2;
using dq::ld16;
using dq::ld32;

__device__ __forceinline__ int dot16(const uint32_t (&w)[4], const int4 x, int acc) {
  acc = __dp4a(int(w[0]), x.x, acc);
  acc = __dp4a(int(w[1]), x.y, acc);
  acc = __dp4a(int(w[2]), x.z, acc);
  return __dp4a(int(w[3]), x.w, acc);
}

// The integer dot of N 16-byte parts of a unit's weights with the activations of each of L levels,
// as a float: level 0 alone, or 254 times it plus level 1 (sum w (254 q + r)).
template <int L>
__device__ __forceinline__ float dot_to_f(int d) {
  if constexpr (L == 2) return __int2float_rn(d);
  else return int_to_f(d);  // |d| < 2^22 (32 x 128 x 127 at most): exact
}
template <int L, int N>
__device__ __forceinline__ float level_dot(const uint32_t (&w)[N][4], const int4 (&x)[L][N]) {
  int d = 0;
#pragma unroll
  for (int n = 0; n < N; ++n) d = dot16(w[n], x[0][n], d);
  if constexpr (L == 2) {
    d *= kQ8LevelRatio;
#pragma unroll
    for (int n = 0; n < N; ++n) d = dot16(w[n], x[1][n], d);
  }
  return dot_to_f<L>(d);
}
// The same for one 16-byte part, each level's dot started from start[l] (PlanesUnit: -bias sum x).
template <int L>
__device__ __forceinline__ float level_dot(const uint32_t (&w)[4], const int4 (&x)[L], const int (&start)[L]) {
  int d = dot16(w, x[0], start[0]);
  if constexpr (L == 2) d = dot16(w, x[1], d * kQ8LevelRatio + start[1]);
  return dot_to_f<L>(d);
}

// The activation rows of one token: level l's values at q[l] (the blocks' scales and sums at xb),
// in global memory (read through the non-coherent cache) or, kShared, in the block's shared memory
// (absorb_q8.cu: each block quantizes its head's activations there).
template <int L, bool kShared = false>
struct TokenX {
  const int8_t* q[L];
  const int2* xb;
  template <class T>
  __device__ static T ld(const T* p) {
    if constexpr (kShared) return *p;
    else return __ldg(p);
  }
};

// ---- units: W = one row's decoded unit, X = one token's activations of the unit ----

// Q4_K and Q5_K: quarter k (unit u = k) of the block; lo / hi hold the 32 values of sub-blocks 2k
// and 2k + 1 as unsigned bytes (4 or 5 bits). Element = d sc q - dmin m.
struct KMinUnit {
  static constexpr int kBlock = 256, kUnitsPerBlock = 4, kUnroll = 2;
  struct W {
    uint32_t lo[2][4], hi[2][4];  // [16-byte half][word]
    float sc[2], mn[2];           // d * sc, dmin * m of sub-blocks 2k, 2k + 1
  };
  template <int L>
  struct X {
    int4 lo[L][2], hi[L][2];  // per level: activation blocks 2k and 2k + 1 of the 256-block, 16 bytes each half
    float d[2], ds[2];        // their scales, and scale * sum
  };
  __device__ static void scales(const uint4 hd, int k, W& w) {
    const float d = half_to_f(hd.x & 0xFFFF), dmin = half_to_f(hd.x >> 16);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int s, m;
      dq::k4_scale_min(hd.y, hd.z, hd.w, 2 * k + r, &s, &m);
      w.sc[r] = __fmul_rn(d, int_to_f(s));
      w.mn[r] = __fmul_rn(dmin, int_to_f(m));
    }
  }
  template <int L, bool S = false>
  __device__ static X<L> load_x(const TokenX<L, S>& t, int64_t blk, int k) {
    const int64_t ab = blk * 8 + 2 * k;  // first activation block of the unit
    X<L> x;
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const int4* p = reinterpret_cast<const int4*>(t.q[l] + 32 * ab);
      x.lo[l][0] = t.ld(p), x.lo[l][1] = t.ld(p + 1), x.hi[l][0] = t.ld(p + 2), x.hi[l][1] = t.ld(p + 3);
    }
    const int4 s = t.ld(reinterpret_cast<const int4*>(t.xb + ab));
    x.d[0] = __int_as_float(s.x), x.d[1] = __int_as_float(s.z);
    x.ds[0] = __fmul_rn(x.d[0], dot_to_f<L>(s.y)), x.ds[1] = __fmul_rn(x.d[1], dot_to_f<L>(s.w));
    return x;
  }
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
    const float dlo = level_dot<L, 2>(w.lo, x.lo), dhi = level_dot<L, 2>(w.hi, x.hi);
    acc = __fmaf_rn(__fmul_rn(w.sc[0], x.d[0]), dlo, acc);
    acc = __fmaf_rn(-w.mn[0], x.ds[0], acc);
    acc = __fmaf_rn(__fmul_rn(w.sc[1], x.d[1]), dhi, acc);
    return __fmaf_rn(-w.mn[1], x.ds[1], acc);
  }
};

// Q4_K, 144 bytes: fp16 d | fp16 dmin | scales[12] | qs[128]; quarter k in qs[32k .. 32k + 32).
struct Q4KUnit : KMinUnit {
  static constexpr int kBytes = 144;
  __device__ static W load(const uint8_t* b, int k, const QuantTables&) {
    W w;
    scales(ld128(b), k, w);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 q = ld128(b + 16 + 32 * k + 16 * h);
      const uint32_t v[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w.lo[h][i] = v[i] & 0x0F0F0F0Fu;
        w.hi[h][i] = (v[i] >> 4) & 0x0F0F0F0Fu;
      }
    }
    return w;
  }
};

// Q5_K, 176 bytes: fp16 d | fp16 dmin | scales[12] | qh[32] | qs[128]; the fifth bit of element
// 32g + l is bit g of qh[l].
struct Q5KUnit : KMinUnit {
  static constexpr int kBytes = 176;
  __device__ static W load(const uint8_t* b, int k, const QuantTables&) {
    W w;
    scales(ld128(b), k, w);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 q = ld128(b + 48 + 32 * k + 16 * h), hb = ld128(b + 16 + 16 * h);
      const uint32_t v[4] = {q.x, q.y, q.z, q.w}, hv[4] = {hb.x, hb.y, hb.z, hb.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w.lo[h][i] = (v[i] & 0x0F0F0F0Fu) | (((hv[i] >> (2 * k)) & 0x01010101u) << 4);
        w.hi[h][i] = ((v[i] >> 4) & 0x0F0F0F0Fu) | (((hv[i] >> (2 * k + 1)) & 0x01010101u) << 4);
      }
    }
    return w;
  }
};

// Units of two groups of 32 under one scale each (IQ4_XS, IQ2_XXS): quarter k (unit u = k) holds
// groups 2k and 2k + 1, activation blocks of their own (Q4_K's unit and activation side), their
// weights decoded to signed bytes by the type's load.
struct GroupPairUnit {
  static constexpr int kBlock = 256, kUnitsPerBlock = 4;
  static constexpr int64_t kStagedMinCols = 0;  // staged loads at every width (the rows allow)
  struct W {
    uint32_t v[2][2][4];  // [group 2k + r][elements 0..15 / 16..31][word]: signed bytes
    float sc[2];          // the scale of group 2k + r
  };
  template <int L>
  using X = KMinUnit::X<L>;
  template <int L, bool S = false>
  __device__ static X<L> load_x(const TokenX<L, S>& t, int64_t blk, int k) {
    return KMinUnit::load_x<L>(t, blk, k);
  }
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
    acc = __fmaf_rn(__fmul_rn(w.sc[0], x.d[0]), level_dot<L, 2>(w.v[0], x.lo), acc);
    return __fmaf_rn(__fmul_rn(w.sc[1], x.d[1]), level_dot<L, 2>(w.v[1], x.hi), acc);
  }
};

// IQ4_XS, 136 bytes (8-byte aligned): fp16 d | scales_h (u16) | scales_l[4] | qs[128]. Quarter k
// (unit u = k) holds groups 2k and 2k + 1 of 32 (activation blocks of their own); group g's 16
// bytes at 8 + 16g hold its elements 0..15 in their low nibbles and 16..31 in their high ones, each
// an index into IQ4_NL's 16 int8 levels; scale 6 bits (low 4 in scales_l at nibble g, high 2 in
// scales_h at bits 2g) with a +32 bias. Element = d (s - 32) level: the levels enter the dot
// products as signed bytes, looked up 8 at a time by byte permutes (table16). H200, one token, two
// levels, us (session 29): output head 280.2 against 439.9 for the fp32 kernel, 8 experts 2048 x
// 6144 32.7 against 54.4; 1.6-1.9x at 2-8 tokens.
struct IQ4XSUnit : GroupPairUnit {
  static constexpr int kBytes = 136, kUnroll = 2;
  // IQ4_NL's levels (gguf/quant_tables.h, kIq4nlValues) as 4 words of 4 int8, for byte permutes.
  static constexpr uint32_t kLevels[4] = {0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u};
  // The levels of the 8 indices in the nibbles of q: {low nibbles' levels, high nibbles'}, byte j
  // of each from byte j of q. Each permute reads 3 bits of a selector nibble; the fourth picks the
  // upper half of the table (llama.cpp's get_int_from_table_16).
  __device__ static uint2 table16(uint32_t q) {
    const uint32_t sel = 0x32103210u | ((q & 0x88888888u) >> 1);
    uint32_t t[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t lo = __byte_perm(kLevels[0], kLevels[1], q >> (16 * i));
      const uint32_t hi = __byte_perm(kLevels[2], kLevels[3], q >> (16 * i));
      t[i] = __byte_perm(lo, hi, sel >> (16 * i));
    }
    return make_uint2(__byte_perm(t[0], t[1], 0x6420u), __byte_perm(t[0], t[1], 0x7531u));
  }
  __device__ static W load(const uint8_t* b, int k, const QuantTables&) {
    W w;
    const uint2 hdr = dq::ld64(b);
    const float d = half_to_f(hdr.x & 0xFFFF);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int g = 2 * k + r;
      const int ls = int(((hdr.y >> (4 * g)) & 0x0F) | (((hdr.x >> (16 + 2 * g)) & 3) << 4));
      w.sc[r] = __fmul_rn(d, int_to_f(ls - 32));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2 q = dq::ld64(b + 8 + 16 * g + 8 * h);
        const uint2 a = table16(q.x), c = table16(q.y);
        w.v[r][0][2 * h] = a.x, w.v[r][1][2 * h] = a.y, w.v[r][0][2 * h + 1] = c.x, w.v[r][1][2 * h + 1] = c.y;
      }
    }
    return w;
  }
};

// Groups 2k and 2k + 1 of an array of 8 bytes per group at p (2-byte aligned): [group][word].
__device__ __forceinline__ void group_pair_bytes8(const uint8_t* p, int k, uint32_t (&v)[2][2]) {
  const uint2 a = dq::ld64_a2(p + 16 * k), c = dq::ld64_a2(p + 16 * k + 8);
  v[0][0] = a.x, v[0][1] = a.y, v[1][0] = c.x, v[1][1] = c.y;
}

// IQ2_XXS, 66 bytes (2-byte aligned): fp16 d | 8 groups of 32 as 8 bytes each: 4 grid indices (8
// consecutive elements each, magnitudes from the 256-entry grid) | u32 with four 7-bit sign indices
// (bits 7l) and the 4-bit scale s (bits 28..31). Element = d (0.5 + s) / 4 * magnitude * sign.
// Quarter k (unit u = k) holds groups 2k and 2k + 1, activation blocks of their own (Q4_K's unit
// and activation side). The magnitudes (8..43) enter the dot products as signed bytes, negated
// where the sign bit is set by flipping the byte and adding one: with f the flagged bytes' 0x01,
// (g ^ 0xFF f) + f per word, no carry between bytes. H200, one token, two levels, us (session 29):
// output head 186.9 against 422.4 for the fp32 kernel, 8 experts 2048 x 6144 25.6 against 58.5;
// at 2-8 tokens 1.0-1.6x.
struct IQ2XXSUnit : GroupPairUnit, GridTable<uint2, &QuantTables::iq2xxs, 256> {
  static constexpr int kBytes = 66, kUnroll = 1;
  // 4 magnitudes of a grid entry with the low 4 bits of `signs` applied (bit j negates byte j).
  __device__ static uint32_t signed4(uint32_t g, uint32_t signs) {
    const uint32_t f = ((signs & 0x0F) * 0x00204081u) & 0x01010101u;  // bit j -> byte j's low bit
    return (g ^ (f * 0xFFu)) + f;
  }
  template <class TB>
  __device__ static W load(const uint8_t* b, int k, const TB& tb) {
    W w;
    const float d = half_to_f(ld16(b));
    // Groups 2k, 2k + 1: {indices, aux} each (ld64_a2 reads no byte past them; ld128_a2's fifth
    // word would pass the block's end for k = 3).
    uint32_t qa[2][2];
    group_pair_bytes8(b + 2, k, qa);
    const uint32_t idx[2] = {qa[0][0], qa[1][0]}, aux[2] = {qa[0][1], qa[1][1]};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      w.sc[r] = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, int_to_f(int(aux[r] >> 28)))), 0.25f);
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        const uint2 g = TB::ld(tb.iq2xxs + ((idx[r] >> (8 * l)) & 0xFF));
        const uint32_t signs = dq::iq_signs((aux[r] >> (7 * l)) & 127);
        w.v[r][l / 2][2 * (l % 2)] = signed4(g.x, signs);
        w.v[r][l / 2][2 * (l % 2) + 1] = signed4(g.y, signs >> 4);
      }
    }
    return w;
  }
};

// The units below up to IQ1MUnit (IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) were written in
// session 30 without a GPU: their decoding is checked on the host (tests/host_emulation) and the
// model takes them only with --int8-activations until they have run on one (GpuModel::q8_levels).

// IQ3_XXS, 98 bytes (2-byte aligned): fp16 d | qs[64]: 8 grid indices per group of 32 (4
// consecutive elements each, magnitudes from the 256-entry grid) | 8 u32, one per group: four 7-bit
// sign indices (bits 7l, each for the 8 elements of indices 2l and 2l + 1) and the 4-bit scale s
// (bits 28..31). Element = d (0.5 + s) / 2 * magnitude * sign (gguf/quants.cpp). Quarter k (unit
// u = k) holds groups 2k and 2k + 1, as IQ2_XXS's; the magnitudes (4..62) enter the dot products
// as signed bytes, negated as IQ2XXSUnit::signed4 negates them.
struct IQ3XXSUnit : GroupPairUnit, GridTable<uint32_t, &QuantTables::iq3xxs, 256> {
  static constexpr int kBytes = 98, kUnroll = 1;
  template <class TB>
  __device__ static W load(const uint8_t* b, int k, const TB& tb) {
    W w;
    const float d = half_to_f(ld16(b));
    // Groups 2k, 2k + 1: their 8 grid indices each, and their two aux words (ld64_a2 reads bytes
    // [p - 2, p + 8): inside the block).
    uint32_t idx[2][2];
    group_pair_bytes8(b + 2, k, idx);
    const uint2 aux = dq::ld64_a2(b + 66 + 8 * k);
    const uint32_t au[2] = {aux.x, aux.y};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      w.sc[r] = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, int_to_f(int(au[r] >> 28)))), 0.5f);
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        const uint32_t i2 = idx[r][l / 2] >> (16 * (l % 2));  // indices 2l, 2l + 1 in its low 16 bits
        const uint32_t g1 = TB::ld(tb.iq3xxs + (i2 & 0xFF)), g2 = TB::ld(tb.iq3xxs + ((i2 >> 8) & 0xFF));
        const uint32_t signs = dq::iq_signs((au[r] >> (7 * l)) & 127);
        w.v[r][l / 2][2 * (l % 2)] = IQ2XXSUnit::signed4(g1, signs);
        w.v[r][l / 2][2 * (l % 2) + 1] = IQ2XXSUnit::signed4(g2, signs >> 4);
      }
    }
    return w;
  }
};

// IQ3_S, 110 bytes (2-byte aligned): fp16 d | qs[64]: low 8 bits of 8 grid indices per group of
// 32 (4 consecutive elements each) | qh[8]: their ninth bits, a byte per group | signs[32]: a sign
// byte per 8 elements (entries 2m, 2m + 1 of a group: byte m, bits 0..3 and 4..7) | scales[4]: a
// nibble s per group. Element = d (1 + 2s) * magnitude * sign (gguf/quants.cpp). Quarter k holds
// groups 2k and 2k + 1, as IQ3_XXS's; magnitudes (1..15) as signed bytes.
struct IQ3SUnit : GroupPairUnit, GridTable<uint32_t, &QuantTables::iq3s, 512> {
  static constexpr int kBytes = 110, kUnroll = 1;
  template <class TB>
  __device__ static W load(const uint8_t* b, int k, const TB& tb) {
    W w;
    const float d = half_to_f(ld16(b));
    uint32_t idx[2][2];
    group_pair_bytes8(b + 2, k, idx);
    const uint32_t qh = ld16(b + 66 + 2 * k);      // byte r: group 2k + r's ninth bits
    const uint2 sg = dq::ld64_a2(b + 74 + 8 * k);  // .x: group 2k's sign bytes, .y: 2k + 1's
    const uint32_t scales = dq::ld8(b + 106 + k);  // nibble r: group 2k + r's scale
    const uint32_t signs[2] = {sg.x, sg.y};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      w.sc[r] = __fmul_rn(d, int_to_f(1 + 2 * int((scales >> (4 * r)) & 0x0F)));
      const uint32_t h9 = (qh >> (8 * r)) & 0xFF;
#pragma unroll
      for (int e = 0; e < 8; ++e) {  // entry e: elements 4e .. 4e + 4 of the group
        const uint32_t i = ((idx[r][e / 4] >> (8 * (e % 4))) & 0xFF) | (((h9 >> e) & 1) << 8);
        const uint32_t sb = (signs[r] >> (8 * (e / 2) + 4 * (e % 2))) & 0x0F;
        w.v[r][e / 4][e % 4] = IQ2XXSUnit::signed4(TB::ld(tb.iq3s + i), sb);
      }
    }
    return w;
  }
};

// Units of two groups of 32 with a scale per 16 elements (IQ2_XS, IQ2_S): GroupPairUnit's layout,
// each half of a group dotted on its own and scaled by its scale; the activation block's scale
// applies to the group.
struct GroupPair16Unit : GroupPairUnit {
  struct W {
    uint32_t v[2][2][4];  // [group 2k + r][elements 0..15 / 16..31][word]: signed bytes
    float sc[2][2];       // [group][half]
  };
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float part = 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int4 xh[L];
        int zero[L];
#pragma unroll
        for (int l = 0; l < L; ++l) {
          xh[l] = r ? x.hi[l][h] : x.lo[l][h];
          zero[l] = 0;
        }
        part = __fmaf_rn(w.sc[r][h], level_dot<L>(w.v[r][h], xh, zero), part);
      }
      acc = __fmaf_rn(x.d[r], part, acc);
    }
    return acc;
  }
};

// The two 8-element signed grid entries of IQ2_XS / IQ2_S (8 magnitudes each) into words
// v[2j], v[2j + 1] of a half.
__device__ __forceinline__ void signed_entry8(uint2 g, uint32_t signs, uint32_t* v) {
  v[0] = IQ2XXSUnit::signed4(g.x, signs);
  v[1] = IQ2XXSUnit::signed4(g.y, signs >> 4);
}

// IQ2_XS, 74 bytes (2-byte aligned): fp16 d | u16 qs[32]: per 8 elements a 9-bit grid index (8
// magnitudes) and a 7-bit sign index (bits 9..15) | scales[8]: a nibble s per 16 elements (group
// g's byte, low nibble first). Element = d (0.5 + s) / 4 * magnitude * sign.
struct IQ2XSUnit : GroupPair16Unit, GridTable<uint2, &QuantTables::iq2xs, 512> {
  static constexpr int kBytes = 74, kUnroll = 1;
  template <class TB>
  __device__ static W load(const uint8_t* b, int k, const TB& tb) {
    W w;
    const float d = half_to_f(ld16(b));
    uint32_t q[2][2];  // groups 2k, 2k + 1: their four u16 entries
    group_pair_bytes8(b + 2, k, q);
    const uint32_t scales = ld16(b + 66 + 2 * k);  // byte r: group 2k + r's two nibbles
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int s = int((scales >> (8 * r + 4 * h)) & 0x0F);
        w.sc[r][h] = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, int_to_f(s))), 0.25f);
        const uint32_t two = q[r][h];  // entries 2h, 2h + 1
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t e = (two >> (16 * j)) & 0xFFFF;
          signed_entry8(TB::ld(tb.iq2xs + (e & 511)), dq::iq_signs(e >> 9), &w.v[r][h][2 * j]);
        }
      }
    return w;
  }
};

// IQ2_S, 82 bytes (2-byte aligned): fp16 d | qs[32]: low 8 bits of a grid index per 8 elements |
// signs[32]: a sign byte per 8 elements | qh[8]: the indices' top 2 bits (group g's byte, bits 2l) |
// scales[8]: a nibble s per 16 elements. Element = d (0.5 + s) / 4 * magnitude * sign.
struct IQ2SUnit : GroupPair16Unit, GridTable<uint2, &QuantTables::iq2s, 1024> {
  static constexpr int kBytes = 82, kUnroll = 1;
  template <class TB>
  __device__ static W load(const uint8_t* b, int k, const TB& tb) {
    W w;
    const float d = half_to_f(ld16(b));
    const uint2 qs = dq::ld64_a2(b + 2 + 8 * k), sg = dq::ld64_a2(b + 34 + 8 * k);  // .x group 2k, .y 2k + 1
    const uint32_t qh = ld16(b + 66 + 2 * k), scales = ld16(b + 74 + 2 * k);     // byte r: group 2k + r
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t lo = r ? qs.y : qs.x, sgn = r ? sg.y : sg.x, hi = (qh >> (8 * r)) & 0xFF;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int s = int((scales >> (8 * r + 4 * h)) & 0x0F);
        w.sc[r][h] = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, int_to_f(s))), 0.25f);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int l = 2 * h + j;  // entry l: elements 8l .. 8l + 8 of the group
          const uint32_t i = ((lo >> (8 * l)) & 0xFF) | (((hi >> (2 * l)) & 3) << 8);
          signed_entry8(TB::ld(tb.iq2s + i), (sgn >> (8 * l)) & 0xFF, &w.v[r][h][2 * j]);
        }
      }
    }
    return w;
  }
};

// IQ1_S, 50 bytes (2-byte aligned): fp16 d | qs[32]: low 8 bits of a grid index per 8 elements |
// u16 qh[8], one per group of 32: the indices' top 3 bits (bits 3l..3l + 2), scale s (bits
// 12..14), delta sign (bit 15). Element = d (2s + 1) (grid ± delta), the grid values -1, 0, 1 as
// signed bytes (gguf/quants.cpp). The dp4a dots take the grid bytes as they are and the delta
// through the activation block's sum: sum (g + delta) x = sum g x + delta sum x. Quarter k holds
// groups 2k and 2k + 1, as IQ2_XXS's.
struct IQ1SUnit : GroupPairUnit, GridTable<uint2, &QuantTables::iq1s, 2048> {
  static constexpr int kBytes = 50, kUnroll = 1;
  struct W {
    uint32_t v[2][2][4];  // [group 2k + r][elements 0..15 / 16..31][word]: signed bytes
    float sc[2], delta[2];
  };
  template <class TB>
  __device__ static W load(const uint8_t* b, int k, const TB& tb) {
    W w;
    const float d = half_to_f(ld16(b));
    const uint2 qs = dq::ld64_a2(b + 2 + 8 * k);        // .x: group 2k's 4 index bytes, .y: 2k + 1's
    const uint32_t qh2 = dq::ld32_a2(b + 34 + 4 * k);  // u16 r: group 2k + r's
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t qh = (qh2 >> (16 * r)) & 0xFFFF, lo = r ? qs.y : qs.x;
      w.sc[r] = __fmul_rn(d, int_to_f(int(2 * ((qh >> 12) & 7) + 1)));
      w.delta[r] = qh & 0x8000 ? -tb.iq1_delta : tb.iq1_delta;
#pragma unroll
      for (int l = 0; l < 4; ++l) {  // entry l: elements 8l .. 8l + 8 of the group
        const uint2 g = TB::ld(tb.iq1s + (((lo >> (8 * l)) & 0xFF) | (((qh >> (3 * l)) & 7) << 8)));
        w.v[r][l / 2][2 * (l % 2)] = g.x;
        w.v[r][l / 2][2 * (l % 2) + 1] = g.y;
      }
    }
    return w;
  }
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
    acc = __fmaf_rn(__fmul_rn(w.sc[0], x.d[0]), level_dot<L, 2>(w.v[0], x.lo), acc);
    acc = __fmaf_rn(__fmul_rn(w.sc[0], w.delta[0]), x.ds[0], acc);
    acc = __fmaf_rn(__fmul_rn(w.sc[1], x.d[1]), level_dot<L, 2>(w.v[1], x.hi), acc);
    return __fmaf_rn(__fmul_rn(w.sc[1], w.delta[1]), x.ds[1], acc);
  }
};

// IQ1_M, 56 bytes (8-byte aligned): qs[32]: low 8 bits of a grid index per 8 elements | qh[16]: a
// nibble per entry (top 3 index bits, delta sign in bit 3) | u16 scales[4]: 3-bit scales per 16
// elements (group g: bits 6 (g % 2) and 6 (g % 2) + 3 of scales[g / 2]), fp16 d in the top nibbles.
// Element = d (2s + 1) (grid ± delta) with a delta sign per entry of 8 (gguf/quants.cpp). Each
// half's dot takes the grid bytes as they are plus, per entry, its delta times the entry's
// activation sum (dp4a against ones): sum g x + delta_a S_a + delta_b S_b, exact in fp32 (integers
// and eighths under 2^21).
struct IQ1MUnit : GroupPairUnit, GridTable<uint2, &QuantTables::iq1s, 2048> {
  static constexpr int kBytes = 56, kUnroll = 1;
  struct W {
    uint32_t v[2][2][4];  // [group 2k + r][elements 0..15 / 16..31][word]: signed bytes
    float sc[2][2];       // [group][half]: d (2s + 1)
    float delta[2][4];    // [group][entry]: ± delta
  };
  template <class TB>
  __device__ static W load(const uint8_t* b, int k, const TB& tb) {
    W w;
    const uint2 s4 = dq::ld64(b + 48);  // scales[0..1] in x, [2..3] in y
    const uint32_t d_bits =
        (s4.x >> 12 & 0x000F) | (s4.x >> 24 & 0x00F0) | (s4.y >> 4 & 0x0F00) | (s4.y >> 16 & 0xF000);
    const float d = half_to_f(d_bits);
    const uint32_t word = (k < 2 ? s4.x : s4.y) >> (16 * (k % 2));  // scales[k]: groups 2k, 2k + 1
    const uint2 qs = dq::ld64(b + 8 * k);                          // .x: group 2k's 4 bytes, .y: 2k + 1's
    const uint32_t qh = ld32(b + 32 + 4 * k);                      // bytes 2r, 2r + 1: group 2k + r's
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t lo = r ? qs.y : qs.x;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        w.sc[r][h] = __fmul_rn(d, int_to_f(int(2 * ((word >> (6 * r + 3 * h)) & 7) + 1)));
#pragma unroll
      for (int l = 0; l < 4; ++l) {  // entry l: elements 8l .. 8l + 8 of the group
        const uint32_t nib = (qh >> (16 * r + 4 * l)) & 0x0F;
        const uint2 g = TB::ld(tb.iq1s + (((lo >> (8 * l)) & 0xFF) | ((nib & 7) << 8)));
        w.v[r][l / 2][2 * (l % 2)] = g.x;
        w.v[r][l / 2][2 * (l % 2) + 1] = g.y;
        w.delta[r][l] = nib & 8 ? -tb.iq1_delta : tb.iq1_delta;
      }
    }
    return w;
  }
  // The activation sum of words a, b of each level, joined (254 q + r), as a float (exact).
  template <int L>
  __device__ static float entry_sum(const int4 (&x)[L], bool second) {
    int s = 0;
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const int a = second ? x[l].z : x[l].x, c = second ? x[l].w : x[l].y;
      const int t = __dp4a(a, 0x01010101, __dp4a(c, 0x01010101, 0));
      s = l == 0 ? t : s * kQ8LevelRatio + t;
    }
    return __int2float_rn(s);
  }
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float part = 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int4 xh[L];
        int zero[L];
#pragma unroll
        for (int l = 0; l < L; ++l) {
          xh[l] = r ? x.hi[l][h] : x.lo[l][h];
          zero[l] = 0;
        }
        float f = level_dot<L>(w.v[r][h], xh, zero);
        f = __fmaf_rn(w.delta[r][2 * h], entry_sum<L>(xh, false), f);
        f = __fmaf_rn(w.delta[r][2 * h + 1], entry_sum<L>(xh, true), f);
        part = __fmaf_rn(w.sc[r][h], f, part);
      }
      acc = __fmaf_rn(x.d[r], part, acc);
    }
    return acc;
  }
};

// The K-quants stored in bit planes (Q2_K, Q3_K, Q6_K): unit u = 2h + s of a 256-block covers, for
// p = 0..3, elements 128h + 32p + 16s + [0, 16): half s of activation block 4h + p, under one
// weight scale each. The activation side is shared: per part p and level, 16 bytes and the sum of
// those 16 values (computed once per unit and token for all the rows, by dot16 against ones), which
// the types use for the offsets in their values (Q6_K q - 32, Q3_K q - 4) and their mins (Q2_K).
struct PlanesUnit {
  static constexpr int kBlock = 256, kUnitsPerBlock = 4;
  static constexpr int64_t kStagedMinCols = 0;  // staged loads at every width (the rows allow)
  template <int L>
  struct X {
    int4 q[4][L];   // per level, 16 bytes of activation block 4h + p
    int sum[4][L];  // per level, the sum of those 16 values
    float d[4];
  };
  template <int L, bool S = false>
  __device__ static X<L> load_x(const TokenX<L, S>& t, int64_t blk, int u) {
    const int h = u / 2, s = u % 2;
    const int64_t ab = blk * 8 + 4 * h;  // first activation block of the unit
    const uint32_t ones[4] = {0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u};
    X<L> x;
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int l = 0; l < L; ++l) {
        x.q[p][l] = t.ld(reinterpret_cast<const int4*>(t.q[l] + 32 * (ab + p) + 16 * s));
        x.sum[p][l] = dot16(ones, x.q[p][l], 0);
      }
    const int4* q = reinterpret_cast<const int4*>(t.xb + ab);
    const int4 s01 = t.ld(q), s23 = t.ld(q + 1);
    x.d[0] = __int_as_float(s01.x), x.d[1] = __int_as_float(s01.z);
    x.d[2] = __int_as_float(s23.x), x.d[3] = __int_as_float(s23.z);
    return x;
  }
  // Part p's integer dot of weights w (as signed bytes) with its activations, each level's chain
  // started from -bias times its sum (sum (w - bias) x, exact), as a float.
  template <int L>
  __device__ static float part_dot(const uint32_t (&w)[4], const X<L>& x, int p, int bias) {
    int start[L];
#pragma unroll
    for (int l = 0; l < L; ++l) start[l] = -bias * x.sum[p][l];
    return level_dot<L>(w, x.q[p], start);
  }
  // Part p's activation sum, both levels joined (254 q + r), as a float.
  template <int L>
  __device__ static float part_sum(const X<L>& x, int p) {
    if constexpr (L == 2) return __int2float_rn(x.sum[p][0] * kQ8LevelRatio + x.sum[p][1]);
    else return int_to_f(x.sum[p][0]);
  }
};

// Q6_K, 210 bytes: ql[128] | qh[64] | int8 scales[16] | fp16 d. Part p of unit (h, s): low (p < 2)
// or high nibbles of ql[64h + 32 (p % 2) + 16s + l], bits 2p of qh[32h + 16s + l], scale
// sc[8h + s + 2p]. Element = d sc (q - 32). The weights enter the dot products as q (0..63, a signed
// byte as it is) and each part's dot starts from -32 times its activations' sum: sum (q - 32) x
// exactly, without a byte-wise subtraction (four instructions per word) in every row's decode.
// H200, one token, two levels, us (session 29): output head 154880 x 6144 241.0 -> 218.7 (77% ->
// 84% of the copy rate; one level 231.4 -> 214.4, 86%), 8 experts 6144 x 2048 29.1 -> 27.4, 6144 x
// 2048 6.5 -> 5.9.
struct Q6KUnit : PlanesUnit {
  static constexpr int kBytes = 210, kUnroll = 1;
  struct W {
    uint32_t q[4][4];  // [p][word]
    float sc[4];       // d * sc of part p
  };
  __device__ static W load(const uint8_t* b, int u, const QuantTables&) {
    const int h = u / 2, s = u % 2;
    W w;
    const float d = half_to_f(ld16(b + 208));
    const uint2 sw = dq::ld64_a2(b + 192 + 8 * h);  // scales 8h .. 8h + 8: part p's is byte s + 2p
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t word = j < 2 ? sw.x : sw.y;
      w.sc[j] = __fmul_rn(d, int_to_f(int(int8_t((word >> (8 * (s + 2 * (j % 2)))) & 0xFF))));
    }
    const uint4 a = ld128_a2(b + 64 * h + 16 * s), c = ld128_a2(b + 64 * h + 32 + 16 * s);
    const uint4 hb = ld128_a2(b + 128 + 32 * h + 16 * s);
    const uint32_t av[4] = {a.x, a.y, a.z, a.w}, cv[4] = {c.x, c.y, c.z, c.w}, hv[4] = {hb.x, hb.y, hb.z, hb.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w.q[0][i] = (av[i] & 0x0F0F0F0Fu) | ((hv[i] << 4) & 0x30303030u);
      w.q[1][i] = (cv[i] & 0x0F0F0F0Fu) | ((hv[i] << 2) & 0x30303030u);
      w.q[2][i] = ((av[i] >> 4) & 0x0F0F0F0Fu) | (hv[i] & 0x30303030u);
      w.q[3][i] = ((cv[i] >> 4) & 0x0F0F0F0Fu) | ((hv[i] >> 2) & 0x30303030u);
    }
    return w;
  }
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
#pragma unroll
    for (int p = 0; p < 4; ++p) acc = __fmaf_rn(__fmul_rn(w.sc[p], x.d[p]), part_dot<L>(w.q[p], x, p, 32), acc);
    return acc;
  }
};

// Q2_K, 84 bytes (4-byte aligned): scales[16] | qs[64] | fp16 d | fp16 dmin. Part p of unit (h, s):
// bits 2p of qs[32h + 16s + l] (q = 0..3), scale byte 8h + 2p + s (low nibble sc, high nibble m).
// Element = d sc q - dmin m: the dot of q (as bytes) with the activations, and the min times their
// sum. H200, one token, two levels, us (session 29): output head 181.4 against 278.0 for the fp32
// kernel, 8 experts 2048 x 6144 22.8 against 34.2. (Without staging the rows of 6144+ columns
// measured up to 10% faster (head 164.8, 6144 x 16384 18.6 against 20.5), those of 2048 slower
// (16384 x 2048 8.2 against 6.7): left staged, as the other types.)
struct Q2KUnit : PlanesUnit {
  static constexpr int kBytes = 84, kUnroll = 2;
  struct W {
    uint32_t qs[4];    // the unit's 16 bytes of qs: part p in bits 2p of each byte
    float sc[4], mn[4];  // d * sc, dmin * m of part p
  };
  __device__ static W load(const uint8_t* b, int u, const QuantTables&) {
    const int h = u / 2, s = u % 2;
    W w;
    const uint32_t dd = ld32(b + 80), s0 = ld32(b + 8 * h), s1 = ld32(b + 8 * h + 4);
    const float d = half_to_f(dd & 0xFFFF), dmin = half_to_f(dd >> 16);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t sb = ((p < 2 ? s0 : s1) >> (8 * (2 * (p % 2) + s))) & 0xFF;
      w.sc[p] = __fmul_rn(d, int_to_f(int(sb & 0x0F)));
      w.mn[p] = __fmul_rn(dmin, int_to_f(int(sb >> 4)));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) w.qs[i] = ld32(b + 16 + 32 * h + 16 * s + 4 * i);
    return w;
  }
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t q[4] = {(w.qs[0] >> (2 * p)) & 0x03030303u, (w.qs[1] >> (2 * p)) & 0x03030303u,
                             (w.qs[2] >> (2 * p)) & 0x03030303u, (w.qs[3] >> (2 * p)) & 0x03030303u};
      acc = __fmaf_rn(__fmul_rn(w.sc[p], x.d[p]), part_dot<L>(q, x, p, 0), acc);
      acc = __fmaf_rn(-w.mn[p], __fmul_rn(x.d[p], part_sum<L>(x, p)), acc);
    }
    return acc;
  }
};

// Q3_K, 110 bytes (2-byte aligned): hmask[32] | qs[64] | scales[12] | fp16 d. Part p of unit (h,
// s): low bits 2p of qs[32h + 16s + l], high bit 4h + p of hmask[16s + l]; scale i = 8h + 2p + s,
// 6 bits (low 4 in byte i % 8 of scales at nibble h, high 2 in byte 8 + i % 4 at bits 2 (i / 4))
// with a +32 bias. Element = d (sc - 32) (low + 4 high - 4): the weights enter as low + 4 high
// (0..7) and each part's dot starts from -4 times its activations' sum. H200, one token, two
// levels, us (session 29): output head 186.7 against 414.7 for the fp32 kernel, 8 experts 2048 x
// 6144 26.1 against 52.5.
struct Q3KUnit : PlanesUnit {
  static constexpr int kBytes = 110, kUnroll = 1;
  struct W {
    uint32_t q[4][4];  // [p][word]: low + 4 high
    float sc[4];       // d * (sc - 32) of part p
  };
  __device__ static W load(const uint8_t* b, int u, const QuantTables&) {
    const int h = u / 2, s = u % 2;
    W w;
    const float d = half_to_f(ld16(b + 108));
    const uint2 lo = dq::ld64_a2(b + 96);  // scales[0..8): part p's low 4 bits in byte 2p + s, nibble h
    const uint32_t hi = dq::ld32_a2(b + 104);  // scales[8..12): part p's high 2 bits in byte 2 (p % 2) + s
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t l4 = ((p < 2 ? lo.x : lo.y) >> (8 * (2 * (p % 2) + s) + 4 * h)) & 0x0F;
      const uint32_t h2 = (hi >> (8 * (2 * (p % 2) + s) + 2 * (2 * h + p / 2))) & 3;
      w.sc[p] = __fmul_rn(d, int_to_f(int(l4 | (h2 << 4)) - 32));
    }
    const uint4 qv = ld128_a2(b + 32 + 32 * h + 16 * s), hm = ld128_a2(b + 16 * s);
    const uint32_t qw[4] = {qv.x, qv.y, qv.z, qv.w}, hw[4] = {hm.x, hm.y, hm.z, hm.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t hh = hw[i] >> (4 * h);  // the high bits of parts 0..3 at bits 0..3 of each byte
      w.q[0][i] = (qw[i] & 0x03030303u) | ((hh << 2) & 0x04040404u);
      w.q[1][i] = ((qw[i] >> 2) & 0x03030303u) | ((hh << 1) & 0x04040404u);
      w.q[2][i] = ((qw[i] >> 4) & 0x03030303u) | (hh & 0x04040404u);
      w.q[3][i] = ((qw[i] >> 6) & 0x03030303u) | ((hh >> 1) & 0x04040404u);
    }
    return w;
  }
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
#pragma unroll
    for (int p = 0; p < 4; ++p) acc = __fmaf_rn(__fmul_rn(w.sc[p], x.d[p]), part_dot<L>(w.q[p], x, p, 4), acc);
    return acc;
  }
};

// Q8_0, 34 bytes: fp16 d | int8 qs[32]. The quants start 2 bytes into a 2-byte aligned block:
// 8 aligned words from (b + 2) rounded down to 4, plus the last half-word, permuted into place.
// Activation block blk's 32 int8 values of each level, two 16-byte loads each (the units of one
// 32-block: Q8_0, Q4_0, IQ4_NL).
template <int L, bool S>
__device__ __forceinline__ void block32_x(const TokenX<L, S>& t, int64_t blk, int4 (&q)[L][2]) {
#pragma unroll
  for (int l = 0; l < L; ++l) {
    const int4* p = reinterpret_cast<const int4*>(t.q[l] + 32 * blk);
    q[l][0] = t.ld(p), q[l][1] = t.ld(p + 1);
  }
}

struct Q80Unit {
  static constexpr int kBlock = 32, kBytes = 34, kUnitsPerBlock = 1, kUnroll = 4;
  // Staged loads from 4096 columns: at 2048 (one warp per block, two chunks) the direct loads of 4
  // units at a time were faster (H200: 6144 x 2048 6.3 against 6.9 us, 16384 x 2048 12.4 against
  // 14.4; 4096^2 10.2 -> 8.8, output head two levels 263 -> 242; docs/PERFORMANCE.md, session 26).
  static constexpr int64_t kStagedMinCols = 4096;
  struct W {
    uint32_t q[2][4];
    float d;
  };
  template <int L>
  struct X {
    int4 q[L][2];
    float d;
  };
  __device__ static W load(const uint8_t* b, int, const QuantTables&) {
    W w;
    w.d = half_to_f(ld16(b));
    const uint8_t* a = reinterpret_cast<const uint8_t*>((reinterpret_cast<uintptr_t>(b) + 2) & ~uintptr_t(3));
    uint32_t v[9];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ld32(a + 4 * i);
    v[8] = ld16(b + 32);  // only used when a == b: bytes 32, 33 of the block
    const uint32_t sel = (reinterpret_cast<uintptr_t>(b) & 2) ? 0x3210u : 0x5432u;
#pragma unroll
    for (int i = 0; i < 8; ++i) w.q[i / 4][i % 4] = __byte_perm(v[i], v[i + 1], sel);
    return w;
  }
  template <int L, bool S = false>
  __device__ static X<L> load_x(const TokenX<L, S>& t, int64_t blk, int) {
    X<L> x;
    block32_x(t, blk, x.q);
    x.d = t.ld(reinterpret_cast<const float*>(t.xb + blk));
    return x;
  }
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
    return __fmaf_rn(__fmul_rn(w.d, x.d), level_dot<L, 2>(w.q, x.q), acc);
  }
};

// Q4_0 and IQ4_NL, 18 bytes (2-byte aligned): fp16 d | qs[16]: element j of the block in the low
// nibble of byte j, element 16 + j in its high nibble. One unit per block (Q8_0's activation side,
// plus the block's sum for Q4_0's - 8). Q4_0: element = d (q - 8), the dot taken as sum q x - 8 sum
// x in int32; IQ4_NL: element = d level(q), the levels looked up as IQ4_XS's. (Session 30, without
// a GPU: checked on the host, tests/host_emulation; the model takes them only with
// --int8-activations until they have run. Staged from 4096 columns, as Q8_0, unmeasured.)
struct Nibbles32Unit {
  static constexpr int kBlock = 32, kBytes = 18, kUnitsPerBlock = 1, kUnroll = 4;
  static constexpr int64_t kStagedMinCols = 4096;
  struct W {
    uint32_t q[2][4];  // [elements 0..15 / 16..31][word]
    float d;
  };
  template <int L>
  struct X {
    int4 q[L][2];
    float d;
    int sum;  // the block's sum (both levels joined: 254 q + r)
  };
  // The 16 nibble bytes (ld64_a2 reads [p - 2, p + 8): inside the block).
  __device__ static void nibbles(const uint8_t* b, uint32_t (&v)[4]) {
    const uint2 a = dq::ld64_a2(b + 2), c = dq::ld64_a2(b + 10);
    v[0] = a.x, v[1] = a.y, v[2] = c.x, v[3] = c.y;
  }
  template <int L, bool S = false>
  __device__ static X<L> load_x(const TokenX<L, S>& t, int64_t blk, int) {
    X<L> x;
    block32_x(t, blk, x.q);
    const int2 s = t.ld(t.xb + blk);
    x.d = __int_as_float(s.x);
    x.sum = s.y;
    return x;
  }
  // The joined integer dot of the block (254 q + r with two levels).
  template <int L>
  __device__ static int int_dot(const W& w, const X<L>& x) {
    int d = dot16(w.q[1], x.q[0][1], dot16(w.q[0], x.q[0][0], 0));
    if constexpr (L == 2) d = dot16(w.q[1], x.q[1][1], dot16(w.q[0], x.q[1][0], d * kQ8LevelRatio));
    return d;
  }
};

struct Q40Unit : Nibbles32Unit {
  __device__ static W load(const uint8_t* b, int, const QuantTables&) {
    W w;
    w.d = half_to_f(ld16(b));
    uint32_t v[4];
    nibbles(b, v);
#pragma unroll
    for (int i = 0; i < 4; ++i) w.q[0][i] = v[i] & 0x0F0F0F0Fu, w.q[1][i] = (v[i] >> 4) & 0x0F0F0F0Fu;
    return w;
  }
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
    // |dot| <= 32 x 15 x 32385 and 8 |sum| <= 8 x 32 x 32385: int32, converted once (rounded past 2^24).
    return __fmaf_rn(__fmul_rn(w.d, x.d), __int2float_rn(int_dot<L>(w, x) - 8 * x.sum), acc);
  }
};

struct IQ4NLUnit : Nibbles32Unit {
  __device__ static W load(const uint8_t* b, int, const QuantTables&) {
    W w;
    w.d = half_to_f(ld16(b));
    uint32_t v[4];
    nibbles(b, v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint2 lv = IQ4XSUnit::table16(v[i]);
      w.q[0][i] = lv.x, w.q[1][i] = lv.y;
    }
    return w;
  }
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
    return __fmaf_rn(__fmul_rn(w.d, x.d), __int2float_rn(int_dot<L>(w, x)), acc);
  }
};

}  // namespace sparsemla::cuda::q8units
