#include "model/cuda/gpu_ops.h"

#include <fmt/format.h>

#include <algorithm>

#include "ops/cuda/check.cuh"
#include "ops/cuda/pdl.cuh"

namespace sparsemla::model::gpu {
namespace {

cudaStream_t st(cuda::Stream s) { return static_cast<cudaStream_t>(s); }

unsigned blocks_for(int64_t n, int threads) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 65535)));
}

// Rows of x to out: blockIdx.x the output row, blockIdx.y a chunk of kColumnChunk columns (one
// row of 6144 values is 6 blocks: a single block per row walked it with one load in flight per
// thread, ~11 us for one token's row on an H200).
constexpr int kColumnThreads = 256, kColumnChunk = 1024;

__global__ void gather_rows_kernel(const float* __restrict__ x, int64_t width, const int32_t* __restrict__ idx,
                                   int32_t divisor, float* __restrict__ out) {
  cuda::pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const float* src = x + int64_t(idx[blockIdx.x] / divisor) * width;
  float* dst = out + int64_t(blockIdx.x) * width;
  const int64_t end = min(width, int64_t(blockIdx.y + 1) * kColumnChunk);
#pragma unroll 4
  for (int64_t c = int64_t(blockIdx.y) * kColumnChunk + threadIdx.x; c < end; c += kColumnThreads) dst[c] = src[c];
}

unsigned column_chunks(int64_t width) { return unsigned(std::max<int64_t>(1, (width + kColumnChunk - 1) / kColumnChunk)); }

__global__ void inverse_perm_kernel(const int32_t* __restrict__ perm, int64_t n, int32_t* __restrict__ inv) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    if (perm[i] >= 0) inv[perm[i]] = int32_t(i);  // -1: an entry left out of the grouping
}

constexpr int kMaxSlots = 64;  // moe_route takes at most 64 experts per token

// blockIdx.x the token, blockIdx.y a chunk of kColumnThreads columns. The token's slots, ordered by
// expert id, with their rows and weights, go to shared memory first; then each thread adds the
// slots to its column in that order (every chunk the same order: the sum's bits do not depend on
// the chunking). The slots' ids, positions and weights are read in one round (a slot per thread)
// and the column's starting value before that; each slot's thread then counts its own place in the
// order (its rank: the slots of lower id, or of equal id and lower slot), all at once, where one
// thread used to insertion-sort them; and the column's values are loaded 8 slots at a time before
// they are added (the adds are a chain; loads between them went out one by one). The same sums in
// the same order as the sort and the interleaved loads gave; H100, GLM-5-width Q4_K_M, one token
// (SPARSEMLA_STEP_PROFILE, 2 MoE layers): the routed experts' section 203.5 -> 199.9 us per step,
// the 3-layer step 0.905 -> 0.9025 ms (medians of 6 interleaved rounds; docs/PERFORMANCE.md,
// "Session 36").
__global__ void moe_combine_kernel(const float* __restrict__ expert_out, const int32_t* __restrict__ ids,
                                   const float* __restrict__ weights, const int32_t* __restrict__ inv, int k,
                                   int64_t n_routed, int64_t width, const float* __restrict__ first,
                                   float* __restrict__ out) {
  cuda::pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  __shared__ int32_t id[kMaxSlots], pos[kMaxSlots], row[kMaxSlots];
  __shared__ float slot_weight[kMaxSlots], weight[kMaxSlots];
  const int64_t t = blockIdx.x;
  const int64_t c = int64_t(blockIdx.y) * kColumnThreads + threadIdx.x;
  float* dst = out + t * width;
  float acc = 0.0f;
  if (c < width) acc = first ? first[t * width + c] : dst[c];
  if (threadIdx.x < k) {
    const int64_t j = t * k + threadIdx.x;
    const int32_t e = ids[j];
    const int64_t p = inv ? inv[j] : j < n_routed ? j : -1;  // (null inv: the identity)
    id[threadIdx.x] = e;
    pos[threadIdx.x] = p >= 0 && e >= 0 ? int32_t(p) : -1;  // -1: not routed here
    slot_weight[threadIdx.x] = weights[j];
  }
  __syncthreads();
  if (int(threadIdx.x) < k) {
    const int s = int(threadIdx.x);
    const int32_t mine = id[s];
    int rank = 0;
    for (int j = 0; j < k; ++j) rank += id[j] < mine || (id[j] == mine && j < s);
    row[rank] = pos[s];
    weight[rank] = slot_weight[s];
  }
  __syncthreads();
  if (c >= width) return;
  constexpr int kBatch = 8;
  for (int s0 = 0; s0 < k; s0 += kBatch) {
    float v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      v[j] = s0 + j < k && row[s0 + j] >= 0 ? expert_out[int64_t(row[s0 + j]) * width + c] : 0.0f;
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      if (s0 + j < k && row[s0 + j] >= 0) acc = __fmaf_rn(weight[s0 + j], v[j], acc);
  }
  dst[c] = acc;
}

__global__ void localize_experts_kernel(const int32_t* __restrict__ ids, int64_t n, int32_t first, int32_t count,
                                        int32_t* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t e = ids[i] - first;
  out[i] = e >= 0 && e < count ? e : -1;
}

}  // namespace

void localize_experts(const int32_t* ids, int64_t n, int32_t first, int32_t count, int32_t* out, cuda::Stream s) {
  if (n <= 0) return;
  localize_experts_kernel<<<blocks_for(n, 256), 256, 0, st(s)>>>(ids, n, first, count, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

void set_device(int device) {
  const cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    fail("CUDA device {}: {}", device, cudaGetErrorString(err));
  }
}

void keep_stream_ordered_memory(uint64_t bytes) {
  int device = 0;
  SPARSEMLA_CUDA_CHECK(cudaGetDevice(&device));
  cudaMemPool_t pool = nullptr;
  SPARSEMLA_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  uint64_t threshold = bytes;  // (cuuint64_t)
  SPARSEMLA_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
}

void memory_info(uint64_t* free_bytes, uint64_t* total_bytes) {
  size_t f = 0, t = 0;
  SPARSEMLA_CUDA_CHECK(cudaMemGetInfo(&f, &t));
  *free_bytes = f;
  *total_bytes = t;
}

OwnedStream::OwnedStream() {
  cudaStream_t s = nullptr;
  SPARSEMLA_CUDA_CHECK(cudaStreamCreate(&s));
  s_ = s;
}

OwnedStream::~OwnedStream() {
  if (s_) cudaStreamDestroy(st(s_));
}

void OwnedStream::synchronize() const { SPARSEMLA_CUDA_CHECK(cudaStreamSynchronize(st(s_))); }

SideStream::SideStream() {
  cudaEvent_t a = nullptr, b = nullptr;
  SPARSEMLA_CUDA_CHECK(cudaEventCreateWithFlags(&a, cudaEventDisableTiming));
  SPARSEMLA_CUDA_CHECK(cudaEventCreateWithFlags(&b, cudaEventDisableTiming));
  forked_ = a;
  joined_ = b;
}

SideStream::~SideStream() {
  if (forked_) cudaEventDestroy(static_cast<cudaEvent_t>(forked_));
  if (joined_) cudaEventDestroy(static_cast<cudaEvent_t>(joined_));
}

void SideStream::fork(cuda::Stream main) {
  SPARSEMLA_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(forked_), st(main)));
  SPARSEMLA_CUDA_CHECK(cudaStreamWaitEvent(st(stream_.get()), static_cast<cudaEvent_t>(forked_), 0));
}

void SideStream::join(cuda::Stream main) {
  SPARSEMLA_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(joined_), st(stream_.get())));
  SPARSEMLA_CUDA_CHECK(cudaStreamWaitEvent(st(main), static_cast<cudaEvent_t>(joined_), 0));
}

void upload_async(void* dst, const void* host, size_t bytes, cuda::Stream s) {
  if (bytes) SPARSEMLA_CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, st(s)));
}

Graph::~Graph() {
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
}

Graph& Graph::operator=(Graph&& o) noexcept {
  if (this != &o) {
    if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
    exec_ = o.exec_;
    o.exec_ = nullptr;
  }
  return *this;
}

void Graph::begin_capture(cuda::Stream s) {
  SPARSEMLA_CUDA_CHECK(cudaStreamBeginCapture(st(s), cudaStreamCaptureModeRelaxed));
}

Graph Graph::end_capture(cuda::Stream s) {
  cudaGraph_t graph = nullptr;
  const cudaError_t err = cudaStreamEndCapture(st(s), &graph);
  if (err != cudaSuccess || !graph) {
    cudaGetLastError();
    if (graph) cudaGraphDestroy(graph);
    fail("CUDA graph capture failed: {}", cudaGetErrorString(err));
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t ierr = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (ierr != cudaSuccess) {
    cudaGetLastError();
    fail("CUDA graph instantiation failed: {}", cudaGetErrorString(ierr));
  }
  Graph g;
  g.exec_ = exec;
  return g;
}

void Graph::abandon_capture(cuda::Stream s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st(s), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(st(s), &graph);
    if (graph) cudaGraphDestroy(graph);
  }
  cudaGetLastError();
}

void Graph::launch(cuda::Stream s) const {
  SPARSEMLA_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), st(s)));
}

StepTimer::~StepTimer() {
  for (auto& m : marks_) pool_.push_back(m.second);
  for (void* e : pool_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

namespace {
// Keeps the stream busy for `ns` nanoseconds (one thread reading the global timer).
__global__ void hold_kernel(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
}  // namespace

void StepTimer::mark(const char* label) {
  // A step's first mark holds the stream while the host enqueues the rest of the step, so that
  // the intervals measure the device's work back to back and not the host's launch gaps (which a
  // CUDA graph removes in a real run).
  if (marks_.empty() && hold_us_ > 0) {
    hold_kernel<<<1, 1, 0, st(s_)>>>(uint64_t(hold_us_) * 1000);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
  }
  void* e = nullptr;
  if (!pool_.empty()) {
    e = pool_.back();
    pool_.pop_back();
  } else {
    cudaEvent_t ev = nullptr;
    SPARSEMLA_CUDA_CHECK(cudaEventCreate(&ev));
    e = ev;
  }
  SPARSEMLA_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e), st(s_)));
  marks_.emplace_back(label, e);
}

void StepTimer::collect() {
  if (marks_.empty()) return;
  SPARSEMLA_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(marks_.back().second)));
  for (size_t i = 1; i < marks_.size(); ++i) {
    float ms = 0;
    SPARSEMLA_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(marks_[i - 1].second),
                                              static_cast<cudaEvent_t>(marks_[i].second)));
    auto it = std::find_if(totals_.begin(), totals_.end(), [&](const auto& t) { return t.first == marks_[i].first; });
    if (it == totals_.end()) it = totals_.insert(totals_.end(), {marks_[i].first, Total{}});
    it->second.ms += ms;
    ++it->second.calls;
  }
  for (auto& m : marks_) pool_.push_back(m.second);
  marks_.clear();
  ++steps_;
}

std::string StepTimer::report() const {
  auto sorted = totals_;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double all = 0;
  for (const auto& t : sorted) all += t.second.ms;
  std::string out = fmt::format("device time by operation over {} decode steps ({:.3f} ms per step):\n", steps_,
                                steps_ ? all / double(steps_) : 0.0);
  for (const auto& t : sorted)
    out += fmt::format("  {:<48} {:9.3f} ms {:5.1f}%  {:7} calls  {:8.4f} ms per step\n", t.first, t.second.ms,
                       all > 0 ? 100.0 * t.second.ms / all : 0.0, t.second.calls,
                       steps_ ? t.second.ms / double(steps_) : 0.0);
  return out;
}

void synchronize(cuda::Stream s) { SPARSEMLA_CUDA_CHECK(cudaStreamSynchronize(st(s))); }

void download(void* host, const void* src, size_t bytes, cuda::Stream s) {
  if (bytes) SPARSEMLA_CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, st(s)));
  SPARSEMLA_CUDA_CHECK(cudaStreamSynchronize(st(s)));
}

void fill_bytes(void* dst, int value, size_t bytes, cuda::Stream s) {
  if (bytes) SPARSEMLA_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, st(s)));
}

void copy_columns(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t n, int64_t rows,
                  cuda::Stream s) {
  if (rows == 0 || n == 0) return;
  SPARSEMLA_CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(dst_stride) * 4, src, size_t(src_stride) * 4, size_t(n) * 4,
                                         size_t(rows), cudaMemcpyDeviceToDevice, st(s)));
}

void gather_rows(const float* x, int64_t width, const int32_t* idx, int32_t divisor, int64_t n, float* out,
                 cuda::Stream s) {
  if (n == 0) return;
  if (n > INT32_MAX || divisor <= 0) fail("gather_rows: {} rows, divisor {}", n, divisor);
  gather_rows_kernel<<<dim3(unsigned(n), column_chunks(width)), kColumnThreads, 0, st(s)>>>(x, width, idx, divisor, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

void moe_combine(const float* expert_out, const int32_t* perm, int64_t n_routed, const int32_t* ids,
                 const float* weights, int64_t T, int k, int64_t width, int32_t* inv, float* out, cuda::Stream s,
                 const float* first) {
  if (T == 0) return;
  if (k <= 0 || k > kMaxSlots || T > INT32_MAX) fail("moe_combine: {} tokens with {} experts each", T, k);
  if (!perm) inv = nullptr;  // the identity: nothing to invert
  else fill_bytes(inv, 0xff, size_t(T) * size_t(k) * sizeof(int32_t), s);  // -1: not routed
  if (perm && n_routed > 0) {
    inverse_perm_kernel<<<blocks_for(n_routed, 256), 256, 0, st(s)>>>(perm, n_routed, inv);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
  }
  if (width <= 0) return;
  const unsigned chunks = unsigned((width + kColumnThreads - 1) / kColumnThreads);
  if (chunks > 65535) fail("moe_combine: rows of {} values", width);
  moe_combine_kernel<<<dim3(unsigned(T), chunks), kColumnThreads, 0, st(s)>>>(expert_out, ids, weights, inv, k,
                                                                           n_routed, width, first, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::model::gpu
