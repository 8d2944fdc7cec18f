// The MLA absorption products (attention.h: Blas::per_head) on quantized W_UK / W_UV read as the
// file stores them (Q8_0, the K-quants, IQ4_XS, IQ2_XXS: the int8 units of q8_units.cuh), so that
// no bf16 copy of them is made: a GLM-5 Q4_K_M layer (attn_k_b Q8_0, attn_v_b Q6_K) reads 13.6 MB
// instead of 29.4 MB of copies per decode step, and holds 1.2 GB less over 78 layers.
//
// Decode-sized batches (up to kHqMaxTokens tokens): a block takes RB rows of one head. Before the
// wait for the kernel before (pdl.cuh: the weights are no kernel's output) it copies the rows' bytes
// into shared memory (16-byte cp.async pieces; a head's rows are contiguous), then quantizes its
// head's activations of every token into shared memory on two levels (quantize_q8_warp: the bits
// of quantize_activations), and then each thread decodes units i = tid, tid + threads, ... of the
// rows (unit i: row i / U, unit i % U of it, U units per row) and forms their dots with each token
// (the dp4a units of the int8 decode kernels). The row's sum adds its U unit dots in unit order
// (one thread per row and token): a fixed order, so a token's result does not depend on the batch.
// Result: W x_hat with x_hat the two-level int8 activations (relative error ~3e-5 on N(0, 1)
// values, against ~2e-3 for the bf16 activations of the bf16 path) and the weights exact.
//
// Larger batches (prefill) dequantize the rows into a bf16 copy per call
// (dequantize_heads_bf16: each value as the CPU dequantizes it, rounded to nearest even) for the
// cuBLAS path of absorb.cu: the copy made at load before, made per prefill call now.
#include <cuda_bf16.h>

#include <algorithm>
#include <numeric>

#include "ops/cuda/absorb_q8.cuh"
#include "ops/cuda/absorb_q8_kernel.cuh"
#include "ops/cuda/check.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/q8_units.cuh"
#include "ops/cuda/quant_matmul_kernels.cuh"

namespace sparsemla::cuda {

namespace {

using gguf::GgmlType;
using namespace q8units;
using namespace absorb;

// Per type: the unit of the head kernel and the dequantizer.
struct HeadTypeKernels {
  GgmlType type;
  int block, units_per_block;  // the unit's kBlock and kUnitsPerBlock
  void (*launch)(const HeadQ8Args& a, cudaStream_t s);
  void (*dequant)(const uint8_t* w, uint64_t row_bytes, int64_t n_rows, int cols, const QuantTables& tb,
                  __nv_bfloat16* out, cudaStream_t s);
};

template <class V>
void launch_head(const HeadQ8Args& a, cudaStream_t s) {
  const int U = a.cols / V::kBlock * V::kUnitsPerBlock;
  const size_t smem = hq_layout(a.row_bytes, a.rows_per_block, a.cols, a.T, U).total;
  const dim3 grid(unsigned((a.rows + a.rows_per_block - 1) / a.rows_per_block), unsigned(a.heads));
  const int nt = hq_tokens_per_pass(a.T);
  const auto kernel = nt == 1 ? head_q8_kernel<V, 1> : nt == 2 ? head_q8_kernel<V, 2> : head_q8_kernel<V, kHqPass>;
  allow_smem(kernel, smem);
  pdl::launch(kernel, grid, kHqThreads, smem, s, a);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

template <GgmlType T, class V>
constexpr HeadTypeKernels head_kernels() {
  return {T, V::kBlock, V::kUnitsPerBlock, &launch_head<V>, &launch_dequantize_bf16<dq::Dq<T>>};
}

constexpr HeadTypeKernels kHeadKernels[] = {
    head_kernels<GgmlType::Q8_0, Q80Unit>(),     head_kernels<GgmlType::Q4_K, Q4KUnit>(),
    head_kernels<GgmlType::Q5_K, Q5KUnit>(),     head_kernels<GgmlType::Q6_K, Q6KUnit>(),
    head_kernels<GgmlType::Q2_K, Q2KUnit>(),     head_kernels<GgmlType::Q3_K, Q3KUnit>(),
    head_kernels<GgmlType::IQ4_XS, IQ4XSUnit>(), head_kernels<GgmlType::IQ2_XXS, IQ2XXSUnit>(),
};

const HeadTypeKernels* head_kernels_for(GgmlType t) {
  for (const HeadTypeKernels& k : kHeadKernels)
    if (k.type == t) return &k;
  return nullptr;
}

uint64_t head_row_bytes(const HeadBatchedGemm& g) { return gguf::row_bytes(g.type, uint64_t(g.cols)); }

// The launch shape of g's rows: units per row, rows per block and the block's shared memory at T tokens.
struct HeadShape {
  int units_per_row = 0, rows_per_block = 0;
  size_t smem = 0;
};
HeadShape head_shape(const HeadBatchedGemm& g, const HeadTypeKernels& k, int64_t T) {
  HeadShape sh;
  const uint64_t rb = head_row_bytes(g);
  sh.units_per_row = g.cols / k.block * k.units_per_block;
  sh.rows_per_block = rows_per_block(rb, g.rows, sh.units_per_row);
  sh.smem = hq_layout(rb, sh.rows_per_block, g.cols, int(T), sh.units_per_row).total;
  return sh;
}

}  // namespace

bool head_q8_supported(gguf::GgmlType t, int rows, int cols, const void* w) {
  const HeadTypeKernels* k = head_kernels_for(t);
  if (!k || rows <= 0 || cols <= 0 || cols % k->block != 0) return false;
  // Every head's rows start 16-byte aligned (the blocks' cp.async pieces).
  const uint64_t head_bytes = uint64_t(rows) * gguf::row_bytes(t, uint64_t(cols));
  return head_bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(w) & 15) == 0;
}

bool head_q8_fits(const HeadBatchedGemm& g, int64_t T) {
  if (g.form != HeadWeights::Quant || T < 1 || T > kHqMaxTokens || g.heads > 65535) return false;
  if (!head_q8_supported(g.type, g.rows, g.cols, g.w)) return false;
  return head_shape(g, *head_kernels_for(g.type), T).smem <= kHqMaxSmem;
}

void head_gemv_q8(const HeadBatchedGemm& g, const float* x, int64_t x_stride, int64_t T, float* out,
                  int64_t out_stride, cudaStream_t s) {
  if (!head_q8_fits(g, T))
    fail("cuda::head_gemv_q8: {} weights of {} heads x {} x {} at {} tokens are not taken", gguf::type_name(g.type),
         g.heads, g.rows, g.cols, T);
  const HeadTypeKernels& k = *head_kernels_for(g.type);
  HeadQ8Args a;
  a.w = static_cast<const uint8_t*>(g.w);
  a.row_bytes = head_row_bytes(g);
  a.heads = g.heads;
  a.rows = g.rows;
  a.cols = g.cols;
  a.rows_per_block = head_shape(g, k, T).rows_per_block;
  a.x = x;
  a.x_stride = x_stride;
  a.T = int(T);
  a.out = out;
  a.out_stride = out_stride;
  a.tables = device_quant_tables();
  k.launch(a, s);
}

void dequantize_heads_bf16(const HeadBatchedGemm& g, void* out, cudaStream_t s) {
  const HeadTypeKernels* k = head_kernels_for(g.type);
  if (g.form != HeadWeights::Quant || !k || g.cols % k->block != 0)
    fail("cuda::dequantize_heads_bf16: {} weights of {} columns are not taken", gguf::type_name(g.type), g.cols);
  // (The decoders read a block's fields as aligned as a 16-byte aligned base makes them.)
  if ((reinterpret_cast<uintptr_t>(g.w) | reinterpret_cast<uintptr_t>(out)) & 15)
    fail("cuda::dequantize_heads_bf16: weights {} and output {} must be 16-byte aligned", g.w, out);
  k->dequant(static_cast<const uint8_t*>(g.w), head_row_bytes(g), int64_t(g.heads) * g.rows, g.cols,
             device_quant_tables(), static_cast<__nv_bfloat16*>(out), s);
}

}  // namespace sparsemla::cuda
