// Tensor parallelism over processes (engine/remote_ranks.h): the TCP communicator against the
// in-process group, the step and configuration messages, and `sparsemla logits`/`run` as rank 0
// with `sparsemla worker` processes as the other ranks, on 127.0.0.1. A multi-process CPU run must
// give the bits the threaded run gives (same shards, same sums in the same rank order), and the
// transformers logits of the fixture; every failure at start (a worker with another model, a rank
// that never comes, a wrong world size) must be an error that names it, on every process.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "dist/communicator.h"
#include "dist/step_message.h"
#include "dist/tcp_bootstrap.h"
#include "dist/tcp_communicator.h"
#include "gpu_test_util.h"
#include "logit_agreement.h"
#include "test_util.h"

namespace sparsemla {
namespace {

using namespace std::chrono_literals;
using test::CliResult;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
uint16_t free_port() { return dist::TcpListener("127.0.0.1:0").port(); }

// ---- the communicator ----

// fn(comm) on N threads, each a rank over TCP on 127.0.0.1; returns each rank's error ("" if none).
std::vector<std::string> on_tcp_ranks(int N, const std::function<void(dist::Communicator&)>& fn) {
  dist::TcpListener listener("127.0.0.1:0");
  const std::string root = "127.0.0.1:" + std::to_string(listener.port());
  std::vector<std::string> errors(size_t(N), "");
  std::vector<std::thread> threads;
  for (int r = 0; r < N; ++r)
    threads.emplace_back([&, r] {
      try {
        dist::TcpBootstrap b = r == 0 ? dist::TcpBootstrap::accept(std::move(listener), N, {}, 20s)
                                      : dist::TcpBootstrap::join(root, r, N, 20s);
        dist::TcpCommunicator comm(b);
        fn(comm);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

TEST(TcpCommunicator, GivesTheInProcessGroupsBits) {
  const int N = 3;
  // More values than one exchange carries: the collectives travel in chunks.
  int64_t n = 0;
  {
    (void)on_tcp_ranks(1, [&](dist::Communicator& c) { n = static_cast<dist::TcpCommunicator&>(c).chunk_values(); });
    n = n / N + 1001;  // the chunk of a 3-rank group is a third of one rank's
  }
  std::vector<std::vector<float>> in(N);
  for (int r = 0; r < N; ++r) in[size_t(r)] = test::randn(size_t(n), uint32_t(10 + r), float(1 + r));
  // The in-process group's results.
  using Results = std::vector<std::vector<float>>;
  // Each rank's all-reduce, all-gather and broadcast (root 2) of its input, into the results.
  const auto collectives = [&](dist::Communicator& c, Results& sum, Results& gather, Results& bcast) {
    const size_t r = size_t(c.rank());
    sum[r] = in[r];
    c.all_reduce_sum(sum[r].data(), n);
    gather[r].resize(size_t(N * n));
    c.all_gather(in[r].data(), n, gather[r].data());
    bcast[r] = in[r];
    c.broadcast(bcast[r].data(), n, 2);
  };
  Results want_sum(N), want_gather(N), want_bcast(N);
  dist::InProcessGroup group(N);
  group.run([&](dist::Communicator& c) { collectives(c, want_sum, want_gather, want_bcast); });
  Results sum(N), gather(N), bcast(N);
  const auto errors = on_tcp_ranks(N, [&](dist::Communicator& c) {
    collectives(c, sum, gather, bcast);
    c.barrier();
    float none = 0;
    c.all_reduce_sum(&none, 0);  // nothing to sum is still one exchange on every rank
  });
  for (int r = 0; r < N; ++r) {
    ASSERT_EQ(errors[size_t(r)], "") << "rank " << r;
    EXPECT_EQ(0, std::memcmp(sum[size_t(r)].data(), want_sum[size_t(r)].data(), size_t(n) * 4)) << "rank " << r;
    EXPECT_EQ(gather[size_t(r)], want_gather[size_t(r)]) << "rank " << r;
    EXPECT_EQ(bcast[size_t(r)], in[2]) << "rank " << r;
  }
  // Rank-order sums: rank 0's value plus rank 1's plus rank 2's, not any other order.
  EXPECT_EQ(sum[1][5], (in[0][5] + in[1][5]) + in[2][5]);
}

TEST(TcpCommunicator, RanksThatDisagreeFailTogether) {
  auto errors = on_tcp_ranks(3, [](dist::Communicator& c) {
    std::vector<float> v(8, 1.0f), out(24);
    if (c.rank() == 1) c.all_gather(v.data(), 8, out.data());
    else c.all_reduce_sum(v.data(), 8);
  });
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(contains(errors[size_t(r)], "collective mismatch") && contains(errors[size_t(r)], "all_gather"))
        << "rank " << r << ": " << errors[size_t(r)];
  errors = on_tcp_ranks(2, [](dist::Communicator& c) {
    std::vector<float> v(8, 1.0f);
    c.all_reduce_sum(v.data(), c.rank() == 0 ? 8 : 6);
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(contains(errors[size_t(r)], "all_reduce_sum: rank")) << "rank " << r << ": " << errors[size_t(r)];
}

// ---- the messages ----

TEST(StepMessages, RoundTripAndRefuseGarbage) {
  dist::RankConfig c;
  c.arch = "glm-dsa";
  c.file_bytes = 123456789012ull;
  c.n_vocab = 154880;
  c.n_layer = 78;
  c.cuda = true;
  c.kv_dtype = 1;
  c.dense_attention = true;
  c.int8_activations = true;
  c.q8_two_level = false;
  c.kv_blocks = 8200;
  c.block_size = 16;
  c.batch_tokens = 4096;
  c.threads = 3;
  c.nccl_id.assign(128, 7);
  const dist::RankConfig d = dist::decode_config(dist::encode(c));
  EXPECT_EQ(d.arch, c.arch);
  EXPECT_EQ(d.file_bytes, c.file_bytes);
  EXPECT_EQ(d.n_vocab, c.n_vocab);
  EXPECT_EQ(d.n_layer, c.n_layer);
  EXPECT_TRUE(d.cuda && d.dense_attention && d.int8_activations && !d.q8_two_level && !d.precise && !d.host_staged);
  EXPECT_EQ(d.kv_dtype, 1);
  EXPECT_EQ(d.kv_blocks, 8200);
  EXPECT_EQ(d.batch_tokens, 4096);
  EXPECT_EQ(d.threads, 3);
  EXPECT_EQ(d.nccl_id, c.nccl_id);

  std::vector<int32_t> t0 = {0, 1, 2}, t1 = {7};
  const std::vector<model::SeqInput> batch = {{{5, 9, 77}, 0, &t0, true}, {{300}, 20, &t1, false}};
  dist::RankStep s = dist::RankStep::of(dist::RankStep::Kind::Sample, batch);
  s.rows = {{0.7f, 0.9f, 40, 0.05f, 1234, 17}, {0.0f, 1.0f, 0, 0.0f, 0, 0}};
  const std::vector<uint8_t> bytes = dist::encode(s);
  const dist::RankStep back = dist::decode_step(bytes);
  ASSERT_EQ(back.kind, dist::RankStep::Kind::Sample);
  const std::vector<model::SeqInput> got = back.inputs();
  ASSERT_EQ(got.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got[i].tokens, batch[i].tokens);
    EXPECT_EQ(got[i].pos0, batch[i].pos0);
    EXPECT_EQ(*got[i].block_table, *batch[i].block_table);
    EXPECT_EQ(got[i].all_logits, batch[i].all_logits);
  }
  ASSERT_EQ(back.rows.size(), 2u);
  EXPECT_EQ(back.rows[0].top_k, 40);
  EXPECT_EQ(back.rows[0].seed, 1234u);
  EXPECT_EQ(back.rows[0].step, 17u);
  EXPECT_FLOAT_EQ(back.rows[0].min_p, 0.05f);

  // Every truncation is refused with the field named; so are extra bytes and a wrong magic.
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    const std::string err =
        test::error_of([&] { dist::decode_step(std::span<const uint8_t>(bytes.data(), cut)); });
    EXPECT_TRUE(contains(err, "step from rank 0")) << "cut at " << cut << ": " << err;
  }
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_TRUE(contains(test::error_of([&] { dist::decode_step(longer); }), "1 bytes left over"));
  EXPECT_TRUE(contains(test::error_of([&] { dist::decode_config(bytes); }), "not one (magic"));
  std::vector<uint8_t> huge = bytes;
  huge[20] = 0xFF;  // the sequence count's low byte: more sequences than the bytes can hold
  EXPECT_TRUE(contains(test::error_of([&] { dist::decode_step(huge); }), "more than the message holds"));
}

// ---- the CLI: rank 0 a command, the other ranks `sparsemla worker` ----

// Starts `sparsemla worker` for ranks 1..N-1 in the background; wait() gives their results.
struct Workers {
  std::vector<std::future<CliResult>> procs;
  Workers(const std::string& model, int N, uint16_t port, int timeout_s = 60, const std::string& extra = "") {
    for (int r = 1; r < N; ++r)
      procs.push_back(std::async(std::launch::async, [=] {
        return test::run_cli(fmt::format("worker -m {} --tensor-parallel {} --tp-rank {} --tp-master 127.0.0.1:{} "
                                         "--tp-timeout {} -t 1 {}",
                                         model, N, r, port, timeout_s, extra));
      }));
  }
  std::vector<CliResult> wait() {
    std::vector<CliResult> out;
    for (auto& p : procs) {
      if (p.wait_for(120s) != std::future_status::ready) {
        std::fprintf(stderr, "a worker did not exit\n");
        std::_Exit(1);
      }
      out.push_back(p.get());
    }
    return out;
  }
};

// The last JSON object line of `run --json`'s output (the generated tokens and text).
std::string json_line(const std::string& out) {
  const size_t at = out.rfind("{\"");
  return at == std::string::npos ? out : out.substr(at, out.find('\n', at) - at);
}

TEST(MultiProcessTensorParallel, LogitsEqualTheThreadedRunBitForBit) {
  test::TempDir dir("mp-tp");
  for (auto [name, N] : std::vector<std::pair<std::string, int>>{{"glm_pub", 2}, {"dsv32_pub", 2}, {"glm_share", 4}}) {
    const std::string model = test::fixture_model_path(name);
    const std::string tokens = test::fixture_path(name + "/seq1.tokens");
    const std::string threaded = dir.file(name + "-threads.f32"), procs = dir.file(name + "-procs.f32");
    const CliResult t = test::run_cli(
        fmt::format("logits -m {} --tokens {} -o {} -t 2 --tensor-parallel {}", model, tokens, threaded, N));
    ASSERT_EQ(t.status, 0) << t.out;
    const uint16_t port = free_port();
    Workers w(model, N, port);
    const CliResult p = test::run_cli(fmt::format("logits -m {} --tokens {} -o {} -t 1 --tensor-parallel {} "
                                                  "--tp-master 127.0.0.1:{} --tp-timeout 60",
                                                  model, tokens, procs, N, port));
    const std::vector<CliResult> ws = w.wait();
    ASSERT_EQ(p.status, 0) << p.out;
    EXPECT_TRUE(contains(p.out, fmt::format("tensor parallel over {} processes", N))) << p.out;
    for (int r = 1; r < N; ++r) {
      EXPECT_EQ(ws[size_t(r - 1)].status, 0) << ws[size_t(r - 1)].out;
      EXPECT_TRUE(contains(ws[size_t(r - 1)].out, fmt::format("rank {} of {}: rank 0 stopped after 1 steps", r, N)))
          << ws[size_t(r - 1)].out;
    }
    const auto a = test::read_values<float>(threaded), b = test::read_values<float>(procs);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << name << ": not the threaded run's bits";
    // And the reference's numbers.
    const auto ref = test::read_values<float>(test::fixture_path(name + "/seq1.logits.f32"));
    EXPECT_LE(test::compare_all(b, ref, 1024).rel, 1e-3) << name << " vs transformers";
  }
}

TEST(MultiProcessTensorParallel, GreedyRunEqualsTheUnsplitModel) {
  const std::string model = test::fixture_model_path("glm_share");
  const std::string run = fmt::format("run -m {} --tokens \"5 9 77 300 12\" -n 12 --json -t 1", model);
  const CliResult whole = test::run_cli(run);
  ASSERT_EQ(whole.status, 0) << whole.out;
  const uint16_t port = free_port();
  Workers w(model, 2, port);
  const CliResult p = test::run_cli(run + fmt::format(" --tensor-parallel 2 --tp-master 127.0.0.1:{}", port));
  const std::vector<CliResult> ws = w.wait();
  ASSERT_EQ(p.status, 0) << p.out;
  ASSERT_EQ(ws[0].status, 0) << ws[0].out;
  EXPECT_EQ(json_line(p.out), json_line(whole.out));
  EXPECT_TRUE(contains(ws[0].out, "rank 0 stopped after")) << ws[0].out;
}

TEST(MultiProcessTensorParallel, StartFailuresNameTheRank) {
  test::TempDir dir("mp-tp-fail");
  const std::string model = test::fixture_model_path("glm_pub");
  const std::string tokens = test::fixture_path("glm_pub/seq0.tokens");
  const std::string logits = fmt::format("logits -m {} --tokens {} -o {} -t 1 --tensor-parallel 2", model, tokens,
                                         dir.file("x.f32"));
  {  // a worker with another model: both processes fail, naming rank 1 and the difference
    const uint16_t port = free_port();
    Workers w(test::fixture_model_path("dsv32_pub"), 2, port);
    const CliResult p = test::run_cli(logits + fmt::format(" --tp-master 127.0.0.1:{} --tp-timeout 60", port));
    const std::vector<CliResult> ws = w.wait();
    EXPECT_NE(p.status, 0);
    EXPECT_TRUE(contains(p.out, "rank 1: its model is not rank 0's")) << p.out;
    EXPECT_NE(ws[0].status, 0);
    EXPECT_TRUE(contains(ws[0].out, "rank 1: its model is not rank 0's")) << ws[0].out;
  }
  {  // nobody joins: rank 0 gives up at its timeout, naming the missing rank
    const CliResult p = test::run_cli(logits + fmt::format(" --tp-master 127.0.0.1:{} --tp-timeout 1", free_port()));
    EXPECT_NE(p.status, 0);
    EXPECT_TRUE(contains(p.out, "error:") && contains(p.out, "1")) << p.out;
  }
  {  // a worker of a 3-rank group at a 2-rank rank 0
    const uint16_t port = free_port();
    Workers w(model, 3, port, 5);  // ranks 1 and 2 of 3
    const CliResult p = test::run_cli(logits + fmt::format(" --tp-master 127.0.0.1:{} --tp-timeout 5", port));
    const std::vector<CliResult> ws = w.wait();
    EXPECT_NE(p.status, 0) << p.out;
    for (const CliResult& r : ws) {
      EXPECT_NE(r.status, 0) << r.out;
      EXPECT_TRUE(contains(r.out, "error:")) << r.out;
    }
  }
  {  // bad arguments
    CliResult r = test::run_cli(fmt::format("worker -m {} --tensor-parallel 2 --tp-rank 0 --tp-master 127.0.0.1:1", model));
    EXPECT_NE(r.status, 0);
    EXPECT_TRUE(contains(r.out, "--tp-rank 0 is not a worker rank of 2")) << r.out;
    r = test::run_cli(logits.substr(0, logits.find(" --tensor-parallel")) + " --tp-master 127.0.0.1:1");
    EXPECT_NE(r.status, 0);
    EXPECT_TRUE(contains(r.out, "needs --tensor-parallel N >= 2")) << r.out;
    r = test::run_cli(fmt::format("worker -m {} --tensor-parallel 2 --tp-rank 1 --tp-master 127.0.0.1:{} --tp-timeout 1",
                                  model, free_port()));
    EXPECT_NE(r.status, 0);
    EXPECT_TRUE(contains(r.out, "error:") && contains(r.out, "rank 1 of 2")) << r.out;
  }
}

// The GPU ranks in separate processes, here both on one GPU with the collectives staged through
// host memory and TCP (NCCL needs a GPU per rank): the logits and the greedy tokens (drawn on the
// device: the sampling step goes to the worker too) are the in-process host-staged run's.
TEST(MultiProcessTensorParallel, GpuRanksGiveTheThreadedRunsResults) {
  SPARSEMLA_REQUIRE_GPU();
  test::TempDir dir("mp-tp-gpu");
  const std::string model = test::fixture_model_path("glm_share");
  const std::string tokens = test::fixture_path("glm_share/seq1.tokens");
  // f32 cache, precise: the random fixture's top-k choices flip under bf16 rounding (see
  // test_gpu_model.cpp), and this run is also held to transformers' logits.
  const std::string gpu = "--device cuda --tensor-parallel 2 --tp-transport host --kv-cache f32 --precise";
  const CliResult t = test::run_cli(fmt::format("logits -m {} --tokens {} -o {} {}", model, tokens, dir.file("t.f32"), gpu));
  ASSERT_EQ(t.status, 0) << t.out;
  uint16_t port = free_port();
  {
    Workers w(model, 2, port, 60, "--gpu 0");
    const CliResult p = test::run_cli(fmt::format("logits -m {} --tokens {} -o {} {} --tp-master 127.0.0.1:{}", model,
                                                  tokens, dir.file("p.f32"), gpu, port));
    const std::vector<CliResult> ws = w.wait();
    ASSERT_EQ(p.status, 0) << p.out;
    ASSERT_EQ(ws[0].status, 0) << ws[0].out;
    EXPECT_TRUE(contains(p.out, "collectives: host-staged over TCP")) << p.out;
    const auto a = test::read_values<float>(dir.file("t.f32")), b = test::read_values<float>(dir.file("p.f32"));
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
    const auto ref = test::read_values<float>(test::fixture_path("glm_share/seq1.logits.f32"));
    EXPECT_LE(test::compare_all(b, ref, 1024).rel, 2e-2) << "vs transformers";
  }
  const std::string run = fmt::format("run -m {} --tokens \"5 9 77 300 12\" -n 10 --json {}", model, gpu);
  const CliResult whole = test::run_cli(run);
  ASSERT_EQ(whole.status, 0) << whole.out;
  port = free_port();
  Workers w(model, 2, port, 60, "--gpu 0");
  const CliResult p = test::run_cli(run + fmt::format(" --tp-master 127.0.0.1:{}", port));
  const std::vector<CliResult> ws = w.wait();
  ASSERT_EQ(p.status, 0) << p.out;
  ASSERT_EQ(ws[0].status, 0) << ws[0].out;
  EXPECT_EQ(json_line(p.out), json_line(whole.out));
}

}  // namespace
}  // namespace sparsemla
