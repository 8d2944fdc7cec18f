#include "ops/cuda/small_ops.h"

#include <algorithm>

#include "ops/cuda/check.cuh"
#include "ops/cuda/norm_split.h"
#include "ops/cuda/rope.cuh"
#include "ops/cuda/row_norm.cuh"
#include "ops/cuda/small_ops_reduce.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/q8_quantize.cuh"

namespace sparsemla::cuda {

namespace {

constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxElementwiseBlocks = 65535;

cudaStream_t stream_of(Stream s) { return static_cast<cudaStream_t>(s); }

int elementwise_blocks(int64_t n) {
  return int(std::min<int64_t>(kMaxElementwiseBlocks, (n + kElementwiseThreads - 1) / kElementwiseThreads));
}

// ---- norms: one block per row (row_norm.cuh) ----

// x may be out (an in-place norm), hence no __restrict__ on either.
__global__ void rms_norm_kernel(const float* x, int64_t x_stride, const float* __restrict__ w,
                                int64_t n, float eps, float* out, int64_t out_stride) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const float* xr = x + int64_t(blockIdx.x) * x_stride;
  float* orow = out + int64_t(blockIdx.x) * out_stride;
  if (row_fits(n)) {
    float v[kRowCache], wv[kRowCache];
    load_row(xr, n, v);
    load_row(w, n, wv);  // with the row's loads: no round trip for them after the sum
    const float scale = rms_inv(v, n, eps);  // synchronizes: every read of x is done before out (maybe x) is written
    for_row(n, [&](int j, int64_t i) { orow[i] = v[j] * scale * wv[j]; });
    return;
  }
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss);
  const float scale = 1.0f / sqrtf(ss / float(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = xr[i] * scale * w[i];
}

__global__ void add_rms_norm_kernel(float* __restrict__ h, const float* __restrict__ delta,
                                    const float* __restrict__ w, int64_t n, float eps, float* __restrict__ out) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  float* hr = h + int64_t(blockIdx.x) * n;
  const float* dr = delta + int64_t(blockIdx.x) * n;
  float* orow = out + int64_t(blockIdx.x) * n;
  if (row_fits(n)) {
    float v[kRowCache], wv[kRowCache];
#pragma unroll
    for (int j = 0; j < kRowCache; ++j) v[j] = 0.0f;
    for_row(n, [&](int j, int64_t i) { v[j] = hr[i] + dr[i]; });
    load_row(w, n, wv);  // with the row's loads: no round trip for them after the sum
    for_row(n, [&](int j, int64_t i) { hr[i] = v[j]; });
    const float scale = rms_inv(v, n, eps);
    for_row(n, [&](int j, int64_t i) { orow[i] = v[j] * scale * wv[j]; });
    return;
  }
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = hr[i] + dr[i];
    hr[i] = v;
    ss += v * v;
  }
  ss = block_sum(ss);
  const float scale = 1.0f / sqrtf(ss / float(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = hr[i] * scale * w[i];
}

__global__ void layer_norm_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                  const float* __restrict__ b, int64_t n, float eps, float* __restrict__ out) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const float* xr = x + int64_t(blockIdx.x) * n;
  float* orow = out + int64_t(blockIdx.x) * n;
  if (row_fits(n)) {
    float v[kRowCache], wv[kRowCache], bv[kRowCache];
    load_row(xr, n, v);
    load_row(w, n, wv);  // with the row's loads: no round trip for them after the sums
    load_row(b, n, bv);  // (zeros without a bias)
    float mean, inv;
    layer_norm_stats(v, n, eps, &mean, &inv);
    for_row(n, [&](int j, int64_t i) { orow[i] = (v[j] - mean) * inv * wv[j] + bv[j]; });
    return;
  }
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += xr[i];
  const float mean = block_sum(sum) / float(n);
  float var = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) var += (xr[i] - mean) * (xr[i] - mean);
  var = block_sum(var) / float(n);
  const float inv = 1.0f / sqrtf(var + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) orow[i] = (xr[i] - mean) * inv * w[i] + (b ? b[i] : 0.0f);
}

// ---- RoPE: blockIdx.x the token; threadIdx.x walks the pairs, blockIdx.y/threadIdx.y the heads ----

constexpr int kRopePairThreads = 32, kRopeHeadThreads = 8;

// In place (x == out, width = 2 half) or into another array: out's first 2 half values of each head
// are x's rotated, its values [2 half, width) x's copied.
template <class Pos>
__global__ void rope_kernel(const float* x, int64_t x_stride, float* out, int64_t out_stride, int64_t width,
                            int64_t heads, const Pos* __restrict__ pos, RopeTable r) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const int64_t t = blockIdx.x;
  const float p = float(pos[t]);
  const int64_t h0 = int64_t(blockIdx.y) * blockDim.y + threadIdx.y, h_step = int64_t(gridDim.y) * blockDim.y;
  for (int64_t i = threadIdx.x; i < r.half; i += blockDim.x) {
    const RopeAngle ang = rope_angle(r, p, i);
    const int64_t a = rope_a(r, i), b = rope_b(r, i);
    for (int64_t h = h0; h < heads; h += h_step) {
      const float* row = x + (t * heads + h) * x_stride;
      float* orow = out + (t * heads + h) * out_stride;
      float x0 = row[a], x1 = row[b];
      rope_rotate(ang, &x0, &x1);
      orow[a] = x0;
      orow[b] = x1;
    }
  }
  for (int64_t c = 2 * r.half + threadIdx.x; c < width; c += blockDim.x)
    for (int64_t h = h0; h < heads; h += h_step) out[(t * heads + h) * out_stride + c] = x[(t * heads + h) * x_stride + c];
}

// ---- elementwise ----

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

__global__ void silu_mul_kernel(float* gate, const float* __restrict__ up, int64_t n) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    gate[i] = silu_times(gate[i], up[i]);
}

// One thread per value, whole warps per 32 values: each warp quantizes the activation block it wrote.
template <int L>
__global__ void silu_mul_q8_kernel(float* gate, const float* __restrict__ up, int64_t n, Q8Out q) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i - threadIdx.x % 32 >= n) return;  // whole warps (n is whole blocks of 32)
  const float v = silu_times(gate[i], up[i]);
  gate[i] = v;
  quantize_q8_warp<L>(v, i / 32, int(threadIdx.x % 32), q.q, q.r, q.blocks);
}

__global__ void silu_mul_fused_kernel(const float* __restrict__ gate_up, int64_t T, int64_t F,
                                      float* __restrict__ out) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < T * F; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / F, f = i - t * F;
    out[i] = silu_times(gate_up[t * 2 * F + f], gate_up[t * 2 * F + F + f]);
  }
}

__global__ void add_kernel(float* h, const float* __restrict__ delta, int64_t n) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    h[i] += delta[i];
}

__global__ void scale_kernel(float* x, float factor, int64_t n) {
  pdl::launch_dependents();  // the next decode product may prefetch its weights (pdl.cuh)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= factor;
}

__global__ void softmax_rows_kernel(float* x, int64_t n) {
  float* row = x + int64_t(blockIdx.x) * n;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, row[i]);
  m = block_max(m, -INFINITY);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float e = expf(row[i] - m);
    row[i] = e;
    sum += e;
  }
  const float inv = 1.0f / block_sum(sum);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) row[i] *= inv;
}

// util/half.h's conversions, on the device.
__global__ void f32_to_bf16_kernel(const float* __restrict__ x, uint16_t* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t b = __float_as_uint(x[i]);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
      out[i] = uint16_t((b >> 16) | 0x40u);
    } else {
      b += 0x7fffu + ((b >> 16) & 1u);
      out[i] = uint16_t(b >> 16);
    }
  }
}

__global__ void bf16_to_f32_kernel(const uint16_t* __restrict__ x, float* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __uint_as_float(uint32_t(x[i]) << 16);
}

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
  const dim3 block(kRopePairThreads, kRopeHeadThreads);
  // blockIdx.y: groups of kRopeHeadThreads heads (one block walked all 64 heads of a token, ~3 us).
  const dim3 grid(unsigned(T), unsigned(std::min<int64_t>((heads + kRopeHeadThreads - 1) / kRopeHeadThreads, 65535)));
  rope_kernel<<<grid, block, 0, stream_of(s)>>>(x, x_stride, out, out_stride, width, heads, pos, r);
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
