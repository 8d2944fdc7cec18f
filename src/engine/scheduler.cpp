#include "engine/scheduler.h"

#include <algorithm>

namespace sparsemla::engine {

using Clock = std::chrono::steady_clock;

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::None: return "none";
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Error: return "error";
  }
  return "none";
}

struct Scheduler::Sequence {
  Sequence(GenerationRequest r, const tokenizer::Tokenizer& tok)
      : req(std::move(r)),
        stream(std::make_shared<RequestStream>()),
        tokens(req.prompt),
        n_prompt(int32_t(req.prompt.size())),
        sampler(req.sampling, req.prompt),
        decoder(tok),
        stop(req.stop),
        arrival(Clock::now()) {}

  GenerationRequest req;
  std::shared_ptr<RequestStream> stream;
  std::vector<int32_t> tokens;  // the prompt, then every sampled token
  int32_t n_prompt;
  int64_t n_computed = 0;  // positions whose cache rows are written
  int32_t n_cached = 0;    // prompt positions reused from the prefix cache
  int32_t generated = 0;
  std::vector<int32_t> table;    // block table
  std::vector<uint64_t> hashes;  // chained hashes of the full blocks of `tokens` known so far
  int32_t n_published = 0;       // leading blocks published to the prefix cache
  int32_t reserved = 0;          // blocks promised at admission, not yet allocated
  Sampler sampler;
  tokenizer::StreamDecoder decoder;
  StopMatcher stop;
  Clock::time_point arrival, last_token;
  bool done = false;

  bool decoding() const { return n_computed >= n_prompt; }
  Usage usage() const { return {n_prompt, generated, n_cached}; }
};

namespace {

const SchedulerConfig& checked(const SchedulerConfig& cfg) {
  if (cfg.max_seqs <= 0 || cfg.batch_tokens < cfg.max_seqs || cfg.ctx_size <= 0)
    fail("scheduler: max_seqs {} must be > 0 and <= batch_tokens {}, ctx_size {} > 0", cfg.max_seqs, cfg.batch_tokens,
         cfg.ctx_size);
  return cfg;
}

// The backend's options, with what the scheduler knows of its forwards: logits for one row per
// sequence (the GPU's workspace estimate).
BackendOptions backend_options(const SchedulerConfig& cfg) {
  BackendOptions o = cfg.backend;
#if SPARSEMLA_HAVE_CUDA
  o.gpu.max_logit_rows = cfg.max_seqs;
#endif
  return o;
}

}  // namespace

Scheduler::Scheduler(model::Model& model, const tokenizer::Tokenizer& tok, const SchedulerConfig& cfg,
                     EngineMetrics* metrics)
    : tok_(tok),
      cfg_(checked(cfg)),
      metrics_(metrics),
      backend_(make_backend(model, backend_options(cfg), cfg.kv_blocks, cfg.block_size, cfg.batch_tokens)),
      blocks_(backend_->blocks()) {
  const int32_t n_vocab = int32_t(backend_->n_vocab());
  visible_.assign(size_t(n_vocab), false);
  for (int32_t id = 0; id < std::min(n_vocab, tok.n_vocab()); ++id) visible_[size_t(id)] = !tok.is_special(id);
  for (int32_t id : cfg.visible_special)
    if (id >= 0 && id < std::min(n_vocab, tok.n_vocab())) visible_[size_t(id)] = true;
  update_stats();
}

Scheduler::~Scheduler() { stop(); }

std::shared_ptr<RequestStream> Scheduler::submit(GenerationRequest req) {
  const int64_t n_prompt = int64_t(req.prompt.size());
  if (n_prompt == 0) fail("the prompt has no tokens");
  if (req.max_tokens <= 0) fail("max_tokens must be at least 1, got {}", req.max_tokens);
  const int64_t n_vocab = backend_->n_vocab();
  for (int32_t id : req.prompt)
    if (id < 0 || id >= n_vocab) fail("token id {} is outside the vocabulary of {} tokens", id, n_vocab);
  const int64_t total = n_prompt + req.max_tokens;
  if (total > cfg_.ctx_size)
    throw Refused(Refused::Kind::TooLarge,
                  fmt::format("the context is {} tokens, but the request needs {} ({} in the prompt, {} to generate)",
                              cfg_.ctx_size, total, n_prompt, req.max_tokens));
  const int64_t blocks = (total + cfg_.block_size - 1) / cfg_.block_size;
  if (blocks > cfg_.kv_blocks)
    throw Refused(Refused::Kind::TooLarge,
                  fmt::format("the request needs {} KV blocks of {} tokens ({} in the prompt, {} to generate), but "
                              "the cache has {} blocks in all",
                              blocks, cfg_.block_size, n_prompt, req.max_tokens, cfg_.kv_blocks));
  auto seq = std::make_unique<Sequence>(std::move(req), tok_);
  auto stream = seq->stream;
  {
    std::lock_guard lk(mu_);
    if (stopping_) throw Refused(Refused::Kind::Stopping, "the server is shutting down");
    if (queued_ >= cfg_.max_waiting)
      throw Refused(Refused::Kind::QueueFull,
                    fmt::format("{} requests are already waiting (the limit is {})", queued_, cfg_.max_waiting));
    ++queued_;
    inbox_.push_back(std::move(seq));
  }
  wake_.notify_all();
  return stream;
}

void Scheduler::intake() {
  std::lock_guard lk(mu_);
  while (!inbox_.empty()) {
    waiting_.push_back(std::move(inbox_.front()));
    inbox_.pop_front();
  }
}

void Scheduler::finish(Sequence& s, FinishReason why, const std::string& error) {
  if (s.done) return;
  s.done = true;
  blocks_.release(s.table);
  reserved_ -= s.reserved;
  s.reserved = 0;
  if (why == FinishReason::Cancelled || why == FinishReason::Error) {
    Event e;
    e.finish = why;
    e.error = error;
    e.usage = s.usage();
    s.stream->push(std::move(e));
  }
}

void Scheduler::drop_cancelled(StepReport& report) {
  for (auto& s : running_)
    if (!s->done && s->stream->cancelled()) {
      finish(*s, FinishReason::Cancelled);
      ++report.finished;
    }
  const size_t before = waiting_.size();
  std::erase_if(waiting_, [&](const auto& s) {
    if (!s->stream->cancelled()) return false;
    finish(*s, FinishReason::Cancelled);
    return true;
  });
  if (waiting_.size() != before) {
    report.finished += int32_t(before - waiting_.size());
    std::lock_guard lk(mu_);
    queued_ -= int32_t(before - waiting_.size());
  }
}

void Scheduler::admit(StepReport& report) {
  const int32_t bs = cfg_.block_size;
  while (!waiting_.empty() && int32_t(running_.size()) < cfg_.max_seqs) {
    Sequence& s = *waiting_.front();
    if (s.hashes.empty()) s.hashes = kv::block_hashes(s.tokens, bs);
    // Reuse whole blocks only, and never the one holding the last prompt token: its logits are
    // needed, and a shared block must not be written.
    kv::BlockManager::PrefixMatch m;
    if (cfg_.prefix_caching) {
      const size_t limit = size_t((s.n_prompt - 1) / bs);
      m = blocks_.match(std::span(s.hashes).first(std::min(limit, s.hashes.size())), s.tokens);
    }
    const int32_t need = int32_t((s.n_prompt + s.req.max_tokens + bs - 1) / bs) - m.blocks;
    // FCFS: the head of the queue waits for room rather than being overtaken.
    if (need > blocks_.n_available() - m.idle - reserved_) break;
    blocks_.acquire(s.hashes, m.blocks, s.table);
    s.n_published = m.blocks;
    s.n_computed = s.n_cached = m.blocks * bs;
    s.reserved = need;
    reserved_ += need;
    if (metrics_) {
      metrics_->prompt_tokens += uint64_t(s.n_prompt);
      metrics_->cached_tokens += uint64_t(s.n_cached);
    }
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    ++report.admitted;
    std::lock_guard lk(mu_);
    --queued_;
  }
}

void Scheduler::publish_full_blocks(Sequence& s) {
  const int32_t bs = cfg_.block_size;
  while (int64_t(s.n_published + 1) * bs <= s.n_computed) {
    const size_t k = size_t(s.n_published);
    const std::span<const int32_t> toks(s.tokens.data() + k * size_t(bs), size_t(bs));
    if (k == s.hashes.size()) s.hashes.push_back(kv::block_hash(k ? s.hashes[k - 1] : kv::kRootHash, toks));
    if (cfg_.prefix_caching) blocks_.publish(s.table[k], s.hashes[k], toks);
    ++s.n_published;
  }
}

void Scheduler::emit_token(Sequence& s, const float* logits) {
  emit(s, s.sampler.sample(std::span(logits, size_t(backend_->n_vocab()))));
}

void Scheduler::emit(Sequence& s, const Sampled& smp) {
  s.sampler.accept(smp.id);
  s.tokens.push_back(smp.id);
  ++s.generated;
  const auto now = Clock::now();
  if (metrics_) {
    ++metrics_->generated_tokens;
    if (s.generated == 1) metrics_->time_to_first_token.observe(std::chrono::duration<double>(now - s.arrival).count());
    else metrics_->inter_token_latency.observe(std::chrono::duration<double>(now - s.last_token).count());
  }
  s.last_token = now;

  Event e;
  e.tokens.push_back(smp);
  FinishReason why = FinishReason::None;
  bool stop_string = false;
  if (!s.req.ignore_eos && tok_.is_eog(smp.id)) {
    why = FinishReason::Stop;
  } else {
    auto out = s.stop.push(visible_[size_t(smp.id)] ? s.decoder.push(smp.id) : std::string());
    e.text = std::move(out.text);
    stop_string = out.stopped;
    if (stop_string) why = FinishReason::Stop;
  }
  if (why == FinishReason::None && s.generated >= s.req.max_tokens) why = FinishReason::Length;
  if (why != FinishReason::None && !stop_string) {
    // The end without a stop string: what is held back is text after all (an unfinished character
    // becomes U+FFFD), unless it completes a stop string.
    auto tail = s.stop.push(s.decoder.flush());
    e.text += tail.text;
    if (tail.stopped) why = FinishReason::Stop;
    else e.text += s.stop.flush();
  }
  e.finish = why;
  e.usage = s.usage();
  if (why != FinishReason::None) finish(s, why);
  s.stream->push(std::move(e));
}

StepReport Scheduler::step() {
  StepReport report;
  intake();
  drop_cancelled(report);
  std::erase_if(running_, [](const auto& s) { return s->done; });
  admit(report);

  std::vector<model::SeqInput> batch;
  std::vector<Sequence*> members;
  int32_t budget = cfg_.batch_tokens;
  auto add = [&](Sequence& s, int32_t n) {
    const int32_t added = blocks_.grow(s.table, s.n_computed + n);
    if (added < 0) fail("scheduler: no block for a running sequence, though {} were reserved", s.reserved);
    s.reserved -= added;
    reserved_ -= added;
    model::SeqInput in;
    in.tokens.assign(s.tokens.begin() + s.n_computed, s.tokens.begin() + s.n_computed + n);
    in.pos0 = s.n_computed;
    in.block_table = &s.table;
    batch.push_back(std::move(in));
    members.push_back(&s);
    budget -= n;
  };
  for (auto& s : running_)
    if (s->decoding()) {
      add(*s, 1);
      ++report.decode_tokens;
    }
  for (auto& s : running_)
    if (!s->decoding() && budget > 0) {
      const int32_t n = int32_t(std::min<int64_t>(s->n_prompt - s->n_computed, budget));
      add(*s, n);
      report.prefill_tokens += n;
    }

  if (!batch.empty()) {
    run_batch(batch, members);
    if (metrics_) ++metrics_->steps;
  }
  for (const auto& s : running_) report.finished += s->done;
  std::erase_if(running_, [](const auto& s) { return s->done; });
  update_stats();
  return report;
}

void Scheduler::run_batch(const std::vector<model::SeqInput>& batch, const std::vector<Sequence*>& members) {
  auto failed = [&](const std::exception& ex) {
    for (Sequence* s : members) finish(*s, FinishReason::Error, std::string("the forward pass failed: ") + ex.what());
  };
  // A member emits when this forward completes its prompt (or it is decoding).
  std::vector<bool> emits(members.size());
  for (size_t i = 0; i < members.size(); ++i)
    emits[i] = members[i]->n_computed + int64_t(batch[i].tokens.size()) == int64_t(members[i]->tokens.size());
#if SPARSEMLA_HAVE_CUDA
  bool on_device = backend_->samples_on_device();
  for (size_t i = 0; i < members.size() && on_device; ++i) {
    const SamplingParams& p = members[i]->sampler.params();
    on_device = !emits[i] || (p.top_logprobs < 0 && p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f &&
                              p.repetition_penalty == 1.0f);
  }
  std::vector<int32_t> ids;
  if (on_device) {
    std::vector<cuda::RowSampling> rows(members.size());
    for (size_t i = 0; i < members.size(); ++i) {
      const SamplingParams& p = members[i]->sampler.params();
      rows[i] = cuda::RowSampling{p.temperature, p.top_p, p.top_k, p.min_p, p.seed, uint64_t(members[i]->generated)};
    }
    try {
      backend_->forward_sample(batch, rows, ids);
    } catch (const std::exception& ex) {
      return failed(ex);
    }
  }
#else
  const bool on_device = false;
  std::vector<int32_t> ids;
#endif
  if (!on_device) {
    logits_.clear();
    try {
      backend_->forward(batch, logits_);
    } catch (const std::exception& ex) {
      return failed(ex);
    }
  }
  const size_t n_vocab = size_t(backend_->n_vocab());
  for (size_t i = 0; i < members.size(); ++i) {
    Sequence& s = *members[i];
    s.n_computed += int64_t(batch[i].tokens.size());
    publish_full_blocks(s);
    if (!emits[i]) continue;
    if (on_device) emit(s, Sampled{ids[i], 0.0f, {}});
    else emit_token(s, logits_.data() + i * n_vocab);
  }
}

void Scheduler::update_stats() {
  SchedulerStats st;
  st.running = int32_t(running_.size());
  st.blocks_total = blocks_.n_blocks();
  st.blocks_used = blocks_.n_used();
  st.blocks_cached = blocks_.n_cached();
  st.blocks_free = blocks_.n_available() - blocks_.n_cached();
  st.blocks_reserved = reserved_;
  std::lock_guard lk(mu_);
  st.waiting = queued_;
  stats_ = st;
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard lk(mu_);
  SchedulerStats st = stats_;
  st.waiting = queued_;
  return st;
}

void Scheduler::start() {
  std::lock_guard lk(mu_);
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { run(); });
}

void Scheduler::run() {
  for (;;) {
    {
      std::unique_lock lk(mu_);
      wake_.wait(lk, [&] { return stopping_ || !inbox_.empty() || !waiting_.empty() || !running_.empty(); });
      if (stopping_) return;
    }
    step();
  }
}

void Scheduler::stop() {
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  intake();
  for (auto& s : running_) finish(*s, FinishReason::Error, "the server is shutting down");
  for (auto& s : waiting_) finish(*s, FinishReason::Error, "the server is shutting down");
  running_.clear();
  waiting_.clear();
  std::lock_guard lk(mu_);
  queued_ = 0;
}

}  // namespace sparsemla::engine
