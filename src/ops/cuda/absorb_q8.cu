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
#include "ops/cuda/check.cuh"
#include "ops/cuda/launch_cache.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/q8_quantize.cuh"
#include "ops/cuda/q8_units.cuh"
#include "ops/cuda/quant_matmul_kernels.cuh"

namespace sparsemla::cuda {

namespace {

using gguf::GgmlType;
using namespace q8units;

constexpr int kHqThreads = 256;
constexpr int kHqUnitsPerThread = 2;  // units per thread that a block's rows come to (at most)
constexpr int kHqPass = 4;            // tokens per pass at most (a pass re-reads its units from shared memory)
constexpr int kHqLevels = 2;
constexpr size_t kHqMaxSmem = 96 * 1024;  // within the 99 KB of SM86/89/12x

struct HeadQ8Args {
  const uint8_t* w = nullptr;  // [heads][rows][row_bytes]
  uint64_t row_bytes = 0;
  int heads = 0, rows = 0, cols = 0;
  int rows_per_block = 0;  // RB
  const float* x = nullptr;
  int64_t x_stride = 0;
  int T = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
  QuantTables tables;
};

// Dynamic shared memory: [RB rows' bytes, 16-aligned] [T][cols] q | [T][cols] r | [T][cols / 32]
// {scale, sum} | [NT][RB][U + 1] unit dots (a row's U + 1 apart: the row sums' lanes, one row
// each, read no shared bank twice).
struct HqLayout {
  size_t w = 0, q = 0, r = 0, blocks = 0, dots = 0, total = 0;
};
__host__ __device__ inline size_t hq_align16(size_t n) { return (n + 15) / 16 * 16; }
__host__ __device__ inline int hq_tokens_per_pass(int T) { return T == 1 ? 1 : T == 2 ? 2 : kHqPass; }
__host__ __device__ inline HqLayout hq_layout(uint64_t row_bytes, int rb, int cols, int T, int units_per_row) {
  HqLayout l;
  l.w = 0;
  l.q = hq_align16(uint64_t(rb) * row_bytes);
  l.r = l.q + hq_align16(size_t(T) * cols);
  l.blocks = l.r + hq_align16(size_t(T) * cols);
  l.dots = l.blocks + size_t(T) * (cols / 32) * 8;
  l.total = l.dots + size_t(hq_tokens_per_pass(T)) * rb * (units_per_row + 1) * 4;
  return l;
}

// Grid (ceil(rows / RB), heads); NT = hq_tokens_per_pass(T) tokens per pass (the last token
// repeated in a pass past T).
template <class V, int NT>
__global__ void __launch_bounds__(kHqThreads) head_q8_kernel(const HeadQ8Args a) {
  extern __shared__ __align__(16) uint8_t sm[];
  constexpr int L = kHqLevels;
  const int h = blockIdx.y, tid = threadIdx.x;
  const int U = a.cols / V::kBlock * V::kUnitsPerBlock;  // units per row
  const int r0 = blockIdx.x * a.rows_per_block, nr = min(a.rows_per_block, a.rows - r0);
  const HqLayout lay = hq_layout(a.row_bytes, a.rows_per_block, a.cols, a.T, U);
  // The block's rows, contiguous and 16-byte aligned (head_q8_supported).
  const uint8_t* src = a.w + (uint64_t(h) * a.rows + r0) * a.row_bytes;
  const int pieces = int(uint64_t(nr) * a.row_bytes / 16);
  for (int p = tid; p < pieces; p += kHqThreads) cp_async16(sm + lay.w + 16 * p, src + 16 * p);
  cp_async_commit();
  pdl::wait();
  pdl::launch_dependents();  // the next decode product may prefetch its weights
  // Every token's activations of this head, quantized: warp w takes blocks w, w + 8, ... of 32.
  int8_t* sq = reinterpret_cast<int8_t*>(sm + lay.q);
  int8_t* sr = reinterpret_cast<int8_t*>(sm + lay.r);
  int2* sb = reinterpret_cast<int2*>(sm + lay.blocks);
  const int nb = a.cols / 32, lane = tid % 32;
  for (int b = tid / 32; b < a.T * nb; b += kHqThreads / 32) {
    const int t = b / nb, c = (b % nb) * 32 + lane;
    quantize_q8_warp<L>(a.x[(int64_t(t) * a.heads + h) * a.x_stride + c], b, lane, sq, sr, sb);
  }
  cp_async_wait_all();
  __syncthreads();
  float* dots = reinterpret_cast<float*>(sm + lay.dots);  // [NT][nr][U + 1]
  const int n_units = nr * U;
  for (int t0 = 0; t0 < a.T; t0 += NT) {
    TokenX<L, true> x[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int tok = min(t0 + t, a.T - 1);
      x[t].q[0] = sq + tok * a.cols;
      x[t].q[1] = sr + tok * a.cols;
      x[t].xb = sb + tok * nb;
    }
    for (int i = tid; i < n_units; i += kHqThreads) {
      const int row = i / U, iu = i % U, b = iu / V::kUnitsPerBlock, u = iu % V::kUnitsPerBlock;
      const typename V::W wu = V::load(sm + lay.w + uint64_t(row) * a.row_bytes + b * V::kBytes, u, a.tables);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const typename V::template X<L> xu = V::template load_x<L>(x[t], b, u);
        dots[(t * nr + row) * (U + 1) + iu] = V::fma(wu, xu, 0.0f);
      }
    }
    __syncthreads();
    for (int j = tid; j < NT * nr; j += kHqThreads) {
      const int t = j / nr, row = j % nr;
      if (t0 + t >= a.T) continue;
      const float* d = dots + (t * nr + row) * (U + 1);
      float s = 0.0f;
      for (int k = 0; k < U; ++k) s = __fadd_rn(s, d[k]);
      a.out[(int64_t(t0 + t) * a.heads + h) * a.out_stride + r0 + row] = s;
    }
    __syncthreads();  // (the next pass writes the dots again)
  }
}

// The rows of every head as bf16, each value as dequantize_exact (the CPU's) gives it, rounded to
// nearest even; one thread per unit of D::kUnit values.
template <GgmlType T>
__global__ void dequantize_bf16_kernel(const uint8_t* __restrict__ w, uint64_t row_bytes, int64_t n_rows, int cols,
                                       QuantTables tables, __nv_bfloat16* __restrict__ out) {
  using D = dq::Dq<T>;
  const int units = cols / D::kUnit;
  const int64_t n = n_rows * units;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / units;
    const int iu = int(i % units), b = iu / D::kUnitsPerBlock, u = iu % D::kUnitsPerBlock;
    float v[D::kUnit];
    dq::dequantize_exact<D>(w + r * row_bytes + int64_t(b) * D::kBytes, u, v, tables);
    __nv_bfloat16* o = out + r * cols + int64_t(b) * D::kBlock;
#pragma unroll
    for (int run = 0; run < D::kUnit / 8; ++run) {
      uint32_t p[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __nv_bfloat162 two = __floats2bfloat162_rn(v[8 * run + 2 * k], v[8 * run + 2 * k + 1]);
        p[k] = *reinterpret_cast<const uint32_t*>(&two);
      }
      *reinterpret_cast<uint4*>(o + D::run(u, run)) = make_uint4(p[0], p[1], p[2], p[3]);
    }
  }
}

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

template <GgmlType T>
void launch_dequant(const uint8_t* w, uint64_t row_bytes, int64_t n_rows, int cols, const QuantTables& tb,
                    __nv_bfloat16* out, cudaStream_t s) {
  const int64_t n = n_rows * (cols / dq::Dq<T>::kUnit);
  const unsigned grid = unsigned(std::min<int64_t>((n + 255) / 256, 65535));
  dequantize_bf16_kernel<T><<<grid, 256, 0, s>>>(w, row_bytes, n_rows, cols, tb, out);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
}

template <GgmlType T, class V>
constexpr HeadTypeKernels head_kernels() {
  return {T, V::kBlock, V::kUnitsPerBlock, &launch_head<V>, &launch_dequant<T>};
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

// Rows per block: the most rows whose units come to at most kHqUnitsPerThread per thread (at least
// one row), a multiple of the rows that make a whole number of 16-byte pieces, and no more than
// the head has.
int rows_per_block(uint64_t row_bytes, int rows, int units_per_row) {
  const int granule = int(16 / std::gcd(row_bytes, uint64_t(16)));
  int rb = std::max(1, kHqThreads * kHqUnitsPerThread / units_per_row);
  rb = std::max(granule, rb / granule * granule);
  return std::min(rb, (rows + granule - 1) / granule * granule);
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
