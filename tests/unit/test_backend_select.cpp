// The backend selector: for every GPU generation and the shapes of GLM-5, DeepSeek-V3.2, tensor-
// parallel slices and the fixtures, which kernels are taken, and that there is always a candidate.
#include <gtest/gtest.h>

#include "ops/device.h"
#include "ops/select/select.h"

namespace sparsemla::ops {
namespace {

AttentionProblem gpu(int major, int minor, uint64_t smem, int heads, int kv_lora, int rope, int idx_heads, int idx_dim,
                     bool fp8 = false) {
  AttentionProblem p;
  p.cuda = true;
  p.device_name = "test GPU";
  p.cc_major = major;
  p.cc_minor = minor;
  p.smem_optin = smem;
  p.heads = heads;
  p.kv_lora = kv_lora;
  p.rope = rope;
  p.idx_heads = idx_heads;
  p.idx_dim = idx_dim;
  p.sparse = idx_heads > 0;
  p.fp8_cache = fp8;
  p.sm90a_code = true;  // as the full fatbinary (80..121) builds it
  return p;
}

const Candidate& candidate(const Selection& s, const std::string& name) {
  for (const Candidate& c : s.candidates)
    if (c.name == name) return c;
  throw std::runtime_error("no candidate " + name);
}

TEST(BackendSelect, EveryArchitectureFromSm80ToSm121TakesTheTensorCoreKernels) {
  // Shared memory per block (opt-in) as the drivers report it: A100 163 KB, RTX 30/40 99 KB, H100/H200
  // 227 KB, B200 227 KB, RTX PRO 6000 / RTX 50 / DGX Spark 99 KB.
  const struct {
    int major, minor;
    uint64_t smem;
  } archs[] = {{8, 0, 166912}, {8, 6, 101376}, {8, 9, 101376}, {9, 0, 232448},
               {10, 0, 232448}, {12, 0, 101376}, {12, 1, 101376}};
  for (const auto& a : archs)
    for (int heads : {128, 64, 32, 16, 8})
      for (bool fp8 : {false, true}) {
        const AttentionProblem p = gpu(a.major, a.minor, a.smem, heads, 512, 64, 32, 128, fp8);
        const BackendPlan plan = select_backends(p);
        EXPECT_EQ(plan.get("indexer").chosen, "cuda-mma") << a.major << "." << a.minor;
        EXPECT_EQ(plan.get("top-k").chosen, "cuda-radix");
        // Hopper takes its wgmma kernel at every head count (tensor-parallel shares of 8-32 heads pad a
        // block of 64; the launch gives small batches to the mma kernel); every other architecture never does.
        const bool hopper = a.major == 9 && a.minor == 0;
        EXPECT_EQ(plan.get("attention").chosen, hopper ? "cuda-wgmma-sm90" : "cuda-mma")
            << a.major << "." << a.minor << " heads " << heads;
        const Candidate& wg = candidate(plan.get("attention"), "cuda-wgmma-sm90");
        EXPECT_EQ(wg.supported, hopper) << a.major << "." << a.minor << ": " << wg.reason;
        if (!hopper) EXPECT_NE(wg.reason.find("is not 9.0"), std::string::npos) << wg.reason;
        EXPECT_TRUE(plan.warnings.empty()) << plan.warnings[0];
      }
}

TEST(BackendSelect, HopperWgmmaKernelDeclaresWhatItTakes) {
  // GLM-5 and DeepSeek-V3.2 on an H100/H200, bf16 and fp8 caches, sparse and dense.
  for (int heads : {64, 128})
    for (bool fp8 : {false, true})
      for (bool sparse : {true, false}) {
        AttentionProblem p = gpu(9, 0, 232448, heads, 512, 64, 32, 128, fp8);
        p.sparse = sparse;
        EXPECT_EQ(select_backends(p).get("attention").chosen, "cuda-wgmma-sm90") << heads << " heads fp8 " << fp8;
      }
  // What it refuses, each with its reason, falls back to cuda-mma.
  auto refused = [](const AttentionProblem& p, const std::string& why) {
    const BackendPlan plan = select_backends(p);
    EXPECT_EQ(plan.get("attention").chosen, p.f32_cache ? "cuda-fma" : "cuda-mma") << why;
    const std::string reason = candidate(plan.get("attention"), "cuda-wgmma-sm90").reason;
    EXPECT_NE(reason.find(why), std::string::npos) << reason;
  };
  AttentionProblem p = gpu(9, 0, 232448, 128, 512, 64, 64, 128);
  p.sm90a_code = false;  // a build without 90 in its architecture list (CI's 80)
  refused(p, "no sm_90a machine code");
  p = gpu(9, 0, 232448, 128, 512, 64, 64, 128);
  p.f32_cache = true;
  refused(p, "f32");
  refused(gpu(9, 0, 232448, 64, 256, 32, 8, 64), "latent 256 + rope 32 is not 512 + 64");
  // DeepSeek-V3.2 at tensor parallel 8 (16 heads) and GLM-5 at 8 (8 heads): padded blocks of 64.
  for (int heads : {16, 8})
    EXPECT_EQ(select_backends(gpu(9, 0, 232448, heads, 512, 64, 64, 128)).get("attention").chosen, "cuda-wgmma-sm90");
  refused(gpu(9, 0, 232448, 4, 512, 64, 32, 128), "4 heads is fewer than 8");  // GLM-5 at tensor parallel 16
  refused(gpu(9, 0, 101376, 64, 512, 64, 32, 128), "101376");   // a 9.0 device with less shared memory
  // Same-major neighbours are not Hopper.
  refused(gpu(9, 1, 232448, 64, 512, 64, 32, 128), "9.1");
  p = gpu(9, 0, 232448, 128, 512, 64, 64, 128);
  const std::string table = format_plan(p, select_backends(p));
  EXPECT_NE(table.find("* cuda-wgmma-sm90 chosen: Hopper wgmma"), std::string::npos) << table;
  EXPECT_NE(table.find("+ cuda-mma        supported, lower rank"), std::string::npos) << table;
}

TEST(BackendSelect, FixtureShapesAndOddShapesFallBackWithReasons) {
  // The fixtures' indexers (8 heads x 64) take the mma kernel; a 96-dim indexer takes the fma one.
  BackendPlan plan = select_backends(gpu(9, 0, 232448, 2, 24, 8, 8, 64));
  EXPECT_EQ(plan.get("indexer").chosen, "cuda-mma");
  EXPECT_EQ(plan.get("attention").chosen, "cuda-mma");
  plan = select_backends(gpu(9, 0, 232448, 4, 20, 4, 6, 96));
  EXPECT_EQ(plan.get("indexer").chosen, "cuda-fma");
  EXPECT_NE(candidate(plan.get("indexer"), "cuda-mma").reason.find("96"), std::string::npos);
  EXPECT_EQ(plan.get("attention").chosen, "cuda-fma");
  EXPECT_NE(candidate(plan.get("attention"), "cuda-mma").reason.find("multiples of 8"), std::string::npos);
  // A latent wider than the mma kernel's 512.
  plan = select_backends(gpu(12, 0, 101376, 16, 768, 64, 0, 0));
  EXPECT_EQ(plan.get("attention").chosen, "cuda-fma");
  EXPECT_NE(candidate(plan.get("attention"), "cuda-mma").reason.find("768"), std::string::npos);
  // fp8 index keys wider than one scale group: only the CPU takes them.
  plan = select_backends(gpu(9, 0, 232448, 16, 512, 64, 16, 256, true));
  EXPECT_EQ(plan.get("indexer").chosen, "cpu");
}

TEST(BackendSelect, SharedMemoryLimitIsRespected) {
  // A device allowing only 48 KB per block cannot run the mma attention kernel's smallest block (61 KB):
  // fma, with the numbers.
  const BackendPlan plan = select_backends(gpu(8, 6, 49152, 64, 512, 64, 32, 128));
  EXPECT_EQ(plan.get("attention").chosen, "cuda-fma");
  const std::string why = candidate(plan.get("attention"), "cuda-mma").reason;
  EXPECT_NE(why.find("49152"), std::string::npos) << why;
}

TEST(BackendSelect, TheMmaAttentionKernelSaysWhichBlockThisDeviceGets) {
  // Per-block and per-SM shared memory as the drivers report them; the blocks are the ones the
  // launch takes there (run on an H200 under these limits: PERFORMANCE.md, session 11).
  const struct {
    int major, minor;
    uint64_t block, sm;
    bool fp8;
    const char* shape;
    bool tile_pairs;  // 16 heads with two tiles and a second set of warps fit (104,832 / 137,472 bytes)
  } cases[] = {
      {12, 0, 101376, 102400, false, "32 heads per block, 1 tile in flight", false},  // RTX PRO 6000: bf16
      {12, 0, 101376, 102400, true, "32 heads per block, 2 tiles in flight", false},  // fp8 rows as stored
      {8, 6, 101376, 102400, true, "32 heads per block, 2 tiles in flight", false},
      {8, 0, 166912, 167936, false, "64 heads per block, 1 tile in flight", true},   // A100
      {8, 0, 166912, 167936, true, "64 heads per block, 3 tiles in flight", true},
      {10, 0, 232448, 233472, false, "64 heads per block, 2 tiles in flight", true},  // B200
      {10, 0, 232448, 233472, true, "32 heads per block, 2 tiles in flight, two blocks per SM", true},
  };
  for (const auto& c : cases) {
    AttentionProblem p = gpu(c.major, c.minor, c.block, 64, 512, 64, 32, 128, c.fp8);
    p.smem_per_sm = c.sm;
    const BackendPlan plan = select_backends(p);
    ASSERT_EQ(plan.get("attention").chosen, "cuda-mma");
    const std::string& why = candidate(plan.get("attention"), "cuda-mma").reason;
    EXPECT_NE(why.find(c.shape), std::string::npos) << c.major << "." << c.minor << ": " << why;
    EXPECT_EQ(why.find("read as stored") != std::string::npos, c.fp8) << why;
    EXPECT_EQ(why.find("tile pairs") != std::string::npos, c.tile_pairs) << why;
  }
  // fp8 rows of other shapes are widened into bf16 tiles.
  const BackendPlan plan = select_backends(gpu(12, 0, 101376, 4, 256, 32, 0, 0, true));
  EXPECT_NE(candidate(plan.get("attention"), "cuda-mma").reason.find("widened into bf16 tiles"), std::string::npos);
}

TEST(BackendSelect, UnknownDeviceGetsTheGenericPathWithAWarningNeverARefusal) {
  BackendPlan plan = select_backends(gpu(13, 0, 232448, 64, 512, 64, 32, 128));
  EXPECT_EQ(plan.get("attention").chosen, "cuda-mma");
  ASSERT_EQ(plan.warnings.size(), 1u);
  EXPECT_NE(plan.warnings[0].find("13.0"), std::string::npos);
  EXPECT_NE(plan.warnings[0].find("PTX"), std::string::npos);
  // Older than Ampere: the CPU path, with a warning.
  plan = select_backends(gpu(7, 5, 65536, 64, 512, 64, 32, 128));
  EXPECT_EQ(plan.get("attention").chosen, "cpu");
  EXPECT_EQ(plan.get("indexer").chosen, "cpu");
  ASSERT_EQ(plan.warnings.size(), 1u);
  EXPECT_NE(plan.warnings[0].find("older than Ampere"), std::string::npos);
}

TEST(BackendSelect, WithoutAGpuTheCpuIsChosenAndTheTableSaysWhy) {
  AttentionProblem p;
  p.heads = 64;
  p.kv_lora = 512;
  p.rope = 64;
  p.idx_heads = 32;
  p.idx_dim = 128;
  const BackendPlan plan = select_backends(p);
  for (const char* op : {"indexer", "top-k", "attention"}) EXPECT_EQ(plan.get(op).chosen, "cpu") << op;
  const std::string table = format_plan(p, plan);
  EXPECT_NE(table.find("* cpu"), std::string::npos) << table;
  EXPECT_NE(table.find(built_with_cuda() ? "refused: no CUDA device" : "refused: this build has no CUDA"),
            std::string::npos)
      << table;
  // Dense mode has no indexer or top-k step.
  p.sparse = false;
  EXPECT_EQ(select_backends(p).ops.size(), 1u);
}

}  // namespace
}  // namespace sparsemla::ops
