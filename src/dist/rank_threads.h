// One long-lived thread per rank, for running the ranks of an in-process tensor-parallel group
// at once, step after step. Starting N threads per step (what the sharded GPU model did) costs
// tens of microseconds per step and gives each step fresh threads without CUDA state; here rank r
// always runs on the same thread.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace sparsemla::dist {

class RankThreads {
 public:
  explicit RankThreads(int n_ranks);
  ~RankThreads();
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  int size() const { return int(threads_.size()); }

  // fn(r) on rank r's thread for every rank at once; returns when all have returned. The first
  // rank to throw calls stop (once, on its thread, while the others may still wait in a
  // collective: stop's job is to make them return), and its error is thrown here as
  // "tensor parallel: rank R: ..." after every rank has returned. One run at a time; calls from
  // several threads take turns.
  void run(const std::function<void(int)>& fn, const std::function<void(const std::string&)>& stop = {});

 private:
  void loop(int rank);

  std::mutex run_mu_;  // one run at a time
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  const std::function<void(const std::string&)>* stop_ = nullptr;
  uint64_t generation_ = 0;  // bumped per run; each thread runs once per generation
  int pending_ = 0;
  bool quit_ = false;
  int failed_ = -1;
  std::string message_;
  std::vector<std::thread> threads_;
};

}  // namespace sparsemla::dist
