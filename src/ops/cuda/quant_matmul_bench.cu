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

// Activations of magnitude ~1 (their values do not change the work).
std::vector<float> bench_activations(size_t n) {
  std::vector<float> xh(n);
  for (size_t i = 0; i < xh.size(); ++i) xh[i] = float(int(i * 2654435761u % 2001) - 1000) * 1e-3f;
  return xh;
}

// Milliseconds per replay of a graph of call(0) .. call(calls - 1) on stream s, best of `runs`;
// call(0) runs once before the capture (first-use uploads stay out of the graph).
template <class Call>
double graph_ms(int calls, int runs, cudaStream_t s, Call&& call) {
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
  return ms;
}

// Distinct random experts (seed 1) for each of `calls` calls: [calls][n_pairs].
std::vector<int32_t> random_expert_ids(int64_t n_experts, int n_pairs, int calls) {
  std::vector<int32_t> ids;
  std::mt19937 rng(1);
  std::vector<int32_t> all(static_cast<size_t>(n_experts));
  std::iota(all.begin(), all.end(), 0);
  for (int c = 0; c < calls; ++c) {
    std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + n_pairs);
  }
  return ids;
}

MatmulTiming timing(double ms, int calls, double weight_bytes, double flops) {
  MatmulTiming t;
  const double sec = ms * 1e-3 / calls;
  t.us_per_call = sec * 1e6;
  t.weight_gbs = weight_bytes / sec * 1e-9;
  t.tflops = flops / sec * 1e-12;
  return t;
}

// Quantized activations in their own buffer.
struct BenchQ8 {
  DeviceBuffer buf;
  Q8Activations act;
  BenchQ8(const DeviceBuffer& x, int64_t n_tokens, int64_t n_cols, int levels)
      : buf(q8_activation_bytes(n_tokens, n_cols, levels)) {
    act.data = buf.get();
    act.bytes = buf.bytes();
    quantize_activations(x.as<float>(), n_tokens, n_cols, act, nullptr, levels);
    synchronize();
  }
};

}  // namespace

// The calls are captured once into a CUDA graph and the graph is replayed: the time is the GPU's,
// not the host's launch rate (several microseconds per launch under some hypervisors, more than a
// whole decode product takes).
MatmulTiming bench_matmul(const QuantMatrix* copies, int n_copies, int64_t n_tokens, int calls, int runs,
                          BenchKernel kernel) {
  const QuantMatrix& w = copies[0];
  const DeviceBuffer x = to_device(bench_activations(size_t(n_tokens * w.n_cols)));
  DeviceBuffer y(size_t(n_tokens * w.n_rows) * sizeof(float));
  const bool dequant = kernel == BenchKernel::DequantBf16;
  DeviceBuffer rows_bf16(dequant ? size_t(w.n_rows * w.n_cols) * 2 : 0);
  cudaStream_t s;
  SPARSEMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // call(0) runs outside the capture: it uploads the codebooks.
  const double ms =
      graph_ms(calls, runs, s, [&](int c) {
        const QuantMatrix& m = copies[c % n_copies];
        switch (kernel) {
          case BenchKernel::Auto: matmul(m, x.as<float>(), n_tokens, y.as<float>(), s); break;
          case BenchKernel::Fp32Decode: matmul_decode(m, x.as<float>(), n_tokens, y.as<float>(), s); break;
          case BenchKernel::TensorCoreDecode: matmul_decode_mma(m, x.as<float>(), n_tokens, y.as<float>(), s); break;
          case BenchKernel::OneTokenTensorCore: matmul_decode_mma_one(m, x.as<float>(), y.as<float>(), s); break;
          case BenchKernel::Prefill: matmul_prefill(m, x.as<float>(), n_tokens, y.as<float>(), s); break;
          case BenchKernel::Blas:
            if (!matmul_prefill_blas(m, x.as<float>(), n_tokens, y.as<float>(), s))
              fail("bench_matmul: the cuBLAS prefill product did not run ({} tokens)", n_tokens);
            break;
          case BenchKernel::DequantBf16: dequantize_bf16(m, 0, m.n_rows, rows_bf16.get(), s); break;
        }
      });
  SPARSEMLA_CUDA_CHECK(cudaStreamDestroy(s));
  const double weight_bytes = double(gguf::row_bytes(w.type, uint64_t(w.n_cols))) * double(w.n_rows);
  if (dequant) return timing(ms, calls, weight_bytes + 2.0 * double(w.n_rows) * double(w.n_cols), 0.0);
  return timing(ms, calls, weight_bytes, 2.0 * double(w.n_rows) * double(w.n_cols) * double(n_tokens));
}

MatmulTiming bench_matmul_experts(const QuantMatrix& w, int64_t rows_per_expert, int n_pairs, int calls, int runs,
                                  ExpertKernel kernel) {
  const DeviceBuffer x = to_device(bench_activations(size_t(w.n_cols)));
  const DeviceBuffer dids = to_device(random_expert_ids(w.n_rows / rows_per_expert, n_pairs, calls));
  DeviceBuffer y(size_t(n_pairs * rows_per_expert) * sizeof(float));
  cudaStream_t s;
  SPARSEMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double ms = graph_ms(calls, runs, s, [&](int c) {
    matmul_experts(w, rows_per_expert, dids.as<int32_t>() + c * n_pairs, n_pairs, x.as<float>(), n_pairs,
                   y.as<float>(), s, kernel);
  });
  SPARSEMLA_CUDA_CHECK(cudaStreamDestroy(s));
  const double rows = double(n_pairs) * double(rows_per_expert);
  return timing(ms, calls, double(gguf::row_bytes(w.type, uint64_t(w.n_cols))) * rows, 2.0 * rows * double(w.n_cols));
}

MatmulTiming bench_matmul_q8(const QuantMatrix* copies, int n_copies, int64_t n_tokens, int calls, int runs,
                             int levels, bool one_token) {
  const QuantMatrix& w = copies[0];
  const DeviceBuffer x = to_device(bench_activations(size_t(n_tokens * w.n_cols)));
  const BenchQ8 xq(x, n_tokens, w.n_cols, levels);
  DeviceBuffer y(size_t(n_tokens * w.n_rows) * sizeof(float));
  cudaStream_t s;
  SPARSEMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double ms =
      graph_ms(calls, runs, s, [&](int c) { matmul_decode_q8(copies[c % n_copies], xq.act, y.as<float>(), s, one_token); });
  SPARSEMLA_CUDA_CHECK(cudaStreamDestroy(s));
  return timing(ms, calls, double(gguf::row_bytes(w.type, uint64_t(w.n_cols))) * double(w.n_rows),
                2.0 * double(w.n_rows) * double(w.n_cols) * double(n_tokens));
}

MatmulTiming bench_matmul_experts_q8(const QuantMatrix& w, int64_t rows_per_expert, int n_pairs, int calls, int runs,
                                     int levels, bool one_token) {
  const DeviceBuffer x = to_device(bench_activations(size_t(w.n_cols)));
  const BenchQ8 xq(x, 1, w.n_cols, levels);
  const DeviceBuffer dids = to_device(random_expert_ids(w.n_rows / rows_per_expert, n_pairs, calls));
  DeviceBuffer y(size_t(n_pairs * rows_per_expert) * sizeof(float));
  cudaStream_t s;
  SPARSEMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double ms = graph_ms(calls, runs, s, [&](int c) {
    matmul_experts_q8(w, rows_per_expert, dids.as<int32_t>() + c * n_pairs, n_pairs, xq.act, n_pairs, y.as<float>(), s,
                      nullptr, one_token);
  });
  SPARSEMLA_CUDA_CHECK(cudaStreamDestroy(s));
  const double rows = double(n_pairs) * double(rows_per_expert);
  return timing(ms, calls, double(gguf::row_bytes(w.type, uint64_t(w.n_cols))) * rows, 2.0 * rows * double(w.n_cols));
}

MatmulTiming bench_per_head(Blas& blas, const HeadBatchedGemm* copies, int n_copies, int64_t n_tokens, int calls,
                            int runs) {
  const HeadBatchedGemm& g = copies[0];
  const int64_t n = n_tokens * g.heads;  // (token, head) rows of cols inputs and rows outputs
  const DeviceBuffer x = to_device(bench_activations(size_t(n * g.cols)));
  DeviceBuffer y(size_t(n * g.rows) * sizeof(float));
  cudaStream_t s;
  SPARSEMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double ms = graph_ms(calls, runs, s, [&](int c) {
    blas.per_head(copies[c % n_copies], x.as<float>(), g.cols, n_tokens, y.as<float>(), g.rows, s);
  });
  SPARSEMLA_CUDA_CHECK(cudaStreamDestroy(s));
  const double values = double(g.heads) * g.rows * g.cols;
  const double bytes = g.f32                              ? 4 * values
                       : g.form == HeadWeights::Quant ? double(gguf::row_bytes(g.type, uint64_t(g.cols))) * g.heads * g.rows
                                                        : 2 * values;
  return timing(ms, calls, bytes, 2.0 * values * double(n_tokens));
}

double bench_quantize_us(int64_t n_tokens, int64_t n_cols, int calls, int runs, int levels) {
  const DeviceBuffer x = to_device(bench_activations(size_t(n_tokens * n_cols)));
  BenchQ8 xq(x, n_tokens, n_cols, levels);
  cudaStream_t s;
  SPARSEMLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double ms =
      graph_ms(calls, runs, s, [&](int) { quantize_activations(x.as<float>(), n_tokens, n_cols, xq.act, s, levels); });
  SPARSEMLA_CUDA_CHECK(cudaStreamDestroy(s));
  return ms * 1e3 / calls;
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
