// The int8-activation decode products of quant_matmul_q8.h: activation quantization, the dp4a
// decode kernel and its dispatch table.
//
// Kernel layout (as gemv.cuh): a block takes kQ8Rows weight rows and all tokens; its threads split
// a row's units round-robin, U units per step fully unrolled so that U x R units' weight loads are
// in flight together. A unit is the weight bytes of whole activation blocks, so that each integer
// dot product meets one activation scale:
//   Q4_K / Q5_K  quarter k of a 256-block: 64 elements = sub-blocks 2k (low nibbles) and 2k + 1
//                (high), two 16-byte quant loads (+ Q5_K's 32 bytes of high bits);
//   Q6_K         half h, l0 in {0, 16} of a 256-block: 16 elements of each of the 4 activation
//                blocks 4h + j, from 3 x 16 bytes (ql twice, qh) read as aligned words;
//   Q2_K / Q3_K  the same 4 x 16 elements as Q6_K (PlanesUnit), from 16 bytes of bit planes
//                (+ Q3_K's 16 bytes of high bits);
//   IQ4_XS /     as Q4_K, two groups of 32 under one scale each (GroupPairUnit), the values looked
//   IQ2_XXS      up in IQ4_NL's levels or IQ2_XXS's grid (the quant tables) with their signs;
//   Q8_0         one 32-block, 32 bytes read as aligned words.
// Per row and token: one __dp4a per 4 elements into an int32 dot, then per sub-block
//   acc += (d_w sc) * d_x * dot  [- (dmin m) * (d_x sum_x) for Q4_K/Q5_K/Q2_K]
// in fp32. The integer dots are exact; an activation load (16 bytes, through L1) feeds all R rows.
// With two activation levels (quant_matmul_q8.h) each dot runs a second __dp4a chain over the
// residual level r, started from 254 times the first one: sum w (254 q + r), still exact in int32
// (up to ~1.3e8), so it is converted to float by cvt, not by dq::int_to_f (exact below 2^22 only).
//
// Batch invariance: the thread count depends only on n_cols and the type, thread i takes units
// i, i + threads, ... in that order, and the per-thread sums are reduced by a fixed shuffle tree
// and then warp by warp; none of it depends on NT or on the token count.
#include "ops/cuda/quant_matmul_q8.h"

#include <algorithm>
#include <atomic>

#include "ops/cuda/check.cuh"
#include "ops/cuda/dequant.cuh"
#include "ops/cuda/gemv_reduce.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/q8_quantize.cuh"
#include "ops/cuda/quant_matmul_kernels.cuh"

namespace sparsemla::cuda {

namespace {

using gguf::GgmlType;
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

// The activation rows of one token: level l's values at q[l] (the blocks' scales and sums at xb).
template <int L>
struct TokenX {
  const int8_t* q[L];
  const int2* xb;
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
  template <int L>
  __device__ static X<L> load_x(const TokenX<L>& t, int64_t blk, int k) {
    const int64_t ab = blk * 8 + 2 * k;  // first activation block of the unit
    X<L> x;
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const int4* p = reinterpret_cast<const int4*>(t.q[l] + 32 * ab);
      x.lo[l][0] = __ldg(p), x.lo[l][1] = __ldg(p + 1), x.hi[l][0] = __ldg(p + 2), x.hi[l][1] = __ldg(p + 3);
    }
    const int4 s = __ldg(reinterpret_cast<const int4*>(t.xb + ab));
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
  template <int L>
  __device__ static X<L> load_x(const TokenX<L>& t, int64_t blk, int k) {
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

// IQ2_XXS, 66 bytes (2-byte aligned): fp16 d | 8 groups of 32 as 8 bytes each: 4 grid indices (8
// consecutive elements each, magnitudes from the 256-entry grid) | u32 with four 7-bit sign indices
// (bits 7l) and the 4-bit scale s (bits 28..31). Element = d (0.5 + s) / 4 * magnitude * sign.
// Quarter k (unit u = k) holds groups 2k and 2k + 1, activation blocks of their own (Q4_K's unit
// and activation side). The magnitudes (8..43) enter the dot products as signed bytes, negated
// where the sign bit is set by flipping the byte and adding one: with f the flagged bytes' 0x01,
// (g ^ 0xFF f) + f per word, no carry between bytes. H200, one token, two levels, us (session 29):
// output head 186.9 against 422.4 for the fp32 kernel, 8 experts 2048 x 6144 25.6 against 58.5;
// at 2-8 tokens 1.0-1.6x.
struct IQ2XXSUnit : GroupPairUnit {
  static constexpr int kBytes = 66, kUnroll = 1;
  // 4 magnitudes of a grid entry with the low 4 bits of `signs` applied (bit j negates byte j).
  __device__ static uint32_t signed4(uint32_t g, uint32_t signs) {
    const uint32_t f = ((signs & 0x0F) * 0x00204081u) & 0x01010101u;  // bit j -> byte j's low bit
    return (g ^ (f * 0xFFu)) + f;
  }
  __device__ static W load(const uint8_t* b, int k, const QuantTables& tb) {
    W w;
    const float d = half_to_f(ld16(b));
    // Groups 2k, 2k + 1: {indices, aux} each (ld64_a2 reads no byte past them; ld128_a2's fifth
    // word would pass the block's end for k = 3).
    const uint2 q0 = dq::ld64_a2(b + 2 + 16 * k), q1 = dq::ld64_a2(b + 10 + 16 * k);
    const uint32_t idx[2] = {q0.x, q1.x}, aux[2] = {q0.y, q1.y};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      w.sc[r] = __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, int_to_f(int(aux[r] >> 28)))), 0.25f);
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        const uint2 g = __ldg(tb.iq2xxs + ((idx[r] >> (8 * l)) & 0xFF));
        const uint32_t signs = dq::iq_signs((aux[r] >> (7 * l)) & 127);
        w.v[r][l / 2][2 * (l % 2)] = signed4(g.x, signs);
        w.v[r][l / 2][2 * (l % 2) + 1] = signed4(g.y, signs >> 4);
      }
    }
    return w;
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
  template <int L>
  __device__ static X<L> load_x(const TokenX<L>& t, int64_t blk, int u) {
    const int h = u / 2, s = u % 2;
    const int64_t ab = blk * 8 + 4 * h;  // first activation block of the unit
    const uint32_t ones[4] = {0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u};
    X<L> x;
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int l = 0; l < L; ++l) {
        x.q[p][l] = __ldg(reinterpret_cast<const int4*>(t.q[l] + 32 * (ab + p) + 16 * s));
        x.sum[p][l] = dot16(ones, x.q[p][l], 0);
      }
    const int4* q = reinterpret_cast<const int4*>(t.xb + ab);
    const int4 s01 = __ldg(q), s23 = __ldg(q + 1);
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
  template <int L>
  __device__ static X<L> load_x(const TokenX<L>& t, int64_t blk, int) {
    X<L> x;
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const int4* p = reinterpret_cast<const int4*>(t.q[l] + 32 * blk);
      x.q[l][0] = __ldg(p), x.q[l][1] = __ldg(p + 1);
    }
    x.d = __ldg(reinterpret_cast<const float*>(t.xb + blk));
    return x;
  }
  template <int L>
  __device__ static float fma(const W& w, const X<L>& x, float acc) {
    return __fmaf_rn(__fmul_rn(w.d, x.d), level_dot<L, 2>(w.q, x.q), acc);
  }
};

constexpr int kQ8MaxThreads = 256;
// Rows per block: each activation load feeds kQ8Rows rows.
constexpr int kQ8Rows = 4;
// The staged kernel's shared memory per block at most: within SM86/89/12x's 99 KB (and the
// H100/H200's 227 KB) with room for the block's partial sums.
constexpr size_t kStagedMaxSmem = 96 * 1024;

// acc[row][t] += unit iu of each row . token t's activations of the unit.
template <class V, int R, int NT, int L>
__device__ __forceinline__ void q8_unit(const uint8_t* const (&w)[R], const TokenX<L> (&x)[NT], int iu,
                                        float (&acc)[R][NT], const QuantTables& tb) {
  const int b = iu / V::kUnitsPerBlock, u = iu % V::kUnitsPerBlock;
  typename V::W wu[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wu[r] = V::load(w[r] + int64_t(b) * V::kBytes, u, tb);
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const typename V::template X<L> xu = V::template load_x<L>(x[t], b, u);
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r][t] = V::fma(wu[r], xu, acc[r][t]);
  }
}

// The blocks' rows, products, expert pairs and tokens as gemv.cuh's kernel takes them (MatArgs,
// block_mat, block_view), with the activations at a.xq (and a.xr) instead of a.x.
template <class V, int NT, int R, int L>
__global__ void __launch_bounds__(kQ8MaxThreads) gemv_q8_kernel(const MatArgs a) {
  // Units per step: at 4 or more tokens the accumulators and activations take the registers that
  // the unrolled weight loads would need (the order of the units is the same either way).
  constexpr int U = NT >= 4 ? 1 : V::kUnroll;
  __shared__ float partial[kQ8MaxThreads / 32][R * NT];  // per warp: [row][token]
  const int n_units = int(a.n_cols / V::kBlock) * V::kUnitsPerBlock;
  const int64_t n_ab = a.n_cols / 32;  // activation blocks per token
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const BlockMat m = block_mat(a);
  if (row0 >= m.n_rows) return;  // (several products: the grid covers the one with the most rows)
  // The weights of an expert or grouped product depend on the routing: no prefetch there.
  gemv_prologue<R>(a.prefetch && !a.expert_ids && !a.group_offsets, m.w, m.row_bytes, row0, m.n_rows);
  BlockView v;
  if (!block_view(a, v)) return;
  const uint8_t* w[R];
#pragma unroll
  for (int r = 0; r < R; ++r) w[r] = v.w + uint64_t(min(row0 + r, v.n_rows - 1)) * v.row_bytes;

  for (int64_t t0 = 0; t0 < v.n_tokens; t0 += NT) {
    // Tokens past the end repeat the last one; their sums are not stored.
    TokenX<L> x[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int64_t tok = v.token_row(a, min(t0 + t, v.n_tokens - 1));
      x[t].q[0] = a.xq + tok * a.n_cols;
      if constexpr (L == 2) x[t].q[1] = a.xr + tok * a.n_cols;
      x[t].xb = a.xb + tok * n_ab;
    }
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;

    for_each_unit<U>(n_units, [&](int iu) { q8_unit<V, R, NT, L>(w, x, iu, acc, a.tables); });

    block_sum_store(acc, partial, row0, v.n_rows, t0, v.n_tokens, v.y);
  }
}

// ---- staged loads (one token or expert pairs; Q6_K and Q8_0) ----
//
// Q6_K (210-byte) and Q8_0 (34-byte) blocks are only 2-byte aligned, so the kernel above reads each
// 16 weight bytes as five 4-byte loads and byte permutes, scattered over the warp's 8 (Q6_K) or 32
// (Q8_0) consecutive blocks: many small L1 requests per byte. Here each warp first copies the
// bytes its 32 lanes' units cover (one "chunk": 32 units of each of its R rows, 1680 bytes of a
// Q6_K row, 1088 of a Q8_0 one, 16-byte aligned when the rows are) into shared memory with
// 16-byte cp.async copies, coalesced, and the units are then decoded from there as before. Each
// thread takes the same units in the same order as gemv_q8_kernel<V, 1, R, L> and adds them the
// same way, so the result is the same bits (a one-token product, or one per expert pair, with
// several products). With two or more chunks per warp, the next chunk's copy is in flight while
// the current one is decoded (two buffers, where they fit; else one after the other).
template <class V>
struct Staged {
  static constexpr int kChunkBlocks = 32 / V::kUnitsPerBlock;
  static constexpr int kChunkBytes = kChunkBlocks * V::kBytes;
  static_assert(32 % V::kUnitsPerBlock == 0 && kChunkBytes % 16 == 0, "a warp's chunk is whole 16-byte pieces");
  // Chunk buffers per warp: two when a warp has more than one chunk (the next one's copy in flight
  // while the current one is decoded) and they fit in kStagedMaxSmem, else one.
  __host__ __device__ static constexpr size_t smem_of(int n_threads, int buffers, int R) {
    return size_t(n_threads / 32) * size_t(buffers) * size_t(R) * kChunkBytes;
  }
  __host__ __device__ static int buffers(int n_units, int n_threads, int R) {
    return n_units > n_threads && smem_of(n_threads, 2, R) <= kStagedMaxSmem ? 2 : 1;
  }
  static size_t smem(int n_units, int n_threads, int R) { return smem_of(n_threads, buffers(n_units, n_threads, R), R); }
};

// One warp's chunk: R rows' kChunkBytes each from byte `off` of rows row0 .. (clamped to the last
// row) into dst ([R][kChunkBytes]), as one cp.async group of 16-byte copies.
template <class V, int R>
__device__ __forceinline__ void staged_copy(uint8_t* dst, const BlockView& v, int64_t row0, int64_t off, int lane) {
  constexpr int kPiecesPerRow = Staged<V>::kChunkBytes / 16;
#pragma unroll 1
  for (int i = lane; i < R * kPiecesPerRow; i += 32) {
    const int r = i / kPiecesPerRow, p = i % kPiecesPerRow;
    const uint8_t* row = v.w + uint64_t(min(row0 + r, v.n_rows - 1)) * v.row_bytes;  // (w[r], not indexed)
    cp_async16(dst + r * Staged<V>::kChunkBytes + 16 * p, row + off + 16 * p);
  }
  cp_async_commit();
}

// acc[r] += this lane's unit (unit iu0 + lane of each row) from a landed chunk src ([R][kChunkBytes]).
template <class V, int R, int L>
__device__ __forceinline__ void staged_unit(const uint8_t* src, const typename V::template X<L>& xu, int lane,
                                            float (&acc)[R][1], const QuantTables& tb) {
  const int u = lane % V::kUnitsPerBlock;
  src += (lane / V::kUnitsPerBlock) * V::kBytes;
  typename V::W wu[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wu[r] = V::load(src + r * Staged<V>::kChunkBytes, u, tb);
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = V::fma(wu[r], xu, acc[r][0]);
}

// The token's int8 activation rows (one token, or the block's expert pair's row).
template <int L>
__device__ __forceinline__ TokenX<L> staged_token(const MatArgs& a, const BlockView& v) {
  TokenX<L> x;
  const int64_t tok = v.token_row(a, 0);
  x.q[0] = a.xq + tok * a.n_cols;
  if constexpr (L == 2) x.q[1] = a.xr + tok * a.n_cols;
  x.xb = a.xb + tok * (a.n_cols / 32);
  return x;
}

template <class V, int R, int L>
__global__ void __launch_bounds__(kQ8MaxThreads) gemv_q8_staged_kernel(const MatArgs a) {
  using S = Staged<V>;
  extern __shared__ __align__(16) uint8_t stage[];  // per warp: [buffers][R][kChunkBytes]
  __shared__ float partial[kQ8MaxThreads / 32][R];
  const int n_units = int(a.n_cols / V::kBlock) * V::kUnitsPerBlock;
  const int n_threads = blockDim.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nbuf = S::buffers(n_units, n_threads, R);
  const int64_t row0 = int64_t(blockIdx.x) * R;
  const BlockMat m = block_mat(a);
  if (row0 >= m.n_rows) return;
  gemv_prologue<R>(a.prefetch && !a.expert_ids, m.w, m.row_bytes, row0, m.n_rows);
  BlockView v;
  if (!block_view(a, v)) return;
  const TokenX<L> x = staged_token<L>(a, v);
  float acc[R][1];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;

  uint8_t* buf = stage + size_t(warp) * nbuf * R * S::kChunkBytes;
  // Chunk of units [iu0, iu0 + 32) of the R rows into buffer k.
  const auto copy = [&](int iu0, int k) {
    staged_copy<V, R>(buf + k * R * S::kChunkBytes, v, row0, int64_t(iu0 / V::kUnitsPerBlock) * V::kBytes, lane);
  };
  int iu0 = warp * 32;
  if (iu0 < n_units) copy(iu0, 0);
  for (int k = 0; iu0 < n_units; iu0 += n_threads, ++k) {
    const int cur = nbuf == 2 ? (k & 1) : 0;
    if (nbuf == 2) {
      if (iu0 + n_threads < n_units) copy(iu0 + n_threads, cur ^ 1);
      else cp_async_commit();  // (an empty group: the wait below counts one behind)
      cp_async_wait_group<1>();
    } else {
      cp_async_wait_all();
    }
    __syncwarp();
    const int iu = iu0 + lane;
    const typename V::template X<L> xu = V::template load_x<L>(x, iu / V::kUnitsPerBlock, iu % V::kUnitsPerBlock);
    staged_unit<V, R, L>(buf + cur * R * S::kChunkBytes, xu, lane, acc, a.tables);
    __syncwarp();  // every lane's reads of this buffer are done before it is filled again
    if (nbuf == 1 && iu0 + n_threads < n_units) copy(iu0 + n_threads, 0);
  }
  block_sum_store(acc, partial, row0, v.n_rows, 0, 1, v.y);
}

// Groups k < n of R rows in turn, from byte `off` of rows row_of(k) .. into buf ([2][R][kChunkBytes],
// this warp's): group k + 1's copy in flight while group k is decoded, its sums (this lane's unit)
// handed to done(k, acc).
template <class V, int R, int L, class RowOf, class Done>
__device__ __forceinline__ void staged_groups(uint8_t* buf, const BlockView& v, int64_t off, int n, RowOf&& row_of,
                                              const typename V::template X<L>& xu, int lane, const QuantTables& tb,
                                              Done&& done) {
  constexpr int kBuf = R * Staged<V>::kChunkBytes;
  if (n > 0) staged_copy<V, R>(buf, v, row_of(0), off, lane);
  for (int k = 0; k < n; ++k) {
    const int cur = k & 1;
    if (k + 1 < n) staged_copy<V, R>(buf + (cur ^ 1) * kBuf, v, row_of(k + 1), off, lane);
    else cp_async_commit();  // (an empty group: the wait below counts one behind)
    cp_async_wait_group<1>();
    __syncwarp();
    float acc[R][1];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r][0] = 0.0f;
    staged_unit<V, R, L>(buf + cur * kBuf, xu, lane, acc, tb);
    __syncwarp();  // every lane's reads of this buffer are done before it is filled again
    done(k, acc);
  }
}

// Rows of one chunk (32 units: Q6_K rows of 2048 columns, as GLM-5's expert down products), where
// gemv_q8_staged_kernel runs one-warp blocks of R rows that copy, wait, decode and leave. Here a block
// holds kGroupWarps warps and each warp takes G groups of R rows in turn, group k + 1's copy in
// flight while group k is decoded (two buffers per warp); group k of warp w is row group
// (blockIdx.x G + k) kGroupWarps + w, so a block's warps read neighbouring rows at once. Each row is
// summed by the same lanes in the same order and reduced by the same shuffle tree as in
// gemv_q8_staged_kernel with its one warp: the same bits.
template <class V, int R, int L>
__global__ void __launch_bounds__(kQ8MaxThreads) gemv_q8_staged_groups_kernel(const MatArgs a, int G) {
  using S = Staged<V>;
  extern __shared__ __align__(16) uint8_t stage[];  // per warp: [2][R][kChunkBytes]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
  const BlockMat m = block_mat(a);
  const auto group_row = [&](int k) { return ((int64_t(blockIdx.x) * G + k) * n_warps + warp) * R; };
  if (int64_t(blockIdx.x) * G * n_warps * R >= m.n_rows) return;
  gemv_prologue<R>(a.prefetch && !a.expert_ids, m.w, m.row_bytes, group_row(0), m.n_rows);
  BlockView v;
  if (!block_view(a, v)) return;
  const TokenX<L> x = staged_token<L>(a, v);
  const typename V::template X<L> xu = V::template load_x<L>(x, lane / V::kUnitsPerBlock, lane % V::kUnitsPerBlock);
  uint8_t* buf = stage + size_t(warp) * 2 * R * S::kChunkBytes;
  int n = 0;  // this warp's groups
  while (n < G && group_row(n) < v.n_rows) ++n;
  staged_groups<V, R, L>(buf, v, 0, n, group_row, xu, lane, a.tables, [&](int k, const float (&acc)[R][1]) {
    const int64_t row0 = group_row(k);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = warp_sum(acc[r][0]);
      if (lane == 0 && row0 + r < v.n_rows) v.y[row0 + r] = s;
    }
  });
}

// Rows of one chunk per warp and more than one warp (Q6_K rows of 4096 to 10240 columns: the output
// head's 6144; wider rows' two buffers per warp pass kStagedMaxSmem), where gemv_q8_staged_kernel
// copies, waits, decodes and leaves once per block. Here a block takes G row groups in turn, each warp's
// chunk of group k + 1 in flight while group k is decoded (two buffers per warp); each group is
// summed and reduced as gemv_q8_staged_kernel sums and reduces its one: the same bits.
template <class V, int R, int L>
__global__ void __launch_bounds__(kQ8MaxThreads) gemv_q8_staged_runs_kernel(const MatArgs a, int G) {
  using S = Staged<V>;
  extern __shared__ __align__(16) uint8_t stage[];  // per warp: [2][R][kChunkBytes]
  __shared__ float partial[kQ8MaxThreads / 32][R];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const BlockMat m = block_mat(a);
  const int64_t first = int64_t(blockIdx.x) * G * R;
  if (first >= m.n_rows) return;
  gemv_prologue<R>(a.prefetch && !a.expert_ids, m.w, m.row_bytes, first, m.n_rows);
  BlockView v;
  if (!block_view(a, v)) return;
  const TokenX<L> x = staged_token<L>(a, v);
  const int iu = warp * 32 + lane;
  const typename V::template X<L> xu = V::template load_x<L>(x, iu / V::kUnitsPerBlock, iu % V::kUnitsPerBlock);
  const int64_t off = int64_t(warp * 32 / V::kUnitsPerBlock) * V::kBytes;
  uint8_t* buf = stage + size_t(warp) * 2 * R * S::kChunkBytes;
  int n = 0;  // the block's groups (the same for every warp: the barriers below are the block's)
  while (n < G && first + int64_t(n) * R < v.n_rows) ++n;
  const auto row_of = [&](int k) { return first + int64_t(k) * R; };
  staged_groups<V, R, L>(buf, v, off, n, row_of, xu, lane, a.tables, [&](int k, const float (&acc)[R][1]) {
    block_sum_store(acc, partial, row_of(k), v.n_rows, 0, 1, v.y);
  });
}

// Whether a product takes the staged kernel: the 2-byte aligned types, one token (or one per
// expert pair), rows of whole chunks and at least V::kStagedMinCols columns, and every matrix
// 16-byte aligned (so every chunk is). (One buffer per warp always fits: Staged::buffers.)
bool g_q8_staged = true;
std::atomic<int64_t> g_q8_staged_launches{0}, g_q8_group_launches{0};

// Row groups per warp for the row-group kernels: the most, up to 4, that still leave every
// multiprocessor a block (blocks of `warps` warps, each warp its own groups; or of one team of warps
// sharing its groups: warps 1). H200, two levels, us per call (docs/PERFORMANCE.md, session 27):
// Q6_K 6144 x 2048 (4 warps) one product 6.4 (2 groups: 192 blocks) against 8.1 (4: 96 blocks) and
// 8.0 for one-warp blocks of one group; 8 experts 28.8 (4) against 29.9 (2), 36.1 (8: 384 blocks)
// and 34.6; the Q6_K output head 154880 x 6144 (3 warps sharing each group) 238.7 (4) against 241.7
// (2), 239.4 (8) and 269.9.
constexpr int kGroupWarps = 4, kMaxGroupsPerWarp = 4;
int groups_per_warp(int64_t row_groups, int warps, int sm_count) {
  int g = kMaxGroupsPerWarp;
  while (g > 1 && ceil_div(row_groups, int64_t(warps) * g) < sm_count) g /= 2;
  return g;
}

template <class V>
bool takes_staged(const MatArgs& a) {
  using S = Staged<V>;
  static_assert(S::smem_of(kQ8MaxThreads, 1, kQ8Rows) <= kStagedMaxSmem, "one chunk buffer per warp fits");
  if (!g_q8_staged || a.group_offsets || (!a.expert_ids && a.n_tokens != 1)) return false;
  if (a.n_cols < V::kStagedMinCols || (a.n_cols / V::kBlock) % S::kChunkBlocks != 0 || a.row_bytes % 16 != 0)
    return false;
  const auto aligned16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  if (!aligned16(a.w) || !aligned16(a.shared_w)) return false;
  for (int i = 0; i < a.n_more; ++i)
    if (!aligned16(a.more[i].w) || !aligned16(a.more[i].shared_w) || a.more[i].row_bytes % 16 != 0) return false;
  return true;
}

// Threads per block: enough that each takes about kUnroll units of a row, a multiple of 32 in
// [32, kQ8MaxThreads]. A function of n_cols and the type only (batch invariance).
template <class V>
int q8_threads(int64_t n_cols) {
  const int64_t n_units = n_cols / V::kBlock * V::kUnitsPerBlock;
  const int64_t want = (n_units + V::kUnroll - 1) / V::kUnroll;
  return int(std::min<int64_t>(kQ8MaxThreads, std::max<int64_t>(32, (want + 31) / 32 * 32)));
}

// Tokens per pass of a grouped launch: two at every batch, where the fp32 kernel takes one up to
// batches of 16 (gemv.cuh, kGroupOneTokenBatch). A pass of two costs a one-token group no more
// than a pass of one here (dp4a, few registers per token) and saves the others' second pass
// (GLM-5-width Q8_0 model, batch 8: 3.23 against 3.31-3.35 ms per step; batch 32, where both take
// two, the same; H200, docs/PERFORMANCE.md).
constexpr int kQ8GroupTokens = 2;

template <class V, int L>
void launch_q8_levels(const MatArgs& a, cudaStream_t s) {
  constexpr int R = kQ8Rows;
  const int threads = q8_threads<V>(a.n_cols);
  const unsigned blocks = unsigned(ceil_div(a.max_rows(), int64_t(R)));
  const unsigned z = 1u + unsigned(a.n_more);  // several products: product i in grid z = i
  if (a.n_more && (a.group_offsets || (!a.expert_ids && a.n_tokens != 1)))
    fail("cuda::launch_q8: several products take one token or expert pairs");
  if constexpr (V::kBytes % 16 != 0) {  // (16-byte aligned blocks gain nothing from staging)
    if (takes_staged<V>(a)) {
      const int n_units = int(a.n_cols / V::kBlock) * V::kUnitsPerBlock;
      const unsigned y = a.expert_ids ? unsigned(a.n_tokens) : 1u;
      const int64_t groups = ceil_div(a.max_rows(), int64_t(R));  // of R rows
      const auto go = [&](auto kernel, unsigned gx, int n_threads, size_t smem, auto... extra) {
        allow_smem(kernel, smem);
        pdl::launch(kernel, dim3(gx, y, z), n_threads, smem, s, a, extra...);
        SPARSEMLA_CUDA_LAUNCH_CHECK();
        ++g_q8_staged_launches;
      };
      if (n_units == 32) {  // rows of one chunk: warps that take several row groups
        const int g = groups_per_warp(groups * y * z, kGroupWarps, a.sm_count);
        go(gemv_q8_staged_groups_kernel<V, R, L>, unsigned(ceil_div(groups, int64_t(kGroupWarps) * g)),
           32 * kGroupWarps, Staged<V>::smem_of(32 * kGroupWarps, 2, R), g);
        ++g_q8_group_launches;
      } else if (n_units == threads && Staged<V>::smem_of(threads, 2, R) <= kStagedMaxSmem) {  // a chunk per warp
        const int g = groups_per_warp(groups * y * z, 1, a.sm_count);
        go(gemv_q8_staged_runs_kernel<V, R, L>, unsigned(ceil_div(groups, int64_t(g))), threads,
           Staged<V>::smem_of(threads, 2, R), g);
      } else {
        go(gemv_q8_staged_kernel<V, R, L>, blocks, threads, Staged<V>::smem(n_units, threads, R));
      }
      return;
    }
  }
  if (a.group_offsets)  // a grid row per group (MatArgs::n_tokens), two tokens per pass at every batch
    pdl::launch(gemv_q8_kernel<V, kQ8GroupTokens, R, L>, dim3(blocks, unsigned(a.n_tokens)), threads, 0, s, a);
  else if (a.expert_ids)
    pdl::launch(gemv_q8_kernel<V, 1, R, L>, dim3(blocks, unsigned(a.n_tokens), z), threads, 0, s, a);
  else if (a.n_tokens == 1)
    pdl::launch(gemv_q8_kernel<V, 1, R, L>, dim3(blocks, 1, z), threads, 0, s, a);
  else if (a.n_tokens == 2)
    pdl::launch(gemv_q8_kernel<V, 2, R, L>, blocks, threads, 0, s, a);
  else if (a.n_tokens <= 4)
    pdl::launch(gemv_q8_kernel<V, 4, R, L>, blocks, threads, 0, s, a);
  else
    pdl::launch(gemv_q8_kernel<V, 8, R, L>, blocks, threads, 0, s, a);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

template <class V>
void launch_levels(const MatArgs& a, cudaStream_t s) {
  if (a.xr) launch_q8_levels<V, 2>(a, s);
  else launch_q8_levels<V, 1>(a, s);
}

struct Q8Kernels {
  GgmlType type;
  void (*launch)(const MatArgs&, cudaStream_t);
};

// Every weight type with an int8-activation kernel.
constexpr Q8Kernels kQ8Kernels[] = {
    {GgmlType::Q8_0, &launch_levels<Q80Unit>},
    {GgmlType::Q4_K, &launch_levels<Q4KUnit>},
    {GgmlType::Q5_K, &launch_levels<Q5KUnit>},
    {GgmlType::Q6_K, &launch_levels<Q6KUnit>},
    {GgmlType::Q2_K, &launch_levels<Q2KUnit>},
    {GgmlType::Q3_K, &launch_levels<Q3KUnit>},
    {GgmlType::IQ4_XS, &launch_levels<IQ4XSUnit>},
    {GgmlType::IQ2_XXS, &launch_levels<IQ2XXSUnit>},
};

const Q8Kernels& q8_kernels_for(GgmlType t, const char* what) {
  for (const Q8Kernels& k : kQ8Kernels)
    if (k.type == t) return k;
  // (The entry points refuse other types first: quant_matmul.cu, checked_q8_product.)
  fail("cuda::{}: internal error: no int8-activation kernel for {}", what, gguf::type_name(t));
}

// One warp per block of 32 values (the rule is in quant_matmul_q8.h); r: the residual level (L = 2).
template <int L>
__global__ void quantize_q8_kernel(const float* x, int64_t n_blocks, int8_t* q, int8_t* r, int2* blocks) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const int64_t blk = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (blk >= n_blocks) return;  // whole warps
  quantize_q8_warp<L>(x[blk * 32 + lane], blk, lane, q, r, blocks);
}

bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }

}  // namespace

size_t q8_scales_offset(int64_t n_tokens, int64_t n_cols, int levels) {
  return size_t(levels) * ((size_t(n_tokens * n_cols) + 15) / 16 * 16);
}

size_t q8_activation_bytes(int64_t n_tokens, int64_t n_cols, int levels) {
  return q8_scales_offset(n_tokens, n_cols, levels) + size_t(n_tokens * (n_cols / kQ8ActBlock)) * 8;
}

Q8Out q8_output(const char* op, int64_t n_tokens, int64_t n_cols, Q8Activations& out, int levels) {
  if (levels != 1 && levels != 2) fail("cuda::{}: {} levels (1 or 2)", op, levels);
  if (n_tokens < 0 || n_cols <= 0 || n_cols % kQ8ActBlock != 0)
    fail("cuda::{}: {} tokens x {} columns: columns must be a positive multiple of {}", op, n_tokens, n_cols,
         kQ8ActBlock);
  const size_t need = q8_activation_bytes(n_tokens, n_cols, levels);
  if (!out.data || !aligned(out.data, 16) || out.bytes < need)
    fail("cuda::{}: output buffer {} of {} bytes; {} tokens x {} columns need {} bytes, 16-byte aligned", op, out.data,
         out.bytes, n_tokens, n_cols, need);
  out.n_tokens = n_tokens;
  out.n_cols = n_cols;
  out.levels = levels;
  Q8Out o;
  o.q = static_cast<int8_t*>(out.data);
  o.r = levels == 2 ? o.q + q8_scales_offset(n_tokens, n_cols, 1) : nullptr;
  o.blocks = reinterpret_cast<int2*>(static_cast<uint8_t*>(out.data) + q8_scales_offset(n_tokens, n_cols, levels));
  return o;
}

void quantize_activations(const float* x, int64_t n_tokens, int64_t n_cols, Q8Activations& out, Stream s,
                          int levels) {
  if (!aligned(x, 4)) fail("cuda::quantize_activations: input {} is not 4-byte aligned", static_cast<const void*>(x));
  const Q8Out o = q8_output("quantize_activations", n_tokens, n_cols, out, levels);
  const int64_t n_blocks = n_tokens * (n_cols / kQ8ActBlock);
  if (n_blocks == 0) return;
  constexpr int kThreads = 256;
  const unsigned grid = unsigned(ceil_div(n_blocks * 32, kThreads));
  // A plain launch: as a dependent launch (PDL) it measured no faster in the model (H200, session
  // 25: 3-layer Q4_K_M 0.944 against 0.920 ms per step, Q8_0 1.033 against 1.041, 4 rounds), as
  // the other small kernels in session 20.
  const cudaStream_t st = static_cast<cudaStream_t>(s);
  if (levels == 2) quantize_q8_kernel<2><<<grid, kThreads, 0, st>>>(x, n_blocks, o.q, o.r, o.blocks);
  else quantize_q8_kernel<1><<<grid, kThreads, 0, st>>>(x, n_blocks, o.q, o.r, o.blocks);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

void set_q8_staged_loads(bool on) { g_q8_staged = on; }
bool q8_staged_loads() { return g_q8_staged; }
int64_t q8_staged_launches() { return g_q8_staged_launches.load(); }
int64_t q8_staged_group_launches() { return g_q8_group_launches.load(); }

bool q8_supported(gguf::GgmlType t) {
  for (const Q8Kernels& k : kQ8Kernels)
    if (k.type == t) return true;
  return false;
}

void launch_q8(GgmlType t, const MatArgs& a, cudaStream_t s) { q8_kernels_for(t, "launch_q8").launch(a, s); }

}  // namespace sparsemla::cuda
