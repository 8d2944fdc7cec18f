// The device's measured ceilings that benchmarks compare with, and device-side random fills for
// benchmark inputs. Plain C++ header; built only with CUDA.
#pragma once
#include <cstdint>

namespace sparsemla::cuda {

// Device-to-device copy of `bytes` (best of a few): bytes read + bytes written per second.
double measure_copy_bytes_per_s(uint64_t bytes = uint64_t(2) << 30);
// A square bf16 GEMM through cuBLAS (fp32 accumulate): floating-point operations per second.
double measure_bf16_gemm_flops(int n = 8192);

// Time per call of fn(ctx, stream) as a CUDA graph replays it (no launch overhead, as in a captured
// decode step): one warm-up call, then `calls` calls captured into one graph, best of `reps` replays.
double graph_time_us(int reps, int calls, void (*fn)(void* ctx, void* stream), void* ctx);

// Fills x[0..n) with uniform values in [-scale, scale) from a counter hash (deterministic per seed).
void fill_uniform(float* x, int64_t n, uint64_t seed, float scale = 1.0f);

}  // namespace sparsemla::cuda
