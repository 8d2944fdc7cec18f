// The scheduler's rules on the glm_pub fixture, stepped by hand: batched requests equal the same
// requests alone (and greedy equals the plain forward loop), admission never promises more blocks
// than the cache has, a request that can never fit is refused with its numbers, the token budget
// puts decodes first, shared prefixes are reused, a cancelled request frees its blocks at the next
// step; and stop strings never leak.
#include <gtest/gtest.h>

#include <memory>

#include "engine/scheduler.h"
#include "engine/stop_strings.h"
#include "gguf/reader.h"
#include "test_util.h"

namespace sparsemla::engine {
namespace {

struct Fixture {
  std::unique_ptr<model::Model> model;
  std::unique_ptr<tokenizer::Tokenizer> tok;
};

Fixture& fixture() {
  static Fixture f = [] {
    Fixture x;
    x.model = model::Model::load(test::fixture_path("glm_pub/model-f32.gguf"), {model::AttentionMode::Sparse, 2});
    x.tok = tokenizer::Tokenizer::from_gguf(x.model->file());
    return x;
  }();
  return f;
}

std::vector<int32_t> prompt_of(int n, int32_t salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(int32_t((i * 37 + salt * 101 + 5) % 990));
  return p;
}

GenerationRequest request(std::vector<int32_t> prompt, int max_tokens, uint64_t seed, float temperature = 0.9f) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.seed = seed;
  r.sampling.temperature = temperature;
  r.ignore_eos = true;  // a random model may end anywhere; the tests want exact lengths
  return r;
}

struct Result {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason finish = FinishReason::None;
  Usage usage;
};

// Collects whatever the stream has; true once the request finished.
bool drain(RequestStream& s, Result& r) {
  while (auto e = s.next(std::chrono::milliseconds(0))) {
    for (const auto& t : e->tokens) r.tokens.push_back(t.id);
    r.text += e->text;
    r.usage = e->usage;
    if (e->finish != FinishReason::None) {
      r.finish = e->finish;
      return true;
    }
  }
  return r.finish != FinishReason::None;
}

SchedulerConfig small_config() {
  SchedulerConfig c;
  c.max_seqs = 4;
  c.batch_tokens = 64;
  c.ctx_size = 256;
  c.kv_blocks = 64;
  c.block_size = 4;
  return c;
}

Result run_alone(const GenerationRequest& req, SchedulerConfig cfg = small_config()) {
  Scheduler s(*fixture().model, *fixture().tok, cfg);
  auto stream = s.submit(req);
  Result r;
  for (int i = 0; i < 1000 && !drain(*stream, r); ++i) s.step();
  return r;
}

TEST(Scheduler, GreedyEqualsThePlainForwardLoop) {
  auto& f = fixture();
  const auto prompt = prompt_of(13, 1);
  const Result got = run_alone(request(prompt, 10, 0, 0.0f));
  kv::PagedCache cache(f.model->cache_shape(16, 4));
  std::vector<int32_t> table;
  ASSERT_TRUE(cache.reserve(table, 23));
  std::vector<int32_t> want;
  model::SeqInput in{prompt, 0, &table, false};
  for (int i = 0; i < 10; ++i) {
    std::vector<float> logits;
    f.model->forward({in}, cache, logits);
    want.push_back(int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()));
    in = model::SeqInput{{want.back()}, in.pos0 + int64_t(in.tokens.size()), &table, false};
  }
  EXPECT_EQ(got.tokens, want);
  EXPECT_EQ(got.finish, FinishReason::Length);
  EXPECT_EQ(got.usage.prompt_tokens, 13);
  EXPECT_EQ(got.usage.completion_tokens, 10);
  EXPECT_EQ(got.text, f.tok->decode(want));
}

TEST(Scheduler, BatchedSeededRequestsEqualEachAlone) {
  std::vector<GenerationRequest> reqs = {request(prompt_of(9, 1), 12, 11), request(prompt_of(30, 2), 7, 22),
                                         request(prompt_of(3, 3), 15, 33, 1.3f),
                                         request(prompt_of(17, 4), 10, 44, 0.0f)};
  reqs[1].sampling.top_p = 0.8f;
  reqs[2].sampling.top_k = 20;
  reqs[0].sampling.frequency_penalty = 0.5f;
  SchedulerConfig cfg = small_config();
  cfg.batch_tokens = 16;  // prompts arrive in chunks, mixed with decodes
  Scheduler s(*fixture().model, *fixture().tok, cfg);
  std::vector<std::shared_ptr<RequestStream>> streams;
  std::vector<Result> got(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    streams.push_back(s.submit(reqs[i]));
    s.step();  // arrivals at different steps
  }
  for (int i = 0; i < 200; ++i) {
    bool all = true;
    for (size_t k = 0; k < reqs.size(); ++k) all = drain(*streams[k], got[k]) && all;
    if (all) break;
    s.step();
  }
  for (size_t k = 0; k < reqs.size(); ++k) {
    const Result alone = run_alone(reqs[k]);
    EXPECT_EQ(got[k].tokens, alone.tokens) << "request " << k;
    EXPECT_EQ(got[k].text, alone.text) << "request " << k;
  }
}

TEST(Scheduler, AdmissionNeverOversubscribesTheCache) {
  SchedulerConfig cfg = small_config();
  cfg.kv_blocks = 6;  // 24 tokens
  cfg.prefix_caching = false;
  Scheduler s(*fixture().model, *fixture().tok, cfg);
  // Each needs ceil((8 + 6) / 4) = 4 blocks: only one fits at a time.
  auto a = s.submit(request(prompt_of(8, 1), 6, 1));
  auto b = s.submit(request(prompt_of(8, 2), 6, 2));
  Result ra, rb;
  bool b_started_before_a_ended = false;
  for (int i = 0; i < 100 && !(drain(*a, ra) & drain(*b, rb)); ++i) {
    s.step();
    const SchedulerStats st = s.stats();
    EXPECT_LE(st.blocks_used + st.blocks_reserved, st.blocks_total) << "step " << i;
    EXPECT_LE(st.running, 1) << "step " << i;
    if (!rb.tokens.empty() && ra.finish == FinishReason::None) b_started_before_a_ended = true;
  }
  EXPECT_FALSE(b_started_before_a_ended);
  EXPECT_EQ(ra.tokens, run_alone(request(prompt_of(8, 1), 6, 1)).tokens);
  EXPECT_EQ(rb.tokens, run_alone(request(prompt_of(8, 2), 6, 2)).tokens);
}

TEST(Scheduler, ARequestThatCanNeverFitIsRefusedWithTheNumbers) {
  SchedulerConfig cfg = small_config();
  cfg.kv_blocks = 6;
  Scheduler s(*fixture().model, *fixture().tok, cfg);
  try {
    s.submit(request(prompt_of(20, 1), 10, 1));
    FAIL() << "accepted a request needing 8 blocks of a 6-block cache";
  } catch (const Refused& e) {
    EXPECT_EQ(e.kind, Refused::Kind::TooLarge);
    EXPECT_NE(std::string(e.what()).find("needs 8 KV blocks of 4 tokens (20 in the prompt, 10 to generate)"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("6 blocks"), std::string::npos) << e.what();
  }
  try {
    s.submit(request(prompt_of(200, 1), 100, 1));
    FAIL() << "accepted a request longer than the context";
  } catch (const Refused& e) {
    EXPECT_NE(std::string(e.what()).find("the context is 256 tokens, but the request needs 300"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(s.submit(request({}, 4, 1)), Error);
  EXPECT_THROW(s.submit(request({5, 99999}, 4, 1)), Error);
  EXPECT_THROW(s.submit(request({5}, 0, 1)), Error);
}

TEST(Scheduler, QueueLimitRefuses) {
  SchedulerConfig cfg = small_config();
  cfg.max_waiting = 2;
  Scheduler s(*fixture().model, *fixture().tok, cfg);
  s.submit(request(prompt_of(4, 1), 4, 1));
  s.submit(request(prompt_of(4, 2), 4, 1));
  try {
    s.submit(request(prompt_of(4, 3), 4, 1));
    FAIL();
  } catch (const Refused& e) {
    EXPECT_EQ(e.kind, Refused::Kind::QueueFull);
  }
}

TEST(Scheduler, TheTokenBudgetGoesToDecodesFirstThenPrefillChunks) {
  SchedulerConfig cfg = small_config();
  cfg.batch_tokens = 8;
  Scheduler s(*fixture().model, *fixture().tok, cfg);
  auto a = s.submit(request(prompt_of(4, 1), 20, 1));
  auto b = s.submit(request(prompt_of(4, 2), 20, 2));
  StepReport r = s.step();
  EXPECT_EQ(r.admitted, 2);
  EXPECT_EQ(r.prefill_tokens, 8);
  EXPECT_EQ(r.decode_tokens, 0);
  const auto long_prompt = prompt_of(20, 3);
  auto c = s.submit(request(long_prompt, 5, 3));
  // 20 prompt tokens at 6 a step next to the two decodes: 6, 6, 6, 2.
  const int want_prefill[] = {6, 6, 6, 2};
  for (int want : want_prefill) {
    r = s.step();
    EXPECT_EQ(r.decode_tokens, 2);
    EXPECT_EQ(r.prefill_tokens, want);
  }
  r = s.step();
  EXPECT_EQ(r.decode_tokens, 3);
  EXPECT_EQ(r.prefill_tokens, 0);
  Result rc;
  for (int i = 0; i < 50 && !drain(*c, rc); ++i) s.step();
  EXPECT_EQ(rc.tokens, run_alone(request(long_prompt, 5, 3)).tokens);
}

TEST(Scheduler, SharedPrefixesAreReusedFromTheCache) {
  SchedulerConfig cfg = small_config();
  EngineMetrics metrics;
  Scheduler s(*fixture().model, *fixture().tok, cfg, &metrics);
  const auto system = prompt_of(14, 7);  // 3 full blocks of 4, and 2 more tokens
  auto with_tail = [&](int32_t salt) {
    auto p = system;
    for (int32_t t : prompt_of(5, salt)) p.push_back(t);
    return p;
  };
  Result first, second, same;
  auto s1 = s.submit(request(with_tail(1), 6, 1));
  for (int i = 0; i < 50 && !drain(*s1, first); ++i) s.step();
  EXPECT_EQ(first.usage.cached_tokens, 0);

  auto s2 = s.submit(request(with_tail(2), 6, 2));
  for (int i = 0; i < 50 && !drain(*s2, second); ++i) s.step();
  EXPECT_EQ(second.usage.cached_tokens, 12);  // the 3 full blocks of the shared system prompt
  EXPECT_EQ(metrics.cached_tokens.load(), 12u);

  // The same prompt again: every full block but the one with the last prompt token (19 tokens:
  // blocks 0-3 hold 0..15, and 18 is in block 4, so 16 are reused).
  auto s3 = s.submit(request(with_tail(2), 6, 2));
  for (int i = 0; i < 50 && !drain(*s3, same); ++i) s.step();
  EXPECT_EQ(same.usage.cached_tokens, 16);

  // Reused rows give what computing them gives.
  SchedulerConfig no_cache = cfg;
  no_cache.prefix_caching = false;
  EXPECT_EQ(second.tokens, run_alone(request(with_tail(2), 6, 2), no_cache).tokens);
  EXPECT_EQ(same.tokens, second.tokens);
  EXPECT_EQ(s.stats().blocks_used, 0);
  EXPECT_GT(s.stats().blocks_cached, 0);
}

TEST(Scheduler, ACancelledRequestFreesItsBlocksAtTheNextStep) {
  SchedulerConfig cfg = small_config();
  cfg.prefix_caching = false;
  Scheduler s(*fixture().model, *fixture().tok, cfg);
  auto a = s.submit(request(prompt_of(10, 1), 200, 1));
  auto waiting = s.submit(request(prompt_of(10, 2), 200, 2));
  for (int i = 0; i < 3; ++i) s.step();
  EXPECT_GT(s.stats().blocks_used, 0);
  a->cancel();
  waiting->cancel();
  const StepReport r = s.step();
  EXPECT_EQ(r.finished, 2);
  const SchedulerStats st = s.stats();
  EXPECT_EQ(st.blocks_used, 0);
  EXPECT_EQ(st.blocks_reserved, 0);
  EXPECT_EQ(st.running, 0);
  EXPECT_EQ(st.waiting, 0);
  Result ra;
  drain(*a, ra);
  EXPECT_EQ(ra.finish, FinishReason::Cancelled);
}

TEST(Scheduler, StopStringsEndTheTextBeforeThem) {
  // Greedy text first, then a stop string made of the end of one token and the start of the next.
  GenerationRequest base = request(prompt_of(6, 9), 16, 0, 0.0f);
  const Result full = run_alone(base);
  ASSERT_EQ(full.tokens.size(), 16u);
  const tokenizer::Tokenizer& tok = *fixture().tok;
  std::string stop;
  for (size_t i = 0; i + 1 < full.tokens.size() && stop.empty(); ++i) {
    const std::string a = tok.token_bytes(full.tokens[i]), b = tok.token_bytes(full.tokens[i + 1]);
    if (!a.empty() && !b.empty() && uint8_t(a.back()) < 0x80 && uint8_t(b.front()) < 0x80 &&
        !tok.is_special(full.tokens[i]) && !tok.is_special(full.tokens[i + 1]))
      stop = std::string(1, a.back()) + b.front();
  }
  ASSERT_FALSE(stop.empty());
  GenerationRequest with_stop = base;
  with_stop.stop = {stop, "never appears \x01"};
  const Result got = run_alone(with_stop);
  EXPECT_EQ(got.finish, FinishReason::Stop);
  EXPECT_EQ(got.text, full.text.substr(0, full.text.find(stop)));
}

TEST(StopMatcher, HoldsBackOnlyWhatCouldStartAStopString) {
  StopMatcher m({"</end>", "xyz"});
  EXPECT_EQ(m.push("hello <").text, "hello ");
  EXPECT_EQ(m.push("/e").text, "");
  auto r = m.push("nx");  // "</enx": not a stop string after all; "x" may start "xyz"
  EXPECT_EQ(r.text, "</en");
  EXPECT_FALSE(r.stopped);
  r = m.push("yz tail");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "");

  StopMatcher n({"ab"});
  EXPECT_EQ(n.push("xa").text, "x");
  EXPECT_EQ(n.flush(), "a");  // the end of generation: the held tail is text after all
  StopMatcher none({});
  EXPECT_EQ(none.push("anything").text, "anything");
}

}  // namespace
}  // namespace sparsemla::engine
