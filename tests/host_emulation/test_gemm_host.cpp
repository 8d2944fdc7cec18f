// The prefill product's kernel (src/ops/cuda/gemm_kernel.cuh) run by the host emulation (cuda/emu.h,
// mma.sync and ldmatrix stood in for), so that CI checks it without a GPU: its grouped mode (the
// experts' tiles of a prefill, cuda::matmul_expert_tiles: tile lists from cuda::expert_tiles, every
// tile width, tiles of a group past 128 tokens, a second product in grid z, row tiles past an
// expert's last row) and its one-product mode with column splits (partial sums per split), for types
// of every block family (plain, 32-element, 256-element, grid lookups) with a half 64-column step
// where the block size allows one. On a GPU: CudaMatmul.ExpertTilesMatchCpu and the prefill tests.
//
// Reference: per (token, row), the CPU's dequantized weight rounded to bf16 times the activation
// rounded to bf16, summed in double. The stand-in mma adds each 16-column product exactly and rounds
// once (the tensor cores: their own internal width), so only fp32 rounding of the running sum and
// the decoders' last bits before the bf16 rounding differ: error per output relative to its sum of
// |w x| <= 1e-4, where a misplaced weight, token or column gives O(1). Rows and tokens no tile covers
// must stay unwritten, and the two thread orders must give the same bits (no race).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../unit/quant_test_util.h"
#include "gguf/ggml_types.h"
#include "gguf/quants.h"
#include "host_tables.h"
#include "ops/cuda/gemm_kernel.cuh"
#include "util/half.h"

namespace sparsemla::cuda {
namespace {

using gguf::GgmlType;

constexpr float kUnwritten = -12345.0f;

int cols_for(GgmlType t) {
  const uint32_t bs = gguf::traits(t).block_size;
  return bs == 256 ? 512 : bs == 32 ? 480 : 200;  // (480 and 200: a last step of 32 and 8 columns)
}

// A stacked weight of E experts x F rows, and its rows as bf16-rounded floats.
struct Stack {
  GgmlType type;
  int64_t rows, cols;
  uint64_t rb;
  std::vector<uint8_t> bytes;
  std::vector<float> w16;  // [rows][cols]
  Stack(GgmlType t, int64_t n_rows, int64_t n_cols, uint32_t seed)
      : type(t), rows(n_rows), cols(n_cols), rb(gguf::row_bytes(t, uint64_t(n_cols))),
        bytes(test_q8::make_weight(t, n_rows, n_cols, seed)), w16(size_t(n_rows * n_cols)) {
    std::vector<float> row(static_cast<size_t>(n_cols));
    for (int64_t r = 0; r < n_rows; ++r) {
      gguf::dequantize_row(t, bytes.data() + r * rb, row.data(), n_cols);
      for (int64_t c = 0; c < n_cols; ++c) w16[size_t(r * n_cols + c)] = bf16_to_f32(f32_to_bf16(row[size_t(c)]));
    }
  }
};

std::vector<float> rounded(const std::vector<float>& x) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = bf16_to_f32(f32_to_bf16(x[i]));
  return r;
}

// y[tok][row] (row of the weight's rows [row0, row0 + n_rows)) against the reference, tokens [t0, t1).
void expect_rows(const std::vector<float>& y, int64_t y_stride, const Stack& w, int64_t row0, int64_t n_rows,
                 const std::vector<float>& x16, int64_t t0, int64_t t1, const std::string& what) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r = 0; r < n_rows; ++r) {
      double s = 0.0, mag = 0.0;
      for (int64_t c = 0; c < w.cols; ++c) {
        const double p = double(w.w16[size_t((row0 + r) * w.cols + c)]) * x16[size_t(t * w.cols + c)];
        s += p;
        mag += std::fabs(p);
      }
      const float got = y[size_t(t * y_stride + r)];
      ASSERT_LE(std::fabs(double(got) - s), 1e-4 * mag + 1e-30)
          << what << ": token " << t << " row " << r << ": got " << got << ", want " << s;
    }
}

MatArgs args_of(const Stack& w, int64_t rows, const float* x, float* y, int64_t n_tokens) {
  MatArgs a;
  a.w = w.bytes.data();
  a.row_bytes = w.rb;
  a.n_rows = rows;
  a.n_cols = w.cols;
  a.x = x;
  a.y = y;
  a.n_tokens = n_tokens;
  a.sm_count = 1;
  a.tables = test_q8::host_tables();
  return a;
}

template <GgmlType T>
void check_grouped(uint32_t seed) {
  using D = dq::Dq<T>;
  SCOPED_TRACE(gguf::traits(T).name);
  // 7 experts of 133 rows (two row tiles, the second of 5 rows); groups of 9 .. 200 tokens and one
  // empty; experts 1 and 6 left out of the tiles (below 9 tokens, at or past `hi`).
  const int64_t E = 7, F = 133, cols = cols_for(T);
  const std::vector<int32_t> counts = {9, 3, 40, 0, 130, 200, 250};
  const int64_t hi = 250;
  int64_t rows = 0;
  std::vector<int64_t> first;
  for (int32_t c : counts) first.push_back(rows), rows += c;
  const Stack gate(T, E * F, cols, seed), up(T, E * F, cols, seed + 100);
  const std::vector<float> x = test::randn(size_t(rows * cols), seed + 200), x16 = rounded(x);
  const ExpertTileLists lists = expert_tiles(counts.data(), E, 9, hi);
  // Widths: 32 for 9, the 2 past 130's first 128 and none else; 64 for 40; 128 for 130's first, 200's
  // first and its 72 after it.
  ASSERT_EQ(lists.of_width[0].size(), 2u);
  ASSERT_EQ(lists.of_width[1].size(), 1u);
  ASSERT_EQ(lists.of_width[2].size(), 3u);
  std::vector<float> y1[2], y2[2];
  for (int order = 0; order < 2; ++order) {
    y1[order].assign(size_t(rows * F), kUnwritten);
    y2[order].assign(size_t(rows * F), kUnwritten);
    MatArgs a = args_of(gate, F, x.data(), y1[order].data(), 0);
    a.more[0].w = up.bytes.data();
    a.more[0].y = y2[order].data();
    a.more[0].n_rows = E * F;
    a.more[0].row_bytes = up.rb;
    a.n_more = 1;
    const emu::Order o = order == 0 ? emu::Order::kForward : emu::Order::kReversed;
    for (int i = 0; i < 3; ++i) {
      const std::vector<ExpertTile>& l = lists.of_width[i];
      if (l.empty()) continue;
      const dim3 grid{unsigned((F + kTileM - 1) / kTileM), unsigned(l.size()), 2u};
      if (i == 0) emu::launch(gemm_kernel<D, 32>, grid, dim3(kGemmThreads), 0, o, a, 0, a.y, l.data());
      if (i == 1) emu::launch(gemm_kernel<D, 64>, grid, dim3(kGemmThreads), 0, o, a, 0, a.y, l.data());
      if (i == 2) emu::launch(gemm_kernel<D, 128>, grid, dim3(kGemmThreads), 0, o, a, 0, a.y, l.data());
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = counts[size_t(e)], f = first[size_t(e)];
    const std::string what = "expert " + std::to_string(e) + " (" + std::to_string(c) + " tokens)";
    if (c >= 9 && c < hi) {
      expect_rows(y1[0], F, gate, e * F, F, x16, f, f + c, "gate, " + what);
      expect_rows(y2[0], F, up, e * F, F, x16, f, f + c, "up, " + what);
    } else {
      for (int64_t i = f * F; i < (f + c) * F; ++i) {
        ASSERT_EQ(y1[0][size_t(i)], kUnwritten) << what << ": not tiled, written";
        ASSERT_EQ(y2[0][size_t(i)], kUnwritten) << what << ": not tiled, written";
      }
    }
  }
  EXPECT_EQ(std::memcmp(y1[0].data(), y1[1].data(), y1[0].size() * sizeof(float)), 0) << "thread orders differ";
  EXPECT_EQ(std::memcmp(y2[0].data(), y2[1].data(), y2[0].size() * sizeof(float)), 0) << "thread orders differ";
}

// One product of 150 rows x 45 tokens (the 64-token tile, a partial one) over 3 column splits: each
// split's partial sums, added in split order, are the product.
template <GgmlType T>
void check_split(uint32_t seed) {
  using D = dq::Dq<T>;
  SCOPED_TRACE(gguf::traits(T).name);
  const int64_t R = 150, N = 45, cols = cols_for(T);
  const Stack w(T, R, cols, seed);
  const std::vector<float> x = test::randn(size_t(N * cols), seed + 1), x16 = rounded(x);
  const int64_t steps = (cols + kTileK - 1) / kTileK, per = (steps + 2) / 3, splits = (steps + per - 1) / per;
  std::vector<float> parts(size_t(splits * N * R), kUnwritten);
  const MatArgs a = args_of(w, R, x.data(), nullptr, N);
  emu::launch(gemm_kernel<D, 64>, dim3(2, 1, unsigned(splits)), dim3(kGemmThreads), 0, emu::Order::kForward, a, int(per),
              parts.data(), static_cast<const ExpertTile*>(nullptr));
  std::vector<float> y(size_t(N * R), 0.0f);
  for (int64_t s = 0; s < splits; ++s)
    for (int64_t i = 0; i < N * R; ++i) y[size_t(i)] += parts[size_t(s * N * R + i)];
  expect_rows(y, R, w, 0, R, x16, 0, N, "split product");
}

TEST(GemmOnTheHost, ExpertTilesMatchTheReference) {
  check_grouped<GgmlType::F32>(1);
  check_grouped<GgmlType::BF16>(2);
  check_grouped<GgmlType::Q8_0>(3);
  check_grouped<GgmlType::MXFP4>(4);
  check_grouped<GgmlType::Q4_K>(5);
  check_grouped<GgmlType::Q6_K>(6);
  check_grouped<GgmlType::Q2_K>(7);
  check_grouped<GgmlType::IQ2_XS>(8);
  check_grouped<GgmlType::IQ1_S>(9);
}

TEST(GemmOnTheHost, ColumnSplitsAddUpToTheProduct) {
  check_split<GgmlType::F16>(11);
  check_split<GgmlType::Q4_0>(12);
  check_split<GgmlType::Q5_K>(13);
  check_split<GgmlType::IQ3_XXS>(14);
}

// The tile lists alone: every group in [lo, hi) covered once, in expert order, 128-token tiles then
// the narrowest width for the rest; the others skipped; bad counts refused.
TEST(GemmOnTheHost, ExpertTilesCoverTheGroupsInRange) {
  const std::vector<int32_t> counts = {0, 8, 9, 32, 33, 64, 65, 128, 129, 161, 300, 1000};
  const ExpertTileLists l = expert_tiles(counts.data(), int64_t(counts.size()), 9, 1000);
  std::vector<int64_t> covered(counts.size(), 0);
  int64_t first = 0;
  std::vector<int64_t> firsts;
  for (int32_t c : counts) firsts.push_back(first), first += c;
  for (int i = 0; i < 3; ++i) {
    int32_t last_expert = -1;
    for (const ExpertTile& t : l.of_width[i]) {
      ASSERT_GE(t.expert, last_expert) << "width " << kExpertTileWidths[i] << ": expert order";
      last_expert = t.expert;
      ASSERT_GT(t.count, 0);
      ASSERT_LE(t.count, kExpertTileWidths[i]);
      if (i > 0) ASSERT_GT(t.count, kExpertTileWidths[i - 1]) << "a narrower tile holds " << t.count;
      const int64_t f = firsts[size_t(t.expert)], c = counts[size_t(t.expert)];
      ASSERT_GE(t.first, f);
      ASSERT_LE(t.first + t.count, f + c);
      ASSERT_EQ((t.first - f) % 128, 0) << "tiles start every 128 tokens of a group";
      covered[size_t(t.expert)] += t.count;
    }
  }
  for (size_t e = 0; e < counts.size(); ++e) {
    const bool in = counts[e] >= 9 && counts[e] < 1000;
    EXPECT_EQ(covered[e], in ? counts[e] : 0) << "expert " << e << " of " << counts[e] << " tokens";
  }
  EXPECT_EQ(l.total(), 2u /*9, 32*/ + 2u /*33, 64*/ + 1u /*65*/ + 1u /*128*/ + 2u /*129*/ + 2u /*161*/ + 3u /*300*/);
  const std::vector<int32_t> bad = {4, -1};
  EXPECT_THROW(expert_tiles(bad.data(), 2, 9, 100), std::exception);
}

}  // namespace
}  // namespace sparsemla::cuda
