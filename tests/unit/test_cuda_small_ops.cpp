// The GPU's small operations and MoE router against their CPU references (ops/cpu, model::route),
// on random inputs over the sizes the models use and the edge sizes around them.
//
// Tolerances, and why: the GPU computes each formula in the CPU's order and precision, except that
// row sums (norms, softmax) accumulate in fp32 where the CPU uses double (relative error ~1e-7 on
// 6144 values, so 2e-6 to 5e-6 relative), and CUDA's expf / sinf / cosf may be 2 ulp from glibc's
// (a few 1e-7 relative). Single-operation kernels (add, scale, bf16) must match bit for bit. The
// router's exp is correctly rounded, as glibc's expf is but for one ulp on ~0.06% of inputs, so its
// choice is the CPU's (ties included); weights to 1e-6 relative.
#include <gtest/gtest.h>

#if SPARSEMLA_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "router_cases.h"
#include "test_util.h"
#include "model/blocks/ffn.h"
#include "model/hparams.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/moe_router.h"
#include "ops/cuda/norm_split.h"
#include "ops/cuda/quant_matmul_q8.h"
#include "ops/cuda/small_ops.h"
#include "util/error.h"
#include "util/half.h"

namespace sparsemla::cuda {
namespace {

const std::vector<int64_t> kRowLengths = {1, 7, 64, 6144};
const std::vector<int64_t> kTokenCounts = {1, 3, 100};

using test::randn;

// NaN / inf positions first, then |got - want| <= rel * |want| + abs; reports the first few misses.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rel, double abs,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int misses = 0;
  for (size_t i = 0; i < got.size() && misses < 5; ++i) {
    const bool same_class = std::isnan(got[i]) == std::isnan(want[i]) && std::isinf(got[i]) == std::isinf(want[i]);
    const bool far = std::isfinite(want[i]) && std::fabs(double(got[i]) - want[i]) > rel * std::fabs(want[i]) + abs;
    if (!same_class || far || (std::isinf(want[i]) && got[i] != want[i])) {
      ADD_FAILURE() << what << " [" << i << "]: got " << got[i] << ", want " << want[i];
      ++misses;
    }
  }
}

TEST(CudaSmallOps, RmsNormMatchesCpu) {
  SPARSEMLA_REQUIRE_GPU();
  for (int64_t n : kRowLengths)
    for (int64_t T : kTokenCounts) {
      const auto x = randn(size_t(T * n), uint32_t(n * 7 + T), 2.0f, 0.3f);
      const auto w = randn(size_t(n), uint32_t(n + 1));
      std::vector<float> want(x.size());
      for (int64_t t = 0; t < T; ++t) ops::rms_norm(x.data() + t * n, w.data(), n, 1e-6f, want.data() + t * n);
      DeviceBuffer dx = to_device(x), dw = to_device(w), dout(x.size() * sizeof(float));
      rms_norm(dx.as<float>(), n, dw.as<float>(), T, n, 1e-6f, dout.as<float>(), n, nullptr);
      expect_close(to_host<float>(dout, x.size()), want, 2e-6, 1e-7,
                   "rms_norm n=" + std::to_string(n) + " T=" + std::to_string(T));

      // In place on the first n values of wider rows (the latent c of [c | k_pe]): the rest untouched.
      const int64_t stride = n + 5;
      std::vector<float> wide(size_t(T * stride)), wide_want;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < stride; ++i) wide[size_t(t * stride + i)] = i < n ? x[size_t(t * n + i)] : float(i);
      wide_want = wide;
      for (int64_t t = 0; t < T; ++t) std::copy_n(want.data() + t * n, n, wide_want.data() + t * stride);
      DeviceBuffer dwide = to_device(wide);
      rms_norm(dwide.as<float>(), stride, dw.as<float>(), T, n, 1e-6f, dwide.as<float>(), stride, nullptr);
      expect_close(to_host<float>(dwide, wide.size()), wide_want, 2e-6, 1e-7, "rms_norm in place, strided");
    }
}

TEST(CudaSmallOps, AddRmsNormUpdatesResidualThenNorms) {
  SPARSEMLA_REQUIRE_GPU();
  for (int64_t n : kRowLengths)
    for (int64_t T : kTokenCounts) {
      const auto h = randn(size_t(T * n), uint32_t(n * 3 + T)), delta = randn(size_t(T * n), uint32_t(n * 5 + T));
      const auto w = randn(size_t(n), uint32_t(n + 2), 0.2f, 1.0f);
      std::vector<float> h_want(h.size()), out_want(h.size());
      for (size_t i = 0; i < h.size(); ++i) h_want[i] = h[i] + delta[i];
      for (int64_t t = 0; t < T; ++t) ops::rms_norm(h_want.data() + t * n, w.data(), n, 1e-5f, out_want.data() + t * n);
      DeviceBuffer dh = to_device(h), dd = to_device(delta), dw = to_device(w), dout(h.size() * sizeof(float));
      add_rms_norm(dh.as<float>(), dd.as<float>(), dw.as<float>(), T, n, 1e-5f, dout.as<float>(), nullptr);
      EXPECT_EQ(to_host<float>(dh, h.size()), h_want) << "the residual sum is one fp32 add";
      expect_close(to_host<float>(dout, h.size()), out_want, 2e-6, 1e-7, "add_rms_norm n=" + std::to_string(n));
    }
}

// The norms with int8 output (the model's norms feeding int8-activation products): the rows as
// without it (close to the CPU), the int8 activations the bits of quantize_activations on those
// rows, with the norm split over a cluster (SM90 and later: every width here, 8 / 4 / 2 blocks) and
// with the one-block kernel; the split rows within 2e-6 of the one-block ones and batch invariant
// (a row's bits the same at T = 1 and T = 3).
TEST(CudaSmallOps, NormsWithInt8OutputQuantizeAsQuantizeActivations) {
  SPARSEMLA_REQUIRE_GPU();
  struct Restore {
    ~Restore() { set_split_norms(true); }
  } restore;
  EXPECT_FALSE(split_norm_fits(1, 768)) << "rows under 1024 values keep the one-block kernel";
  EXPECT_FALSE(split_norm_fits(1, 1000));
  EXPECT_EQ(split_norm_fits(128, 6144), split_norm_fits(1, 6144)) << "decode batches up to 128 rows keep the split";
  EXPECT_FALSE(split_norm_fits(129, 6144)) << "prefill sizes take the one-block kernel";
  std::printf("  split norms on this device: %s\n", split_norm_fits(1, 6144) ? "yes" : "no (before SM90)");
  for (int64_t n : {1024, 1536, 2048, 6144, 7168}) {
    EXPECT_EQ(split_norm_fits(1, n), split_norm_fits(1, 6144)) << n;
    const auto w = randn(size_t(n), uint32_t(n + 9), 0.2f, 1.0f);
    const DeviceBuffer dw = to_device(w);
    for (int levels : {1, 2})
      for (bool split : {true, false}) {
        set_split_norms(split);
        std::vector<float> row0;  // T = 1's output row
        for (int64_t T : {1, 3}) {
          const std::string what = "n=" + std::to_string(n) + " T=" + std::to_string(T) + " levels=" +
                                   std::to_string(levels) + (split ? " split" : " one block");
          // (T = 1 takes the first of the three rows.)
          const auto h3 = randn(size_t(3 * n), uint32_t(n * 11)), d3 = randn(size_t(3 * n), uint32_t(n * 13));
          const std::vector<float> h(h3.begin(), h3.begin() + T * n), delta(d3.begin(), d3.begin() + T * n);
          std::vector<float> h_want(h.size()), want(h.size());
          for (size_t i = 0; i < h.size(); ++i) h_want[i] = h[i] + delta[i];
          for (int64_t t = 0; t < T; ++t) ops::rms_norm(h_want.data() + t * n, w.data(), n, 1e-5f, want.data() + t * n);
          const size_t qbytes = q8_activation_bytes(T, n, levels);
          DeviceBuffer dh = to_device(h), dd = to_device(delta), dout(h.size() * sizeof(float)), dq(qbytes),
                       dref(qbytes), dx = to_device(h_want), dout2(h.size() * sizeof(float)), dq2(qbytes);
          Q8Activations q, ref, q2;
          q.data = dq.get(), q.bytes = qbytes, ref.data = dref.get(), ref.bytes = qbytes, q2.data = dq2.get(),
          q2.bytes = qbytes;
          add_rms_norm(dh.as<float>(), dd.as<float>(), dw.as<float>(), T, n, 1e-5f, dout.as<float>(), nullptr, &q,
                       levels);
          rms_norm(dx.as<float>(), n, dw.as<float>(), T, n, 1e-5f, dout2.as<float>(), n, nullptr, &q2, levels);
          quantize_activations(dout.as<float>(), T, n, ref, nullptr, levels);
          synchronize();
          const std::vector<float> out = to_host<float>(dout, h.size());
          EXPECT_EQ(to_host<float>(dh, h.size()), h_want) << what << ": the residual";
          expect_close(out, want, 2e-6, 1e-7, what + ": add_rms_norm");
          expect_close(to_host<float>(dout2, h.size()), want, 2e-6, 1e-7, what + ": rms_norm");
          EXPECT_EQ(q.n_tokens, T);
          EXPECT_EQ(q.levels, levels);
          EXPECT_EQ(to_host<uint8_t>(dq, qbytes), to_host<uint8_t>(dref, qbytes)) << what << ": int8 output";
          DeviceBuffer dref2(qbytes);
          Q8Activations r2;
          r2.data = dref2.get(), r2.bytes = qbytes;
          quantize_activations(dout2.as<float>(), T, n, r2, nullptr, levels);
          synchronize();
          EXPECT_EQ(to_host<uint8_t>(dq2, qbytes), to_host<uint8_t>(dref2, qbytes)) << what << ": rms_norm int8 output";
          if (T == 1) row0 = out;
          else if (split) EXPECT_EQ(std::vector<float>(out.begin(), out.begin() + n), row0) << what << ": batch invariance";
        }
      }
  }
  // Int8 output wants contiguous rows.
  DeviceBuffer buf(1 << 20);
  Q8Activations q;
  q.data = buf.get(), q.bytes = 1 << 19;
  EXPECT_THROW(rms_norm(buf.as<float>(), 2100, buf.as<float>(), 1, 2048, 1e-5f, buf.as<float>(), 2100, nullptr, &q, 2),
               Error);
}

TEST(CudaSmallOps, LayerNormMatchesCpuWithAndWithoutBias) {
  SPARSEMLA_REQUIRE_GPU();
  for (int64_t n : kRowLengths)
    for (int64_t T : kTokenCounts)
      for (bool with_bias : {true, false}) {
        const auto x = randn(size_t(T * n), uint32_t(n * 11 + T), 1.5f, 0.5f);
        const auto w = randn(size_t(n), uint32_t(n + 3)), b = randn(size_t(n), uint32_t(n + 4));
        std::vector<float> want(x.size());
        for (int64_t t = 0; t < T; ++t)
          ops::layer_norm(x.data() + t * n, w.data(), with_bias ? b.data() : nullptr, n, 1e-6f, want.data() + t * n);
        DeviceBuffer dx = to_device(x), dw = to_device(w), db = to_device(b), dout(x.size() * sizeof(float));
        layer_norm(dx.as<float>(), dw.as<float>(), with_bias ? db.as<float>() : nullptr, T, n, 1e-6f, dout.as<float>(),
                   nullptr);
        // The fp32 mean is off the double one by ~1e-7 of the row's spread: an absolute term scaled by |w|.
        const auto got = to_host<float>(dout, x.size());
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_NEAR(got[i], want[i], 5e-6 * (std::fabs(want[i]) + std::fabs(w[i % size_t(n)])) + 1e-7)
              << "layer_norm n=" << n << " T=" << T << " bias=" << with_bias << " at " << i;
      }
}

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

TEST(CudaSmallOps, RopeMatchesCpuBothStylesBothPositionTypes) {
  SPARSEMLA_REQUIRE_GPU();
  for (const auto& [name, rope] : ropes()) {
    const DeviceRope drope(rope);
    ASSERT_EQ(drope.dims(), rope.dims());
    const int64_t d = rope.dims();
    for (int64_t T : kTokenCounts)
      for (int64_t heads : {1, 3, 64})
        for (ops::RopeStyle style : {ops::RopeStyle::Interleaved, ops::RopeStyle::HalfSplit}) {
          // Heads of [nope | rope] (q), the rotated part at offset nope; positions up to 200k.
          const int64_t nope = 16, stride = nope + d;
          const auto x = randn(size_t(T * heads * stride), uint32_t(T * 31 + heads));
          std::mt19937 rng(uint32_t(T + heads));
          std::vector<int64_t> pos(static_cast<size_t>(T));
          for (auto& p : pos) p = int64_t(rng() % 200000);
          if (T > 1) pos[0] = 0;
          std::vector<int32_t> pos32(pos.begin(), pos.end());
          std::vector<float> want(x);
          for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < heads; ++h)
              rope.apply(want.data() + (t * heads + h) * stride + nope, pos[size_t(t)], style);
          const std::string what = "rope " + name + " T=" + std::to_string(T) + " heads=" + std::to_string(heads) +
                                   (style == ops::RopeStyle::Interleaved ? " interleaved" : " half-split");
          DeviceBuffer dx = to_device(x), dpos = to_device(pos), dpos32 = to_device(pos32);
          drope.apply(dx.as<float>() + nope, T, heads, stride, dpos.as<int64_t>(), style, nullptr);
          const auto got = to_host<float>(dx, x.size());
          // cos and sin may be 2 ulp from glibc's: the error of an output is a few 1e-7 of its pair's size.
          for (size_t i = 0; i < x.size(); ++i) {
            const int64_t in_head = int64_t(i) % stride;
            if (in_head < nope) {
              ASSERT_EQ(got[i], x[i]) << what << ": a value outside the rotary dims changed at " << i;
              continue;
            }
            const size_t head0 = i - size_t(in_head) + size_t(nope);
            double pair_norm = 0;
            for (int64_t j = 0; j < d; ++j) pair_norm = std::max(pair_norm, double(std::fabs(x[head0 + size_t(j)])));
            ASSERT_NEAR(got[i], want[i], 1e-6 * pair_norm + 1e-7) << what << " at " << i;
          }
          DeviceBuffer dx32 = to_device(x);
          drope.apply(dx32.as<float>() + nope, T, heads, stride, dpos32.as<int32_t>(), style, nullptr);
          EXPECT_EQ(to_host<float>(dx32, x.size()), got) << what << ": int32 positions differ from int64";
        }
  }
}

// apply_to: q_pe moved into the wider absorbed row [W_UK q_nope | rope(q_pe)] in one launch. The
// rotated values against the CPU's rope, bit for bit equal to the in-place kernel's; the values
// past the rotary dims copied; every other value of the destination untouched.
TEST(CudaSmallOps, RopeIntoAnotherArrayMatchesCpu) {
  SPARSEMLA_REQUIRE_GPU();
  for (const auto& [name, rope] : ropes()) {
    const DeviceRope drope(rope);
    const int64_t d = rope.dims();
    for (int64_t T : kTokenCounts)
      for (int64_t heads : {1, 3, 64})
        for (int64_t extra : {0, 5})
          for (ops::RopeStyle style : {ops::RopeStyle::Interleaved, ops::RopeStyle::HalfSplit}) {
            // source heads [nope | rope | extra], destination heads [lead | rope | extra | pad]
            const int64_t nope = 12, width = d + extra, src_stride = nope + width, lead = 20,
                          dst_stride = lead + width + 3;
            const auto x = randn(size_t(T * heads * src_stride), uint32_t(T * 37 + heads + extra));
            const auto dst0 = randn(size_t(T * heads * dst_stride), uint32_t(T * 41 + heads));
            std::mt19937 rng(uint32_t(T + heads + extra));
            std::vector<int64_t> pos(static_cast<size_t>(T));
            for (auto& p : pos) p = int64_t(rng() % 200000);
            std::vector<float> want(dst0);
            for (int64_t t = 0; t < T; ++t)
              for (int64_t h = 0; h < heads; ++h) {
                const float* src = x.data() + (t * heads + h) * src_stride + nope;
                float* dst = want.data() + (t * heads + h) * dst_stride + lead;
                std::copy_n(src, width, dst);
                rope.apply(dst, pos[size_t(t)], style);
              }
            const std::string what = "rope into " + name + " T=" + std::to_string(T) + " heads=" + std::to_string(heads) +
                                     " extra=" + std::to_string(extra);
            DeviceBuffer dx = to_device(x), ddst = to_device(dst0), dpos = to_device(pos);
            drope.apply_to(dx.as<float>() + nope, src_stride, ddst.as<float>() + lead, dst_stride, width, T, heads,
                           dpos.as<int64_t>(), style, nullptr);
            const auto got = to_host<float>(ddst, dst0.size());
            DeviceBuffer dinplace = to_device(x);
            drope.apply(dinplace.as<float>() + nope, T, heads, src_stride, dpos.as<int64_t>(), style, nullptr);
            const auto inplace = to_host<float>(dinplace, x.size());
            ASSERT_EQ(to_host<float>(dx, x.size()), x) << what << ": the source changed";
            for (int64_t t = 0; t < T; ++t)
              for (int64_t h = 0; h < heads; ++h)
                for (int64_t c = 0; c < dst_stride; ++c) {
                  const size_t i = size_t((t * heads + h) * dst_stride + c);
                  if (c < lead || c >= lead + width) {
                    ASSERT_EQ(got[i], dst0[i]) << what << ": a value outside the destination's part changed at " << i;
                    continue;
                  }
                  const size_t si = size_t((t * heads + h) * src_stride + nope + (c - lead));
                  ASSERT_EQ(got[i], inplace[si]) << what << ": differs from the in-place rope at " << i;
                  if (c - lead >= d) ASSERT_EQ(got[i], x[si]) << what << ": a copied value differs at " << i;
                  double pair_norm = 0;
                  for (int64_t j = 0; j < d; ++j)
                    pair_norm = std::max(pair_norm, double(std::fabs(x[si - size_t(c - lead) + size_t(j)])));
                  ASSERT_NEAR(got[i], want[i], 1e-6 * pair_norm + 1e-7) << what << " at " << i;
                }
          }
  }
  const DeviceRope drope(ropes()[0].second);
  DeviceBuffer buf(4096), pos(8);
  EXPECT_THROW(drope.apply_to(buf.as<float>(), 64, buf.as<float>(), 32, 64, 1, 1, pos.as<int64_t>(),
                              ops::RopeStyle::HalfSplit, nullptr),
               Error)
      << "a destination stride shorter than the values moved";
  EXPECT_THROW(drope.apply_to(buf.as<float>(), 64, buf.as<float>(), 64, 32, 1, 1, pos.as<int64_t>(),
                              ops::RopeStyle::HalfSplit, nullptr),
               Error)
      << "fewer values than the rotary dims";
}

TEST(CudaSmallOps, SiluMulPlainAndFusedMatchCpu) {
  SPARSEMLA_REQUIRE_GPU();
  for (int64_t F : kRowLengths)
    for (int64_t T : kTokenCounts) {
      const auto gate = randn(size_t(T * F), uint32_t(F * 13 + T), 3.0f, 0.0f);
      const auto up = randn(size_t(T * F), uint32_t(F * 17 + T));
      std::vector<float> want(gate);
      ops::silu_mul(want.data(), up.data(), T * F);
      DeviceBuffer dg = to_device(gate), du = to_device(up);
      silu_mul(dg.as<float>(), du.as<float>(), T * F, nullptr);
      expect_close(to_host<float>(dg, gate.size()), want, 1e-6, 1e-30, "silu_mul F=" + std::to_string(F));

      std::vector<float> gate_up(size_t(T * 2 * F));
      for (int64_t t = 0; t < T; ++t) {
        std::copy_n(gate.data() + t * F, F, gate_up.data() + t * 2 * F);
        std::copy_n(up.data() + t * F, F, gate_up.data() + t * 2 * F + F);
      }
      DeviceBuffer dgu = to_device(gate_up), dout(size_t(T * F) * sizeof(float));
      silu_mul_fused(dgu.as<float>(), T, F, dout.as<float>(), nullptr);
      expect_close(to_host<float>(dout, size_t(T * F)), want, 1e-6, 1e-30, "silu_mul_fused F=" + std::to_string(F));
    }
}

// SiLU x up with int8 output (the down products' input): the same values as without, and the int8
// activations the bits of quantize_activations on them, one and two levels; rows that are not whole
// blocks of 32 refused.
TEST(CudaSmallOps, SiluMulWithInt8OutputQuantizesAsQuantizeActivations) {
  SPARSEMLA_REQUIRE_GPU();
  for (const auto& [T, F] : {std::pair<int64_t, int64_t>{1, 2048}, {9, 2048}, {3, 96}, {2, 12288}})
    for (int levels : {1, 2}) {
      const std::string what = std::to_string(T) + " x " + std::to_string(F) + ", " + std::to_string(levels) + " level(s)";
      const auto gate = randn(size_t(T * F), uint32_t(F + T), 3.0f), up = randn(size_t(T * F), uint32_t(F * 3 + T));
      DeviceBuffer dg = to_device(gate), du = to_device(up), dplain = to_device(gate);
      const size_t qbytes = q8_activation_bytes(T, F, levels);
      DeviceBuffer dq(qbytes), dref(qbytes);
      Q8Activations q, ref;
      q.data = dq.get(), q.bytes = qbytes, ref.data = dref.get(), ref.bytes = qbytes;
      silu_mul(dg.as<float>(), du.as<float>(), T * F, nullptr, &q, F, levels);
      silu_mul(dplain.as<float>(), du.as<float>(), T * F, nullptr);
      quantize_activations(dplain.as<float>(), T, F, ref, nullptr, levels);
      synchronize();
      EXPECT_EQ(to_host<float>(dg, gate.size()), to_host<float>(dplain, gate.size())) << what << ": values";
      EXPECT_EQ(q.n_tokens, T);
      EXPECT_EQ(to_host<uint8_t>(dq, qbytes), to_host<uint8_t>(dref, qbytes)) << what << ": int8 output";
    }
  DeviceBuffer buf(1 << 16);
  Q8Activations q;
  q.data = buf.get(), q.bytes = 1 << 15;
  EXPECT_NE(test::error_of([&] { silu_mul(buf.as<float>(), buf.as<float>(), 100, nullptr, &q, 50, 1); })
                .find("multiple of 32"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { silu_mul(buf.as<float>(), buf.as<float>(), 100, nullptr, &q, 64, 1); })
                .find("whole rows"),
            std::string::npos);
}

TEST(CudaSmallOps, AddAndScaleAreExact) {
  SPARSEMLA_REQUIRE_GPU();
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(6144), int64_t(100 * 6144)}) {
    const auto h = randn(size_t(n), uint32_t(n)), d = randn(size_t(n), uint32_t(n + 9));
    std::vector<float> sum(h), scaled(h);
    for (int64_t i = 0; i < n; ++i) {
      sum[size_t(i)] += d[size_t(i)];
      scaled[size_t(i)] *= 0.37f;
    }
    DeviceBuffer dh = to_device(h), dd = to_device(d), ds = to_device(h);
    add(dh.as<float>(), dd.as<float>(), n, nullptr);
    scale(ds.as<float>(), 0.37f, n, nullptr);
    EXPECT_EQ(to_host<float>(dh, size_t(n)), sum) << n;
    EXPECT_EQ(to_host<float>(ds, size_t(n)), scaled) << n;
  }
}

TEST(CudaSmallOps, SoftmaxRowsMatchesCpu) {
  SPARSEMLA_REQUIRE_GPU();
  for (int64_t n : kRowLengths)
    for (int64_t T : kTokenCounts) {
      auto x = randn(size_t(T * n), uint32_t(n * 19 + T), 4.0f, 1.0f);
      if (n > 1) x[1] = -std::numeric_limits<float>::infinity();  // a masked entry
      std::vector<float> want(x);
      for (int64_t t = 0; t < T; ++t) ops::softmax(want.data() + t * n, n);
      DeviceBuffer dx = to_device(x);
      softmax_rows(dx.as<float>(), T, n, nullptr);
      expect_close(to_host<float>(dx, x.size()), want, 5e-6, 1e-12,
                   "softmax n=" + std::to_string(n) + " T=" + std::to_string(T));
    }
}

TEST(CudaSmallOps, Bf16ConversionsAreBitExact) {
  SPARSEMLA_REQUIRE_GPU();
  std::vector<float> x = randn(100000, 5, 100.0f);
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
  std::vector<uint16_t> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = sparsemla::f32_to_bf16(x[i]);
  DeviceBuffer dx = to_device(x), db(x.size() * 2), dback(x.size() * 4);
  cuda::f32_to_bf16(dx.as<float>(), db.as<uint16_t>(), int64_t(x.size()), nullptr);
  ASSERT_EQ(to_host<uint16_t>(db, x.size()), want);
  cuda::bf16_to_f32(db.as<uint16_t>(), dback.as<float>(), int64_t(x.size()), nullptr);
  const auto back = to_host<float>(dback, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t got_bits, want_bits = uint32_t(want[i]) << 16;
    std::memcpy(&got_bits, &back[i], 4);
    ASSERT_EQ(got_bits, want_bits) << i;
  }
}

// ---- router (the cases: router_cases.h) ----

// Routes T tokens on the GPU and checks each against model::route(): the same experts (as a set),
// each with the CPU's weight.
void check_router(const model::HParams& hp, const std::vector<float>& logits, const std::vector<float>& bias,
                  int64_t T, const std::string& what) {
  const int64_t E = hp.n_expert, k = hp.n_expert_used;
  DeviceBuffer dl = to_device(logits), db = to_device(bias), dids(size_t(T * k) * 4), dw(size_t(T * k) * 4);
  moe_route(hp, dl.as<float>(), db.as<float>(), T, dids.as<int32_t>(), dw.as<float>(), nullptr);
  const auto ids = to_host<int32_t>(dids, size_t(T * k));
  const auto weights = to_host<float>(dw, size_t(T * k));
  for (int64_t t = 0; t < T; ++t) {
    const model::Routing r = model::route(hp, logits.data() + t * E, bias.data());
    std::map<int32_t, float> want, got;
    for (size_t i = 0; i < r.experts.size(); ++i) want[r.experts[i]] = r.weights[i];
    for (int64_t i = 0; i < k; ++i) got[ids[size_t(t * k + i)]] = weights[size_t(t * k + i)];
    ASSERT_EQ(got.size(), size_t(k)) << what << " token " << t << ": an expert chosen twice";
    for (const auto& [e, wgt] : want) {
      ASSERT_TRUE(got.count(e)) << what << " token " << t << ": expert " << e << " not chosen";
      EXPECT_NEAR(got[e], wgt, 1e-6 * std::fabs(wgt) + 1e-9) << what << " token " << t << " expert " << e;
    }
  }
}

TEST(CudaRouter, MatchesCpuRouteOnRandomLogits) {
  SPARSEMLA_REQUIRE_GPU();
  for (int64_t T : kTokenCounts)
    test::for_random_router_logits({T}, [&](const test::RouterCase&, const model::HParams& hp, const auto& logits,
                                            const auto& bias, int64_t n, const std::string& what) {
      check_router(hp, logits, bias, n, what);
    });
}

// Logits and biases from a handful of values: scores, group scores and choices tie everywhere, and
// the lower id (and lower group) must win every tie, as on the CPU.
TEST(CudaRouter, TiedScoresBreakToTheLowerId) {
  SPARSEMLA_REQUIRE_GPU();
  test::for_tied_router_logits(100, [&](const test::RouterCase&, const model::HParams& hp, const auto& logits,
                                        const auto& bias, int64_t T, const std::string& what) {
    check_router(hp, logits, bias, T, what);
  });
}

// counts, offsets and the stable permutation, from a plain CPU counting sort.
TEST(CudaRouter, GroupByExpertIsAStableCountingSort) {
  SPARSEMLA_REQUIRE_GPU();
  for (int64_t E : {8, 256})
    for (int64_t T : {1, 3, 100, 5000}) {
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
      const int64_t n = T * k;
      std::vector<int32_t> want_counts(size_t(E), 0), want_offsets(size_t(E + 1), 0), want_perm;
      for (int32_t e : ids)
        if (e >= 0) ++want_counts[size_t(e)];
      for (int64_t e = 0; e < E; ++e) want_offsets[size_t(e + 1)] = want_offsets[size_t(e)] + want_counts[size_t(e)];
      for (int64_t e = 0; e < E; ++e)
        for (int64_t j = 0; j < n; ++j)
          if (ids[size_t(j)] == e) want_perm.push_back(int32_t(j));

      DeviceBuffer did = to_device(ids), dcounts(size_t(E) * 4), doffsets(size_t(E + 1) * 4), dperm(size_t(n) * 4),
          ws(std::max<size_t>(1, moe_group_workspace_bytes(n, E)));
      moe_group(did.as<int32_t>(), n, E, dcounts.as<int32_t>(), doffsets.as<int32_t>(), dperm.as<int32_t>(), ws.get(),
                nullptr);
      const std::string what = "E=" + std::to_string(E) + " T=" + std::to_string(T);
      EXPECT_EQ(to_host<int32_t>(dcounts, size_t(E)), want_counts) << what;
      EXPECT_EQ(to_host<int32_t>(doffsets, size_t(E + 1)), want_offsets) << what;
      auto perm = to_host<int32_t>(dperm, size_t(n));
      perm.resize(want_perm.size());
      EXPECT_EQ(perm, want_perm) << what;
      // With the list of experts that have pairs: the same grouping, the list ascending, and the
      // entries left out marked -1 at the end of perm.
      std::vector<int32_t> want_active;
      for (int64_t e = 0; e < E; ++e)
        if (want_counts[size_t(e)] > 0) want_active.push_back(int32_t(e));
      DeviceBuffer dactive(size_t(E) * 4), dn(4);
      moe_group(did.as<int32_t>(), n, E, dcounts.as<int32_t>(), doffsets.as<int32_t>(), dperm.as<int32_t>(), ws.get(),
                nullptr, dactive.as<int32_t>(), dn.as<int32_t>());
      const int32_t n_active = to_host<int32_t>(dn, 1)[0];
      ASSERT_EQ(n_active, int32_t(want_active.size())) << what;
      EXPECT_EQ(to_host<int32_t>(dactive, size_t(n_active)), want_active) << what;
      std::vector<int32_t> want_full = want_perm;
      want_full.resize(size_t(n), -1);
      EXPECT_EQ(to_host<int32_t>(dperm, size_t(n)), want_full) << what;
    }
}

// The router's output fed to the grouping, as the MoE layer chains them, with no host step between.
TEST(CudaRouter, RouteThenGroupMatchesCpuRouting) {
  SPARSEMLA_REQUIRE_GPU();
  const model::HParams hp = test::router_params(test::router_cases()[1]);
  const int64_t T = 300, E = hp.n_expert, k = hp.n_expert_used;
  const auto logits = randn(size_t(T * E), 99, 2.0f), bias = randn(size_t(E), 98, 0.1f);
  DeviceBuffer dl = to_device(logits), db = to_device(bias), dids(size_t(T * k) * 4), dw(size_t(T * k) * 4),
      dcounts(size_t(E) * 4), doffsets(size_t(E + 1) * 4), dperm(size_t(T * k) * 4),
      ws(moe_group_workspace_bytes(T * k, E));
  moe_route(hp, dl.as<float>(), db.as<float>(), T, dids.as<int32_t>(), dw.as<float>(), nullptr);
  moe_group(dids.as<int32_t>(), T * k, E, dcounts.as<int32_t>(), doffsets.as<int32_t>(), dperm.as<int32_t>(), ws.get(),
            nullptr);
  const auto offsets = to_host<int32_t>(doffsets, size_t(E + 1));
  const auto perm = to_host<int32_t>(dperm, size_t(T * k));
  std::vector<std::vector<int64_t>> want(static_cast<size_t>(E));  // tokens per expert, in token order
  for (int64_t t = 0; t < T; ++t)
    for (int32_t e : model::route(hp, logits.data() + t * E, bias.data()).experts) want[size_t(e)].push_back(t);
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> got;
    for (int32_t j = offsets[size_t(e)]; j < offsets[size_t(e + 1)]; ++j) got.push_back(perm[size_t(j)] / k);
    EXPECT_EQ(got, want[size_t(e)]) << "expert " << e;
  }
}

}  // namespace
}  // namespace sparsemla::cuda

#else

TEST(CudaSmallOps, Skipped) { GTEST_SKIP() << "built without CUDA"; }

#endif
