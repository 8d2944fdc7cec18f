// The CUDA products on quantized weights (ops/cuda/quant_matmul.h) against the CPU reference
// (ops/cpu/matmul.h) on the same weight bytes, for every supported type; and the int8-activation
// products (ops/cuda/quant_matmul_q8.h) against the dequantized weight times the dequantized
// activations (tolerances beside those tests).
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

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/quants.h"
#include "ops/cpu/matmul.h"
#include "ops/cpu/thread_pool.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/moe_router.h"
#include "ops/cuda/quant_matmul.h"
#include "ops/cuda/quant_matmul_q8.h"
#include "quant_test_util.h"
#include "test_util.h"
#include "util/half.h"

namespace sparsemla::cuda {
namespace {

using gguf::GgmlType;
using test_q8::dequantized;
using test_q8::HostQ8;
using test_q8::make_weight;
using test_q8::quantize_on_host;

const std::vector<std::string> kSupportedNames = {"f32",   "f16",    "bf16",  "q8_0",   "q4_0",    "iq4_nl", "mxfp4",
                                                  "q2_K",  "q3_K",   "q4_K",  "q5_K",   "q6_K",    "iq4_xs", "iq2_xxs",
                                                  "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s",   "iq1_m"};

constexpr double kDecodeTol = 1e-4;
constexpr double kPrefillTol = 1e-2;
// The one-token tensor-core kernel: only the activations rounded to bf16 (2^-9 relative each).
constexpr double kOneTokenTol = 4e-3;
// What matmul's few-token products reach: the fp32 decode kernel's rounding, or for the types with
// a tensor-core decode kernel (bf16 weights and activations) the prefill kernel's.
double few_token_tol(GgmlType t, int64_t T) {
  if (T == 1 && mma_one_token_supported(t)) return kOneTokenTol;
  return T >= mma_min_tokens(t) ? kPrefillTol : kDecodeTol;
}

ops::ThreadPool& pool() {
  static ops::ThreadPool p(0);
  return p;
}

using test::randn;

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

// Rows [e F, (e + 1) F) of a stack of experts, as a matrix of their own.
QuantMatrix expert_rows(const QuantMatrix& w, int64_t e, int64_t F) {
  QuantMatrix m = w;
  m.n_rows = F;
  m.data = static_cast<const uint8_t*>(w.data) + uint64_t(e) * uint64_t(F) * w.row_bytes;
  return m;
}

using ProductFn = void (*)(const QuantMatrix&, const float*, int64_t, float*, Stream);

std::vector<float> gpu_product(ProductFn fn, const QuantMatrix& m, const std::vector<float>& x, int64_t T) {
  const DeviceBuffer dx = to_device(x);
  DeviceBuffer dy(size_t(T * m.n_rows) * sizeof(float));
  fn(m, dx.as<float>(), T, dy.as<float>(), nullptr);
  synchronize();
  return to_host<float>(dy, size_t(T * m.n_rows));
}

// matmul_decode_mma_one's y = W x for one token, into a poisoned buffer: every row must be written.
std::vector<float> one_token_product(const QuantMatrix& m, const std::vector<float>& x) {
  const DeviceBuffer dx = to_device(x);
  DeviceBuffer dy = to_device(std::vector<float>(size_t(m.n_rows), NAN));
  matmul_decode_mma_one(m, dx.as<float>(), dy.as<float>(), nullptr);
  synchronize();
  return to_host<float>(dy, size_t(m.n_rows));
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
    // Prefill token tiles: 32 (T = 17, 32), 64 (40, 64) and 128 (100), whole and partial.
    for (int64_t T : {1, 2, 3, 7, 16, 17, 32, 40, 64, 100}) {
      const std::vector<float> x = randn(size_t(T * sh.n_cols), seed++);
      std::vector<float> want(size_t(T * sh.n_rows));
      ops::matmul(w.host, x.data(), T, want.data(), pool());
      const std::vector<float> got = gpu_product(&matmul, w.mat, x, T);
      const bool decode = T <= kDecodeMaxTokens;
      const std::string what = GetParam() + " " + std::to_string(sh.n_rows) + "x" + std::to_string(sh.n_cols) +
                               " T=" + std::to_string(T);
      const double e = check_close(got, want, T, sh.n_rows, decode ? few_token_tol(type(), T) : kPrefillTol, what);
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

// Token t of a T-token product of a 37 x 768 weight has the same bits as that token alone.
// product(x, T): the product's [T, 37] output for activations x: [T, 768].
using Product = std::function<std::vector<float>(const std::vector<float>&, int64_t)>;
void expect_batch_invariant(const std::string& what, uint32_t seed, const Product& product) {
  for (int64_t T : {2, 3, 7, 16, 23}) {
    const std::vector<float> x = randn(size_t(T * 768), seed + uint32_t(T));
    const std::vector<float> batch = product(x, T);
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<float> xt(x.begin() + t * 768, x.begin() + (t + 1) * 768);
      const std::vector<float> alone = product(xt, 1);
      ASSERT_EQ(std::memcmp(alone.data(), batch.data() + t * 37, 37 * sizeof(float)), 0)
          << what << " T=" << T << " token " << t << " differs from the token alone";
    }
  }
}

TEST_P(CudaMatmul, DecodeIsBatchInvariant) {
  SPARSEMLA_REQUIRE_GPU();
  const TestWeight w(type(), 37, 768, 11);
  expect_batch_invariant(GetParam(), 200, [&](const std::vector<float>& x, int64_t T) {
    return gpu_product(&matmul_decode, w.mat, x, T);
  });
  if (!mma_decode_supported(type())) return;
  // The tensor-core decode kernel: 8 tokens per pass, so T = 16 and 23 take several passes.
  expect_batch_invariant(GetParam() + " tensor cores", 300, [&](const std::vector<float>& x, int64_t T) {
    return gpu_product(&matmul_decode_mma, w.mat, x, T);
  });
}

// The tensor-core decode kernel on the shapes of matmul's test at every pass width, directly (matmul
// takes it only up to kDecodeMaxTokens), and its refusal of the types it lacks.
TEST_P(CudaMatmul, TensorCoreDecodeMatchesCpu) {
  SPARSEMLA_REQUIRE_GPU();
  if (!mma_decode_supported(type())) {
    const TestWeight w(type(), 16, 256, 5);
    EXPECT_NE(test::error_of([&] { gpu_product(&matmul_decode_mma, w.mat, randn(256, 5), 1); })
                  .find("no tensor-core decode kernel for " + GetParam()),
              std::string::npos);
    return;
  }
  uint32_t seed = 500;
  for (const Shape& sh : shapes_for(type()))
    for (int64_t T : {1, 2, 8, 9, 20}) {
      const TestWeight w(type(), sh.n_rows, sh.n_cols, seed++);
      const std::vector<float> x = randn(size_t(T * sh.n_cols), seed++);
      std::vector<float> want(size_t(T * sh.n_rows));
      ops::matmul(w.host, x.data(), T, want.data(), pool());
      check_close(gpu_product(&matmul_decode_mma, w.mat, x, T), want, T, sh.n_rows, kPrefillTol,
                  GetParam() + " tensor-core decode " + std::to_string(sh.n_rows) + "x" + std::to_string(sh.n_cols) +
                      " T=" + std::to_string(T));
    }
}

// The one-token tensor-core kernel against the CPU on shapes with row tails, 1 to 35 blocks of 256
// per row (partial rounds of the warps) and many tiles per block; it refuses the types it lacks.
TEST_P(CudaMatmul, OneTokenTensorCoreKernelMatchesCpu) {
  SPARSEMLA_REQUIRE_GPU();
  if (!mma_one_token_supported(type())) {
    const TestWeight w(type(), 16, 256, 5);
    EXPECT_NE(test::error_of([&] { one_token_product(w.mat, randn(256, 5)); })
                  .find("no one-token tensor-core kernel for " + GetParam()),
              std::string::npos);
    return;
  }
  uint32_t seed = 700;
  double worst = 0;
  // 20000 rows: 1250 tiles of 16, more than one per block of the persistent kernel on any GPU; rows
  // of GLM-5's widths (6144, 16384) and of the widest the kernel stages.
  for (const Shape& sh : {Shape{67, 768}, Shape{131, 256}, Shape{19, 8960}, Shape{40, 2560}, Shape{16, 4096},
                          Shape{20000, 512}, Shape{50, 6144}, Shape{24, 16384}, Shape{8, kOneTokenMaxCols}}) {
    const TestWeight w(type(), sh.n_rows, sh.n_cols, seed++);
    const std::vector<float> x = randn(size_t(sh.n_cols), seed++);
    std::vector<float> want(size_t(sh.n_rows));
    ops::matmul(w.host, x.data(), 1, want.data(), pool());
    worst = std::max(worst, check_close(one_token_product(w.mat, x), want, 1, sh.n_rows, kOneTokenTol,
                                        GetParam() + " one-token " + std::to_string(sh.n_rows) + "x" +
                                            std::to_string(sh.n_cols)));
  }
  std::printf("  %s one-token tensor-core kernel: worst relative error %.2e\n", GetParam().c_str(), worst);
}

// One token: matmul takes the one-token tensor-core kernel for the types that have it, else the
// fp32 decode kernel, on a one-wave and a many-wave grid (67 and 6400 rows); bit for bit the
// kernel's own result, and within that kernel's tolerance of the CPU.
TEST_P(CudaMatmul, OneTokenTakesTheOneTokenKernelWhereTheTypeHasIt) {
  SPARSEMLA_REQUIRE_GPU();
  uint32_t seed = 900;
  const bool one = mma_one_token_supported(type());
  EXPECT_EQ(one, type() == GgmlType::Q4_K) << GetParam();
  for (const Shape& sh : {Shape{67, 768}, Shape{6400, 256}}) {
    const TestWeight w(type(), sh.n_rows, sh.n_cols, seed++);
    const std::vector<float> x = randn(size_t(sh.n_cols), seed++);
    std::vector<float> want(size_t(sh.n_rows));
    ops::matmul(w.host, x.data(), 1, want.data(), pool());
    const std::vector<float> got = gpu_product(&matmul, w.mat, x, 1);
    const std::vector<float> kernel = one ? one_token_product(w.mat, x) : gpu_product(&matmul_decode, w.mat, x, 1);
    const std::string what = GetParam() + " " + std::to_string(sh.n_rows) + "x" + std::to_string(sh.n_cols) + " T=1";
    EXPECT_EQ(std::memcmp(got.data(), kernel.data(), got.size() * sizeof(float)), 0) << what << ": not the chosen kernel's bits";
    check_close(got, want, 1, sh.n_rows, one ? kOneTokenTol : kDecodeTol, what);
  }
}

// Wider than the one-token kernel stages (kOneTokenMaxCols): matmul takes the fp32 kernel for one
// token, bit for bit, and the one-token entry refuses the shape by name.
TEST_P(CudaMatmul, OneTokenPastTheStagedWidthTakesTheFp32Kernel) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t n_cols = kOneTokenMaxCols + 256;
  const TestWeight w(type(), 24, n_cols, 31);
  const std::vector<float> x = randn(size_t(n_cols), 32);
  const std::vector<float> got = gpu_product(&matmul, w.mat, x, 1), fp32 = gpu_product(&matmul_decode, w.mat, x, 1);
  EXPECT_EQ(std::memcmp(got.data(), fp32.data(), got.size() * sizeof(float)), 0) << GetParam();
  EXPECT_FALSE(mma_one_token_takes(w.mat));
  if (mma_one_token_supported(type())) {
    const std::string err = test::error_of([&] { one_token_product(w.mat, x); });
    EXPECT_NE(err.find(std::to_string(n_cols) + " columns"), std::string::npos) << err;
  }
}

// Activations of very different sizes from group to group, large (x 1e6) and small (x 1e-6 ..
// 1e-3), with groups of zeros: the one-token kernel's staged bf16 values and group sums stay within
// its tolerance of the CPU.
TEST_P(CudaMatmul, OneTokenKernelKeepsLargeAndSmallActivations) {
  SPARSEMLA_REQUIRE_GPU();
  if (!mma_one_token_supported(type())) return;
  const int64_t n_rows = 40, n_cols = 2048;
  const TestWeight w(type(), n_rows, n_cols, 41);
  const std::vector<std::vector<float>> sizes = {{1e6f, 1.0f, 3e5f, 0.0f}, {1e-6f, 3e-4f, 0.0f, 1e-3f}};
  for (const std::vector<float>& size : sizes) {
    std::vector<float> x = randn(size_t(n_cols), 42);
    for (int64_t i = 0; i < n_cols; ++i) x[size_t(i)] *= size[size_t(i / 32) % size.size()];
    std::vector<float> want(static_cast<size_t>(n_rows));
    ops::matmul(w.host, x.data(), 1, want.data(), pool());
    check_close(one_token_product(w.mat, x), want, 1, n_rows, kOneTokenTol,
                GetParam() + " one-token, activations x " + std::to_string(size[0]));
  }
}

// Expert-mode output y [P = ids.size(), F] over activations x [tokens, H], pair p reading token
// p / k: an unused pair (id -1) must have left its row at kUnwritten; check(p, expert, the pair's
// activations, its output row) judges each used pair.
constexpr float kUnwritten = 12345.0f;
void check_expert_pairs(const std::vector<float>& y, const std::vector<int32_t>& ids, int64_t F, int64_t H,
                        int64_t k, const std::vector<float>& x,
                        const std::function<void(int64_t, int32_t, const std::vector<float>&,
                                                 const std::vector<float>&)>& check) {
  for (int64_t p = 0; p < int64_t(ids.size()); ++p) {
    const int32_t e = ids[size_t(p)];
    if (e < 0) {
      for (int64_t r = 0; r < F; ++r) ASSERT_EQ(y[size_t(p * F + r)], kUnwritten) << "unused pair written";
      continue;
    }
    const std::vector<float> xt(x.begin() + (p / k) * H, x.begin() + (p / k + 1) * H);
    check(p, e, xt, std::vector<float>(y.begin() + p * F, y.begin() + (p + 1) * F));
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
  // Every kernel the type has: the fp32 decode kernel, the tensor-core one, the one-token one.
  for (const ExpertKernel kernel : {ExpertKernel::kFp32, ExpertKernel::kTensorCores, ExpertKernel::kOneToken}) {
    if (kernel == ExpertKernel::kTensorCores && !mma_decode_supported(type())) continue;
    if (kernel == ExpertKernel::kOneToken && !mma_one_token_supported(type())) {
      const std::string err = test::error_of([&] {
        matmul_experts(w.mat, F, dids.as<int32_t>(), P, dx.as<float>(), k, nullptr, nullptr, kernel);
      });
      EXPECT_NE(err.find("no one-token tensor-core kernel for " + GetParam()), std::string::npos) << err;
      continue;
    }
    DeviceBuffer dy = to_device(std::vector<float>(size_t(P * F), kUnwritten));
    matmul_experts(w.mat, F, dids.as<int32_t>(), P, dx.as<float>(), k, dy.as<float>(), nullptr, kernel);
    synchronize();
    const std::string what = GetParam() + (kernel == ExpertKernel::kTensorCores ? " tensor cores"
                                           : kernel == ExpertKernel::kOneToken  ? " one-token tensor cores"
                                                                                : "");
    check_expert_pairs(to_host<float>(dy, size_t(P * F)), ids, F, H, k, x,
                       [&](int64_t p, int32_t e, const std::vector<float>& xt, const std::vector<float>& got) {
                         const QuantMatrix rows = expert_rows(w.mat, e, F);
                         const std::vector<float> alone =
                             kernel == ExpertKernel::kFp32          ? gpu_product(&matmul_decode, rows, xt, 1)
                             : kernel == ExpertKernel::kTensorCores ? gpu_product(&matmul_decode_mma, rows, xt, 1)
                                                                    : one_token_product(rows, xt);
                         EXPECT_EQ(std::memcmp(alone.data(), got.data(), size_t(F) * sizeof(float)), 0)
                             << what << " pair " << p << " (expert " << e << ") differs from the one-token product";
                         std::vector<float> want(static_cast<size_t>(F));
                         ops::matmul(w.host.rows(e * F, F), xt.data(), 1, want.data(), pool());
                         check_close(got, want, 1, F, kernel == ExpertKernel::kFp32 ? kDecodeTol : kPrefillTol,
                                     what + " expert pair");
                       });
  }
}

// A shared expert run as one more pair (SharedPair): the routed pairs' rows are those of the call
// without it, and its row n_pairs has the bits of its own one-token product by the kernel's entry
// (matmul_decode, matmul_decode_mma, the one-token kernel) on activation row x_row; the same in the
// gate/up pair form. A shared matrix of another shape is refused.
TEST_P(CudaMatmul, SharedExpertPairEqualsItsOneTokenProduct) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t E = 4, F = 18, H = 768, k = 3;
  const TestWeight w(type(), E * F, H, 81), w2(type(), E * F, H, 82), sh(type(), F, H, 83), sh2(type(), F, H, 84),
      wrong(type(), F + 1, H, 85);
  const std::vector<int32_t> ids = {3, -1, 1};  // one token's k pairs, one slot unused
  const std::vector<float> x = randn(size_t(2 * H), 86);  // the shared expert reads row 1
  const DeviceBuffer dx = to_device(x), dids = to_device(ids);
  const std::vector<float> x1(x.begin() + H, x.end());
  for (const ExpertKernel kernel : {ExpertKernel::kFp32, ExpertKernel::kTensorCores, ExpertKernel::kOneToken}) {
    if (kernel == ExpertKernel::kTensorCores && !mma_decode_supported(type())) continue;
    if (kernel == ExpertKernel::kOneToken && !mma_one_token_supported(type())) continue;
    const std::string what = GetParam() + " kernel " + std::to_string(int(kernel));
    auto alone = [&](const QuantMatrix& m) {
      return kernel == ExpertKernel::kFp32          ? gpu_product(&matmul_decode, m, x1, 1)
             : kernel == ExpertKernel::kTensorCores ? gpu_product(&matmul_decode_mma, m, x1, 1)
                                                    : one_token_product(m, x1);
    };
    const std::vector<float> unwritten(size_t((k + 1) * F), kUnwritten);
    DeviceBuffer y = to_device(unwritten), y2 = to_device(unwritten), plain = to_device(unwritten);
    const SharedPair one{&sh.mat, nullptr, 1}, two{&sh.mat, &sh2.mat, 1};
    matmul_experts(w.mat, F, dids.as<int32_t>(), k, dx.as<float>(), k, plain.as<float>(), nullptr, kernel);
    matmul_experts(w.mat, F, dids.as<int32_t>(), k, dx.as<float>(), k, y.as<float>(), nullptr, kernel, &one);
    synchronize();
    const std::vector<float> got = to_host<float>(y, size_t((k + 1) * F));
    const std::vector<float> routed = to_host<float>(plain, size_t(k * F));
    EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + k * F), routed) << what << ": routed rows";
    EXPECT_EQ(std::vector<float>(got.begin() + k * F, got.end()), alone(sh.mat)) << what << ": shared row";
    // The gate/up form: both outputs, each with its shared matrix.
    DeviceBuffer g = to_device(unwritten);
    matmul_experts_pair(w.mat, w2.mat, F, dids.as<int32_t>(), k, dx.as<float>(), k, g.as<float>(), y2.as<float>(),
                        nullptr, kernel, &two);
    synchronize();
    const std::vector<float> g1 = to_host<float>(g, size_t((k + 1) * F)), g2 = to_host<float>(y2, size_t((k + 1) * F));
    EXPECT_EQ(g1, got) << what << ": pair, first";
    EXPECT_EQ(std::vector<float>(g2.begin() + k * F, g2.end()), alone(sh2.mat)) << what << ": pair, second shared row";
    EXPECT_EQ(g2[size_t(F)], kUnwritten) << what << ": the unused slot was written";
    const SharedPair bad{&wrong.mat, nullptr, 1};
    EXPECT_THROW(matmul_experts(w.mat, F, dids.as<int32_t>(), k, dx.as<float>(), k, y.as<float>(), nullptr, kernel, &bad),
                 Error)
        << what << ": a shared expert of another shape";
  }
}

// A pair of products of one input (an MLP's gate and up) in one launch: each output has the bits of
// its matrix's own product by the same entry (matmul, matmul_decode, matmul_experts), at one token
// (one launch, also for different row counts) and where the pair falls back to two calls (more
// tokens; experts of different shapes or the tensor-core expert kernel). Skipped expert slots (id
// -1) are left unwritten in both outputs.
TEST_P(CudaMatmul, PairsOfProductsEqualTheProductsAlone) {
  SPARSEMLA_REQUIRE_GPU();
  for (const Shape sh : {shapes_for(type())[0], shapes_for(type())[2]}) {
    const TestWeight w1(type(), sh.n_rows, sh.n_cols, 31), w2(type(), sh.n_rows, sh.n_cols, 32);
    const TestWeight other(type(), sh.n_rows + 5, sh.n_cols, 33);
    const std::string what = GetParam() + " " + std::to_string(sh.n_rows) + "x" + std::to_string(sh.n_cols);
    for (const int64_t T : {int64_t(1), int64_t(3)})
      for (const bool precise : {false, true})
        for (const QuantMatrix* second : {&w2.mat, &other.mat}) {
          const std::vector<float> x = randn(size_t(T * sh.n_cols), uint32_t(40 + T));
          const DeviceBuffer dx = to_device(x);
          DeviceBuffer y1(size_t(T * sh.n_rows) * 4), y2(size_t(T * second->n_rows) * 4);
          matmul_pair(w1.mat, *second, dx.as<float>(), T, y1.as<float>(), y2.as<float>(), nullptr, precise);
          synchronize();
          const ProductFn alone = precise ? &matmul_decode : &matmul;
          const std::string c = what + " T=" + std::to_string(T) + (precise ? " precise" : "") +
                                (second == &other.mat ? " (different shapes)" : "");
          EXPECT_EQ(to_host<float>(y1, size_t(T * sh.n_rows)), gpu_product(alone, w1.mat, x, T)) << c << ": first";
          EXPECT_EQ(to_host<float>(y2, size_t(T * second->n_rows)), gpu_product(alone, *second, x, T)) << c << ": second";
        }
    // Experts: 4 of 18 rows each, a token's pairs reading its activation row, one slot skipped.
    const int64_t F = 4, E = sh.n_rows / F, k = 2;
    if (E < 3) continue;
    const std::vector<int32_t> ids = {2, 0, -1, 1};  // [2 tokens, k]
    const int64_t P = int64_t(ids.size());
    const std::vector<float> x = randn(size_t(2 * sh.n_cols), 50);
    const DeviceBuffer dx = to_device(x), dids = to_device(ids);
    const QuantMatrix e1 = expert_rows(w1.mat, 0, E * F), e2 = expert_rows(w2.mat, 0, E * F);
    for (const ExpertKernel kernel : {ExpertKernel::kFp32, ExpertKernel::kTensorCores, ExpertKernel::kOneToken}) {
      if (kernel == ExpertKernel::kTensorCores && !mma_decode_supported(type())) continue;
      if (kernel == ExpertKernel::kOneToken && !mma_one_token_supported(type())) continue;
      const std::vector<float> unwritten(size_t(P * F), kUnwritten);
      DeviceBuffer y1 = to_device(unwritten), y2 = to_device(unwritten), a1 = to_device(unwritten),
                   a2 = to_device(unwritten);
      matmul_experts_pair(e1, e2, F, dids.as<int32_t>(), P, dx.as<float>(), k, y1.as<float>(), y2.as<float>(), nullptr,
                          kernel);
      matmul_experts(e1, F, dids.as<int32_t>(), P, dx.as<float>(), k, a1.as<float>(), nullptr, kernel);
      matmul_experts(e2, F, dids.as<int32_t>(), P, dx.as<float>(), k, a2.as<float>(), nullptr, kernel);
      synchronize();
      const std::string c = what + " experts, kernel " + std::to_string(int(kernel));
      const std::vector<float> g1 = to_host<float>(y1, size_t(P * F)), g2 = to_host<float>(y2, size_t(P * F));
      EXPECT_EQ(g1, to_host<float>(a1, size_t(P * F))) << c << ": first";
      EXPECT_EQ(g2, to_host<float>(a2, size_t(P * F))) << c << ": second";
      EXPECT_EQ(g1[size_t(2 * F)], kUnwritten) << c << ": a skipped slot was written";
      EXPECT_NE(g1, g2) << c << ": both outputs from one matrix";
    }
  }
}

// Up to four products of one input (an attention's q_a, kv_a and index-key products): at one token
// those of one type share a launch whatever their row counts (a grid over the most rows, the blocks
// past a product's rows leaving), and each output has the bits of its matrix's own product by the
// same entry (matmul, or matmul_decode when precise); a product of another type runs alone; more
// tokens take a call each, but for those that take cuBLAS at prefill sizes, which share one bf16
// rounding of x (prefill_blas_many) and must still give each product's own bits. More than four
// are refused.
TEST_P(CudaMatmul, ManyProductsEqualTheProductsAlone) {
  SPARSEMLA_REQUIRE_GPU();
  const Shape sh = shapes_for(type())[0];
  const TestWeight a(type(), sh.n_rows, sh.n_cols, 61), b(type(), 3, sh.n_cols, 62),
      c(type(), 2 * sh.n_rows + 16, sh.n_cols, 63), other(GgmlType::F32, 40, sh.n_cols, 64);
  const std::vector<const TestWeight*> ws = {&a, &b, &other, &c};
  const int64_t blas_T = kBlasMinTokensMax + 37;  // (past every type's blas_min_tokens)
  for (const int64_t T : {int64_t(1), int64_t(2), blas_T})
    for (const bool precise : {false, true})
      for (const int n : {3, 4}) {  // three of one type; then the other type among them
        std::vector<QuantMatrix> mats;
        for (int i = 0; i < 4 && int(mats.size()) < n; ++i)
          if (n == 4 || ws[size_t(i)] != &other) mats.push_back(ws[size_t(i)]->mat);
        const std::vector<float> x = randn(size_t(T * sh.n_cols), uint32_t(70 + T));
        const DeviceBuffer dx = to_device(x);
        std::vector<DeviceBuffer> ys;
        std::vector<float*> yp;
        for (const QuantMatrix& m : mats) {
          ys.push_back(to_device(std::vector<float>(size_t(T * m.n_rows), kUnwritten)));
          yp.push_back(ys.back().as<float>());
        }
        const int64_t calls = prefill_blas_calls();
        matmul_many(mats.data(), yp.data(), int(mats.size()), dx.as<float>(), T, nullptr, precise);
        synchronize();
        if (T == blas_T && !precise)  // every product here takes cuBLAS from blas_min_tokens of its type
          EXPECT_EQ(prefill_blas_calls() - calls, int64_t(mats.size())) << GetParam() << ": products not through cuBLAS";
        const ProductFn alone = precise ? &matmul_decode : &matmul;
        for (size_t i = 0; i < mats.size(); ++i)
          EXPECT_EQ(to_host<float>(ys[i], size_t(T * mats[i].n_rows)), gpu_product(alone, mats[i], x, T))
              << GetParam() << " T=" << T << (precise ? " precise" : "") << ", " << mats.size() << " products: product "
              << i << " (" << mats[i].n_rows << " rows of " << gguf::type_name(mats[i].type) << ")";
      }
  const std::vector<QuantMatrix> five(5, a.mat);
  std::vector<float*> y5(5, nullptr);
  EXPECT_THROW(matmul_many(five.data(), y5.data(), 5, nullptr, 1, nullptr), Error);
}

// Grouped by expert on the device (moe_group, then matmul_expert_groups): every grouped slot has
// the bits of its pair's matmul_experts row (so of the one-token product); slots of left-out pairs
// (id -1) are -1 in perm and their rows untouched; activations already in grouped order (no perm)
// give the same bits.
// The (token, expert) pairs of device ids [P] grouped by expert on the device (moe_group), as
// matmul_expert_groups takes them, with up to max_slots slots per group.
struct DeviceGroups {
  DeviceBuffer counts, offsets, perm, active, n_active, ws;
  int64_t E, max_slots;
  DeviceGroups(const DeviceBuffer& ids, int64_t P, int64_t E_, int64_t max_slots_)
      : counts(size_t(E_) * 4), offsets(size_t(E_ + 1) * 4), perm(size_t(P) * 4), active(size_t(E_) * 4), n_active(4),
        ws(std::max<size_t>(1, moe_group_workspace_bytes(P, E_))), E(E_), max_slots(max_slots_) {
    moe_group(ids.as<int32_t>(), P, E, counts.as<int32_t>(), offsets.as<int32_t>(), perm.as<int32_t>(), ws.get(),
              nullptr, active.as<int32_t>(), n_active.as<int32_t>());
  }
  ExpertGroups groups() const {
    ExpertGroups g;
    g.offsets = offsets.as<int32_t>();
    g.active = active.as<int32_t>();
    g.n_active = n_active.as<int32_t>();
    g.perm = perm.as<int32_t>();
    g.max_groups = E;
    g.max_slots = max_slots;
    return g;
  }
};

TEST_P(CudaMatmul, ExpertGroupsEqualThePairProducts) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t E = 6, F = 18, H = 768, tokens = 5, k = 3, P = tokens * k;
  const TestWeight w(type(), E * F, H, 23);
  const std::vector<int32_t> ids = {4, 0, 2, 1, 4, -1, 3, 0, 4, 4, 2, 1, 0, 5, -1};  // [tokens, k]
  const std::vector<float> x = randn(size_t(tokens * H), 78);
  const DeviceBuffer dx = to_device(x), dids = to_device(ids);
  DeviceBuffer pairs(size_t(P * F) * sizeof(float));
  matmul_experts(w.mat, F, dids.as<int32_t>(), P, dx.as<float>(), k, pairs.as<float>(), nullptr);
  const DeviceGroups dg(dids, P, E, tokens);
  const DeviceBuffer &perm = dg.perm, &active = dg.active, &n_active = dg.n_active;
  ExpertGroups g = dg.groups();
  const std::vector<float> fill(size_t(P * F), kUnwritten);
  DeviceBuffer grouped = to_device(fill);
  matmul_expert_groups(w.mat, F, g, dx.as<float>(), k, grouped.as<float>(), nullptr);
  // A batch above kGroupOneTokenBatch (gemv.cuh) takes groups two tokens per pass: the same bits.
  DeviceBuffer grouped_wide = to_device(fill);
  g.max_slots = 40;
  matmul_expert_groups(w.mat, F, g, dx.as<float>(), k, grouped_wide.as<float>(), nullptr);
  g.max_slots = tokens;
  synchronize();
  const auto want = to_host<float>(pairs, size_t(P * F)), got = to_host<float>(grouped, size_t(P * F));
  EXPECT_EQ(std::memcmp(to_host<float>(grouped_wide, size_t(P * F)).data(), got.data(), size_t(P * F) * sizeof(float)), 0)
      << GetParam() << ": two-token passes differ from one-token passes";
  const auto hperm = to_host<int32_t>(perm, size_t(P));
  const auto hactive = to_host<int32_t>(active, size_t(E));
  ASSERT_EQ(to_host<int32_t>(n_active, 1)[0], 6) << "experts 0..5 all have tokens";
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(hactive[size_t(e)], e);
  int64_t routed = 0;
  for (int32_t id : ids) routed += id >= 0;
  for (int64_t j = 0; j < P; ++j) {
    if (j >= routed) {
      EXPECT_EQ(hperm[size_t(j)], -1) << "slot " << j << " past the routed pairs";
      for (int64_t r = 0; r < F; ++r) ASSERT_EQ(got[size_t(j * F + r)], kUnwritten) << "slot " << j << " written";
      continue;
    }
    const int32_t p = hperm[size_t(j)];
    ASSERT_EQ(std::memcmp(got.data() + j * F, want.data() + int64_t(p) * F, size_t(F) * sizeof(float)), 0)
        << GetParam() << " grouped slot " << j << " (pair " << p << ", expert " << ids[size_t(p)]
        << ") differs from the pair product";
  }
  // The same slots with their activations already gathered in grouped order.
  std::vector<float> xg(size_t(P * H), 0.0f);
  for (int64_t j = 0; j < routed; ++j)
    std::copy_n(x.begin() + (hperm[size_t(j)] / k) * H, H, xg.begin() + j * H);
  const DeviceBuffer dxg = to_device(xg);
  DeviceBuffer in_place = to_device(fill);
  g.perm = nullptr;
  matmul_expert_groups(w.mat, F, g, dxg.as<float>(), 1, in_place.as<float>(), nullptr);
  synchronize();
  const auto got2 = to_host<float>(in_place, size_t(P * F));
  EXPECT_EQ(std::memcmp(got2.data(), got.data(), size_t(routed * F) * sizeof(float)), 0) << GetParam();
  // The tensor-core kernel grouped: the bits of its own pair products.
  if (mma_decode_supported(type())) {
    DeviceBuffer pairs_tc(size_t(P * F) * sizeof(float));
    matmul_experts(w.mat, F, dids.as<int32_t>(), P, dx.as<float>(), k, pairs_tc.as<float>(), nullptr,
                   ExpertKernel::kTensorCores);
    DeviceBuffer grouped_tc = to_device(fill);
    g.perm = perm.as<int32_t>();
    matmul_expert_groups(w.mat, F, g, dx.as<float>(), k, grouped_tc.as<float>(), nullptr, true);
    g.perm = nullptr;
    synchronize();
    const auto want_tc = to_host<float>(pairs_tc, size_t(P * F)), got_tc = to_host<float>(grouped_tc, size_t(P * F));
    for (int64_t j = 0; j < routed; ++j)
      ASSERT_EQ(std::memcmp(got_tc.data() + j * F, want_tc.data() + int64_t(hperm[size_t(j)]) * F, size_t(F) * sizeof(float)), 0)
          << GetParam() << " tensor cores: grouped slot " << j << " differs from its pair product";
  }
  // Bad arguments are refused with the numbers.
  g.max_groups = E + 1;
  EXPECT_NE(test::error_of([&] { matmul_expert_groups(w.mat, F, g, dxg.as<float>(), 1, in_place.as<float>(), nullptr); })
                .find("7 groups of up to 5 slots over 6 experts"),
            std::string::npos);
}

// The experts' tiles of a prefill (matmul_expert_tiles, from expert_tiles' lists): gate and up in one
// launch per tile width, each group's rows against the CPU's products of its expert on its tokens,
// within the prefill kernel's tolerance; rows of the groups outside [9, 250) (3 tokens, 250, none)
// left unwritten. 133 rows per expert: a row tile past an expert's last row.
TEST_P(CudaMatmul, ExpertTilesMatchCpu) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t E = 7, F = 133, H = 768;
  const std::vector<int32_t> counts = {9, 3, 40, 0, 130, 200, 250};
  int64_t rows = 0;
  std::vector<int64_t> first;
  for (int32_t c : counts) first.push_back(rows), rows += c;
  const TestWeight gate(type(), E * F, H, 31), up(type(), E * F, H, 32);
  const std::vector<float> x = randn(size_t(rows * H), 33);
  const ExpertTileLists lists = expert_tiles(counts.data(), E, 9, 250);
  std::vector<ExpertTile> all;
  for (const auto& l : lists.of_width) all.insert(all.end(), l.begin(), l.end());
  ASSERT_EQ(all.size(), 6u);
  const DeviceBuffer dx = to_device(x), dtiles = to_device(all);
  const std::vector<float> fill(size_t(rows * F), kUnwritten);
  DeviceBuffer dy1 = to_device(fill), dy2 = to_device(fill);
  const int64_t launches = expert_tile_launches();
  const ExpertTile* t = dtiles.as<ExpertTile>();
  for (int i = 0; i < 3; ++i) {
    const int64_t n = int64_t(lists.of_width[i].size());
    matmul_expert_tiles(gate.mat, &up.mat, F, t, n, kExpertTileWidths[i], dx.as<float>(), dy1.as<float>(),
                        dy2.as<float>(), nullptr);
    t += n;
  }
  synchronize();
  EXPECT_EQ(expert_tile_launches() - launches, 3);
  const auto y1 = to_host<float>(dy1, fill.size()), y2 = to_host<float>(dy2, fill.size());
  double worst = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = counts[size_t(e)], f = first[size_t(e)];
    const std::string what = GetParam() + " expert " + std::to_string(e) + " (" + std::to_string(c) + " tokens)";
    if (c < 9 || c >= 250) {
      for (int64_t i = f * F; i < (f + c) * F; ++i)
        ASSERT_TRUE(y1[size_t(i)] == kUnwritten && y2[size_t(i)] == kUnwritten) << what << ": not tiled, written";
      continue;
    }
    for (const TestWeight* w : {&gate, &up}) {
      ops::Weight ew = w->host;
      ew.n_rows = F;
      ew.data = static_cast<const uint8_t*>(w->host.data) + uint64_t(e * F) * w->host.row_bytes;
      std::vector<float> want(size_t(c * F));
      ops::matmul(ew, x.data() + f * H, c, want.data(), pool());
      const std::vector<float>& y = w == &gate ? y1 : y2;
      const std::vector<float> got(y.begin() + f * F, y.begin() + (f + c) * F);
      worst = std::max(worst, check_close(got, want, c, F, kPrefillTol, what + (w == &gate ? " gate" : " up")));
    }
  }
  std::printf("  %-8s expert tiles: worst relative error %.2e\n", GetParam().c_str(), worst);
  // Bad arguments are refused with what was wrong.
  const auto err = [&](auto f) { return test::error_of(f); };
  EXPECT_NE(err([&] { matmul_expert_tiles(gate.mat, nullptr, F, dtiles.as<ExpertTile>(), 1, 48, dx.as<float>(),
                                          dy1.as<float>(), nullptr, nullptr); })
                .find("tiles of 48 tokens"),
            std::string::npos);
  EXPECT_NE(err([&] { matmul_expert_tiles(gate.mat, nullptr, 50, dtiles.as<ExpertTile>(), 1, 32, dx.as<float>(),
                                          dy1.as<float>(), nullptr, nullptr); })
                .find("not whole experts of 50 rows"),
            std::string::npos);
  QuantMatrix narrow = up.mat;
  narrow.n_rows = F;
  EXPECT_NE(err([&] { matmul_expert_tiles(gate.mat, &narrow, F, dtiles.as<ExpertTile>(), 1, 32, dx.as<float>(),
                                          dy1.as<float>(), dy2.as<float>(), nullptr); })
                .find("not of the first's shape"),
            std::string::npos);
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

// The cuBLAS prefill turned on for a scope (set_prefill_blas), and back as it was after it.
struct PrefillBlasOn {
  bool was = prefill_blas_enabled();
  PrefillBlasOn() { set_prefill_blas(true); }
  ~PrefillBlasOn() { set_prefill_blas(was); }
  PrefillBlasOn(const PrefillBlasOn&) = delete;
  PrefillBlasOn& operator=(const PrefillBlasOn&) = delete;
};

// The weight rows that matmul_prefill_blas multiplies: the CPU's dequantized values rounded to bf16
// (nearest even), bit for bit, for rows inside the weight (not its first or last).
TEST_P(CudaMatmul, DequantizeBf16EqualsCpuRoundedBitForBit) {
  SPARSEMLA_REQUIRE_GPU();
  for (const Shape& sh : shapes_for(type())) {
    const TestWeight w(type(), sh.n_rows, sh.n_cols, 17);
    const int64_t row0 = 1, n = sh.n_rows - 2;
    DeviceBuffer dout(size_t(n * sh.n_cols) * 2);
    dequantize_bf16(w.mat, row0, n, dout.get(), nullptr);
    synchronize();
    const std::vector<uint16_t> got = to_host<uint16_t>(dout, size_t(n * sh.n_cols));
    std::vector<float> want(size_t(sh.n_cols));
    for (int64_t r = 0; r < n; ++r) {
      ops::dequantize_row(w.host, row0 + r, want.data());
      for (int64_t c = 0; c < sh.n_cols; ++c)
        ASSERT_EQ(got[size_t(r * sh.n_cols + c)], f32_to_bf16(want[size_t(c)]))
            << GetParam() << " row " << row0 + r << " col " << c << ": " << want[size_t(c)];
    }
  }
}

// The cuBLAS prefill form against the CPU for every type and shape, at blas_min_tokens(type) and
// 300 tokens, as one chunk and in chunks of 128 rows (the last partial); its output buffer starts
// as NaN, so every element must be written. With it on, matmul takes it from blas_min_tokens(type)
// tokens (its bits) and not one token earlier (the tile kernel: other bits).
TEST_P(CudaMatmul, CublasPrefillMatchesCpu) {
  SPARSEMLA_REQUIRE_GPU();
  uint32_t seed = 50;
  for (const Shape& sh : shapes_for(type())) {
    const TestWeight w(type(), sh.n_rows, sh.n_cols, seed++);
    const int64_t from = blas_min_tokens(type());
    ASSERT_GT(from, kDecodeMaxTokens);
    ASSERT_LE(from, kBlasMinTokensMax);
    for (int64_t T : {from, int64_t(300)}) {
      const std::vector<float> x = randn(size_t(T * sh.n_cols), seed++);
      std::vector<float> want(size_t(T * sh.n_rows));
      ops::matmul(w.host, x.data(), T, want.data(), pool());
      const std::string what = GetParam() + " " + std::to_string(sh.n_rows) + "x" + std::to_string(sh.n_cols) +
                               " T=" + std::to_string(T);
      const DeviceBuffer dx = to_device(x);
      std::vector<float> whole;
      for (int64_t chunk : {int64_t(0), int64_t(128)}) {
        DeviceBuffer dy = to_device(std::vector<float>(size_t(T * sh.n_rows), NAN));
        ASSERT_TRUE(matmul_prefill_blas(w.mat, dx.as<float>(), T, dy.as<float>(), nullptr, chunk)) << what;
        synchronize();
        const std::vector<float> got = to_host<float>(dy, size_t(T * sh.n_rows));
        check_close(got, want, T, sh.n_rows, kPrefillTol, what + (chunk ? " in 128-row chunks" : ""));
        if (chunk == 0) whole = got;
      }
      const PrefillBlasOn on;
      const std::vector<float> chosen = gpu_product(&matmul, w.mat, x, T);
      EXPECT_EQ(std::memcmp(chosen.data(), whole.data(), whole.size() * sizeof(float)), 0)
          << what << ": matmul did not take the cuBLAS form";
      if (T == from) {  // one token fewer: the tile kernel, whose bits are its own
        const int64_t calls = prefill_blas_calls();
        (void)gpu_product(&matmul, w.mat, std::vector<float>(x.begin(), x.end() - sh.n_cols), T - 1);
        EXPECT_EQ(prefill_blas_calls(), calls) << what << ": matmul took the cuBLAS form below its threshold";
      }
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
    for (int64_t T : {int64_t(1), int64_t(5), int64_t(33), blas_min_tokens(t) + 2}) {  // (the last: cuBLAS)
      const std::vector<float> x = randn(size_t(T * count), 300 + uint32_t(T));
      std::vector<float> want(size_t(T * 41));
      ops::matmul(hs, x.data(), T, want.data(), pool());
      check_close(gpu_product(&matmul, ds, x, T), want, T, 41, T <= kDecodeMaxTokens ? few_token_tol(t, T) : kPrefillTol,
                  std::string(tr.name) + " column slice T=" + std::to_string(T));
      if (T >= blas_min_tokens(t)) {
        const DeviceBuffer dx = to_device(x);
        DeviceBuffer dy(size_t(T * 41) * sizeof(float));
        ASSERT_TRUE(matmul_prefill_blas(ds, dx.as<float>(), T, dy.as<float>(), nullptr));
        synchronize();
        check_close(to_host<float>(dy, size_t(T * 41)), want, T, 41, kPrefillTol,
                    std::string(tr.name) + " column slice, cuBLAS, T=" + std::to_string(T));
      }
    }
  }
}

// The router's product at prefill sizes: F32 weights through cuBLAS in fp32 arithmetic, within the
// fp32 decode tolerance of the CPU (a bf16 rounding would be ~1e-3); other types are declined.
TEST(CudaMatmulApi, F32BlasMatchesCpuInFp32) {
  SPARSEMLA_REQUIRE_GPU();
  for (const Shape& sh : {Shape{256, 768}, Shape{67, 200}}) {
    const TestWeight w(GgmlType::F32, sh.n_rows, sh.n_cols, 21);
    for (int64_t T : {kF32BlasMinTokens, int64_t(333)}) {
      const std::vector<float> x = randn(size_t(T * sh.n_cols), 700 + uint32_t(T));
      std::vector<float> want(size_t(T * sh.n_rows));
      ops::matmul(w.host, x.data(), T, want.data(), pool());
      const DeviceBuffer dx = to_device(x);
      DeviceBuffer dy = to_device(std::vector<float>(size_t(T * sh.n_rows), NAN));
      ASSERT_TRUE(matmul_f32_blas(w.mat, dx.as<float>(), T, dy.as<float>(), nullptr));
      synchronize();
      const std::string what =
          "f32 cuBLAS " + std::to_string(sh.n_rows) + "x" + std::to_string(sh.n_cols) + " T=" + std::to_string(T);
      check_close(to_host<float>(dy, size_t(T * sh.n_rows)), want, T, sh.n_rows, kDecodeTol, what);
    }
  }
  const TestWeight q(GgmlType::Q8_0, 32, 256, 22);
  const DeviceBuffer dx = to_device(randn(size_t(kF32BlasMinTokens * 256), 23));
  DeviceBuffer dy(size_t(kF32BlasMinTokens * 32) * sizeof(float));
  EXPECT_FALSE(matmul_f32_blas(q.mat, dx.as<float>(), kF32BlasMinTokens, dy.as<float>(), nullptr));
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


// ---- int8-activation products (quant_matmul_q8.h) ----
//
// Reference: the weight dequantized by the CPU (ops::dequantize_row, exact) times the dequantized
// activations x_hat = d * q, summed in double. The GPU differs only in fp32 summation order:
// tolerance 1e-5 relative (L2 per token; measured on an H200: 0.8e-7 to 2.2e-7). Against the fp32
// activations the int8 rounding adds about 8.5e-3 measured (each value off by at most
// d / 2 = max / 254 of its block): tolerance 2e-2. With two levels each value is off by at most
// max / 64516 of its block (~2e-5 relative on N(0, 1) values): tolerance 2e-4, ten times under
// what bf16 activations cost (~2e-3).

constexpr double kQ8Tol = 1e-5;
constexpr double kQ8VsFp32Tol = 2e-2;
constexpr double kQ8x2VsFp32Tol = 2e-4;

// Quantized activations on the device, owning their buffer.
struct DeviceQ8 {
  DeviceBuffer buf;
  Q8Activations act;
  DeviceQ8(const std::vector<float>& x, int64_t T, int64_t n_cols, int levels = 1)
      : buf(q8_activation_bytes(T, n_cols, levels)) {
    const DeviceBuffer dx = to_device(x);
    act.data = buf.get();
    act.bytes = buf.bytes();
    quantize_activations(dx.as<float>(), T, n_cols, act, nullptr, levels);
    synchronize();
  }
  HostQ8 download() const {
    HostQ8 h;
    h.levels = act.levels;
    const size_t n = size_t(act.n_tokens * act.n_cols), nb = n / 32;
    std::vector<uint8_t> all = to_host<uint8_t>(buf, buf.bytes());
    h.q.assign(reinterpret_cast<const int8_t*>(all.data()), reinterpret_cast<const int8_t*>(all.data()) + n);
    if (act.levels == 2) {
      const int8_t* r = reinterpret_cast<const int8_t*>(all.data() + q8_scales_offset(act.n_tokens, act.n_cols, 1));
      h.r.assign(r, r + n);
    }
    const uint8_t* blocks = all.data() + q8_scales_offset(act.n_tokens, act.n_cols, act.levels);
    h.d.resize(nb);
    h.sum.resize(nb);
    for (size_t b = 0; b < nb; ++b) {
      std::memcpy(&h.d[b], blocks + 8 * b, 4);
      std::memcpy(&h.sum[b], blocks + 8 * b + 4, 4);
    }
    return h;
  }
};

void expect_same_quantization(const HostQ8& got, const HostQ8& want, const std::string& what) {
  ASSERT_EQ(got.q.size(), want.q.size());
  ASSERT_EQ(got.r.size(), want.r.size());
  for (size_t i = 0; i < want.q.size(); ++i)
    ASSERT_EQ(int(got.q[i]), int(want.q[i])) << what << ": value " << i << " (block scale " << want.d[i / 32] << ")";
  for (size_t i = 0; i < want.r.size(); ++i)
    ASSERT_EQ(int(got.r[i]), int(want.r[i])) << what << ": residual " << i << " (block scale " << want.d[i / 32] << ")";
  for (size_t b = 0; b < want.d.size(); ++b) {
    ASSERT_EQ(f32_to_bits(got.d[b]), f32_to_bits(want.d[b])) << what << ": scale of block " << b;
    ASSERT_EQ(got.sum[b], want.sum[b]) << what << ": sum of block " << b;
  }
}

TEST(CudaQ8Activations, QuantizationMatchesCpuBitForBit) {
  SPARSEMLA_REQUIRE_GPU();
  std::vector<std::pair<std::string, std::vector<float>>> cases;
  cases.emplace_back("random", randn(3 * 768, 5, 2.0f));
  cases.emplace_back("zeros", std::vector<float>(64, 0.0f));
  std::vector<float> huge = randn(64, 6, 1e-3f);
  huge[37] = -3e5f;  // one block dominated by one value: the others round to 0
  cases.emplace_back("one huge value", huge);
  std::vector<float> negzero(64, -0.0f);
  negzero[40] = 1.0f;
  cases.emplace_back("negative zeros", negzero);
  // max 127 gives d = 1 exactly, so x / d lands on halves: ties go to the even neighbour.
  std::vector<float> ties(64);
  for (int i = 0; i < 64; ++i) ties[size_t(i)] = float(i % 32) - 15.5f;
  ties[0] = 127.0f;
  ties[32] = -127.0f;
  cases.emplace_back("ties at .5", ties);
  std::vector<float> tiny(32, 1e-44f);  // subnormal: d rounds to 0 or a few ulps
  tiny[3] = 3e-43f;
  cases.emplace_back("subnormal", tiny);
  for (const auto& [name, x] : cases) {
    const int64_t n_cols = int64_t(x.size()) >= 768 ? 768 : int64_t(x.size());
    const int64_t T = int64_t(x.size()) / n_cols;
    const DeviceQ8 dq(x, T, n_cols);
    const HostQ8 want = quantize_on_host(x);
    expect_same_quantization(dq.download(), want, name);
    const HostQ8 want2 = quantize_on_host(x, 2);
    expect_same_quantization(DeviceQ8(x, T, n_cols, 2).download(), want2, name + ", two levels");
    if (name == "random") {  // the second level within max / 64516 of each value (fp32 rounding aside)
      const std::vector<double> xh = dequantized(want2);
      for (size_t i = 0; i < x.size(); ++i) {
        float amax = 0.0f;
        for (size_t j = i / 32 * 32; j < i / 32 * 32 + 32; ++j) amax = std::max(amax, std::fabs(x[j]));
        ASSERT_LE(std::fabs(xh[i] - double(x[i])), double(amax) * (1.0 / 64516.0 + 1e-6)) << "value " << i;
      }
    }
    if (name == "ties at .5") {
      EXPECT_EQ(want.q[size_t(1)], -14);  // -14.5 -> -14
      EXPECT_EQ(want.q[size_t(2)], -14);  // -13.5 -> -14
      EXPECT_EQ(want.q[size_t(16)], 0);   //   0.5 -> 0
      EXPECT_EQ(want.q[size_t(17)], 2);   //   1.5 -> 2
    }
  }
}

class CudaMatmulQ8 : public ::testing::TestWithParam<std::string> {
 protected:
  GgmlType type() const { return *gguf::type_from_name(GetParam()); }
};

// The whole weight dequantized on the host: [n_rows][n_cols].
std::vector<float> dequantized_weight(const ops::Weight& w) {
  std::vector<float> v(size_t(w.n_rows * w.n_cols));
  for (int64_t r = 0; r < w.n_rows; ++r) ops::dequantize_row(w, r, v.data() + r * w.n_cols);
  return v;
}

// y[t][r] = sum_c W[r][c] x[t][c] in double, as float.
template <class X>
std::vector<float> host_product(const std::vector<float>& wd, int64_t n_rows, int64_t n_cols, const std::vector<X>& x,
                                int64_t T) {
  std::vector<float> y(size_t(T * n_rows));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < n_rows; ++r) {
      double s = 0.0;
      const float* wr = wd.data() + r * n_cols;
      const X* xt = x.data() + t * n_cols;
      for (int64_t c = 0; c < n_cols; ++c) s += double(wr[c]) * double(xt[c]);
      y[size_t(t * n_rows + r)] = float(s);
    }
  return y;
}

// (one_token: the one-token int8 tensor-core kernel where the type has one.)
std::vector<float> gpu_product_q8(const QuantMatrix& m, const DeviceQ8& x, bool one_token = false) {  // either level count
  const int64_t T = x.act.n_tokens;
  DeviceBuffer dy = to_device(std::vector<float>(size_t(T * m.n_rows), NAN));  // poisoned: every value must be written
  matmul_decode_q8(m, x.act, dy.as<float>(), nullptr, one_token);
  synchronize();
  return to_host<float>(dy, size_t(T * m.n_rows));
}

TEST_P(CudaMatmulQ8, MatchesProductWithDequantizedActivations) {
  SPARSEMLA_REQUIRE_GPU();
  ASSERT_TRUE(q8_supported(type()));
  std::vector<Shape> shapes = {{67, 768}, {131, 256}, {19, 8960}, {2048, 6144}, {6144, 2048}};
  if (gguf::traits(type()).block_size == 32) shapes.push_back({33, 160});  // (Q8_0, Q4_0, IQ4_NL)
  uint32_t seed = 500;
  double worst_fp32[2] = {0.0, 0.0};
  for (const Shape& sh : shapes) {
    const TestWeight w(type(), sh.n_rows, sh.n_cols, seed++);
    const std::vector<float> wd = dequantized_weight(w.host);
    double worst = 0.0;
    for (int64_t T : {1, 2, 3, 5, 8, 16}) {
      if (sh.n_rows * sh.n_cols > (1 << 22) && T != 1 && T != 5 && T != 16) continue;  // keep the CPU time down
      const std::vector<float> x = randn(size_t(T * sh.n_cols), seed++);
      const std::vector<float> exact = host_product(wd, sh.n_rows, sh.n_cols, x, T);
      for (int levels : {1, 2}) {
        const DeviceQ8 dq(x, T, sh.n_cols, levels);
        const HostQ8 hq = quantize_on_host(x, levels);
        expect_same_quantization(dq.download(), hq, "activations");
        const std::vector<float> got = gpu_product_q8(w.mat, dq);
        const std::string what = GetParam() + " " + std::to_string(sh.n_rows) + "x" + std::to_string(sh.n_cols) +
                                 " T=" + std::to_string(T) + ", " + std::to_string(levels) + " level(s)";
        worst = std::max(worst, check_close(got, host_product(wd, sh.n_rows, sh.n_cols, dequantized(hq), T), T,
                                            sh.n_rows, kQ8Tol, what));
        worst_fp32[levels - 1] =
            std::max(worst_fp32[levels - 1], check_close(got, exact, T, sh.n_rows,
                                                         levels == 2 ? kQ8x2VsFp32Tol : kQ8VsFp32Tol,
                                                         what + " vs fp32 activations"));
      }
    }
    std::printf("  %-5s %5lldx%-5lld  worst relative error against W x_hat: %.2e\n", GetParam().c_str(),
                (long long)sh.n_rows, (long long)sh.n_cols, worst);
  }
  std::printf("  %-5s worst relative error against W x (fp32 activations): %.2e one level, %.2e two\n",
              GetParam().c_str(), worst_fp32[0], worst_fp32[1]);
}

// Token t of a T-token int8-activation product has the same bits as that token alone.
TEST_P(CudaMatmulQ8, IsBatchInvariant) {
  SPARSEMLA_REQUIRE_GPU();
  const TestWeight w(type(), 37, 768, 11);
  for (int levels : {1, 2})
    expect_batch_invariant(GetParam() + " q8, " + std::to_string(levels) + " level(s)", 600,
                           [&](const std::vector<float>& x, int64_t T) {
                             return gpu_product_q8(w.mat, DeviceQ8(x, T, 768, levels));
                           });
}

// Expert mode: each pair equals the one-token product on the expert's rows bit for bit; pairs
// with id -1 leave their rows alone.
TEST_P(CudaMatmulQ8, ExpertPairsEqualOneTokenProducts) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t E = 5, F = 18, H = 768, tokens = 3, k = 3;
  const TestWeight w(type(), E * F, H, 21);
  const std::vector<float> wd = dequantized_weight(w.host);
  const std::vector<int32_t> ids = {4, 0, 2, 1, 1, -1, 3, 0, -1};  // [tokens, k]
  const std::vector<float> x = randn(size_t(tokens * H), 77);
  const DeviceBuffer dids = to_device(ids);
  const int64_t P = int64_t(ids.size());
  for (int levels : {1, 2}) {
    const std::string name = GetParam() + ", " + std::to_string(levels) + " level(s),";
    const DeviceQ8 dq(x, tokens, H, levels);
    const std::vector<double> xhat = dequantized(quantize_on_host(x, levels));
    DeviceBuffer dy = to_device(std::vector<float>(size_t(P * F), kUnwritten));
    matmul_experts_q8(w.mat, F, dids.as<int32_t>(), P, dq.act, k, dy.as<float>(), nullptr);
    synchronize();
    check_expert_pairs(to_host<float>(dy, size_t(P * F)), ids, F, H, k, x,
                       [&](int64_t p, int32_t e, const std::vector<float>& xt, const std::vector<float>& got) {
                         const std::vector<float> alone =
                             gpu_product_q8(expert_rows(w.mat, e, F), DeviceQ8(xt, 1, H, levels));
                         EXPECT_EQ(std::memcmp(alone.data(), got.data(), size_t(F) * sizeof(float)), 0)
                             << name << " pair " << p << " (expert " << e << ") differs from the one-token product";
                         const std::vector<float> we(wd.begin() + e * F * H, wd.begin() + (e + 1) * F * H);
                         const std::vector<double> xh(xhat.begin() + (p / k) * H, xhat.begin() + (p / k + 1) * H);
                         check_close(got, host_product(we, F, H, xh, 1), 1, F, kQ8Tol, name + " expert pair");
                       });
  }
}

// Grouped mode on quantized activations (the fast mode's Q8_0 experts at batches of 2-64): each
// routed slot has the bits of its pair product (matmul_experts_q8) and is close to the expert's rows
// times the token's x_hat on the host; a larger batch bound and activation rows gathered in grouped
// order give the same bits; slots past the routed pairs stay unwritten.
TEST_P(CudaMatmulQ8, ExpertGroupsEqualThePairProducts) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t E = 6, F = 18, H = 768, tokens = 5, k = 3, P = tokens * k;
  const TestWeight w(type(), E * F, H, 29);
  const std::vector<float> wd = dequantized_weight(w.host);
  const std::vector<int32_t> ids = {4, 0, 2, 1, 4, -1, 3, 0, 4, 4, 2, 1, 0, 5, -1};  // [tokens, k]
  const std::vector<float> x = randn(size_t(tokens * H), 79);
  const DeviceBuffer dids = to_device(ids);
  const DeviceGroups dg(dids, P, E, tokens);
  const DeviceBuffer &perm = dg.perm, &active = dg.active, &n_active = dg.n_active;
  ExpertGroups g = dg.groups();
  synchronize();
  const auto hperm = to_host<int32_t>(perm, size_t(P));
  int64_t routed = 0;
  for (int32_t id : ids) routed += id >= 0;
  const std::vector<float> fill(size_t(P * F), kUnwritten);
  for (int levels : {1, 2}) {
    const std::string name = GetParam() + ", " + std::to_string(levels) + " level(s),";
    const DeviceQ8 dq(x, tokens, H, levels);
    const std::vector<double> xhat = dequantized(quantize_on_host(x, levels));
    DeviceBuffer pairs = to_device(fill), grouped = to_device(fill), wide = to_device(fill);
    matmul_experts_q8(w.mat, F, dids.as<int32_t>(), P, dq.act, k, pairs.as<float>(), nullptr);
    g.perm = perm.as<int32_t>();
    matmul_expert_groups_q8(w.mat, F, g, dq.act, k, grouped.as<float>(), nullptr);
    g.max_slots = 40;  // a larger batch: the same bits
    matmul_expert_groups_q8(w.mat, F, g, dq.act, k, wide.as<float>(), nullptr);
    g.max_slots = tokens;
    // The same slots with their activation rows gathered in grouped order, read in place.
    std::vector<float> xg(size_t(P * H), 0.0f);
    for (int64_t j = 0; j < routed; ++j) std::copy_n(x.begin() + (hperm[size_t(j)] / k) * H, H, xg.begin() + j * H);
    const DeviceQ8 dqg(xg, P, H, levels);
    DeviceBuffer in_place = to_device(fill);
    g.perm = nullptr;
    matmul_expert_groups_q8(w.mat, F, g, dqg.act, 1, in_place.as<float>(), nullptr);
    synchronize();
    const auto want = to_host<float>(pairs, size_t(P * F)), got = to_host<float>(grouped, size_t(P * F));
    EXPECT_EQ(std::memcmp(to_host<float>(wide, size_t(P * F)).data(), got.data(), got.size() * sizeof(float)), 0)
        << name << " a larger batch bound changes the bits";
    EXPECT_EQ(std::memcmp(to_host<float>(in_place, size_t(P * F)).data(), got.data(), size_t(routed * F) * sizeof(float)), 0)
        << name << " gathered rows read in place differ";
    for (int64_t j = 0; j < P; ++j) {
      const std::vector<float> slot(got.begin() + j * F, got.begin() + (j + 1) * F);
      if (j >= routed) {
        for (float v : slot) ASSERT_EQ(v, kUnwritten) << name << " slot " << j << " past the routed pairs written";
        continue;
      }
      const int32_t p = hperm[size_t(j)], e = ids[size_t(p)];
      ASSERT_EQ(std::memcmp(slot.data(), want.data() + int64_t(p) * F, size_t(F) * sizeof(float)), 0)
          << name << " grouped slot " << j << " (pair " << p << ", expert " << e << ") differs from the pair product";
      const std::vector<float> we(wd.begin() + e * F * H, wd.begin() + (e + 1) * F * H);
      const std::vector<double> xh(xhat.begin() + (p / k) * H, xhat.begin() + (p / k + 1) * H);
      check_close(slot, host_product(we, F, H, xh, 1), 1, F, kQ8Tol, name + " grouped slot");
    }
  }
}

// Several products of one input and the shared expert as one more pair, on quantized activations:
// each output has the bits of its product alone (matmul_decode_q8), at one token in one launch
// per type and column count, and the gate/up form equals two calls.
TEST_P(CudaMatmulQ8, ManyProductsAndSharedPairsEqualTheProductsAlone) {
  SPARSEMLA_REQUIRE_GPU();
  const int64_t E = 4, F = 18, H = 768, k = 3;
  const TestWeight a(type(), 40, H, 91), b(type(), 3, H, 92), c(type(), 96, H, 93), w(type(), E * F, H, 94),
      w2(type(), E * F, H, 95), sh(type(), F, H, 96), sh2(type(), F, H, 97), wrong(type(), F + 1, H, 98);
  for (int levels : {1, 2}) {
    const std::string name = GetParam() + ", " + std::to_string(levels) + " level(s)";
    for (const int64_t T : {int64_t(1), int64_t(3)}) {
      const std::vector<float> x = randn(size_t(T * H), uint32_t(100 + T));
      const DeviceQ8 dq(x, T, H, levels);
      const std::vector<QuantMatrix> mats = {a.mat, b.mat, c.mat};
      std::vector<DeviceBuffer> ys;
      std::vector<float*> yp;
      for (const QuantMatrix& m : mats) {
        ys.push_back(to_device(std::vector<float>(size_t(T * m.n_rows), kUnwritten)));
        yp.push_back(ys.back().as<float>());
      }
      matmul_many_q8(mats.data(), yp.data(), 3, dq.act, nullptr);
      synchronize();
      for (size_t i = 0; i < mats.size(); ++i)
        EXPECT_EQ(to_host<float>(ys[i], size_t(T * mats[i].n_rows)), gpu_product_q8(mats[i], dq))
            << name << " T=" << T << ": product " << i;
    }
    // One token's k pairs (one unused) and the shared expert reading activation row 1.
    const std::vector<int32_t> ids = {3, -1, 1};
    const std::vector<float> x = randn(size_t(2 * H), uint32_t(110 + levels));
    const DeviceQ8 dq(x, 2, H, levels);
    const DeviceQ8 dq1(std::vector<float>(x.begin() + H, x.end()), 1, H, levels);
    const DeviceBuffer dids = to_device(ids);
    const std::vector<float> unwritten(size_t((k + 1) * F), kUnwritten);
    DeviceBuffer y = to_device(unwritten), plain = to_device(unwritten), g = to_device(unwritten),
                 u = to_device(unwritten);
    const SharedPair one{&sh.mat, nullptr, 1}, two{&sh.mat, &sh2.mat, 1};
    matmul_experts_q8(w.mat, F, dids.as<int32_t>(), k, dq.act, k, plain.as<float>(), nullptr);
    matmul_experts_q8(w.mat, F, dids.as<int32_t>(), k, dq.act, k, y.as<float>(), nullptr, &one);
    matmul_experts_pair_q8(w.mat, w2.mat, F, dids.as<int32_t>(), k, dq.act, k, g.as<float>(), u.as<float>(), nullptr,
                           &two);
    synchronize();
    const std::vector<float> got = to_host<float>(y, size_t((k + 1) * F)), routed = to_host<float>(plain, size_t(k * F));
    EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + k * F), routed) << name << ": routed rows";
    EXPECT_EQ(std::vector<float>(got.begin() + k * F, got.end()), gpu_product_q8(sh.mat, dq1)) << name << ": shared row";
    EXPECT_EQ(to_host<float>(g, size_t((k + 1) * F)), got) << name << ": pair, first";
    const std::vector<float> second = to_host<float>(u, size_t((k + 1) * F));
    EXPECT_EQ(std::vector<float>(second.begin() + k * F, second.end()), gpu_product_q8(sh2.mat, dq1))
        << name << ": pair, second shared row";
    EXPECT_EQ(second[size_t(F)], kUnwritten) << name << ": the unused slot was written";
    const SharedPair bad{&wrong.mat, nullptr, 1}, past{&sh.mat, nullptr, 2};
    EXPECT_THROW(matmul_experts_q8(w.mat, F, dids.as<int32_t>(), k, dq.act, k, y.as<float>(), nullptr, &bad), Error)
        << name << ": a shared expert of another shape";
    const std::string beyond =
        test::error_of([&] { matmul_experts_q8(w.mat, F, dids.as<int32_t>(), k, dq.act, k, y.as<float>(), nullptr, &past); });
    EXPECT_NE(beyond.find("activation rows"), std::string::npos) << beyond;
  }
}

// The one-token int8 tensor-core kernel (Q4_K, Q5_K): at one token W x_hat within kQ8Tol on every
// shape (rows not a multiple of 16; one to 90 256-blocks per row, past the bf16 one-token kernel's
// staged width; 4300 x 2304 takes Q4_K's two-tile blocks only by the rule that their blocks fill a
// 132-SM device once; rows of 8192 columns or more, Q4_K's three-blocks-per-SM form), one and two
// levels, and close to W x; several products in one launch, expert
// pairs and a shared pair each the bits of their product alone with the kernel; unused pairs
// unwritten. Types without the kernel (Q8_0, Q6_K, Q2_K, Q3_K, IQ4_XS and the other IQ types) give the dp4a
// kernel's bits with the flag set.
TEST_P(CudaMatmulQ8, OneTokenKernelMatchesProductWithDequantizedActivations) {
  SPARSEMLA_REQUIRE_GPU();
  const bool has = q8_one_token_supported(type());
  EXPECT_EQ(has, type() == GgmlType::Q4_K || type() == GgmlType::Q5_K);
  const std::vector<Shape> shapes = {{67, 768},    {131, 256},  {19, 8960},  {2048, 6144},
                                     {6144, 2048},  {40, 23040}, {4300, 2304}, {1000, 8192}};
  uint32_t seed = 700;
  double worst[2] = {0.0, 0.0}, worst_fp32[2] = {0.0, 0.0};
  for (const Shape& sh : shapes) {
    const TestWeight w(type(), sh.n_rows, sh.n_cols, seed++);
    const std::vector<float> wd = dequantized_weight(w.host);
    const std::vector<float> x = randn(size_t(sh.n_cols), seed++);
    const std::vector<float> exact = host_product(wd, sh.n_rows, sh.n_cols, x, 1);
    for (int levels : {1, 2}) {
      const DeviceQ8 dq(x, 1, sh.n_cols, levels);
      const std::vector<float> got = gpu_product_q8(w.mat, dq, true);
      const std::string what = GetParam() + " " + std::to_string(sh.n_rows) + "x" + std::to_string(sh.n_cols) + ", " +
                               std::to_string(levels) + " level(s), one-token kernel";
      if (!has) {
        EXPECT_EQ(got, gpu_product_q8(w.mat, dq)) << what << ": not the dp4a kernel's bits";
        continue;
      }
      const std::vector<double> xhat = dequantized(quantize_on_host(x, levels));
      worst[levels - 1] = std::max(
          worst[levels - 1], check_close(got, host_product(wd, sh.n_rows, sh.n_cols, xhat, 1), 1, sh.n_rows, kQ8Tol, what));
      worst_fp32[levels - 1] =
          std::max(worst_fp32[levels - 1], check_close(got, exact, 1, sh.n_rows,
                                                       levels == 2 ? kQ8x2VsFp32Tol : kQ8VsFp32Tol, what + " vs W x"));
    }
  }
  if (has)
    std::printf("  %-5s one-token kernel, worst relative error against W x_hat %.2e / %.2e, against W x %.2e / %.2e "
                "(one / two levels)\n",
                GetParam().c_str(), worst[0], worst[1], worst_fp32[0], worst_fp32[1]);
  // Several products in one launch, and expert pairs with a shared pair.
  const int64_t E = 4, F = 18, H = 768, k = 3;
  const TestWeight a(type(), 40, H, 191), b(type(), 3, H, 192), c(type(), 96, H, 193), we(type(), E * F, H, 194),
      we2(type(), E * F, H, 195), sh(type(), F, H, 196), sh2(type(), F, H, 197);
  for (int levels : {1, 2}) {
    const std::string name = GetParam() + ", " + std::to_string(levels) + " level(s), one-token kernel";
    const DeviceQ8 dq(randn(size_t(H), uint32_t(200 + levels)), 1, H, levels);
    const std::vector<QuantMatrix> mats = {a.mat, b.mat, c.mat};
    std::vector<DeviceBuffer> ys;
    std::vector<float*> yp;
    for (const QuantMatrix& m : mats) {
      ys.push_back(to_device(std::vector<float>(size_t(m.n_rows), kUnwritten)));
      yp.push_back(ys.back().as<float>());
    }
    matmul_many_q8(mats.data(), yp.data(), 3, dq.act, nullptr, true);
    synchronize();
    for (size_t i = 0; i < mats.size(); ++i)
      EXPECT_EQ(to_host<float>(ys[i], size_t(mats[i].n_rows)), gpu_product_q8(mats[i], dq, true))
          << name << ": product " << i << " of three";
    const std::vector<int32_t> ids = {3, -1, 1};
    const std::vector<float> x = randn(size_t(2 * H), uint32_t(210 + levels));
    const DeviceQ8 dx(x, 2, H, levels);
    const DeviceQ8 dx0(std::vector<float>(x.begin(), x.begin() + H), 1, H, levels);
    const DeviceQ8 dx1(std::vector<float>(x.begin() + H, x.end()), 1, H, levels);
    const DeviceBuffer dids = to_device(ids);
    const std::vector<float> unwritten(size_t((k + 1) * F), kUnwritten);
    DeviceBuffer y = to_device(unwritten), g = to_device(unwritten), u = to_device(unwritten);
    const SharedPair one{&sh.mat, nullptr, 1}, two{&sh.mat, &sh2.mat, 1};
    matmul_experts_q8(we.mat, F, dids.as<int32_t>(), k, dx.act, k, y.as<float>(), nullptr, &one, true);
    matmul_experts_pair_q8(we.mat, we2.mat, F, dids.as<int32_t>(), k, dx.act, k, g.as<float>(), u.as<float>(), nullptr,
                           &two, true);
    synchronize();
    const std::vector<float> got = to_host<float>(y, size_t((k + 1) * F)), second = to_host<float>(u, size_t((k + 1) * F));
    EXPECT_EQ(to_host<float>(g, size_t((k + 1) * F)), got) << name << ": pair, first";
    for (int64_t p = 0; p < k; ++p) {
      const int32_t e = ids[size_t(p)];
      const std::vector<float> row(got.begin() + p * F, got.begin() + (p + 1) * F),
          row2(second.begin() + p * F, second.begin() + (p + 1) * F);
      if (e < 0) {
        EXPECT_EQ(row, std::vector<float>(size_t(F), kUnwritten)) << name << ": unused pair " << p << " written";
        EXPECT_EQ(row2, std::vector<float>(size_t(F), kUnwritten)) << name << ": unused pair " << p << " written";
        continue;
      }
      EXPECT_EQ(row, gpu_product_q8(expert_rows(we.mat, e, F), dx0, true)) << name << ": pair " << p;
      EXPECT_EQ(row2, gpu_product_q8(expert_rows(we2.mat, e, F), dx0, true)) << name << ": pair " << p << ", second";
    }
    EXPECT_EQ(std::vector<float>(got.begin() + k * F, got.end()), gpu_product_q8(sh.mat, dx1, true))
        << name << ": shared row";
    EXPECT_EQ(std::vector<float>(second.begin() + k * F, second.end()), gpu_product_q8(sh2.mat, dx1, true))
        << name << ": pair, second shared row";
  }
}

// Staged loads (Q2_K, Q3_K, Q6_K, the IQ types and Q8_0, whose blocks are only 2-, 4- or 8-byte
// aligned): rows of whole chunks (8 blocks but Q8_0's; 32 Q8_0 blocks, from 4096 columns) take the staged kernel (counted by
// q8_staged_launches) at one token, as several products in one launch and as expert pairs with a
// shared pair, with one level and two, with two chunk buffers per warp (Q8_0 6144 columns: 192
// units over 64 threads) and with chunks in turn in one buffer (Q6_K 18432 columns: 288 units over
// 256 threads, two buffers past kStagedMaxSmem); each result has the bits of the kernel without
// staging. Rows of one chunk (Q6_K 2048 columns) take the row-group kernel, also for expert
// products with a shared one; rows of one chunk per warp (Q6_K 6144 columns) blocks that run
// several row groups in turn. Narrower rows, other types and two tokens do not take it.
TEST_P(CudaMatmulQ8, StagedLoadsGiveTheUnstagedBits) {
  SPARSEMLA_REQUIRE_GPU();
  struct Restore {
    ~Restore() { set_q8_staged_loads(true); }
  } restore;
  // The types of 8 blocks per chunk (Q2_K, Q3_K, Q6_K and the IQ types) and Q8_0.
  const bool eight_blocks = type() == GgmlType::Q6_K || type() == GgmlType::Q2_K || type() == GgmlType::Q3_K ||
                            type() == GgmlType::IQ4_XS || type() == GgmlType::IQ2_XXS || type() == GgmlType::IQ3_XXS ||
                            type() == GgmlType::IQ3_S || type() == GgmlType::IQ2_XS || type() == GgmlType::IQ2_S ||
                            type() == GgmlType::IQ1_S || type() == GgmlType::IQ1_M;
  // (Q4_0 and IQ4_NL: 32 blocks per chunk from 4096 columns, as Q8_0.)
  const bool staged_type =
      eight_blocks || type() == GgmlType::Q8_0 || type() == GgmlType::Q4_0 || type() == GgmlType::IQ4_NL;
  const auto whole_chunks = [&](int64_t n_cols) {
    return eight_blocks ? n_cols % (8 * 256) == 0 : n_cols % (32 * 32) == 0 && n_cols >= 4096;
  };
  // f() with staging on and off: both results and the staged launches each made.
  // Rows of exactly one chunk (Q6_K 2048 columns) take the row-group form (counted apart too).
  const auto one_chunk = [&](int64_t n_cols) { return eight_blocks && n_cols == 8 * 256; };
  int64_t group_launches = 0;
  const auto both = [&](auto&& f) {
    set_q8_staged_loads(true);
    const int64_t n0 = q8_staged_launches(), g0 = q8_staged_group_launches();
    auto on = f();
    const int64_t n_on = q8_staged_launches() - n0;
    group_launches = q8_staged_group_launches() - g0;
    set_q8_staged_loads(false);
    auto off = f();
    const int64_t n_off = q8_staged_launches() - n0 - n_on;
    set_q8_staged_loads(true);
    EXPECT_EQ(n_off, 0) << "staged launches with staging off";
    return std::tuple{on, off, n_on};
  };
  // (Q6_K 2048 columns: 37 rows take one row group per warp, 6144 two and 8461 four on a 132-SM
  // device, the last block's warps fewer.)
  const std::vector<Shape> shapes = {{37, 2048},  {6144, 2048}, {8461, 2048}, {67, 6144},
                                     {19, 18432}, {33, 768},    {5, 1024}};
  uint32_t seed = 900;
  for (const Shape& sh : shapes) {
    const TestWeight w(type(), sh.n_rows, sh.n_cols, seed++);
    for (int levels : {1, 2}) {
      const std::string what = GetParam() + " " + std::to_string(sh.n_rows) + "x" + std::to_string(sh.n_cols) + ", " +
                               std::to_string(levels) + " level(s)";
      const DeviceQ8 dq(randn(size_t(sh.n_cols), seed++), 1, sh.n_cols, levels);
      const auto [on, off, n] = both([&] { return gpu_product_q8(w.mat, dq); });
      EXPECT_EQ(on, off) << what << ": staged bits differ";
      EXPECT_EQ(n, staged_type && whole_chunks(sh.n_cols) ? 1 : 0) << what << ": staged launches";
      EXPECT_EQ(group_launches, one_chunk(sh.n_cols) ? 1 : 0) << what << ": row-group launches";
      const DeviceQ8 dq2(randn(size_t(2 * sh.n_cols), seed++), 2, sh.n_cols, levels);
      const auto [on2, off2, n2] = both([&] { return gpu_product_q8(w.mat, dq2); });
      EXPECT_EQ(on2, off2) << what << ", two tokens";
      EXPECT_EQ(n2, 0) << what << ", two tokens: staged launches";
    }
  }
  const int64_t E = 4, F = 37, H = 6144, k = 3;
  const TestWeight a(type(), 40, H, 991), b(type(), 3, H, 992), c(type(), 96, H, 993), we(type(), E * F, H, 994),
      we2(type(), E * F, H, 995), sh(type(), F, H, 996), sh2(type(), F, H, 997);
  const std::vector<int32_t> ids = {3, -1, 1};
  const DeviceBuffer dids = to_device(ids);
  for (int levels : {1, 2}) {
    const std::string name = GetParam() + ", " + std::to_string(levels) + " level(s)";
    const DeviceQ8 dq(randn(size_t(H), uint32_t(1000 + levels)), 1, H, levels);
    const std::vector<QuantMatrix> mats = {a.mat, b.mat, c.mat};
    const auto [many_on, many_off, n_many] = both([&] {
      std::vector<DeviceBuffer> ys;
      std::vector<float*> yp;
      for (const QuantMatrix& m : mats) {
        ys.push_back(to_device(std::vector<float>(size_t(m.n_rows), kUnwritten)));
        yp.push_back(ys.back().as<float>());
      }
      matmul_many_q8(mats.data(), yp.data(), 3, dq.act, nullptr);
      synchronize();
      std::vector<std::vector<float>> out;
      for (size_t i = 0; i < mats.size(); ++i) out.push_back(to_host<float>(ys[i], size_t(mats[i].n_rows)));
      return out;
    });
    EXPECT_EQ(many_on, many_off) << name << ": three products in one launch";
    EXPECT_EQ(n_many, staged_type ? 1 : 0) << name << ": three products, staged launches";
    const DeviceQ8 dx(randn(size_t(2 * H), uint32_t(1010 + levels)), 2, H, levels);
    const SharedPair two{&sh.mat, &sh2.mat, 1};
    const auto [pair_on, pair_off, n_pair] = both([&] {
      const std::vector<float> unwritten(size_t((k + 1) * F), kUnwritten);
      DeviceBuffer g = to_device(unwritten), u = to_device(unwritten);
      matmul_experts_pair_q8(we.mat, we2.mat, F, dids.as<int32_t>(), k, dx.act, k, g.as<float>(), u.as<float>(),
                             nullptr, &two);
      synchronize();
      return std::pair{to_host<float>(g, size_t((k + 1) * F)), to_host<float>(u, size_t((k + 1) * F))};
    });
    EXPECT_EQ(pair_on, pair_off) << name << ": expert pairs with a shared pair";
    EXPECT_EQ(n_pair, staged_type ? 1 : 0) << name << ": expert pairs, staged launches";
    EXPECT_EQ(pair_on.first[size_t(F)], kUnwritten) << name << ": the unused pair was written";
  }
  // Expert down products of 2048 columns with a shared expert (GLM-5's shape, fewer rows: 37 per
  // expert, not a whole number of row groups per block).
  const int64_t Hd = 2048;
  const TestWeight wd(type(), E * F, Hd, 998), shd(type(), F, Hd, 999);
  for (int levels : {1, 2}) {
    const std::string name = GetParam() + ", " + std::to_string(levels) + " level(s), 2048 columns";
    const std::vector<float> x = randn(size_t(2 * Hd), uint32_t(1020 + levels));
    const DeviceQ8 dx(x, 2, Hd, levels);
    const DeviceQ8 dx0(std::vector<float>(x.begin(), x.begin() + Hd), 1, Hd, levels);
    const DeviceQ8 dx1(std::vector<float>(x.begin() + Hd, x.end()), 1, Hd, levels);
    const SharedPair one{&shd.mat, nullptr, 1};
    const auto [on, off, n] = both([&] {
      DeviceBuffer y = to_device(std::vector<float>(size_t((k + 1) * F), kUnwritten));
      matmul_experts_q8(wd.mat, F, dids.as<int32_t>(), k, dx.act, k, y.as<float>(), nullptr, &one);
      synchronize();
      return to_host<float>(y, size_t((k + 1) * F));
    });
    EXPECT_EQ(on, off) << name << ": expert products with a shared one";
    EXPECT_EQ(n, eight_blocks ? 1 : 0) << name << ": staged launches";
    EXPECT_EQ(group_launches, one_chunk(Hd) ? 1 : 0) << name << ": row-group launches";
    EXPECT_EQ(on[size_t(F)], kUnwritten) << name << ": the unused pair was written";
    for (int64_t p = 0; p < k; ++p) {
      if (ids[size_t(p)] < 0) continue;
      EXPECT_EQ(std::vector<float>(on.begin() + p * F, on.begin() + (p + 1) * F),
                gpu_product_q8(expert_rows(wd.mat, ids[size_t(p)], F), dx0))
          << name << ": pair " << p;
    }
    EXPECT_EQ(std::vector<float>(on.begin() + k * F, on.end()), gpu_product_q8(shd.mat, dx1)) << name << ": shared row";
  }
}

INSTANTIATE_TEST_SUITE_P(Types, CudaMatmulQ8, ::testing::Values("q8_0", "q4_K", "q5_K", "q6_K", "q2_K", "q3_K", "iq4_xs",
                                                                  "iq2_xxs", "iq3_xxs", "iq3_s", "iq2_xs", "iq2_s",
                                                                  "iq1_s", "iq1_m", "q4_0", "iq4_nl"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(CudaMatmulQ8Api, SupportedTypesAndRefusals) {
  SPARSEMLA_REQUIRE_GPU();
  size_t n = 0;
  const gguf::TypeTraits* all = gguf::all_types(&n);
  for (size_t i = 0; i < n; ++i) {
    const GgmlType t = all[i].type;
    EXPECT_EQ(q8_supported(t), t == GgmlType::Q8_0 || t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K ||
                                   t == GgmlType::Q2_K || t == GgmlType::Q3_K || t == GgmlType::IQ4_XS ||
                                   t == GgmlType::IQ2_XXS || t == GgmlType::IQ3_XXS || t == GgmlType::IQ3_S ||
                                   t == GgmlType::IQ2_XS || t == GgmlType::IQ2_S || t == GgmlType::IQ1_S ||
                                   t == GgmlType::IQ1_M || t == GgmlType::Q4_0 || t == GgmlType::IQ4_NL)
        << all[i].name;
  }
  DeviceBuffer buf(1 << 16);
  DeviceQ8 x(randn(256, 9), 1, 256);
  float* y = buf.as<float>();
  QuantMatrix m;
  m.type = GgmlType::MXFP4;
  m.n_rows = 4;
  m.n_cols = 256;
  m.row_bytes = gguf::row_bytes(m.type, 256);
  m.data = buf.get();
  const std::string refused = test::error_of([&] { matmul_decode_q8(m, x.act, y, nullptr); });
  EXPECT_NE(refused.find("mxfp4"), std::string::npos) << refused;
  EXPECT_NE(test::error_of([&] { matmul_experts_q8(m, 2, nullptr, 1, x.act, 1, y, nullptr); }).find("mxfp4"),
            std::string::npos);
  m.type = GgmlType::Q4_K;
  m.n_cols = 512;
  m.row_bytes = gguf::row_bytes(m.type, 512);
  EXPECT_NE(test::error_of([&] { matmul_decode_q8(m, x.act, y, nullptr); }).find("columns"), std::string::npos);
  Q8Activations small;
  small.data = buf.get();
  small.bytes = 100;
  EXPECT_NE(test::error_of([&] { quantize_activations(y, 1, 256, small, nullptr); }).find("bytes"), std::string::npos);
  EXPECT_NE(test::error_of([&] { quantize_activations(y, 1, 100, x.act, nullptr); }).find("multiple of 32"),
            std::string::npos);
}

}  // namespace
}  // namespace sparsemla::cuda

#else

TEST(CudaMatmul, Skipped) { GTEST_SKIP() << "built without CUDA"; }

#endif
