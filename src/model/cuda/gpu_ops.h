// The few device operations the GPU model needs beyond ops/cuda: its stream, copies on it, the
// device's memory, and the row gather and weighted combine around the routed experts. Plain C++
// (no CUDA headers); every pointer is a device pointer unless it says host.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ops/cuda/buffer.h"

namespace sparsemla::model::gpu {

// Makes `device` current for this thread; throws Error naming the device on failure.
void set_device(int device);
// Free and total memory of the current device, in bytes.
void memory_info(uint64_t* free_bytes, uint64_t* total_bytes);
// The current device's stream-ordered allocations (cudaMallocAsync: the tile kernel's split sums,
// the cuBLAS prefill's scratch) keep up to `bytes` of freed memory in their pool across
// synchronizations instead of returning it (the default, 0), so that a product after a host sync
// does not map its memory again.
void keep_stream_ordered_memory(uint64_t bytes);

// A CUDA stream owned by the host object that holds it (blocking: it orders with the legacy
// default stream that DeviceBuffer's copies use).
class OwnedStream {
 public:
  OwnedStream();
  ~OwnedStream();
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  cuda::Stream get() const { return s_; }
  void synchronize() const;

 private:
  cuda::Stream s_ = nullptr;
};

// A second stream for work that may run beside the main stream's (a branch of the step): fork(main)
// makes the work enqueued here next wait for everything enqueued on `main` so far; join(main) makes
// the work enqueued on `main` next wait for everything enqueued here so far. Both are event
// dependencies, so they also hold inside a graph capture of `main` (the branch becomes parallel
// nodes of the graph).
class SideStream {
 public:
  SideStream();
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  cuda::Stream get() const { return stream_.get(); }
  void fork(cuda::Stream main);
  void join(cuda::Stream main);

 private:
  OwnedStream stream_;
  void* forked_ = nullptr;  // cudaEvent_t
  void* joined_ = nullptr;
};

// A captured sequence of the stream's work (a CUDA graph), replayed by launch(). Capture is in
// relaxed mode: host calls that enqueue nothing (attribute setting, allocations) are allowed
// between begin_capture and end_capture, while nothing the capture records runs until launch.
class Graph {
 public:
  Graph() = default;
  ~Graph();
  Graph(Graph&& o) noexcept : exec_(o.exec_) { o.exec_ = nullptr; }
  Graph& operator=(Graph&& o) noexcept;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  static void begin_capture(cuda::Stream s);
  // Ends the capture and instantiates it; throws Error (after ending the capture) when something
  // enqueued during it could not be captured.
  static Graph end_capture(cuda::Stream s);
  // Ends a capture that failed part way (an exception in the captured code), discarding it.
  static void abandon_capture(cuda::Stream s);
  void launch(cuda::Stream s) const;
  bool empty() const { return exec_ == nullptr; }

 private:
  void* exec_ = nullptr;  // cudaGraphExec_t
};

// Device time between marks on a stream, summed by label over many steps: where a forward's time
// goes, without a profiler. mark(label) records an event; the time since the previous mark is
// charged to `label`. collect() waits for the stream and adds the step's intervals to the totals.
class StepTimer {
 public:
  // hold_us > 0: each step starts behind a kernel that waits that long, while the host enqueues
  // the step (make it longer than the host takes to launch one step).
  explicit StepTimer(cuda::Stream s, int hold_us = 0) : s_(s), hold_us_(hold_us) {}
  ~StepTimer();
  StepTimer(const StepTimer&) = delete;
  StepTimer& operator=(const StepTimer&) = delete;
  void mark(const char* label);
  void collect();
  // One line per label, largest first: total ms, share, calls, ms per step.
  std::string report() const;

 private:
  struct Total {
    double ms = 0;
    int64_t calls = 0;
  };
  cuda::Stream s_;
  int hold_us_ = 0;
  std::vector<std::pair<const char*, void*>> marks_;  // this step's (label, cudaEvent_t)
  std::vector<void*> pool_;                           // events to reuse
  std::vector<std::pair<std::string, Total>> totals_;
  int64_t steps_ = 0;
};

void upload_async(void* dst, const void* host, size_t bytes, cuda::Stream s);
// Waits for everything enqueued on the stream.
void synchronize(cuda::Stream s);
// Copies to the host and waits for it (and for everything before it on the stream).
void download(void* host, const void* src, size_t bytes, cuda::Stream s);
void fill_bytes(void* dst, int value, size_t bytes, cuda::Stream s);

// dst[r][0..n) = src[r][0..n) for r < rows.   src: [rows, src_stride]   dst: [rows, dst_stride] fp32
void copy_columns(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t n, int64_t rows,
                  cuda::Stream s);

// out[i] = x[idx[i] / divisor] for i < n (divisor k turns a routed entry t * k + slot into its token).
//   x: [*, width]   idx: [n] int32   out: [n, width]
void gather_rows(const float* x, int64_t width, const int32_t* idx, int32_t divisor, int64_t n, float* out,
                 cuda::Stream s);

// The routed experts' outputs added into `out`, each token's in ascending expert order as the CPU's
// moe_forward adds them: out[t] += sum_slot weights[t][slot] * expert_out[pos(t * k + slot)], where
// pos inverts perm (perm[pos] = entry) over its first n_routed entries (perm entries of -1 are
// skipped); entries outside it, and entries whose id is negative (an expert another rank holds),
// add nothing. A null perm is the identity (the outputs in entry order: one launch, inv unused).
// With `first` ([T, width]: the shared experts' outputs computed with the routed ones), out[t] =
// first[t] + ... instead of out[t] + ..., the same sum.
//   expert_out: [n_routed, width] (grouped by expert)   perm: [n_routed]
//   ids, weights: [T, k]   inv: [T * k] int32 scratch   out: [T, width]
void moe_combine(const float* expert_out, const int32_t* perm, int64_t n_routed, const int32_t* ids,
                 const float* weights, int64_t T, int k, int64_t width, int32_t* inv, float* out, cuda::Stream s,
                 const float* first = nullptr);

// Expert ids of the whole model to a rank's own: out[i] = ids[i] - first when that is in
// [0, count), else -1 (an expert another rank computes).   ids, out: [n]
void localize_experts(const int32_t* ids, int64_t n, int32_t first, int32_t count, int32_t* out, cuda::Stream s);

}  // namespace sparsemla::model::gpu
