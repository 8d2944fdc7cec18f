// Counters and latency histograms that the scheduler and the server update and /metrics reads.
// Every member may be used from any thread.
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

namespace sparsemla::engine {

// A Prometheus histogram: cumulative counts per upper bound, a sum and a count.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size(), 0) {}
  void observe(double v);
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // [bounds.size()] observations <= each bound
    uint64_t count = 0;
    double sum = 0;
  };
  Snapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative
  uint64_t count_ = 0;
  double sum_ = 0;
};

struct EngineMetrics {
  std::atomic<uint64_t> prompt_tokens{0};  // prompt tokens of admitted requests
  std::atomic<uint64_t> cached_tokens{0};  // of those, reused from the prefix cache
  std::atomic<uint64_t> generated_tokens{0};
  std::atomic<uint64_t> steps{0};
  // Seconds; buckets from a fast GPU decode to a slow CPU prefill of a long prompt.
  Histogram time_to_first_token{{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  Histogram inter_token_latency{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}};
};

}  // namespace sparsemla::engine
