#include "ops/cuda/quant_matmul_bench.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include "gguf/ggml_types.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/check.cuh"

namespace sparsemla::cuda {

namespace {

// Best time in ms of `runs` runs of fn() between two events on stream s (cuda::time_ms).
template <class Fn>
double best_ms(int runs, cudaStream_t s, Fn&& fn) {
  return time_ms(runs, [](void* f) { (*static_cast<std::remove_reference_t<Fn>*>(f))(); }, &fn, s);
}

}  // namespace

// The calls are captured once into a CUDA graph and the graph is replayed: the time is the GPU's,
// not the host's launch rate (several microseconds per launch under some hypervisors, more than a
// whole decode product takes).
MatmulTiming bench_matmul(const QuantMatrix* copies, int n_copies, int64_t n_tokens, int calls, int runs) {
  const QuantMatrix& w = copies[0];
  // Activations of magnitude ~1 (their values do not change the work).
  std::vector<float> xh(size_t(n_tokens * w.n_cols));
  for (size_t i = 0; i < xh.size(); ++i) xh[i] = float(int(i * 2654435761u % 2001) - 1000) * 1e-3f;
  const DeviceBuffer x = to_device(xh);
  DeviceBuffer y(size_t(n_tokens * w.n_rows) * sizeof(float));
  cudaStream_t s;
  SPARSEMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  matmul(w, x.as<float>(), n_tokens, y.as<float>(), s);  // outside the capture: uploads the codebooks
  SPARSEMLA_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  SPARSEMLA_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int c = 0; c < calls; ++c) matmul(copies[c % n_copies], x.as<float>(), n_tokens, y.as<float>(), s);
  SPARSEMLA_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  SPARSEMLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = best_ms(runs, s, [&] { SPARSEMLA_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
  SPARSEMLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  SPARSEMLA_CUDA_CHECK(cudaGraphDestroy(graph));
  SPARSEMLA_CUDA_CHECK(cudaStreamDestroy(s));
  MatmulTiming t;
  const double sec = ms * 1e-3 / calls;
  t.us_per_call = sec * 1e6;
  t.weight_gbs = double(gguf::row_bytes(w.type, uint64_t(w.n_cols))) * double(w.n_rows) / sec * 1e-9;
  t.tflops = 2.0 * double(w.n_rows) * double(w.n_cols) * double(n_tokens) / sec * 1e-12;
  return t;
}

MatmulTiming bench_matmul_experts(const QuantMatrix& w, int64_t rows_per_expert, int n_pairs, int calls, int runs) {
  const int64_t n_experts = w.n_rows / rows_per_expert;
  std::vector<float> xh(size_t(w.n_cols));
  for (size_t i = 0; i < xh.size(); ++i) xh[i] = float(int(i * 2654435761u % 2001) - 1000) * 1e-3f;
  std::vector<int32_t> ids;  // [calls][n_pairs]
  std::mt19937 rng(1);
  std::vector<int32_t> all(static_cast<size_t>(n_experts));
  std::iota(all.begin(), all.end(), 0);
  for (int c = 0; c < calls; ++c) {
    std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + n_pairs);
  }
  const DeviceBuffer x = to_device(xh), dids = to_device(ids);
  DeviceBuffer y(size_t(n_pairs * rows_per_expert) * sizeof(float));
  cudaStream_t s;
  SPARSEMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto call = [&](int c) {
    matmul_experts(w, rows_per_expert, dids.as<int32_t>() + c * n_pairs, n_pairs, x.as<float>(), n_pairs,
                   y.as<float>(), s);
  };
  call(0);
  SPARSEMLA_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  SPARSEMLA_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int c = 0; c < calls; ++c) call(c);
  SPARSEMLA_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  SPARSEMLA_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double ms = best_ms(runs, s, [&] { SPARSEMLA_CUDA_CHECK(cudaGraphLaunch(exec, s)); });
  SPARSEMLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  SPARSEMLA_CUDA_CHECK(cudaGraphDestroy(graph));
  SPARSEMLA_CUDA_CHECK(cudaStreamDestroy(s));
  MatmulTiming t;
  const double sec = ms * 1e-3 / calls;
  const double rows = double(n_pairs) * double(rows_per_expert);
  t.us_per_call = sec * 1e6;
  t.weight_gbs = double(gguf::row_bytes(w.type, uint64_t(w.n_cols))) * rows / sec * 1e-9;
  t.tflops = 2.0 * rows * double(w.n_cols) / sec * 1e-12;
  return t;
}

double bench_copy_gbs(size_t bytes, int runs) {
  DeviceBuffer src(bytes), dst(bytes);
  src.zero();
  const double ms = best_ms(runs, nullptr, [&] {
    SPARSEMLA_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, nullptr));
  });
  return 2.0 * double(bytes) / (ms * 1e-3) * 1e-9;
}

}  // namespace sparsemla::cuda
