// The collectives of ranks in separate processes (or on separate hosts) over the TCP star of a
// TcpBootstrap, in host memory: the CPU forward of a multi-process run, and the host-staged GPU
// one (dist/cuda/sharded_gpu_model.h) where NCCL is not wanted.
//
// Every collective is an exchange through rank 0 carrying a header (which collective, how many
// values, the root), so ranks that call different collectives or sizes all fail with an Error that
// names them, as the in-process group does. all_reduce_sum adds the ranks' values in rank order
// 0, 1, ..., N-1 on every rank, the in-process group's order: a multi-process CPU forward gives the
// bits the threaded one gives. Large collectives travel in chunks. Each exchange waits at most the
// bootstrap's timeout; abort() makes every later collective of this rank throw (the peers learn of
// it when this rank's process exits and its connection closes).
#pragma once
#include <string>

#include "dist/communicator.h"
#include "dist/tcp_bootstrap.h"

namespace sparsemla::dist {

class TcpCommunicator final : public Communicator {
 public:
  explicit TcpCommunicator(TcpBootstrap& boot) : boot_(boot) {}
  int rank() const override { return boot_.rank(); }
  int size() const override { return boot_.size(); }
  void all_reduce_sum(float* data, int64_t n) override;
  void all_gather(const float* in, int64_t n_per_rank, float* out) override;
  void broadcast(float* data, int64_t n, int root) override;
  void barrier() override;
  void abort(const std::string& reason) override { failed_ = reason.empty() ? "aborted" : reason; }

  // Values per rank in one exchange (the bootstrap caps a message at 64 MB for all ranks together).
  int64_t chunk_values() const;

 private:
  enum class Op : uint32_t { AllReduceSum = 1, AllGather = 2, Broadcast = 3, Barrier = 4 };
  // One exchange: this rank's header and `n` values from `in` (none when null); returns every
  // rank's values, after checking that all ranks sent the same header.
  std::vector<std::vector<uint8_t>> exchange(Op op, int64_t n_total, int root, const float* in, int64_t n);
  TcpBootstrap& boot_;
  std::string failed_;
};

}  // namespace sparsemla::dist
