// dist::RankThreads: every rank runs once per call, at the same time as the others, always on its
// own thread; a failing rank stops the others and is named in the error; the threads outlive a
// failure.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dist/rank_threads.h"
#include "test_util.h"

namespace sparsemla::dist {
namespace {

// All n ranks must arrive before any leaves (as in a collective); false after 10 s.
class Rendezvous {
 public:
  explicit Rendezvous(int n) : n_(n) {}
  bool arrive() {
    std::unique_lock<std::mutex> lk(mu_);
    if (++arrived_ == n_) cv_.notify_all();
    return cv_.wait_for(lk, std::chrono::seconds(10), [&] { return arrived_ >= n_; });
  }

 private:
  int n_, arrived_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
};

TEST(RankThreads, EveryRankRunsOnceAtOnceOnItsOwnThread) {
  for (int n : {1, 2, 4, 8}) {
    RankThreads pool(n);
    EXPECT_EQ(pool.size(), n);
    std::vector<std::thread::id> first{size_t(n)};
    for (int call = 0; call < 50; ++call) {
      Rendezvous all(n);
      std::vector<int> runs(size_t(n), 0);
      std::vector<std::thread::id> ids{size_t(n)};
      std::atomic<int> late{0};
      pool.run([&](int r) {
        ++runs[size_t(r)];
        ids[size_t(r)] = std::this_thread::get_id();
        if (!all.arrive()) ++late;  // a rank run after another returned would wait here alone
      });
      EXPECT_EQ(late.load(), 0) << n << " ranks, call " << call;
      EXPECT_EQ(runs, std::vector<int>(size_t(n), 1)) << n << " ranks, call " << call;
      if (call == 0) first = ids;
      EXPECT_EQ(ids, first) << "rank threads changed between calls";
    }
    EXPECT_EQ(std::set<std::thread::id>(first.begin(), first.end()).size(), size_t(n));
    EXPECT_EQ(std::count(first.begin(), first.end(), std::this_thread::get_id()), 0);
  }
}

TEST(RankThreads, TheFirstFailureStopsTheOthersAndIsNamed) {
  RankThreads pool(4);
  // Rank 2 throws while the others wait for a release that only stop gives (as a collective
  // waits until the communicator is aborted).
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  int stops = 0;
  std::string reason;
  const std::string err = test::error_of([&] {
    pool.run(
        [&](int r) {
          if (r == 2) throw std::runtime_error("shard 2 is broken");
          std::unique_lock<std::mutex> lk(mu);
          if (!cv.wait_for(lk, std::chrono::seconds(10), [&] { return released; }))
            throw std::runtime_error("never released");
        },
        [&](const std::string& why) {
          std::lock_guard<std::mutex> lk(mu);
          ++stops;
          reason = why;
          released = true;
          cv.notify_all();
        });
  });
  EXPECT_NE(err.find("tensor parallel: rank 2: shard 2 is broken"), std::string::npos) << err;
  EXPECT_EQ(stops, 1);
  EXPECT_NE(reason.find("rank 2 failed: shard 2 is broken"), std::string::npos) << reason;

  // Two ranks failing: one error, one stop; then the pool runs normally again.
  stops = 0;
  const std::string err2 = test::error_of([&] {
    pool.run([&](int r) { if (r % 2) throw std::runtime_error(fmt::format("rank {} out", r)); },
             [&](const std::string&) { ++stops; });
  });
  EXPECT_TRUE(err2.find("rank 1: rank 1 out") != std::string::npos || err2.find("rank 3: rank 3 out") != std::string::npos)
      << err2;
  EXPECT_EQ(stops, 1);
  std::atomic<int> sum{0};
  pool.run([&](int r) { sum += r + 1; });
  EXPECT_EQ(sum.load(), 1 + 2 + 3 + 4);
}

TEST(RankThreads, CallersFromSeveralThreadsTakeTurns) {
  RankThreads pool(3);
  std::atomic<int> inside{0}, overlap{0}, total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int i = 0; i < 20; ++i)
        pool.run([&](int) {
          if (++inside > 3) ++overlap;  // two runs at once would put more than 3 ranks inside
          ++total;
          std::this_thread::sleep_for(std::chrono::microseconds(50));
          --inside;
        });
    });
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(overlap.load(), 0);
  EXPECT_EQ(total.load(), 4 * 20 * 3);
}

TEST(RankThreads, RefusesNoRanks) {
  EXPECT_NE(test::error_of([] { RankThreads pool(0); }).find("0 rank threads"), std::string::npos);
}

}  // namespace
}  // namespace sparsemla::dist
