#include "server/metrics_text.h"

#include <fmt/format.h>

namespace sparsemla::server {
namespace {

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void single(std::string& out, const char* name, const char* type, const char* help, double value) {
  header(out, name, type, help);
  out += fmt::format("{} {}\n", name, value);
}

void histogram(std::string& out, const char* name, const char* help, const engine::Histogram& h) {
  header(out, name, "histogram", help);
  const auto s = h.snapshot();
  for (size_t i = 0; i < s.bounds.size(); ++i)
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, s.bounds[i], s.cumulative[i]);
  out +=
      fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, s.count, name, s.sum, name, s.count);
}

}  // namespace

std::string metrics_text(const engine::EngineMetrics& m, const engine::SchedulerStats& st,
                         const std::map<int, uint64_t>& responses_by_status) {
  std::string out;
  header(out, "sparsemla_requests_total", "counter", "HTTP responses sent, by status code.");
  for (const auto& [status, n] : responses_by_status)
    out += fmt::format("sparsemla_requests_total{{status=\"{}\"}} {}\n", status, n);
  single(out, "sparsemla_prompt_tokens_total", "counter", "Prompt tokens of requests admitted to the engine.",
         double(m.prompt_tokens.load()));
  single(out, "sparsemla_prompt_tokens_cached_total", "counter",
         "Prompt tokens whose KV cache rows were reused from an earlier request.", double(m.cached_tokens.load()));
  single(out, "sparsemla_generation_tokens_total", "counter", "Tokens generated.", double(m.generated_tokens.load()));
  single(out, "sparsemla_engine_steps_total", "counter", "Forward passes run by the scheduler.",
         double(m.steps.load()));
  single(out, "sparsemla_requests_waiting", "gauge", "Requests queued for admission (the queue depth).", st.waiting);
  single(out, "sparsemla_requests_running", "gauge", "Requests admitted and generating.", st.running);
  single(out, "sparsemla_kv_blocks_total", "gauge", "Blocks in the KV cache.", st.blocks_total);
  single(out, "sparsemla_kv_blocks_used", "gauge", "KV blocks referenced by running requests.", st.blocks_used);
  single(out, "sparsemla_kv_blocks_free", "gauge", "KV blocks that can be handed out (including cached prefixes).",
         st.blocks_free + st.blocks_cached);
  single(out, "sparsemla_kv_blocks_cached", "gauge", "Free KV blocks that still hold a reusable prompt prefix.",
         st.blocks_cached);
  single(out, "sparsemla_kv_blocks_reserved", "gauge", "KV blocks promised to running requests, not yet filled.",
         st.blocks_reserved);
  histogram(out, "sparsemla_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
            m.time_to_first_token);
  histogram(out, "sparsemla_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
            m.inter_token_latency);
  return out;
}

}  // namespace sparsemla::server
