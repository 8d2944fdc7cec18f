// CPU (de)quantization of ggml block formats. Each format has a block struct mirroring ggml's
// byte layout (ggml-common.h) and a function that decodes one block in the element order and
// float32 operation order of ggml's dequantize_row_* (ggml-quants.c), so results match ggml's
// reference dequantization bit for bit.
#include "gguf/quants.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "gguf/quant_tables.h"
#include "util/error.h"
#include "util/half.h"

namespace sparsemla::gguf {
namespace {

// Block fields are read by copying the bytes into these structs, which assumes the file's
// little-endian byte order is the machine's.
static_assert(std::endian::native == std::endian::little, "quants.cpp assumes a little-endian host");

constexpr int kQK = 256;  // elements in a K-quant / IQ super-block (ggml's QK_K)

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Multiplier for element j under a sign mask whose bit j set means negative.
float sign_of(uint32_t mask, int j) { return (mask >> j) & 1u ? -1.0f : 1.0f; }

// ---- plain types: one element per "block" ----

struct PlainF32 {
  static constexpr int kElems = 1;
  uint32_t bits;
};
static_assert(sizeof(PlainF32) == 4);

struct PlainF16 {
  static constexpr int kElems = 1;
  uint16_t bits;
};
static_assert(sizeof(PlainF16) == 2);

struct PlainBF16 {
  static constexpr int kElems = 1;
  uint16_t bits;
};
static_assert(sizeof(PlainBF16) == 2);

void dequantize_block(const PlainF32& b, float* y) { *y = bits_to_f32(b.bits); }
void dequantize_block(const PlainF16& b, float* y) { *y = fp16_to_f32(b.bits); }
void dequantize_block(const PlainBF16& b, float* y) { *y = bf16_to_f32(b.bits); }

// ---- legacy 32-element blocks ----
// In Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL/MXFP4, byte qs[j] holds element j in its low nibble and
// element j + 16 in its high nibble.

// 18 bytes: [0,2) fp16 d | [2,18) qs. x = d * (q - 8)
struct BlockQ4_0 {
  static constexpr int kElems = 32;
  uint16_t d;
  uint8_t qs[16];
};
static_assert(sizeof(BlockQ4_0) == 18);

void dequantize_block(const BlockQ4_0& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((b.qs[j] & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((b.qs[j] >> 4) - 8) * d;
  }
}

// 20 bytes: [0,2) fp16 d | [2,4) fp16 m | [4,20) qs. x = d * q + m
struct BlockQ4_1 {
  static constexpr int kElems = 32;
  uint16_t d;
  uint16_t m;
  uint8_t qs[16];
};
static_assert(sizeof(BlockQ4_1) == 20);

void dequantize_block(const BlockQ4_1& b, float* y) {
  const float d = fp16_to_f32(b.d);
  const float m = fp16_to_f32(b.m);
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(b.qs[j] & 0x0F) * d + m;
    y[j + 16] = static_cast<float>(b.qs[j] >> 4) * d + m;
  }
}

// 22 bytes: [0,2) fp16 d | [2,6) qh, little-endian u32 whose bit i is the fifth bit of element i
// | [6,22) qs. x = d * (q - 16)
struct BlockQ5_0 {
  static constexpr int kElems = 32;
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[16];
};
static_assert(sizeof(BlockQ5_0) == 22);

void dequantize_block(const BlockQ5_0& b, float* y) {
  const float d = fp16_to_f32(b.d);
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < 16; ++j) {
    const int lo = (b.qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
    const int hi = (b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = static_cast<float>(lo - 16) * d;
    y[j + 16] = static_cast<float>(hi - 16) * d;
  }
}

// 24 bytes: [0,2) fp16 d | [2,4) fp16 m | [4,8) qh as in Q5_0 | [8,24) qs. x = d * q + m
struct BlockQ5_1 {
  static constexpr int kElems = 32;
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[16];
};
static_assert(sizeof(BlockQ5_1) == 24);

void dequantize_block(const BlockQ5_1& b, float* y) {
  const float d = fp16_to_f32(b.d);
  const float m = fp16_to_f32(b.m);
  const uint32_t qh = load_u32(b.qh);
  for (int j = 0; j < 16; ++j) {
    const int lo = (b.qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
    const int hi = (b.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = static_cast<float>(lo) * d + m;
    y[j + 16] = static_cast<float>(hi) * d + m;
  }
}

// 34 bytes: [0,2) fp16 d | [2,34) int8 qs, one per element. x = d * q
struct BlockQ8_0 {
  static constexpr int kElems = 32;
  uint16_t d;
  int8_t qs[32];
};
static_assert(sizeof(BlockQ8_0) == 34);

void dequantize_block(const BlockQ8_0& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(b.qs[j]) * d;
}

// 18 bytes: [0,2) fp16 d | [2,18) qs, 4-bit indices into the IQ4_NL levels. x = d * level
struct BlockIQ4_NL {
  static constexpr int kElems = 32;
  uint16_t d;
  uint8_t qs[16];
};
static_assert(sizeof(BlockIQ4_NL) == 18);

void dequantize_block(const BlockIQ4_NL& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(tables::kIq4nlValues[b.qs[j] & 0x0F]);
    y[j + 16] = d * static_cast<float>(tables::kIq4nlValues[b.qs[j] >> 4]);
  }
}

// 17 bytes: [0,1) E8M0 exponent e | [1,17) qs, 4-bit E2M1 codes. x = 2^(e-127) * e2m1(q)
struct BlockMXFP4 {
  static constexpr int kElems = 32;
  uint8_t e;
  uint8_t qs[16];
};
static_assert(sizeof(BlockMXFP4) == 17);

// 2^(e-128): half the block scale, because the E2M1 table holds doubled values. Built from bits
// as ggml does, so e = 0 and 1 give the exact subnormals; e = 255 is not treated as NaN.
float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  return bits_to_f32(bits);
}

void dequantize_block(const BlockMXFP4& b, float* y) {
  const float d = e8m0_half(b.e);
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(tables::kMxfp4Values[b.qs[j] & 0x0F]) * d;
    y[j + 16] = static_cast<float>(tables::kMxfp4Values[b.qs[j] >> 4]) * d;
  }
}

// ---- K-quants: 256-element super-blocks ----
// In Q2_K, Q3_K and TQ2_0, each half of 128 elements reads 32 bytes of qs four times: pass p
// (0..3) takes bits 2p..2p+1 of each byte, giving 32 consecutive elements.

// 84 bytes: [0,16) scales, per 16 elements: low nibble scale, high nibble min | [16,80) qs,
// 2 bits per element | [80,82) fp16 d | [82,84) fp16 dmin. x = d*sc * q - dmin*m
struct BlockQ2_K {
  static constexpr int kElems = kQK;
  uint8_t scales[16];
  uint8_t qs[64];
  uint16_t d;
  uint16_t dmin;
};
static_assert(sizeof(BlockQ2_K) == 84);

void dequantize_block(const BlockQ2_K& b, float* y) {
  const float d = fp16_to_f32(b.d);
  const float dmin = fp16_to_f32(b.dmin);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* q = b.qs + 32 * half;
    for (int pass = 0; pass < 4; ++pass) {
      for (int sub = 0; sub < 2; ++sub) {  // two groups of 16 with their own scale
        const uint8_t sc = b.scales[8 * half + 2 * pass + sub];
        const float dl = d * static_cast<float>(sc & 0x0F);
        const float ml = dmin * static_cast<float>(sc >> 4);
        for (int l = 0; l < 16; ++l)
          *y++ = dl * static_cast<float>((q[16 * sub + l] >> (2 * pass)) & 3) - ml;
      }
    }
  }
}

// 110 bytes: [0,32) hmask, high bit of each element (element 32*k + l: bit k of hmask[l])
// | [32,96) qs, low 2 bits as in Q2_K | [96,108) scales, sixteen 6-bit signed scales
// | [108,110) fp16 d. x = d * (sc - 32) * (q - (high bit ? 0 : 4))
struct BlockQ3_K {
  static constexpr int kElems = kQK;
  uint8_t hmask[32];
  uint8_t qs[64];
  uint8_t scales[12];
  uint16_t d;
};
static_assert(sizeof(BlockQ3_K) == 110);

// Scale i: low 4 bits in nibble (i / 8) of scales[i % 8], high 2 bits in bits 2*(i/4)..+1 of
// scales[8 + i % 4]; stored with a +32 bias.
int q3_k_scale(const uint8_t* s, int i) {
  const int lo = (s[i % 8] >> (4 * (i / 8))) & 0x0F;
  const int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

void dequantize_block(const BlockQ3_K& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* q = b.qs + 32 * half;
    for (int pass = 0; pass < 4; ++pass) {
      const int high_bit = 4 * half + pass;
      for (int sub = 0; sub < 2; ++sub) {
        const float dl = d * static_cast<float>(q3_k_scale(b.scales, 8 * half + 2 * pass + sub));
        for (int l = 16 * sub; l < 16 * sub + 16; ++l) {
          const int low = (q[l] >> (2 * pass)) & 3;
          const int offset = (b.hmask[l] >> high_bit) & 1 ? 0 : 4;
          *y++ = dl * static_cast<float>(low - offset);
        }
      }
    }
  }
}

// Q4_K / Q5_K pack eight 6-bit scales and eight 6-bit mins in 12 bytes: for i < 4, scale i and
// min i are the low 6 bits of bytes i and i + 4; for i >= 4, their low 4 bits are the nibbles of
// byte i + 4 and their top 2 bits the top bits of bytes i - 4 and i.
void k4_scale_min(const uint8_t* s, int i, int* scale, int* min) {
  if (i < 4) {
    *scale = s[i] & 63;
    *min = s[i + 4] & 63;
  } else {
    *scale = (s[i + 4] & 0x0F) | ((s[i - 4] >> 6) << 4);
    *min = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
  }
}

// 144 bytes: [0,2) fp16 d | [2,4) fp16 dmin | [4,16) scales/mins | [16,144) qs. Each 64 elements
// read 32 bytes: low nibbles first, then high nibbles. x = d*sc * q - dmin*m per 32 elements
struct BlockQ4_K {
  static constexpr int kElems = kQK;
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qs[128];
};
static_assert(sizeof(BlockQ4_K) == 144);

void dequantize_block(const BlockQ4_K& b, float* y) {
  const float d = fp16_to_f32(b.d);
  const float dmin = fp16_to_f32(b.dmin);
  for (int k = 0; k < 4; ++k) {
    const uint8_t* q = b.qs + 32 * k;
    for (int nibble = 0; nibble < 2; ++nibble) {
      int sc, m;
      k4_scale_min(b.scales, 2 * k + nibble, &sc, &m);
      const float dl = d * static_cast<float>(sc);
      const float ml = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) *y++ = dl * static_cast<float>((q[l] >> (4 * nibble)) & 0x0F) - ml;
    }
  }
}

// 176 bytes: [0,2) fp16 d | [2,4) fp16 dmin | [4,16) scales/mins | [16,48) qh | [48,176) qs.
// As Q4_K, with the fifth bit of element 32*g + l (g = 0..7) in bit g of qh[l].
struct BlockQ5_K {
  static constexpr int kElems = kQK;
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};
static_assert(sizeof(BlockQ5_K) == 176);

void dequantize_block(const BlockQ5_K& b, float* y) {
  const float d = fp16_to_f32(b.d);
  const float dmin = fp16_to_f32(b.dmin);
  for (int k = 0; k < 4; ++k) {
    const uint8_t* q = b.qs + 32 * k;
    for (int nibble = 0; nibble < 2; ++nibble) {
      const int group = 2 * k + nibble;
      int sc, m;
      k4_scale_min(b.scales, group, &sc, &m);
      const float dl = d * static_cast<float>(sc);
      const float ml = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) {
        const int v = ((q[l] >> (4 * nibble)) & 0x0F) | (((b.qh[l] >> group) & 1) << 4);
        *y++ = dl * static_cast<float>(v) - ml;
      }
    }
  }
}

// 210 bytes: [0,128) ql, low 4 bits | [128,192) qh, high 2 bits | [192,208) int8 scales, one per
// 16 elements | [208,210) fp16 d. Each half of 128 elements uses 64 bytes of ql and 32 of qh:
// element 32*k + l (k = 0..3) takes nibble k/2 of ql[l + 32*(k%2)] and bits 2k..2k+1 of qh[l].
// x = d * sc * (q - 32)
struct BlockQ6_K {
  static constexpr int kElems = kQK;
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;
};
static_assert(sizeof(BlockQ6_K) == 210);

void dequantize_block(const BlockQ6_K& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b.ql + 64 * half;
    const uint8_t* qh = b.qh + 32 * half;
    const int8_t* sc = b.scales + 8 * half;
    for (int k = 0; k < 4; ++k) {
      for (int l = 0; l < 32; ++l) {
        const int low = (ql[l + 32 * (k % 2)] >> (4 * (k / 2))) & 0x0F;
        const int high = (qh[l] >> (2 * k)) & 3;
        const float scale = d * static_cast<float>(sc[l / 16 + 2 * k]);
        y[32 * k + l] = scale * static_cast<float>((low | (high << 4)) - 32);
      }
    }
    y += 128;
  }
}

// ---- ternary formats ----

// 54 bytes: [0,48) qs | [48,52) qh | [52,54) fp16 d. Every byte packs 5 (qs) or 4 (qh) base-3
// digits as a fixed-point fraction of 243: digit n of byte q is ((q * 3^n mod 256) * 3) >> 8.
// Elements: qs[0..32) give 5 runs of 32 (digit n for run n), qs[32..48) 5 runs of 16, qh 4
// runs of 4. x = d * (digit - 1)
struct BlockTQ1_0 {
  static constexpr int kElems = kQK;
  uint8_t qs[48];
  uint8_t qh[4];
  uint16_t d;
};
static_assert(sizeof(BlockTQ1_0) == 54);

int tq1_digit(uint8_t byte, int n) {
  static constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};
  const uint8_t q = static_cast<uint8_t>(byte * kPow3[n]);  // wraps mod 256 by design
  return (q * 3) >> 8;
}

void dequantize_block(const BlockTQ1_0& b, float* y) {
  const float d = fp16_to_f32(b.d);
  auto runs = [&](const uint8_t* bytes, int width, int digits) {
    for (int n = 0; n < digits; ++n)
      for (int m = 0; m < width; ++m) *y++ = static_cast<float>(tq1_digit(bytes[m], n) - 1) * d;
  };
  runs(b.qs, 32, 5);
  runs(b.qs + 32, 16, 5);
  runs(b.qh, 4, 4);
}

// 66 bytes: [0,64) qs, 2 bits per element as in Q2_K | [64,66) fp16 d. x = d * (q - 1)
struct BlockTQ2_0 {
  static constexpr int kElems = kQK;
  uint8_t qs[64];
  uint16_t d;
};
static_assert(sizeof(BlockTQ2_0) == 66);

void dequantize_block(const BlockTQ2_0& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int half = 0; half < 2; ++half)
    for (int pass = 0; pass < 4; ++pass)
      for (int m = 0; m < 32; ++m)
        *y++ = static_cast<float>(((b.qs[32 * half + m] >> (2 * pass)) & 3) - 1) * d;
}

// ---- IQ formats: 256 elements in 8 groups of 32, values from the lattices of quant_tables.h ----

// 66 bytes: [0,2) fp16 d | [2,66) 8 groups of 8 bytes: 4 grid indices (one per 8 elements),
// then a little-endian u32 holding four 7-bit sign indices (bits 7l..7l+6) and a 4-bit scale s
// (bits 28..31). x = d * (0.5 + s) / 4 * grid * sign
struct BlockIQ2_XXS {
  static constexpr int kElems = kQK;
  uint16_t d;
  uint8_t qs[64];
};
static_assert(sizeof(BlockIQ2_XXS) == 66);

void dequantize_block(const BlockIQ2_XXS& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int g = 0; g < 8; ++g) {
    const uint8_t* q = b.qs + 8 * g;
    const uint32_t aux = load_u32(q + 4);
    const float db = d * (0.5f + static_cast<float>(aux >> 28)) * 0.25f;
    for (int l = 0; l < 4; ++l) {
      const uint8_t* grid = tables::kIq2xxsGrid[q[l]];
      const uint8_t signs = tables::kIq2Signs[(aux >> (7 * l)) & 127];
      for (int j = 0; j < 8; ++j) y[j] = db * static_cast<float>(grid[j]) * sign_of(signs, j);
      y += 8;
    }
  }
}

// 74 bytes: [0,2) fp16 d | [2,66) 32 little-endian u16, one per 8 elements: grid index in bits
// 0..8, sign index in bits 9..15 | [66,74) scales, one byte per group: low nibble for its first
// 16 elements, high nibble for the next 16. x = d * (0.5 + s) / 4 * grid * sign
struct BlockIQ2_XS {
  static constexpr int kElems = kQK;
  uint16_t d;
  uint16_t qs[32];
  uint8_t scales[8];
};
static_assert(sizeof(BlockIQ2_XS) == 74);

void dequantize_block(const BlockIQ2_XS& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int g = 0; g < 8; ++g) {
    const float db[2] = {d * (0.5f + static_cast<float>(b.scales[g] & 0x0F)) * 0.25f,
                         d * (0.5f + static_cast<float>(b.scales[g] >> 4)) * 0.25f};
    for (int l = 0; l < 4; ++l) {
      const uint16_t q = b.qs[4 * g + l];
      const uint8_t* grid = tables::kIq2xsGrid[q & 511];
      const uint8_t signs = tables::kIq2Signs[q >> 9];
      for (int j = 0; j < 8; ++j) y[j] = db[l / 2] * static_cast<float>(grid[j]) * sign_of(signs, j);
      y += 8;
    }
  }
}

// 82 bytes: [0,2) fp16 d | [2,34) low 8 bits of the grid indices, one per 8 elements
// | [34,66) sign bytes, one per 8 elements | [66,74) qh, per group the top 2 index bits of its
// 4 indices (bits 2l..2l+1) | [74,82) scales as in IQ2_XS. x = d * (0.5 + s) / 4 * grid * sign
struct BlockIQ2_S {
  static constexpr int kElems = kQK;
  uint16_t d;
  uint8_t qs[32];
  uint8_t signs[32];
  uint8_t qh[8];
  uint8_t scales[8];
};
static_assert(sizeof(BlockIQ2_S) == 82);

void dequantize_block(const BlockIQ2_S& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int g = 0; g < 8; ++g) {
    const float db[2] = {d * (0.5f + static_cast<float>(b.scales[g] & 0x0F)) * 0.25f,
                         d * (0.5f + static_cast<float>(b.scales[g] >> 4)) * 0.25f};
    for (int l = 0; l < 4; ++l) {
      const int index = b.qs[4 * g + l] | (((b.qh[g] >> (2 * l)) & 3) << 8);
      const uint8_t* grid = tables::kIq2sGrid[index];
      const uint8_t signs = b.signs[4 * g + l];
      for (int j = 0; j < 8; ++j) y[j] = db[l / 2] * static_cast<float>(grid[j]) * sign_of(signs, j);
      y += 8;
    }
  }
}

// 98 bytes: [0,2) fp16 d | [2,66) grid indices, one per 4 elements | [66,98) 8 little-endian
// u32, one per group: four 7-bit sign indices (one per 8 elements) and a 4-bit scale s in bits
// 28..31. x = d * (0.5 + s) / 2 * grid * sign
struct BlockIQ3_XXS {
  static constexpr int kElems = kQK;
  uint16_t d;
  uint8_t qs[64];
  uint8_t scales_signs[32];
};
static_assert(sizeof(BlockIQ3_XXS) == 98);

void dequantize_block(const BlockIQ3_XXS& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int g = 0; g < 8; ++g) {
    const uint32_t aux = load_u32(b.scales_signs + 4 * g);
    const float db = d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;
    for (int l = 0; l < 4; ++l) {
      const uint8_t signs = tables::kIq2Signs[(aux >> (7 * l)) & 127];
      const uint8_t* grid1 = tables::kIq3xxsGrid[b.qs[8 * g + 2 * l]];
      const uint8_t* grid2 = tables::kIq3xxsGrid[b.qs[8 * g + 2 * l + 1]];
      for (int j = 0; j < 4; ++j) {
        y[j] = db * static_cast<float>(grid1[j]) * sign_of(signs, j);
        y[j + 4] = db * static_cast<float>(grid2[j]) * sign_of(signs, j + 4);
      }
      y += 8;
    }
  }
}

// 110 bytes: [0,2) fp16 d | [2,66) low 8 bits of the grid indices, one per 4 elements
// | [66,74) qh, per group the ninth bit of its 8 indices | [74,106) sign bytes, one per 8
// elements | [106,110) scales, a nibble s per group (low nibble first). x = d * (1 + 2s) * grid * sign
struct BlockIQ3_S {
  static constexpr int kElems = kQK;
  uint16_t d;
  uint8_t qs[64];
  uint8_t qh[8];
  uint8_t signs[32];
  uint8_t scales[4];
};
static_assert(sizeof(BlockIQ3_S) == 110);

void dequantize_block(const BlockIQ3_S& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int g = 0; g < 8; ++g) {
    const int s = (b.scales[g / 2] >> (4 * (g % 2))) & 0x0F;
    const float db = d * static_cast<float>(1 + 2 * s);
    for (int l = 0; l < 4; ++l) {
      const int i1 = b.qs[8 * g + 2 * l] | (((b.qh[g] >> (2 * l)) & 1) << 8);
      const int i2 = b.qs[8 * g + 2 * l + 1] | (((b.qh[g] >> (2 * l + 1)) & 1) << 8);
      const uint8_t* grid1 = tables::kIq3sGrid[i1];
      const uint8_t* grid2 = tables::kIq3sGrid[i2];
      const uint8_t signs = b.signs[4 * g + l];
      for (int j = 0; j < 4; ++j) {
        y[j] = db * static_cast<float>(grid1[j]) * sign_of(signs, j);
        y[j + 4] = db * static_cast<float>(grid2[j]) * sign_of(signs, j + 4);
      }
      y += 8;
    }
  }
}

// 50 bytes: [0,2) fp16 d | [2,34) low 8 bits of the grid indices, one per 8 elements
// | [34,50) 8 u16, one per group: top 3 bits of index l in bits 3l..3l+2, scale s in bits
// 12..14, delta sign in bit 15. x = d * (2s + 1) * (grid ± delta)
struct BlockIQ1_S {
  static constexpr int kElems = kQK;
  uint16_t d;
  uint8_t qs[32];
  uint16_t qh[8];
};
static_assert(sizeof(BlockIQ1_S) == 50);

void dequantize_block(const BlockIQ1_S& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int g = 0; g < 8; ++g) {
    const uint16_t qh = b.qh[g];
    const float dl = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1);
    const float delta = qh & 0x8000 ? -tables::kIq1Delta : tables::kIq1Delta;
    for (int l = 0; l < 4; ++l) {
      const int8_t* grid = tables::kIq1sGrid[b.qs[4 * g + l] | (((qh >> (3 * l)) & 7) << 8)];
      for (int j = 0; j < 8; ++j) y[j] = dl * (static_cast<float>(grid[j]) + delta);
      y += 8;
    }
  }
}

// 56 bytes: [0,32) low 8 bits of the grid indices, one per 8 elements | [32,48) qh, one nibble
// per 8 elements: top 3 index bits, delta sign in bit 3 | [48,56) 4 little-endian u16: bits
// 0..11 hold two 3-bit scales per group (one per 16 elements), the top nibbles of the 4 words
// together form the fp16 d (first word = least significant nibble). x = d * (2s + 1) * (grid ± delta)
struct BlockIQ1_M {
  static constexpr int kElems = kQK;
  uint8_t qs[32];
  uint8_t qh[16];
  uint16_t scales[4];
};
static_assert(sizeof(BlockIQ1_M) == 56);

void dequantize_block(const BlockIQ1_M& b, float* y) {
  const uint16_t* sc = b.scales;
  const auto d_bits = static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) |
                                            ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000));
  const float d = fp16_to_f32(d_bits);
  for (int g = 0; g < 8; ++g) {
    const int shift = 6 * (g % 2);
    const float dl[2] = {d * static_cast<float>(2 * ((sc[g / 2] >> shift) & 7) + 1),
                         d * static_cast<float>(2 * ((sc[g / 2] >> (shift + 3)) & 7) + 1)};
    for (int l = 0; l < 4; ++l) {
      const int nib = (b.qh[2 * g + l / 2] >> (4 * (l % 2))) & 0x0F;
      const int8_t* grid = tables::kIq1sGrid[b.qs[4 * g + l] | ((nib & 7) << 8)];
      const float delta = nib & 8 ? -tables::kIq1Delta : tables::kIq1Delta;
      for (int j = 0; j < 8; ++j) y[j] = dl[l / 2] * (static_cast<float>(grid[j]) + delta);
      y += 8;
    }
  }
}

// 136 bytes: [0,2) fp16 d | [2,4) scales_h, bits 2g..2g+1 = top bits of group g's scale
// | [4,8) scales_l, a nibble per group (low nibble first) | [8,136) qs, 16 bytes per group laid
// out as an IQ4_NL block. x = d * (s - 32) * level
struct BlockIQ4_XS {
  static constexpr int kElems = kQK;
  uint16_t d;
  uint16_t scales_h;
  uint8_t scales_l[4];
  uint8_t qs[128];
};
static_assert(sizeof(BlockIQ4_XS) == 136);

void dequantize_block(const BlockIQ4_XS& b, float* y) {
  const float d = fp16_to_f32(b.d);
  for (int g = 0; g < 8; ++g) {
    const int ls = ((b.scales_l[g / 2] >> (4 * (g % 2))) & 0x0F) | (((b.scales_h >> (2 * g)) & 3) << 4);
    const float dl = d * static_cast<float>(ls - 32);
    const uint8_t* q = b.qs + 16 * g;
    for (int j = 0; j < 16; ++j) {
      y[j] = dl * static_cast<float>(tables::kIq4nlValues[q[j] & 0x0F]);
      y[j + 16] = dl * static_cast<float>(tables::kIq4nlValues[q[j] >> 4]);
    }
    y += 32;
  }
}

// ---- quantization ----
// The fitted formats (Q4_0, Q4_K, Q5_K, Q6_K) follow ggml's reference quantizers
// (quantize_row_*_ref in ggml-quants.c, no importance matrix): the same scale searches, rounding
// (ties to even) and float operation order. Built without FMA contraction, as this file is, the
// bytes equaled those of ggml's code built the same way on every block tried; ggml is usually
// built with contraction, which moves some roundings, so byte equality is not promised. The
// layouts are ggml's, so ggml, gguf-py and dequantize_row read the same values.

void quantize_block(const float* x, PlainF32* b) { b->bits = f32_to_bits(*x); }
void quantize_block(const float* x, PlainF16* b) { b->bits = f32_to_fp16(*x); }
void quantize_block(const float* x, PlainBF16* b) { b->bits = f32_to_bf16(*x); }

// ggml leaves NaN/inf inputs undefined (its scale becomes NaN and the float-to-int conversions
// overflow); here they are an error naming the type.
void require_finite(const float* x, int n, const char* type) {
  for (int j = 0; j < n; ++j)
    if (!std::isfinite(x[j]))
      fail("quantize_row: {} cannot encode {}: its block scale would be undefined", type, x[j]);
}

// A block scale as fp16. Finite input can still give a scale beyond fp16's range (about 65504),
// which ggml stores as inf and which would decode to inf/NaN; the fitted formats refuse it.
uint16_t checked_fp16_scale(float s, const char* type) {
  const uint16_t h = f32_to_fp16(s);
  if (!std::isfinite(fp16_to_f32(h)))
    fail("quantize_row: {} block scale {} does not fit in fp16: input values are too large for {}", type, s,
         type);
  return h;
}

// ggml's nearest_int (round to nearest, ties to even, the default rounding mode) followed by its
// clamp to [lo, hi]. Clamping first gives the same result and keeps out-of-range values and NaN
// (NaN goes to lo) away from an undefined float-to-int conversion.
int nearest_int_in(float v, int lo, int hi) {
  if (!(v > static_cast<float>(lo))) return lo;
  if (v >= static_cast<float>(hi)) return hi;
  return static_cast<int>(std::nearbyint(v));
}

// ggml's make_qkx2_quants (with use_mad = false): fits x[i] ≈ scale * L[i] - *min_out with
// L[i] in [0, nmax] and *min_out >= 0, minimising sum w[i] * err^2. The first guess spans
// [min(x, 0), max(x)]; then nstep + 1 trial inverse scales (nmax + rmin + rdelta * k) / range
// each fix the L, solve the weighted least-squares scale and min for them, and are kept when
// their error is lower. Returns the scale (0 for a constant non-positive block, where
// *min_out alone carries the value).
float fit_scale_min(int n, int nmax, const float* x, const float* w, uint8_t* L, float* min_out, float rmin,
                    float rdelta, int nstep) {
  float min = x[0], max = x[0];
  float sum_w = w[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    min = std::min(min, x[i]);
    max = std::max(max, x[i]);
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (min > 0.0f) min = 0.0f;
  if (max == min) {
    std::fill(L, L + n, uint8_t{0});
    *min_out = -min;
    return 0.0f;
  }
  float iscale = static_cast<float>(nmax) / (max - min);
  float scale = 1.0f / iscale;
  float best_error = 0.0f;
  for (int i = 0; i < n; ++i) {
    L[i] = static_cast<uint8_t>(nearest_int_in(iscale * (x[i] - min), 0, nmax));
    const float diff = scale * static_cast<float>(L[i]) + min - x[i];
    best_error += w[i] * (diff * diff);
  }
  uint8_t trial[32];  // n <= 32
  for (int step = 0; step <= nstep; ++step) {
    iscale = (rmin + rdelta * static_cast<float>(step) + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = nearest_int_in(iscale * (x[i] - min), 0, nmax);
      trial[i] = static_cast<uint8_t>(l);
      const float fl = static_cast<float>(l);
      sum_l += w[i] * fl;
      sum_l2 += w[i] * fl * fl;
      sum_xl += w[i] * fl * x[i];
    }
    const float det = sum_w * sum_l2 - sum_l * sum_l;
    if (!(det > 0.0f)) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
    float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
    if (this_min > 0.0f) {  // the offset may only shift values down: refit the scale alone
      this_min = 0.0f;
      this_scale = sum_xl / sum_l2;
    }
    float error = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float diff = this_scale * static_cast<float>(trial[i]) + this_min - x[i];
      error += w[i] * (diff * diff);
    }
    if (error < best_error) {
      std::copy(trial, trial + n, L);
      best_error = error;
      scale = this_scale;
      min = this_min;
    }
  }
  *min_out = -min;
  return scale;
}

// ggml's make_qx_quants with rmse_type 1 and no importance weights: fits x[i] ≈ scale * L[i]
// with L[i] in [-nmax, nmax - 1] (stored as L[i] + nmax), minimising sum x[i]^2 * err^2. The
// largest-magnitude element maps to -nmax (so the scale's sign is opposite to it); 18 nearby
// inverse scales -(nmax + 0.1 k) / max are tried, each with its least-squares scale, and the best
// is kept. Returns 0 with all L[i] = 0 for a block below ggml's GROUP_MAX_EPS.
float fit_symmetric_scale(int n, int nmax, const float* x, uint8_t* L) {
  float max = 0.0f, amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < 1e-15f) {
    std::fill(L, L + n, uint8_t{0});
    return 0.0f;
  }
  auto fit = [&](float iscale, float* sum_lx, float* sum_l2, bool store) {
    *sum_lx = 0.0f;
    *sum_l2 = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = nearest_int_in(iscale * x[i], -nmax, nmax - 1);
      if (store) L[i] = static_cast<uint8_t>(l + nmax);
      const float w = x[i] * x[i];
      const float fl = static_cast<float>(l);
      *sum_lx += w * x[i] * fl;
      *sum_l2 += w * fl * fl;
    }
  };
  float sum_lx, sum_l2;
  fit(-static_cast<float>(nmax) / max, &sum_lx, &sum_l2, true);
  float scale = sum_l2 != 0.0f ? sum_lx / sum_l2 : 0.0f;
  float best = scale * sum_lx;
  for (int k = -9; k <= 9; ++k) {
    if (k == 0) continue;
    const float iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(k)) / max;
    fit(iscale, &sum_lx, &sum_l2, false);
    // sum_lx^2 / sum_l2 is the weighted energy the fitted scale captures: more is less error.
    if (sum_l2 > 0.0f && sum_lx * sum_lx > best * sum_l2) {
      fit(iscale, &sum_lx, &sum_l2, true);
      scale = sum_lx / sum_l2;
      best = scale * sum_lx;
    }
  }
  return scale;
}

// ggml's quantize_row_q4_0_ref: d = -max / 8 where max is the element of largest magnitude (so
// it maps to q = 0 exactly); q = min(15, trunc(x / d + 8.5)), i.e. x / d rounded half up, the
// far end clipped to +7.
void quantize_block(const float* x, BlockQ4_0* b) {
  require_finite(x, 32, "q4_0");
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < 32; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  b->d = checked_fp16_scale(d, "q4_0");
  // x * id + 8.5 lies in [0.5, 16.5] (up to rounding), where floor is ggml's truncation. When d
  // is so small that 1 / d overflows, x * id is ±inf (or NaN for 0): the clamp keeps those codes
  // in range, and the block decodes to 0 anyway since d rounds to fp16 zero.
  auto code = [&](float v) { return nearest_int_in(std::floor(v * id + 8.5f), 0, 15); };
  for (int j = 0; j < 16; ++j) b->qs[j] = static_cast<uint8_t>(code(x[j]) | (code(x[j + 16]) << 4));
}

// Inverse of k4_scale_min on zeroed bytes: stores 6-bit scale sc and min m of group i.
void k4_set_scale_min(uint8_t* s, int i, int sc, int m) {
  if (i < 4) {
    s[i] |= static_cast<uint8_t>(sc);
    s[i + 4] |= static_cast<uint8_t>(m);
  } else {
    s[i + 4] |= static_cast<uint8_t>((sc & 0x0F) | ((m & 0x0F) << 4));
    s[i - 4] |= static_cast<uint8_t>((sc >> 4) << 6);
    s[i] |= static_cast<uint8_t>((m >> 4) << 6);
  }
}

// Shared by Q4_K and Q5_K (ggml's quantize_row_q{4,5}_K_ref): each group of 32 is fitted with
// fit_scale_min (weights rms(group) + |x|); the eight scales and eight mins are then coded as
// 6-bit multiples of d = max scale / 63 and dmin = max min / 63 (fp16), and every element is
// re-rounded against its group's coded scale and min. Fills scales[12], d, dmin and L[256]
// (values in [0, nmax]).
void quantize_k4_groups(const float* x, int nmax, float rmin, int nstep, const char* type, uint8_t* scales,
                        uint16_t* d_out, uint16_t* dmin_out, uint8_t* L) {
  require_finite(x, kQK, type);
  float group_scale[8], group_min[8];
  float max_scale = 0.0f, max_min = 0.0f;
  for (int g = 0; g < 8; ++g) {
    const float* xg = x + 32 * g;
    float sum_x2 = 0.0f;
    for (int l = 0; l < 32; ++l) sum_x2 += xg[l] * xg[l];
    const float av_x = std::sqrt(sum_x2 / 32.0f);
    float weights[32];
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xg[l]);
    group_scale[g] = fit_scale_min(32, nmax, xg, weights, L + 32 * g, &group_min[g], rmin, 0.1f, nstep);
    max_scale = std::max(max_scale, group_scale[g]);
    max_min = std::max(max_min, group_min[g]);
  }
  const float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
  std::memset(scales, 0, 12);
  for (int g = 0; g < 8; ++g)
    k4_set_scale_min(scales, g, nearest_int_in(inv_scale * group_scale[g], 0, 63),
                     nearest_int_in(inv_min * group_min[g], 0, 63));
  *d_out = checked_fp16_scale(max_scale / 63.0f, type);
  *dmin_out = checked_fp16_scale(max_min / 63.0f, type);

  const float d = fp16_to_f32(*d_out);
  const float dmin = fp16_to_f32(*dmin_out);
  for (int g = 0; g < 8; ++g) {
    int sc, m;
    k4_scale_min(scales, g, &sc, &m);
    const float dl = d * static_cast<float>(sc);
    if (dl == 0.0f) continue;  // keep the fitted L; they decode to -dmin * m regardless
    const float ml = dmin * static_cast<float>(m);
    for (int l = 0; l < 32; ++l)
      L[32 * g + l] = static_cast<uint8_t>(nearest_int_in((x[32 * g + l] + ml) / dl, 0, nmax));
  }
}

// ggml's quantize_row_q4_K_ref: 4-bit values; trial inverse scales (15 - 1 + 0.1 k) / range,
// k = 0..20.
void quantize_block(const float* x, BlockQ4_K* b) {
  uint8_t L[kQK];
  quantize_k4_groups(x, 15, -1.0f, 20, "q4_K", b->scales, &b->d, &b->dmin, L);
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < 32; ++l)
      b->qs[32 * k + l] = static_cast<uint8_t>(L[64 * k + l] | (L[64 * k + 32 + l] << 4));
}

// ggml's quantize_row_q5_K_ref: 5-bit values; trial inverse scales (31 - 0.5 + 0.1 k) / range,
// k = 0..15.
void quantize_block(const float* x, BlockQ5_K* b) {
  uint8_t L[kQK];
  quantize_k4_groups(x, 31, -0.5f, 15, "q5_K", b->scales, &b->d, &b->dmin, L);
  std::memset(b->qh, 0, sizeof(b->qh));
  for (int k = 0; k < 4; ++k) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t lo = L[64 * k + l];
      const uint8_t hi = L[64 * k + 32 + l];
      b->qs[32 * k + l] = static_cast<uint8_t>((lo & 0x0F) | ((hi & 0x0F) << 4));
      b->qh[l] |= static_cast<uint8_t>(((lo >> 4) << (2 * k)) | ((hi >> 4) << (2 * k + 1)));
    }
  }
}

// ggml's quantize_row_q6_K_ref: each group of 16 is fitted with fit_symmetric_scale (6-bit values
// -32..31); the sixteen scales are coded as int8 multiples of d = -max scale / 128, where max is
// the scale of largest magnitude (so it codes as -128), and the elements are re-rounded against
// the coded scales.
void quantize_block(const float* x, BlockQ6_K* b) {
  require_finite(x, kQK, "q6_K");
  uint8_t L[kQK];
  float group_scale[16];
  float max_scale = 0.0f, max_abs_scale = 0.0f;
  for (int g = 0; g < 16; ++g) {
    group_scale[g] = fit_symmetric_scale(16, 32, x + 16 * g, L + 16 * g);
    if (std::fabs(group_scale[g]) > max_abs_scale) {
      max_abs_scale = std::fabs(group_scale[g]);
      max_scale = group_scale[g];
    }
  }
  if (max_abs_scale < 1e-15f) {  // ggml's GROUP_MAX_EPS: an all-zero block
    std::memset(b, 0, sizeof(*b));
    return;
  }
  const float iscale = -128.0f / max_scale;
  b->d = checked_fp16_scale(1.0f / iscale, "q6_K");
  for (int g = 0; g < 16; ++g)
    b->scales[g] = static_cast<int8_t>(nearest_int_in(iscale * group_scale[g], -128, 127));

  const float d = fp16_to_f32(b->d);
  for (int g = 0; g < 16; ++g) {
    const float dl = d * static_cast<float>(b->scales[g]);
    if (dl == 0.0f) continue;  // keep the fitted L; they decode to 0
    for (int l = 0; l < 16; ++l)
      L[16 * g + l] = static_cast<uint8_t>(nearest_int_in(x[16 * g + l] / dl, -32, 31) + 32);
  }
  for (int half = 0; half < 2; ++half) {
    const uint8_t* q = L + 128 * half;
    uint8_t* ql = b->ql + 64 * half;
    uint8_t* qh = b->qh + 32 * half;
    for (int l = 0; l < 32; ++l) {
      ql[l] = static_cast<uint8_t>((q[l] & 0x0F) | ((q[l + 64] & 0x0F) << 4));
      ql[l + 32] = static_cast<uint8_t>((q[l + 32] & 0x0F) | ((q[l + 96] & 0x0F) << 4));
      qh[l] = static_cast<uint8_t>((q[l] >> 4) | ((q[l + 32] >> 4) << 2) | ((q[l + 64] >> 4) << 4) |
                                   ((q[l + 96] >> 4) << 6));
    }
  }
}

// ggml's quantize_row_q8_0_ref: d = amax / 127, q = round-half-away(x * (1 / d)), d stored as
// fp16. The rounded value is within ±127 whenever 1/d is finite; a subnormal d (amax below about
// 4e-37) makes 1/d infinite, and those quants are stored as 0, which is what ggml's conversion
// yields on x86. Unlike the fitted formats, a d beyond fp16's range is stored as inf, as ggml does.
void quantize_block(const float* x, BlockQ8_0* b) {
  require_finite(x, 32, "q8_0");
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  b->d = f32_to_fp16(d);
  for (int j = 0; j < 32; ++j) {
    const float q = std::round(x[j] * id);
    b->qs[j] = std::fabs(q) <= 127.0f ? static_cast<int8_t>(q) : int8_t{0};
  }
}

// ---- dispatch ----

using DequantizeFn = void (*)(const uint8_t* src, float* dst, int64_t n_blocks);
using QuantizeFn = void (*)(const float* src, uint8_t* dst, int64_t n_blocks);

// Blocks are copied between the row and a local struct: tensor data need not be aligned for the
// struct (blocks of 17 or 18 bytes follow each other), and the copy avoids aliasing casts.
template <class Block>
void dequantize_blocks(const uint8_t* src, float* dst, int64_t n_blocks) {
  for (int64_t i = 0; i < n_blocks; ++i) {
    Block block;
    std::memcpy(&block, src + i * sizeof(Block), sizeof(Block));
    dequantize_block(block, dst + i * Block::kElems);
  }
}

template <class Block>
void quantize_blocks(const float* src, uint8_t* dst, int64_t n_blocks) {
  for (int64_t i = 0; i < n_blocks; ++i) {
    Block block;
    quantize_block(src + i * Block::kElems, &block);
    std::memcpy(dst + i * sizeof(Block), &block, sizeof(Block));
  }
}

template <class Fn>
struct Codec {
  GgmlType type;
  uint32_t block_size;
  uint32_t type_size;
  Fn fn;
};

template <class Block>
constexpr Codec<DequantizeFn> dequantizer(GgmlType t) {
  return {t, Block::kElems, sizeof(Block), &dequantize_blocks<Block>};
}

template <class Block>
constexpr Codec<QuantizeFn> quantizer(GgmlType t) {
  return {t, Block::kElems, sizeof(Block), &quantize_blocks<Block>};
}

constexpr Codec<DequantizeFn> kDequantizers[] = {
    dequantizer<PlainF32>(GgmlType::F32),         dequantizer<PlainF16>(GgmlType::F16),
    dequantizer<PlainBF16>(GgmlType::BF16),       dequantizer<BlockQ4_0>(GgmlType::Q4_0),
    dequantizer<BlockQ4_1>(GgmlType::Q4_1),       dequantizer<BlockQ5_0>(GgmlType::Q5_0),
    dequantizer<BlockQ5_1>(GgmlType::Q5_1),       dequantizer<BlockQ8_0>(GgmlType::Q8_0),
    dequantizer<BlockQ2_K>(GgmlType::Q2_K),       dequantizer<BlockQ3_K>(GgmlType::Q3_K),
    dequantizer<BlockQ4_K>(GgmlType::Q4_K),       dequantizer<BlockQ5_K>(GgmlType::Q5_K),
    dequantizer<BlockQ6_K>(GgmlType::Q6_K),       dequantizer<BlockIQ1_S>(GgmlType::IQ1_S),
    dequantizer<BlockIQ1_M>(GgmlType::IQ1_M),     dequantizer<BlockIQ2_XXS>(GgmlType::IQ2_XXS),
    dequantizer<BlockIQ2_XS>(GgmlType::IQ2_XS),   dequantizer<BlockIQ2_S>(GgmlType::IQ2_S),
    dequantizer<BlockIQ3_XXS>(GgmlType::IQ3_XXS), dequantizer<BlockIQ3_S>(GgmlType::IQ3_S),
    dequantizer<BlockIQ4_NL>(GgmlType::IQ4_NL),   dequantizer<BlockIQ4_XS>(GgmlType::IQ4_XS),
    dequantizer<BlockTQ1_0>(GgmlType::TQ1_0),     dequantizer<BlockTQ2_0>(GgmlType::TQ2_0),
    dequantizer<BlockMXFP4>(GgmlType::MXFP4),
};

// The formats the writer produces.
constexpr Codec<QuantizeFn> kQuantizers[] = {
    quantizer<PlainF32>(GgmlType::F32),
    quantizer<PlainF16>(GgmlType::F16),
    quantizer<PlainBF16>(GgmlType::BF16),
    quantizer<BlockQ8_0>(GgmlType::Q8_0),
    quantizer<BlockQ4_0>(GgmlType::Q4_0),
    quantizer<BlockQ4_K>(GgmlType::Q4_K),
    quantizer<BlockQ5_K>(GgmlType::Q5_K),
    quantizer<BlockQ6_K>(GgmlType::Q6_K),
};

// The entry for t, or null. Also checks that the block struct has the type table's geometry
// and that n is a whole number of blocks; returns the number of blocks in *n_blocks.
template <class Fn, size_t N>
const Codec<Fn>* find_codec(const Codec<Fn> (&table)[N], const char* what, GgmlType t, int64_t n,
                            int64_t* n_blocks) {
  for (const Codec<Fn>& c : table) {
    if (c.type != t) continue;
    const TypeTraits& tr = traits(t);
    if (tr.block_size != c.block_size || tr.type_size != c.type_size)
      fail("{}: internal error: the {} block struct ({} elements, {} bytes) disagrees with the type "
           "table ({} elements, {} bytes)",
           what, tr.name, c.block_size, c.type_size, tr.block_size, tr.type_size);
    if (n < 0 || n % tr.block_size != 0)
      fail("{}: {} elements is not a whole number of {} blocks ({} elements each)", what, n, tr.name,
           tr.block_size);
    *n_blocks = n / tr.block_size;
    return &c;
  }
  return nullptr;
}

}  // namespace

void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n) {
  int64_t n_blocks = 0;
  const Codec<DequantizeFn>* c = find_codec(kDequantizers, "dequantize_row", t, n, &n_blocks);
  if (!c)
    fail("dequantize_row: no CPU dequantization for ggml type {} (id {})", type_name(t),
         static_cast<uint32_t>(t));
  c->fn(static_cast<const uint8_t*>(src), dst, n_blocks);
}

bool can_quantize(GgmlType t) {
  for (const Codec<QuantizeFn>& c : kQuantizers)
    if (c.type == t) return true;
  return false;
}

void quantize_row(GgmlType t, const float* src, void* dst, int64_t n) {
  int64_t n_blocks = 0;
  const Codec<QuantizeFn>* c = find_codec(kQuantizers, "quantize_row", t, n, &n_blocks);
  if (!c)
    fail("quantize_row: cannot quantize to ggml type {} (id {}); only f32, f16, bf16, q8_0, q4_0, q4_K, "
         "q5_K and q6_K are written",
         type_name(t), static_cast<uint32_t>(t));
  c->fn(src, static_cast<uint8_t*>(dst), n_blocks);
}

}  // namespace sparsemla::gguf
