// --device and --kv-cache on `sparsemla logits`, `run` and `bench`, as a user runs them: refused
// with a clear message where they cannot run; on a GPU, the GPU's logits and tokens are the CPU's.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "gpu_test_util.h"
#include "test_util.h"

namespace sparsemla {
namespace {

using test::CliResult;
CliResult cli(const std::string& args) { return test::run_cli(args); }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string model() { return test::fixture_path("glm_share/model.gguf"); }

TEST(DeviceCli, KvCacheNeedsDeviceCuda) {
  test::TempDir dir("dev-cli");
  const CliResult r = cli("logits -m " + model() + " --tokens " + test::fixture_path("glm_share/seq0.tokens") +
                          " -o " + dir.file("l.f32") + " --kv-cache fp8");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--kv-cache fp8: only with --device cuda")) << r.out;
  const CliResult precise = cli("run -m " + model() + " --tokens \"5 9\" --precise");
  EXPECT_EQ(precise.status, 1) << precise.out;
  EXPECT_TRUE(contains(precise.out, "--precise: only with --device cuda")) << precise.out;
  const CliResult bad = cli("run -m " + model() + " --tokens \"5 9\" --device tpu");
  EXPECT_NE(bad.status, 0) << bad.out;
  EXPECT_TRUE(contains(bad.out, "--device")) << bad.out;
}

TEST(DeviceCli, DeviceCudaWithoutAGpuIsRefusedClearly) {
  const std::string why = test::gpu_unavailable();
  if (why.empty()) GTEST_SKIP() << "a GPU is present (DeviceCli.GpuCommandsRunAndAgreeWithTheCpu runs instead)";
  for (const std::string& cmd : {std::string("run -m ") + model() + " --tokens \"5 9\" -n 2 --device cuda",
                                 std::string("bench -m ") + model() + " --prompt 4 --gen 2 --device cuda"}) {
    const CliResult r = cli(cmd);
    EXPECT_EQ(r.status, 1) << cmd << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, "error: --device cuda: ")) << r.out;
    EXPECT_TRUE(contains(r.out, ops::built_with_cuda() ? "no CUDA device is usable here" : "built without CUDA")) << r.out;
  }
}

TEST(DeviceCli, GpuCommandsRunAndAgreeWithTheCpu) {
  SPARSEMLA_REQUIRE_GPU();
  test::TempDir dir("dev-cli-gpu");
  const std::string tokens = test::fixture_path("glm_share/seq1.tokens");
  const CliResult c = cli("logits -m " + model() + " --tokens " + tokens + " -o " + dir.file("cpu.f32") + " -t 4");
  ASSERT_EQ(c.status, 0) << c.out;
  for (const char* kv : {"bf16", "fp8"}) {
    const CliResult g = cli("logits -m " + model() + " --tokens " + tokens + " -o " + dir.file("gpu.f32") +
                            " --device cuda --verbose --kv-cache " + kv);
    ASSERT_EQ(g.status, 0) << g.out;
    EXPECT_TRUE(contains(g.out, "backends for")) << g.out;
    EXPECT_TRUE(contains(g.out, "KV cache")) << g.out;
    // The GPU's own choices differ from the CPU's at near ties (test_gpu_model.cpp compares them
    // with the same choices): here only the gross agreement of the command's output is checked.
    const auto a = test::read_values<float>(dir.file("gpu.f32")), b = test::read_values<float>(dir.file("cpu.f32"));
    ASSERT_EQ(a.size(), b.size());
    const int64_t V = 1024, rows = int64_t(b.size()) / V;
    int64_t same = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < V; ++i) ASSERT_TRUE(std::isfinite(a[size_t(r * V + i)])) << kv;
      same += test::argmax(a.data() + r * V, V) == test::argmax(b.data() + r * V, V);
    }
    std::printf("  logits --device cuda --kv-cache %s: argmax equal to the CPU's at %lld of %lld rows\n", kv,
                (long long)same, (long long)rows);
    EXPECT_GE(2 * same, rows) << kv;
  }
  // The first token comes from a 5-token prompt (decode kernels, every position inside top-k).
  const std::string run = "run -m " + model() + " --tokens \"5 9 77 300 12\" -n 8 --json";
  const CliResult rc = cli(run + " -t 4"), rg = cli(run + " --device cuda");
  ASSERT_EQ(rc.status, 0) << rc.out;
  ASSERT_EQ(rg.status, 0) << rg.out;
  const auto first = [](const std::string& out) {
    const size_t at = out.find("{\"tokens\":[");
    return at == std::string::npos ? std::string("none") : out.substr(at, out.find(',', at) - at);
  };
  EXPECT_EQ(first(rg.out), first(rc.out)) << rg.out << rc.out;
  EXPECT_NE(rg.out.find("{\"tokens\":["), std::string::npos) << rg.out;
  const CliResult bench = cli("bench -m " + model() + " --prompt 32 --gen 8 --device cuda");
  ASSERT_EQ(bench.status, 0) << bench.out;
  EXPECT_TRUE(contains(bench.out, "decode 8 tokens")) << bench.out;
}

}  // namespace
}  // namespace sparsemla
