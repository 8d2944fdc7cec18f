// The int8-activation decode products (non-precise mode): the activations are quantized once per
// product to int8 blocks of 32 with an fp32 scale, and multiplied with the weights' integer quants
// by __dp4a, applying the weight and activation scales per sub-block (llama.cpp's mmvq scheme).
// About one instruction per weight element at one token instead of three (gemv.cuh), so the
// products run near the memory rate. Plain C++, so that host code can call it.
//
// Result: y = W x_hat, where x_hat is the dequantized activation (quantize_activations below), up
// to fp32 summation order (relative ~2e-7 measured). Two precisions of x_hat:
//   one level   x_hat = d q: against the fp32 x, the int8 rounding costs a relative error of 8e-3
//               to 9e-3 on N(0, 1) activations (H200, test_cuda_matmul): --int8-activations;
//   two levels  x_hat = (d / 254) (254 q + r), r the int8 rounding of what q leaves over: each
//               value within max|x| / 64,500 of its block, a relative error of ~3e-5 on N(0, 1)
//               activations, under the ~2e-3 of bf16 activations; one more __dp4a per 4 weights
//               and twice the activation loads. On an H200 (docs/PERFORMANCE.md, sessions 18,
//               24-26) faster than the fp32 kernel for Q8_0 and Q5_K at every batch (output head
//               at one token: 91% against 75% of copy bandwidth, and 56% against 41%; 1.6-2.4x at
//               8 tokens) and for Q6_K at one token with staged loads (below; head 265 against
//               307 us); at 2-8 tokens no faster than the tensor-core kernels for Q4_K and Q6_K.
//               The model's fast mode takes it for Q8_0, Q5_K, Q2_K, Q3_K, IQ4_XS and IQ2_XXS
//               (model::GpuModelOptions::q8_two_level; Q2_K / Q3_K / IQ4_XS / IQ2_XXS output head
//               at one token 181 / 187 / 280 / 187 us against 278 / 415 / 440 / 422 for the fp32
//               kernel, session 29; faster at 2-8 tokens too but for Q3_K and IQ2_XXS at a few
//               shapes, within 5%), and for Q4_K and Q6_K in one-token steps (Q4_K on the
//               one-token tensor-core kernel below: session 25).
// Batch invariant as matmul_decode is: token t's result is the same bits whatever the number of
// tokens and the other tokens' values, and an expert pair equals the one-token product on the
// expert's rows.
//
// One-token tensor-core kernel (Q4_K, Q5_K: q8_one_token_supported; gemv_q8_mma.cu): the bf16
// one-token kernel's scheme on integers (m16n8k32 u8 x s8 mma, the n holding a 256-block's scale
// groups), fewer decode instructions per weight than the dp4a kernel (counted from the code) and
// 5-29% less time at one token on an H200 (docs/PERFORMANCE.md, session 25). Its result is W x_hat as
// well (the integer dots are exact; fp32 scaling and sums in another order), so it is taken only
// where a caller asks (one_token_kernel below: one token per product, or expert pairs), as
// matmul takes the bf16 one-token kernel and matmul_decode does not; a token's bits then differ
// between one token and a batch. Types without it take the dp4a kernel either way.
#pragma once
#include <cstddef>
#include <cstdint>

#include "gguf/ggml_types.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/quant_matmul.h"

namespace sparsemla::cuda {

// Elements per activation block: one fp32 scale and one int32 sum per 32 int8 values.
constexpr int64_t kQ8ActBlock = 32;
// Two levels: the first level's step over the second's.
constexpr int kQ8LevelRatio = 254;

// Quantized activations in a caller-owned device buffer of q8_activation_bytes(n_tokens, n_cols,
// levels) bytes (16-byte aligned). Layout (S = n_tokens * n_cols rounded up to 16):
//   q:      [n_tokens][n_cols] int8, at offset 0
//   r:      [n_tokens][n_cols] int8, at offset S (two levels only)
//   blocks: [n_tokens][n_cols / 32] {float scale, int32 sum}, at offset q8_scales_offset(...):
//           one level: scale d, sum of q; two levels: scale d / 254, sum of 254 q + r
// The caller sets data and bytes; quantize_activations sets n_tokens, n_cols and levels.
struct Q8Activations {
  void* data = nullptr;  // device, 16-byte aligned
  size_t bytes = 0;      // capacity of data
  int64_t n_tokens = 0;
  int64_t n_cols = 0;    // a multiple of 32
  int levels = 1;        // 1 or 2
};

// Offset of the block scales in the buffer: the int8 values (each level) rounded up to 16 bytes.
size_t q8_scales_offset(int64_t n_tokens, int64_t n_cols, int levels = 1);
// Bytes of the buffer for n_tokens x n_cols activations.
size_t q8_activation_bytes(int64_t n_tokens, int64_t n_cols, int levels = 1);

// Quantizes x: [n_tokens, n_cols] device fp32 (n_cols a multiple of 32) into out, block by block
// of 32 consecutive values of a row:
//   amax = max |x_i| (fp32, exact)
//   d    = amax / 127 (fp32 division, round to nearest even)
//   q_i  = 0 if d == 0, else clamp(round_half_even(x_i / d), -127, 127) (fp32 division, then
//          rounding to the nearest integer, ties to even; the clamp only acts when d is subnormal)
//   sum  = sum of q_i (int32)
// and with levels = 2 also
//   e_i  = fma(-d, q_i, x_i) (what q_i leaves over, rounded once)
//   s    = d / 254 (fp32 division)
//   r_i  = 0 if s == 0, else clamp(round_half_even(e_i / s), -127, 127) (|e_i| <= d / 2, so the
//          clamp acts only where fp32 rounding takes a value a hair past 127)
//   scale = s, sum = sum of 254 q_i + r_i
// Finite inputs only (a NaN or inf in a block makes its values unspecified). The CPU reference in
// test_cuda_matmul.cpp reproduces it bit for bit. Throws sparsemla::Error for a bad shape, a buffer
// that is too small or a misaligned pointer.
void quantize_activations(const float* x, int64_t n_tokens, int64_t n_cols, Q8Activations& out, Stream s,
                          int levels = 1);

// Whether matmul_decode_q8 / matmul_experts_q8 take this weight type: Q8_0, Q4_K, Q5_K, Q6_K, Q2_K,
// Q3_K, IQ4_XS, IQ2_XXS, IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, Q4_0, IQ4_NL (the last eight
// written in session 30 without a GPU: the model takes them only with --int8-activations until they
// have run).
// Other types stay on the fp32 path (matmul_decode); the caller checks.
bool q8_supported(gguf::GgmlType t);
bool q8_one_token_supported(gguf::GgmlType t);

// y[t][r] = sum_c W[r][c] * x_hat[t][c] for t < x.n_tokens (any count; made for 1..16).
// x.n_cols must equal w.n_cols. y: [x.n_tokens, n_rows] device fp32. Throws sparsemla::Error
// naming the type for an unsupported type, or the shape / alignment problem.
void matmul_decode_q8(const QuantMatrix& w, const Q8Activations& x, float* y, Stream s, bool one_token_kernel = false);

// Several products of one input, y_i = W_i x_hat (n <= kMaxProducts; every type q8_supported), each
// the bits of matmul_decode_q8 alone; at one token those of one type and column count share a launch
// (as matmul_many).
// one_token_kernel: at one token, products of q8_one_token_supported types take the one-token
// tensor-core kernel (each then the bits of matmul_decode_q8 alone with the same flag).
void matmul_many_q8(const QuantMatrix* w, float* const* y, int n, const Q8Activations& x, Stream s,
                    bool one_token_kernel = false);

// matmul_experts on quantized activations: for each pair p < n_pairs with ids[p] >= 0,
// y[p] = W_{ids[p]} x_hat[p / x_div]; pairs with a negative id leave their output row unwritten.
// x holds n_pairs / x_div (rounded up) rows or more.   y: [n_pairs, rows_per_expert]
// shared: a shared expert run as pair n_pairs, as matmul_experts takes it. Each pair is summed as
// matmul_decode_q8 sums the expert's rows alone (with the same one_token_kernel).
void matmul_experts_q8(const QuantMatrix& w, int64_t rows_per_expert, const int32_t* expert_ids, int64_t n_pairs,
                       const Q8Activations& x, int64_t x_div, float* y, Stream s, const SharedPair* shared = nullptr,
                       bool one_token_kernel = false);
// The experts' gate and up products in one launch where their types and shapes agree (else two),
// with a shared expert pair (SharedPair::w, w2): the bits of two matmul_experts_q8 calls.
void matmul_experts_pair_q8(const QuantMatrix& w1, const QuantMatrix& w2, int64_t rows_per_expert,
                            const int32_t* expert_ids, int64_t n_pairs, const Q8Activations& x, int64_t x_div,
                            float* y1, float* y2, Stream s, const SharedPair* shared = nullptr,
                            bool one_token_kernel = false);

// The dp4a kernel's staged loads for Q6_K and Q8_0 (gemv_q8.cu: each warp copies its weight bytes
// into shared memory in 16-byte pieces first; one token or expert pairs, rows of whole 8-block
// (Q6_K) / 32-block (Q8_0) chunks). The same bits either way; on by default. Off: the kernel reads
// the 2-byte aligned blocks directly. For tests and benchmarks (process-wide, not thread-safe).
// q8_staged_launches: how many launches took the staged kernel so far (process-wide).
void set_q8_staged_loads(bool on);
bool q8_staged_loads();
int64_t q8_staged_launches();
// Of those, the launches of the row-group kernel (rows of one chunk: Q6_K 2048 columns).
int64_t q8_staged_group_launches();

// matmul_expert_groups on quantized activations: each group's slots read the rows of x that
// matmul_expert_groups would read (perm[j] / x_div, or row j without perm); x must hold them all
// (they are on the device, so this is the caller's to ensure). Each slot is summed as
// matmul_decode_q8 sums one token on the expert's rows.
void matmul_expert_groups_q8(const QuantMatrix& w, int64_t rows_per_expert, const ExpertGroups& g,
                             const Q8Activations& x, int64_t x_div, float* y, Stream s);

}  // namespace sparsemla::cuda
