// The sparse MLA launch rule (plan_sparse_mla, sparse_mla.cu) on the limits of the devices the engine
// targets, where there is no GPU: whatever the shape, batch, context and cache format, there is a
// launch (never a refusal), it fits the device's shared memory, its splits cover the rows, and the
// rule's documented choices hold (sparse_mla.cu, docs/PERFORMANCE.md sessions 20, 35): tile pairs
// only for the bf16-tile kernel at 16 or 32 heads with two stages and two tiles per split, and never
// on the 99 KB devices; 16 heads per block for bf16 rows up to 512 (token, head) rows where tile
// pairs fit; the fp8-row kernel from 8 tokens where an SM holds two of its blocks; the Hopper kernel
// handed back to the mma kernel for small bf16 batches. The properties are the rule's statement;
// the GPU tests (CudaAttention.SparseMla*) check that what is launched computes the right thing.
#include <gtest/gtest.h>

#if SPARSEMLA_HAVE_CUDA

#include <string>
#include <vector>

#include "ops/cuda/attention_smem.h"
#include "ops/cuda/sparse_mla_plan.h"
#include "util/error.h"

namespace sparsemla::cuda {
namespace {

struct DeviceLimits {
  std::string name;
  int sms, optin, per_sm;
  bool hopper;  // sm_90a: the wgmma kernel exists
};

// Published limits (CUDA programming guide, compute capabilities table): opt-in shared memory per
// block and per SM; SM counts of the named parts.
const std::vector<DeviceLimits> kDevices = {
    {"H100 SXM (SM90)", 132, 227 * 1024, 228 * 1024, true}, {"H200 (SM90)", 132, 227 * 1024, 228 * 1024, true},
    {"A100 (SM80)", 108, 163 * 1024, 164 * 1024, false},    {"B200 (SM100)", 148, 227 * 1024, 228 * 1024, false},
    {"L40S (SM89)", 142, 99 * 1024, 100 * 1024, false},     {"RTX 3090 (SM86)", 82, 99 * 1024, 100 * 1024, false},
    {"RTX PRO 6000 (SM120)", 188, 99 * 1024, 100 * 1024, false},
};

struct Shape {
  std::string name;
  int heads;
};
// GLM-5 (64 heads; 8-32 per GPU under tensor parallelism) and DeepSeek-V3.2 (128), latent 512 + 64.
const std::vector<Shape> kShapes = {{"glm5", 64}, {"glm5/tp2", 32}, {"glm5/tp4", 16}, {"glm5/tp8", 8},
                                    {"dsv32", 128}};

AttentionArgs args(int heads, int64_t T, KvDtype d, int64_t ctx, bool sparse) {
  AttentionArgs a;
  a.T = T;
  a.heads = heads;
  a.kv_lora = 512;
  a.rope = 64;
  a.max_ctx = ctx;
  static const int32_t dummy = 0;
  a.selected = sparse ? &dummy : nullptr;  // (the plan reads no pointer)
  a.top_k = sparse ? 2048 : 0;
  a.selected_front = sparse;
  a.dtype = d;
  a.latent.row_bytes = d == KvDtype::FP8 ? mla_smem::fp8_latent_row_bytes(512, 64) : (512 + 64) * 2;
  return a;
}

int64_t rows_of(const AttentionArgs& a) {
  return a.selected ? std::min<int64_t>(a.top_k, a.max_ctx) : a.max_ctx;
}

TEST(SparseMlaPlan, EveryDeviceHasALaunchThatFitsAndFollowsTheRule) {
  int plans = 0;
  for (const DeviceLimits& dev : kDevices)
    for (const Shape& sh : kShapes)
      for (KvDtype d : {KvDtype::BF16, KvDtype::FP8})
        for (int64_t T : {1, 2, 3, 4, 7, 8, 16, 64, 128})
          for (int64_t ctx : {100, 1024, 4096, 131072})
            for (bool sparse : {true, false})
              for (bool pairs_allowed : {true, false})
                for (AttentionKernel k : {AttentionKernel::Mma, AttentionKernel::Wgmma}) {
                  if (k == AttentionKernel::Wgmma && !dev.hopper) continue;
                  if (!sparse && ctx > 4096) continue;  // (dense attention at 128K is not a decode shape)
                  AttentionWorkspace ws;
                  ws.sm_count = dev.sms;
                  ws.smem_optin = dev.optin;
                  ws.device_smem_per_sm = dev.per_sm;
                  ws.tile_pairs = pairs_allowed;
                  const AttentionArgs a = args(sh.heads, T, d, ctx, sparse);
                  const std::string what = dev.name + " " + sh.name + (d == KvDtype::FP8 ? " fp8" : " bf16") +
                                           " T=" + std::to_string(T) + " ctx=" + std::to_string(ctx) +
                                           (sparse ? " sparse" : " dense") + (pairs_allowed ? "" : " no pairs") +
                                           (k == AttentionKernel::Wgmma ? " wgmma" : "");
                  MlaLaunchPlan p;
                  ASSERT_NO_THROW(p = plan_sparse_mla(a, k, ws)) << what;
                  ++plans;
                  // A launch the device holds, over all the rows.
                  ASSERT_TRUE(p.heads_per_block == 16 || p.heads_per_block == 32 || p.heads_per_block == 64) << what;
                  ASSERT_GE(p.splits, 1) << what;
                  const int64_t tiles = std::max<int64_t>(1, (rows_of(a) + 31) / 32);
                  EXPECT_GE(int64_t(p.splits) * p.tiles_per_split, tiles) << what << ": rows left out";
                  EXPECT_LT(int64_t(p.splits - 1) * p.tiles_per_split, tiles) << what << ": an empty split";
                  if (p.kernel == AttentionKernel::Mma) {
                    EXPECT_GT(p.smem, 0u) << what;
                    EXPECT_LE(p.smem, size_t(dev.optin)) << what << ": more shared memory than a block may have";
                  }
                  // The Hopper kernel: small batches go to the mma kernel, the rest keep it: from 64
                  // heads (bulk output stores) below kWgmmaBulkMinRows (128) token-head rows (GLM-5 at
                  // one token); below 64 heads bf16 rows below 8 tokens and 512 token-head rows, fp8
                  // rows below kWgmmaFp8MinRows (256) token-head rows and kWgmmaFp8MinTokens (4) tokens
                  // at 32 heads (GLM-5's share at tensor parallel 2 below 4 tokens); 8 and 16 heads
                  // with fp8 rows never.
                  const bool small = sh.heads >= 64           ? T * sh.heads < 128
                                     : d == KvDtype::BF16 ? T < 8 && T * sh.heads < 512
                                                          : T * sh.heads < 256 && T < 4 && sh.heads >= 32;
                  if (k == AttentionKernel::Wgmma)
                    EXPECT_EQ(p.kernel, small ? AttentionKernel::Mma : AttentionKernel::Wgmma) << what;
                  else
                    EXPECT_EQ(p.kernel, AttentionKernel::Mma) << what;
                  // Tile pairs: where allowed, only for the bf16-tile kernel at 16 or 32 heads with two
                  // stages and at least two tiles per split, and never within 99 KB.
                  if (p.tile_pairs == 2) {
                    EXPECT_TRUE(pairs_allowed) << what;
                    EXPECT_EQ(p.kernel, AttentionKernel::Mma) << what;
                    EXPECT_FALSE(p.fp8_rows) << what;
                    EXPECT_EQ(p.stages, 2) << what;
                    EXPECT_LE(p.heads_per_block, 32) << what;
                    EXPECT_GE(p.tiles_per_split, 2) << what;
                    EXPECT_GT(dev.optin, 99 * 1024) << what << ": tile pairs on a 99 KB device";
                  } else {
                    EXPECT_EQ(p.tile_pairs, 1) << what;
                  }
                  // 16 heads per block for bf16 rows up to 512 (token, head) rows where tile pairs fit
                  // at 16 heads (the launch then takes them wherever a split has two tiles).
                  const bool pairs_fit_16 =
                      mla_smem::tile_pairs_hold(1, false, 512, 64, a.latent.row_bytes, uint64_t(dev.optin));
                  if (p.kernel == AttentionKernel::Mma && d == KvDtype::BF16 && pairs_allowed && pairs_fit_16 &&
                      T * sh.heads <= 512)
                    EXPECT_EQ(p.heads_per_block, 16) << what << ": the 16-heads rule";
                  // The fp8-row kernel from 8 tokens where an SM holds two of its 32-head blocks.
                  if (p.kernel == AttentionKernel::Mma && d == KvDtype::FP8 &&
                      mla_smem::fp8_rows_two_per_sm(uint64_t(dev.per_sm)))
                    EXPECT_EQ(p.fp8_rows, T >= 8) << what;
                  if (d == KvDtype::BF16) EXPECT_FALSE(p.fp8_rows) << what;
                }
  std::printf("  %d launch plans checked\n", plans);
}

// The Hopper kernel's small-batch bounds at the shapes they were measured on (H100, sessions 45-50;
// sparse_mla.cu, plan_mma), stated point by point rather than by the rule's own expression.
TEST(SparseMlaPlan, HopperKernelTakesTheBatchesItWins) {
  AttentionWorkspace ws;
  ws.sm_count = 132;
  ws.smem_optin = 232448;
  ws.device_smem_per_sm = 233472;
  ws.tile_pairs = true;
  const struct {
    int heads;
    int64_t T;
    KvDtype d;
    bool hopper;
  } points[] = {
      // 64 heads or more (bulk output stores, session 50): all but GLM-5 at one token.
      {64, 1, KvDtype::BF16, false}, {64, 2, KvDtype::BF16, true},  {128, 1, KvDtype::BF16, true},
      {64, 1, KvDtype::FP8, false},  {64, 2, KvDtype::FP8, true},   {128, 1, KvDtype::FP8, true},
      // One GPU's share under tensor parallelism (session 49).
      {32, 4, KvDtype::BF16, false}, {32, 8, KvDtype::BF16, true},  {8, 4, KvDtype::BF16, false},
      {8, 8, KvDtype::BF16, true},   {32, 3, KvDtype::FP8, false},  {32, 4, KvDtype::FP8, true},
      {16, 1, KvDtype::FP8, true},   {8, 1, KvDtype::FP8, true},
  };
  for (const auto& pt : points) {
    const MlaLaunchPlan p = plan_sparse_mla(args(pt.heads, pt.T, pt.d, 131072, true), AttentionKernel::Wgmma, ws);
    EXPECT_EQ(p.kernel, pt.hopper ? AttentionKernel::Wgmma : AttentionKernel::Mma)
        << pt.heads << " heads, " << pt.T << " tokens, " << (pt.d == KvDtype::FP8 ? "fp8" : "bf16");
  }
}

// GLM-5 batch 1 at 128K (issue 6's headline shape) on each device: tile pairs at 16 heads where
// they fit; on the 99 KB devices one set of warps, 16 heads with two stages where the SMs are many
// enough for 128 blocks, else 32 heads (the SM count rule).
TEST(SparseMlaPlan, BatchOneAtLongContextTakesTilePairsWhereTheyFit) {
  for (const DeviceLimits& dev : kDevices) {
    AttentionWorkspace ws;
    ws.sm_count = dev.sms;
    ws.smem_optin = dev.optin;
    ws.device_smem_per_sm = dev.per_sm;
    const MlaLaunchPlan p = plan_sparse_mla(args(64, 1, KvDtype::BF16, 131072, true), AttentionKernel::Mma, ws);
    if (dev.optin > 99 * 1024) {
      EXPECT_EQ(p.heads_per_block, 16) << dev.name << ": the 16-heads rule";
      EXPECT_EQ(p.tile_pairs, 2) << dev.name;
      EXPECT_EQ(p.splits, 32) << dev.name << ": 2 tiles per split";
    } else {
      EXPECT_EQ(p.tile_pairs, 1) << dev.name;
      // Fewer heads per block until the blocks come near one per SM: 16 where 32 would leave more
      // than a quarter of the SMs idle (64 blocks), else 32 (one stage within 99 KB).
      EXPECT_EQ(p.heads_per_block, 64 < dev.sms * 3 / 4 ? 16 : 32) << dev.name;
      if (p.heads_per_block == 16) EXPECT_EQ(p.stages, 2) << dev.name << ": two tiles in flight within 99 KB";
    }
  }
}

// The Hopper kernel's split clusters (wgmma_split_cluster_rule): on a model of an H100's cluster
// occupancy, the launches the H100 took in session 53's runs 110-113 (printed by the GPU tests and
// `bench attention`); then, on other occupancies, what the rule promises: never more splits than
// planned, clusters that all fit, the most that fit, pairs kept where their clusters fit, plans
// past 8 (paired) or 16 (unpaired) left to the merge kernel.
TEST(SparseMlaPlan, SplitClustersTakeTheMostSplitsThatFit) {
  // Clusters of n whole-SM blocks an H100 (132 SMs) ran at once, as those runs bound them: n = 2 at
  // least 64 (DeepSeek-V3.2 fp8 at 32 tokens unpaired), 3 at least 32 (GLM-5 at 32 tokens), 4 from 24
  // to 31 (pairs at 24 tokens merged, at 32 not; GLM-5 at 32 tokens not), 5 and 6 below 24 (GLM-5 at
  // 24 tokens took 4), 6 at least 16 (GLM-5 at 16 tokens), 7 below 16, 8 from 12 to 15 (GLM-5 at 12
  // tokens merged 8, pairs at 8 tokens; DeepSeek-V3.2 bf16 at 8 tokens, 16 clusters, not); past 8
  // none (portable clusters).
  const int h100[17] = {0, 132, 66, 33, 28, 22, 20, 15, 14};
  auto on_h100 = [&](int x, int s) { return h100[x * s]; };
  struct Case {
    const char* what;
    int planned;
    bool fp8;
    int64_t blocks_x, T;
    int splits;
    bool pairs;
  };
  const Case seen[] = {
      {"GLM-5 bf16 64 tokens", 2, false, 1, 64, 2, false},     {"GLM-5 bf16 48", 2, false, 1, 48, 2, false},
      {"GLM-5 bf16 32", 4, false, 1, 32, 3, false},            {"GLM-5 bf16 24", 5, false, 1, 24, 4, false},
      {"GLM-5 bf16 16", 8, false, 1, 16, 6, false},            {"GLM-5 bf16 12", 11, false, 1, 12, 8, false},
      {"GLM-5 bf16 8", 16, false, 1, 8, 8, false},             {"GLM-5 bf16 4 (past 16)", 32, false, 1, 4, 32, true},
      {"DeepSeek-V3.2 bf16 8", 8, false, 2, 8, 6, false},      {"DeepSeek-V3.2 bf16 16", 4, false, 2, 16, 3, false},
      {"DeepSeek-V3.2 bf16 32", 2, false, 2, 32, 2, false},    {"DeepSeek-V3.2 fp8 8", 8, true, 2, 8, 4, true},
      {"DeepSeek-V3.2 fp8 16", 4, true, 2, 16, 3, true},       {"DeepSeek-V3.2 fp8 24", 2, true, 2, 24, 2, true},
      {"DeepSeek-V3.2 fp8 32 (unpaired)", 2, true, 2, 32, 2, false},
      {"DeepSeek-V3.2 fp8 4 (paired, past 8)", 16, true, 2, 4, 16, true},
  };
  const int top_k_tiles = 2048 / mla_smem::kRows;
  for (const Case& c : seen) {
    const WgmmaClusterSplits r =
        wgmma_split_cluster_rule(c.planned, true, c.fp8, c.blocks_x, c.T, top_k_tiles, true, on_h100);
    EXPECT_EQ(r.splits, c.splits) << c.what;
    if (c.fp8) EXPECT_EQ(r.pairs, c.pairs) << c.what;
  }
  // Pair clusters off: pairs keep the plan (the merge kernel), unpaired shapes are unaffected.
  EXPECT_EQ(wgmma_split_cluster_rule(8, true, true, 2, 8, top_k_tiles, false, on_h100).splits, 8);
  EXPECT_TRUE(wgmma_split_cluster_rule(8, true, true, 2, 8, top_k_tiles, false, on_h100).pairs);
  EXPECT_EQ(wgmma_split_cluster_rule(16, true, false, 1, 8, top_k_tiles, false, on_h100).splits, 8);
  // A short context (700 rows: 22 tiles) planned 11 ways has 64 rows per split: the launch would not
  // pair it, so it is an unpaired plan of 9-16 and merges as unpaired clusters (12 of 8 blocks fit).
  const WgmmaClusterSplits short_ctx = wgmma_split_cluster_rule(11, true, true, 2, 6, 22, true, on_h100);
  EXPECT_EQ(short_ctx.splits, 8);
  EXPECT_FALSE(short_ctx.pairs);

  // Other occupancies: n blocks a cluster fit cap / n clusters, or none past a largest size (16: the
  // device would take clusters past the portable 8, which the rule must still not ask for).
  for (int cap : {8, 40, 100, 132, 188})
    for (int largest : {2, 4, 8, 16})
      for (int tiles : {2, 8, 22, 64})
        for (int planned = 1; planned <= 40; ++planned)
          for (int64_t T = 1; T <= 80; T += 3)
            for (int64_t bx : {1, 2, 3})
              for (bool fp8 : {false, true})
                for (bool pairs : {false, true})
                  for (bool pair_clusters : {true, false}) {
                    auto fit = [&](int x, int s) { return x * s <= largest ? cap / (x * s) : 0; };
                    const WgmmaClusterSplits r =
                        wgmma_split_cluster_rule(planned, pairs, fp8, bx, T, tiles, pair_clusters, fit);
                    const bool paired_plan = wgmma_pairs_at(pairs, fp8, bx, tiles, planned);
                    const std::string what =
                        "cap " + std::to_string(cap) + " largest " + std::to_string(largest) + " tiles " +
                        std::to_string(tiles) + " planned " + std::to_string(planned) + " T " + std::to_string(T) +
                        " blocks " + std::to_string(bx) + (fp8 ? " fp8" : " bf16") + (pairs ? " pairs" : "") +
                        (pair_clusters ? "" : " (pair clusters off)");
                    ASSERT_LE(r.splits, planned) << what;
                    ASSERT_GE(r.splits, 1) << what;
                    if (r.pairs) EXPECT_TRUE(pairs) << what << ": paired where the caller did not allow it";
                    const bool kept = r.splits == planned && r.pairs == pairs;
                    if (planned < 2 || planned > (paired_plan ? 8 : 16) || (paired_plan && !pair_clusters)) {
                      EXPECT_TRUE(kept) << what << ": a plan the rule leaves alone";
                      continue;
                    }
                    const bool as_pairs = paired_plan && r.pairs;
                    const int x = as_pairs ? 2 : 1;
                    const int64_t need = bx / x * T;
                    const bool fits = r.splits >= 2 && r.splits <= 8 / x && fit(x, r.splits) >= need;
                    if (!kept || fits) {
                      // Merged in clusters: they all fit, within a portable cluster's 8 blocks, and one
                      // more split (within the plan and those 8 blocks) would not; pairs keep their rows.
                      EXPECT_TRUE(fits) << what << ": " << r.splits << " splits whose clusters do not all fit";
                      if (r.splits < planned && r.splits < 8 / x) EXPECT_LT(fit(x, r.splits + 1), need) << what;
                      if (as_pairs) EXPECT_TRUE(wgmma_pairs_at(pairs, fp8, bx, tiles, r.splits)) << what;
                      // Unpaired where pairs were possible: no pair cluster fits.
                      if (paired_plan && !r.pairs)
                        for (int s = 2; s <= std::min(planned, 4); ++s) EXPECT_LT(fit(2, s), bx / 2 * T) << what;
                    } else {
                      // Left to the merge kernel: no cluster of 2 .. min(plan, 8) splits fits, paired
                      // (up to 4) or not.
                      for (int s = 2; s <= std::min(planned, 8); ++s) EXPECT_LT(fit(1, s), bx * T) << what << " s " << s;
                      if (paired_plan)
                        for (int s = 2; s <= std::min(planned, 4); ++s) EXPECT_LT(fit(2, s), bx / 2 * T) << what;
                    }
                  }
}

// Shapes no kernel takes, and a workspace without the device's limits, are refused with the reason.
TEST(SparseMlaPlan, RefusesWhatNoKernelTakes) {
  AttentionWorkspace ws;
  AttentionArgs a = args(64, 1, KvDtype::BF16, 4096, true);
  EXPECT_THROW(plan_sparse_mla(a, AttentionKernel::Mma, ws), Error) << "no device limits";
  ws.sm_count = 132, ws.smem_optin = 227 * 1024, ws.device_smem_per_sm = 228 * 1024;
  EXPECT_NO_THROW(plan_sparse_mla(a, AttentionKernel::Mma, ws));
  EXPECT_THROW(plan_sparse_mla(a, AttentionKernel::Mma, ws, 0, 48), Error) << "48 heads per block";
  a.dtype = KvDtype::F32;
  EXPECT_THROW(plan_sparse_mla(a, AttentionKernel::Mma, ws), Error) << "f32 rows take the fma kernel";
  EXPECT_EQ(plan_sparse_mla(a, AttentionKernel::Fma, ws).kernel, AttentionKernel::Fma);
  a = args(64, 1, KvDtype::BF16, 4096, true);
  a.kv_lora = 500;
  EXPECT_THROW(plan_sparse_mla(a, AttentionKernel::Mma, ws), Error) << "kv_lora not a multiple of 8";
}

}  // namespace
}  // namespace sparsemla::cuda

#else

TEST(SparseMlaPlan, NeedsCuda) { GTEST_SKIP() << "built without CUDA"; }

#endif
