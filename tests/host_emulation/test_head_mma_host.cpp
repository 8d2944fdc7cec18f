// The absorption products' tensor-core kernel (src/ops/cuda/head_mma_kernel.cuh: bf16 W_UK / W_UV
// rows read as stored, decode batches of up to 16 tokens on mma.sync) run by the host emulation
// (cuda/emu.h, mma.sync m16n8k16 stood in for): its fragment loads (each lane's 16 bytes of rows g
// and g + 8, the chunk's two k-steps in the permuted column order), the staged tokens' padded rows,
// the rows past a head's end and the tokens past T are checked in CI, where there is no GPU;
// CudaAttention.AbsorptionTensorCoreKernelMatchesTheCpu runs it on one.
//
// Reference: per (token, head, row), the bf16 row times the activations rounded to bf16, in double.
// Only fp32 rounding differs (the stand-in adds each mma's products exactly and rounds once, so
// one rounding per k-step): error per row relative to its sum of |w x| <= 4e-6. Besides: the same
// results with the block's threads run in the opposite order; each token's results the same bits
// at every batch size (a C element depends on its row and token only); nothing written past a
// head's rows or past T tokens.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "../unit/quant_test_util.h"
#include "ops/cuda/head_mma_kernel.cuh"

namespace sparsemla::cuda {
namespace {

using namespace headmma;

constexpr float kUnwritten = -12345.0f;

struct Case {
  int heads, rows, cols, T;
};

struct Problem {
  Case c;
  std::vector<__nv_bfloat16> w;  // [heads][rows][cols]
  std::vector<float> x;          // [T][heads][x_stride]
  int x_stride, out_stride;
};

Problem make_problem(const Case& c, uint32_t seed) {
  Problem p{c, {}, test::randn(size_t(c.T) * c.heads * (c.cols + 24), seed + 1), c.cols + 24, c.rows + 5};
  const std::vector<float> w = test::randn(size_t(c.heads) * c.rows * c.cols, seed);
  p.w.reserve(w.size());
  for (float v : w) p.w.push_back(__float2bfloat16(v));
  return p;
}

// Runs head_mma_kernel as absorb.cu launches it, over the first T tokens of p.
std::vector<float> run_kernel(const Problem& p, int T, emu::Order order) {
  const Case& c = p.c;
  EXPECT_TRUE(hm_takes(c.cols, T, p.w.data()));
  HeadMmaArgs a;
  a.w = p.w.data();
  a.heads = c.heads;
  a.rows = c.rows;
  a.cols = c.cols;
  a.x = p.x.data();
  a.x_stride = p.x_stride;
  a.T = T;
  std::vector<float> out(size_t(T) * c.heads * p.out_stride, kUnwritten);
  a.out = out.data();
  a.out_stride = p.out_stride;
  const HmLaunch l = hm_launch(c.heads, c.rows, c.cols, T);
  emu::launch(l.kernel, l.grid, dim3(kHmWarps * 32), l.smem, order, a);
  return out;
}

// The largest error of out against W_h bf16(x[t][h]), per row relative to its sum of |w x|; and
// that nothing past a head's rows was written.
double max_error(const Problem& p, const std::vector<float>& out, int T) {
  const Case& c = p.c;
  double worst = 0;
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < c.heads; ++h) {
      const float* xs = p.x.data() + (size_t(t) * c.heads + h) * p.x_stride;
      const float* o = out.data() + (size_t(t) * c.heads + h) * p.out_stride;
      for (int r = 0; r < c.rows; ++r) {
        const __nv_bfloat16* wr = p.w.data() + (size_t(h) * c.rows + r) * c.cols;
        double ref = 0, norm = 0;
        for (int k = 0; k < c.cols; ++k) {
          const double v = double(__bfloat162float(wr[k])) * double(__bfloat162float(__float2bfloat16(xs[k])));
          ref += v;
          norm += std::fabs(v);
        }
        worst = std::max(worst, std::fabs(double(o[r]) - ref) / std::max(norm, 1e-30));
      }
      for (int r = c.rows; r < p.out_stride; ++r)
        EXPECT_EQ(o[r], kUnwritten) << "token " << t << ", head " << h << ": written past the rows at " << r;
    }
  return worst;
}

// GLM-5's W_UK (512 x 192) and W_UV (256 x 512), DeepSeek-V3.2's W_UK (512 x 128) with fewer
// heads, at one and two n-tiles; rows that leave a warp's 16 and a block's 64 short; a single chunk.
const std::vector<Case> kCases = {{2, 512, 192, 1}, {2, 256, 512, 8},  {2, 256, 512, 16}, {3, 512, 128, 3},
                                  {3, 40, 32, 9},   {2, 72, 96, 5},    {1, 16, 64, 16},   {2, 200, 160, 12},
                                  {2, 48, 576, 4}};

TEST(AbsorptionTensorCoreKernelOnTheHost, MatchesDoubleSums) {
  uint32_t seed = 700;
  for (const Case& c : kCases) {
    const std::string what = fmt::format("{} heads {}x{}, {} tokens", c.heads, c.rows, c.cols, c.T);
    SCOPED_TRACE(what);
    const Problem p = make_problem(c, seed += 2);
    const std::vector<float> out = run_kernel(p, c.T, emu::Order::kForward);
    const double e = max_error(p, out, c.T);
    EXPECT_LE(e, 4e-6);
    EXPECT_EQ(run_kernel(p, c.T, emu::Order::kReversed), out) << "results depend on the order of the threads";
    if (c.T > 1) {  // the first token alone gives the bits it gave in the batch
      const std::vector<float> one = run_kernel(p, 1, emu::Order::kForward);
      for (int h = 0; h < c.heads; ++h)
        for (int r = 0; r < c.rows; ++r)
          ASSERT_EQ(one[size_t(h) * p.out_stride + r], out[size_t(h) * p.out_stride + r])
              << "token 0, head " << h << ", row " << r << ": differs between 1 and " << c.T << " tokens";
    }
    std::printf("  %s: max error %.2e\n", what.c_str(), e);
  }
}

// The shapes the kernel refuses (absorb.cu then takes the GEMV or cuBLAS): columns not whole
// 32-column chunks, more than 16 tokens, a base not 16-byte aligned.
TEST(AbsorptionTensorCoreKernelOnTheHost, RefusesWhatItDoesNotTake) {
  alignas(16) static const __nv_bfloat16 w[64] = {};
  EXPECT_TRUE(hm_takes(192, 16, w));
  EXPECT_FALSE(hm_takes(48, 1, w));
  EXPECT_FALSE(hm_takes(192, 17, w));
  EXPECT_FALSE(hm_takes(192, 0, w));
  EXPECT_FALSE(hm_takes(192, 1, w + 1));
}

}  // namespace
}  // namespace sparsemla::cuda
