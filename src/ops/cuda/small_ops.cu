#include "ops/cuda/small_ops.h"

#include <algorithm>

#include "ops/cuda/check.cuh"
#include "ops/cuda/norm_split.h"
#include "ops/cuda/small_ops_kernels.cuh"

namespace sparsemla::cuda {

namespace {

using namespace smallops;

cudaStream_t stream_of(Stream s) { return static_cast<cudaStream_t>(s); }

void check_rows(const char* op, int64_t T, int64_t n) {
  if (T < 0 || n < 0 || T > INT32_MAX) fail("cuda::{}: bad shape [{}, {}]", op, T, n);
}

}  // namespace

void rms_norm(const float* x, int64_t x_stride, const float* w, int64_t T, int64_t n, float eps, float* out,
              int64_t out_stride, Stream s, Q8Activations* q, int levels) {
  check_rows("rms_norm", T, n);
  if (x_stride < n || out_stride < n)
    fail("cuda::rms_norm: strides {} / {} shorter than the row ({})", x_stride, out_stride, n);
  if (q && out_stride != n)
    fail("cuda::rms_norm: int8 output wants contiguous rows (out_stride {} for rows of {})", out_stride, n);
  if (T == 0 || n == 0) return;
  if (split_norm_fits(T, n)) {
    split_norm(x, x_stride, nullptr, w, T, n, eps, out, out_stride, q, levels, "rms_norm", s);
    return;
  }
  rms_norm_kernel<<<int(T), row_threads(n), 0, stream_of(s)>>>(x, x_stride, w, n, eps, out, out_stride);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
  if (q) quantize_activations(out, T, n, *q, s, levels);
}

void add_rms_norm(float* h, const float* delta, const float* w, int64_t T, int64_t n, float eps, float* out,
                  Stream s, Q8Activations* q, int levels) {
  check_rows("add_rms_norm", T, n);
  if (T == 0 || n == 0) return;
  if (split_norm_fits(T, n)) {
    split_norm(delta, n, h, w, T, n, eps, out, n, q, levels, "add_rms_norm", s);
    return;
  }
  add_rms_norm_kernel<<<int(T), row_threads(n), 0, stream_of(s)>>>(h, delta, w, n, eps, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
  if (q) quantize_activations(out, T, n, *q, s, levels);
}

void layer_norm(const float* x, const float* w, const float* b, int64_t T, int64_t n, float eps, float* out,
                Stream s) {
  check_rows("layer_norm", T, n);
  if (T == 0 || n == 0) return;
  layer_norm_kernel<<<int(T), row_threads(n), 0, stream_of(s)>>>(x, w, b, n, eps, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

DeviceRope::DeviceRope(const ops::Rope& rope)
    : inv_freq_(to_device(rope.inv_freq())), dims_(rope.dims()), attn_factor_(rope.attn_factor()) {}

RopeTable DeviceRope::table(ops::RopeStyle style) const {
  return {inv_freq_.as<float>(), dims_ / 2, attn_factor_, style == ops::RopeStyle::Interleaved};
}

namespace {
template <class Pos>
void launch_rope(const float* x, int64_t x_stride, float* out, int64_t out_stride, int64_t width, int64_t T,
                 int64_t heads, const Pos* pos, const RopeTable& r, Stream s) {
  check_rows("rope", T, heads);
  if (x_stride < width || out_stride < width)
    fail("cuda::rope: head strides {} / {} shorter than the {} values rotated or copied", x_stride, out_stride, width);
  if (width < 2 * r.half) fail("cuda::rope: {} values per head, fewer than the {} rotary dims", width, 2 * r.half);
  if (T == 0 || heads == 0 || width == 0) return;
  rope_kernel<<<rope_grid(T, heads), rope_block(), 0, stream_of(s)>>>(x, x_stride, out, out_stride, width, heads, pos,
                                                                      r);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}
}  // namespace

void DeviceRope::apply(float* x, int64_t T, int64_t heads, int64_t stride, const int64_t* pos, ops::RopeStyle style,
                       Stream s) const {
  launch_rope(x, stride, x, stride, dims_, T, heads, pos, table(style), s);
}

void DeviceRope::apply(float* x, int64_t T, int64_t heads, int64_t stride, const int32_t* pos, ops::RopeStyle style,
                       Stream s) const {
  launch_rope(x, stride, x, stride, dims_, T, heads, pos, table(style), s);
}

void DeviceRope::apply_to(const float* x, int64_t x_stride, float* out, int64_t out_stride, int64_t width, int64_t T,
                          int64_t heads, const int64_t* pos, ops::RopeStyle style, Stream s) const {
  launch_rope(x, x_stride, out, out_stride, width, T, heads, pos, table(style), s);
}

void silu_mul(float* gate, const float* up, int64_t n, Stream s, Q8Activations* q, int64_t n_cols, int levels) {
  if (q && (n_cols <= 0 || n % n_cols != 0))
    fail("cuda::silu_mul: int8 output of {} values as rows of {}: not whole rows", n, n_cols);
  if (n <= 0) return;
  const int64_t blocks = (n + kElementwiseThreads - 1) / kElementwiseThreads;
  if (q && blocks <= kMaxElementwiseBlocks) {  // (q8_output checks that rows are whole blocks of 32)
    const Q8Out o = q8_output("silu_mul", n / n_cols, n_cols, *q, levels);
    if (levels == 2) silu_mul_q8_kernel<2><<<unsigned(blocks), kElementwiseThreads, 0, stream_of(s)>>>(gate, up, n, o);
    else silu_mul_q8_kernel<1><<<unsigned(blocks), kElementwiseThreads, 0, stream_of(s)>>>(gate, up, n, o);
    SPARSEMLA_CUDA_LAUNCH_CHECK();
    return;
  }
  silu_mul_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream_of(s)>>>(gate, up, n);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
  if (q) quantize_activations(gate, n / n_cols, n_cols, *q, s, levels);
}

void silu_mul_fused(const float* gate_up, int64_t T, int64_t F, float* out, Stream s) {
  check_rows("silu_mul_fused", T, F);
  if (T * F == 0) return;
  silu_mul_fused_kernel<<<elementwise_blocks(T * F), kElementwiseThreads, 0, stream_of(s)>>>(gate_up, T, F, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

void add(float* h, const float* delta, int64_t n, Stream s) {
  if (n <= 0) return;
  add_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream_of(s)>>>(h, delta, n);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

void scale(float* x, float factor, int64_t n, Stream s) {
  if (n <= 0) return;
  scale_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream_of(s)>>>(x, factor, n);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

void softmax_rows(float* x, int64_t T, int64_t n, Stream s) {
  check_rows("softmax_rows", T, n);
  if (T == 0 || n == 0) return;
  softmax_rows_kernel<<<int(T), row_threads(n), 0, stream_of(s)>>>(x, n);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

void f32_to_bf16(const float* x, uint16_t* out, int64_t n, Stream s) {
  if (n <= 0) return;
  f32_to_bf16_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream_of(s)>>>(x, out, n);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

void bf16_to_f32(const uint16_t* x, float* out, int64_t n, Stream s) {
  if (n <= 0) return;
  bf16_to_f32_kernel<<<elementwise_blocks(n), kElementwiseThreads, 0, stream_of(s)>>>(x, out, n);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

}  // namespace sparsemla::cuda
