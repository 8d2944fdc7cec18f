#include "dist/rank_threads.h"

#include <exception>

#include "util/error.h"

namespace sparsemla::dist {

RankThreads::RankThreads(int n_ranks) {
  if (n_ranks < 1) fail("tensor parallel: {} rank threads", n_ranks);
  threads_.reserve(size_t(n_ranks));
  for (int r = 0; r < n_ranks; ++r) threads_.emplace_back([this, r] { loop(r); });
}

RankThreads::~RankThreads() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    quit_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void RankThreads::run(const std::function<void(int)>& fn, const std::function<void(const std::string&)>& stop) {
  std::lock_guard<std::mutex> turn(run_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    stop_ = stop ? &stop : nullptr;
    failed_ = -1;
    message_.clear();
    pending_ = size();
    ++generation_;
  }
  work_cv_.notify_all();
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return pending_ == 0; });
  fn_ = nullptr;
  stop_ = nullptr;
  if (failed_ >= 0) fail("tensor parallel: rank {}: {}", failed_, message_);
}

void RankThreads::loop(int rank) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* fn;
    const std::function<void(const std::string&)>* stop;
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [&] { return quit_ || generation_ != seen; });
      if (quit_) return;
      seen = generation_;
      fn = fn_;
      stop = stop_;
    }
    std::string error;
    bool threw = false;
    try {
      (*fn)(rank);
    } catch (const std::exception& e) {
      threw = true;
      error = e.what();
    } catch (...) {
      threw = true;
      error = "unknown exception";
    }
    if (threw) {
      bool first = false;
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (failed_ < 0) {
          failed_ = rank;
          message_ = error;
          first = true;
        }
      }
      if (first && stop) (*stop)(fmt::format("rank {} failed: {}", rank, error));
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (--pending_ == 0) done_cv_.notify_all();
  }
}

}  // namespace sparsemla::dist
