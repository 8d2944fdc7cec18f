// The int8-activation decode products (src/ops/cuda/gemv_q8_kernels.cuh) run by the host
// emulation (cuda/emu.h) as gemv_q8.cu launches them (plan_q8 picks the kernel, grid, threads and
// shared memory), for all 16 types on one and two activation levels, and the activation
// quantization kernel before them. So the kernels around the int8 units (their rows per block,
// token passes, staged chunk copies and row groups, the expert, grouped and several-product
// modes, the block reductions) are checked in CI, where there is no GPU; CudaMatmulQ8 runs them on
// one.
//
// References (independent of the kernels): the quantized activations against quantize_on_host
// (quant_test_util.h: the rule of quant_matmul_q8.h on the host), bit for bit; each output against
// the rows as the CPU dequantizes them times x_hat in double (error per row relative to its sum of
// |w x| <= 1e-6: only fp32 rounding differs). And the equalities the kernels promise, bit for bit:
// a token's result is the same alone and in a batch, through the staged kernels and the plain one,
// as an expert pair, a grouped slot or one of several products and as the matrix alone; the
// same with the block's threads run in the opposite order (no race between them).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../unit/quant_test_util.h"
#include "gguf/ggml_types.h"
#include "gguf/quants.h"
#include "host_tables.h"
#include "ops/cuda/gemv_q8_kernels.cuh"

namespace sparsemla::cuda {
namespace {

using gguf::GgmlType;
using namespace q8gemv;

// Activations quantized by the emulated quantize_q8_kernel, in the layout MatArgs reads.
struct Q8X {
  std::vector<int8_t> q, r;
  std::vector<int2> xb;
};

template <int L>
Q8X quantize_emulated(const std::vector<float>& x) {
  const int64_t n_blocks = int64_t(x.size()) / 32;
  Q8X o{std::vector<int8_t>(x.size()), std::vector<int8_t>(L == 2 ? x.size() : 0), std::vector<int2>(size_t(n_blocks))};
  const unsigned grid = unsigned((n_blocks * 32 + 255) / 256);
  emu::launch(quantize_q8_kernel<L>, dim3(grid), dim3(256), 0, emu::Order::kForward, x.data(), n_blocks, o.q.data(),
              L == 2 ? o.r.data() : static_cast<int8_t*>(nullptr), o.xb.data());
  return o;
}

// x_hat of token rows [0, n) of n_cols (the values the products multiply), from the host rule.
std::vector<double> x_hat(const std::vector<float>& x, int levels) {
  return test_q8::dequantized(test_q8::quantize_on_host(x, levels));
}

// The weights of `n_mats` matrices of n_rows x n_cols, one allocation 16-byte aligned per matrix
// (as the engine's tensors are), and their rows dequantized by the CPU.
struct Weights {
  GgmlType type;
  int64_t n_rows, n_cols;
  uint64_t row_bytes;
  std::vector<std::vector<uint8_t>> bytes;  // (std::vector's allocation: 16-byte aligned)
  std::vector<std::vector<float>> deq;
  Weights(GgmlType t, int n_mats, int64_t rows, int64_t cols, uint32_t seed)
      : type(t), n_rows(rows), n_cols(cols), row_bytes(gguf::row_bytes(t, uint64_t(cols))) {
    for (int m = 0; m < n_mats; ++m) {
      bytes.push_back(test_q8::make_weight(t, rows, cols, seed + uint32_t(m)));
      std::vector<float> d(size_t(rows * cols));
      for (int64_t r = 0; r < rows; ++r)
        gguf::dequantize_row(t, bytes.back().data() + r * row_bytes, d.data() + r * cols, cols);
      deq.push_back(std::move(d));
    }
  }
};

// Largest error of y (rows of matrix `deq`, n_rows x n_cols) against deq . xh (one token's x_hat).
double row_error(const std::vector<float>& deq, int64_t n_rows, int64_t n_cols, const double* xh, const float* y) {
  double worst = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    double ref = 0, norm = 0;
    for (int64_t c = 0; c < n_cols; ++c) {
      const double p = double(deq[size_t(r * n_cols + c)]) * xh[c];
      ref += p;
      norm += std::fabs(p);
    }
    worst = std::max(worst, std::fabs(double(y[r]) - ref) / std::max(norm, 1e-30));
  }
  return worst;
}

MatArgs base_args(const Weights& w, const Q8X& x, int levels) {
  MatArgs a;
  a.w = w.bytes[0].data();
  a.row_bytes = w.row_bytes;
  a.n_rows = w.n_rows;
  a.n_cols = w.n_cols;
  a.xq = x.q.data();
  a.xr = levels == 2 ? x.r.data() : nullptr;
  a.xb = x.xb.data();
  a.sm_count = 4;  // (small: the row-group kernels take several groups per warp)
  a.tables = test_q8::host_tables();
  return a;
}

// Runs the product as gemv_q8.cu would (plan_q8), in both thread orders; the two must agree.
template <class V, int L>
Q8Plan::Path run(const MatArgs& a, bool staged, const std::vector<float*>& outputs, const std::vector<size_t>& sizes) {
  const Q8Plan p = plan_q8<V, L>(a, staged);
  const auto go = [&](emu::Order order) {
    if (p.group_kernel) emu::launch(p.group_kernel, p.grid, dim3(unsigned(p.threads)), p.smem, order, a, p.groups);
    else emu::launch(p.kernel, p.grid, dim3(unsigned(p.threads)), p.smem, order, a);
  };
  go(emu::Order::kReversed);
  std::vector<std::vector<float>> first;
  for (size_t i = 0; i < outputs.size(); ++i) first.emplace_back(outputs[i], outputs[i] + sizes[i]);
  go(emu::Order::kForward);
  for (size_t i = 0; i < outputs.size(); ++i)
    EXPECT_EQ(first[i], std::vector<float>(outputs[i], outputs[i] + sizes[i]))
        << "output " << i << " depends on the order of the block's threads";
  return p.path;
}

const char* path_name(Q8Plan::Path p) {
  switch (p) {
    case Q8Plan::kPlain: return "plain";
    case Q8Plan::kStaged: return "staged";
    case Q8Plan::kStagedGroups: return "staged row groups";
    case Q8Plan::kStagedRuns: return "staged runs";
  }
  return "?";
}

constexpr float kUnwritten = -12345.0f;

template <class V, int L>
void check_levels(GgmlType type, int64_t n_cols, uint32_t seed) {
  SCOPED_TRACE(fmt::format("{} x {} columns, {} level(s)", gguf::type_name(type), n_cols, L));
  const int64_t n_rows = 70;  // (not a multiple of the 4 rows per block)
  const Weights w(type, 3, n_rows, n_cols, seed);
  const int n_tok = 9;  // two passes of 8 tokens
  const std::vector<float> x = test::randn(size_t(n_tok * n_cols), seed + 7);

  // The quantization kernel gives the host rule's bits.
  const Q8X xq = quantize_emulated<L>(x);
  const test_q8::HostQ8 hq = test_q8::quantize_on_host(x, L);
  ASSERT_EQ(xq.q, hq.q);
  if (L == 2) ASSERT_EQ(xq.r, hq.r);
  for (size_t b = 0; b < hq.d.size(); ++b) {
    ASSERT_EQ(xq.xb[b].x, __float_as_int(hq.d[b])) << "block " << b;
    ASSERT_EQ(xq.xb[b].y, hq.sum[b]) << "block " << b;
  }
  const std::vector<double> xh = x_hat(x, L);
  double worst = 0;

  // One token, as the model's decode runs it (staged where the type and shape allow), and
  // through the plain kernel: the same bits.
  std::vector<float> one(size_t(n_rows), kUnwritten), one_plain(size_t(n_rows), kUnwritten);
  MatArgs a = base_args(w, xq, L);
  a.n_tokens = 1;
  a.y = one.data();
  const Q8Plan::Path path = run<V, L>(a, true, {one.data()}, {one.size()});
  // (Which kernel the rules of gemv_q8.cu give: staged for the blocks that are not 16-byte multiples
  // from V::kStagedMinCols columns; row groups for rows of 32 units, runs for a chunk per warp.)
  if constexpr (V::kBytes % 16 == 0) {
    EXPECT_EQ(path, Q8Plan::kPlain);
  } else {
    if (V::kBlock == 256 && n_cols == 2048) EXPECT_EQ(path, Q8Plan::kStagedGroups);
    if (V::kBlock == 256 && n_cols == 4096 && V::kUnroll == 1) EXPECT_EQ(path, Q8Plan::kStagedRuns);
    if (V::kBlock == 32) EXPECT_EQ(path, n_cols >= 4096 ? Q8Plan::kStaged : Q8Plan::kPlain);
  }
  // The IQ types' runs read their grid table from a copy in shared memory (grid_in_shared: here 4 row
  // groups per block, so IQ1's too), and that is the kernel whose bits are compared below.
  if constexpr (GridOf<V>::kBytes > 0) {
    if (path == Q8Plan::kStagedRuns) {
      const Q8Plan p = plan_q8<V, L>(a, true);
      const bool shared = p.group_kernel == &gemv_q8_staged_runs_kernel<V, kQ8Rows, L, true>;
      EXPECT_EQ(shared, grid_in_shared<V>(p.groups));
      if (env_switch("SPARSEMLA_Q8_SMEM_GRID") != 0) EXPECT_TRUE(shared) << p.groups << " row groups per block";
    }
  }
  a.y = one_plain.data();
  EXPECT_EQ((run<V, L>(a, false, {one_plain.data()}, {one_plain.size()})), Q8Plan::kPlain);
  EXPECT_EQ(one, one_plain) << "staged and plain kernels differ";
  worst = std::max(worst, row_error(w.deq[0], n_rows, n_cols, xh.data(), one.data()));

  // Batches of 2, 3, 5 and 9 tokens (2, 4 and 8 per pass): each token as it is alone.
  for (int T : {2, 3, 5, 9}) {
    std::vector<float> y(size_t(T * n_rows), kUnwritten);
    a.n_tokens = T;
    a.y = y.data();
    run<V, L>(a, true, {y.data()}, {y.size()});
    EXPECT_TRUE(std::equal(one.begin(), one.end(), y.begin())) << "token 0 of " << T << " differs from it alone";
    for (int t = 0; t < T; ++t)
      worst = std::max(worst, row_error(w.deq[0], n_rows, n_cols, xh.data() + t * n_cols, y.data() + t * n_rows));
  }

  // Several products of one token (grid z): each as it is alone.
  {
    std::vector<float> y0(size_t(n_rows), kUnwritten), y1(size_t(n_rows - 6), kUnwritten), y2(size_t(n_rows), kUnwritten);
    MatArgs m = base_args(w, xq, L);
    m.n_tokens = 1;
    m.y = y0.data();
    m.n_more = 2;
    m.more[0] = {w.bytes[1].data(), y1.data(), n_rows - 6, w.row_bytes, nullptr};
    m.more[1] = {w.bytes[2].data(), y2.data(), n_rows, w.row_bytes, nullptr};
    run<V, L>(m, true, {y0.data(), y1.data(), y2.data()}, {y0.size(), y1.size(), y2.size()});
    EXPECT_EQ(y0, one) << "product 0 of three differs from it alone";
    worst = std::max(worst, row_error(w.deq[1], n_rows - 6, n_cols, xh.data(), y1.data()));
    worst = std::max(worst, row_error(w.deq[2], n_rows, n_cols, xh.data(), y2.data()));
  }

  // Expert pairs: the three matrices as experts of one tensor (rows e * n_rows ..), pairs of
  // tokens (x_div 2), one unused slot (-1: its row left alone) and a shared expert pair.
  {
    std::vector<uint8_t> experts;
    for (const auto& b : w.bytes) experts.insert(experts.end(), b.begin(), b.end());
    const std::vector<int32_t> ids = {2, 0, -1, 1, 0, 2};  // pairs 0..5; pair 6 is the shared expert's
    const int n_pairs = 7;
    std::vector<float> y(size_t(n_pairs * n_rows), kUnwritten);
    MatArgs e = base_args(w, xq, L);
    e.w = experts.data();
    e.expert_ids = ids.data();
    e.n_tokens = n_pairs;
    e.x_div = 2;
    e.shared_w = w.bytes[1].data();
    e.shared_pair = 6;
    e.shared_x_row = 4;
    e.y = y.data();
    run<V, L>(e, true, {y.data()}, {y.size()});
    for (int p = 0; p < n_pairs; ++p) {
      const float* yp = y.data() + p * n_rows;
      if (p == 2) {
        EXPECT_TRUE(std::all_of(yp, yp + n_rows, [](float v) { return v == kUnwritten; })) << "unused pair written";
        continue;
      }
      const int mat = p == 6 ? 1 : ids[size_t(p)], tok = p == 6 ? 4 : p / 2;
      worst = std::max(worst, row_error(w.deq[size_t(mat)], n_rows, n_cols, xh.data() + tok * n_cols, yp));
    }
    EXPECT_TRUE(std::equal(one.begin(), one.end(), y.begin() + n_rows)) << "expert pair 1 (matrix 0, token 0)";
  }

  // Grouped slots: experts 2 and 0 active (in that order), expert 1 empty; slots read permuted
  // token rows; a grid row past the active count does nothing.
  {
    std::vector<uint8_t> experts;
    for (const auto& b : w.bytes) experts.insert(experts.end(), b.begin(), b.end());
    const std::vector<int32_t> offsets = {0, 3, 3, 8};  // expert 0: slots 0-2, expert 2: slots 3-7
    const std::vector<int32_t> active = {2, 0, 1}, count = {2};
    const std::vector<int32_t> perm = {0, 5, 8, 1, 2, 3, 6, 7};  // slot j reads token perm[j] / x_div
    const int n_slots = 8;
    std::vector<float> y(size_t(n_slots * n_rows), kUnwritten);
    MatArgs g = base_args(w, xq, L);
    g.w = experts.data();
    g.group_offsets = offsets.data();
    g.group_active = active.data();
    g.group_count = count.data();
    g.group_perm = perm.data();
    g.group_tokens_max = 5;
    g.n_tokens = 3;  // grid rows: one more than the active groups
    g.x_div = 1;
    g.y = y.data();
    run<V, L>(g, true, {y.data()}, {y.size()});
    for (int j = 0; j < n_slots; ++j) {
      const int mat = j < 3 ? 0 : 2, tok = perm[size_t(j)];
      worst = std::max(worst, row_error(w.deq[size_t(mat)], n_rows, n_cols, xh.data() + tok * n_cols,
                                        y.data() + j * n_rows));
    }
    EXPECT_TRUE(std::equal(one.begin(), one.end(), y.begin())) << "grouped slot 0 (matrix 0, token 0)";
  }

  EXPECT_LE(worst, 1e-6);
  std::printf("  %-8s %5lld cols, %d level(s): max error %.2e (1 token %s)\n", std::string(gguf::type_name(type)).c_str(),
              static_cast<long long>(n_cols), L, worst, path_name(path));
}

template <class V>
void check_type(GgmlType type, std::vector<int64_t> widths) {
  uint32_t seed = 300 + 17 * uint32_t(type);
  for (int64_t n_cols : widths) {
    check_levels<V, 1>(type, n_cols, seed += 31);
    check_levels<V, 2>(type, n_cols, seed += 31);
  }
}

// Widths per kind of unit: 256-blocks at 2048 columns (32 units: the staged row-group kernel for
// the 2-byte aligned types), 4096 (a chunk per warp at one unit per thread: the staged runs kernel)
// and 1280; 32-blocks at 4096 (staged from there) and 1536 (not).
const std::vector<int64_t> kWide = {2048, 4096, 1280};
const std::vector<int64_t> kLegacy = {4096, 1536};

TEST(DecodeProductsOnTheHost, Q8_0) { check_type<Q80Unit>(GgmlType::Q8_0, kLegacy); }
TEST(DecodeProductsOnTheHost, Q4_0) { check_type<Q40Unit>(GgmlType::Q4_0, kLegacy); }
TEST(DecodeProductsOnTheHost, IQ4_NL) { check_type<IQ4NLUnit>(GgmlType::IQ4_NL, kLegacy); }
TEST(DecodeProductsOnTheHost, Q4_K) { check_type<Q4KUnit>(GgmlType::Q4_K, kWide); }
TEST(DecodeProductsOnTheHost, Q5_K) { check_type<Q5KUnit>(GgmlType::Q5_K, kWide); }
TEST(DecodeProductsOnTheHost, Q6_K) { check_type<Q6KUnit>(GgmlType::Q6_K, kWide); }
TEST(DecodeProductsOnTheHost, Q2_K) { check_type<Q2KUnit>(GgmlType::Q2_K, kWide); }
TEST(DecodeProductsOnTheHost, Q3_K) { check_type<Q3KUnit>(GgmlType::Q3_K, kWide); }
TEST(DecodeProductsOnTheHost, IQ4_XS) { check_type<IQ4XSUnit>(GgmlType::IQ4_XS, kWide); }
TEST(DecodeProductsOnTheHost, IQ2_XXS) { check_type<IQ2XXSUnit>(GgmlType::IQ2_XXS, kWide); }
TEST(DecodeProductsOnTheHost, IQ2_XS) { check_type<IQ2XSUnit>(GgmlType::IQ2_XS, kWide); }
TEST(DecodeProductsOnTheHost, IQ2_S) { check_type<IQ2SUnit>(GgmlType::IQ2_S, kWide); }
TEST(DecodeProductsOnTheHost, IQ3_XXS) { check_type<IQ3XXSUnit>(GgmlType::IQ3_XXS, kWide); }
TEST(DecodeProductsOnTheHost, IQ3_S) { check_type<IQ3SUnit>(GgmlType::IQ3_S, kWide); }
TEST(DecodeProductsOnTheHost, IQ1_S) { check_type<IQ1SUnit>(GgmlType::IQ1_S, kWide); }
TEST(DecodeProductsOnTheHost, IQ1_M) { check_type<IQ1MUnit>(GgmlType::IQ1_M, kWide); }

}  // namespace
}  // namespace sparsemla::cuda
