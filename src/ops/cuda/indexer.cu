// The DSA lightning indexer: every visible key of a token's sequence scored by a few cheap heads,
//   score[t][p] = sum_h w[t][h] * relu(q[t][h] . k[p]).
// Mma: tensor cores (mma.sync m16n8k16: bf16 keys, or fp8 keys widened exactly to fp16), 64 keys per
// block, 16 per warp, all heads of the token against them. Fma: one warp per key, any shape.
#include <algorithm>

#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/mma.cuh"

namespace sparsemla::cuda {
namespace {

constexpr int kKeysPerTile = 64;  // keys in shared memory at a time (16 per warp)
constexpr int kTilesPerBlock = 4;  // tiles per block: the queries are staged once for 256 keys

// Value c of a key row stored as `D` (KvDtype).
template <KvDtype D>
__device__ __forceinline__ float key_value(const uint8_t* row, int c, int dim) {
  if constexpr (D == KvDtype::FP8) {
    const float* scales = reinterpret_cast<const float*>(row + dim);
    return fp8_to_float(row[c]) * scales[c / kFp8Group];
  } else if constexpr (D == KvDtype::F32) {
    return reinterpret_cast<const float*>(row)[c];
  } else {
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[c]);
  }
}

template <int DIM, bool FP8>
__global__ void __launch_bounds__(128) indexer_mma_kernel(IndexerArgs a) {
  using T16 = typename std::conditional<FP8, __half, __nv_bfloat16>::type;
  constexpr int STR = DIM + 8;  // row stride in smem (16-byte aligned, staggers banks)
  constexpr int KSTEPS = DIM / 16;
  extern __shared__ __align__(16) unsigned char smem[];
  const int heads_pad = (a.heads + 7) / 8 * 8;
  T16* sQ = reinterpret_cast<T16*>(smem);              // [heads_pad][STR]
  T16* sK = sQ + heads_pad * STR;                      // [64][STR]
  float* sW = reinterpret_cast<float*>(sK + kKeysPerTile * STR);  // [heads_pad]
  float* sScale = sW + heads_pad;                       // [64]
  uint8_t* sRaw = reinterpret_cast<uint8_t*>(sScale + kKeysPerTile);  // fp8 keys as stored: [64][row_bytes]

  const int t = blockIdx.y, tid = threadIdx.x;
  const int n = a.n_ctx[t];
  const int block_p0 = blockIdx.x * kKeysPerTile * kTilesPerBlock;
  if (block_p0 >= n) return;
  const int seq = a.seq[t];

  // queries and head weights of token t
  const float* q = a.q + int64_t(t) * a.heads * DIM;
  for (int i = tid; i < heads_pad * DIM / 4; i += blockDim.x) {
    const int h = i / (DIM / 4), c = (i % (DIM / 4)) * 4;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (h < a.heads) v = *reinterpret_cast<const float4*>(q + h * DIM + c);
    T16* dst = sQ + h * STR + c;
    dst[0] = to16<T16>(v.x);
    dst[1] = to16<T16>(v.y);
    dst[2] = to16<T16>(v.z);
    dst[3] = to16<T16>(v.w);
  }
  for (int h = tid; h < heads_pad; h += blockDim.x) sW[h] = h < a.heads ? a.w[int64_t(t) * a.heads + h] : 0.0f;

  const int warp = tid / 32, lane = tid % 32, g = lane / 4, q4 = lane % 4;
  const int r0 = warp * 16;
  for (int tile = 0; tile < kTilesPerBlock; ++tile) {
    const int p0 = block_p0 + tile * kKeysPerTile;
    if (p0 >= n) break;  // uniform over the block
    if (tile > 0) __syncthreads();  // the previous tile's keys are no longer read
    if constexpr (!FP8) {
      constexpr int CH = DIM / 8;  // 16-byte chunks per row
      for (int i = tid; i < kKeysPerTile * CH; i += blockDim.x) {
        const int r = i / CH, c = i % CH, p = p0 + r;
        T16* dst = sK + r * STR + c * 8;
        if (p < n) {
          const int64_t slot = slot_of(a.keys.block_tables, a.keys.max_blocks, a.keys.block_size, seq, p);
          cp_async16(dst, static_cast<const uint8_t*>(a.keys.data) + slot * a.keys.row_bytes + c * 16);
        } else {
          *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
        }
      }
      cp_async_wait_all();
    } else {
      // Raw rows (dim e4m3 + scale, 4-byte aligned) land by cp.async, then are widened in place:
      // e4m3 values are exact in fp16; the per-key scale is applied to the dot products.
      const int RB = int(a.keys.row_bytes);  // a multiple of 4
      const int CH = RB / 4;
      for (int i = tid; i < kKeysPerTile * CH; i += blockDim.x) {
        const int r = i / CH, c = i % CH, p = p0 + r;
        uint8_t* dst = sRaw + r * RB + c * 4;
        if (p < n) {
          const int64_t slot = slot_of(a.keys.block_tables, a.keys.max_blocks, a.keys.block_size, seq, p);
          cp_async4(dst, static_cast<const uint8_t*>(a.keys.data) + slot * a.keys.row_bytes + c * 4);
        } else {
          *reinterpret_cast<uint32_t*>(dst) = 0;
        }
      }
      cp_async_wait_all();
      __syncthreads();
      constexpr int WCH = DIM / 4;
      for (int i = tid; i < kKeysPerTile * WCH; i += blockDim.x) {
        const int r = i / WCH, c = i % WCH;
        const uint32_t v = *reinterpret_cast<const uint32_t*>(sRaw + r * RB + c * 4);
        const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(v & 0xffffu), __NV_E4M3);
        const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(v >> 16), __NV_E4M3);
        *reinterpret_cast<uint2*>(sK + r * STR + c * 4) =
            make_uint2(uint32_t(lo.x) | (uint32_t(lo.y) << 16), uint32_t(hi.x) | (uint32_t(hi.y) << 16));
      }
      for (int r = tid; r < kKeysPerTile; r += blockDim.x) sScale[r] = *reinterpret_cast<const float*>(sRaw + r * RB + DIM);
    }
    __syncthreads();
    if (p0 + r0 >= n) continue;
    uint32_t fa[KSTEPS][4];
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const T16* k0 = sK + (r0 + g) * STR + ks * 16 + q4 * 2;
      fa[ks][0] = smem_u32(k0);
      fa[ks][1] = smem_u32(k0 + 8 * STR);
      fa[ks][2] = smem_u32(k0 + 8);
      fa[ks][3] = smem_u32(k0 + 8 * STR + 8);
    }
    float acc_lo = 0.0f, acc_hi = 0.0f;  // keys r0+g and r0+g+8, this lane's heads
    for (int nt = 0; nt < heads_pad / 8; ++nt) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks) {
        const T16* qp = sQ + (nt * 8 + g) * STR + ks * 16 + q4 * 2;
        const uint32_t b[2] = {smem_u32(qp), smem_u32(qp + 8)};
        mma_16816(c, fa[ks], b, T16());
      }
      const float w0 = sW[nt * 8 + q4 * 2], w1 = sW[nt * 8 + q4 * 2 + 1];
      acc_lo += w0 * fmaxf(c[0], 0.0f) + w1 * fmaxf(c[1], 0.0f);
      acc_hi += w0 * fmaxf(c[2], 0.0f) + w1 * fmaxf(c[3], 0.0f);
    }
    acc_lo += __shfl_xor_sync(0xffffffffu, acc_lo, 1);
    acc_lo += __shfl_xor_sync(0xffffffffu, acc_lo, 2);
    acc_hi += __shfl_xor_sync(0xffffffffu, acc_hi, 1);
    acc_hi += __shfl_xor_sync(0xffffffffu, acc_hi, 2);
    if (q4 == 0) {
      float* out = a.scores + int64_t(t) * a.score_stride;
      const int pa = p0 + r0 + g, pb = pa + 8;
      if (FP8) {
        acc_lo *= sScale[r0 + g];
        acc_hi *= sScale[r0 + g + 8];
      }
      if (pa < n) out[pa] = acc_lo;
      if (pb < n) out[pb] = acc_hi;
    }
  }
}

// One warp per key: any head count and dimension, any key format.
template <KvDtype D>
__global__ void indexer_fma_kernel(IndexerArgs a) {
  const int t = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int p = blockIdx.x * (blockDim.x / 32) + warp;
  if (p >= a.n_ctx[t]) return;
  const int64_t slot = slot_of(a.keys.block_tables, a.keys.max_blocks, a.keys.block_size, a.seq[t], p);
  const uint8_t* row = static_cast<const uint8_t*>(a.keys.data) + slot * a.keys.row_bytes;
  const float* q = a.q + int64_t(t) * a.heads * a.dim;
  float score = 0.0f;
  for (int h = 0; h < a.heads; ++h) {
    float dot = 0.0f;
    for (int c = lane; c < a.dim; c += 32) dot += q[h * a.dim + c] * key_value<D>(row, c, a.dim);
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    score += a.w[int64_t(t) * a.heads + h] * fmaxf(dot, 0.0f);
  }
  if (lane == 0) a.scores[int64_t(t) * a.score_stride + p] = score;
}

template <int DIM, bool FP8>
void launch_mma(const IndexerArgs& a, cudaStream_t st) {
  const int heads_pad = (a.heads + 7) / 8 * 8;
  const size_t smem = size_t(heads_pad + kKeysPerTile) * (DIM + 8) * 2 + size_t(heads_pad + kKeysPerTile) * 4 +
                      (FP8 ? size_t(kKeysPerTile) * a.keys.row_bytes : 0);
  auto kernel = indexer_mma_kernel<DIM, FP8>;
  SPARSEMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned(ceil_div(a.max_ctx, kKeysPerTile * kTilesPerBlock)), unsigned(a.T));
  kernel<<<grid, 128, smem, st>>>(a);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace

void indexer_scores(const IndexerArgs& a, IndexerKernel k, Stream s) {
  if (a.T == 0 || a.max_ctx == 0) return;
  auto st = static_cast<cudaStream_t>(s);
  const bool fp8 = a.dtype == KvDtype::FP8;
  if (fp8 && a.dim > kFp8Group) fail("indexer: fp8 keys need dim <= {} (one scale per key), got {}", kFp8Group, a.dim);
  if (k == IndexerKernel::Mma) {
    if (a.dtype == KvDtype::F32) fail("indexer: the mma kernel takes bf16 or fp8 keys, not f32");
    if (a.dim == 128) return fp8 ? launch_mma<128, true>(a, st) : launch_mma<128, false>(a, st);
    if (a.dim == 64) return fp8 ? launch_mma<64, true>(a, st) : launch_mma<64, false>(a, st);
    fail("indexer: the mma kernel takes dim 64 or 128, got {}", a.dim);
  }
  const dim3 grid(unsigned(ceil_div(a.max_ctx, 4)), unsigned(a.T));
  if (fp8) indexer_fma_kernel<KvDtype::FP8><<<grid, 128, 0, st>>>(a);
  else if (a.dtype == KvDtype::F32) indexer_fma_kernel<KvDtype::F32><<<grid, 128, 0, st>>>(a);
  else indexer_fma_kernel<KvDtype::BF16><<<grid, 128, 0, st>>>(a);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
