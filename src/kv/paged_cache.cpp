#include "kv/paged_cache.h"

#include <algorithm>
#include <cmath>

#include "util/error.h"
#include "util/half.h"

namespace sparsemla::kv {

const CacheShape& checked_cache_shape(const CacheShape& shape) {
  if (shape.block_size <= 0 || shape.n_blocks <= 0 || shape.n_layers <= 0 || shape.latent_dim <= 0)
    fail("KV cache: invalid shape ({} layers, latent {}, {} blocks of {})", shape.n_layers, shape.latent_dim,
         shape.n_blocks, shape.block_size);
  return shape;
}

PagedCache::PagedCache(const CacheShape& shape)
    : BlockAllocator(checked_cache_shape(shape).block_size, shape.n_blocks), shape_(shape) {
  latent_.assign(size_t(shape.n_layers) * size_t(n_slots()) * size_t(shape.latent_dim), 0.0f);
  index_keys_.assign(size_t(shape.n_layers) * size_t(n_slots()) * size_t(shape.idx_dim), 0.0f);
}

namespace {

constexpr int64_t kFp8Group = 128;  // values sharing one scale (ops/cuda/attention.h)

float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

void round_fp8_groups(float* x, int64_t n) {
  for (int64_t g0 = 0; g0 < n; g0 += kFp8Group) {
    const int64_t g1 = std::min(n, g0 + kFp8Group);
    float amax = 0.0f;
    for (int64_t i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int64_t i = g0; i < g1; ++i) x[i] = fp8_e4m3_to_f32(f32_to_fp8_e4m3(x[i] / scale)) * scale;
  }
}

}  // namespace

void PagedCache::set_rounding(RowRounding r, int32_t kv_lora) {
  if (r == RowRounding::FP8 && (kv_lora <= 0 || kv_lora > shape_.latent_dim))
    fail("KV cache: kv_lora {} does not fit the latent row of {}", kv_lora, shape_.latent_dim);
  rounding_ = r;
  kv_lora_ = kv_lora;
}

void PagedCache::round_latent(int32_t layer, int64_t slot) {
  if (rounding_ == RowRounding::None) return;
  float* row = latent(layer, slot);
  const int64_t bf16_from = rounding_ == RowRounding::FP8 ? kv_lora_ : 0;
  if (rounding_ == RowRounding::FP8) round_fp8_groups(row, kv_lora_);
  for (int64_t i = bf16_from; i < shape_.latent_dim; ++i) row[i] = round_bf16(row[i]);
}

void PagedCache::round_index_key(int32_t layer, int64_t slot) {
  if (rounding_ == RowRounding::None) return;
  float* key = index_key(layer, slot);
  if (rounding_ == RowRounding::FP8) round_fp8_groups(key, shape_.idx_dim);
  else
    for (int64_t i = 0; i < shape_.idx_dim; ++i) key[i] = round_bf16(key[i]);
}

}  // namespace sparsemla::kv
