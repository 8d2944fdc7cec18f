// The absorption products' head-batched GEMV (src/ops/cuda/head_gemv_kernel.cuh: bf16 / f16 W_UK and
// W_UV rows read as stored, decode batches of up to 16 tokens) run by the host emulation (cuda/emu.h)
// as absorb.cu launches it, with and without the query's rope in its launch (cuda::HeadRope,
// GpuModelOptions::rope_in_wuk): the row and column counts of GLM-5's and DeepSeek-V3.2's W_UK and
// of W_UV, and odd ones, on a few heads; one token (the model's case, with the rope in both styles at
// positions up to 150K), two and five (no rope: Blas::takes_rope asks for one token). So the
// kernel's loads, staging, row split and the rope's place in its launch are checked in CI, where
// there is no GPU; CudaAttention.AbsorptionProductsMatchTheCpu and
// AbsorptionProductDoesTheQueryRopeInItsLaunch run it on one.
//
// References: each product row, the stored row times the activations rounded to bf16 in double,
// error relative to the row's sum of |w x| <= 1e-6 (fp32 sums of 8-term chunks); the rotated part bit
// for bit as rope_kernel (the unfused launch) computes it (rope.cuh's angle and rotation, called here
// on the host), and within 1e-6 of the CPU's ops::Rope::apply; the product's bits the same with the
// rope and without it; without it, nothing written past a head's product rows; the same bits with
// the block's threads run in reverse.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../unit/quant_test_util.h"
#include "../unit/rope_test_util.h"
#include "model/hparams.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/head_gemv_kernel.cuh"
#include "util/half.h"

namespace sparsemla::cuda {
namespace {

using namespace headgemv;

constexpr float kUnwritten = -12345.0f;

// Runs head_gemv_kernel as absorb.cu's launch_head_gemv does: w [heads][rows][cols] 16-bit rows, x
// [T][heads][x_stride], out [T][heads][out_stride].
template <class WR>
void run_gemv(const uint16_t* w, int heads, int rows, int cols, const float* x, int64_t x_stride, int T, float* out,
              int64_t out_stride, const HeadRope& rope, emu::Order order) {
  const auto* wb = reinterpret_cast<const uint8_t*>(w);
  const size_t smem = size_t(T) * cols * sizeof(float);
  auto go = [&](auto rpw) {
    constexpr int RPW = decltype(rpw)::value;
    const dim3 grid(unsigned((rows + kHgWarps * RPW - 1) / (kHgWarps * RPW)), unsigned(heads));
    const auto kernel = T == 1   ? (rope.out ? head_gemv_kernel<WR, 1, RPW, true> : head_gemv_kernel<WR, 1, RPW>)
                        : T == 2 ? head_gemv_kernel<WR, 2, RPW>
                                 : head_gemv_kernel<WR, 4, RPW>;
    emu::launch(kernel, grid, dim3(kHgWarps * 32), smem, order, wb, heads, rows, cols, x, x_stride, T, out,
                out_stride, rope);
  };
  if (cols <= 256) go(std::integral_constant<int, kHgShortRowsPerWarp>{});
  else go(std::integral_constant<int, kHgRowsPerWarp>{});
}

TEST(HeadGemvOnTheHost, ProductsMatchTheCpuWithAndWithoutTheQueryRope) {
  const ops::Rope rope = test::plain_rope(64, 1e4f);
  // (heads, product rows, columns: W_UK's kv_lora x qk_nope, W_UV's v x kv_lora)
  for (auto [heads, rows, cols] : std::vector<std::tuple<int, int, int>>{
           {8, 512, 192}, {4, 512, 128}, {2, 256, 512}, {3, 40, 16}})
    for (bool f16 : {false, true})
      for (int T : {1, 2, 5})
        for (ops::RopeStyle style : {ops::RopeStyle::HalfSplit, ops::RopeStyle::Interleaved}) {
          if (T > 1 && style == ops::RopeStyle::Interleaved) continue;
          const std::string what = std::to_string(heads) + " heads " + std::to_string(rows) + "x" +
                                   std::to_string(cols) + (f16 ? " f16" : " bf16") + ", " + std::to_string(T) +
                                   " tokens" + (style == ops::RopeStyle::Interleaved ? ", interleaved" : "");
          // q as the model holds it: [T][heads][cols + 64] (nope | rope); out: [T][heads][rows + 64].
          const int64_t x_stride = cols + 64, out_stride = rows + 64;
          const std::vector<float> wf = test::randn(size_t(heads) * rows * cols, uint32_t(heads + rows + cols), 0.05f);
          std::vector<uint16_t> w(wf.size());
          std::vector<double> wd(wf.size());
          for (size_t i = 0; i < wf.size(); ++i) {
            w[i] = f16 ? ::sparsemla::f32_to_fp16(wf[i]) : ::sparsemla::f32_to_bf16(wf[i]);
            wd[i] = f16 ? ::sparsemla::fp16_to_f32(w[i]) : ::sparsemla::bf16_to_f32(w[i]);
          }
          const std::vector<float> x = test::randn(size_t(T) * heads * x_stride, uint32_t(T * 7 + cols));
          std::mt19937 rng(uint32_t(rows + T));
          std::vector<int64_t> pos(static_cast<size_t>(T));
          for (auto& p : pos) p = int64_t(rng() % 150000);
          const RopeTable table{rope.inv_freq().data(), 32, rope.attn_factor(), style == ops::RopeStyle::Interleaved};
          const size_t n_out = size_t(T) * heads * out_stride;

          auto run = [&](bool with_rope, emu::Order order) {
            std::vector<float> out(n_out, kUnwritten);
            HeadRope hr;
            if (with_rope && T == 1)
              hr = HeadRope{x.data() + cols, x_stride, out.data() + rows, out_stride, pos.data(), table};
            if (f16)
              run_gemv<F16Row>(w.data(), heads, rows, cols, x.data(), x_stride, T, out.data(), out_stride, hr, order);
            else
              run_gemv<Bf16Row>(w.data(), heads, rows, cols, x.data(), x_stride, T, out.data(), out_stride, hr, order);
            return out;
          };
          const std::vector<float> fused = run(true, emu::Order::kForward), plain = run(false, emu::Order::kForward);
          ASSERT_EQ(fused, run(true, emu::Order::kReversed)) << what << ": depends on the order of the block's threads";

          // The rotation as the unfused launch (rope_kernel) computes it: rope.cuh's angle and rotation.
          std::vector<float> unfused(n_out, kUnwritten);
          for (int t = 0; t < T; ++t)
            for (int h = 0; h < heads; ++h)
              for (int64_t i = 0; i < table.half; ++i) {
                const RopeAngle ang = rope_angle(table, float(pos[size_t(t)]), i);
                const int64_t ia = rope_a(table, i), ib = rope_b(table, i);
                const float* row = x.data() + (size_t(t) * heads + h) * size_t(x_stride) + cols;
                float x0 = row[ia], x1 = row[ib];
                rope_rotate(ang, &x0, &x1);
                float* orow = unfused.data() + (size_t(t) * heads + h) * size_t(out_stride) + rows;
                orow[ia] = x0;
                orow[ib] = x1;
              }
          double worst = 0;
          for (int t = 0; t < T; ++t)
            for (int h = 0; h < heads; ++h) {
              const size_t o = (size_t(t) * heads + h) * size_t(out_stride);
              const float* xh = x.data() + (size_t(t) * heads + h) * size_t(x_stride);
              for (int r = 0; r < rows; ++r) {
                double acc = 0, mag = 0;
                for (int c = 0; c < cols; ++c) {
                  const double xr = ::sparsemla::bf16_to_f32(::sparsemla::f32_to_bf16(xh[c]));
                  const double term = wd[(size_t(h) * rows + r) * cols + c] * xr;
                  acc += term;
                  mag += std::fabs(term);
                }
                worst = std::max(worst, std::fabs(fused[o + r] - acc) / std::max(mag, 1e-30));
                ASSERT_EQ(std::memcmp(&fused[o + r], &plain[o + r], 4), 0) << what << ": the rope moved the product";
              }
              std::vector<float> want(xh + cols, xh + cols + 64);
              rope.apply(want.data(), pos[size_t(t)], style);
              for (int c = 0; c < 64; ++c) {
                ASSERT_EQ(plain[o + rows + c], kUnwritten) << what << ": written past the product rows";
                if (T > 1) continue;  // (the rope is done in one-token launches only: Blas::takes_rope)
                ASSERT_EQ(std::memcmp(&fused[o + rows + c], &unfused[o + rows + c], 4), 0)
                    << what << ": token " << t << " head " << h << " rope value " << c << " not the rope kernel's";
                ASSERT_NEAR(fused[o + rows + c], want[size_t(c)], 1e-6 * (1.0 + std::fabs(want[size_t(c)]))) << what;
              }
            }
          EXPECT_LE(worst, 1e-6) << what;
        }
}

}  // namespace
}  // namespace sparsemla::cuda
