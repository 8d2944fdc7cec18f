// The shared-memory geometry of the mma attention kernel (sparse_mla.cu) and of the wgmma one
// (sparse_mla_sm90.cu), in plain C++ so that the backend selector (ops/select), built with or
// without CUDA, checks a device against the same numbers the kernels launch with.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace sparsemla::cuda::mla_smem {

constexpr int kRows = 32;     // latent rows per tile
constexpr int kChunk = 512;   // slots of a chunk of rows (32-bit each), looked up before its tiles
constexpr int kSStride = 40;  // row stride of the score exchange, in floats (8 mod 32: float2 rows without bank conflicts)
constexpr uint32_t kNoSlot = 0xffffffffu;  // a chunk entry without a row

// Bytes of an fp8 latent row as the cache stores it (cache_write.cu: latent_row_bytes): kv_lora e4m3
// values, an fp32 scale per 128 of them, rope bf16 values, padded to 16 bytes.
inline int64_t fp8_latent_row_bytes(int kv_lora, int rope) {
  const int64_t b = kv_lora + 4 * int64_t((kv_lora + 127) / 128) + 2 * int64_t(rope);
  return (b + 15) / 16 * 16;
}

// Output tiles of 8 dims per warp half: the smallest power of 2 (>= 2) whose 16 * n covers kv_lora.
inline int nv_tiles(int kv_lora) {
  int nv = 2;
  while (nv * 16 < kv_lora) nv *= 2;
  return nv;
}

// Row stride in bf16 values of the q and latent tiles: both halves of whole k-steps, +8 to stagger banks.
inline int stride(int kv_lora, int rope) {
  const int d_pad = (kv_lora + rope + 31) / 32 * 32;
  return std::max(d_pad, nv_tiles(kv_lora) * 16) + 8;
}

// The score exchange of hg head groups: [hg pairs of warps][2 halves][16 heads][kSStride].
inline size_t score_bytes(int hg) { return size_t(hg) * 2 * 16 * kSStride * 4; }

// One stage of fp8 rows as stored (two stages): a tile's stage is free once it has been widened, so
// the tile's score exchange (of hg pairs of warps: with tile pairs, of both sets) lives there too;
// 16-byte multiple.
inline size_t fp8_stage_bytes(int hg, int64_t row_bytes) {
  return (std::max(size_t(kRows) * size_t(row_bytes), score_bytes(hg)) + 15) / 16 * 16;
}

// Bytes of one block: q (hg * 16 heads), the bf16 tile(s), the fp8 staging tiles (which hold the
// scores too), else the scores (of each set of warps: tile_pairs), slots. 16 heads with two stages
// fit 99 KB for bf16 (99,712 bytes) and fp8 (100,096) rows of 576; with two tile pairs 104,832 and
// 137,472 (fp8 rows: two bf16 tiles), at 32 heads 134,656 and 156,160.
inline size_t bytes(int hg, int stages, bool fp8, int row_stride, int64_t row_bytes, int tile_pairs = 1) {
  const size_t staged =
      fp8 && stages == 2 ? 2 * fp8_stage_bytes(hg * tile_pairs, row_bytes) : score_bytes(hg * tile_pairs);
  return size_t(hg) * 16 * row_stride * 2 + size_t(fp8 && tile_pairs == 1 ? 1 : stages) * kRows * row_stride * 2 +
         staged + size_t(kChunk) * 4;
}

// The fp8-row kernel (sparse_mla_fp8.cu; latent 512 + rope 64): q as fp16 (latent, 520 per head)
// and bf16 (rope, 72), `stages` tiles of 32 rows as stored (656 bytes in a 704-byte stride), scores,
// slots. 32 heads with two stages: 93,440 bytes (99 KB devices); 64 heads with three: 162,304.
constexpr int kFp8RowStride = 704;
inline size_t fp8_rows_bytes(int hg, int stages) {
  return size_t(hg) * 16 * (520 + 72) * 2 + size_t(stages) * kRows * kFp8RowStride + score_bytes(hg) +
         size_t(kChunk) * 4;
}

// Whether the mma kernel's tile pairs (hg head groups, two stages) can hand the second set's output
// over through the two bf16 tiles at the end: (nv + 1) KB per head group (each warp's output
// fragments and its rows' maxima and denominators) against the tiles' 2 x 32 rows of row_stride.
inline bool tile_pairs_fit(int hg, int kv_lora, int row_stride) {
  return size_t(hg) * size_t(nv_tiles(kv_lora) + 1) * 1024 <= size_t(2) * kRows * size_t(row_stride) * 2;
}

// Whether a device of `optin` bytes per block holds the mma kernel's tile pairs at hg head groups:
// the block's bytes with two sets of warps and two stages, and the hand-over (tile_pairs_fit). The
// launch (sparse_mla.cu) and the backend table (select.cpp) both ask this.
inline bool tile_pairs_hold(int hg, bool fp8, int kv_lora, int rope, int64_t row_bytes, uint64_t optin) {
  const int st = stride(kv_lora, rope);
  return bytes(hg, 2, fp8, st, row_bytes, 2) <= optin && tile_pairs_fit(hg, kv_lora, st);
}

// Whether an SM of `per_sm` bytes holds two fp8-row blocks of 32 heads with two stages (1 KB of
// each block is the system's): the fp8-row kernel then takes that shape (H200, B200).
inline bool fp8_rows_two_per_sm(uint64_t per_sm) { return per_sm >= 2 * (fp8_rows_bytes(2, 2) + 1024); }

// The block that fits `limit` bytes: from hg head groups of 16 and max_stages tiles in flight, fewer
// stages first, then half the heads with max_stages again; {0, 0} when even 16 heads with
// min_stages do not fit. bytes(hg, stages): a variant's bytes. The launch and the backend table
// (ops/select) both fit with this.
struct Fit {
  int hg = 0, stages = 0;
};
template <class Bytes>
Fit fit(int hg, int max_stages, int min_stages, uint64_t limit, Bytes bytes) {
  for (; hg >= 1; hg /= 2)
    for (int st = max_stages; st >= min_stages; --st)
      if (bytes(hg, st) <= limit) return {hg, st};
  return {};
}

// The smallest variant (16 heads, one tile; the same for bf16 and fp8 rows): what a device must hold.
inline size_t min_bytes(int kv_lora, int rope) {
  return bytes(1, 1, false, stride(kv_lora, rope), 2 * int64_t(kv_lora + rope));
}

// The wgmma kernel's block: q and two 64-row tiles as bf16 (3 x 72 KB), P (8 KB), per-head softmax
// state, row flags and mbarriers. Its fixed shape (latent 512 + rope 64, 64 heads) fixes the size.
constexpr size_t kWgmmaBytes = 230960;

}  // namespace sparsemla::cuda::mla_smem
