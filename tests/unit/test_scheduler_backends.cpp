// The scheduler on every backend this machine has (engine/backend.h): the CPU, the CPU split over 2
// ranks, the GPU (f32 cache, precise mode: the GPU computes what the CPU does, to fp32 rounding) and
// the GPU split over 2 ranks (both on GPU 0, host-staged). Each runs the same greedy requests on the
// glm_pub fixture, batched, prompts in chunks beside decodes, one of them reusing another's prefix
// blocks, and must give the plain CPU scheduler's tokens; the fixture's greedy prompt must give the
// tokens transformers generated. The backends' own forward is checked against model::Model::forward,
// and what cannot run is refused with its reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "engine/backend.h"
#include "engine/scheduler.h"
#include "gpu_test_util.h"
#include "test_util.h"

namespace sparsemla::engine {
namespace {

struct Fixture {
  std::unique_ptr<model::Model> model;
  std::unique_ptr<tokenizer::Tokenizer> tok;
  std::vector<int32_t> greedy_prompt, greedy_tokens;  // transformers' greedy decoding (greedy.json)
  std::vector<int32_t> seq0, seq1;                    // 48 and 80 tokens: the indexer selects
};

Fixture& fixture() {
  static Fixture f = [] {
    Fixture x;
    x.model = model::Model::load(test::fixture_path("glm_pub/model-f32.gguf"), {model::AttentionMode::Sparse, 2});
    x.tok = tokenizer::Tokenizer::from_gguf(x.model->file());
    std::ifstream in(test::fixture_path("glm_pub/greedy.json"));
    const auto j = nlohmann::json::parse(in);
    x.greedy_prompt = j["prompt"].get<std::vector<int32_t>>();
    x.greedy_tokens = j["greedy"].get<std::vector<int32_t>>();
    x.seq0 = test::read_values<int32_t>(test::fixture_path("glm_pub/seq0.tokens"));
    x.seq1 = test::read_values<int32_t>(test::fixture_path("glm_pub/seq1.tokens"));
    return x;
  }();
  return f;
}

// 4 sequences of up to 256 positions over 64 blocks of 4 tokens, on `backend`.
SchedulerConfig config(const BackendOptions& backend, int32_t batch_tokens) {
  SchedulerConfig cfg;
  cfg.max_seqs = 4;
  cfg.batch_tokens = batch_tokens;
  cfg.ctx_size = 256;
  cfg.kv_blocks = 64;
  cfg.block_size = 4;
  cfg.backend = backend;
  return cfg;
}

GenerationRequest greedy(std::vector<int32_t> prompt, int max_tokens) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0.0f;
  r.ignore_eos = true;  // a random model may end anywhere; the tests want exact lengths
  return r;
}

struct Outcome {
  std::vector<std::vector<int32_t>> tokens;  // per request
  std::vector<Usage> usage;
  std::vector<std::string> errors;
  SchedulerStats end;
  std::string description;
};

// Four greedy requests: the fixture's greedy prompt, seq0, a part of seq1, and seq0's first 5 blocks
// followed by other tokens (submitted once seq0's prompt is in the cache, so that it reuses them).
Outcome run_requests(const BackendOptions& backend) {
  Fixture& f = fixture();
  const std::vector<int32_t> part1(f.seq1.begin(), f.seq1.begin() + 40);
  std::vector<int32_t> shared(f.seq0.begin(), f.seq0.begin() + 20);
  shared.insert(shared.end(), f.seq1.begin() + 50, f.seq1.begin() + 59);
  const std::vector<GenerationRequest> reqs = {greedy(f.greedy_prompt, int(f.greedy_tokens.size())),
                                               greedy(f.seq0, 10), greedy(part1, 8), greedy(shared, 9)};
  Scheduler s(*f.model, *f.tok, config(backend, 16));  // prompts arrive in chunks, mixed with decodes
  Outcome out;
  out.description = s.backend().description();
  out.tokens.resize(reqs.size());
  out.usage.resize(reqs.size());
  out.errors.resize(reqs.size());
  std::vector<std::shared_ptr<RequestStream>> streams;
  std::vector<bool> done(reqs.size(), false);
  auto drain = [&] {
    for (size_t k = 0; k < streams.size(); ++k)
      while (auto e = streams[k]->next(std::chrono::milliseconds(0))) {
        for (const auto& t : e->tokens) out.tokens[k].push_back(t.id);
        out.usage[k] = e->usage;
        out.errors[k] += e->error;
        if (e->finish != FinishReason::None) done[k] = true;
      }
  };
  for (size_t k = 0; k + 1 < reqs.size(); ++k) {
    streams.push_back(s.submit(reqs[k]));
    s.step();  // arrivals at different steps
  }
  for (int i = 0; i < 4; ++i) s.step();  // seq0's 48 prompt tokens are in the cache by now
  streams.push_back(s.submit(reqs.back()));
  for (int i = 0; i < 200 && !std::all_of(done.begin(), done.end(), [](bool d) { return d; }); ++i) {
    s.step();
    drain();
  }
  out.end = s.stats();
  return out;
}

const Outcome& cpu_reference() {
  static const Outcome o = run_requests({});
  return o;
}

void expect_reference_tokens(const Outcome& got, const std::string& what) {
  const Outcome& want = cpu_reference();
  std::string described = got.description;
  for (size_t at = 0; (at = described.find('\n', at)) != std::string::npos; at += 5) described.replace(at, 1, "\n    ");
  std::printf("  %s:\n    %s\n", what.c_str(), described.c_str());
  ASSERT_EQ(got.tokens.size(), want.tokens.size());
  for (size_t k = 0; k < got.tokens.size(); ++k) {
    EXPECT_EQ(got.errors[k], "") << what << " request " << k;
    EXPECT_EQ(got.tokens[k], want.tokens[k]) << what << " request " << k;
    EXPECT_EQ(got.usage[k].completion_tokens, int32_t(want.tokens[k].size())) << what << " request " << k;
  }
  EXPECT_EQ(got.tokens[0], fixture().greedy_tokens) << what << ": transformers' greedy tokens";
  EXPECT_EQ(got.usage[3].cached_tokens, 20) << what << ": the shared prefix's 5 blocks are reused";
  EXPECT_EQ(got.end.running, 0) << what;
  EXPECT_EQ(got.end.blocks_used, 0) << what;
  EXPECT_EQ(got.end.blocks_reserved, 0) << what;
}

TEST(SchedulerBackends, CpuGivesTransformersGreedyTokensAndReusesPrefixes) {
  const Outcome& o = cpu_reference();
  for (size_t k = 0; k < o.tokens.size(); ++k) EXPECT_EQ(o.errors[k], "") << "request " << k;
  EXPECT_EQ(o.tokens[0], fixture().greedy_tokens);
  EXPECT_EQ(o.tokens[1].size(), 10u);
  EXPECT_EQ(o.tokens[3].size(), 9u);
  EXPECT_EQ(o.usage[3].cached_tokens, 20);
  EXPECT_EQ(o.end.blocks_used, 0);
  EXPECT_NE(o.description.find("CPU: KV cache 64 blocks of 4 tokens (fp32"), std::string::npos) << o.description;
}

TEST(SchedulerBackends, CpuTwoRanksGivesTheCpuTokens) {
  BackendOptions o;
  o.tensor_parallel = 2;
  o.threads = 2;
  const Outcome got = run_requests(o);
  EXPECT_NE(got.description.find("tensor parallel over 2 ranks"), std::string::npos) << got.description;
  expect_reference_tokens(got, "CPU, 2 ranks");
}

TEST(SchedulerBackends, GpuGivesTheCpuTokens) {
  SPARSEMLA_REQUIRE_GPU();
#if SPARSEMLA_HAVE_CUDA
  BackendOptions o;
  o.device = Device::Cuda;
  o.gpu.kv_cache = cuda::KvDtype::F32;
  o.gpu.precise = true;
  const Outcome got = run_requests(o);
  EXPECT_NE(got.description.find("KV cache 64 blocks of 4 tokens (f32, "), std::string::npos) << got.description;
  expect_reference_tokens(got, "GPU, f32 cache, precise");
#endif
}

TEST(SchedulerBackends, GpuTwoRanksOnOneGpuGivesTheCpuTokens) {
  SPARSEMLA_REQUIRE_GPU();
#if SPARSEMLA_HAVE_CUDA
  BackendOptions o;
  o.device = Device::Cuda;
  o.tensor_parallel = 2;
  o.gpu.kv_cache = cuda::KvDtype::F32;
  o.gpu.precise = true;
  o.tp_devices = {0, 0};
  o.tp_transport = dist::TpTransport::HostStaged;
  const Outcome got = run_requests(o);
  EXPECT_NE(got.description.find("tensor parallel over 2 ranks"), std::string::npos) << got.description;
  EXPECT_NE(got.description.find("KV cache 64 blocks of 4 tokens (f32, "), std::string::npos) << got.description;
  expect_reference_tokens(got, "GPU, 2 ranks host-staged on GPU 0, f32 cache, precise");
#endif
}

#if SPARSEMLA_HAVE_CUDA
// Runs `reqs` to the end on a fresh scheduler over `backend`; the tokens and the events' logprobs.
struct RunResult {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<Sampled>> sampled;
  std::vector<std::string> errors;
};
RunResult run_all(const BackendOptions& backend, const std::vector<GenerationRequest>& reqs) {
  Fixture& f = fixture();
  Scheduler s(*f.model, *f.tok, config(backend, 32));
  RunResult out;
  out.tokens.resize(reqs.size());
  out.sampled.resize(reqs.size());
  out.errors.resize(reqs.size());
  std::vector<std::shared_ptr<RequestStream>> streams;
  for (const auto& r : reqs) streams.push_back(s.submit(r));
  std::vector<bool> done(reqs.size(), false);
  for (int i = 0; i < 200 && !std::all_of(done.begin(), done.end(), [](bool d) { return d; }); ++i) {
    s.step();
    for (size_t k = 0; k < streams.size(); ++k)
      while (auto e = streams[k]->next(std::chrono::milliseconds(0))) {
        for (const auto& t : e->tokens) {
          out.tokens[k].push_back(t.id);
          out.sampled[k].push_back(t);
        }
        out.errors[k] += e->error;
        if (e->finish != FinishReason::None) done[k] = true;
      }
  }
  return out;
}
#endif

// On the GPU the scheduler draws tokens on the device (only ids come back) unless a request in the
// batch needs the host sampler (logprobs, penalties). Seeded requests repeat their tokens; greedy
// ones give the CPU's tokens either way; a logprobs request gets the CPU's logprobs.
TEST(SchedulerBackends, GpuSamplesOnTheDeviceAndOnTheHostWhenARequestNeedsIt) {
  SPARSEMLA_REQUIRE_GPU();
#if SPARSEMLA_HAVE_CUDA
  Fixture& f = fixture();
  BackendOptions o;
  o.device = Device::Cuda;
  o.gpu.kv_cache = cuda::KvDtype::F32;
  o.gpu.precise = true;
  GenerationRequest seeded = greedy(f.seq0, 12);
  seeded.sampling.temperature = 0.8f;
  seeded.sampling.top_k = 20;
  seeded.sampling.top_p = 0.9f;
  seeded.sampling.seed = 7;
  GenerationRequest other_seed = seeded;
  other_seed.sampling.seed = 8;
  const GenerationRequest plain = greedy(f.greedy_prompt, int(f.greedy_tokens.size()));
  // Device sampling: greedy beside seeded rows.
  const RunResult a = run_all(o, {seeded, plain, other_seed});
  const RunResult b = run_all(o, {seeded, plain, other_seed});
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(a.errors[k], "") << k;
  EXPECT_EQ(a.tokens[0].size(), 12u);
  EXPECT_EQ(a.tokens[0], b.tokens[0]) << "a seeded request draws the same tokens on every run";
  EXPECT_EQ(a.tokens[2], b.tokens[2]);
  EXPECT_NE(a.tokens[0], a.tokens[2]) << "two seeds, 12 draws each at temperature 0.8: the same tokens is unlikely";
  EXPECT_EQ(a.tokens[1], f.greedy_tokens) << "greedy on the device: transformers' tokens";
  // A logprobs request sends its batch to the host sampler: the CPU's tokens and logprobs.
  GenerationRequest lp = plain;
  lp.sampling.top_logprobs = 2;
  const RunResult gpu = run_all(o, {lp, seeded});
  const RunResult cpu = run_all({}, {lp});
  EXPECT_EQ(gpu.tokens[0], cpu.tokens[0]);
  ASSERT_EQ(gpu.sampled[0].size(), cpu.sampled[0].size());
  for (size_t i = 0; i < gpu.sampled[0].size(); ++i) {
    ASSERT_EQ(gpu.sampled[0][i].top.size(), 2u) << i;
    EXPECT_NEAR(gpu.sampled[0][i].logprob, cpu.sampled[0][i].logprob, 1e-4) << i;
  }
#endif
}

// The backend's forward against model::Model::forward on its own cache: bit for bit on the CPU,
// to the order of the sums across ranks when split.
TEST(Backend, ForwardIsTheModelsForward) {
  Fixture& f = fixture();
  const int64_t V = f.model->hparams().n_vocab;
  kv::PagedCache cache(f.model->cache_shape(32, 4));
  std::vector<int32_t> table;
  ASSERT_TRUE(cache.reserve(table, int64_t(f.seq1.size())));
  std::vector<float> want;
  f.model->forward({model::SeqInput{f.seq1, 0, &table, true}}, cache, want);
  for (int ranks : {1, 2}) {
    BackendOptions o;
    o.tensor_parallel = ranks;
    o.threads = 2;
    auto b = make_backend(*f.model, o, 32, 4, int64_t(f.seq1.size()));
    EXPECT_EQ(b->n_vocab(), V);
    EXPECT_EQ(b->blocks().n_blocks(), 32);
    EXPECT_EQ(b->blocks().block_size(), 4);
    std::vector<int32_t> t;
    ASSERT_TRUE(b->blocks().reserve(t, int64_t(f.seq1.size())));
    std::vector<float> got;
    b->forward({model::SeqInput{f.seq1, 0, &t, true}}, got);
    ASSERT_EQ(got.size(), want.size()) << ranks << " ranks";
    if (ranks == 1) {
      EXPECT_EQ(got, want);
      continue;
    }
    double max_ref = 0, max_diff = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      max_ref = std::max(max_ref, std::fabs(double(want[i])));
      max_diff = std::max(max_diff, std::fabs(double(got[i]) - want[i]));
    }
    EXPECT_LE(max_diff, 1e-5 * max_ref) << ranks << " ranks";
    for (size_t r = 0; r < f.seq1.size(); ++r)
      EXPECT_EQ(test::argmax(got.data() + r * V, V), test::argmax(want.data() + r * V, V)) << "row " << r;
  }
}

TEST(Backend, WhatCannotRunIsRefusedWithItsReason) {
  Fixture& f = fixture();
  BackendOptions o;
  o.tensor_parallel = 0;
  EXPECT_EQ(test::error_of([&] { make_backend(*f.model, o, 8, 4, 16); }),
            "tensor parallel over 0 ranks: at least 1 is needed");
  o.tensor_parallel = 3;
  EXPECT_NE(test::error_of([&] { make_backend(*f.model, o, 8, 4, 16); })
                .find("tensor parallel over 3 ranks: the model's 2 attention heads do not divide by 3"),
            std::string::npos);
  o.tensor_parallel = 1;
  EXPECT_EQ(test::error_of([&] { make_backend(*f.model, o, 0, 4, 16); }),
            "backend: a KV cache of 0 blocks of 4 tokens for 16-token forwards");
  // The scheduler passes the refusal on.
  SchedulerConfig cfg;
  cfg.max_seqs = 2;
  cfg.batch_tokens = 16;
  cfg.ctx_size = 64;
  cfg.kv_blocks = 16;
  cfg.block_size = 4;
  cfg.backend.tensor_parallel = 3;
  EXPECT_NE(test::error_of([&] { Scheduler s(*f.model, *f.tok, cfg); }).find("do not divide by 3"), std::string::npos);
  if (!test::gpu_unavailable().empty()) {
    o.device = Device::Cuda;
    const std::string msg = test::error_of([&] { make_backend(*f.model, o, 8, 4, 16); });
    EXPECT_EQ(msg.rfind("--device cuda: ", 0), 0u) << msg;
  }
}

}  // namespace
}  // namespace sparsemla::engine
