// The split RMS norms (norm_split.cu): a row's norm over a cluster of blocks, optionally
// quantizing its output to int8 activations in the same launch. small_ops.cu takes them where
// split_norm_fits says so; plain C++.
#pragma once
#include <cstdint>

#include "ops/cuda/buffer.h"
#include "ops/cuda/quant_matmul_q8.h"

namespace sparsemla::cuda {

// Whether T rows of n values take the split norm: SM90 and later, n >= 1024 split into 8, 4 or 2
// slices of whole warps' values (at most 1024 threads of at most 8 values each), T <= 128 (decode
// batches; SPARSEMLA_SPLIT_NORM_MAX_ROWS), and split norms on (set_split_norms).
bool split_norm_fits(int64_t T, int64_t n);

// out = rms_norm(h ? (h += x) : x, w) for T rows (x rows x_stride apart, h rows n apart, out rows
// out_stride apart); with q, out also quantized into *q on `levels` levels as
// quantize_activations(out, T, n, *q, s, levels) would (the same bits). `op` names the caller in
// errors. Only where split_norm_fits(T, n).
void split_norm(const float* x, int64_t x_stride, float* h, const float* w, int64_t T, int64_t n, float eps,
                float* out, int64_t out_stride, Q8Activations* q, int levels, const char* op, Stream s);

// Split norms on (the default) or off (the one-block kernels everywhere), for tests and benchmarks
// (process-wide, not thread-safe).
void set_split_norms(bool on);

}  // namespace sparsemla::cuda
