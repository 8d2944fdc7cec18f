#include "dist/communicator.h"

#include <fmt/format.h>

#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "dist/rank_threads.h"
#include "util/error.h"

namespace sparsemla::dist {
namespace {

enum class Op { AllReduceSum, AllGather, Broadcast, Barrier };

const char* op_name(Op op) {
  switch (op) {
    case Op::AllReduceSum: return "all_reduce_sum";
    case Op::AllGather: return "all_gather";
    case Op::Broadcast: return "broadcast";
    case Op::Barrier: return "barrier";
  }
  return "?";
}

// What one rank asked for in a collective.
struct Post {
  Op op = Op::Barrier;
  const float* in = nullptr;
  float* out = nullptr;
  int64_t n = 0;  // values (per rank, for all_gather)
  int root = 0;   // broadcast
};

}  // namespace

struct InProcessGroup::State {
  explicit State(int n_ranks) : n(n_ranks), posts(size_t(n_ranks)), left(size_t(n_ranks), false) {}

  const int n;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Post> posts;   // [n] the current collective, as each rank posted it
  std::vector<bool> left;    // [n] ranks that will call no more collectives
  int arrived = 0;           // ranks in the current collective
  Op current = Op::Barrier;  // the current collective, as the first rank to arrive called it
  uint64_t generation = 0;   // collectives completed
  bool failed = false;
  std::string failure;       // the first reason the group failed
  std::vector<float> sum;    // all_reduce scratch

  // Under the lock: the group fails (the first reason is kept) and every waiting rank wakes.
  void fail_locked(std::string why) {
    if (!failed) {
      failed = true;
      failure = std::move(why);
    }
    cv.notify_all();
  }

  void collective(int rank, const Post& p) {
    std::unique_lock<std::mutex> lk(mu);
    if (failed) throw Error(fmt::format("rank {}: {} abandoned: {}", rank, op_name(p.op), failure));
    for (int r = 0; r < n; ++r)
      if (left[size_t(r)]) {
        fail_locked(fmt::format("rank {} called {} after rank {} had left the group", rank, op_name(p.op), r));
        throw Error(failure);
      }
    posts[size_t(rank)] = p;
    if (arrived == 0) current = p.op;
    const uint64_t gen = generation;
    if (++arrived < n) {
      cv.wait(lk, [&] { return generation != gen || failed; });
      if (generation == gen) throw Error(fmt::format("rank {}: {} abandoned: {}", rank, op_name(p.op), failure));
      return;
    }
    const std::string mismatch = check_locked();
    if (!mismatch.empty()) {
      fail_locked(mismatch);
      throw Error(failure);
    }
    execute_locked();
    arrived = 0;
    ++generation;
    cv.notify_all();
  }

  // "" when every rank asked for the same collective with the same sizes.
  std::string check_locked() const {
    const Post& p0 = posts[0];
    for (int r = 1; r < n; ++r)
      if (posts[size_t(r)].op != p0.op)
        return fmt::format("collective mismatch: rank 0 called {}, rank {} called {}", op_name(p0.op), r,
                           op_name(posts[size_t(r)].op));
    bool same = true;
    for (int r = 1; r < n; ++r) same = same && posts[size_t(r)].n == p0.n && posts[size_t(r)].root == p0.root;
    if (!same) {
      std::string sizes, roots;
      for (int r = 0; r < n; ++r) {
        sizes += fmt::format("{}{}", r ? ", " : "", posts[size_t(r)].n);
        roots += fmt::format("{}{}", r ? ", " : "", posts[size_t(r)].root);
      }
      return p0.op == Op::Broadcast
                 ? fmt::format("broadcast: the ranks disagree: values by rank {}; root by rank {}", sizes, roots)
                 : fmt::format("{}: the ranks disagree on the size: values by rank {}", op_name(p0.op), sizes);
    }
    if (p0.n < 0) return fmt::format("{}: negative size {}", op_name(p0.op), p0.n);
    if (p0.op == Op::Broadcast && (p0.root < 0 || p0.root >= n))
      return fmt::format("broadcast: root {} is not a rank of a group of {}", p0.root, n);
    for (int r = 0; r < n; ++r)
      if (p0.op != Op::Barrier && p0.n > 0 && (!posts[size_t(r)].in || !posts[size_t(r)].out))
        return fmt::format("{}: rank {} gave a null buffer for {} values", op_name(p0.op), r, p0.n);
    return "";
  }

  // Moves the data for every rank (they all wait meanwhile): sums in rank order, one result for all.
  void execute_locked() {
    const size_t n_vals = size_t(posts[0].n);
    switch (posts[0].op) {
      case Op::AllReduceSum:
        sum.assign(posts[0].in, posts[0].in + n_vals);
        for (int r = 1; r < n; ++r) {
          const float* in = posts[size_t(r)].in;
          for (size_t i = 0; i < n_vals; ++i) sum[i] += in[i];
        }
        for (int r = 0; r < n; ++r) std::memcpy(posts[size_t(r)].out, sum.data(), n_vals * sizeof(float));
        break;
      case Op::AllGather:
        // memmove: a rank's input may already sit in its own slot of its output (in place).
        for (int d = 0; d < n; ++d)
          for (int r = 0; r < n; ++r)
            std::memmove(posts[size_t(d)].out + size_t(r) * n_vals, posts[size_t(r)].in, n_vals * sizeof(float));
        break;
      case Op::Broadcast:
        for (int r = 0; r < n; ++r)
          if (r != posts[0].root)
            std::memcpy(posts[size_t(r)].out, posts[size_t(posts[0].root)].in, n_vals * sizeof(float));
        break;
      case Op::Barrier: break;
    }
  }
};

class InProcessGroup::Rank : public Communicator {
 public:
  Rank(State& s, int rank) : s_(s), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_.n; }
  void all_reduce_sum(float* data, int64_t n) override { s_.collective(rank_, {Op::AllReduceSum, data, data, n, 0}); }
  void all_gather(const float* in, int64_t n_per_rank, float* out) override {
    s_.collective(rank_, {Op::AllGather, in, out, n_per_rank, 0});
  }
  void broadcast(float* data, int64_t n, int root) override { s_.collective(rank_, {Op::Broadcast, data, data, n, root}); }
  void barrier() override { s_.collective(rank_, {Op::Barrier, nullptr, nullptr, 0, 0}); }
  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lk(s_.mu);
    s_.fail_locked(fmt::format("rank {} failed: {}", rank_, reason));
  }

 private:
  State& s_;
  int rank_;
};

InProcessGroup::InProcessGroup(int n_ranks) {
  if (n_ranks < 1) fail("a process group needs at least one rank, got {}", n_ranks);
  state_ = std::make_unique<State>(n_ranks);
  for (int r = 0; r < n_ranks; ++r) ranks_.push_back(std::make_unique<Rank>(*state_, r));
}

InProcessGroup::~InProcessGroup() = default;

int InProcessGroup::size() const { return state_->n; }

Communicator& InProcessGroup::comm(int rank) {
  if (rank < 0 || rank >= state_->n) fail("rank {} is not in a group of {}", rank, state_->n);
  return *ranks_[size_t(rank)];
}

void InProcessGroup::leave(int rank) {
  if (rank < 0 || rank >= state_->n) fail("rank {} is not in a group of {}", rank, state_->n);
  std::lock_guard<std::mutex> lk(state_->mu);
  state_->left[size_t(rank)] = true;
  if (state_->arrived > 0)
    state_->fail_locked(fmt::format("rank {} left the group while {} other rank(s) wait for it in {}", rank,
                                    state_->arrived, op_name(state_->current)));
}

void InProcessGroup::run(const std::function<void(Communicator&)>& fn, RankThreads* pool) {
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    if (state_->failed) throw Error(state_->failure);
    state_->left.assign(size_t(state_->n), false);
  }
  if (pool && pool->size() != state_->n)
    fail("tensor parallel: {} rank threads for a group of {}", pool->size(), state_->n);
  // A rank's error aborts the group here; run() reports the group's first failure below.
  const auto rank_run = [this, &fn](int r) {
    try {
      fn(*ranks_[size_t(r)]);
      leave(r);
    } catch (const std::exception& e) {
      ranks_[size_t(r)]->abort(e.what());
    } catch (...) {
      ranks_[size_t(r)]->abort("unknown exception");
    }
  };
  if (pool) {
    pool->run(rank_run);
  } else {
    std::vector<std::thread> threads;
    for (int r = 0; r < state_->n; ++r) threads.emplace_back(rank_run, r);
    for (auto& t : threads) t.join();
  }
  std::lock_guard<std::mutex> lk(state_->mu);
  if (state_->failed) throw Error(state_->failure);
}

}  // namespace sparsemla::dist
