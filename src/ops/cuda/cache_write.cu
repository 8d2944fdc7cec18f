// Writing new tokens' latent rows and indexer keys into the paged cache, in bf16 or fp8.
#include <algorithm>

#include "ops/cuda/attention.h"
#include "ops/cuda/attention_smem.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/rope.cuh"
#include "ops/cuda/row_norm.cuh"

namespace sparsemla::cuda {

const char* kv_dtype_name(KvDtype d) { return d == KvDtype::FP8 ? "fp8" : d == KvDtype::F32 ? "f32" : "bf16"; }

static int fp8_groups(int n) { return (n + kFp8Group - 1) / kFp8Group; }

int64_t latent_row_bytes(KvDtype d, int kv_lora, int rope) {
  if (d == KvDtype::BF16) return 2 * int64_t(kv_lora + rope);
  if (d == KvDtype::F32) return 4 * int64_t(kv_lora + rope);
  static_assert(kFp8Group == 128, "mla_smem::fp8_latent_row_bytes groups 128 values");
  return mla_smem::fp8_latent_row_bytes(kv_lora, rope);
}

int64_t index_key_row_bytes(KvDtype d, int dim) {
  if (d == KvDtype::BF16) return 2 * int64_t(dim);
  if (d == KvDtype::F32) return 4 * int64_t(dim);
  const int64_t b = dim + 4 * int64_t(fp8_groups(dim));
  return (b + 3) / 4 * 4;
}

namespace {

// Row x (n_fp8 + n_tail fp32 values, global or shared) stored at dst in format D by the whole
// block. FP8: the first n_fp8 values quantized in groups of 128 (one warp per group, scale =
// amax / 448), followed by the scales, then the n_tail values kept as bf16 (the rope part).
template <KvDtype D>
__device__ __forceinline__ void store_row(const float* x, uint8_t* dst, int n_fp8, int n_tail) {
  const int n = n_fp8 + n_tail;
  if constexpr (D == KvDtype::F32) {
    float* out = reinterpret_cast<float*>(dst);
    for (int c = threadIdx.x; c < n; c += blockDim.x) out[c] = x[c];
  } else if constexpr (D == KvDtype::BF16) {
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(dst);
    for (int c = threadIdx.x; c < n; c += blockDim.x) out[c] = __float2bfloat16(x[c]);
  } else {
    const int groups = (n_fp8 + kFp8Group - 1) / kFp8Group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* scales = reinterpret_cast<float*>(dst + n_fp8);
    for (int gi = warp; gi < groups; gi += blockDim.x / 32) {
      const int c0 = gi * kFp8Group, c1 = min(n_fp8, c0 + kFp8Group);
      float amax = 0.0f;
      for (int c = c0 + lane; c < c1; c += 32) amax = fmaxf(amax, fabsf(x[c]));
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
      for (int c = c0 + lane; c < c1; c += 32) dst[c] = float_to_fp8(x[c] / scale);
      if (lane == 0) scales[gi] = scale;
    }
    __nv_bfloat16* tail = reinterpret_cast<__nv_bfloat16*>(dst + n_fp8 + 4 * groups);
    for (int c = threadIdx.x; c < n_tail; c += blockDim.x) tail[c] = __float2bfloat16(x[n_fp8 + c]);
  }
}

// One block per row.
template <KvDtype D>
__global__ void write_rows_kernel(const float* rows, const int64_t* slots, int n_fp8, int n_tail, uint8_t* cache,
                                  int64_t row_bytes) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  store_row<D>(rows + int64_t(blockIdx.x) * (n_fp8 + n_tail), cache + slots[blockIdx.x] * row_bytes, n_fp8, n_tail);
}

// Threads of a row's block: fp8 one warp per group of 128 (at most 8).
int store_threads(KvDtype d, int n_fp8) {
  return d == KvDtype::FP8 ? 32 * std::min(8, std::max(1, fp8_groups(n_fp8))) : 128;
}

void write_rows(const float* rows, const int64_t* slots, int64_t T, KvDtype d, int n_fp8, int n_tail, void* cache,
                int64_t row_bytes, Stream s) {
  if (T == 0) return;
  auto st = static_cast<cudaStream_t>(s);
  auto* c = static_cast<uint8_t*>(cache);
  const int threads = store_threads(d, n_fp8);
  if (d == KvDtype::F32)
    write_rows_kernel<KvDtype::F32><<<unsigned(T), threads, 0, st>>>(rows, slots, n_fp8, n_tail, c, row_bytes);
  else if (d == KvDtype::BF16)
    write_rows_kernel<KvDtype::BF16><<<unsigned(T), threads, 0, st>>>(rows, slots, n_fp8, n_tail, c, row_bytes);
  else
    write_rows_kernel<KvDtype::FP8><<<unsigned(T), threads, 0, st>>>(rows, slots, n_fp8, n_tail, c, row_bytes);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

// One block of row_threads(n_norm) threads per row (the norm kernels' count, so the same sums):
// the row's first n_norm values normalized (RMS: x / rms * w; layer: (x - mean) / sd * w + b), the
// rest as they are, then pairs [rot0, rot0 + 2 half) rotated at the token's position, then stored.
template <KvDtype D, bool LAYER>
__global__ void write_normed_kernel(const float* rows, int64_t in_stride, int n_norm, const float* __restrict__ w,
                                    const float* __restrict__ b, float eps, int rot0, RopeTable rope,
                                    const int64_t* __restrict__ pos, const int64_t* slots, int n_fp8, int n_tail,
                                    uint8_t* cache, int64_t row_bytes) {
  extern __shared__ float row[];  // [n_fp8 + n_tail]
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const int n = n_fp8 + n_tail;
  const float* x = rows + int64_t(blockIdx.x) * in_stride;
  // Everything that does not depend on the row first, its loads in flight with the row's: the
  // norm's weights and bias, and the angle of this thread's first pair.
  float v[kRowCache], wv[kRowCache], bv[kRowCache];
  load_row(x, n_norm, v);
  load_row(w, n_norm, wv);
  load_row(LAYER ? b : nullptr, n_norm, bv);
  const int i_tail = n_norm + int(threadIdx.x);  // this thread's first value past the norm
  const float tail = i_tail < n ? x[i_tail] : 0.0f;
  const float p = float(pos[blockIdx.x]);
  const RopeAngle first = threadIdx.x < rope.half ? rope_angle(rope, p, threadIdx.x) : RopeAngle{0.0f, 0.0f};
  if constexpr (LAYER) {
    float mean, inv;
    layer_norm_stats(v, n_norm, eps, &mean, &inv);
    for_row(n_norm, [&](int j, int64_t i) { row[i] = (v[j] - mean) * inv * wv[j] + bv[j]; });
  } else {
    const float scale = rms_inv(v, n_norm, eps);
    for_row(n_norm, [&](int j, int64_t i) { row[i] = v[j] * scale * wv[j]; });
  }
  if (i_tail < n) row[i_tail] = tail;
  for (int i = i_tail + int(blockDim.x); i < n; i += blockDim.x) row[i] = x[i];
  __syncthreads();
  for (int64_t i = threadIdx.x; i < rope.half; i += blockDim.x) {
    float* a = row + rot0 + rope_a(rope, i);
    float* bb = row + rot0 + rope_b(rope, i);
    rope_rotate(i == threadIdx.x ? first : rope_angle(rope, p, i), a, bb);
  }
  __syncthreads();
  store_row<D>(row, cache + slots[blockIdx.x] * row_bytes, n_fp8, n_tail);
}

template <bool LAYER>
void write_normed(const char* op, const float* rows, int64_t in_stride, int n_norm, const float* w, const float* b,
                  float eps, int rot0, const RopeTable& rope, const int64_t* pos, const int64_t* slots, int64_t T,
                  KvDtype d, int n_fp8, int n_tail, void* cache, int64_t row_bytes, Stream s) {
  const int n = n_fp8 + n_tail;
  if (T < 0 || T > INT32_MAX || n_norm < 0 || n_norm > n || in_stride < n)
    fail("cuda::{}: bad shape: {} rows of {} values ({} normalized), row stride {}", op, T, n, n_norm, in_stride);
  if (n_norm > kMaxCachedRow)
    fail("cuda::{}: {} values to normalize, more than the {} one block holds", op, n_norm, kMaxCachedRow);
  if (rot0 < 0 || rot0 + 2 * rope.half > n)
    fail("cuda::{}: rotary values [{}, {}) outside the row of {}", op, rot0, rot0 + 2 * rope.half, n);
  if (T == 0) return;
  auto st = static_cast<cudaStream_t>(s);
  auto* c = static_cast<uint8_t*>(cache);
  const int threads = row_threads(n_norm);
  const size_t smem = size_t(n) * 4;
  auto launch = [&](auto kernel) {
    allow_smem(kernel, smem);
    kernel<<<unsigned(T), threads, smem, st>>>(rows, in_stride, n_norm, w, b, eps, rot0, rope, pos, slots, n_fp8,
                                                n_tail, c, row_bytes);
  };
  if (d == KvDtype::F32) launch(write_normed_kernel<KvDtype::F32, LAYER>);
  else if (d == KvDtype::BF16) launch(write_normed_kernel<KvDtype::BF16, LAYER>);
  else launch(write_normed_kernel<KvDtype::FP8, LAYER>);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace

void write_latent_rows(const float* rows, const int64_t* slots, int64_t T, KvDtype d, int kv_lora, int rope,
                       void* cache, int64_t row_bytes, Stream s) {
  write_rows(rows, slots, T, d, kv_lora, rope, cache, row_bytes, s);
}

void write_index_keys(const float* keys, const int64_t* slots, int64_t T, KvDtype d, int dim, void* cache,
                      int64_t row_bytes, Stream s) {
  write_rows(keys, slots, T, d, dim, 0, cache, row_bytes, s);
}

void write_latent_normed(const float* kv, const float* norm_w, float eps, const RopeTable& rope, const int64_t* pos,
                         const int64_t* slots, int64_t T, KvDtype d, int kv_lora, int rope_dims, void* cache,
                         int64_t row_bytes, Stream s) {
  write_normed<false>("write_latent_normed", kv, kv_lora + rope_dims, kv_lora, norm_w, nullptr, eps, kv_lora, rope, pos,
                      slots, T, d, kv_lora, rope_dims, cache, row_bytes, s);
}

void write_index_keys_normed(const float* keys, const float* norm_w, const float* norm_b, float eps,
                             const RopeTable& rope, const int64_t* pos, const int64_t* slots, int64_t T, KvDtype d,
                             int dim, void* cache, int64_t row_bytes, Stream s) {
  write_normed<true>("write_index_keys_normed", keys, dim, dim, norm_w, norm_b, eps, 0, rope, pos, slots, T, d, dim, 0,
                     cache, row_bytes, s);
}

}  // namespace sparsemla::cuda
