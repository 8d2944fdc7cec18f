// A generation request as the engine sees it (token ids in, text and tokens out) and the mailbox
// through which the scheduler thread hands results to the thread that serves the client.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/sampler.h"

namespace sparsemla::engine {

struct GenerationRequest {
  std::vector<int32_t> prompt;  // token ids, not empty
  SamplingParams sampling;
  int32_t max_tokens = 16;        // > 0; prompt + max_tokens fits in the context
  std::vector<std::string> stop;  // stop strings
  bool ignore_eos = false;        // go on past end-of-generation tokens
};

enum class FinishReason { None, Stop, Length, Cancelled, Error };
const char* finish_reason_name(FinishReason r);  // "stop", "length", ...

struct Usage {
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_tokens = 0;  // prompt tokens whose cache rows were reused from another request
};

// What one scheduler step produced for a request.
struct Event {
  std::string text;             // new text: valid UTF-8, never part of a stop string
  std::vector<Sampled> tokens;  // tokens sampled (with logprobs when asked)
  FinishReason finish = FinishReason::None;
  std::string error;  // with FinishReason::Error
  Usage usage;        // so far
};

// One request's results. The scheduler pushes; the client's thread pops and may cancel (a
// disconnected client): the scheduler then drops the request and frees its blocks at its next step.
class RequestStream {
 public:
  // The next event, or nothing when `timeout` passes first.
  std::optional<Event> next(std::chrono::milliseconds timeout) {
    std::unique_lock lk(mu_);
    if (!cv_.wait_for(lk, timeout, [&] { return !events_.empty(); })) return std::nullopt;
    Event e = std::move(events_.front());
    events_.pop_front();
    return e;
  }
  void cancel() {
    std::lock_guard lk(mu_);
    cancelled_ = true;
  }
  bool cancelled() const {
    std::lock_guard lk(mu_);
    return cancelled_;
  }
  void push(Event e) {
    {
      std::lock_guard lk(mu_);
      events_.push_back(std::move(e));
    }
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  bool cancelled_ = false;
};

}  // namespace sparsemla::engine
