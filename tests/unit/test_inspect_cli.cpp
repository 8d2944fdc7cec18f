// `sparsemla inspect` as a user runs it: the binary on split and whole files, --dump output, and
// files of architectures the engine does not run.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <iterator>

#include "gguf/reader.h"
#include "gguf/writer.h"
#include "test_util.h"

namespace sparsemla {
namespace {

using Result = test::CliResult;
Result run(const std::string& args) { return test::run_cli(args); }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Drops the lines that name files (they differ between a split and a whole file by design).
std::string without_file_lines(const std::string& report) {
  std::string out, line;
  for (char c : report) {
    if (c != '\n') {
      line += c;
      continue;
    }
    if (line.rfind("  [", 0) != 0 && line.rfind("GGUF version", 0) != 0 && line.rfind("header bytes", 0) != 0)
      out += line + "\n";
    line.clear();
  }
  return out;
}

TEST(InspectCli, SplitAndWholeInspectAndDumpIdentically) {
  test::TempDir dir("cli");
  auto src = gguf::File::open(test::fixture_path("dsv32_pub/model-f32.gguf"));
  gguf::Writer w;
  for (const auto& [k, v] : src->metadata()) w.set(k, v);
  for (const auto& t : src->tensors())
    w.add_tensor(t.name, t.name.find("ffn_gate_inp") == std::string::npos && t.ne[0] % 32 == 0 && t.n_dims > 1
                             ? gguf::GgmlType::Q8_0
                             : gguf::GgmlType::F32,
                 std::vector<int64_t>(t.ne, t.ne + t.n_dims),
                 std::vector<float>(reinterpret_cast<const float*>(t.data),
                                    reinterpret_cast<const float*>(t.data) + t.n_elements()));
  w.write(dir.file("whole.gguf"));
  const auto parts = w.write_split(dir.file("ds"), 20);
  ASSERT_EQ(parts.size(), 4u);

  const Result whole = run("inspect " + dir.file("whole.gguf"));
  const Result split = run("inspect " + parts[2]);
  ASSERT_EQ(whole.status, 0) << whole.out;
  ASSERT_EQ(split.status, 0) << split.out;
  EXPECT_EQ(without_file_lines(split.out), without_file_lines(whole.out));
  EXPECT_NE(split.out.find("4 file(s)"), std::string::npos);
  EXPECT_NE(whole.out.find("q8_0"), std::string::npos);

  for (const char* name : {"blk.1.ffn_down_exps.weight", "token_embd.weight", "blk.0.attn_kv_a_norm.weight"}) {
    ASSERT_EQ(run(std::string("inspect ") + dir.file("whole.gguf") + " --tensor " + name + " --dump " +
                  dir.file("a.f32")).status, 0);
    ASSERT_EQ(run("inspect " + parts[0] + " --tensor " + name + " --dump " + dir.file("b.f32")).status, 0);
    const std::string a = slurp(dir.file("a.f32")), b = slurp(dir.file("b.f32"));
    EXPECT_FALSE(a.empty());
    EXPECT_EQ(a, b) << name;
    EXPECT_EQ(a.size(), size_t(src->tensor(name)->n_elements()) * 4) << name;
  }
}

TEST(InspectCli, UnknownArchitectureIsInspectedWithANote) {
  test::TempDir dir("cli2");
  gguf::Writer w;
  w.set("general.architecture", gguf::Value::string("qwen3moe"));
  w.add_tensor("token_embd.weight", gguf::GgmlType::F32, {8, 4}, std::vector<float>(32, 0.5f));
  w.write(dir.file("q.gguf"));
  const Result r = run("inspect " + dir.file("q.gguf") + " --tensors");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("qwen3moe -- not supported, cannot be run"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("token_embd.weight"), std::string::npos) << r.out;
}

TEST(InspectCli, BadArgumentsAreRefusedWithAMessage) {
  const std::string model = test::fixture_path("glm_pub/model-f32.gguf");
  Result r = run("inspect " + model + " --tensor no.such.tensor --dump /tmp/x.f32");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("no tensor named 'no.such.tensor'"), std::string::npos) << r.out;
  r = run("inspect /nonexistent/model.gguf");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("cannot open"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace sparsemla
