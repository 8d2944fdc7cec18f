// Collective communication between the ranks of a tensor-parallel group, behind one interface:
// the in-process group here (one thread per rank, for the CPU check path and the tests) and NCCL
// (one thread or process per GPU: dist/cuda/nccl_communicator.h). The model code only ever sees a
// Communicator.
//
// Rules every implementation keeps:
//  - Every rank calls the same collectives in the same order with the same sizes; a mismatch is an
//    Error on every rank, never a hang or a silent misread.
//  - all_reduce_sum gives every rank the same bits, and never depends on which rank arrived first:
//    the in-process group sums in rank order 0, 1, ..., size-1; NCCL reduces each element once in
//    an order fixed by its algorithm and topology, then distributes it.
//  - A rank that cannot go on calls abort(); every collective then in progress or later, on every
//    rank, throws sparsemla::Error instead of waiting for it.
//  - Pointers are in the implementation's memory: host memory for the in-process group, device
//    memory for NCCL, whose calls are enqueued on the stream the communicator was made with (ordered
//    with the rank's other work on it) rather than complete on return.
// NCCL keeps the first and third rules only in part: it cannot see a mismatch (so the sequence of
// collectives is checked on the in-process group first), and its abort is this rank's alone (the
// others learn of it from the launch, as nccl_communicator.h says).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace sparsemla::dist {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: data[i] = sum over ranks of data[i].   data: [n]
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
  // out = in of rank 0, then in of rank 1, ...   in: [n_per_rank]   out: [size * n_per_rank]
  // `in` may be out + rank * n_per_rank (in place); otherwise the two must not overlap.
  virtual void all_gather(const float* in, int64_t n_per_rank, float* out) = 0;
  // data of rank `root` to every rank.   data: [n]
  virtual void broadcast(float* data, int64_t n, int root) = 0;
  virtual void barrier() = 0;
  // Releases every rank from the group's collectives with an Error that quotes `reason`.
  virtual void abort(const std::string& reason) = 0;
};

// N ranks in one process, one thread each, meeting at a shared rendezvous. The last rank to reach a
// collective checks that all ranks asked for the same thing, then moves the data for everyone
// while the others wait; so the data movement is serial and in rank order (deterministic).
// Once a collective has failed, the group stays failed: every later collective throws.
class RankThreads;

class InProcessGroup {
 public:
  explicit InProcessGroup(int n_ranks);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int size() const;
  // The communicator of rank r; used by one thread at a time, valid while the group lives.
  Communicator& comm(int rank);
  // Tells the group that `rank` will call no more collectives: a collective that waits for it, now
  // or later, fails instead of hanging.
  void leave(int rank);

  // Runs fn(comm(r)) on size() threads, one per rank, and waits for all of them. A rank that throws
  // aborts the group (releasing the others), and a rank that returns leaves it; run() then throws
  // an Error naming the rank that failed first and its message. The threads are `threads`' (one
  // per rank, kept between calls) when given, else started for this call.
  void run(const std::function<void(Communicator&)>& fn, RankThreads* threads = nullptr);

 private:
  struct State;
  class Rank;
  std::unique_ptr<State> state_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace sparsemla::dist
