// Sparse MLA attention over latent rows gathered from the paged cache (FlashAttention-style online
// softmax, output in latent space). The same kernels run dense attention when no selection is given.
//
// Mma kernel: a block takes one token and 32 heads; warps 2g and 2g+1 share heads 16g..16g+15.
// Each tile of 32 rows is gathered into shared memory (cp.async for bf16; fp8 rows are widened to
// bf16 with their group scales); the two warps of a pair each compute half of q . row over the
// 576 dims, add the halves through shared memory, and then each accumulates half of the 512 output
// dims (P in bf16 on the tensor cores, fp32 accumulators). Long selections are split over blocks
// (split-KV) and merged by a second kernel. Shared memory: 2 * 32 * (D + 8) * 2 + 8.4 KB = 82 KB for
// D = 576, inside SM12x's 99 KB.
// Fma kernel: one block per token and head, any shape; the reference the selector falls back to.
#include <algorithm>
#include <cmath>

#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/mma.cuh"

namespace sparsemla::cuda {
namespace {

constexpr int kHeads = 32;  // heads per block
constexpr int kRows = 32;   // latent rows per tile
constexpr int kSStride = 33;
constexpr float kLog2e = 1.4426950408889634f;

struct Geometry {
  int d;         // kv_lora + rope
  int d_pad;     // d rounded up to 32 (two halves of whole k-steps)
  int stride;    // smem row stride in bf16 values
  int splits;
  int tiles_per_split;
};

__host__ __device__ inline int latent_groups(int kv_lora) { return (kv_lora + kFp8Group - 1) / kFp8Group; }

// Position index -> slot, or -1 for an unused entry.
__device__ __forceinline__ int64_t row_slot(const AttentionArgs& a, int t, int seq, int idx, int n_rows) {
  if (idx >= n_rows) return -1;
  const int pos = a.selected ? a.selected[int64_t(t) * a.top_k + idx] : idx;
  if (pos < 0) return -1;
  return slot_of(a.latent.block_tables, a.latent.max_blocks, a.latent.block_size, seq, pos);
}

template <int NV, bool FP8>
__global__ void __launch_bounds__(128) mla_mma_kernel(AttentionArgs a, Geometry geo, float* part) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int stride = geo.stride, D = geo.d;
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem);  // [32][stride]
  __nv_bfloat16* sK = sQ + kHeads * stride;                     // [32][stride]
  float* sS = reinterpret_cast<float*>(sK + kRows * stride);     // [2 pairs][2 halves][16][33]
  int64_t* sSlot = reinterpret_cast<int64_t*>(sS + 4 * 16 * kSStride);  // [32]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q4 = lane % 4;
  const int pair = warp / 2, half = warp % 2;
  const int t = blockIdx.y, h0 = blockIdx.x * kHeads, split = blockIdx.z;
  const int seq = a.seq[t];
  const int n_rows = a.selected ? a.top_k : a.n_ctx[t];
  const int r_begin = split * geo.tiles_per_split * kRows;
  const int r_end = min(n_rows, r_begin + geo.tiles_per_split * kRows);

  const float* q = a.q + int64_t(t) * a.heads * D;
  for (int i = tid; i < kHeads * stride; i += blockDim.x) {
    const int r = i / stride, c = i % stride, h = h0 + r;
    sQ[i] = __float2bfloat16(h < a.heads && c < D ? q[int64_t(h) * D + c] : 0.0f);
    sK[i] = __float2bfloat16(0.0f);  // pad columns stay zero; rows are rewritten per tile
  }

  float o[NV][4];
#pragma unroll
  for (int j = 0; j < NV; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const float sl2 = a.scale * kLog2e;
  const int ksteps = geo.d_pad / 32;  // k-steps of 16 in each half

  for (int r0 = r_begin; r0 < r_end; r0 += kRows) {
    __syncthreads();  // the previous tile is no longer read
    if (tid < kRows) sSlot[tid] = r0 + tid < r_end ? row_slot(a, t, seq, r0 + tid, n_rows) : -1;
    __syncthreads();
    const uint8_t* base = static_cast<const uint8_t*>(a.latent.data);
    if constexpr (!FP8) {
      const int ch = D / 8;
      for (int i = tid; i < kRows * ch; i += blockDim.x) {
        const int r = i / ch, c = i % ch;
        const int64_t slot = sSlot[r];
        __nv_bfloat16* dst = sK + r * stride + c * 8;
        if (slot >= 0) cp_async16(dst, base + slot * a.latent.row_bytes + c * 16);
        else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      }
      cp_async_wait_all();
    } else {
      const int ch = a.kv_lora / 8, groups = latent_groups(a.kv_lora);
      for (int i = tid; i < kRows * ch; i += blockDim.x) {
        const int r = i / ch, c = i % ch;
        const int64_t slot = sSlot[r];
        __nv_bfloat16* dst = sK + r * stride + c * 8;
        if (slot < 0) {
          *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
          continue;
        }
        const uint8_t* row = base + slot * a.latent.row_bytes;
        const uint2 v = *reinterpret_cast<const uint2*>(row + c * 8);
        const float sc = reinterpret_cast<const float*>(row + a.kv_lora)[c * 8 / kFp8Group];
        uint32_t w[4];
        for (int j = 0; j < 4; ++j) {
          const uint32_t word = j < 2 ? v.x : v.y;
          const int sh = (j % 2) * 16;
          w[j] = pack_bf16(fp8_to_float(uint8_t(word >> sh)) * sc, fp8_to_float(uint8_t(word >> (sh + 8))) * sc);
        }
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      }
      const int rope_words = a.rope / 2;
      for (int i = tid; i < kRows * rope_words; i += blockDim.x) {
        const int r = i / rope_words, c = i % rope_words;
        const int64_t slot = sSlot[r];
        uint32_t v = 0;
        if (slot >= 0) v = reinterpret_cast<const uint32_t*>(base + slot * a.latent.row_bytes + a.kv_lora + 4 * groups)[c];
        *reinterpret_cast<uint32_t*>(sK + r * stride + a.kv_lora + 2 * c) = v;
      }
    }
    __syncthreads();

    // S = Q K^T over this warp's half of the dims: [16 heads][32 rows]
    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    for (int ks = 0; ks < ksteps; ++ks) {
      const int k0 = (half * ksteps + ks) * 16;
      const __nv_bfloat16* qa = sQ + (pair * 16 + g) * stride + k0 + q4 * 2;
      const uint32_t fa[4] = {smem_u32(qa), smem_u32(qa + 8 * stride), smem_u32(qa + 8), smem_u32(qa + 8 * stride + 8)};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const __nv_bfloat16* kb = sK + (nt * 8 + g) * stride + k0 + q4 * 2;
        const uint32_t fb[2] = {smem_u32(kb), smem_u32(kb + 8)};
        mma_16816(s[nt], fa, fb, __nv_bfloat16());
      }
    }
    float* mine = sS + (pair * 2 + half) * 16 * kSStride;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int c = nt * 8 + q4 * 2;
      mine[g * kSStride + c] = s[nt][0];
      mine[g * kSStride + c + 1] = s[nt][1];
      mine[(g + 8) * kSStride + c] = s[nt][2];
      mine[(g + 8) * kSStride + c + 1] = s[nt][3];
    }
    __syncthreads();
    const float* s0 = sS + (pair * 2) * 16 * kSStride;
    const float* s1 = s0 + 16 * kSStride;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = g + (e >= 2 ? 8 : 0), c = nt * 8 + q4 * 2 + (e & 1);
        s[nt][e] = sSlot[c] >= 0 ? (s0[r * kSStride + c] + s1[r * kSStride + c]) * sl2 : -INFINITY;
      }

    // online softmax on rows g (e = 0, 1) and g + 8 (e = 2, 3)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * rr], s[nt][2 * rr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[rr], mx);
      const bool empty = m_new == -INFINITY;
      const float alpha = empty ? 1.0f : exp2f(m[rr] - m_new);
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 2 * rr; e < 2 * rr + 2; ++e) {
          const float p = empty ? 0.0f : exp2f(s[nt][e] - m_new);
          s[nt][e] = p;
          sum += p;
        }
      l[rr] = l[rr] * alpha + sum;
      m[rr] = m_new;
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        o[j][2 * rr] *= alpha;
        o[j][2 * rr + 1] *= alpha;
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
  }

#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
  }
  // Output: normalized when unsplit, else the split's unnormalized sum with its max and denominator.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int h = h0 + pair * 16 + g + rr * 8;
    if (h >= a.heads) continue;
    if (geo.splits == 1) {
      const float inv = l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f;
      float* dst = a.out + (int64_t(t) * a.heads + h) * a.kv_lora;
#pragma unroll
      for (int j = 0; j < NV; ++j)
        for (int e = 0; e < 2; ++e) {
          const int c = half * NV * 8 + j * 8 + q4 * 2 + e;
          if (c < a.kv_lora) dst[c] = o[j][2 * rr + e] * inv;
        }
    } else {
      const int64_t row = (int64_t(t) * geo.splits + split) * a.heads + h;
      float* dst = part + row * (a.kv_lora + 2);
#pragma unroll
      for (int j = 0; j < NV; ++j)
        for (int e = 0; e < 2; ++e) {
          const int c = half * NV * 8 + j * 8 + q4 * 2 + e;
          if (c < a.kv_lora) dst[c] = o[j][2 * rr + e];
        }
      if (half == 0 && q4 == 0) {
        dst[a.kv_lora] = m[rr];
        dst[a.kv_lora + 1] = l[rr];
      }
    }
  }
}

// Merges the splits of one (token, head): out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s.
__global__ void mla_combine_kernel(AttentionArgs a, int splits, const float* part) {
  const int t = blockIdx.y, h = blockIdx.x;
  const int64_t stride = a.kv_lora + 2;
  const float* p = part + (int64_t(t) * splits * a.heads + h) * stride;
  const int64_t split_step = int64_t(a.heads) * stride;
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, p[s * split_step + a.kv_lora]);
  float L = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float ms = p[s * split_step + a.kv_lora];
    if (ms != -INFINITY) L += exp2f(ms - M) * p[s * split_step + a.kv_lora + 1];
  }
  const float inv = L > 0.0f ? 1.0f / L : 0.0f;
  float* dst = a.out + (int64_t(t) * a.heads + h) * a.kv_lora;
  for (int c = threadIdx.x; c < a.kv_lora; c += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float ms = p[s * split_step + a.kv_lora];
      if (ms != -INFINITY) acc += exp2f(ms - M) * p[s * split_step + c];
    }
    dst[c] = acc * inv;
  }
}

// One block per (token, head): 128 rows at a time, one row per thread for the logits, then every
// thread accumulates its output dims over the chunk.
template <bool FP8>
__device__ __forceinline__ float latent_value(const AttentionArgs& a, const uint8_t* row, int c) {
  if constexpr (FP8) {
    if (c < a.kv_lora)
      return fp8_to_float(row[c]) * reinterpret_cast<const float*>(row + a.kv_lora)[c / kFp8Group];
    return __bfloat162float(
        reinterpret_cast<const __nv_bfloat16*>(row + a.kv_lora + 4 * latent_groups(a.kv_lora))[c - a.kv_lora]);
  } else {
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[c]);
  }
}

constexpr int kFmaThreads = 128, kFmaMaxOut = 8;  // kv_lora <= 1024

template <bool FP8>
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
      for (int c = 0; c < D; ++c) dot += q[c] * latent_value<FP8>(a, row, c);
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
        if (sSlot[j] >= 0) v += sP[j] * latent_value<FP8>(a, base + sSlot[j] * a.latent.row_bytes, c);
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

// Output tiles of 8 dims per warp half: the smallest even count covering kv_lora / 2.
int nv_tiles(int kv_lora) {
  int nv = 2;
  while (nv * 16 < kv_lora) nv *= 2;
  return nv;
}

template <int NV, bool FP8>
void launch_mma(const AttentionArgs& a, const Geometry& geo, float* part, cudaStream_t st) {
  const size_t smem = size_t(kHeads + kRows) * geo.stride * 2 + 4 * 16 * kSStride * 4 + kRows * 8;
  auto kernel = mla_mma_kernel<NV, FP8>;
  SPARSEMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned(ceil_div(a.heads, kHeads)), unsigned(a.T), unsigned(geo.splits));
  kernel<<<grid, 128, smem, st>>>(a, geo, part);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

template <bool FP8>
void dispatch_mma(const AttentionArgs& a, const Geometry& geo, float* part, cudaStream_t st) {
  switch (nv_tiles(a.kv_lora)) {
    case 2: return launch_mma<2, FP8>(a, geo, part, st);
    case 4: return launch_mma<4, FP8>(a, geo, part, st);
    case 8: return launch_mma<8, FP8>(a, geo, part, st);
    case 16: return launch_mma<16, FP8>(a, geo, part, st);
    case 32: return launch_mma<32, FP8>(a, geo, part, st);
    default: fail("sparse_mla: the mma kernel takes kv_lora <= 512, got {}", a.kv_lora);
  }
}

}  // namespace

size_t attention_mma_smem_bytes(int kv_lora, int rope) {
  const int d_pad = (kv_lora + rope + 31) / 32 * 32;
  const int stride = std::max(d_pad, nv_tiles(kv_lora) * 16) + 8;
  return size_t(kHeads + kRows) * stride * 2 + 4 * 16 * kSStride * 4 + kRows * 8;
}

void sparse_mla(const AttentionArgs& a, AttentionKernel k, AttentionWorkspace& ws, Stream s, int splits) {
  if (a.T == 0) return;
  auto st = static_cast<cudaStream_t>(s);
  const bool fp8 = a.dtype == KvDtype::FP8;
  if (k == AttentionKernel::Fma) {
    if (a.kv_lora > kFmaThreads * kFmaMaxOut) fail("sparse_mla: kv_lora {} > {}", a.kv_lora, kFmaThreads * kFmaMaxOut);
    const dim3 grid(unsigned(a.heads), unsigned(a.T));
    if (fp8) mla_fma_kernel<true><<<grid, kFmaThreads, 0, st>>>(a);
    else mla_fma_kernel<false><<<grid, kFmaThreads, 0, st>>>(a);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
    return;
  }
  if ((a.kv_lora + a.rope) % 8 != 0 || a.kv_lora % 8 != 0 || a.rope % 2 != 0)
    fail("sparse_mla: the mma kernel needs kv_lora and kv_lora + rope multiples of 8 (got {} + {})", a.kv_lora, a.rope);
  Geometry geo;
  geo.d = a.kv_lora + a.rope;
  geo.d_pad = (geo.d + 31) / 32 * 32;
  geo.stride = std::max(geo.d_pad, nv_tiles(a.kv_lora) * 16) + 8;
  const int64_t rows = a.selected ? a.top_k : a.max_ctx;
  const int tiles = std::max(1, ceil_div(rows, kRows));
  if (splits <= 0) {
    if (ws.sm_count == 0) {
      int dev = 0;
      SPARSEMLA_CUDA_CHECK(cudaGetDevice(&dev));
      SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&ws.sm_count, cudaDevAttrMultiProcessorCount, dev));
    }
    const int64_t blocks = int64_t(ceil_div(a.heads, kHeads)) * a.T;
    splits = blocks >= ws.sm_count ? 1 : int(std::min<int64_t>((2 * ws.sm_count + blocks - 1) / blocks, (tiles + 1) / 2));
    splits = std::max(1, std::min(splits, 64));
  }
  splits = std::min(splits, tiles);
  geo.tiles_per_split = ceil_div(tiles, splits);
  geo.splits = ceil_div(tiles, geo.tiles_per_split);
  float* part = nullptr;
  if (geo.splits > 1) {
    const size_t need = size_t(a.T) * geo.splits * a.heads * (a.kv_lora + 2) * sizeof(float);
    if (ws.partial.bytes() < need) ws.partial = DeviceBuffer(need);
    part = ws.partial.as<float>();
  }
  if (fp8) dispatch_mma<true>(a, geo, part, st);
  else dispatch_mma<false>(a, geo, part, st);
  if (geo.splits > 1) {
    mla_combine_kernel<<<dim3(unsigned(a.heads), unsigned(a.T)), 128, 0, st>>>(a, geo.splits, part);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace sparsemla::cuda
