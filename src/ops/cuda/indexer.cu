// The DSA lightning indexer: every visible key of a token's sequence scored by a few cheap heads,
//   score[t][p] = sum_h w[t][h] * relu(q[t][h] . k[p]).
// Mma: tensor cores (mma.sync m16n8k16: bf16 keys, or fp8 keys widened exactly to fp16), tiles of
// 64 keys against all heads of the token, with one wave of blocks covering the keys: a decode
// token at long context is a pure stream of its keys. Three kernels (launch_mma chooses):
//   staged: a block streams a run of tiles through a small ring of shared-memory stages (cp.async),
//     the next tile's keys in flight while one is scored; 16 keys per warp for bf16 keys, 32 for
//     fp8. Fp8 keys (132-byte rows) are copied 16 bytes at a time as the runs of consecutive slots
//     that a cache page holds.
//   regs (bf16 keys, up to 64 heads; only when asked for): each warp loads its keys straight into
//     its A fragments, the next tile's while one is scored; only the queries in shared memory.
//   qfrag (up to 64 heads; fp8 keys in pages of a multiple of 64 slots; the default for bf16 keys
//     and for fp8 keys of up to 32 heads): the queries are the A operand, in each warp's registers
//     for the whole block, and the keys the B operand from the stages: shared memory serves each
//     key once per 32 heads instead of every query per 16 (or 32) keys.
//   tokens (a prefill's runs of one sequence, on the qfrag kernel's shapes; the default from 8 tokens
//     per run): up to 8 consecutive tokens per block share each key tile, each warp holding one
//     token's queries (indexer_tokens_kernel.cuh); the qfrag kernel's sums, the same bits.
// Fma: one warp per key, any shape.
// The kernels and the choice among them are in indexer_kernels.cuh (built by the host emulation too).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "ops/cuda/attention.h"
#include "ops/cuda/check.cuh"
#include "ops/cuda/indexer_kernels.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/pdl.cuh"
#include "util/env.h"

namespace sparsemla::cuda {
namespace {

using namespace indexer;

// Launches an mma kernel over the tokens' keys with enough tiles per block that one wave of resident
// blocks covers them, so that each block streams several tiles; smem_bytes(tiles): the kernel's
// shared memory for blocks of that many tiles. `extra`: the kernel's arguments after (a, tiles).
template <class Kernel, class SmemBytes, class... Extra>
void launch_one_wave(Kernel kernel, int threads, int tokens_per_block, SmemBytes smem_bytes, const IndexerArgs& a,
                     cudaStream_t st, Extra... extra) {
  const size_t smem_max = smem_bytes(kMaxTilesPerBlock);
  allow_smem(kernel, smem_max);
  const int per_sm = blocks_per_sm(kernel, threads, smem_max);
  const int per_block = one_wave_tiles(a, int64_t(sm_count()) * per_sm, tokens_per_block);
  const int64_t groups = token_groups(a, tokens_per_block);
  if (groups > 65535) fail("indexer: {} tokens in one call (at most {} here)", a.T, 65535LL * tokens_per_block);
  const dim3 grid{unsigned(ceil_div(ceil_div(a.max_ctx, kKeysPerTile), per_block)), unsigned(groups)};
  pdl::launch(kernel, grid, dim3(threads), smem_bytes(per_block), st, a, per_block, extra...);
}

IndexerMma indexer_mma_from_env() {
  const char* v = std::getenv("SPARSEMLA_INDEXER_MMA");
  if (!v) return IndexerMma::kAuto;
  const std::string name(v);
  if (name == "staged") return IndexerMma::kStaged;
  if (name == "regs") return IndexerMma::kRegs;
  if (name == "qfrag") return IndexerMma::kQfrag;
  if (name == "tokens") return IndexerMma::kTokens;
  return IndexerMma::kAuto;
}

template <int DIM, bool FP8>
void launch_mma(const IndexerArgs& a, cudaStream_t st) {
  // Two stages (35 KB of shared memory at 128 dims, bf16 keys) by default: on an H200 three (52 KB)
  // scored one token x 128K as fast or 0.5-0.9 us faster, but the top-k launched after it then took
  // ~2 us longer (DeepSeek-V3.2 indexer + top-k 23.6-23.7 -> 25.6-25.7 us; session 22).
  // SPARSEMLA_INDEXER_QFRAG_STAGES=3 (A/B runs): three stages instead of two
  static const int64_t stages = env_int("SPARSEMLA_INDEXER_QFRAG_STAGES", 2);
  dispatch_mma<DIM, FP8>(a, indexer_mma_choice(a), stages == 3 ? 3 : 2,
                         [&](auto kernel, int threads, int tokens_per_block, auto smem_bytes, auto... extra) {
                           launch_one_wave(kernel, threads, tokens_per_block, smem_bytes, a, st, extra...);
                         });
}

}  // namespace

void index_queries(float* q, float* w, int64_t T, int heads, int dim, const RopeTable& rope, const int64_t* pos,
                   float w_scale, KvDtype keys, uint16_t* q16, Stream s) {
  if (T < 0 || T > INT32_MAX || heads <= 0 || dim <= 0)
    fail("index_queries: bad shape: {} tokens of {} heads x {} values", T, heads, dim);
  if (2 * rope.half > dim) fail("index_queries: {} rotary values in heads of {}", 2 * rope.half, dim);
  if (T == 0) return;
  auto st = static_cast<cudaStream_t>(s);
  const dim3 grid{unsigned(T), unsigned(ceil_div(heads, kQueryHeadsPerBlock))};
  const dim3 block(32, kQueryHeadsPerBlock);
  if (index_queries_fp16(keys))
    index_queries_kernel<__half><<<grid, block, 0, st>>>(q, w, heads, dim, rope, pos, w_scale,
                                                         reinterpret_cast<__half*>(q16));
  else
    index_queries_kernel<__nv_bfloat16><<<grid, block, 0, st>>>(q, w, heads, dim, rope, pos, w_scale,
                                                                reinterpret_cast<__nv_bfloat16*>(q16));
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

IndexerMma indexer_mma_choice(const IndexerArgs& a) {
  // SPARSEMLA_INDEXER_MMA=staged|regs|qfrag: as IndexerArgs::mma (A/B runs)
  static const IndexerMma env_kernel = indexer_mma_from_env();
  return choose_mma(a, env_kernel);
}

const char* indexer_mma_name(IndexerMma k) {
  switch (k) {
    case IndexerMma::kStaged: return "staged";
    case IndexerMma::kRegs: return "regs";
    case IndexerMma::kQfrag: return "qfrag";
    case IndexerMma::kTokens: return "tokens";
    default: return "auto";
  }
}

bool indexer_takes_query_prep(const IndexerArgs& a, IndexerKernel k) {
  return k == IndexerKernel::Mma && a.dtype != KvDtype::F32 && (a.dim == 64 || a.dim == 128) &&
         2 * a.prep.rope.half <= a.dim && indexer_mma_choice(a) == IndexerMma::kQfrag;
}

namespace {
std::atomic<int64_t> g_score_calls{0};
}  // namespace

int64_t indexer_score_calls() { return g_score_calls.load(); }

void indexer_scores(const IndexerArgs& a, IndexerKernel k, Stream s) {
  if (a.T == 0 || a.max_ctx == 0) return;
  g_score_calls.fetch_add(1);
  auto st = static_cast<cudaStream_t>(s);
  const bool fp8 = a.dtype == KvDtype::FP8;
  if (fp8 && a.dim > kFp8Group) fail("indexer: fp8 keys need dim <= {} (one scale per key), got {}", kFp8Group, a.dim);
  if (a.counts.hist && k != IndexerKernel::Mma)
    fail("indexer: only the mma kernel counts top_k's first digit (IndexerArgs::counts)");
  if (a.prep.pos && !indexer_takes_query_prep(a, k))
    fail("indexer: the queries' rope and scales asked of a kernel that does not take them (IndexerArgs::prep; "
         "indexer_takes_query_prep)");
  if (k == IndexerKernel::Mma) {
    if (a.dtype == KvDtype::F32) fail("indexer: the mma kernel takes bf16 or fp8 keys, not f32");
    if (reinterpret_cast<uintptr_t>(a.q16) % 16 != 0) fail("indexer: 16-bit queries must start 16-byte aligned");
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
