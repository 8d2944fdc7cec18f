// The small operations (src/ops/cuda/small_ops_kernels.cuh) and the MoE router
// (moe_router_kernels.cuh) run by the host emulation (cuda/emu.h) with the launch shapes of
// small_ops.cu and moe_router.cu, so that their block reductions, warp argmax rounds, in-place
// rows and the grouping's counting sort are checked in CI, where there is no GPU;
// tests/unit/test_cuda_small_ops.cpp runs them on one.
//
// References and tolerances are those of the GPU test (the CPU's ops::rms_norm, layer_norm, rope,
// silu_mul, softmax, model::route and a plain counting sort; the int8 activations against
// quantize_on_host bit for bit), with the host's expf / sinf / cosf standing in for CUDA's. Every
// launch runs in both thread orders and must give the same bits (no race between the block's
// threads), and the bitwise promises hold: the residual sum is one fp32 add, a row's norm is the same
// alone and in a batch and through the cached and looping kernels' paths, int32 and int64 positions
// rotate alike, the rope into another array gives the in-place bits.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "../unit/quant_test_util.h"
#include "../unit/router_cases.h"
#include "../unit/test_util.h"
#include "model/blocks/ffn.h"
#include "model/hparams.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/moe_router_kernels.cuh"
#include "ops/cuda/small_ops_kernels.cuh"
#include "util/half.h"

namespace sparsemla::cuda {
namespace {

using test::randn;

// Runs go(order) in both thread orders (each from the same inputs, which go sets up) and checks
// that the outputs it returns agree bit for bit; returns them.
template <class T>
std::vector<T> both_orders(const std::function<std::vector<T>(emu::Order)>& go, const std::string& what) {
  const std::vector<T> reversed = go(emu::Order::kReversed);
  const std::vector<T> forward = go(emu::Order::kForward);
  EXPECT_EQ(0, std::memcmp(reversed.data(), forward.data(), reversed.size() * sizeof(T)))
      << what << ": depends on the order of the block's threads";
  return forward;
}

// |got - want| <= rel |want| + abs, NaN and inf in the same places; returns the largest relative error.
double expect_close(const std::vector<float>& got, const std::vector<float>& want, double rel, double abs,
                    const std::string& what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  int misses = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const bool same_class = std::isnan(got[i]) == std::isnan(want[i]) && std::isinf(got[i]) == std::isinf(want[i]);
    const double err = std::fabs(double(got[i]) - want[i]);
    if (std::isfinite(want[i])) worst = std::max(worst, err / std::max(std::fabs(double(want[i])), 1e-30));
    const bool far = std::isfinite(want[i]) && err > rel * std::fabs(want[i]) + abs;
    if ((!same_class || far || (std::isinf(want[i]) && got[i] != want[i])) && misses++ < 5)
      ADD_FAILURE() << what << " [" << i << "]: got " << got[i] << ", want " << want[i];
  }
  return worst;
}

// The row lengths: the models' 6144, a warp's rows, and 9000 (past the 8192 that 512 threads hold
// in registers: the looping path).
const std::vector<int64_t> kRowLengths = {1, 7, 64, 300, 6144, 9000};
const std::vector<int64_t> kTokenCounts = {1, 3, 17};

// ---- norms ----

// rms_norm_kernel as small_ops.cu launches it (one block of row_threads(n) per row), in place or not.
std::vector<float> rms_rows(const std::vector<float>& x, int64_t x_stride, const std::vector<float>& w, int64_t T,
                            int64_t n, float eps, bool in_place, int64_t out_stride, emu::Order order) {
  std::vector<float> buf(x), out(size_t(T * out_stride), -7.0f);
  float* o = in_place ? buf.data() : out.data();
  emu::launch(smallops::rms_norm_kernel, dim3(unsigned(T)), dim3(unsigned(row_threads(n))), 0, order,
              static_cast<const float*>(buf.data()), x_stride, w.data(), n, eps, o, in_place ? x_stride : out_stride);
  return in_place ? buf : out;
}

TEST(SmallOpsOnTheHost, RmsNormMatchesCpu) {
  double worst = 0;
  for (int64_t n : kRowLengths)
    for (int64_t T : kTokenCounts) {
      const std::string what = "rms_norm n=" + std::to_string(n) + " T=" + std::to_string(T);
      const auto x = randn(size_t(T * n), uint32_t(n * 7 + T), 2.0f, 0.5f), w = randn(size_t(n), uint32_t(n + 1));
      std::vector<float> want(x.size());
      for (int64_t t = 0; t < T; ++t) ops::rms_norm(x.data() + t * n, w.data(), n, 1e-6f, want.data() + t * n);
      const auto got = both_orders<float>(
          [&](emu::Order o) { return rms_rows(x, n, w, T, n, 1e-6f, false, n, o); }, what);
      worst = std::max(worst, expect_close(got, want, 2e-6, 1e-7, what));
      // Batch invariance: row 0 as it is alone.
      const auto alone = rms_rows(x, n, w, 1, n, 1e-6f, false, n, emu::Order::kForward);
      EXPECT_EQ(0, std::memcmp(alone.data(), got.data(), size_t(n) * 4)) << what << ": row 0 differs from it alone";
      // In place, inside wider rows (the latent c of [c | k_pe]): the rest of each row untouched.
      const int64_t stride = n + 5;
      const auto wide = randn(size_t(T * stride), uint32_t(n + T + 3));
      std::vector<float> wide_want(wide);
      for (int64_t t = 0; t < T; ++t)
        ops::rms_norm(wide.data() + t * stride, w.data(), n, 1e-6f, wide_want.data() + t * stride);
      const auto in_place = both_orders<float>(
          [&](emu::Order o) { return rms_rows(wide, stride, w, T, n, 1e-6f, true, stride, o); }, what + " in place");
      expect_close(in_place, wide_want, 2e-6, 1e-7, what + " in place, strided");
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = n; i < stride; ++i)
          ASSERT_EQ(in_place[size_t(t * stride + i)], wide[size_t(t * stride + i)]) << what << " in place";
    }
  std::printf("rms_norm: largest relative error %.3g\n", worst);
}

TEST(SmallOpsOnTheHost, AddRmsNormUpdatesResidualThenNorms) {
  double worst = 0;
  for (int64_t n : kRowLengths)
    for (int64_t T : kTokenCounts) {
      const std::string what = "add_rms_norm n=" + std::to_string(n) + " T=" + std::to_string(T);
      const auto h = randn(size_t(T * n), uint32_t(n * 3 + T)), d = randn(size_t(T * n), uint32_t(n * 5 + T), 0.3f);
      const auto w = randn(size_t(n), uint32_t(n + 2));
      std::vector<float> h_want(h), out_want(h.size());
      for (size_t i = 0; i < h.size(); ++i) h_want[i] += d[i];
      for (int64_t t = 0; t < T; ++t) ops::rms_norm(h_want.data() + t * n, w.data(), n, 1e-5f, out_want.data() + t * n);
      std::vector<float> h_got;
      const auto out = both_orders<float>(
          [&](emu::Order o) {
            std::vector<float> hh(h), oo(h.size(), -7.0f);
            emu::launch(smallops::add_rms_norm_kernel, dim3(unsigned(T)), dim3(unsigned(row_threads(n))), 0, o,
                        hh.data(), d.data(), w.data(), n, 1e-5f, oo.data());
            h_got = hh;
            return oo;
          },
          what);
      EXPECT_EQ(h_got, h_want) << what << ": the residual sum is one fp32 add";
      worst = std::max(worst, expect_close(out, out_want, 2e-6, 1e-7, what));
      // The same bits as rms_norm on the updated residual.
      const auto plain = rms_rows(h_want, n, w, T, n, 1e-5f, false, n, emu::Order::kForward);
      EXPECT_EQ(0, std::memcmp(plain.data(), out.data(), out.size() * 4)) << what << ": differs from rms_norm";
    }
  std::printf("add_rms_norm: largest relative error %.3g\n", worst);
}

TEST(SmallOpsOnTheHost, LayerNormMatchesCpuWithAndWithoutBias) {
  double worst = 0;
  for (int64_t n : kRowLengths)
    for (int64_t T : kTokenCounts)
      for (bool with_bias : {false, true}) {
        const std::string what = "layer_norm n=" + std::to_string(n) + " T=" + std::to_string(T) +
                                 (with_bias ? " bias" : "");
        const auto x = randn(size_t(T * n), uint32_t(n * 11 + T), 3.0f, 2.0f);
        const auto w = randn(size_t(n), uint32_t(n + 4)), b = randn(size_t(n), uint32_t(n + 5));
        std::vector<float> want(x.size());
        for (int64_t t = 0; t < T; ++t)
          ops::layer_norm(x.data() + t * n, w.data(), with_bias ? b.data() : nullptr, n, 1e-6f, want.data() + t * n);
        const auto got = both_orders<float>(
            [&](emu::Order o) {
              std::vector<float> out(x.size(), -7.0f);
              emu::launch(smallops::layer_norm_kernel, dim3(unsigned(T)), dim3(unsigned(row_threads(n))), 0, o,
                          x.data(), w.data(), with_bias ? b.data() : static_cast<const float*>(nullptr), n, 1e-6f,
                          out.data());
              return out;
            },
            what);
        for (size_t i = 0; i < got.size(); ++i) {
          const double err = std::fabs(double(got[i]) - want[i]);
          const double tol = 5e-6 * (std::fabs(want[i]) + std::fabs(w[i % size_t(n)])) + 1e-7;
          worst = std::max(worst, err / (std::fabs(want[i]) + std::fabs(w[i % size_t(n)]) + 1e-30));
          ASSERT_LE(err, tol) << what << " at " << i;
        }
      }
  std::printf("layer_norm: largest error relative to |out| + |w| %.3g\n", worst);
}

// ---- RoPE ----

model::HParams rope_params(float theta, int dims) {
  model::HParams hp;
  hp.qk_rope = uint32_t(dims);
  hp.rope_theta = theta;
  return hp;
}

// GLM-5's (theta 1e6, no scaling) and DeepSeek-V3.2's (theta 1e4, YaRN factor 40 over 4096) tables.
std::vector<std::pair<std::string, ops::Rope>> ropes() {
  model::HParams yarn = rope_params(10000.0f, 64);
  yarn.rope_scaling = model::RopeScaling::Yarn;
  yarn.rope_factor = 40.0f;
  yarn.rope_orig_ctx = 4096;
  yarn.yarn_beta_fast = 32.0f;
  yarn.yarn_beta_slow = 1.0f;
  return {{"plain", ops::Rope(rope_params(1e6f, 64))},
          {"yarn", ops::Rope(yarn)},
          {"small", ops::Rope(rope_params(1e4f, 8))}};
}

// rope_kernel as launch_rope (small_ops.cu) runs it: x and out may be the same array.
template <class Pos>
void run_rope(const float* x, int64_t x_stride, float* out, int64_t out_stride, int64_t width, int64_t T,
              int64_t heads, const Pos* pos, const RopeTable& r, emu::Order order) {
  emu::launch(smallops::rope_kernel<Pos>, smallops::rope_grid(T, heads), smallops::rope_block(), 0, order, x, x_stride,
              out, out_stride, width, heads, pos, r);
}

TEST(SmallOpsOnTheHost, RopeMatchesCpuBothStylesBothPositionTypes) {
  double worst = 0;
  for (const auto& [name, rope] : ropes()) {
    const int64_t d = rope.dims();
    for (int64_t T : {1, 3})
      for (int64_t heads : {1, 3, 64})
        for (ops::RopeStyle style : {ops::RopeStyle::Interleaved, ops::RopeStyle::HalfSplit}) {
          const RopeTable table{rope.inv_freq().data(), d / 2, rope.attn_factor(),
                                style == ops::RopeStyle::Interleaved};
          // Heads of [nope | rope] (q), the rotated part at offset nope; positions up to 200k.
          const int64_t nope = 16, stride = nope + d;
          const auto x = randn(size_t(T * heads * stride), uint32_t(T * 31 + heads));
          std::mt19937 rng(uint32_t(T + heads));
          std::vector<int64_t> pos(static_cast<size_t>(T));
          for (auto& p : pos) p = int64_t(rng() % 200000);
          if (T > 1) pos[0] = 0;
          const std::vector<int32_t> pos32(pos.begin(), pos.end());
          std::vector<float> want(x);
          for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < heads; ++h)
              rope.apply(want.data() + (t * heads + h) * stride + nope, pos[size_t(t)], style);
          const std::string what = "rope " + name + " T=" + std::to_string(T) + " heads=" + std::to_string(heads) +
                                   (style == ops::RopeStyle::Interleaved ? " interleaved" : " half-split");
          const auto got = both_orders<float>(
              [&](emu::Order o) {
                std::vector<float> b(x);
                run_rope(b.data() + nope, stride, b.data() + nope, stride, d, T, heads, pos.data(), table, o);
                return b;
              },
              what);
          for (size_t i = 0; i < x.size(); ++i) {
            const int64_t in_head = int64_t(i) % stride;
            if (in_head < nope) {
              ASSERT_EQ(got[i], x[i]) << what << ": a value outside the rotary dims changed at " << i;
              continue;
            }
            const size_t head0 = i - size_t(in_head) + size_t(nope);
            double pair_norm = 0;
            for (int64_t j = 0; j < d; ++j) pair_norm = std::max(pair_norm, double(std::fabs(x[head0 + size_t(j)])));
            worst = std::max(worst, std::fabs(double(got[i]) - want[i]) / pair_norm);
            ASSERT_NEAR(got[i], want[i], 1e-6 * pair_norm + 1e-7) << what << " at " << i;
          }
          std::vector<float> b32(x);
          run_rope(b32.data() + nope, stride, b32.data() + nope, stride, d, T, heads, pos32.data(), table,
                   emu::Order::kForward);
          EXPECT_EQ(b32, got) << what << ": int32 positions differ from int64";

          // Into a wider row (apply_to): the rotated part of each head moved to offset `lead` of a
          // wider destination row, the bits of the in-place rope; the rest of the row untouched.
          const int64_t lead = 5, width = d, dst_stride = lead + width + 3;
          const auto dst0 = randn(size_t(T * heads * dst_stride), uint32_t(T + heads + 99));
          const auto moved = both_orders<float>(
              [&](emu::Order o) {
                std::vector<float> dst(dst0);
                run_rope(x.data() + nope, stride, dst.data() + lead, dst_stride, width, T, heads, pos.data(), table, o);
                return dst;
              },
              what + " into another array");
          for (int64_t th = 0; th < T * heads; ++th)
            for (int64_t c = 0; c < dst_stride; ++c) {
              const size_t i = size_t(th * dst_stride + c);
              if (c < lead || c >= lead + width) ASSERT_EQ(moved[i], dst0[i]) << what << ": untouched value at " << i;
              else ASSERT_EQ(moved[i], got[size_t(th * stride + nope + c - lead)]) << what << ": differs from in place";
            }
        }
  }
  // apply_to with a tail past the rotary dims: those values copied.
  {
    const ops::Rope rope = ropes()[0].second;
    const int64_t d = rope.dims(), T = 2, heads = 3, width = d + 16, stride = width + 4;
    const RopeTable table{rope.inv_freq().data(), d / 2, rope.attn_factor(), false};
    const auto x = randn(size_t(T * heads * stride), 1234);
    const std::vector<int64_t> pos = {7, 150000};
    const auto out = both_orders<float>(
        [&](emu::Order o) {
          std::vector<float> dst(size_t(T * heads * width), -7.0f);
          run_rope(x.data(), stride, dst.data(), width, width, T, heads, pos.data(), table, o);
          return dst;
        },
        "rope into another array with a tail");
    for (int64_t th = 0; th < T * heads; ++th) {
      std::vector<float> want(x.begin() + th * stride, x.begin() + th * stride + width);
      rope.apply(want.data(), pos[size_t(th / heads)], ops::RopeStyle::HalfSplit);
      for (int64_t c = 0; c < width; ++c) {
        const float g = out[size_t(th * width + c)];
        if (c >= d) ASSERT_EQ(g, want[size_t(c)]) << "copied value " << c;
        else ASSERT_NEAR(g, want[size_t(c)], 1e-5) << "rotated value " << c;
      }
    }
  }
  std::printf("rope: largest error relative to the head's largest |x| %.3g\n", worst);
}

// ---- elementwise ----

TEST(SmallOpsOnTheHost, SiluMulPlainAndFusedMatchCpu) {
  double worst = 0;
  for (int64_t F : {1, 7, 64, 6144})
    for (int64_t T : {1, 3, 17}) {
      const auto gate = randn(size_t(T * F), uint32_t(F * 13 + T), 3.0f, 0.0f);
      const auto up = randn(size_t(T * F), uint32_t(F * 17 + T));
      std::vector<float> want(gate);
      ops::silu_mul(want.data(), up.data(), T * F);
      const int64_t n = T * F;
      const auto got = both_orders<float>(
          [&](emu::Order o) {
            std::vector<float> g(gate);
            emu::launch(smallops::silu_mul_kernel, dim3(unsigned(smallops::elementwise_blocks(n))),
                        dim3(smallops::kElementwiseThreads), 0, o, g.data(), up.data(), n);
            return g;
          },
          "silu_mul");
      worst = std::max(worst, expect_close(got, want, 1e-6, 1e-30, "silu_mul F=" + std::to_string(F)));
      std::vector<float> gate_up(size_t(T * 2 * F));
      for (int64_t t = 0; t < T; ++t) {
        std::copy_n(gate.data() + t * F, F, gate_up.data() + t * 2 * F);
        std::copy_n(up.data() + t * F, F, gate_up.data() + t * 2 * F + F);
      }
      const auto fused = both_orders<float>(
          [&](emu::Order o) {
            std::vector<float> out(size_t(n), -7.0f);
            emu::launch(smallops::silu_mul_fused_kernel, dim3(unsigned(smallops::elementwise_blocks(n))),
                        dim3(smallops::kElementwiseThreads), 0, o, gate_up.data(), T, F, out.data());
            return out;
          },
          "silu_mul_fused");
      EXPECT_EQ(fused, got) << "silu_mul_fused F=" << F << ": differs from silu_mul";
    }
  std::printf("silu_mul: largest relative error %.3g\n", worst);
}

// SiLU x up with int8 output: the values of silu_mul_kernel, the int8 activations the host rule's bits.
TEST(SmallOpsOnTheHost, SiluMulWithInt8OutputQuantizesAsTheHostRule) {
  for (const auto& [T, F] : {std::pair<int64_t, int64_t>{1, 2048}, {9, 2048}, {3, 96}, {2, 12288}})
    for (int levels : {1, 2}) {
      const std::string what =
          std::to_string(T) + " x " + std::to_string(F) + ", " + std::to_string(levels) + " level(s)";
      const int64_t n = T * F;
      const auto gate = randn(size_t(n), uint32_t(F + T), 3.0f), up = randn(size_t(n), uint32_t(F * 3 + T));
      std::vector<float> plain(gate);
      emu::launch(smallops::silu_mul_kernel, dim3(unsigned(smallops::elementwise_blocks(n))),
                  dim3(smallops::kElementwiseThreads), 0, emu::Order::kForward, plain.data(), up.data(), n);
      std::vector<int8_t> q, r;
      std::vector<int2> blocks;
      const auto values = both_orders<float>(
          [&](emu::Order o) {
            std::vector<float> g(gate);
            q.assign(size_t(n), int8_t(99));
            r.assign(levels == 2 ? size_t(n) : 0, int8_t(99));
            blocks.assign(size_t(n / 32), int2{-1, -1});
            Q8Out out;
            out.q = q.data();
            out.r = levels == 2 ? r.data() : nullptr;
            out.blocks = blocks.data();
            const unsigned grid = unsigned((n + smallops::kElementwiseThreads - 1) / smallops::kElementwiseThreads);
            if (levels == 2)
              emu::launch(smallops::silu_mul_q8_kernel<2>, dim3(grid), dim3(smallops::kElementwiseThreads), 0, o,
                          g.data(), up.data(), n, out);
            else
              emu::launch(smallops::silu_mul_q8_kernel<1>, dim3(grid), dim3(smallops::kElementwiseThreads), 0, o,
                          g.data(), up.data(), n, out);
            return g;
          },
          what);
      EXPECT_EQ(values, plain) << what << ": values";
      const test_q8::HostQ8 h = test_q8::quantize_on_host(plain, levels);
      EXPECT_EQ(q, h.q) << what << ": int8 values";
      if (levels == 2) EXPECT_EQ(r, h.r) << what << ": second level";
      for (size_t b = 0; b < h.d.size(); ++b) {
        ASSERT_EQ(blocks[b].x, __float_as_int(h.d[b])) << what << ": scale of block " << b;
        ASSERT_EQ(blocks[b].y, h.sum[b]) << what << ": sum of block " << b;
      }
    }
}

TEST(SmallOpsOnTheHost, AddAndScaleAreExact) {
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(6144), int64_t(70000)}) {
    const auto h = randn(size_t(n), uint32_t(n)), d = randn(size_t(n), uint32_t(n + 9));
    std::vector<float> sum(h), scaled(h);
    for (int64_t i = 0; i < n; ++i) {
      sum[size_t(i)] += d[size_t(i)];
      scaled[size_t(i)] *= 0.37f;
    }
    // (A grid of few blocks as well: the grid-stride loops take the rest.)
    for (unsigned grid : {unsigned(smallops::elementwise_blocks(n)), 3u}) {
      const auto got_sum = both_orders<float>(
          [&](emu::Order o) {
            std::vector<float> x(h);
            emu::launch(smallops::add_kernel, dim3(grid), dim3(smallops::kElementwiseThreads), 0, o, x.data(),
                        d.data(), n);
            return x;
          },
          "add");
      EXPECT_EQ(got_sum, sum) << n;
      const auto got_scaled = both_orders<float>(
          [&](emu::Order o) {
            std::vector<float> x(h);
            emu::launch(smallops::scale_kernel, dim3(grid), dim3(smallops::kElementwiseThreads), 0, o, x.data(),
                        0.37f, n);
            return x;
          },
          "scale");
      EXPECT_EQ(got_scaled, scaled) << n;
    }
  }
}

TEST(SmallOpsOnTheHost, SoftmaxRowsMatchesCpu) {
  double worst = 0;
  for (int64_t n : kRowLengths)
    for (int64_t T : kTokenCounts) {
      auto x = randn(size_t(T * n), uint32_t(n * 19 + T), 4.0f, 1.0f);
      if (n > 1) x[1] = -std::numeric_limits<float>::infinity();  // a masked entry
      std::vector<float> want(x);
      for (int64_t t = 0; t < T; ++t) ops::softmax(want.data() + t * n, n);
      const std::string what = "softmax n=" + std::to_string(n) + " T=" + std::to_string(T);
      const auto got = both_orders<float>(
          [&](emu::Order o) {
            std::vector<float> b(x);
            emu::launch(smallops::softmax_rows_kernel, dim3(unsigned(T)), dim3(unsigned(row_threads(n))), 0, o,
                        b.data(), n);
            return b;
          },
          what);
      worst = std::max(worst, expect_close(got, want, 5e-6, 1e-12, what));
    }
  std::printf("softmax: largest relative error %.3g\n", worst);
}

TEST(SmallOpsOnTheHost, Bf16ConversionsAreBitExact) {
  std::vector<float> x = randn(20000, 5, 100.0f);
  std::mt19937 rng(6);
  for (int i = 0; i < 20000; ++i) {  // raw bit patterns: ties, subnormals, NaNs with payloads
    uint32_t b = rng();
    if (i % 4 == 0) b = (b & 0xffff0000u) | 0x8000u;  // exactly half way
    float f;
    std::memcpy(&f, &b, 4);
    x.push_back(f);
  }
  for (float f : {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), 1.0f + 1.0f / 256.0f})
    x.push_back(f);
  const int64_t n = int64_t(x.size());
  std::vector<uint16_t> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = sparsemla::f32_to_bf16(x[i]);
  const auto got = both_orders<uint16_t>(
      [&](emu::Order o) {
        std::vector<uint16_t> b(x.size(), 0xdead);
        emu::launch(smallops::f32_to_bf16_kernel, dim3(unsigned(smallops::elementwise_blocks(n))),
                    dim3(smallops::kElementwiseThreads), 0, o, x.data(), b.data(), n);
        return b;
      },
      "f32_to_bf16");
  ASSERT_EQ(got, want);
  const auto back = both_orders<float>(
      [&](emu::Order o) {
        std::vector<float> f(x.size(), -7.0f);
        emu::launch(smallops::bf16_to_f32_kernel, dim3(unsigned(smallops::elementwise_blocks(n))),
                    dim3(smallops::kElementwiseThreads), 0, o, got.data(), f.data(), n);
        return f;
      },
      "bf16_to_f32");
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(__float_as_uint(back[i]), uint32_t(want[i]) << 16) << i;
}

// ---- router ----

// route_kernel as moe_route (moe_router.cu) launches it, in both orders; the ids and weights of T tokens.
std::pair<std::vector<int32_t>, std::vector<float>> run_route(const model::HParams& hp,
                                                              const std::vector<float>& logits,
                                                              const std::vector<float>& bias, int64_t T,
                                                              const std::string& what) {
  router::RouterShape sh{};
  sh.E = int(hp.n_expert);
  sh.k = int(hp.n_expert_used);
  sh.groups = int(std::max<uint32_t>(hp.n_expert_groups, 1));
  sh.groups_used = int(hp.n_group_used);
  sh.sigmoid = hp.expert_gating == 2;
  sh.norm = hp.expert_weights_norm;
  sh.scale = hp.expert_weights_scale;
  std::vector<int32_t> ids;
  const auto weights = both_orders<float>(
      [&](emu::Order o) {
        std::vector<int32_t> i(size_t(T * sh.k), -5);
        std::vector<float> w(size_t(T * sh.k), -7.0f);
        emu::launch(router::route_kernel, dim3(unsigned(T)), dim3(router::kRouterThreads),
                    router::route_smem_bytes(sh), o, sh, logits.data(), bias.data(), i.data(), w.data());
        if (!ids.empty()) EXPECT_EQ(ids, i) << what << ": ids depend on the order of the block's threads";
        ids = i;
        return w;
      },
      what);
  return {ids, weights};
}

// Each token against model::route(): the same experts (as a set), each with the CPU's weight.
double check_router(const model::HParams& hp, const std::vector<float>& logits, const std::vector<float>& bias,
                    int64_t T, const std::string& what) {
  const int64_t E = hp.n_expert, k = hp.n_expert_used;
  const auto [ids, weights] = run_route(hp, logits, bias, T, what);
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    const model::Routing r = model::route(hp, logits.data() + t * E, bias.data());
    std::map<int32_t, float> want, got;
    for (size_t i = 0; i < r.experts.size(); ++i) want[r.experts[i]] = r.weights[i];
    for (int64_t i = 0; i < k; ++i) got[ids[size_t(t * k + i)]] = weights[size_t(t * k + i)];
    EXPECT_EQ(got.size(), size_t(k)) << what << " token " << t << ": an expert chosen twice";
    for (const auto& [e, wgt] : want) {
      if (!got.count(e)) {
        ADD_FAILURE() << what << " token " << t << ": expert " << e << " not chosen";
        return worst;
      }
      worst = std::max(worst, std::fabs(double(got[e]) - wgt) / std::max(std::fabs(double(wgt)), 1e-30));
      EXPECT_NEAR(got[e], wgt, 1e-6 * std::fabs(wgt) + 1e-9) << what << " token " << t << " expert " << e;
    }
  }
  return worst;
}

TEST(RouterOnTheHost, MatchesCpuRouteOnRandomLogits) {
  double worst = 0;
  test::for_random_router_logits({1, 3, 40}, [&](const test::RouterCase&, const model::HParams& hp, const auto& logits,
                                                 const auto& bias, int64_t T, const std::string& what) {
    worst = std::max(worst, check_router(hp, logits, bias, T, what));
  });
  std::printf("router: largest relative weight error %.3g\n", worst);
}

// Tied scores break to the lower id (and lower group), as on the CPU; with every logit equal each
// token takes experts 0 .. k - 1 in that order.
TEST(RouterOnTheHost, TiedScoresBreakToTheLowerId) {
  test::for_tied_router_logits(20, [&](const test::RouterCase& c, const model::HParams& hp, const auto& logits,
                                       const auto& bias, int64_t T, const std::string& what) {
    check_router(hp, logits, bias, T, what);
    if (std::all_of(logits.begin(), logits.end(), [&](float l) { return l == logits[0]; }) &&
        std::all_of(bias.begin(), bias.end(), [](float b) { return b == 0.0f; })) {
      const auto ids = run_route(hp, logits, bias, T, what).first;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < int64_t(c.used); ++i) EXPECT_EQ(ids[size_t(t * c.used + i)], i) << what;
    }
  });
}

// What moe_group (moe_router.cu) leaves: counts, offsets, perm and (with it) the active list.
struct Grouping {
  std::vector<int32_t> counts, offsets, perm, active;
  int32_t n_active = -1;
  bool operator==(const Grouping& o) const {
    return counts == o.counts && offsets == o.offsets && perm == o.perm && active == o.active &&
           n_active == o.n_active;
  }
};

// The three launches of moe_group, each in `order`.
Grouping run_group(const std::vector<int32_t>& ids, int64_t E, bool with_active, emu::Order order) {
  const int64_t n = int64_t(ids.size());
  const int n_chunks = int((n + router::kChunk - 1) / router::kChunk);
  Grouping g;
  g.counts.assign(size_t(E), -5);
  g.offsets.assign(size_t(E + 1), -5);
  g.perm.assign(size_t(n), -5);
  if (with_active) g.active.assign(size_t(E), -5);
  std::vector<int32_t> base(size_t(E) * size_t(n_chunks), -5);
  emu::launch(router::count_chunks_kernel, dim3(unsigned(n_chunks)), dim3(router::kChunk), size_t(E) * sizeof(int32_t),
              order, ids.data(), n, int(E), n_chunks, base.data());
  emu::launch(router::scan_chunks_kernel, dim3(1), dim3(router::kScanThreads), 0, order, base.data(), int(E), n_chunks,
              g.counts.data(), g.offsets.data(), n, g.perm.data(), with_active ? g.active.data() : nullptr,
              with_active ? &g.n_active : nullptr);
  emu::launch(router::scatter_chunks_kernel, dim3(unsigned(n_chunks)), dim3(router::kChunk), 0, order, ids.data(), n,
              int(E), n_chunks, static_cast<const int32_t*>(base.data()), g.perm.data());
  return g;
}

// counts, offsets and the stable permutation, from a plain CPU counting sort.
TEST(RouterOnTheHost, GroupByExpertIsAStableCountingSort) {
  for (int64_t E : {8, 256})
    for (int64_t T : {1, 3, 100, 700}) {
      const int64_t k = std::min<int64_t>(8, E);
      std::mt19937 rng(uint32_t(E * 1000 + T));
      std::vector<int32_t> ids(size_t(T * k));
      for (int64_t t = 0; t < T; ++t) {  // k distinct experts a token, skewed towards low ids
        std::vector<int32_t> pick;
        while (int64_t(pick.size()) < k) {
          const int32_t e = int32_t(std::min<uint32_t>(rng() % uint32_t(E), rng() % uint32_t(E)));
          if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
        }
        std::copy(pick.begin(), pick.end(), ids.begin() + t * k);
      }
      if (T == 100) ids[5] = -1;  // an empty slot is left out
      if (T == 700) ids[300] = int32_t(E);  // (out of range: left out as well)
      const int64_t n = T * k;
      std::vector<int32_t> want_counts(size_t(E), 0), want_offsets(size_t(E + 1), 0), want_perm, want_active;
      for (int32_t e : ids)
        if (e >= 0 && e < E) ++want_counts[size_t(e)];
      for (int64_t e = 0; e < E; ++e) want_offsets[size_t(e + 1)] = want_offsets[size_t(e)] + want_counts[size_t(e)];
      for (int64_t e = 0; e < E; ++e)
        for (int64_t j = 0; j < n; ++j)
          if (ids[size_t(j)] == e) want_perm.push_back(int32_t(j));
      for (int64_t e = 0; e < E; ++e)
        if (want_counts[size_t(e)] > 0) want_active.push_back(int32_t(e));
      const std::string what = "E=" + std::to_string(E) + " T=" + std::to_string(T);
      for (bool with_active : {false, true}) {
        const Grouping rev = run_group(ids, E, with_active, emu::Order::kReversed);
        const Grouping g = run_group(ids, E, with_active, emu::Order::kForward);
        EXPECT_TRUE(rev == g) << what << ": depends on the order of the block's threads";
        EXPECT_EQ(g.counts, want_counts) << what;
        EXPECT_EQ(g.offsets, want_offsets) << what;
        EXPECT_EQ(std::vector<int32_t>(g.perm.begin(), g.perm.begin() + int64_t(want_perm.size())), want_perm) << what;
        if (!with_active) continue;
        // The experts with pairs ascending, and the entries left out marked -1 at the end of perm.
        ASSERT_EQ(g.n_active, int32_t(want_active.size())) << what;
        EXPECT_EQ(std::vector<int32_t>(g.active.begin(), g.active.begin() + g.n_active), want_active) << what;
        std::vector<int32_t> want_full = want_perm;
        want_full.resize(size_t(n), -1);
        EXPECT_EQ(g.perm, want_full) << what;
      }
    }
}

// The router's output fed to the grouping, as the MoE layer chains them.
TEST(RouterOnTheHost, RouteThenGroupMatchesCpuRouting) {
  const model::HParams hp = test::router_params(test::router_cases()[1]);
  const int64_t T = 60, E = hp.n_expert, k = hp.n_expert_used;
  const auto logits = randn(size_t(T * E), 99, 2.0f), bias = randn(size_t(E), 98, 0.1f);
  const auto [ids, weights] = run_route(hp, logits, bias, T, "route then group");
  const Grouping g = run_group(ids, E, false, emu::Order::kForward);
  std::vector<std::vector<int64_t>> want(static_cast<size_t>(E));  // tokens per expert, in token order
  for (int64_t t = 0; t < T; ++t)
    for (int32_t e : model::route(hp, logits.data() + t * E, bias.data()).experts) want[size_t(e)].push_back(t);
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> got;
    for (int32_t j = g.offsets[size_t(e)]; j < g.offsets[size_t(e + 1)]; ++j) got.push_back(g.perm[size_t(j)] / k);
    EXPECT_EQ(got, want[size_t(e)]) << "expert " << e;
  }
}

}  // namespace
}  // namespace sparsemla::cuda
