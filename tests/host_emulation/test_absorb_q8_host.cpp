// The head-batched int8 absorption kernel (src/ops/cuda/absorb_q8_kernel.cuh: W_UK / W_UV read in
// place, quantized) run by the host emulation (cuda/emu.h): every thread of every block a fiber,
// with the kernel's own shared-memory layout, cp.async copies, warp collectives and barriers. So
// the kernel around the int8 units (its rows per block, shared-memory offsets, the per-head
// activation quantization, the passes over tokens and the unit-order row sums) is checked in CI,
// where there is no GPU; CudaAttention.QuantizedAbsorptionWeightsReadInPlace runs it on one.
//
// Reference: per (token, head), the head's first `cols` activations quantized on two levels by the
// rule of quant_matmul_q8.h (reproduced on the host in quant_test_util.h), times the rows as the
// CPU dequantizes them, in double. Only fp32 rounding differs: error per row relative to its sum of
// |w x| <= 1e-6 (the unit test's bound for the same arithmetic). Besides: the same results with
// the block's threads run in the opposite order between barriers (no race between its threads),
// and each token's results the same bits at every batch size (the kernel's unit-order sums).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "../unit/quant_test_util.h"
#include "gguf/ggml_types.h"
#include "gguf/quants.h"
#include "host_tables.h"
#include "ops/cuda/absorb_q8_kernel.cuh"

namespace sparsemla::cuda {
namespace {

using gguf::GgmlType;
using namespace absorb;

struct Case {
  int heads, rows, cols, T;
};

struct Problem {
  GgmlType type;
  Case c;
  std::vector<uint8_t> w;
  std::vector<float> x;  // [T][heads][x_stride]
  int x_stride, out_stride;
};

Problem make_problem(GgmlType type, const Case& c, uint32_t seed) {
  Problem p{type, c, test_q8::make_weight(type, int64_t(c.heads) * c.rows, c.cols, seed), {}, c.cols + 32,
            c.rows + 5};
  p.x = test::randn(size_t(c.T) * c.heads * p.x_stride, seed + 1);
  return p;
}

// Runs head_q8_kernel<V, NT> as absorb_q8.cu launches it, over the first T tokens of p.
template <class V>
std::vector<float> run_kernel(const Problem& p, int T, emu::Order order) {
  const Case& c = p.c;
  HeadQ8Args a;
  a.w = p.w.data();
  a.row_bytes = gguf::row_bytes(p.type, uint64_t(c.cols));
  a.heads = c.heads;
  a.rows = c.rows;
  a.cols = c.cols;
  const int U = c.cols / V::kBlock * V::kUnitsPerBlock;
  a.rows_per_block = rows_per_block(a.row_bytes, c.rows, U);
  a.x = p.x.data();
  a.x_stride = p.x_stride;
  a.T = T;
  std::vector<float> out(size_t(T) * c.heads * p.out_stride, -12345.0f);
  a.out = out.data();
  a.out_stride = p.out_stride;
  a.tables = test_q8::host_tables();
  const size_t smem = hq_layout(a.row_bytes, a.rows_per_block, c.cols, T, U).total;
  EXPECT_LE(smem, kHqMaxSmem);  // (head_q8_fits refuses larger)
  const dim3 grid(unsigned((c.rows + a.rows_per_block - 1) / a.rows_per_block), unsigned(c.heads));
  const int nt = hq_tokens_per_pass(T);
  const auto kernel = nt == 1 ? head_q8_kernel<V, 1> : nt == 2 ? head_q8_kernel<V, 2> : head_q8_kernel<V, kHqPass>;
  emu::launch(kernel, grid, dim3(kHqThreads), smem, order, a);
  return out;
}

// The largest error of out against W_h x_hat[t][h], per row relative to its sum of |w x|.
double max_error(const Problem& p, const std::vector<float>& out, int T) {
  const Case& c = p.c;
  const uint64_t rb = gguf::row_bytes(p.type, uint64_t(c.cols));
  std::vector<float> w(size_t(c.heads) * c.rows * c.cols);
  for (int64_t r = 0; r < int64_t(c.heads) * c.rows; ++r)
    gguf::dequantize_row(p.type, p.w.data() + r * rb, w.data() + r * c.cols, c.cols);
  double worst = 0;
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < c.heads; ++h) {
      const float* xs = p.x.data() + (size_t(t) * c.heads + h) * p.x_stride;
      const std::vector<double> xh =
          test_q8::dequantized(test_q8::quantize_on_host(std::vector<float>(xs, xs + c.cols), 2));
      for (int r = 0; r < c.rows; ++r) {
        const float* wr = w.data() + (size_t(h) * c.rows + r) * c.cols;
        double ref = 0, norm = 0;
        for (int k = 0; k < c.cols; ++k) {
          ref += double(wr[k]) * xh[size_t(k)];
          norm += std::fabs(double(wr[k]) * xh[size_t(k)]);
        }
        const double got = out[(size_t(t) * c.heads + h) * p.out_stride + r];
        worst = std::max(worst, std::fabs(got - ref) / std::max(norm, 1e-30));
      }
    }
  return worst;
}

template <class V>
void check_type(GgmlType type, const std::vector<Case>& cases) {
  uint32_t seed = 90 + uint32_t(type);
  for (const Case& c : cases) {
    const std::string what = fmt::format("{} {} heads {}x{}, {} tokens", gguf::type_name(type), c.heads, c.rows,
                                         c.cols, c.T);
    SCOPED_TRACE(what);
    const Problem p = make_problem(type, c, seed += 2);
    const std::vector<float> out = run_kernel<V>(p, c.T, emu::Order::kForward);
    const double e = max_error(p, out, c.T);
    EXPECT_LE(e, 1e-6);
    // No race between the block's threads: the same bits when they run in the opposite order.
    EXPECT_EQ(run_kernel<V>(p, c.T, emu::Order::kReversed), out) << "results depend on the order of the threads";
    // Batch invariance: the first token alone gives the bits it gave in the batch.
    if (c.T > 1) {
      const std::vector<float> one = run_kernel<V>(p, 1, emu::Order::kForward);
      for (int h = 0; h < c.heads; ++h)
        for (int r = 0; r < c.rows; ++r)
          ASSERT_EQ(one[size_t(h) * p.out_stride + r], out[size_t(h) * p.out_stride + r])
              << "token 0, head " << h << ", row " << r << ": differs between 1 and " << c.T << " tokens";
    }
    std::printf("  %s: max error %.2e\n", what.c_str(), e);
  }
}

// The GPU test's shapes with fewer heads (GLM-5's W_UK 512 x 192 and W_UV 256 x 512, DeepSeek-V3.2's
// 512 x 128; one, two and four tokens per pass; rows that leave the last block short), each head's
// rows a whole number of 16-byte pieces (head_q8_supported).
const std::vector<Case> kQ8Cases = {{2, 512, 192, 1}, {2, 256, 512, 2}, {3, 512, 192, 5}, {2, 256, 512, 16},
                                    {2, 512, 128, 3}, {5, 40, 32, 1},   {3, 520, 32, 2},  {3, 40, 96, 7}};
const std::vector<Case> kKCases = {{2, 256, 512, 1}, {2, 256, 512, 16}, {5, 40, 256, 2}, {2, 104, 768, 3}};

TEST(AbsorptionKernelOnTheHost, Q8_0) { check_type<q8units::Q80Unit>(GgmlType::Q8_0, kQ8Cases); }
TEST(AbsorptionKernelOnTheHost, Q4_K) { check_type<q8units::Q4KUnit>(GgmlType::Q4_K, kKCases); }
TEST(AbsorptionKernelOnTheHost, Q5_K) { check_type<q8units::Q5KUnit>(GgmlType::Q5_K, kKCases); }
TEST(AbsorptionKernelOnTheHost, Q6_K) { check_type<q8units::Q6KUnit>(GgmlType::Q6_K, kKCases); }
TEST(AbsorptionKernelOnTheHost, Q2_K) { check_type<q8units::Q2KUnit>(GgmlType::Q2_K, kKCases); }
TEST(AbsorptionKernelOnTheHost, Q3_K) { check_type<q8units::Q3KUnit>(GgmlType::Q3_K, kKCases); }
TEST(AbsorptionKernelOnTheHost, IQ4_XS) { check_type<q8units::IQ4XSUnit>(GgmlType::IQ4_XS, kKCases); }
TEST(AbsorptionKernelOnTheHost, IQ2_XXS) { check_type<q8units::IQ2XXSUnit>(GgmlType::IQ2_XXS, kKCases); }

}  // namespace
}  // namespace sparsemla::cuda
