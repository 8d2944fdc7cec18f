// --device, --tensor-parallel and --kv-cache on `sparsemla logits`, `run`, `bench`, `ppl` and
// `serve`, as a user runs them: refused with a clear message where they cannot run; on a GPU, the
// GPU's logits and tokens are the CPU's; a server split over ranks answers as the whole model.
#include <gtest/gtest.h>
#include <httplib.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <future>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>

#include "dist/tcp_bootstrap.h"
#include "engine/backend.h"
#include "gpu_test_util.h"
#include "test_util.h"

namespace sparsemla {
namespace {

using test::CliResult;
CliResult cli(const std::string& args) { return test::run_cli(args); }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string model() { return test::fixture_path("glm_share/model.gguf"); }

// `sparsemla serve ARGS` as a child process, its stdout and stderr read through one pipe. Every wait
// has a deadline, so a server that never starts or never ends fails the test instead of hanging it.
class ServeProcess {
 public:
  explicit ServeProcess(const std::string& args) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], 1);
      dup2(fds[1], 2);
      close(fds[0]);
      close(fds[1]);
      const std::string cmd = "exec " + test::binary_path() + " serve " + args;
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    fd_ = fds[0];
  }
  ~ServeProcess() {
    if (pid_ > 0 && status_ == kRunning) {
      kill(pid_, SIGTERM);
      finish(30);
      if (status_ == kRunning) {
        kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
      }
    }
    if (fd_ >= 0) close(fd_);
  }
  // Reads until `text` is in the output; false when the process closed its output or the time ran out.
  bool wait_for(const std::string& text, int seconds) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
    while (out_.find(text) == std::string::npos)
      if (!read_some(deadline)) return false;
    return true;
  }
  // Reads to the end of the output and reaps the process: its exit status, or -1 (killed, or still
  // running when the time ran out).
  int finish(int seconds) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
    while (read_some(deadline)) {
    }
    for (int i = 0; status_ == kRunning && i < 100 * seconds; ++i) {
      int st = 0;
      if (waitpid(pid_, &st, WNOHANG) == pid_) status_ = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
      else usleep(10000);
    }
    return status_ == kRunning ? -1 : status_;
  }
  // The port printed in "listening on http://HOST:PORT", or 0.
  int port() const {
    std::smatch m;
    return std::regex_search(out_, m, std::regex("listening on http://[^:]+:([0-9]+)")) ? std::stoi(m[1]) : 0;
  }
  const std::string& output() const { return out_; }

 private:
  static constexpr int kRunning = -2;
  bool read_some(std::chrono::steady_clock::time_point deadline) {
    if (fd_ < 0) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, int(left.count())) <= 0) return false;
    char buf[4096];
    const ssize_t n = read(fd_, buf, sizeof buf);
    if (n <= 0) return false;
    out_.append(buf, size_t(n));
    return true;
  }
  pid_t pid_ = -1;
  int fd_ = -1;
  int status_ = kRunning;
  std::string out_;
};

// A server started with `args`: its reply to a greedy chat completion (null on a failure, with its
// output), and what it printed (the backend's description among it).
struct Served {
  nlohmann::json reply;
  std::string log;
};
Served serve_chat(const std::string& args, const std::string& user) {
  ServeProcess p("-m " + test::fixture_path("glm_pub/model-f32.gguf") +
                 " --port 0 --ctx-size 256 --max-seqs 2 --served-model-name glm-pub " + args);
  // "ready" on a line of its own (stdout); the log line on stderr says "ready:".
  if (!p.wait_for("\nready\n", 120)) {
    ADD_FAILURE() << "serve " << args << " did not start:\n" << p.output();
    return {nullptr, p.output()};
  }
  httplib::Client c("127.0.0.1", p.port());
  c.set_read_timeout(60, 0);
  const nlohmann::json body = {{"model", "glm-pub"},
                               {"messages", {{{"role", "user"}, {"content", user}}}},
                               {"max_tokens", 16},
                               {"temperature", 0}};
  auto res = c.Post("/v1/chat/completions", body.dump(), "application/json");
  if (!res || res->status != 200) {
    ADD_FAILURE() << "serve " << args << ": " << (res ? res->body : httplib::to_string(res.error())) << "\n" << p.output();
    return {nullptr, p.output()};
  }
  return {nlohmann::json::parse(res->body), p.output()};
}

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
  const std::string reason = ops::built_with_cuda() ? "no CUDA device is usable here" : "built without CUDA";
  for (const std::string& cmd : {std::string("run -m ") + model() + " --tokens \"5 9\" -n 2 --device cuda",
                                 std::string("bench -m ") + model() + " --prompt 4 --gen 2 --device cuda",
                                 std::string("ppl -m ") + model() + " --file " + test::fixture_path("README.md") +
                                     " --device cuda --tensor-parallel 2"}) {
    const CliResult r = cli(cmd);
    EXPECT_EQ(r.status, 1) << cmd << "\n" << r.out;
    EXPECT_TRUE(contains(r.out, "error: --device cuda: ")) << r.out;
    EXPECT_TRUE(contains(r.out, reason)) << r.out;
  }
  // serve refuses before it listens: the process ends at once with the reason.
  for (const std::string& args : {std::string(" --device cuda"), std::string(" --device cuda --tensor-parallel 2")}) {
    ServeProcess p("-m " + model() + " --port 0" + args);
    EXPECT_EQ(p.finish(60), 1) << args << "\n" << p.output();
    EXPECT_TRUE(contains(p.output(), "error: --device cuda: ")) << p.output();
    EXPECT_TRUE(contains(p.output(), reason)) << p.output();
    EXPECT_FALSE(contains(p.output(), "listening on")) << p.output();
  }
}

// bench on the CPU: a batch of sequences, whole and split over ranks (no all-reduce line: the CPU
// ranks sum in host memory).
TEST(DeviceCli, BenchReportsBatchedDecodeOnTheCpu) {
  for (const std::string tp : {"", " --tensor-parallel 2"}) {
    const CliResult r = cli("bench -m " + model() + " --prompt 12 --gen 3 --batch 2 --threads 2" + tp);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_TRUE(contains(r.out, "prefill 2 x 12 tokens")) << r.out;
    EXPECT_TRUE(contains(r.out, "decode 3 steps of batch 2, context 13..15 (logits to the host)")) << r.out;
    EXPECT_FALSE(contains(r.out, "all-reduce")) << r.out;
  }
  const CliResult bad = cli("bench -m " + model() + " --batch 0");
  EXPECT_NE(bad.status, 0);
  EXPECT_TRUE(contains(bad.out, "--batch 0: '0' is not a positive size")) << bad.out;
  // Lists: every prompt size with every batch on one loaded model, then the table.
  const CliResult sweep = cli("bench -m " + model() + " --prompt 8,20 --gen 2 --batch 1,3 --threads 2");
  ASSERT_EQ(sweep.status, 0) << sweep.out;
  for (const char* line : {"prefill 1 x 8 tokens", "prefill 3 x 8 tokens", "prefill 1 x 20 tokens",
                           "decode 2 steps of batch 3, context 21..22", "context  batch   chunk  prefill tok/s"})
    EXPECT_TRUE(contains(sweep.out, line)) << line << "\n" << sweep.out;
  // Prefill chunks (serve's --batch-tokens): each size in turn, a chunk past the prompt is the prompt.
  const CliResult chunks = cli("bench -m " + model() + " --prompt 20 --gen 2 --batch-tokens 8,64 --threads 2");
  ASSERT_EQ(chunks.status, 0) << chunks.out;
  for (const char* line : {"prefill 1 x 20 tokens in chunks of 8:", "prefill 1 x 20 tokens in chunks of 20:"})
    EXPECT_TRUE(contains(chunks.out, line)) << line << "\n" << chunks.out;
  // Without --batch-tokens, serve's default for the device (the CPU's here).
  const CliResult dflt = cli("bench -m " + model() + " --prompt " + std::to_string(engine::kCpuBatchTokens + 40) +
                             " --gen 1 --threads 2");
  ASSERT_EQ(dflt.status, 0) << dflt.out;
  EXPECT_TRUE(contains(dflt.out, fmt::format("in chunks of {}:", engine::kCpuBatchTokens))) << dflt.out;
  const CliResult bad_chunk = cli("bench -m " + model() + " --batch-tokens 0");
  EXPECT_NE(bad_chunk.status, 0);
  EXPECT_TRUE(contains(bad_chunk.out, "--batch-tokens 0: '0' is not a positive size")) << bad_chunk.out;
  const CliResult bad_list = cli("bench -m " + model() + " --prompt 8,,20");
  EXPECT_NE(bad_list.status, 0);
  EXPECT_TRUE(contains(bad_list.out, "--prompt 8,,20: '' is not a positive size")) << bad_list.out;
}

// `bench model --model FILE` (the model issue's spelling, beside `bench attention`) runs the same
// benchmark as `bench -m FILE`; without a model it says what is missing.
TEST(DeviceCli, BenchModelSubcommandIsTheModelBenchmark) {
  const CliResult r = cli("bench model --model " + model() + " --prompt 10 --gen 2 --batch 2 --threads 2");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "prefill 2 x 10 tokens")) << r.out;
  EXPECT_TRUE(contains(r.out, "decode 2 steps of batch 2, context 11..12")) << r.out;
  const CliResult bad_p = cli("bench model --model " + model() + " --top-p 1.5");
  EXPECT_NE(bad_p.status, 0);
  EXPECT_TRUE(contains(bad_p.out, "--top-p")) << bad_p.out;
  const CliResult missing = cli("bench model --prompt 10");
  EXPECT_NE(missing.status, 0);
  EXPECT_TRUE(contains(missing.out, "bench needs --model FILE")) << missing.out;
}

// `bench attention --shapes` names the shapes it times; a name it does not know is refused with the
// option and the name (it used to print an empty table), on any machine (parsing comes first).
TEST(DeviceCli, BenchAttentionRefusesAnUnknownShape) {
  const CliResult bad = cli("bench attention --shapes glm5 glm6 --batch 1 --context 4096");
  EXPECT_NE(bad.status, 0) << bad.out;
  EXPECT_TRUE(contains(bad.out, "--shapes")) << bad.out;
  EXPECT_TRUE(contains(bad.out, "glm6")) << bad.out;
}

TEST(DeviceCli, ServeSplitOverTwoCpuRanksAnswersAsTheWholeModel) {
  for (const std::string& user : {"Hello there", "Tell me a story about a cat"}) {
    const Served whole = serve_chat("-t 2", user), split = serve_chat("-t 2 --tensor-parallel 2", user);
    ASSERT_TRUE(whole.reply.is_object() && split.reply.is_object());
    EXPECT_TRUE(contains(whole.log, "CPU: KV cache 32 blocks of 16 tokens")) << whole.log;
    EXPECT_TRUE(contains(split.log, "CPU, tensor parallel over 2 ranks: per rank 1 attention heads")) << split.log;
    EXPECT_TRUE(contains(split.log, "KV cache 32 blocks of 16 tokens (fp32, 0.6 MiB) on each of the 2 ranks")) << split.log;
    EXPECT_EQ(split.reply["choices"][0]["message"], whole.reply["choices"][0]["message"]) << user;
    EXPECT_EQ(split.reply["choices"][0]["finish_reason"], whole.reply["choices"][0]["finish_reason"]) << user;
    EXPECT_EQ(split.reply["usage"], whole.reply["usage"]) << user;
    EXPECT_EQ(whole.reply["usage"]["completion_tokens"], 16) << user;
  }
  // The same split with rank 1 in a process of its own (`sparsemla worker`): the server's answers
  // are the whole model's too, and the worker ends when the server does.
  {
    const uint16_t port = dist::TcpListener("127.0.0.1:0").port();
    auto worker = std::async(std::launch::async, [port] {
      return cli(fmt::format("worker -m {} --tensor-parallel 2 --tp-rank 1 --tp-master 127.0.0.1:{} --tp-timeout 60 -t 1",
                             test::fixture_path("glm_pub/model-f32.gguf"), port));
    });
    const std::string user = "Tell me a story about a cat";
    const Served whole = serve_chat("-t 2", user);
    const Served procs = serve_chat(fmt::format("-t 1 --tensor-parallel 2 --tp-master 127.0.0.1:{}", port), user);
    ASSERT_TRUE(whole.reply.is_object() && procs.reply.is_object());
    EXPECT_TRUE(contains(procs.log, "tensor parallel over 2 processes")) << procs.log;
    EXPECT_EQ(procs.reply["choices"][0]["message"], whole.reply["choices"][0]["message"]);
    EXPECT_EQ(procs.reply["usage"], whole.reply["usage"]);
    ASSERT_EQ(worker.wait_for(std::chrono::seconds(60)), std::future_status::ready) << "the worker outlived the server";
    const CliResult w = worker.get();
    EXPECT_TRUE(contains(w.out, "rank 1 of 2: ready")) << w.out;
  }
  // A split the model does not allow ends the server with the plan's reason.
  ServeProcess bad("-m " + test::fixture_path("glm_pub/model-f32.gguf") + " --port 0 -t 2 --tensor-parallel 3");
  EXPECT_EQ(bad.finish(120), 1) << bad.output();
  EXPECT_TRUE(contains(bad.output(), "error: tensor parallel over 3 ranks: the model's 2 attention heads do not divide by 3"))
      << bad.output();
}

// The GPU server in its reference mode (f32 cache, precise) answers as the CPU server; split over
// two GPUs when there are two, else refused with the reason.
TEST(DeviceCli, ServeOnTheGpuAnswersAsTheCpu) {
  SPARSEMLA_REQUIRE_GPU();
  const std::string user = "Tell me a story about a cat";
  const Served cpu = serve_chat("-t 4", user);
  const Served gpu = serve_chat("--device cuda --kv-cache f32 --precise --verbose", user);
  ASSERT_TRUE(cpu.reply.is_object() && gpu.reply.is_object());
  EXPECT_TRUE(contains(gpu.log, "backends for")) << gpu.log;  // --verbose: the kernel table
  EXPECT_TRUE(contains(gpu.log, "KV cache 32 blocks of 16 tokens (f32, ")) << gpu.log;
  EXPECT_EQ(gpu.reply["choices"][0]["message"], cpu.reply["choices"][0]["message"]);
  EXPECT_EQ(gpu.reply["usage"], cpu.reply["usage"]);
  if (ops::list_devices().size() >= 2) {
    const Served tp = serve_chat("--device cuda --kv-cache f32 --precise --tensor-parallel 2", user);
    ASSERT_TRUE(tp.reply.is_object());
    EXPECT_TRUE(contains(tp.log, "on each rank")) << tp.log;
    EXPECT_EQ(tp.reply["choices"][0]["message"], cpu.reply["choices"][0]["message"]);
  } else {
    ServeProcess p("-m " + test::fixture_path("glm_pub/model-f32.gguf") + " --port 0 --device cuda --tensor-parallel 2");
    EXPECT_EQ(p.finish(120), 1) << p.output();
    EXPECT_TRUE(contains(p.output(), "error: ")) << p.output();
    EXPECT_TRUE(contains(p.output(), "needs 2 GPUs")) << p.output();
    if (const size_t at = p.output().find("error: "); at != std::string::npos)
      std::printf("  serve --device cuda --tensor-parallel 2 on one GPU: %s\n", p.output().substr(at).c_str());
  }
  // A KV cache far beyond the GPU's memory is a load error with the numbers.
  ServeProcess big("-m " + test::fixture_path("glm_pub/model-f32.gguf") +
                   " --port 0 --device cuda --kv-cache f32 --kv-cache-tokens 4000000000");
  EXPECT_EQ(big.finish(120), 1) << big.output();
  EXPECT_TRUE(contains(big.output(), "error: ")) << big.output();
  EXPECT_TRUE(contains(big.output(), "KV cache of 4000000000 tokens")) << big.output();
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
  EXPECT_TRUE(contains(bench.out, "decode 8 steps of batch 1, context 33..40 (tokens drawn on the GPU)")) << bench.out;
  const CliResult drawn = cli("bench -m " + model() + " --prompt 32 --gen 8 --batch 2 --device cuda --temperature 0.8 "
                              "--top-p 0.9 --top-k 40");
  ASSERT_EQ(drawn.status, 0) << drawn.out;
  EXPECT_TRUE(contains(drawn.out, "decode 8 steps of batch 2, context 33..40 (tokens drawn on the GPU, temperature "
                                  "0.8, top-p 0.9, top-k 40)"))
      << drawn.out;
  const CliResult batched = cli("bench -m " + model() + " --prompt 32 --gen 8 --batch 3 --device cuda --host-logits");
  ASSERT_EQ(batched.status, 0) << batched.out;
  EXPECT_TRUE(contains(batched.out, "prefill 3 x 32 tokens")) << batched.out;
  EXPECT_TRUE(contains(batched.out, "decode 8 steps of batch 3, context 33..40 (logits to the host)")) << batched.out;
}

}  // namespace
}  // namespace sparsemla
