#include "dist/cuda/nccl_communicator.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <tuple>

#include "ops/cuda/check.cuh"
#include "util/error.h"

namespace sparsemla::dist {
namespace {

static_assert(sizeof(ncclUniqueId) == std::tuple_size_v<NcclUniqueId>, "NcclUniqueId must hold ncclUniqueId");

ncclComm_t nccl(void* comm) { return static_cast<ncclComm_t>(comm); }
cudaStream_t cuda_stream(cuda::Stream s) { return static_cast<cudaStream_t>(s); }

// An NCCL failure as an Error: where, the call, NCCL's name for the result and its last message
// (which says what was wrong: "invalid usage" alone rarely does).
void nccl_check(ncclResult_t result, const char* call, ncclComm_t comm, const std::string& where) {
  if (result == ncclSuccess) return;
  const char* last = ncclGetLastError(comm);
  fail("{}: {} failed: {}{}", where, call, ncclGetErrorString(result),
       last && *last ? fmt::format(" ({})", last) : std::string());
}

NcclUniqueId id_of(const TcpBootstrap& boot) {
  NcclUniqueId id;
  if (boot.blob().size() != id.size())
    fail("tcp bootstrap {} (rank {} of {}): rank 0 sent a blob of {} bytes, an NCCL unique id has {}",
         boot.root_address(), boot.rank(), boot.size(), boot.blob().size(), id.size());
  std::memcpy(id.data(), boot.blob().data(), id.size());
  return id;
}

}  // namespace

void nccl_keep_nvls_off() {
  // NVLink multicast (NVLS, NVLink SHARP) can leave the GPUs of a host that others share out of
  // service, well past the end of this process; it must never switch itself on for us. NCCL reads
  // the variable when it initializes, so it is set before the first call that can; overwrite=0 keeps
  // a value the user set on purpose. Once per process: setenv races with other threads' getenv,
  // and every thread of ours that starts NCCL passes through here first.
  static std::once_flag once;
  std::call_once(once, [] { ::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0); });
}

NcclUniqueId nccl_unique_id() {
  nccl_keep_nvls_off();
  ncclUniqueId uid;
  nccl_check(ncclGetUniqueId(&uid), "ncclGetUniqueId", nullptr, "nccl");
  NcclUniqueId id;
  std::memcpy(id.data(), &uid, id.size());
  return id;
}

TcpBootstrap nccl_bootstrap_root(TcpListener listener, int world_size, std::chrono::milliseconds timeout) {
  const NcclUniqueId id = nccl_unique_id();
  return TcpBootstrap::accept(std::move(listener), world_size, std::vector<uint8_t>(id.begin(), id.end()), timeout);
}

NcclCommunicator::NcclCommunicator(const NcclUniqueId& id, int rank, int size, int device, cuda::Stream stream)
    : rank_(rank), size_(size), device_(device), stream_(stream) {
  if (size < 1 || rank < 0 || rank >= size) fail("{}: rank {} is not in a group of {}", where(), rank, size);
  int n_devices = 0;
  SPARSEMLA_CUDA_CHECK(cudaGetDeviceCount(&n_devices));
  if (device < 0 || device >= n_devices)
    fail("{}: there is no CUDA device {} (this process sees {})", where(), device, n_devices);
  SPARSEMLA_CUDA_CHECK(cudaSetDevice(device));
  scratch_ = cuda::DeviceBuffer(sizeof(float));
  scratch_.zero();

  nccl_keep_nvls_off();
  ncclUniqueId uid;
  std::memcpy(&uid, id.data(), sizeof uid);
  ncclComm_t comm = nullptr;
  nccl_check(ncclCommInitRank(&comm, size, uid, rank), "ncclCommInitRank", nullptr, where());
  comm_ = comm;
}

NcclCommunicator::NcclCommunicator(const TcpBootstrap& boot, int device, cuda::Stream stream)
    : NcclCommunicator(id_of(boot), boot.rank(), boot.size(), device, stream) {}

NcclCommunicator::~NcclCommunicator() {
  std::lock_guard<std::mutex> lk(mu_);
  if (aborted_) return;  // ncclCommAbort has freed it
  cudaSetDevice(device_);
  ncclCommDestroy(nccl(comm_));
}

std::string NcclCommunicator::where() const {
  return fmt::format("nccl rank {} of {} (GPU {})", rank_, size_, device_);
}

void NcclCommunicator::check_usable(const char* op) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (aborted_) fail("{}: {} after the communicator was aborted: {}", where(), op, abort_reason_);
}

void NcclCommunicator::all_reduce_sum(float* data, int64_t n) {
  check_usable("all_reduce_sum");
  if (n < 0 || (n > 0 && !data)) fail("{}: all_reduce_sum of {} values at {}", where(), n, static_cast<void*>(data));
  nccl_check(ncclAllReduce(data, data, size_t(n), ncclFloat32, ncclSum, nccl(comm_), cuda_stream(stream_)),
             "ncclAllReduce", nccl(comm_), where());
}

void NcclCommunicator::all_gather(const float* in, int64_t n_per_rank, float* out) {
  check_usable("all_gather");
  if (n_per_rank < 0 || (n_per_rank > 0 && (!in || !out)))
    fail("{}: all_gather of {} values per rank from {} to {}", where(), n_per_rank, static_cast<const void*>(in),
         static_cast<void*>(out));
  nccl_check(ncclAllGather(in, out, size_t(n_per_rank), ncclFloat32, nccl(comm_), cuda_stream(stream_)),
             "ncclAllGather", nccl(comm_), where());
}

void NcclCommunicator::broadcast(float* data, int64_t n, int root) {
  check_usable("broadcast");
  if (n < 0 || (n > 0 && !data)) fail("{}: broadcast of {} values at {}", where(), n, static_cast<void*>(data));
  if (root < 0 || root >= size_) fail("{}: broadcast: root {} is not a rank of a group of {}", where(), root, size_);
  nccl_check(ncclBroadcast(data, data, size_t(n), ncclFloat32, root, nccl(comm_), cuda_stream(stream_)),
             "ncclBroadcast", nccl(comm_), where());
}

void NcclCommunicator::barrier() {
  all_reduce_sum(scratch_.as<float>(), 1);
  const cudaError_t synced = cudaStreamSynchronize(cuda_stream(stream_));
  check_usable("barrier");  // an abort from another thread is what ended the wait
  if (synced != cudaSuccess) fail("{}: barrier: waiting for the stream: {}", where(), cudaGetErrorString(synced));
  ncclResult_t async = ncclSuccess;
  nccl_check(ncclCommGetAsyncError(nccl(comm_), &async), "ncclCommGetAsyncError", nccl(comm_), where());
  nccl_check(async, "barrier (an asynchronous NCCL error)", nccl(comm_), where());
}

void NcclCommunicator::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (aborted_) return;
    aborted_ = true;
    abort_reason_ = reason;
  }
  // Its result is of no use: the communicator is gone either way, and abort() runs in error paths.
  cudaSetDevice(device_);
  ncclCommAbort(nccl(comm_));
}

}  // namespace sparsemla::dist
