// The small operations of the forward pass on the GPU: norms, RoPE, SwiGLU, residual add, scale,
// softmax and fp32 <-> bf16. Plain C++ (no CUDA headers): every pointer is a device pointer, every
// call is asynchronous on stream `s`. Each one computes what its CPU twin in ops/cpu computes
// (same formula, fp32 values, fp32 accumulation where the CPU accumulates in double).
#pragma once
#include <cstdint>

#include "ops/cpu/rope.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/quant_matmul_q8.h"

namespace sparsemla::cuda {

// out = x / sqrt(mean(x^2) + eps) * w for each of T rows of n values. Rows start `x_stride` and
// `out_stride` floats apart, so a norm can read or write part of a wider row (the latent c of
// [c | k_pe]); x == out (in place) is allowed.   x: [T, x_stride]   w: [n]   out: [T, out_stride]
// With q: out (its n values per row, contiguous: out_stride == n) also quantized into *q on
// `levels` levels, the bits of quantize_activations(out, T, n, *q, s, levels), in the same launch
// where the norm is split over a cluster of blocks (norm_split.h: SM90 and later, rows of 1024 or
// more values that split into 8, 4 or 2 slices of whole warps), else by that call after it.
void rms_norm(const float* x, int64_t x_stride, const float* w, int64_t T, int64_t n, float eps, float* out,
              int64_t out_stride, Stream s, Q8Activations* q = nullptr, int levels = 0);

// The residual step of every layer, fused: h += delta, then out = rms_norm(h, w) (q: as rms_norm).
//   h: [T, n] (updated)   delta: [T, n]   w: [n]   out: [T, n]
void add_rms_norm(float* h, const float* delta, const float* w, int64_t T, int64_t n, float eps, float* out,
                  Stream s, Q8Activations* q = nullptr, int levels = 0);

// out = (x - mean) / sqrt(var + eps) * w + b per row (biased variance; b may be null).
//   x, out: [T, n]   w, b: [n]
void layer_norm(const float* x, const float* w, const float* b, int64_t T, int64_t n, float eps, float* out,
                Stream s);

// A DeviceRope's table in one style, for kernels that rotate as part of a fused operation (rope.cuh
// has the rotation): pair i < half of a head rotates its values a = 2i and b = 2i + 1
// (interleaved) or a = i and b = i + half (half split).
struct RopeTable {
  const float* inv_freq = nullptr;  // [half], device
  int64_t half = 0;
  float attn_factor = 1.0f;
  bool interleaved = false;
};

// A Rope's frequency table on the device (uploaded once), applied in place to the first dims()
// values of every head of every token, token t at position pos[t].
//   x: [T, heads, stride] (the rotated part of a head may start inside a wider row: pass x + offset)
//   pos: [T] int64 or int32
class DeviceRope {
 public:
  explicit DeviceRope(const ops::Rope& rope);
  int64_t dims() const { return dims_; }
  RopeTable table(ops::RopeStyle style) const;
  void apply(float* x, int64_t T, int64_t heads, int64_t stride, const int64_t* pos, ops::RopeStyle style,
             Stream s) const;
  void apply(float* x, int64_t T, int64_t heads, int64_t stride, const int32_t* pos, ops::RopeStyle style,
             Stream s) const;
  // Into another array: out's first dims() values of each head are x's rotated, its values
  // [dims(), width) x's copied (the rotated part of a head moved into a wider row in one launch).
  //   x: [T, heads, x_stride]   out: [T, heads, out_stride]
  void apply_to(const float* x, int64_t x_stride, float* out, int64_t out_stride, int64_t width, int64_t T,
                int64_t heads, const int64_t* pos, ops::RopeStyle style, Stream s) const;

 private:
  DeviceBuffer inv_freq_;  // [dims / 2] fp32
  int64_t dims_ = 0;
  float attn_factor_ = 1.0f;
};

// gate[i] = silu(gate[i]) * up[i]   gate, up: [n]
// With q: gate, as rows of n_cols values (n / n_cols of them), also quantized into *q on `levels`
// levels in the same launch, the bits of quantize_activations(gate, n / n_cols, n_cols, *q, s, levels).
void silu_mul(float* gate, const float* up, int64_t n, Stream s, Q8Activations* q = nullptr, int64_t n_cols = 0,
              int levels = 0);
// The same on the fused layout of one gate|up product: out[t][f] = silu(gu[t][f]) * gu[t][F + f].
//   gate_up: [T, 2F]   out: [T, F]
void silu_mul_fused(const float* gate_up, int64_t T, int64_t F, float* out, Stream s);

// h[i] += delta[i]   h, delta: [n]
void add(float* h, const float* delta, int64_t n, Stream s);
// x[i] *= factor   x: [n]
void scale(float* x, float factor, int64_t n, Stream s);
// In-place softmax of each row (max-subtracted).   x: [T, n]
void softmax_rows(float* x, int64_t T, int64_t n, Stream s);

// fp32 <-> bf16 (stored as uint16), bit for bit as util/half.h: round to nearest even, NaN stays a
// quiet NaN.   [n] each
void f32_to_bf16(const float* x, uint16_t* out, int64_t n, Stream s);
void bf16_to_f32(const uint16_t* x, float* out, int64_t n, Stream s);

}  // namespace sparsemla::cuda
