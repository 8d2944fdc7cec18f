// Sparse MLA attention over fp8 latent rows (latent 512 + rope 64: GLM-5, DeepSeek-V3.2) on the
// mma.sync tensor cores of every GPU from SM80: the rows are used as stored, never widened into a
// bf16 tile. The bf16-tile kernel (sparse_mla.cu) spends a pass and a barrier per tile widening,
// and its bf16 tile (37 KB) keeps a 99 KB device (SM86, SM89, SM12x) to one tile in flight; here a
// tile is 32 rows of 656 bytes, so 32 heads keep two tiles in flight within 99 KB.
//
// A block takes one token and 16, 32 or 64 heads; warps 2p and 2p+1 share heads 16p..16p+15, and
// each takes half of the work: latent groups 2 * half and 2 * half + 1 (dims 256 * half ..) and
// half of the rope for the scores, the same two groups of the output.
//   Scores: e4m3 bytes go straight from shared memory into B fragments, widened exactly to fp16
//     (4 bytes per row per k-step and lane: q's latent columns are stored permuted to match, and as
//     fp16, each row scaled into fp16's range by a power of two, q_factor). Each group's 8 k-steps
//     sum apart and are scaled by their rows' group scales.
//   Output: P . V takes V's group scales into P: P' = P * scale[row][group] / K[group], K a
//     running bound of the scales seen (lazy, like the softmax maximum: it moves only when a
//     tile's largest scale passes it kScaleSlack-fold, and then the output is rescaled), so P' <=
//     256 * 16 stays within fp16 and never becomes subnormal for want of a larger K. Output dims
//     are permuted within 32 (a lane holds dims 4g + j of four n-tiles j), so one 4-byte load per
//     row serves four n-tiles; the bytes of two rows are paired with a byte permute and widened.
//   Shared memory rows are 704 bytes with 16-byte chunks XOR-swizzled by row, so that the score
//     loads (16 bytes: rows g, two per quarter warp) and the output loads (4 bytes: rows 2 q4, 8
//     lanes per row) are free of bank conflicts; the rope chunks too, for ldmatrix.
#include <algorithm>

#include "ops/cuda/attention.h"
#include "ops/cuda/attention_smem.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/sparse_mla_tile.cuh"

namespace sparsemla::cuda {
namespace {

using mla_smem::kChunk;
using mla_smem::kNoSlot;
using mla_smem::kRows;

constexpr int kLora = 512, kRope = 64;
constexpr int kRowBytes = kLora + 16 + 2 * kRope;            // 656: 512 e4m3, 4 fp32 scales, 64 bf16
constexpr int kRowChunks = kRowBytes / 16;                   // 41
constexpr int kStride = mla_smem::kFp8RowStride;             // 704 bytes per row in shared memory
constexpr int kTileBytes = kRows * kStride;
constexpr int kQStride = kLora + 8, kRStride = kRope + 8;    // q rows in fp16 / bf16 values
constexpr int kScaleChunk = kLora / 16, kRopeChunk = kScaleChunk + 1;
constexpr float kScaleSlack = 16.0f;  // the lazy bound K of the scales: P' <= 2^kMaxSlack * 16

// The shared-memory chunk of chunk c of tile row r.
__device__ __forceinline__ int swizzle(int r, int c) {
  const int x = (r >> 1) & 3;
  return c < kScaleChunk ? c ^ (2 * x) : c == kScaleChunk ? c : kRopeChunk + ((c - kRopeChunk) ^ x);
}

template <int HG, int STAGES>
__global__ void __launch_bounds__(HG * 64) mla_fp8_kernel(AttentionArgs a, MlaGeometry geo, float* part) {
  constexpr int THREADS = HG * 64;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* sp = smem;
  __half* sQh = reinterpret_cast<__half*>(sp);  // [HG * 16][kQStride]: latent columns, permuted
  sp += HG * 16 * kQStride * 2;
  __nv_bfloat16* sQr = reinterpret_cast<__nv_bfloat16*>(sp);  // [HG * 16][kRStride]: rope
  sp += HG * 16 * kRStride * 2;
  uint8_t* sRaw = sp;  // [STAGES][32][kStride]
  sp += STAGES * kTileBytes;
  float* sS = reinterpret_cast<float*>(sp);  // [HG pairs][2 halves][16][kSStride]
  sp += geo.score_bytes;
  uint32_t* sSlot = reinterpret_cast<uint32_t*>(sp);  // [kChunk]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q4 = lane % 4;
  const int mi = lane / 8, ri = lane % 8;
  const int pair = warp / 2, half = warp % 2;
  const int h0 = blockIdx.x * HG * 16;
  const BlockRows br = block_rows(a, geo);
  const int t = br.t, split = br.split, r_begin = br.r_begin, r_end = br.r_end;
  const uint8_t* base = static_cast<const uint8_t*>(a.latent.data);

  // q: latent dim p = 64 kg + 16 q + 4 sub + 2 hi + i goes to column 16 (4 kg + sub) + 8 hi + 2 q + i,
  // where the A fragment of k-step 4 kg + sub meets the bytes lane q loads (below); rope as is.
  // The fp16 latent part of row r is scaled by q_factor (convert.cuh) of its largest magnitude, kept
  // in the row's padding (qf(r)); the scores' latent part is scaled back (below).
  auto qf = [&](int r) { return reinterpret_cast<float*>(sQh + r * kQStride + kLora); };
  // One pass: each warp two rows at a time (all their loads in flight: 10 float4 per lane), each
  // lane 4 float4 of a row's latent values and lanes 0-15 one of its rope values; the row's maximum
  // by shuffles, then its values written from the same registers. (Session 47's form read q twice,
  // a warp's rows one after another for the maxima and then the whole of q again: the kernel 5-11%
  // slower than without the scaling; H100, session 48, run 85.)
  auto load_q = [&]() {
    constexpr int RB = 2, WARPS = THREADS / 32, NL = kLora / 128;
    static_assert((HG * 16) % (WARPS * RB) == 0 && kRope / 4 <= 32, "q rows per warp");
    const float* q = a.q + int64_t(t) * a.heads * (kLora + kRope);
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int r0 = warp * RB; r0 < HG * 16; r0 += WARPS * RB) {
      float4 v[RB][NL], rv[RB];
#pragma unroll
      for (int j = 0; j < RB; ++j) {
        const int h = h0 + r0 + j;
        const float4* src = reinterpret_cast<const float4*>(q + int64_t(min(h, a.heads - 1)) * (kLora + kRope));
#pragma unroll
        for (int k = 0; k < NL; ++k) v[j][k] = h < a.heads ? src[lane + 32 * k] : zero;
        rv[j] = h < a.heads && lane < kRope / 4 ? src[kLora / 4 + lane] : zero;
      }
#pragma unroll
      for (int j = 0; j < RB; ++j) {
        const int r = r0 + j;
        float amax = 0.0f;
#pragma unroll
        for (int k = 0; k < NL; ++k)
          amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[j][k].x), fabsf(v[j][k].y)), fmaxf(fabsf(v[j][k].z), fabsf(v[j][k].w))));
#pragma unroll
        for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float f = q_factor(__float_as_uint(amax));
        if (lane == 0) *qf(r) = f;
        // latent value p = 4 (lane + 32 k) goes to column 16 (4 (p / 64) + p % 16 / 4) + 2 (p % 64 / 16)
        // = col0 + 128 k
        __half* dst = sQh + r * kQStride + 16 * (4 * (lane / 16) + lane % 4) + 2 * (lane % 16 / 4);
#pragma unroll
        for (int k = 0; k < NL; ++k) {
          *reinterpret_cast<uint32_t*>(dst + 128 * k) = pack_f16(v[j][k].x * f, v[j][k].y * f);
          *reinterpret_cast<uint32_t*>(dst + 128 * k + 8) = pack_f16(v[j][k].z * f, v[j][k].w * f);
        }
        if (lane < kRope / 4)
          *reinterpret_cast<uint2*>(sQr + r * kRStride + 4 * lane) =
              make_uint2(pack_bf16(rv[j].x, rv[j].y), pack_bf16(rv[j].z, rv[j].w));
      }
    }
  };
  bool q_loaded = false;

  float o[32][4];  // n-tile j: dims 256 half + 32 (j / 4) + 4 n + j % 4 of column n
#pragma unroll
  for (int j = 0; j < 32; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float K[2] = {0.0f, 0.0f};  // the lazy bound of the scales of groups 2 half + gi: o is in units of K
  const float sl2 = a.scale * kLog2e;
  const int swz_s = 2 * ((g >> 1) & 3);  // the score loads' rows nt * 8 + g
  const __half* qa = sQh + (pair * 16 + (mi % 2) * 8 + ri) * kQStride + (mi / 2) * 8;
  const __nv_bfloat16* qr = sQr + (pair * 16 + (mi % 2) * 8 + ri) * kRStride + (mi / 2) * 8;

  for (int c0 = r_begin; c0 < r_end; c0 += kChunk) {
    const int chunk_rows = load_chunk_slots(sSlot, a, br, c0, tid, THREADS);
    const int n_tiles = (chunk_rows + kRows - 1) / kRows;

    // Starts copying tile j's rows as stored into stage st; rows without a slot are zero. Thread
    // tid takes chunks q, q + kTpr, ... of row tid / kTpr: one slot lookup per row and no division
    // per chunk (a loop over the tile's chunks with a division and a slot load each was a fifth of
    // the kernel's instructions, Nsight Compute).
    auto issue = [&](int j, int st) {
      constexpr int kTpr = THREADS / kRows, kPer = (kRowChunks + kTpr - 1) / kTpr;
      static_assert(THREADS % kRows == 0, "whole rows per thread group");
      const int r = tid / kTpr, q = tid % kTpr;
      const uint32_t slot = r < chunk_rows - j * kRows ? sSlot[j * kRows + r] : kNoSlot;
      uint8_t* d = sRaw + st * kTileBytes + r * kStride;
      if (slot != kNoSlot) {
        const uint8_t* src = base + int64_t(slot) * kRowBytes;
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          const int c = q + k * kTpr;
          if (c < kRowChunks) cp_async16(d + swizzle(r, c) * 16, src + c * 16);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          const int c = q + k * kTpr;
          if (c < kRowChunks) *reinterpret_cast<uint4*>(d + swizzle(r, c) * 16) = make_uint4(0, 0, 0, 0);
        }
      }
    };
#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) {
      if (j < n_tiles) issue(j, j);
      cp_async_commit();
    }
    if (!q_loaded) {
      load_q();  // visible to all warps after the barrier at the top of the tile loop
      q_loaded = true;
    }
    for (int it = 0; it < n_tiles; ++it) {
      cp_async_wait_group<STAGES - 2>();
      __syncthreads();  // tile `it` landed for every thread; the stage refilled below is no longer read
      if (it + STAGES - 1 < n_tiles) issue(it + STAGES - 1, (it + STAGES - 1) % STAGES);
      cp_async_commit();
      const uint8_t* raw = sRaw + (it % STAGES) * kTileBytes;
      const uint32_t* slots = sSlot + it * kRows;
      const int valid = min(kRows, chunk_rows - it * kRows);

      // Group scales of this lane's 8 rows (the score columns nt * 8 + 2 q4 + e), and the tile's largest.
      float sc[8][2], tmax[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 v = *reinterpret_cast<const float2*>(raw + ((i / 2) * 8 + 2 * q4 + i % 2) * kStride +
                                                          kScaleChunk * 16 + 8 * half);
        sc[i][0] = v.x;
        sc[i][1] = v.y;
        tmax[0] = fmaxf(tmax[0], v.x);
        tmax[1] = fmaxf(tmax[1], v.y);
      }
#pragma unroll
      for (int gi = 0; gi < 2; ++gi) {
        tmax[gi] = fmaxf(tmax[gi], __shfl_xor_sync(0xffffffffu, tmax[gi], 1));
        tmax[gi] = fmaxf(tmax[gi], __shfl_xor_sync(0xffffffffu, tmax[gi], 2));
      }

      // S = Q K^T over this warp's half: [16 heads][32 rows]
      float s[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int gi = 0; gi < 2; ++gi) {
        float st[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) st[nt][0] = st[nt][1] = st[nt][2] = st[nt][3] = 0.0f;
#pragma unroll
        for (int kgl = 0; kgl < 2; ++kgl) {
          const int kg = (2 * half + gi) * 2 + kgl;  // 64 dims
          uint4 w[4];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
            w[nt] = *reinterpret_cast<const uint4*>(raw + (nt * 8 + g) * kStride + ((kg * 4 + q4) ^ swz_s) * 16);
#pragma unroll
          for (int sub = 0; sub < 4; ++sub) {
            uint32_t fa[4];
            ldmatrix_x4(fa, qa + (kg * 4 + sub) * 16);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              const uint32_t word = sub == 0 ? w[nt].x : sub == 1 ? w[nt].y : sub == 2 ? w[nt].z : w[nt].w;
              const uint32_t fb[2] = {fp8x2_to_f16x2(word), fp8x2_hi_to_f16x2(word)};
              mma_16816(st[nt], fa, fb, __half());
            }
          }
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] += st[nt][e] * sc[nt * 2 + (e & 1)][gi];
      }
      {  // the latent part back from q's scaled fp16 (rows g and g + 8 of the pair's heads)
        const float inv0 = 1.0f / *qf(pair * 16 + g), inv8 = 1.0f / *qf(pair * 16 + g + 8);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          s[nt][0] *= inv0;
          s[nt][1] *= inv0;
          s[nt][2] *= inv8;
          s[nt][3] *= inv8;
        }
      }
#pragma unroll
      for (int rkl = 0; rkl < 2; ++rkl) {  // rope k-steps of this half, bf16
        const int rk = half * 2 + rkl, row = (mi / 2) * 8 + ri;
        const int chunk = kRopeChunk + ((rk * 2 + mi % 2) ^ ((row >> 1) & 3));
        uint32_t fa[4], fb0[4], fb1[4];
        ldmatrix_x4(fa, qr + rk * 16);
        ldmatrix_x4(fb0, raw + row * kStride + chunk * 16);
        ldmatrix_x4(fb1, raw + (row + 16) * kStride + chunk * 16);
        mma_16816(s[0], fa, fb0, __nv_bfloat16());
        mma_16816(s[1], fa, fb0 + 2, __nv_bfloat16());
        mma_16816(s[2], fa, fb1, __nv_bfloat16());
        mma_16816(s[3], fa, fb1 + 2, __nv_bfloat16());
      }

      float alpha[2];
      pair_softmax(s, sS, pair, half, lane, slots, valid, sl2, m, l, alpha);
      float inv_k[2], ratio[2];
#pragma unroll
      for (int gi = 0; gi < 2; ++gi) {  // lazy, as the softmax maximum: K moves when passed 16-fold
        const float k_new = tmax[gi] > kScaleSlack * K[gi] ? tmax[gi] : K[gi];
        ratio[gi] = k_new == K[gi] ? 1.0f : K[gi] / k_new;
        inv_k[gi] = k_new > 0.0f ? 1.0f / k_new : 0.0f;
        K[gi] = k_new;
      }
      // the factors of the output's rows g, g + 8 (alpha) in its two groups (dims j / 16: ratio)
      if (warp_rescales(alpha[0] * ratio[0], alpha[1] * ratio[0]) ||
          warp_rescales(alpha[0] * ratio[1], alpha[1] * ratio[1])) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const float f0 = alpha[0] * ratio[j / 16], f1 = alpha[1] * ratio[j / 16];
          o[j][0] *= f0;
          o[j][1] *= f0;
          o[j][2] *= f1;
          o[j][3] *= f1;
        }
      }

      // O += P' V over this warp's half of the output dims; P' of both k-steps first (s and the
      // scales are then dead: fewer live registers in the loop)
      uint32_t pa[2][2][4];  // [kk][group][A fragment]
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
#pragma unroll
        for (int gi = 0; gi < 2; ++gi) {  // rows 16 kk + 2 q4 + {0, 1} and + {8, 9}: sc[4 kk .. 4 kk + 3]
          const float x0 = sc[4 * kk][gi] * inv_k[gi], x1 = sc[4 * kk + 1][gi] * inv_k[gi];
          const float x8 = sc[4 * kk + 2][gi] * inv_k[gi], x9 = sc[4 * kk + 3][gi] * inv_k[gi];
          pa[kk][gi][0] = pack_f16(s[2 * kk][0] * x0, s[2 * kk][1] * x1);
          pa[kk][gi][1] = pack_f16(s[2 * kk][2] * x0, s[2 * kk][3] * x1);
          pa[kk][gi][2] = pack_f16(s[2 * kk + 1][0] * x8, s[2 * kk + 1][1] * x9);
          pa[kk][gi][3] = pack_f16(s[2 * kk + 1][2] * x8, s[2 * kk + 1][3] * x9);
        }
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const uint32_t(*fa)[4] = pa[kk];
        const uint8_t* r0 = raw + (16 * kk + 2 * q4) * kStride;  // rows R, R + 1, R + 8, R + 9
#pragma unroll
        for (int jb = 0; jb < 8; ++jb) {
          const int off = (((half * 16 + 2 * jb + (g >> 2)) ^ (2 * q4)) * 16) + 4 * (g & 3);
          const uint32_t w0 = smem_u32(r0 + off), w1 = smem_u32(r0 + kStride + off);
          const uint32_t w8 = smem_u32(r0 + 8 * kStride + off), w9 = smem_u32(r0 + 9 * kStride + off);
          const uint32_t lo01 = __byte_perm(w0, w1, 0x5140), hi01 = __byte_perm(w0, w1, 0x7362);
          const uint32_t lo89 = __byte_perm(w8, w9, 0x5140), hi89 = __byte_perm(w8, w9, 0x7362);
          const uint32_t b0[2] = {fp8x2_to_f16x2(lo01), fp8x2_to_f16x2(lo89)};
          const uint32_t b1[2] = {fp8x2_hi_to_f16x2(lo01), fp8x2_hi_to_f16x2(lo89)};
          const uint32_t b2[2] = {fp8x2_to_f16x2(hi01), fp8x2_to_f16x2(hi89)};
          const uint32_t b3[2] = {fp8x2_hi_to_f16x2(hi01), fp8x2_hi_to_f16x2(hi89)};
          mma_16816(o[jb * 4 + 0], fa[jb / 4], b0, __half());
          mma_16816(o[jb * 4 + 1], fa[jb / 4], b1, __half());
          mma_16816(o[jb * 4 + 2], fa[jb / 4], b2, __half());
          mma_16816(o[jb * 4 + 3], fa[jb / 4], b3, __half());
        }
      }
    }
  }

  pair_denominators(l);
  // Output: normalized when unsplit, else the split's unnormalized sum with its max and denominator.
  // A lane holds 8 consecutive dims 256 half + 32 jb + 8 q4 .. of each of its rows.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int h = h0 + pair * 16 + g + rr * 8;
    if (h >= a.heads) continue;
    const float inv = geo.splits == 1 ? (l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f) : 1.0f;
    float* dst = geo.splits == 1 ? a.out + (int64_t(t) * a.heads + h) * kLora
                                 : part + ((int64_t(t) * geo.splits + split) * a.heads + h) * partial_row_floats(kLora);
#pragma unroll
    for (int jb = 0; jb < 8; ++jb) {
      const float f = K[jb / 4] * inv;
      float* d = dst + half * 256 + jb * 32 + 8 * q4;
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1)
#pragma unroll
        for (int jj = 0; jj < 4; jj += 2)
          *reinterpret_cast<float2*>(d + 4 * e1 + jj) =
              make_float2(o[jb * 4 + jj][2 * rr + e1] * f, o[jb * 4 + jj + 1][2 * rr + e1] * f);
    }
    if (geo.splits > 1 && half == 0 && q4 == 0) {
      dst[kLora] = m[rr];
      dst[kLora + 1] = l[rr];
    }
  }
}

template <int HG, int STAGES>
void launch(const AttentionArgs& a, const MlaGeometry& geo, float* part, cudaStream_t st) {
  const size_t smem = std::max(mla_smem::fp8_rows_bytes(HG, STAGES), geo.launch_smem);
  auto kernel = mla_fp8_kernel<HG, STAGES>;
  allow_smem(kernel, smem);
  const dim3 grid(unsigned(ceil_div(a.heads, HG * 16)), unsigned(a.T), unsigned(geo.splits));
  kernel<<<grid, HG * 64, smem, st>>>(a, geo, part);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace

bool mla_fp8_rows_take(const AttentionArgs& a) {
  return a.dtype == KvDtype::FP8 && a.kv_lora == kLora && a.rope == kRope && a.latent.row_bytes == kRowBytes;
}

void mla_fp8_rows(const AttentionArgs& a, const MlaGeometry& geo, float* part, cudaStream_t st) {
  if (geo.hg == 4) return geo.stages == 3 ? launch<4, 3>(a, geo, part, st) : launch<4, 2>(a, geo, part, st);
  if (geo.hg == 2) return geo.stages == 3 ? launch<2, 3>(a, geo, part, st) : launch<2, 2>(a, geo, part, st);
  return geo.stages == 3 ? launch<1, 3>(a, geo, part, st) : launch<1, 2>(a, geo, part, st);
}

}  // namespace sparsemla::cuda
