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
        EXPECT_EQ(plan.get("attention").chosen, "cuda-mma") << a.major << "." << a.minor << " heads " << heads;
        EXPECT_TRUE(plan.warnings.empty()) << plan.warnings[0];
      }
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
  // A device allowing only 48 KB per block cannot run the 82 KB mma attention block: fma, with the numbers.
  const BackendPlan plan = select_backends(gpu(8, 6, 49152, 64, 512, 64, 32, 128));
  EXPECT_EQ(plan.get("attention").chosen, "cuda-fma");
  const std::string why = candidate(plan.get("attention"), "cuda-mma").reason;
  EXPECT_NE(why.find("49152"), std::string::npos) << why;
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
