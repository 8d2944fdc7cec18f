// The CUDA products on quantized weights (ops/cuda/quant_matmul.h) against the CPU reference
// (ops/cpu/matmul.h) on the same weight bytes, for every supported type.
//
// Tolerances, as the relative L2 error of each token's output row:
//   decode (T <= 16, fp32 activations and fp32 weights): 1e-4. Only the summation order differs
//     from the CPU (typically ~1e-6); any decoding error of one element or one scale is far above.
//   prefill (T > 16, bf16 activations and weights): 1e-2. Each product w x carries two bf16
//     roundings (2^-9 relative at most, RMS ~1.6e-3 together); measured on an H200: 2.3e-3 to
//     4.4e-3 for most types, 5.5e-3 for Q2_K (random blocks whose large mins cancel in d*q - m,
//     so the rounded values carry more relative error than the result).
#include <gtest/gtest.h>

#include "gpu_test_util.h"

#if SPARSEMLA_HAVE_CUDA

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/quants.h"
#include "ops/cpu/matmul.h"
#include "ops/cpu/thread_pool.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/quant_matmul.h"
#include "test_util.h"
#include "util/half.h"

namespace sparsemla::cuda {
namespace {

using gguf::GgmlType;

const std::vector<std::string> kSupportedNames = {"f32",   "f16",    "bf16",  "q8_0",   "q4_0",    "iq4_nl", "mxfp4",
                                                  "q2_K",  "q3_K",   "q4_K",  "q5_K",   "q6_K",    "iq4_xs", "iq2_xxs",
                                                  "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s",   "iq1_m"};

constexpr double kDecodeTol = 1e-4;
constexpr double kPrefillTol = 1e-2;

ops::ThreadPool& pool() {
  static ops::ThreadPool p(0);
  return p;
}

using test::randn;

void put_fp16(uint8_t* p, float v) {
  const uint16_t h = f32_to_fp16(v);
  std::memcpy(p, &h, 2);
}

// Weight bytes of n_rows x n_cols: the formats the project can write are quantized from N(0, 1)
// rows; the others are random bytes (every grid index and sign pattern is valid) with their fp16
// scales (or MXFP4's exponent) replaced by small finite values.
std::vector<uint8_t> make_weight(GgmlType t, int64_t n_rows, int64_t n_cols, uint32_t seed) {
  const auto& tr = gguf::traits(t);
  const uint64_t rb = gguf::row_bytes(t, uint64_t(n_cols));
  std::vector<uint8_t> w(size_t(rb * n_rows));
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: case GgmlType::Q8_0: case GgmlType::Q4_0:
    case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K: {
      const std::vector<float> x = randn(size_t(n_rows * n_cols), seed);
      for (int64_t r = 0; r < n_rows; ++r) gguf::quantize_row(t, x.data() + r * n_cols, w.data() + r * rb, n_cols);
      return w;
    }
    default: break;
  }
  std::mt19937 rng(seed);
  for (uint8_t& b : w) b = uint8_t(rng());
  std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
  std::vector<int> fp16_at;  // offsets of fp16 scales within a block
  switch (t) {
    case GgmlType::Q2_K: fp16_at = {80, 82}; break;
    case GgmlType::Q3_K: fp16_at = {108}; break;
    case GgmlType::IQ4_NL: case GgmlType::IQ4_XS: case GgmlType::IQ2_XXS: case GgmlType::IQ2_XS:
    case GgmlType::IQ2_S: case GgmlType::IQ3_XXS: case GgmlType::IQ3_S: case GgmlType::IQ1_S: fp16_at = {0}; break;
    default: break;
  }
  for (size_t at = 0; at < w.size(); at += tr.type_size) {
    uint8_t* blk = w.data() + at;
    for (int o : fp16_at) put_fp16(blk + o, scale(rng));
    if (t == GgmlType::MXFP4) blk[0] = uint8_t(120 + rng() % 10);
    if (t == GgmlType::IQ1_M) {  // fp16 d in the top nibbles of the four u16 scales
      const uint16_t d = f32_to_fp16(scale(rng));
      for (int k = 0; k < 4; ++k) blk[49 + 2 * k] = uint8_t((blk[49 + 2 * k] & 0x0F) | (((d >> (4 * k)) & 0xF) << 4));
    }
  }
  return w;
}

// A weight on the host (for the CPU reference) and on the device.
struct TestWeight {
  std::vector<uint8_t> bytes;
  ops::Weight host;
  DeviceBuffer dev;
  QuantMatrix mat;

  TestWeight(GgmlType t, int64_t n_rows, int64_t n_cols, uint32_t seed)
      : bytes(make_weight(t, n_rows, n_cols, seed)), dev(to_device(bytes)) {
    host.type = mat.type = t;
    host.n_cols = mat.n_cols = n_cols;
    host.n_rows = mat.n_rows = n_rows;
    host.row_bytes = mat.row_bytes = gguf::row_bytes(t, uint64_t(n_cols));
    host.data = bytes.data();
    mat.data = dev.get();
  }
};

using ProductFn = void (*)(const QuantMatrix&, const float*, int64_t, float*, Stream);

std::vector<float> gpu_product(ProductFn fn, const QuantMatrix& m, const std::vector<float>& x, int64_t T) {
  const DeviceBuffer dx = to_device(x);
  DeviceBuffer dy(size_t(T * m.n_rows) * sizeof(float));
  fn(m, dx.as<float>(), T, dy.as<float>(), nullptr);
  synchronize();
  return to_host<float>(dy, size_t(T * m.n_rows));
}

// NaN/inf positions first, then each token's relative L2 error; returns the largest.
double check_close(const std::vector<float>& got, const std::vector<float>& want, int64_t T, int64_t n_rows,
                   double tol, const std::string& what) {
  double worst = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    double err = 0.0, norm = 0.0;
    for (int64_t r = 0; r < n_rows; ++r) {
      const float g = got[size_t(t * n_rows + r)], c = want[size_t(t * n_rows + r)];
      if (std::isfinite(g) != std::isfinite(c)) {
        ADD_FAILURE() << what << ": token " << t << " row " << r << ": got " << g << ", want " << c;
        return INFINITY;
      }
      err += (double(g) - c) * (double(g) - c);
      norm += double(c) * c;
    }
    const double rel = std::sqrt(err / std::max(norm, 1e-30));
    worst = std::max(worst, rel);
    if (rel > tol) {
      ADD_FAILURE() << what << ": token " << t << " relative error " << rel << " > " << tol;
      return rel;
    }
  }
  return worst;
}

struct Shape {
  int64_t n_rows, n_cols;
};

// Rows never a multiple of the 128-row tile or the 4-row decode block; columns an odd number of
// blocks (misaligned rows for the 2-byte aligned formats) and, for the small blocks, not a
// multiple of the 64-column tile either. 8960 columns give the decode kernel its largest thread
// count (256) with units left over after the unrolled steps, 768 and 256 its smallest (32) with
// idle threads.
std::vector<Shape> shapes_for(GgmlType t) {
  std::vector<Shape> s = {{67, 768}, {131, 256}, {19, 8960}};
  const uint32_t bs = gguf::traits(t).block_size;
  if (bs == 1) s.push_back({33, 200});
  if (bs == 32) s.push_back({33, 160});
  return s;
}

class CudaMatmul : public ::testing::TestWithParam<std::string> {
 protected:
  GgmlType type() const { return *gguf::type_from_name(GetParam()); }
};

TEST_P(CudaMatmul, MatchesCpuForEveryShapeAndTokenCount) {
  SPARSEMLA_REQUIRE_GPU();
  ASSERT_TRUE(supported(type()));
  uint32_t seed = 1;
  for (const Shape& sh : shapes_for(type())) {
    const TestWeight w(type(), sh.n_rows, sh.n_cols, seed++);
    double worst_decode = 0, worst_prefill = 0;
    for (int64_t T : {1, 2, 3, 7, 16, 17, 64, 100}) {
      const std::vector<float> x = randn(size_t(T * sh.n_cols), seed++);
      std::vector<float> want(size_t(T * sh.n_rows));
      ops::matmul(w.host, x.data(), T, want.data(), pool());
      const std::vector<float> got = gpu_product(&matmul, w.mat, x, T);
      const bool decode = T <= kDecodeMaxTokens;
      const std::string what = GetParam() + " " + std::to_string(sh.n_rows) + "x" + std::to_string(sh.n_cols) +
                               " T=" + std::to_string(T);
      const double e = check_close(got, want, T, sh.n_rows, decode ? kDecodeTol : kPrefillTol, what);
      (decode ? worst_decode : worst_prefill) = std::max(decode ? worst_decode : worst_prefill, e);
    }
    std::printf("  %-8s %4lldx%-4lld  worst relative error: decode %.2e  prefill %.2e\n", GetParam().c_str(),
                (long long)sh.n_rows, (long long)sh.n_cols, worst_decode, worst_prefill);
  }
}

// The decode kernel at any token count against the CPU, and the prefill kernel at few tokens.
TEST_P(CudaMatmul, BothKernelsTakeAnyTokenCount) {
  SPARSEMLA_REQUIRE_GPU();
  const TestWeight w(type(), 45, 512, 7);
  for (int64_t T : {1, 5, 40}) {
    const std::vector<float> x = randn(size_t(T * 512), 100 + uint32_t(T));
    std::vector<float> want(size_t(T * 45));
    ops::matmul(w.host, x.data(), T, want.data(), pool());
    check_close(gpu_product(&matmul_decode, w.mat, x, T), want, T, 45, kDecodeTol, GetParam() + " decode T=" + std::to_string(T));
    check_close(gpu_product(&matmul_prefill, w.mat, x, T), want, T, 45, kPrefillTol, GetParam() + " prefill T=" + std::to_string(T));
  }
}

// Token t of a T-token decode product has the same bits as that token alone.
TEST_P(CudaMatmul, DecodeIsBatchInvariant) {
  SPARSEMLA_REQUIRE_GPU();
  const TestWeight w(type(), 37, 768, 11);
  for (int64_t T : {2, 3, 7, 16, 23}) {
    const std::vector<float> x = randn(size_t(T * 768), 200 + uint32_t(T));
    const std::vector<float> batch = gpu_product(&matmul_decode, w.mat, x, T);
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<float> xt(x.begin() + t * 768, x.begin() + (t + 1) * 768);
      const std::vector<float> alone = gpu_product(&matmul_decode, w.mat, xt, 1);
      ASSERT_EQ(std::memcmp(alone.data(), batch.data() + t * 37, 37 * sizeof(float)), 0)
          << GetParam() << " T=" << T << " token " << t << " differs from the token alone";
    }
  }
}

// Expert mode: each (token, expert) pair equals the one-token product on that expert's rows, bit
// for bit, and the CPU product to the decode tolerance; pairs with id -1 leave their rows alone.
TEST_P(CudaMatmul, ExpertPairsEqualOneTokenProductsOnTheExpertRows) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t E = 5, F = 18, H = 768, tokens = 3, k = 3;
  const TestWeight w(type(), E * F, H, 21);
  const std::vector<int32_t> ids = {4, 0, 2, 1, 1, -1, 3, 0, 4};  // [tokens, k]
  const std::vector<float> x = randn(size_t(tokens * H), 77);
  const DeviceBuffer dx = to_device(x), dids = to_device(ids);
  const int64_t P = int64_t(ids.size());
  std::vector<float> fill(size_t(P * F), 12345.0f);
  DeviceBuffer dy = to_device(fill);
  matmul_experts(w.mat, F, dids.as<int32_t>(), P, dx.as<float>(), k, dy.as<float>(), nullptr);
  synchronize();
  const std::vector<float> y = to_host<float>(dy, size_t(P * F));
  for (int64_t p = 0; p < P; ++p) {
    const int32_t e = ids[size_t(p)];
    if (e < 0) {
      for (int64_t r = 0; r < F; ++r) ASSERT_EQ(y[size_t(p * F + r)], 12345.0f) << "unused pair written";
      continue;
    }
    QuantMatrix m = w.mat;
    m.n_rows = F;
    m.data = static_cast<const uint8_t*>(w.mat.data) + uint64_t(e) * F * w.mat.row_bytes;
    const std::vector<float> xt(x.begin() + (p / k) * H, x.begin() + (p / k + 1) * H);
    const std::vector<float> alone = gpu_product(&matmul_decode, m, xt, 1);
    ASSERT_EQ(std::memcmp(alone.data(), y.data() + p * F, size_t(F) * sizeof(float)), 0)
        << GetParam() << " pair " << p << " (expert " << e << ") differs from the one-token product";
    std::vector<float> want(static_cast<size_t>(F));
    ops::matmul(w.host.rows(e * F, F), xt.data(), 1, want.data(), pool());
    const std::vector<float> got(y.begin() + p * F, y.begin() + (p + 1) * F);
    check_close(got, want, 1, F, kDecodeTol, GetParam() + " expert pair");
  }
}

// Row lookup equals the CPU's dequantize_row bit for bit; negative ids give zero rows (another
// rank's vocabulary), ids past the end NaN rows.
TEST_P(CudaMatmul, DequantizeRowsEqualsCpuBitForBit) {
  SPARSEMLA_REQUIRE_GPU();
  for (const Shape& sh : shapes_for(type())) {
    const TestWeight w(type(), sh.n_rows, sh.n_cols, 13);
    const std::vector<int32_t> ids = {0, int32_t(sh.n_rows - 1), 5, 5, 17, -1, int32_t(sh.n_rows)};
    const DeviceBuffer dids = to_device(ids);
    DeviceBuffer dout(ids.size() * size_t(sh.n_cols) * sizeof(float));
    dequantize_rows(w.mat, dids.as<int32_t>(), int64_t(ids.size()), dout.as<float>(), nullptr);
    synchronize();
    const std::vector<float> got = to_host<float>(dout, ids.size() * size_t(sh.n_cols));
    std::vector<float> want(size_t(sh.n_cols));
    for (size_t i = 0; i < ids.size(); ++i) {
      const float* g = got.data() + i * size_t(sh.n_cols);
      if (ids[i] < 0) {
        for (int64_t c = 0; c < sh.n_cols; ++c) ASSERT_EQ(f32_to_bits(g[c]), 0u) << "id " << ids[i];
        continue;
      }
      if (ids[i] >= sh.n_rows) {
        for (int64_t c = 0; c < sh.n_cols; ++c) ASSERT_TRUE(std::isnan(g[c])) << "id " << ids[i];
        continue;
      }
      ops::dequantize_row(w.host, ids[i], want.data());
      for (int64_t c = 0; c < sh.n_cols; ++c)
        ASSERT_EQ(f32_to_bits(g[c]), f32_to_bits(want[size_t(c)]))
            << GetParam() << " row " << ids[i] << " col " << c << ": " << g[c] << " vs " << want[size_t(c)];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, CudaMatmul, ::testing::ValuesIn(kSupportedNames),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(CudaMatmulApi, SupportedIsExactlyTheTestedTypes) {
  SPARSEMLA_REQUIRE_GPU();
  size_t n = 0;
  const gguf::TypeTraits* all = gguf::all_types(&n);
  for (size_t i = 0; i < n; ++i) {
    bool tested = false;
    for (const std::string& name : kSupportedNames) tested |= gguf::type_from_name(name) == all[i].type;
    EXPECT_EQ(supported(all[i].type), tested) << all[i].name;
  }
}

// A column slice (a tensor-parallel shard of the input dimension) keeps the full row stride.
TEST(CudaMatmulApi, ColumnSlicesReadStridedRows) {
  SPARSEMLA_REQUIRE_GPU();
  for (GgmlType t : {GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::BF16}) {
    const auto& tr = gguf::traits(t);
    const int64_t first = tr.block_size == 256 ? 256 : 32, count = 512;
    const TestWeight w(t, 41, 1024, 3);
    const uint64_t offset = uint64_t(first) / tr.block_size * tr.type_size;
    ops::Weight hs = w.host;
    hs.n_cols = count;
    hs.data += offset;
    QuantMatrix ds = w.mat;
    ds.n_cols = count;
    ds.data = static_cast<const uint8_t*>(w.mat.data) + offset;
    for (int64_t T : {1, 5, 33}) {
      const std::vector<float> x = randn(size_t(T * count), 300 + uint32_t(T));
      std::vector<float> want(size_t(T * 41));
      ops::matmul(hs, x.data(), T, want.data(), pool());
      check_close(gpu_product(&matmul, ds, x, T), want, T, 41, T <= kDecodeMaxTokens ? kDecodeTol : kPrefillTol,
                  std::string(tr.name) + " column slice T=" + std::to_string(T));
    }
  }
}

TEST(CudaMatmulApi, RefusalsNameTheProblem) {
  SPARSEMLA_REQUIRE_GPU();
  DeviceBuffer buf(1 << 16);
  QuantMatrix m;
  m.type = GgmlType::Q4_1;
  m.n_rows = 4;
  m.n_cols = 64;
  m.row_bytes = gguf::row_bytes(m.type, 64);
  m.data = buf.get();
  float* x = buf.as<float>() + 1024;
  float* y = buf.as<float>() + 4096;
  EXPECT_NE(test::error_of([&] { matmul(m, x, 1, y, nullptr); }).find("q4_1"), std::string::npos);
  m.type = GgmlType::Q4_K;
  m.n_cols = 300;
  EXPECT_NE(test::error_of([&] { matmul(m, x, 1, y, nullptr); }).find("multiple of 256"), std::string::npos);
  m.n_cols = 256;
  m.row_bytes = 100;
  EXPECT_NE(test::error_of([&] { matmul(m, x, 1, y, nullptr); }).find("row_bytes"), std::string::npos);
  m.row_bytes = gguf::row_bytes(m.type, 256);
  EXPECT_NE(test::error_of([&] { matmul(m, x + 1, 1, y, nullptr); }).find("aligned"), std::string::npos);
  EXPECT_EQ(test::error_of([&] { matmul(m, x, 0, y, nullptr); }), "(no error)");
}

}  // namespace
}  // namespace sparsemla::cuda

#else

TEST(CudaMatmul, Skipped) { GTEST_SKIP() << "built without CUDA"; }

#endif
