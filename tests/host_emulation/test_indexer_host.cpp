// The DSA lightning indexer's score kernels (src/ops/cuda/indexer_kernels.cuh) run by the host
// emulation (cuda/emu.h) as indexer.cu launches them: the mma kernel that choose_mma picks, or each
// one asked for by name (staged: 16 keys per warp for bf16 keys, 32 for fp8 with whole-tile runs,
// page runs or 4-byte copies; regs; qfrag with two and three stages, one or two warps of one or two
// m-tiles of heads), dispatched by dispatch_mma with one_wave_tiles' blocks, and the fma kernel over
// bf16, fp8 and f32 keys; on the shapes of CudaAttention.IndexerScoresMatchTheCpuReference and
// IndexerScoresOneLongRow (GLM-5's 32 heads and DeepSeek-V3.2's 64 x 128, the fixtures' small
// ones; shorter contexts), over paged caches with shuffled block tables, decode rows and prefill
// rows of one sequence (the causal mask: each token sees its position + 1 keys). So the kernels'
// page lookups, cp.async stages, fp8 widening, fragment layouts, head padding, score exchange and
// the count of top_k's first digit are checked in CI, where there is no GPU; those tests run them
// on one.
//
// Reference: model::indexer_score on the keys as the cache stores them (decoded on the CPU), with q
// rounded to the mma kernel's 16-bit type; error relative to the summed terms' magnitude <= 2e-5,
// as the GPU test. Besides, bit for bit: the same scores from 16-bit queries (IndexerArgs::q16) and
// from fp32 ones, with blocks of one tile and of many (a wave of fewer resident blocks), and with
// the block's threads run in the opposite order (no race between them, nor between the copies and
// their reads); positions past a row's context left unwritten; and the counted histogram equal to
// the first digits of the row's scores counted on the host (rows of n <= k left at zero).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "model/blocks/indexer.h"
#include "model/hparams.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/indexer_kernels.cuh"
#include "../unit/paged_test_util.h"
#include "../unit/rope_test_util.h"
#include "util/half.h"

namespace sparsemla::cuda {
namespace {

using namespace indexer;
using sparsemla::bf16_to_f32;
using sparsemla::f32_to_bf16;

using test_paged::fp16_query_factor;
using test_paged::Paged;
using test_paged::random_vec;

// Index keys [n_slots][dim] stored as `dtype` (attention.h: bf16, f32, or fp8 e4m3 with one fp32
// scale amax / 448 per 128 values after them, as write_index_keys stores them), and decoded.
struct HostKeys {
  std::vector<uint8_t> bytes;  // (std::vector's allocation: 16-byte aligned, as a device buffer)
  int64_t row_bytes = 0;
  std::vector<float> decoded;
};
HostKeys make_keys(const std::vector<float>& rows, int64_t n_slots, int dim, KvDtype dtype) {
  const int groups = (dim + kFp8Group - 1) / kFp8Group;
  HostKeys c;
  c.row_bytes = dtype == KvDtype::F32 ? 4 * dim : dtype == KvDtype::BF16 ? 2 * dim : dim + 4 * groups;
  c.bytes.assign(size_t(n_slots * c.row_bytes), 0);
  c.decoded.resize(size_t(n_slots * dim));
  for (int64_t s = 0; s < n_slots; ++s) {
    const float* x = rows.data() + s * dim;
    uint8_t* row = c.bytes.data() + s * c.row_bytes;
    float* out = c.decoded.data() + s * dim;
    if (dtype == KvDtype::F32) {
      std::memcpy(row, x, size_t(dim) * 4);
      std::copy(x, x + dim, out);
    } else if (dtype == KvDtype::BF16) {
      for (int i = 0; i < dim; ++i) {
        const uint16_t h = f32_to_bf16(x[i]);
        std::memcpy(row + 2 * i, &h, 2);
        out[i] = bf16_to_f32(h);
      }
    } else {
      for (int g = 0; g < groups; ++g) {
        const int i0 = g * kFp8Group, i1 = std::min(dim, i0 + kFp8Group);
        float amax = 0.0f;
        for (int i = i0; i < i1; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        std::memcpy(row + dim + 4 * g, &scale, 4);
        for (int i = i0; i < i1; ++i) {
          row[i] = f32_to_fp8_e4m3(x[i] / scale);
          out[i] = fp8_e4m3_to_f32(row[i]) * scale;
        }
      }
    }
  }
  return c;
}

const char* dtype_name(KvDtype d) { return d == KvDtype::FP8 ? "fp8" : d == KvDtype::BF16 ? "bf16" : "f32"; }
const char* mma_name(IndexerMma k) {
  if (k == IndexerMma::kStaged) return "staged";
  if (k == IndexerMma::kRegs) return "regs";
  if (k == IndexerMma::kTokens) return "tokens";
  return k == IndexerMma::kQfrag ? "qfrag" : "auto";
}
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct IndexerCase {
  int heads, dim;
  std::vector<int> ctx;  // per query token: its context length (tokens t share sequences round-robin)
  int n_seq;
  int block_size;
  int run = 1;  // tokens t .. t + run - 1 share a sequence (runs of the sequences in turn)
};

// Prefill rows: `T` tokens of one sequence at positions first .. first + T - 1 (the causal mask).
IndexerCase prefill(int heads, int dim, int first, int T, int block_size) {
  IndexerCase c{heads, dim, {}, 1, block_size};
  for (int t = 0; t < T; ++t) c.ctx.push_back(first + t + 1);
  return c;
}

// One problem's inputs on the host, and the arguments that point at them.
struct Problem {
  IndexerCase c;
  KvDtype dtype;
  std::vector<int32_t> seq, n_ctx;
  Paged pg;
  HostKeys keys;
  std::vector<float> q, w;
  std::vector<uint16_t> q16;
  int64_t max_ctx = 0;
  Problem(const IndexerCase& c_, KvDtype d, std::mt19937& rng) : c(c_), dtype(d), pg(lens(c_), c_.block_size, rng) {
    const int T = int(c.ctx.size());
    for (int t = 0; t < T; ++t) {
      seq.push_back(t / c.run % c.n_seq);
      n_ctx.push_back(c.ctx[size_t(t)]);
    }
    keys = make_keys(random_vec(size_t(pg.n_slots() * c.dim), rng), pg.n_slots(), c.dim, dtype);
    q = random_vec(size_t(T) * c.heads * c.dim, rng);
    w = random_vec(size_t(T) * c.heads, rng, 0.1f);
    q16.resize(q.size());
    for (size_t i = 0; i < q.size(); ++i) q16[i] = index_queries_fp16(dtype) ? f32_to_fp16(q[i]) : f32_to_bf16(q[i]);
    max_ctx = *std::max_element(n_ctx.begin(), n_ctx.end());
  }
  static std::vector<int> lens(const IndexerCase& c) {
    std::vector<int> l(size_t(c.n_seq), 1);
    for (size_t t = 0; t < c.ctx.size(); ++t) {
      const size_t s = t / size_t(c.run) % size_t(c.n_seq);
      l[s] = std::max(l[s], c.ctx[t]);
    }
    return l;
  }
  IndexerArgs args(bool use_q16) const {
    IndexerArgs a;
    a.q = use_q16 ? nullptr : q.data();
    a.q16 = use_q16 ? q16.data() : nullptr;
    a.w = w.data();
    a.T = int64_t(c.ctx.size());
    a.heads = c.heads;
    a.dim = c.dim;
    a.seq = seq.data();
    a.n_ctx = n_ctx.data();
    a.max_ctx = max_ctx;
    a.keys.data = const_cast<uint8_t*>(keys.bytes.data());
    a.keys.row_bytes = keys.row_bytes;
    a.keys.block_size = pg.block_size;
    a.keys.max_blocks = pg.max_blocks;
    a.keys.block_tables = pg.tables.data();
    a.dtype = dtype;
    a.score_stride = max_ctx;
    return a;
  }
};

// A launch's results: the scores (poisoned first, so an unwritten one shows) and the histograms.
constexpr uint32_t kPoison = 0x7fc0dead;
struct Scored {
  std::vector<float> scores;
  std::vector<uint32_t> hist;  // [T][2048] where counted
};

// Runs the mma kernel `choice` as indexer.cu's launch_mma does, with one_wave_tiles for `slots`
// resident blocks; count_k > 0: counts top_k's first digit for rows of more than count_k keys.
// `edit` changes the arguments first.
Scored run_mma(const Problem& p, IndexerMma choice, bool use_q16, int64_t slots, int qfrag_stages, emu::Order order,
               int count_k, const std::function<void(IndexerArgs&)>& edit = {}) {
  IndexerArgs a = p.args(use_q16);
  if (edit) edit(a);
  const int64_t T = a.T;
  Scored r;
  r.scores.resize(size_t(T * p.max_ctx));
  const float poison = bits_to_f32(kPoison);
  std::fill(r.scores.begin(), r.scores.end(), poison);
  a.scores = r.scores.data();
  if (count_k > 0) {
    r.hist.assign(size_t(T) * topk::kMaxBins, 0u);
    a.counts.hist = r.hist.data();
    a.counts.row_words = topk::kMaxBins;
    a.counts.k = count_k;
  }
  auto launch = [&](auto kernel, int threads, int tokens_per_block, auto smem_bytes, auto... extra) {
    const int per_block = one_wave_tiles(a, slots, tokens_per_block);
    const int64_t tiles = (a.max_ctx + kKeysPerTile - 1) / kKeysPerTile;
    const dim3 grid{unsigned((tiles + per_block - 1) / per_block), unsigned(token_groups(a, tokens_per_block))};
    emu::launch(kernel, grid, dim3(unsigned(threads)), smem_bytes(per_block), order, a, per_block, extra...);
  };
  const bool fp8 = p.dtype == KvDtype::FP8;
  if (p.c.dim == 128) {
    if (fp8) dispatch_mma<128, true>(a, choice, qfrag_stages, launch);
    else dispatch_mma<128, false>(a, choice, qfrag_stages, launch);
  } else {
    if (fp8) dispatch_mma<64, true>(a, choice, qfrag_stages, launch);
    else dispatch_mma<64, false>(a, choice, qfrag_stages, launch);
  }
  return r;
}

// The fma kernel as indexer_scores launches it: blocks of 4 warps, one key each.
Scored run_fma(const Problem& p, emu::Order order) {
  IndexerArgs a = p.args(false);
  Scored r;
  r.scores.assign(size_t(a.T * p.max_ctx), bits_to_f32(kPoison));
  a.scores = r.scores.data();
  const dim3 grid(unsigned((a.max_ctx + 3) / 4), unsigned(a.T));
  if (p.dtype == KvDtype::FP8) emu::launch(indexer_fma_kernel<KvDtype::FP8>, grid, dim3(128), 0, order, a);
  else if (p.dtype == KvDtype::F32) emu::launch(indexer_fma_kernel<KvDtype::F32>, grid, dim3(128), 0, order, a);
  else emu::launch(indexer_fma_kernel<KvDtype::BF16>, grid, dim3(128), 0, order, a);
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Scores against model::indexer_score (q rounded as the mma kernel rounds it where `rounded`),
// positions past each row's context unwritten; returns the largest error relative to the summed
// terms' magnitude, sum_h |w_h| sum_i |q_hi k_i| (a dot product that nearly cancels is only as
// exact as its terms; fp32 sums in another order differ by a few ulps of that).
double check_scores(const Problem& p, const std::vector<float>& got, bool rounded, const std::string& what) {
  const int T = int(p.c.ctx.size()), H = p.c.heads, D = p.c.dim;
  std::vector<float> qr = p.q;
  if (rounded)
    for (size_t i = 0; i < qr.size(); ++i)
      qr[i] = index_queries_fp16(p.dtype) ? fp16_to_f32(p.q16[i]) : bf16_to_f32(p.q16[i]);
  std::vector<float> w_abs(p.w), q_abs(qr), k_abs(static_cast<size_t>(D));
  for (float& x : w_abs) x = std::fabs(x);
  for (float& x : q_abs) x = std::fabs(x);
  double worst = 0;
  for (int t = 0; t < T; ++t) {
    const int n = p.n_ctx[size_t(t)];
    for (int pos = 0; pos < p.max_ctx; ++pos) {
      const float g = got[size_t(t * p.max_ctx + pos)];
      if (pos >= n) {
        uint32_t u;
        std::memcpy(&u, &g, 4);
        EXPECT_EQ(u, kPoison) << what << ": token " << t << " position " << pos << " past its context written";
        if (u != kPoison) return 1e30;
        continue;
      }
      const float* key = p.keys.decoded.data() + p.pg.slot(p.seq[size_t(t)], pos) * D;
      for (int i = 0; i < D; ++i) k_abs[size_t(i)] = std::fabs(key[i]);
      const float ref = model::indexer_score(qr.data() + size_t(t) * H * D, p.w.data() + size_t(t) * H, key, H, D);
      const float mag = model::indexer_score(q_abs.data() + size_t(t) * H * D, w_abs.data() + size_t(t) * H,
                                             k_abs.data(), H, D);
      const double err = std::fabs(double(g) - ref) / std::max(mag, 1e-6f);
      worst = std::max(worst, std::isnan(err) ? 1e30 : err);
      EXPECT_LE(err, 2e-5) << what << ": token " << t << " position " << pos << ": emulated " << g << " cpu " << ref;
      if (!(err <= 2e-5)) return 1e30;
    }
  }
  return worst;
}

// The counted histograms against the first digits of the rows' own scores counted here.
void check_counts(const Problem& p, const Scored& r, int k, const std::string& what) {
  const int T = int(p.c.ctx.size());
  for (int t = 0; t < T; ++t) {
    std::vector<uint32_t> want(topk::kMaxBins, 0u);
    const int n = p.n_ctx[size_t(t)];
    if (n > k)
      for (int pos = 0; pos < n; ++pos)
        ++want[topk::order_key(r.scores[size_t(t * p.max_ctx + pos)]) >> topk::digit_shift(0)];
    const std::vector<uint32_t> got(r.hist.begin() + int64_t(t) * topk::kMaxBins,
                                    r.hist.begin() + int64_t(t + 1) * topk::kMaxBins);
    ASSERT_EQ(got, want) << what << ": token " << t << " (n " << n << ", k " << k << ")";
  }
}

// One mma kernel on one problem: fp32 queries with blocks of many tiles (a wave of 2 resident
// blocks) in both orders, counting with k = count_k, then 16-bit queries with blocks of one tile
// (a wide wave) and no count: the same bits throughout, within the bound of the CPU's.
double check_mma(const Problem& p, IndexerMma asked, int count_k, int qfrag_stages = 2) {
  IndexerArgs a = p.args(false);
  a.mma = asked;
  const IndexerMma choice = choose_mma(a, IndexerMma::kAuto);
  const std::string what = std::string(mma_name(choice)) + " (asked " + mma_name(asked) + ") " + dtype_name(p.dtype) +
                           " heads " + std::to_string(p.c.heads) + " dim " + std::to_string(p.c.dim) + " pages of " +
                           std::to_string(p.c.block_size) + " stages " + std::to_string(qfrag_stages);
  const auto t0 = std::chrono::steady_clock::now();
  const Scored fwd = run_mma(p, choice, false, 2, qfrag_stages, emu::Order::kForward, count_k);
  const Scored rev = run_mma(p, choice, false, 2, qfrag_stages, emu::Order::kReversed, count_k);
  EXPECT_TRUE(same_bits(fwd.scores, rev.scores)) << what << ": the threads' order changed the scores";
  EXPECT_EQ(fwd.hist, rev.hist) << what << ": the threads' order changed the counts";
  const Scored wide = run_mma(p, choice, true, 1 << 20, qfrag_stages, emu::Order::kReversed, 0);
  EXPECT_TRUE(same_bits(fwd.scores, wide.scores))
      << what << ": 16-bit queries or one tile per block changed the scores";
  const double err = check_scores(p, fwd.scores, true, what);
  if (count_k > 0) check_counts(p, fwd, count_k, what);
  std::printf("  %s, %d tokens, max ctx %lld: max error %.2e of the summed terms (%.2f s)\n", what.c_str(),
              int(p.c.ctx.size()), (long long)p.max_ctx, err, seconds_since(t0));
  return err;
}

// The GPU test's cases (kIndexerCases), and prefill rows.
const std::vector<IndexerCase> kCases = {
    {64, 128, {1, 63, 64, 65, 1000, 4097}, 3, 64},  // GLM-5 / DeepSeek-V3.2 width
    {32, 128, {300, 17}, 2, 16},                    // 32 heads (GLM-5; tensor-parallel halves)
    {32, 128, {5000, 130}, 2, 128},                 // pages larger than a tile
    {32, 128, {700, 3}, 1, 2},                      // pages too small for 16-byte fp8 runs
    {8, 64, {1, 12, 30}, 1, 16},                    // the fixtures' shape
    {16, 64, {5, 33}, 2, 4},
    {4, 64, {20}, 1, 16},
    {80, 128, {1, 700}, 2, 64},  // more heads than a warp holds
    {128, 64, {130}, 1, 16},
    {16, 128, {300, 64}, 2, 64},   // one m-tile of heads per warp
    {24, 64, {200, 129}, 1, 128},  // padding heads, dim 64 (fp8 rows of 68 bytes)
    prefill(32, 128, 120, 9, 64),  // prefill: 9 tokens of one sequence, crossing a page and a tile
    prefill(64, 128, 60, 6, 16),
};

const IndexerMma kAsked[] = {IndexerMma::kAuto, IndexerMma::kStaged, IndexerMma::kRegs, IndexerMma::kQfrag};

// The kernel SPARSEMLA_INDEXER_MMA names (choose_mma's env_kernel) is taken where the arguments ask
// for none, theirs where they do. (The choice by shape is CudaAttention.IndexerMmaChoiceFollowsTheShape,
// which runs without a GPU too.)
// Arguments for the choice alone (nothing is read): bf16 keys of dim 128 in pages of 64, 16-bit
// queries, aligned.
IndexerArgs choice_args(int heads) {
  alignas(16) static uint8_t fake[64];
  IndexerArgs a;
  a.heads = heads;
  a.dim = 128;
  a.q16 = reinterpret_cast<const uint16_t*>(fake);
  a.keys.data = fake;
  a.keys.block_size = 64;
  a.keys.row_bytes = 256;
  return a;
}

TEST(IndexerOnTheHost, MmaChoiceTakesTheEnvironmentsKernelUnlessTheArgumentsAsk) {
  using M = IndexerMma;
  IndexerArgs a = choice_args(64);
  EXPECT_EQ(choose_mma(a, M::kAuto), M::kQfrag);
  EXPECT_EQ(choose_mma(a, M::kRegs), M::kRegs);
  EXPECT_EQ(choose_mma(a, M::kStaged), M::kStaged);
  a.mma = M::kStaged;
  EXPECT_EQ(choose_mma(a, M::kRegs), M::kStaged);
  a.mma = M::kRegs;
  EXPECT_EQ(choose_mma(a, M::kQfrag), M::kRegs);
}

// Every case, both key formats, each kernel asked for (the ones that fall back run once), counting
// the first digit for rows of more than 100 keys.
TEST(IndexerOnTheHost, MmaScoresMatchTheCpuReference) {
  std::mt19937 rng(2);
  double worst = 0;
  for (const IndexerCase& c : kCases)
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
      const Problem p(c, d, rng);
      std::vector<IndexerMma> done;
      for (IndexerMma asked : kAsked) {
        IndexerArgs a = p.args(false);
        a.mma = asked;
        const IndexerMma choice = choose_mma(a, IndexerMma::kAuto);
        if (std::find(done.begin(), done.end(), choice) != done.end()) continue;
        done.push_back(choice);
        worst = std::max(worst, check_mma(p, asked, 100));
        if (HasFailure()) return;
      }
    }
  std::printf("  max error %.2e\n", worst);
}

// Three stages of the qfrag kernel (SPARSEMLA_INDEXER_QFRAG_STAGES=3) on each head grouping.
TEST(IndexerOnTheHost, QfragThreeStages) {
  std::mt19937 rng(7);
  for (int heads : {16, 32, 64})
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
      const Problem p({heads, 128, {700, 65, 1}, 2, 64}, d, rng);
      check_mma(p, IndexerMma::kQfrag, 100, 3);
      if (HasFailure()) return;
    }
}

// Decode rows at longer context, few resident blocks: every block streams more tiles than its ring
// has stages (IndexerScoresOneLongRow, shorter); the counts with top_k's k = 2048.
TEST(IndexerOnTheHost, LongRowsStreamManyTiles) {
  std::mt19937 rng(12);
  for (KvDtype d : {KvDtype::BF16, KvDtype::FP8}) {
    check_mma(Problem({32, 128, {12000}, 1, 64}, d, rng), IndexerMma::kAuto, 2048);
    for (IndexerMma asked : {IndexerMma::kStaged, IndexerMma::kRegs, IndexerMma::kQfrag}) {
      if (d == KvDtype::FP8 && asked == IndexerMma::kRegs) continue;  // (falls back to staged)
      check_mma(Problem({64, 128, {2000, 1995, 1936, 2001}, 4, 64}, d, rng), asked, 2048);
      if (HasFailure()) return;
    }
    check_mma(Problem({16, 128, {12000}, 1, 64}, d, rng), IndexerMma::kQfrag, 2048);  // one warp of one m-tile
  }
}

// The tokens kernel (several tokens of a sequence per block sharing each key tile) against the CPU
// and, bit for bit, against the qfrag kernel, whose sums it keeps: prefill rows of one sequence
// (causal: each token sees one key more than the one before), runs of two and three sequences in
// turn whose boundaries fall inside a block (and round-robin ones, every token of a block another
// sequence's), each head grouping (16, 32 with and without padding, 48 and 64: two warps per token),
// dims 64 and 128, pages smaller than a tile (bf16) and larger; a last group of fewer tokens than a
// block holds. Can fail: a block's tiles shared by tokens of different sequences would score one
// sequence's keys for the other.
TEST(IndexerOnTheHost, TokensKernelGivesTheQfragBits) {
  std::mt19937 rng(21);
  std::vector<IndexerCase> cases = {
      prefill(32, 128, 100, 40, 64),  // GLM-5: 8 tokens per block, 5 blocks of tokens
      prefill(64, 128, 0, 21, 128),   // DeepSeek-V3.2: 4 per block, from position 0 (keys shorter than a tile)
      prefill(16, 64, 250, 19, 64),   // one m-tile per warp
      prefill(24, 128, 30, 9, 64),    // padding heads
      prefill(48, 64, 70, 11, 64),    // three m-tiles: two warps per token, one padded
  };
  {
    IndexerCase c = prefill(32, 128, 0, 0, 64);  // two sequences in runs of 13, then 7 of the first
    c.n_seq = 2;
    c.run = 13;
    for (int t = 0; t < 33; ++t) c.ctx.push_back(300 + 5 * t);
    cases.push_back(c);
    c = IndexerCase{64, 128, {}, 3, 64, 5};  // three sequences, runs of 5 (blocks of 4 tokens)
    for (int t = 0; t < 30; ++t) c.ctx.push_back(150 + 11 * t);
    cases.push_back(c);
    cases.push_back(IndexerCase{32, 128, {90, 400, 33, 700, 5, 64, 65, 128, 1}, 3, 64});  // round-robin
  }
  for (KvDtype d : {KvDtype::BF16, KvDtype::FP8})
    for (const IndexerCase& c : cases) {
      const Problem p(c, d, rng);
      IndexerArgs a = p.args(false);
      a.tokens_per_run = kIndexerTokensMinRun;
      ASSERT_EQ(choose_mma(a, IndexerMma::kAuto), IndexerMma::kTokens) << "heads " << c.heads;
      check_mma(p, IndexerMma::kTokens, 0);
      const Scored qfrag = run_mma(p, IndexerMma::kQfrag, true, 2, 2, emu::Order::kForward, 0);
      const Scored tokens = run_mma(p, IndexerMma::kTokens, true, 2, 2, emu::Order::kForward, 0);
      EXPECT_TRUE(same_bits(tokens.scores, qfrag.scores))
          << dtype_name(d) << " heads " << c.heads << " dim " << c.dim << ": the tokens kernel's scores are not qfrag's";
      if (HasFailure()) return;
    }
  // Pages smaller than a tile (the serving cache's 16 slots, and 32 at dim 64: fp8 rows copied a page
  // at a time); qfrag takes fp8 keys only in pages of whole tiles, so those are against the CPU only.
  for (auto [c, d] : {std::pair{prefill(32, 128, 40, 17, 16), KvDtype::BF16},
                      std::pair{prefill(32, 128, 200, 19, 16), KvDtype::FP8},
                      std::pair{prefill(64, 64, 90, 10, 32), KvDtype::FP8}}) {
    const Problem p(c, d, rng);
    check_mma(p, IndexerMma::kTokens, 0);
    if (d == KvDtype::BF16)
      EXPECT_TRUE(same_bits(run_mma(p, IndexerMma::kTokens, true, 2, 2, emu::Order::kForward, 0).scores,
                            run_mma(p, IndexerMma::kQfrag, true, 2, 2, emu::Order::kForward, 0).scores));
  }
}

// Where the tokens kernel is taken: runs of 8 tokens or more on average, the qfrag kernel's shapes,
// nothing counted; asked for elsewhere, the default choice.
TEST(IndexerOnTheHost, TokensKernelTakesRunsOfOneSequence) {
  using M = IndexerMma;
  IndexerArgs a = choice_args(32);
  a.T = 4096;
  EXPECT_EQ(choose_mma(a, M::kAuto), M::kQfrag);  // one token per run: a decode batch
  a.tokens_per_run = 7;
  EXPECT_EQ(choose_mma(a, M::kAuto), M::kQfrag);
  a.tokens_per_run = 8;
  EXPECT_EQ(choose_mma(a, M::kAuto), M::kTokens);
  EXPECT_EQ(choose_mma(a, M::kQfrag), M::kQfrag);  // SPARSEMLA_INDEXER_MMA=qfrag
  a.dtype = KvDtype::FP8;
  a.keys.row_bytes = 132;
  EXPECT_EQ(choose_mma(a, M::kAuto), M::kTokens);
  a.keys.block_size = 16;  // the serving cache's pages: fp8 rows copied a page at a time
  EXPECT_EQ(choose_mma(a, M::kAuto), M::kTokens);
  a.keys.block_size = 2;  // runs of 264 bytes: no 16-byte copies
  EXPECT_EQ(choose_mma(a, M::kAuto), M::kStaged);
  a.dtype = KvDtype::BF16;
  a.keys.row_bytes = 256;
  EXPECT_EQ(choose_mma(a, M::kAuto), M::kTokens);
  uint32_t hist[1];
  a.counts.hist = hist;  // counting: the kernels that count
  EXPECT_EQ(choose_mma(a, M::kAuto), M::kQfrag);
  a.counts.hist = nullptr;
  a.heads = 80;  // more heads than its warps hold
  EXPECT_EQ(choose_mma(a, M::kAuto), M::kStaged);
  a.tokens_per_run = 1;
  a.heads = 32;
  EXPECT_EQ(choose_mma(a, M::kTokens), M::kTokens);  // asked for by name
  a.T = 1;
  EXPECT_EQ(choose_mma(a, M::kTokens), M::kQfrag);  // one token: the default
}

// The fma kernel: every case on bf16, fp8 and f32 keys, and shapes only it takes.
TEST(IndexerOnTheHost, FmaScoresMatchTheCpuReference) {
  std::mt19937 rng(3);
  std::vector<IndexerCase> cases = {kCases[1], kCases[4], kCases[5], kCases[10], kCases[11]};
  double worst = 0;
  for (const IndexerCase& c : cases)
    for (KvDtype d : {KvDtype::BF16, KvDtype::FP8, KvDtype::F32}) {
      const Problem p(c, d, rng);
      const auto t0 = std::chrono::steady_clock::now();
      const Scored fwd = run_fma(p, emu::Order::kForward), rev = run_fma(p, emu::Order::kReversed);
      EXPECT_TRUE(same_bits(fwd.scores, rev.scores)) << "fma: the threads' order changed the scores";
      const double err = check_scores(p, fwd.scores, false, std::string("fma ") + dtype_name(d));
      worst = std::max(worst, err);
      std::printf("  fma %s heads %d dim %d: max error %.2e (%.2f s)\n", dtype_name(d), c.heads, c.dim, err,
                  seconds_since(t0));
      if (HasFailure()) return;
    }
  for (auto [c, d] : {std::pair{IndexerCase{6, 40, {9, 70}, 2, 16}, KvDtype::BF16},
                      std::pair{IndexerCase{3, 96, {50}, 1, 8}, KvDtype::FP8}}) {
    const Problem p(c, d, rng);
    const Scored fwd = run_fma(p, emu::Order::kForward), rev = run_fma(p, emu::Order::kReversed);
    EXPECT_TRUE(same_bits(fwd.scores, rev.scores));
    worst = std::max(worst, check_scores(p, fwd.scores, false, "fma odd shape"));
  }
  std::printf("  fma max error %.2e\n", worst);
}

// index_queries' kernel (the indexer's queries and head weights in one launch, attention.h) against
// ops::Rope::apply and the scaling attention.h states, in both thread orders: the rotated fp32 queries
// in place, the weights times w_scale, and the 16-bit copy rounded to nearest; for fp8 keys (fp16
// queries) each head's row scaled by fp16_query_factor (paged_test_util.h) and its weight divided
// by it, so that queries far past fp16's
// range (gain 1e6) or below its normal numbers (1e-7) keep their precision; bf16 rows unscaled.
TEST(IndexerOnTheHost, QueriesRotatedAndScaledIntoTheirType) {
  std::mt19937 rng(48);
  const ops::Rope rope = test::plain_rope(64, 1e4f);
  for (auto [T, heads, dim] : std::vector<std::tuple<int, int, int>>{{2, 8, 128}, {1, 13, 96}, {3, 4, 64}})
    for (ops::RopeStyle style : {ops::RopeStyle::HalfSplit, ops::RopeStyle::Interleaved})
      for (bool fp16 : {true, false})
        for (float gain : {3.0f, 1e6f, 1e-7f}) {
          if (!fp16 && gain != 3.0f) continue;
          const size_t n = size_t(T) * heads * dim;
          const std::vector<float> q = random_vec(n, rng, gain), w = random_vec(size_t(T) * heads, rng, 1.0f);
          std::vector<int64_t> pos(static_cast<size_t>(T));
          for (auto& p : pos) p = int64_t(rng() % 150000);
          const float ws = 1.0f / std::sqrt(float(heads * dim));
          std::vector<float> want_q(q);
          for (int t = 0; t < T; ++t)
            for (int h = 0; h < heads; ++h) rope.apply(want_q.data() + (size_t(t) * heads + h) * dim, pos[size_t(t)], style);
          const RopeTable table{rope.inv_freq().data(), rope.dims() / 2, rope.attn_factor(),
                                style == ops::RopeStyle::Interleaved};
          const std::string what = "T " + std::to_string(T) + " heads " + std::to_string(heads) + " dim " +
                                   std::to_string(dim) + (fp16 ? " fp16" : " bf16") + " gain " + std::to_string(gain);
          for (emu::Order order : {emu::Order::kForward, emu::Order::kReversed}) {
            std::vector<float> got_q(q), got_w(w);
            std::vector<uint16_t> got16(n, 0xFFFF);
            const dim3 grid(unsigned(T), unsigned((heads + 7) / 8)), block(32, 8);
            if (fp16)
              emu::launch(index_queries_kernel<__half>, grid, block, 0, order, got_q.data(), got_w.data(), heads, dim,
                          table, pos.data(), ws, reinterpret_cast<__half*>(got16.data()));
            else
              emu::launch(index_queries_kernel<__nv_bfloat16>, grid, block, 0, order, got_q.data(), got_w.data(), heads,
                          dim, table, pos.data(), ws, reinterpret_cast<__nv_bfloat16*>(got16.data()));
            for (size_t i = 0; i < n; ++i)
              ASSERT_NEAR(got_q[i], want_q[i], gain * (6e-6 + 3e-8)) << what << ": query value " << i;
            // Each row's factor from the kernel's own rotated values (checked above; the CPU's may
            // differ in a last bit, which at a power of two would move the factor).
            std::vector<float> want_w(w), f(w.size(), 1.0f);
            for (size_t r = 0; r < w.size(); ++r) {
              want_w[r] *= ws;
              if (!fp16) continue;
              f[r] = fp16_query_factor(got_q.data() + r * size_t(dim), dim);
              want_w[r] /= f[r];
            }
            ASSERT_EQ(got_w, want_w) << what << ": head weights";
            for (size_t i = 0; i < n; ++i) {
              const float scaled = got_q[i] * f[i / size_t(dim)];
              ASSERT_EQ(got16[i], fp16 ? f32_to_fp16(scaled) : f32_to_bf16(scaled)) << what << ": 16-bit query " << i;
              if (fp16) {
                ASSERT_TRUE(std::isfinite(fp16_to_f32(got16[i]))) << what << ": query " << i;
                ASSERT_TRUE(got_q[i] == 0.0f || fp16_to_f32(got16[i]) != 0.0f) << what << ": query " << i << " lost";
              }
            }
          }
        }
}

// The qfrag kernel doing index_queries' work itself (IndexerArgs::prep: the products' q and w as
// they stand, the rope, w_scale and the 16-bit rounding and fp16 scaling in its prologue) gives the
// scores of index_queries (emulated) then qfrag on its q16 and w, bit for bit: one-token rows and a
// few tokens of several sequences, GLM-5's 32 heads, DeepSeek-V3.2's 64, one m-tile at dim 64,
// padding heads; bf16 and fp8 keys (fp16 queries, at a gain of 3 and of 1e6, where the power-of-two
// factor matters); both rope styles; the block's threads in both orders.
TEST(IndexerOnTheHost, QfragPreparesTheQueriesWithIndexQueriesBits) {
  std::mt19937 rng(55);
  const ops::Rope rope = test::plain_rope(64, 1e4f);
  const std::vector<IndexerCase> cases = {
      IndexerCase{32, 128, {3000}, 1, 64},             // GLM-5, one decode token
      IndexerCase{64, 128, {700, 130, 2100}, 3, 64},   // DeepSeek-V3.2, three sequences
      IndexerCase{16, 64, {500, 90}, 2, 64},           // one m-tile
      IndexerCase{24, 128, {260, 1000}, 2, 64}};       // padding heads
  for (KvDtype d : {KvDtype::BF16, KvDtype::FP8})
    for (const IndexerCase& c : cases)
      for (ops::RopeStyle style : {ops::RopeStyle::HalfSplit, ops::RopeStyle::Interleaved})
        for (float gain : {3.0f, 1e6f}) {
          if (d == KvDtype::BF16 && gain != 3.0f) continue;
          Problem p(c, d, rng);
          for (float& x : p.q) x *= gain;
          const int T = int(c.ctx.size());
          std::vector<int64_t> pos(static_cast<size_t>(T));
          for (int t = 0; t < T; ++t) pos[size_t(t)] = c.ctx[size_t(t)] - 1;
          const RopeTable table{rope.inv_freq().data(), rope.dims() / 2, rope.attn_factor(),
                                style == ops::RopeStyle::Interleaved};
          const float ws = 1.0f / std::sqrt(float(c.heads * c.dim));
          const std::string what = std::string(dtype_name(d)) + " heads " + std::to_string(c.heads) + " dim " +
                                   std::to_string(c.dim) + (style == ops::RopeStyle::Interleaved ? " interleaved" : "") +
                                   " gain " + std::to_string(gain);
          // The unfused chain: index_queries' kernel, then qfrag on its 16-bit queries and weights.
          std::vector<float> q_rot(p.q), w_sc(p.w);
          std::vector<uint16_t> q16(p.q.size());
          const dim3 grid(unsigned(T), unsigned((c.heads + 7) / 8)), block(32, 8);
          if (d == KvDtype::FP8)
            emu::launch(index_queries_kernel<__half>, grid, block, 0, emu::Order::kForward, q_rot.data(), w_sc.data(),
                        c.heads, c.dim, table, pos.data(), ws, reinterpret_cast<__half*>(q16.data()));
          else
            emu::launch(index_queries_kernel<__nv_bfloat16>, grid, block, 0, emu::Order::kForward, q_rot.data(),
                        w_sc.data(), c.heads, c.dim, table, pos.data(), ws,
                        reinterpret_cast<__nv_bfloat16*>(q16.data()));
          const Scored want = run_mma(p, IndexerMma::kQfrag, true, 2, 2, emu::Order::kForward, 0, [&](IndexerArgs& a) {
            a.q16 = q16.data();
            a.w = w_sc.data();
          });
          for (emu::Order order : {emu::Order::kForward, emu::Order::kReversed}) {
            const Scored got = run_mma(p, IndexerMma::kQfrag, false, 2, 2, order, 0, [&](IndexerArgs& a) {
              a.prep.rope = table;
              a.prep.pos = pos.data();
              a.prep.w_scale = ws;
            });
            ASSERT_TRUE(same_bits(got.scores, want.scores))
                << what << (order == emu::Order::kReversed ? ", threads in reverse" : "")
                << ": not the scores of index_queries then qfrag";
          }
          // (and the chain's scores are the model's: the CPU reference on the rotated queries)
          p.q = q_rot;
          p.w = w_sc;
          for (size_t i = 0; i < q16.size(); ++i) p.q16[i] = q16[i];
          check_scores(p, want.scores, true, what);
        }
}

}  // namespace
}  // namespace sparsemla::cuda
