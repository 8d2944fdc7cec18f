// Matrix products on GGUF weights in device memory, read in place: each kernel dequantizes the
// blocks it needs in registers or shared memory, so no float copy of a weight ever exists.
// The GPU counterpart of ops/cpu/matmul.h; plain C++, so that host code can call it.
//
// Three kernels, picked by the number of tokens and the type:
//   decode  (T <= kDecodeMaxTokens): fp32 activations, weights dequantized to fp32 in registers,
//           fp32 FMA. Batch invariant: token t's result is the same bits whatever T is and whatever
//           the other tokens are (each token's sum runs in a fixed order that depends only on the
//           weight's shape). Agrees with the CPU to fp32 rounding (relative ~1e-6).
//   tensor-core decode (Q4_K and Q6_K: mma_decode_supported): weights decoded to bf16 pairs in
//           registers, activations rounded to bf16, mma.sync with fp32 accumulation (gemv_mma.cu):
//           about 3.7 instructions per weight whatever the token count up to 8, where the fp32
//           kernel adds a multiply-add per weight and token. Batch invariant among the token
//           counts it takes; agrees with the fp32 product to ~1e-2 relative (bf16 roundings, as
//           the prefill kernel). matmul takes it from mma_min_tokens(type) to kDecodeMaxTokens
//           tokens (Q4_K 2, Q6_K 3). One Q6_K token stays on the fp32 kernel (faster there, H200).
//   one-token tensor-core decode (Q4_K: mma_one_token_supported): the mma's n holds the scale
//           groups instead of tokens, weights exact, only activations rounded to bf16 (~2e-3
//           relative); matmul's kernel for one Q4_K token of up to kOneTokenMaxCols columns (wider
//           ones take the fp32 kernel). So a token's bits under matmul differ
//           between one token and a batch; matmul_decode (the precise mode's choice) stays the
//           fp32 kernel at every T.
//   prefill (T > kDecodeMaxTokens): tiles of 128 rows x 32, 64 or 128 tokens, weights dequantized
//           to bf16 in shared memory, activations rounded to bf16, tensor-core mma.sync with fp32
//           accumulation. Relative error 2e-3 to 6e-3 against the fp32 product (two bf16
//           roundings per term); deterministic for a given T, but not batch invariant.
// The crossover is measured (H200, docs/PERFORMANCE.md): the decode kernel costs about one fp32
// FMA per weight and token, so past 8 tokens the tensor-core kernel, whose time hardly depends on
// T up to its tile, is faster (at 16 tokens 2-2.5x).
// A caller that needs batch invariance for more tokens (a large decode batch) calls
// matmul_decode directly, which takes any T.
#pragma once
#include <cstdint>

#include "gguf/ggml_types.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/expert_tiles.h"

namespace sparsemla::cuda {

// A 2-D view of a weight in device memory; mirrors ops::Weight, column slices included (rows
// row_bytes apart, each holding n_cols values at its start).
struct QuantMatrix {
  gguf::GgmlType type = gguf::GgmlType::F32;
  int64_t n_cols = 0;       // ne0: the input dimension of y = W x; a whole number of blocks
                            // (a multiple of 8 for F32/F16/BF16)
  int64_t n_rows = 0;       // output dimension
  uint64_t row_bytes = 0;   // stride between rows: >= gguf::row_bytes(type, n_cols), whole blocks
  const void* data = nullptr;  // device, [n_rows][row_bytes]; a block start of a 16-byte aligned
                               // tensor (so aligned to the largest power of 2, up to 16, that
                               // divides the block's byte size)
};

// Largest token count that matmul sends to the batch-invariant decode kernel.
constexpr int64_t kDecodeMaxTokens = 8;

// Whether the kernels handle this type: F32, F16, BF16, Q8_0, Q4_0, IQ4_NL, MXFP4, Q2_K..Q6_K,
// IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M.
bool supported(gguf::GgmlType t);

// y[t][r] = sum_c W[r][c] * x[t][c].   x: [n_tokens, n_cols] device fp32, 16-byte aligned
// y: [n_tokens, n_rows] device fp32. Throws sparsemla::Error naming the type or shape for an
// unsupported type, a shape the view does not hold, or misaligned pointers.
void matmul(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s);
void matmul_decode(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s);
bool mma_decode_supported(gguf::GgmlType t);
int64_t mma_min_tokens(gguf::GgmlType t);  // the fewest tokens matmul sends to it (> kDecodeMaxTokens: never)
// The one-token tensor-core kernel (Q4_K): the mma's n holds a 256-block's 8 scale groups instead
// of tokens, the weights enter as exact bf16 integers and their scales are applied per group in
// fp32 (gemv_mma_one.cu), so only the activations are rounded to bf16: closer to the fp32 product
// than the kernel above. One token per call (or per expert pair); at most kOneTokenMaxCols columns
// (its blocks stage the token in shared memory).
// matmul takes it for every one-token product it takes (mma_one_token_takes): as fast as or
// faster than the fp32 kernel on every shape measured (H200, docs/PERFORMANCE.md).
bool mma_one_token_supported(gguf::GgmlType t);
constexpr int64_t kOneTokenMaxCols = 21248;
bool mma_one_token_takes(const QuantMatrix& w);
void matmul_decode_mma_one(const QuantMatrix& w, const float* x, float* y, Stream s);
void matmul_decode_mma(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s);
void matmul_prefill(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s);
// The prefill product through cuBLAS (prefill_blas.cu): the weight's rows dequantized to bf16 once
// per call (in chunks of 64 MiB; BF16 rows read in place), the activations rounded to bf16 once,
// cuBLAS's bf16 GEMM with fp32 accumulation. The tile kernel decodes each weight once per
// 128-token tile, and that decode sets its pace; here the decode is paid once. Where
// prefill_blas_enabled() (the default; SPARSEMLA_PREFILL_BLAS=0 or set_prefill_blas(false) turns it
// off), matmul takes it from blas_min_tokens(type) tokens, where it measured faster than the tile
// kernel (docs/PERFORMANCE.md, session 38), and the model its routers' fp32 products
// (matmul_f32_blas) from kF32BlasMinTokens. The same two bf16 roundings per term as the tile
// kernel; deterministic for a given T, not batch invariant. Returns false, having enqueued nothing,
// where it cannot run (no memory for its scratch: cuBLAS's 32 MiB workspace, T x cols + one chunk
// of bf16; no cuBLAS handle, or a CUDA graph capture before the device has one); matmul then takes
// the tile kernel. chunk_rows > 0: at most that many rows per chunk (tests: several chunks on a
// small weight).
int64_t blas_min_tokens(gguf::GgmlType t);  // > kDecodeMaxTokens, <= kBlasMinTokensMax
constexpr int64_t kBlasMinTokensMax = 128;
constexpr int64_t kF32BlasMinTokens = 128;
bool matmul_prefill_blas(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s,
                         int64_t chunk_rows = 0);
bool prefill_blas_enabled();
void set_prefill_blas(bool on);  // process-wide
// Makes the current device's cuBLAS handle and runs one small bf16 and one fp32 GEMM on s (then
// waits for them), so that the library's first-use setup (~0.2 s on an H100: its modules loaded)
// is paid when a model loads, not by the first long prompt. Nothing where the cuBLAS prefill is off.
void prefill_blas_warm_up(Stream s);
// The cuBLAS products run so far in this process (matmul_prefill_blas and matmul_f32_blas; tests).
int64_t prefill_blas_calls();
// y = W x in fp32 arithmetic through cuBLAS (no tensor-core rounding) for F32 weights: a router's
// logits at prefill sizes, which the fp32 decode kernel (one FMA per weight and token) takes 2.5 ms
// for at 4096 tokens x 256 x 6144 on an H100. fp32 rounding as matmul_decode, another summation
// order; not batch invariant. False, having enqueued nothing, for other types or where cuBLAS
// cannot run (as matmul_prefill_blas).
bool matmul_f32_blas(const QuantMatrix& w, const float* x, int64_t n_tokens, float* y, Stream s);

// Several products of one input (an attention's q_a, kv_a and index-key products; an MLP's gate and
// up), y_i = W_i x for i < n <= kMaxProducts, the same bits as n calls of matmul (precise:
// matmul_decode). At one token the products that share a type and a column count take one launch
// (the one-token or fp32 decode kernel, the product picked by the grid's z; any row counts), which
// saves kernels' starts and drains at batch 1 and fills the device where each alone would not (a
// 128-row product is 8 blocks). At prefill sizes those that take cuBLAS (blas_min_tokens; of one
// column count) round x to bf16 once for all (prefill_blas_many); otherwise one call each.
constexpr int kMaxProducts = 4;
void matmul_many(const QuantMatrix* w, float* const* y, int n, const float* x, int64_t n_tokens, Stream s,
                 bool precise = false);
// matmul_many of two.
void matmul_pair(const QuantMatrix& w1, const QuantMatrix& w2, const float* x, int64_t n_tokens, float* y1, float* y2,
                 Stream s, bool precise = false);

// Mixture-of-experts products without a host round trip (the expert ids stay on the device):
// for each pair p < n_pairs, y[p] = W_{ids[p]} x[p / x_div], where W_e is rows
// [e * rows_per_expert, (e + 1) * rows_per_expert) of w (the experts of a 3-D GGUF tensor).
// x_div = k (experts per token) for gate/up (x: [tokens, n_cols]), 1 for down (x: [pairs, n_cols]).
// Pairs with a negative id are skipped (their output rows are not written). Each pair is summed
// exactly as the one-token decode product sums it (batch invariant).   y: [n_pairs, rows_per_expert]
// kernel: the fp32 decode kernel; the tensor-core one where mma_decode_supported, summed as its
// one-token product sums it (so equal to matmul_expert_groups with tensor_cores); or the one-token
// tensor-core kernel (mma_one_token_supported types; the fast mode's choice at batch 1).
enum class ExpertKernel { kFp32, kTensorCores, kOneToken };
// A shared expert run as one more pair of the call (so that its product is no launch of its own):
// pair n_pairs multiplies w (matmul_experts_pair: w for the first product, w2 for the second; each of
// one expert's shape and type: rows_per_expert rows) with activation row x_row of x, into output row
// n_pairs, summed as the one-token product sums it. It reads no expert id.
struct SharedPair {
  const QuantMatrix* w = nullptr;
  const QuantMatrix* w2 = nullptr;
  int64_t x_row = 0;
};
// Whether m has the shape of one expert of `experts` (rows_per_expert rows; type, columns and row
// stride equal): what a SharedPair's matrix must be.
bool expert_shaped(const QuantMatrix& experts, int64_t rows_per_expert, const QuantMatrix& m);
void matmul_experts(const QuantMatrix& w, int64_t rows_per_expert, const int32_t* expert_ids, int64_t n_pairs,
                    const float* x, int64_t x_div, float* y, Stream s, ExpertKernel kernel = ExpertKernel::kFp32,
                    const SharedPair* shared = nullptr);
// The experts' gate and up products in one launch (kFp32 and kOneToken; kTensorCores, or matrices of
// different types or shapes, as two calls): the same bits as two matmul_experts calls.
void matmul_experts_pair(const QuantMatrix& w1, const QuantMatrix& w2, int64_t rows_per_expert,
                         const int32_t* expert_ids, int64_t n_pairs, const float* x, int64_t x_div, float* y1,
                         float* y2, Stream s, ExpertKernel kernel = ExpertKernel::kFp32,
                         const SharedPair* shared = nullptr);

// The experts' products grouped by expert, without a host round trip (cuda::moe_group's output on
// the device): each expert with pairs reads its weights once for all of them. For every active
// expert e = active[g] (g < *n_active) and grouped slot j in [offsets[e], offsets[e + 1]):
// y[j] = W_e x[perm[j] / x_div] (x[j] when perm is null: activations already in grouped order).
// max_groups bounds *n_active (min(experts, pairs)); max_slots bounds the slots of one expert (the
// tokens: an expert appears once per token). Each slot is summed as the one-token decode product
// sums it, so the result equals matmul_experts' for the same pairs (kFp32 without tensor_cores,
// kTensorCores with), bit for bit.
//   y: [pairs, rows_per_expert] in grouped order (rows of experts without pairs untouched)
struct ExpertGroups {
  const int32_t* offsets = nullptr;   // [E + 1]
  const int32_t* active = nullptr;    // [E]
  const int32_t* n_active = nullptr;  // [1]
  const int32_t* perm = nullptr;      // [pairs] or null
  int64_t max_groups = 0, max_slots = 0;
};
void matmul_expert_groups(const QuantMatrix& w, int64_t rows_per_expert, const ExpertGroups& g, const float* x,
                          int64_t x_div, float* y, Stream s, bool tensor_cores = false);

// The experts of a prefill in few launches, their token groups cut into tiles (expert_tiles.h): one
// launch of n_tiles tiles (device memory) of `width` tokens: y = W_e x for w and, where w2 is
// given (same type and shape: an expert's gate and up), y2 = W2_e x in the same launch. w holds
// whole experts of rows_per_expert rows; x: [rows, w.n_cols] and y, y2: [rows, rows_per_expert],
// where rows is past every tile's rows (the tiles are on the device: not checked here).
void matmul_expert_tiles(const QuantMatrix& w, const QuantMatrix* w2, int64_t rows_per_expert, const ExpertTile* tiles,
                         int64_t n_tiles, int width, const float* x, float* y, float* y2, Stream s);
// The launches matmul_expert_tiles made so far in this process (tests).
int64_t expert_tile_launches();

// Embedding lookup: out[i] = row rows[i] of W as fp32, equal bit for bit to ops::dequantize_row.
// rows: [n] device int32; out: [n, n_cols] device fp32, 16-byte aligned. A negative id gives a row
// of zeros (under tensor parallelism, a token whose embedding row another rank holds); an id
// >= n_rows gives a row of NaN (the ids are on the device, so they cannot be checked here).
void dequantize_rows(const QuantMatrix& w, const int32_t* rows, int64_t n, float* out, Stream s);
// Rows [row0, row0 + n) of w as bf16 (each value as the CPU's dequantization gives it, rounded to
// nearest even): what matmul_prefill_blas multiplies.   out: [n, n_cols] bf16, 16-byte aligned
void dequantize_bf16(const QuantMatrix& w, int64_t row0, int64_t n, void* out, Stream s);

}  // namespace sparsemla::cuda
