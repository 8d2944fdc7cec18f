// Sparse MLA attention over latent rows gathered from the paged cache (FlashAttention-style online
// softmax, output in latent space). The same kernels run dense attention when no selection is given.
//
// Mma kernel: a block takes one token and 16, 32 or 64 heads; warps 2g and 2g+1 share heads
// 16g..16g+15. Each tile of 32 rows is gathered into shared memory (cp.async; fp8 rows land as
// stored and are widened to bf16 with their group scales); the two warps of a pair each compute half
// of q . row over the 576 dims, add the halves through shared memory, and then each accumulates half
// of the 512 output dims (P in bf16 on the tensor cores, fp32 accumulators). Long selections are
// split over blocks (split-KV) and merged by a second kernel. Two tiles in flight where shared
// memory allows (attention_smem.h: at 16 heads also within the 99 KB of SM86, SM89 and SM12x).
// Fma kernel: one block per token and head, any shape; the reference the selector falls back to.
#include <algorithm>
#include <cmath>

#include "ops/cuda/attention.h"
#include "ops/cuda/attention_smem.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/sparse_mla_tile.cuh"
#include "util/env.h"

namespace sparsemla::cuda {
namespace {

using mla_smem::kChunk;
using mla_smem::kNoSlot;
using mla_smem::kRows;
using mla_smem::nv_tiles;
using Geometry = MlaGeometry;

template <int NV, bool FP8, int HG, int STAGES, int KS>
__global__ void __launch_bounds__(HG * 64) mla_mma_kernel(AttentionArgs a, Geometry geo, float* part) {
  constexpr int THREADS = HG * 64;
  extern __shared__ __align__(16) unsigned char smem[];
  const int stride = geo.stride, D = geo.d;
  const int64_t row_bytes = a.latent.row_bytes;
  unsigned char* sp = smem;
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(sp);  // [HG * 16][stride]
  sp += size_t(HG) * 16 * stride * 2;
  __nv_bfloat16* sKbuf = reinterpret_cast<__nv_bfloat16*>(sp);  // [STAGES or 1][32][stride]
  sp += size_t(FP8 ? 1 : STAGES) * kRows * stride * 2;
  // fp8 rows as stored, double-buffered ([2][32][row_bytes], each stage padded to fp8_stage_bytes);
  // the scores [HG pairs][2 halves][16][33] go in the stage of the tile being computed (widened by
  // then), or after the tiles without fp8 stages.
  uint8_t* sRaw = sp;
  const int raw_stage = geo.raw_stage;
  sp += FP8 && STAGES == 2 ? 2 * raw_stage : geo.score_bytes;
  uint32_t* sSlot = reinterpret_cast<uint32_t*>(sp);  // [kChunk] cache slots (32 bits: GpuCache checks)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q4 = lane % 4;
  const int pair = warp / 2, half = warp % 2;
  const int h0 = blockIdx.x * HG * 16;
  const BlockRows br = block_rows(a, geo);
  const int t = br.t, split = br.split, r_begin = br.r_begin, r_end = br.r_end;

  {  // the row tiles' pad columns (D .. stride) are zero; the copies never write them
    const int pad = (stride - D) / 8, rows = (FP8 ? 1 : STAGES) * kRows;
    for (int i = tid; i < rows * pad; i += THREADS)
      *reinterpret_cast<uint4*>(sKbuf + (i / pad) * stride + D + (i % pad) * 8) = make_uint4(0, 0, 0, 0);
  }
  // Queries, four values at a time, many loads in flight; pad columns and missing heads are zero.
  // Called once the first tile's copy is under way.
  auto load_q = [&]() {
    constexpr int kInFlight = 12;
    const float* q = a.q + int64_t(t) * a.heads * D;
    const int qch = stride / 4, total = HG * 16 * qch;
    for (int i0 = 0; i0 < total; i0 += kInFlight * THREADS) {
      float4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int i = i0 + u * THREADS + tid;
        const int r = i / qch, c = (i % qch) * 4, h = h0 + r;
        v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < total && h < a.heads && c < D) v[u] = *reinterpret_cast<const float4*>(q + int64_t(h) * D + c);
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int i = i0 + u * THREADS + tid;
        const int r = i / qch, c = (i % qch) * 4;
        if (i < total)
          *reinterpret_cast<uint2*>(sQ + r * stride + c) = make_uint2(pack_bf16(v[u].x, v[u].y), pack_bf16(v[u].z, v[u].w));
      }
    }
  };
  bool q_loaded = false;

  float o[NV][4];
#pragma unroll
  for (int j = 0; j < NV; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float sl2 = a.scale * kLog2e;
  const int ksteps = KS > 0 ? KS : geo.d_pad / 32;  // k-steps of 16 in each half (KS: known at compile time)
  const uint8_t* base = static_cast<const uint8_t*>(a.latent.data);
  const int groups = latent_groups(a.kv_lora);

  for (int c0 = r_begin; c0 < r_end; c0 += kChunk) {
    const int chunk_rows = load_chunk_slots(sSlot, a, br, c0, tid, THREADS);
    const int n_tiles = (chunk_rows + kRows - 1) / kRows;

    // Starts copying tile j of the chunk into its buffer (bf16 rows, or raw fp8 rows), or for fp8
    // without a second stage converts it straight from global memory.
    auto issue = [&](int j) {
      const uint32_t* slots = sSlot + j * kRows;
      const int valid = min(kRows, chunk_rows - j * kRows);
      if constexpr (!FP8) {
        __nv_bfloat16* dstK = sKbuf + (STAGES == 2 ? (j & 1) : 0) * kRows * stride;
        constexpr int PER_ROW = THREADS / kRows;  // threads per row
        const int r = tid / PER_ROW, ch = D / 8;
        const uint32_t slot = r < valid ? slots[r] : kNoSlot;
        const uint8_t* src = base + int64_t(slot) * row_bytes;
        __nv_bfloat16* dst = dstK + r * stride;
        for (int c = tid % PER_ROW; c < ch; c += PER_ROW) {
          if (slot != kNoSlot) cp_async16(dst + c * 8, src + c * 16);
          else *reinterpret_cast<uint4*>(dst + c * 8) = make_uint4(0, 0, 0, 0);
        }
      } else if constexpr (STAGES == 2) {
        uint8_t* dstR = sRaw + (j & 1) * raw_stage;
        constexpr int PER_ROW = THREADS / kRows;
        const int r = tid / PER_ROW, ch = int(row_bytes / 16);
        const uint32_t slot = r < valid ? slots[r] : kNoSlot;
        const uint8_t* src = base + int64_t(slot) * row_bytes;
        uint8_t* dst = dstR + r * row_bytes;
        for (int c = tid % PER_ROW; c < ch; c += PER_ROW) {
          if (slot != kNoSlot) cp_async16(dst + c * 16, src + c * 16);
          else *reinterpret_cast<uint4*>(dst + c * 16) = make_uint4(0, 0, 0, 0);
        }
      } else {
        const int ch = a.kv_lora / 8;
        for (int i = tid; i < kRows * ch; i += THREADS) {
          const int r = i / ch, c = i % ch;
          const uint32_t slot = r < valid ? slots[r] : kNoSlot;
          __nv_bfloat16* dst = sKbuf + r * stride + c * 8;
          if (slot == kNoSlot) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
            continue;
          }
          const uint8_t* row = base + int64_t(slot) * row_bytes;
          const uint2 v = *reinterpret_cast<const uint2*>(row + c * 8);
          const float sc = reinterpret_cast<const float*>(row + a.kv_lora)[c * 8 / kFp8Group];
          *reinterpret_cast<uint4*>(dst) = widen_fp8x8(v, sc);
        }
        const int rope_words = a.rope / 2;
        for (int i = tid; i < kRows * rope_words; i += THREADS) {
          const int r = i / rope_words, c = i % rope_words;
          const uint32_t slot = r < valid ? slots[r] : kNoSlot;
          uint32_t v = 0;
          if (slot != kNoSlot)
            v = reinterpret_cast<const uint32_t*>(base + int64_t(slot) * row_bytes + a.kv_lora + 4 * groups)[c];
          *reinterpret_cast<uint32_t*>(sKbuf + r * stride + a.kv_lora + 2 * c) = v;
        }
      }
    };

    issue(0);
    cp_async_commit();
    if (!q_loaded) {
      load_q();  // visible to all warps after the barrier at the top of the tile loop
      q_loaded = true;
    }
    for (int it = 0; it < n_tiles; ++it) {
      if constexpr (STAGES == 2) {
        if (it + 1 < n_tiles) issue(it + 1);
        cp_async_commit();
        cp_async_wait_group<1>();
      } else {
        cp_async_wait_group<0>();
      }
      __syncthreads();
      const __nv_bfloat16* sK = sKbuf + (STAGES == 2 && !FP8 ? (it & 1) : 0) * kRows * stride;
      if constexpr (FP8 && STAGES == 2) {  // widen the landed fp8 tile into the bf16 buffer
        const uint8_t* raw = sRaw + (it & 1) * raw_stage;
        const int ch = a.kv_lora / 8;
        for (int i = tid; i < kRows * ch; i += THREADS) {
          const int r = i / ch, c = i % ch;
          const uint8_t* row = raw + r * row_bytes;
          const uint2 v = *reinterpret_cast<const uint2*>(row + c * 8);
          const float sc = reinterpret_cast<const float*>(row + a.kv_lora)[c * 8 / kFp8Group];
          *reinterpret_cast<uint4*>(sKbuf + r * stride + c * 8) = widen_fp8x8(v, sc);
        }
        const int rope_words = a.rope / 2;
        for (int i = tid; i < kRows * rope_words; i += THREADS) {
          const int r = i / rope_words, c = i % rope_words;
          *reinterpret_cast<uint32_t*>(sKbuf + r * stride + a.kv_lora + 2 * c) =
              reinterpret_cast<const uint32_t*>(raw + r * row_bytes + a.kv_lora + 4 * groups)[c];
        }
        __syncthreads();
      }
      const uint32_t* slots = sSlot + it * kRows;
      const int valid = min(kRows, chunk_rows - it * kRows);
      float* sS = reinterpret_cast<float*>(sRaw + (FP8 && STAGES == 2 ? (it & 1) * raw_stage : 0));

      // S = Q K^T over this warp's half of the dims: [16 heads][32 rows]
      float s[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      {
        const int mi = lane / 8, ri = lane % 8;
        // A: rows (mi % 2) * 8 + ri, columns (mi / 2) * 8; B ([row][dim] = [n][k]): rows (mi / 2) * 8 + ri
        // (+16 for the second pair of n-tiles), columns (mi % 2) * 8.
        const __nv_bfloat16* qa = sQ + (pair * 16 + (mi % 2) * 8 + ri) * stride + half * ksteps * 16 + (mi / 2) * 8;
        const __nv_bfloat16* kb = sK + ((mi / 2) * 8 + ri) * stride + half * ksteps * 16 + (mi % 2) * 8;
#pragma unroll(KS > 0 ? KS : 1)
        for (int ks = 0; ks < ksteps; ++ks) {
          score_kstep(s, qa + ks * 16, kb + ks * 16, kb + 16 * stride + ks * 16);
        }
      }
      float alpha[2];
      pair_softmax(s, sS, pair, half, lane, slots, valid, sl2, m, l, alpha);
      if (warp_rescales(alpha[0], alpha[1])) {
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          o[j][0] *= alpha[0];
          o[j][1] *= alpha[0];
          o[j][2] *= alpha[1];
          o[j][3] *= alpha[1];
        }
      }

      // O += P V over this warp's half of the output dims
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const uint32_t fa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                                pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
        const int mi = lane / 8, ri = lane % 8;
        const __nv_bfloat16* vrow = sK + (kk * 16 + (mi % 2) * 8 + ri) * stride + half * NV * 8 + (mi / 2) * 8;
#pragma unroll
        for (int j = 0; j < NV; j += 2) {
          uint32_t fb[4];
          ldmatrix_x4_trans(fb, vrow + j * 8);
          mma_16816(o[j], fa, fb, __nv_bfloat16());
          mma_16816(o[j + 1], fa, fb + 2, __nv_bfloat16());
        }
      }
      __syncthreads();  // this tile's buffers and S are free again
      if constexpr (STAGES == 1) {
        if (it + 1 < n_tiles) {
          issue(it + 1);
          cp_async_commit();
        }
      }
    }
  }

  pair_denominators(l);
  // Output: normalized when unsplit, else the split's unnormalized sum with its max and denominator.
  // Pairs of dims as one 8-byte store (kv_lora is even): a warp's store fills whole 32-byte sectors.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int h = h0 + pair * 16 + g + rr * 8;  // head of this row
    if (h >= a.heads) continue;
    if (geo.splits == 1) {
      const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
      float* dst = a.out + (int64_t(t) * a.heads + h) * a.kv_lora;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int c = half * NV * 8 + j * 8 + q4 * 2;
        if (c < a.kv_lora) *reinterpret_cast<float2*>(dst + c) = make_float2(o[j][2 * rr] * inv, o[j][2 * rr + 1] * inv);
      }
    } else {
      const int64_t row = (int64_t(t) * geo.splits + split) * a.heads + h;
      float* dst = part + row * (a.kv_lora + 2);
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int c = half * NV * 8 + j * 8 + q4 * 2;
        if (c < a.kv_lora) *reinterpret_cast<float2*>(dst + c) = make_float2(o[j][2 * rr], o[j][2 * rr + 1]);
      }
      if (half == 0 && q4 == 0) {
        dst[a.kv_lora] = m[rr];
        dst[a.kv_lora + 1] = l[rr];
      }
    }
  }
}

// Merges the splits of one (token, head): out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s.
// A block takes kCombineDims output dims of one (token, head): its first warp turns the splits'
// maxima and denominators (one load each per lane) into weights in shared memory, then every
// thread sums its dim over the splits with independent loads.
constexpr int kMaxSplits = 128;
constexpr int kCombineDims = 128;
__global__ void __launch_bounds__(kCombineDims) mla_combine_kernel(AttentionArgs a, int splits, const float* part) {
  __shared__ float s_w[kMaxSplits];
  const int t = blockIdx.z, h = blockIdx.y, tid = threadIdx.x;
  const int64_t stride = a.kv_lora + 2;
  const int64_t split_step = int64_t(a.heads) * stride;
  const float* p = part + (int64_t(t) * splits * a.heads + h) * stride;
  if (tid < 32) {
    constexpr int kPerLane = kMaxSplits / 32;
    float ms[kPerLane], ls[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int sp = tid + 32 * j;
      ms[j] = sp < splits ? p[sp * split_step + a.kv_lora] : -INFINITY;
      ls[j] = sp < splits ? p[sp * split_step + a.kv_lora + 1] : 0.0f;
    }
    float M = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) M = fmaxf(M, ms[j]);
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float L = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      ms[j] = ms[j] == -INFINITY ? 0.0f : exp2f(ms[j] - M);
      L += ms[j] * ls[j];
    }
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (tid + 32 * j < splits) s_w[tid + 32 * j] = ms[j] * inv;
  }
  __syncthreads();
  const int c = blockIdx.x * kCombineDims + tid;
  if (c >= a.kv_lora) return;
  float acc = 0.0f;
#pragma unroll 16
  for (int sp = 0; sp < splits; ++sp) acc += s_w[sp] * p[sp * split_step + c];
  a.out[(int64_t(t) * a.heads + h) * a.kv_lora + c] = acc;
}

// One block per (token, head): 128 rows at a time, one row per thread for the logits, then every
// thread accumulates its output dims over the chunk.
template <KvDtype DT>
__device__ __forceinline__ float latent_value(const AttentionArgs& a, const uint8_t* row, int c) {
  if constexpr (DT == KvDtype::F32) {
    return reinterpret_cast<const float*>(row)[c];
  } else if constexpr (DT == KvDtype::FP8) {
    if (c < a.kv_lora)
      return fp8_to_float(row[c]) * reinterpret_cast<const float*>(row + a.kv_lora)[c / kFp8Group];
    return __bfloat162float(
        reinterpret_cast<const __nv_bfloat16*>(row + a.kv_lora + 4 * latent_groups(a.kv_lora))[c - a.kv_lora]);
  } else {
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[c]);
  }
}

constexpr int kFmaThreads = 128, kFmaMaxOut = 8;  // kv_lora <= 1024

template <KvDtype DT>
__global__ void __launch_bounds__(kFmaThreads) mla_fma_kernel(AttentionArgs a) {
  __shared__ float sP[kFmaThreads];
  __shared__ int64_t sSlot[kFmaThreads];
  __shared__ float sRed[kFmaThreads / 32];
  const int t = blockIdx.y, h = blockIdx.x, tid = threadIdx.x, D = a.kv_lora + a.rope;
  const int seq = a.seq[t];
  const int n_rows = a.selected ? a.top_k : a.n_ctx[t];
  const float* q = a.q + (int64_t(t) * a.heads + h) * D;
  const uint8_t* base = static_cast<const uint8_t*>(a.latent.data);
  float acc[kFmaMaxOut] = {};
  float m = -INFINITY, l = 0.0f;
  for (int r0 = 0; r0 < n_rows; r0 += kFmaThreads) {
    const int64_t slot = row_slot(a, t, seq, r0 + tid, n_rows);
    float logit = -INFINITY;
    if (slot >= 0) {
      const uint8_t* row = base + slot * a.latent.row_bytes;
      float dot = 0.0f;
      for (int c = 0; c < D; ++c) dot += q[c] * latent_value<DT>(a, row, c);
      logit = dot * a.scale;
    }
    float mx = logit;
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (tid % 32 == 0) sRed[tid / 32] = mx;
    __syncthreads();
    mx = sRed[0];
    for (int w = 1; w < kFmaThreads / 32; ++w) mx = fmaxf(mx, sRed[w]);
    const float m_new = fmaxf(m, mx);
    const float alpha = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    const float p = logit == -INFINITY ? 0.0f : expf(logit - m_new);
    sP[tid] = p;
    sSlot[tid] = slot;
    __syncthreads();
    float sum = 0.0f;
    for (int j = 0; j < kFmaThreads; ++j) sum += sP[j];
    l = l * alpha + sum;
    m = m_new;
    for (int i = 0; i < kFmaMaxOut; ++i) {
      const int c = tid + i * kFmaThreads;
      if (c >= a.kv_lora) break;
      float v = acc[i] * alpha;
      for (int j = 0; j < kFmaThreads; ++j)
        if (sSlot[j] >= 0) v += sP[j] * latent_value<DT>(a, base + sSlot[j] * a.latent.row_bytes, c);
      acc[i] = v;
    }
    __syncthreads();
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  float* dst = a.out + (int64_t(t) * a.heads + h) * a.kv_lora;
  for (int i = 0; i < kFmaMaxOut; ++i) {
    const int c = tid + i * kFmaThreads;
    if (c < a.kv_lora) dst[c] = acc[i] * inv;
  }
}

template <int NV, bool FP8, int HG, int STAGES>
void launch_mma(const AttentionArgs& a, const Geometry& geo, float* part, cudaStream_t st) {
  const size_t smem = std::max(mla_smem::bytes(HG, STAGES, FP8, geo.stride, a.latent.row_bytes), geo.launch_smem);
  // GLM-5 / DeepSeek rows (512 + 64) get the k-loop unrolled: 18 k-steps of 16 per half of 288.
  auto kernel = NV == 32 && geo.d_pad == 576 ? mla_mma_kernel<NV, FP8, HG, STAGES, (NV == 32 ? 18 : 0)>
                                             : mla_mma_kernel<NV, FP8, HG, STAGES, 0>;
  allow_smem(kernel, smem);
  const dim3 grid(unsigned(ceil_div(a.heads, HG * 16)), unsigned(a.T), unsigned(geo.splits));
  kernel<<<grid, HG * 64, smem, st>>>(a, geo, part);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

template <int NV, bool FP8>
void launch_variant(const AttentionArgs& a, const Geometry& geo, float* part, cudaStream_t st) {
  if (geo.hg == 4) {
    if (geo.stages == 2) return launch_mma<NV, FP8, 4, 2>(a, geo, part, st);
    return launch_mma<NV, FP8, 4, 1>(a, geo, part, st);
  }
  if (geo.hg == 2) {
    if (geo.stages == 2) return launch_mma<NV, FP8, 2, 2>(a, geo, part, st);
    return launch_mma<NV, FP8, 2, 1>(a, geo, part, st);
  }
  // 16 heads: two stages (also within 99 KB), or one where a device has less (none known; the tests
  // emulate one).
  if (geo.stages == 2) return launch_mma<NV, FP8, 1, 2>(a, geo, part, st);
  return launch_mma<NV, FP8, 1, 1>(a, geo, part, st);
}

template <bool FP8>
void dispatch_mma(const AttentionArgs& a, const Geometry& geo, float* part, cudaStream_t st) {
  switch (nv_tiles(a.kv_lora)) {
    case 2: return launch_variant<2, FP8>(a, geo, part, st);
    case 4: return launch_variant<4, FP8>(a, geo, part, st);
    case 8: return launch_variant<8, FP8>(a, geo, part, st);
    case 16: return launch_variant<16, FP8>(a, geo, part, st);
    case 32: return launch_variant<32, FP8>(a, geo, part, st);
    default: fail("sparse_mla: the mma kernel takes kv_lora <= 512, got {}", a.kv_lora);
  }
}

// The shared memory to ask for so that this device holds as many blocks of `bytes` per SM as one
// with `per_sm` bytes per SM would (both reserve 1 KB per block).
size_t emulated_smem(int per_sm, size_t bytes) {
  int dev = 0, here = 0, optin = 0, reserved = 0;
  SPARSEMLA_CUDA_CHECK(cudaGetDevice(&dev));
  SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&here, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
  const size_t blocks = std::max<size_t>(1, size_t(per_sm) / (bytes + size_t(reserved)));
  return std::min(size_t(here) / blocks - size_t(reserved), size_t(optin));
}

}  // namespace

// The Hopper kernel and its launch (sparse_mla_sm90.cu): splits of rows_per_split rows each, blocks
// in pairs where `pairs` and the rows and heads allow; returns the blocks per cluster launched.
int sparse_mla_wgmma(const AttentionArgs& a, int splits, int rows_per_split, float* part, bool pairs, Stream s);
// The fp8-row kernel (sparse_mla_fp8.cu): whether it takes these rows (fp8, latent 512 + rope 64),
// and its launch (geo.hg 1, 2 or 4; geo.stages 2 or 3).
bool mla_fp8_rows_take(const AttentionArgs& a);
void mla_fp8_rows(const AttentionArgs& a, const MlaGeometry& geo, float* part, cudaStream_t st);

void sparse_mla(const AttentionArgs& a, AttentionKernel k, AttentionWorkspace& ws, Stream s, int splits,
                int heads_per_block) {
  ws.last_cluster = 0;
  ws.last = {};
  if (a.T == 0) return;
  auto st = static_cast<cudaStream_t>(s);
  const bool fp8 = a.dtype == KvDtype::FP8;
  if (k == AttentionKernel::Fma) {
    if (a.kv_lora > kFmaThreads * kFmaMaxOut) fail("sparse_mla: kv_lora {} > {}", a.kv_lora, kFmaThreads * kFmaMaxOut);
    const dim3 grid(unsigned(a.heads), unsigned(a.T));
    if (fp8) mla_fma_kernel<KvDtype::FP8><<<grid, kFmaThreads, 0, st>>>(a);
    else if (a.dtype == KvDtype::F32) mla_fma_kernel<KvDtype::F32><<<grid, kFmaThreads, 0, st>>>(a);
    else mla_fma_kernel<KvDtype::BF16><<<grid, kFmaThreads, 0, st>>>(a);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
    ws.last = {"fma", 1, 0, 1};
    return;
  }
  if (a.dtype == KvDtype::F32) fail("sparse_mla: the mma kernel takes bf16 or fp8 latent rows, not f32");
  // The Hopper kernel loses to the generic one on a few tokens over a bf16 cache (H200, batch 1:
  // 21.1 vs 14.0 us GLM-5, 22.4 vs 20.2 DeepSeek-V3.2; even with fp8): the selector cannot see the
  // batch, so the launch decides. Forced split counts (tests) keep the kernel asked for.
  if (k == AttentionKernel::Wgmma && a.dtype == KvDtype::BF16 && a.T < 8 && splits <= 0 && heads_per_block == 0)
    k = AttentionKernel::Mma;
  if ((a.kv_lora + a.rope) % 8 != 0 || a.kv_lora % 8 != 0 || a.rope % 2 != 0)
    fail("sparse_mla: the mma kernel needs kv_lora and kv_lora + rope multiples of 8 (got {} + {})", a.kv_lora, a.rope);
  Geometry geo;
  geo.d = a.kv_lora + a.rope;
  geo.d_pad = (geo.d + 31) / 32 * 32;
  geo.stride = mla_smem::stride(a.kv_lora, a.rope);
  if (ws.sm_count == 0) {
    int dev = 0;
    SPARSEMLA_CUDA_CHECK(cudaGetDevice(&dev));
    SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&ws.sm_count, cudaDevAttrMultiProcessorCount, dev));
    SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&ws.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  }
  if (ws.device_smem_per_sm == 0) {
    int dev = 0;
    SPARSEMLA_CUDA_CHECK(cudaGetDevice(&dev));
    SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&ws.device_smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  }
  const int per_sm = ws.smem_per_sm > 0 ? ws.smem_per_sm : ws.device_smem_per_sm;
  // Heads per block: 64 where there are that many (each gathered row serves more heads), fewer when
  // the blocks of a small batch, even split as finely as the rows allow, would leave SMs idle.
  // Two stages (the next tile loads while this one is computed) where shared memory allows.
  // (SPARSEMLA_MLA_SELECTED_FRONT=0: every selection split over all top_k entries, for A/B.)
  static const bool front_off = env_off("SPARSEMLA_MLA_SELECTED_FRONT");
  const int64_t rows = !a.selected                       ? a.max_ctx
                       : a.selected_front && !front_off ? std::min<int64_t>(a.top_k, a.max_ctx)
                                                        : a.top_k;
  const int tiles = std::max(1, ceil_div(rows, kRows));
  if (heads_per_block != 0 && heads_per_block != 16 && heads_per_block != 32 && heads_per_block != 64)
    fail("sparse_mla: heads_per_block must be 16, 32 or 64, got {}", heads_per_block);
  // A split takes at least two tiles (the second loads while the first is computed; finer splits
  // cost more in partial sums written and merged than they gain).
  const int max_splits = std::min(kMaxSplits, std::max(1, tiles / 2));
  if (k == AttentionKernel::Wgmma) {  // 64 heads per block, one block per SM: split to cover the SMs once
    heads_per_block = 64;
    if (splits <= 0)
      splits = int(std::clamp<int64_t>(ws.sm_count / (int64_t(ceil_div(a.heads, 64)) * a.T), 1, max_splits));
  }
  if (heads_per_block > 0) {
    geo.hg = heads_per_block / 16;
  } else {
    geo.hg = a.heads > 32 ? 4 : 2;
    // Fewer heads per block until the blocks come near one per SM (most of a wave is as good as all).
    while (geo.hg > 1 && int64_t(ceil_div(a.heads, geo.hg * 16)) * a.T * max_splits < ws.sm_count * 3 / 4) geo.hg /= 2;
  }
  // fp8 rows of 512 + 64 go to the kernel that reads them as stored (sparse_mla_fp8.cu), unless
  // SPARSEMLA_MLA_FP8_ROWS=0 (A/B), or for small batches where the bf16-tile kernel keeps two stages
  // at these heads. Where an SM holds two of its blocks of 32 heads and two stages (H200, B200: 8
  // warps per SM) it takes that shape (H200, batch 8 / 128: GLM-5 51 / 297 us vs 60 / 419 for the
  // bf16-tile kernel; 86 / 404 with 64 heads and three stages, one block per SM), from 8 tokens
  // (batch 1: DeepSeek-V3.2 28.7 vs 22.8). Else the most heads and stages that fit, from 64 tokens
  // where the bf16-tile kernel has two stages (A100: batch 8 87 vs 62 us, 64 even, 128 413 vs 423,
  // DeepSeek-V3.2 597 vs 688), at every batch where it has not (99 KB devices beyond 16 heads per
  // block: GLM-5 batch 128 427 vs 1918 us with one block per SM; at 16, as GLM-5 batch 1, both tie). Forced shapes (tests) keep it.
  static const bool fp8_rows_off = env_off("SPARSEMLA_MLA_FP8_ROWS");
  const bool forced = splits > 0 || heads_per_block > 0;
  const bool two_per_sm = mla_smem::fp8_rows_two_per_sm(uint64_t(per_sm));
  bool fp8_rows = k == AttentionKernel::Mma && mla_fp8_rows_take(a) && !fp8_rows_off &&
                  mla_smem::fp8_rows_bytes(1, 2) <= size_t(ws.smem_optin);
  if (fp8_rows && a.T < (two_per_sm ? 8 : 64) && !forced &&
      mla_smem::bytes(geo.hg, 2, true, geo.stride, a.latent.row_bytes) <= size_t(ws.smem_optin))
    fp8_rows = false;
  auto bytes_of = [&](int hg, int stages) {
    return fp8_rows ? mla_smem::fp8_rows_bytes(hg, stages)
                    : mla_smem::bytes(hg, stages, fp8, geo.stride, a.latent.row_bytes);
  };
  int max_stages = fp8_rows ? 3 : 2;
  const int min_stages = fp8_rows ? 2 : 1;
  if (fp8_rows && heads_per_block == 0 && two_per_sm) {
    geo.hg = std::min(geo.hg, 2);
    max_stages = 2;
  }
  const mla_smem::Fit fit = mla_smem::fit(geo.hg, max_stages, min_stages, uint64_t(ws.smem_optin), bytes_of);
  if (fit.hg == 0)
    fail("sparse_mla: the mma kernel needs {} bytes of shared memory, the device allows {}", bytes_of(1, min_stages),
         ws.smem_optin);
  geo.hg = fit.hg;
  geo.stages = fit.stages;
  geo.raw_stage = int(mla_smem::fp8_stage_bytes(geo.hg, a.latent.row_bytes));
  geo.score_bytes = int(mla_smem::score_bytes(geo.hg));
  if (ws.smem_per_sm > 0) geo.launch_smem = emulated_smem(ws.smem_per_sm, bytes_of(geo.hg, geo.stages));
  if (splits <= 0) {
    const int64_t blocks = int64_t(ceil_div(a.heads, geo.hg * 16)) * a.T;
    splits = blocks >= ws.sm_count ? 1 : int(std::min<int64_t>((2 * ws.sm_count + blocks - 1) / blocks, max_splits));
    splits = std::max(1, splits);
  }
  splits = std::min({splits, tiles, kMaxSplits});
  geo.tiles_per_split = ceil_div(tiles, splits);
  geo.splits = ceil_div(tiles, geo.tiles_per_split);
  float* part = nullptr;
  if (geo.splits > 1) {
    const size_t need = size_t(a.T) * geo.splits * a.heads * (a.kv_lora + 2) * sizeof(float);
    if (ws.partial.bytes() < need) ws.partial = DeviceBuffer(need);
    part = ws.partial.as<float>();
  }
  static const bool pairs_off = env_off("SPARSEMLA_MLA_PAIRS");
  ws.last = {k == AttentionKernel::Wgmma ? "wgmma" : fp8_rows ? "mma fp8 rows" : "mma", geo.hg * 16,
             k == AttentionKernel::Wgmma ? 2 : geo.stages, geo.splits};
  if (k == AttentionKernel::Wgmma)
    ws.last_cluster = sparse_mla_wgmma(a, geo.splits, geo.tiles_per_split * kRows, part, ws.pairs && !pairs_off, st);
  else if (fp8_rows) mla_fp8_rows(a, geo, part, st);
  else if (fp8) dispatch_mma<true>(a, geo, part, st);
  else dispatch_mma<false>(a, geo, part, st);
  if (geo.splits > 1) {
    const dim3 grid(unsigned(ceil_div(a.kv_lora, kCombineDims)), unsigned(a.heads), unsigned(a.T));
    mla_combine_kernel<<<grid, kCombineDims, 0, st>>>(a, geo.splits, part);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace sparsemla::cuda
