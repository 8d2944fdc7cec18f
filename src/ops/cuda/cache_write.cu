// Writing new tokens' latent rows and indexer keys into the paged cache, in bf16 or fp8.
#include <algorithm>

#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/pdl.cuh"

namespace sparsemla::cuda {

const char* kv_dtype_name(KvDtype d) { return d == KvDtype::FP8 ? "fp8" : d == KvDtype::F32 ? "f32" : "bf16"; }

static int fp8_groups(int n) { return (n + kFp8Group - 1) / kFp8Group; }

int64_t latent_row_bytes(KvDtype d, int kv_lora, int rope) {
  if (d == KvDtype::BF16) return 2 * int64_t(kv_lora + rope);
  if (d == KvDtype::F32) return 4 * int64_t(kv_lora + rope);
  const int64_t b = kv_lora + 4 * int64_t(fp8_groups(kv_lora)) + 2 * int64_t(rope);
  return (b + 15) / 16 * 16;
}

int64_t index_key_row_bytes(KvDtype d, int dim) {
  if (d == KvDtype::BF16) return 2 * int64_t(dim);
  if (d == KvDtype::F32) return 4 * int64_t(dim);
  const int64_t b = dim + 4 * int64_t(fp8_groups(dim));
  return (b + 3) / 4 * 4;
}

namespace {

// One block per row: `n_fp8` values quantized in groups of 128 (one warp per group, scale =
// amax / 448), followed by the scales, then `n_tail` values kept as bf16 (the rope part).
__global__ void write_fp8_rows(const float* rows, const int64_t* slots, int n_fp8, int n_tail, uint8_t* cache,
                               int64_t row_bytes) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const float* x = rows + int64_t(blockIdx.x) * (n_fp8 + n_tail);
  uint8_t* dst = cache + slots[blockIdx.x] * row_bytes;
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

__global__ void write_bf16_rows(const float* rows, const int64_t* slots, int n, __nv_bfloat16* cache,
                                int64_t row_elems) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const float* x = rows + int64_t(blockIdx.x) * n;
  __nv_bfloat16* dst = cache + slots[blockIdx.x] * row_elems;
  for (int c = threadIdx.x; c < n; c += blockDim.x) dst[c] = __float2bfloat16(x[c]);
}

__global__ void write_f32_rows(const float* rows, const int64_t* slots, int n, float* cache, int64_t row_elems) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const float* x = rows + int64_t(blockIdx.x) * n;
  float* dst = cache + slots[blockIdx.x] * row_elems;
  for (int c = threadIdx.x; c < n; c += blockDim.x) dst[c] = x[c];
}

void write_rows(const float* rows, const int64_t* slots, int64_t T, KvDtype d, int n_fp8, int n_tail, void* cache,
                int64_t row_bytes, Stream s) {
  if (T == 0) return;
  auto st = static_cast<cudaStream_t>(s);
  if (d == KvDtype::F32) {
    write_f32_rows<<<unsigned(T), 128, 0, st>>>(rows, slots, n_fp8 + n_tail, static_cast<float*>(cache), row_bytes / 4);
  } else if (d == KvDtype::BF16) {
    write_bf16_rows<<<unsigned(T), 128, 0, st>>>(rows, slots, n_fp8 + n_tail, static_cast<__nv_bfloat16*>(cache),
                                                  row_bytes / 2);
  } else {
    const int warps = std::min(8, std::max(1, fp8_groups(n_fp8)));
    write_fp8_rows<<<unsigned(T), 32 * warps, 0, st>>>(rows, slots, n_fp8, n_tail, static_cast<uint8_t*>(cache),
                                                       row_bytes);
  }
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

}  // namespace sparsemla::cuda
