// The Communicator over NCCL: one rank per GPU, in one process (a thread per GPU) or in many (one
// per GPU, on one node or several). Built only when CUDA and NCCL are (SPARSEMLA_HAVE_NCCL); plain
// C++ here, so that callers need neither nccl.h nor cuda_runtime.h.
//
// Starting a group: rank 0 makes a unique id (128 opaque bytes naming the group) and every rank
// must get it before it can join. Ranks that are threads of one process can share it in memory;
// processes get it over the TCP bootstrap:
//
//   rank 0:  TcpBootstrap boot = nccl_bootstrap_root(TcpListener("0.0.0.0:29500"), N, timeout);
//   rank r:  TcpBootstrap boot = TcpBootstrap::join("node0:29500", r, N, timeout);
//   every rank:  NcclCommunicator comm(boot, /*device=*/local_rank, stream);
//
// Pointers given to the collectives are device memory of the communicator's GPU. The collectives
// are enqueued on the communicator's stream and return before they complete (ordered with the
// rank's other work on that stream); barrier() alone waits. NCCL does not check that the ranks
// call the same collectives with the same sizes: a mismatch hangs or misreads, so code is checked
// on the in-process group first, which does check.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

#include "dist/communicator.h"
#include "dist/tcp_bootstrap.h"
#include "ops/cuda/buffer.h"

namespace sparsemla::dist {

// ncclUniqueId's bytes (NCCL_UNIQUE_ID_BYTES).
using NcclUniqueId = std::array<uint8_t, 128>;

// A fresh unique id (ncclGetUniqueId), made once by rank 0 for the group. It also opens rank 0's
// NCCL bootstrap socket, which the other ranks reach through the address inside the id.
NcclUniqueId nccl_unique_id();

// Rank 0 of a multi-process start: makes the unique id and hands it to ranks 1..world_size-1 as
// they connect to `listener` (see TcpBootstrap::accept).
TcpBootstrap nccl_bootstrap_root(TcpListener listener, int world_size, std::chrono::milliseconds timeout);

// NCCL_NVLS_ENABLE=0 in this process's environment, unless the user set the variable (to anything).
// Called before every NCCL call that can create or join a communicator.
void nccl_keep_nvls_off();

class NcclCommunicator : public Communicator {
 public:
  // Joins the group named by `id` as `rank` of `size`, on CUDA device `device`, enqueuing on
  // `stream` (a stream of that device; nullptr: the legacy default stream). Blocks until all `size`
  // ranks have joined, so the ranks must join concurrently. Makes `device` current on this thread.
  NcclCommunicator(const NcclUniqueId& id, int rank, int size, int device, cuda::Stream stream);
  // The same, with the id, rank and size that `boot` carries.
  NcclCommunicator(const TcpBootstrap& boot, int device, cuda::Stream stream);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }
  cuda::Stream stream() const { return stream_; }

  void all_reduce_sum(float* data, int64_t n) override;
  void all_gather(const float* in, int64_t n_per_rank, float* out) override;
  void broadcast(float* data, int64_t n, int root) override;
  // A one-value all-reduce, then waits for the stream: on return every rank has reached it and
  // this rank's earlier work on the stream is done.
  void barrier() override;
  // ncclCommAbort: the kernels this rank has in flight are stopped and its later collectives throw
  // Error quoting `reason`. The other ranks are not told by NCCL; a multi-process launch learns of
  // it when this process exits and its bootstrap connection closes. May be called from another
  // thread (a watchdog) while this rank waits in barrier().
  void abort(const std::string& reason) override;

 private:
  void check_usable(const char* op) const;  // throws once aborted
  std::string where() const;                // "nccl rank R of N (GPU D)"

  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  cuda::Stream stream_ = nullptr;
  void* comm_ = nullptr;        // ncclComm_t
  cuda::DeviceBuffer scratch_;  // [1] float, the barrier's all-reduce
  mutable std::mutex mu_;       // guards the two below: abort() may come from another thread
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace sparsemla::dist
