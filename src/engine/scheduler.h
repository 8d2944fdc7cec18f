// Continuous batching: one thread owns the backend (the model and its KV cache, on the CPU or the
// GPU, whole or split over ranks) and every running sequence; each step decodes one token for every
// running sequence and fills the rest of the token budget with chunks of waiting prompts. The rules
// are written in src/engine/README.md.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/backend.h"
#include "engine/metrics.h"
#include "engine/request.h"
#include "engine/stop_strings.h"
#include "kv/block_manager.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace sparsemla::engine {

struct SchedulerConfig {
  int32_t max_seqs = 8;        // sequences running at once
  int32_t batch_tokens = 512;  // tokens per forward: one per decoding sequence, the rest prefill
  int32_t ctx_size = 4096;     // positions per sequence (prompt + generated)
  int32_t kv_blocks = 2048;    // blocks in the KV cache
  int32_t block_size = 16;     // tokens per block
  BackendOptions backend;      // where the forward runs (default: the CPU)
  int32_t max_waiting = 256;   // requests queued beyond the running ones
  bool prefix_caching = true;  // share blocks of equal prompt prefixes between requests
  // Special (control) tokens that appear in the output text; every other one decodes to nothing.
  // The server lists the markers its parsers read: <think>, <tool_call>, ...
  std::vector<int32_t> visible_special;
};

// A request the engine refuses at submission: it can never fit, the queue is full, or the
// scheduler is stopping.
class Refused : public Error {
 public:
  enum class Kind { TooLarge, QueueFull, Stopping };
  Refused(Kind kind, const std::string& message) : Error(message), kind(kind) {}
  Kind kind;
};

// What one step did, for tests and logs.
struct StepReport {
  int32_t admitted = 0;        // requests that left the queue this step
  int32_t decode_tokens = 0;   // one per decoding sequence
  int32_t prefill_tokens = 0;  // prompt tokens computed
  int32_t finished = 0;        // requests that ended (including cancelled ones)
};

struct SchedulerStats {
  int32_t waiting = 0;
  int32_t running = 0;
  int32_t blocks_total = 0;
  int32_t blocks_used = 0;      // referenced by a running sequence
  int32_t blocks_cached = 0;    // holding a published prefix, unreferenced (reusable or evictable)
  int32_t blocks_free = 0;      // never used or released unpublished
  int32_t blocks_reserved = 0;  // promised to running sequences, not yet handed out
};

class Scheduler {
 public:
  // Builds the backend cfg.backend names for `model` (which must outlive the scheduler), with a KV
  // cache of cfg.kv_blocks blocks. Throws Error for a bad config or a backend that cannot run.
  Scheduler(model::Model& model, const tokenizer::Tokenizer& tok, const SchedulerConfig& cfg,
            EngineMetrics* metrics = nullptr);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request; any thread. Throws Refused when it can never fit or the queue is full, and
  // Error for a malformed request (empty prompt, max_tokens <= 0, an id outside the vocabulary).
  std::shared_ptr<RequestStream> submit(GenerationRequest req);

  // Runs step() on a thread of its own until stop(); every pending request then ends with an error.
  void start();
  void stop();

  // One scheduling step (the thread's loop body). Tests call it directly, without start().
  StepReport step();

  SchedulerStats stats() const;
  // For its description(); the backend itself is the scheduler thread's.
  const Backend& backend() const { return *backend_; }

 private:
  struct Sequence;
  void intake();
  void drop_cancelled(StepReport& report);
  void admit(StepReport& report);
  void emit_token(Sequence& s, const float* logits);  // [n_vocab]: the request's sampler draws
  void emit(Sequence& s, const Sampled& smp);         // the token drawn, to the request
  // Runs the batch; the sequences whose prompt is complete get their next token (drawn on the GPU
  // when the backend can and none of them needs the host sampler's penalties or logprobs).
  void run_batch(const std::vector<model::SeqInput>& batch, const std::vector<Sequence*>& members);
  // Releases the sequence's blocks and reservation; a cancelled or failed one gets its last event here.
  void finish(Sequence& s, FinishReason why, const std::string& error = {});
  void publish_full_blocks(Sequence& s);
  void update_stats();
  void run();

  const tokenizer::Tokenizer& tok_;
  SchedulerConfig cfg_;
  EngineMetrics* metrics_;
  std::unique_ptr<Backend> backend_;
  kv::BlockManager blocks_;    // over backend_->blocks()
  std::vector<bool> visible_;  // [n_vocab] whether a token's text is part of the output

  // Owned by the scheduler thread (or the test calling step()).
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;  // in admission order
  int32_t reserved_ = 0;                            // blocks promised to running_, not yet allocated
  std::vector<float> logits_;

  // Shared with submitting threads.
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::unique_ptr<Sequence>> inbox_;
  int32_t queued_ = 0;  // inbox_ + waiting_
  bool stopping_ = false;
  SchedulerStats stats_;
  std::thread thread_;
};

}  // namespace sparsemla::engine
