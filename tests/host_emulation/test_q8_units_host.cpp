// The int8 decode units of the CUDA decode kernels (src/ops/cuda/q8_units.cuh) run on the host: the
// host compiler builds them against cuda/*.h beside this file, which stand in for the few CUDA names
// they use with the device's arithmetic. So a unit's decoding is checked in CI, where there is no
// GPU; the GPU tests (CudaMatmulQ8, test_cuda_matmul.cpp) run the kernels themselves.
//
// For every unit: rows of a random weight (quantized from N(0, 1) where the project can write the
// type, else random blocks with small scales: quant_test_util.h) times activations quantized on one
// and two levels by the rule of quant_matmul_q8.h (reproduced on the host there), summed unit by
// unit as the kernels sum them (load, load_x, fma), against double sums of the weights as the CPU
// dequantizes them (gguf::dequantize_row) times the dequantized activations: only fp32 rounding
// differs (error per row relative to its sum of |w x|: <= 1e-6; 0.6e-8 to 3.5e-8 measured on x86-64
// for every unit; one wrong element per block gives ~1e-3 and more). And each unit's loads stay
// inside its block: blocks placed against inaccessible pages.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../unit/quant_test_util.h"
#include "host_tables.h"
#include "gguf/ggml_types.h"
#include "gguf/quants.h"
#include "ops/cuda/q8_units.cuh"

namespace sparsemla::cuda {
namespace {

using gguf::GgmlType;
using namespace q8units;
using test_q8::host_tables;

// One token's activations on L levels in the layout the units read (TokenX): q[l] rows and the
// blocks' {scale, sum}; x_hat their dequantized values.
struct HostTokenX {
  std::vector<int8_t> q[2];
  std::vector<int2> xb;
  std::vector<double> x_hat;
};
HostTokenX quantize_token(const std::vector<float>& x, int levels) {
  const test_q8::HostQ8 h = test_q8::quantize_on_host(x, levels);
  HostTokenX t;
  t.q[0] = h.q;
  t.q[1] = levels == 2 ? h.r : std::vector<int8_t>(h.q.size());
  for (size_t b = 0; b < h.d.size(); ++b) t.xb.push_back(make_int2(__float_as_int(h.d[b]), h.sum[b]));
  t.x_hat = test_q8::dequantized(h);
  return t;
}

// The largest relative L2 error of rows of W x_hat summed by unit V, over `rows` rows of n_cols.
template <class V, int L>
double unit_error(GgmlType type, const std::vector<uint8_t>& w, int64_t rows, int64_t n_cols,
                  const std::vector<float>& x) {
  const QuantTables tb = host_tables();
  const HostTokenX hx = quantize_token(x, L);
  TokenX<L> tx;
  tx.q[0] = hx.q[0].data();
  if constexpr (L == 2) tx.q[1] = hx.q[1].data();
  tx.xb = hx.xb.data();
  const uint64_t rb = gguf::row_bytes(type, uint64_t(n_cols));
  const int64_t n_blocks = n_cols / V::kBlock;
  std::vector<float> deq(static_cast<size_t>(n_cols));
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w.data() + r * rb;
    float acc = 0.0f;
    for (int64_t b = 0; b < n_blocks; ++b)
      for (int u = 0; u < V::kUnitsPerBlock; ++u) {
        const typename V::W wu = V::load(row + b * V::kBytes, u, tb);
        const typename V::template X<L> xu = V::template load_x<L>(tx, b, u);
        acc = V::fma(wu, xu, acc);
      }
    gguf::dequantize_row(type, row, deq.data(), n_cols);
    double ref = 0, norm = 0;
    for (int64_t c = 0; c < n_cols; ++c) {
      ref += double(deq[size_t(c)]) * hx.x_hat[size_t(c)];
      norm += std::fabs(double(deq[size_t(c)]) * hx.x_hat[size_t(c)]);
    }
    // Relative to the row's sum of |w x| (a row sum near zero would make any rounding look large).
    worst = std::max(worst, std::fabs(double(acc) - ref) / std::max(norm, 1e-30));
  }
  return worst;
}

// Loads of every unit of a block placed against an inaccessible page on either side: a read past
// the block (or before it) faults.
template <class V>
void loads_stay_inside(const std::vector<uint8_t>& block) {
  const QuantTables tb = host_tables();
  const long page = sysconf(_SC_PAGESIZE);
  auto* m = static_cast<uint8_t*>(mmap(nullptr, size_t(3 * page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(m, MAP_FAILED);
  ASSERT_EQ(mprotect(m, size_t(page), PROT_NONE), 0);
  ASSERT_EQ(mprotect(m + 2 * page, size_t(page), PROT_NONE), 0);
  // (The end of a page: 16-byte aligned bases put blocks at multiples of kBytes, so this is where a
  // block ends in a weight; a block at the page start is 16-byte aligned.)
  for (uint8_t* at : {m + 2 * page - V::kBytes, m + page}) {
    std::memcpy(at, block.data(), V::kBytes);
    for (int u = 0; u < V::kUnitsPerBlock; ++u) {
      const typename V::W wu = V::load(at, u, tb);
      // (Every byte of the decoded unit used, so that no load is left out.)
      unsigned char bytes[sizeof(wu)], sum = 0;
      std::memcpy(bytes, &wu, sizeof(wu));
      for (unsigned char c : bytes) sum = static_cast<unsigned char>(sum ^ c);
      volatile unsigned char sink = sum;
      (void)sink;
    }
  }
  munmap(m, size_t(3 * page));
}

template <class V>
void check_unit(GgmlType type) {
  SCOPED_TRACE(std::string(gguf::type_name(type)));
  const int64_t rows = 12, n_cols = 8960;  // 35 blocks of 256 (280 of 32)
  const std::vector<uint8_t> w = test_q8::make_weight(type, rows, n_cols, 77 + uint32_t(type));
  const std::vector<float> x = test::randn(size_t(n_cols), 5 + uint32_t(type));
  const double e1 = unit_error<V, 1>(type, w, rows, n_cols, x), e2 = unit_error<V, 2>(type, w, rows, n_cols, x);
  EXPECT_LE(e1, 1e-6) << "one level";
  EXPECT_LE(e2, 1e-6) << "two levels";
  std::printf("  %-8s unit dots against W x_hat: max error %.2e (one level), %.2e (two)\n",
              std::string(gguf::type_name(type)).c_str(), e1, e2);
  loads_stay_inside<V>(std::vector<uint8_t>(w.begin(), w.begin() + V::kBytes));
}

TEST(Q8UnitsOnTheHost, UnitDotsMatchTheCpuDequantizerAndStayInsideTheirBlocks) {
  check_unit<Q80Unit>(GgmlType::Q8_0);
  check_unit<Q4KUnit>(GgmlType::Q4_K);
  check_unit<Q5KUnit>(GgmlType::Q5_K);
  check_unit<Q6KUnit>(GgmlType::Q6_K);
  check_unit<Q2KUnit>(GgmlType::Q2_K);
  check_unit<Q3KUnit>(GgmlType::Q3_K);
  check_unit<IQ4XSUnit>(GgmlType::IQ4_XS);
  check_unit<IQ2XXSUnit>(GgmlType::IQ2_XXS);
  check_unit<IQ3XXSUnit>(GgmlType::IQ3_XXS);
  check_unit<IQ3SUnit>(GgmlType::IQ3_S);
  check_unit<IQ2XSUnit>(GgmlType::IQ2_XS);
  check_unit<IQ2SUnit>(GgmlType::IQ2_S);
  check_unit<IQ1SUnit>(GgmlType::IQ1_S);
  check_unit<IQ1MUnit>(GgmlType::IQ1_M);
  check_unit<Q40Unit>(GgmlType::Q4_0);
  check_unit<IQ4NLUnit>(GgmlType::IQ4_NL);
}

// The check above can fail: a unit that decodes one element of each block wrongly (its first
// word's lowest byte negated, as a sign slip would) is caught by a wide margin.
struct BrokenIQ2XXS : IQ2XXSUnit {
  static W load(const uint8_t* b, int k, const QuantTables& tb) {
    W w = IQ2XXSUnit::load(b, k, tb);
    w.v[0][0][0] = (w.v[0][0][0] & 0xFFFFFF00u) | uint32_t(uint8_t(-int8_t(w.v[0][0][0] & 0xFF)));
    return w;
  }
};
TEST(Q8UnitsOnTheHost, AWrongElementIsCaught) {
  const int64_t rows = 4, n_cols = 8960;
  const std::vector<uint8_t> w = test_q8::make_weight(GgmlType::IQ2_XXS, rows, n_cols, 3);
  const std::vector<float> x = test::randn(size_t(n_cols), 4);
  const double e = unit_error<BrokenIQ2XXS, 2>(GgmlType::IQ2_XXS, w, rows, n_cols, x);
  EXPECT_GT(e, 1e-3);
  std::printf("  iq2_xxs with one element per block negated: error %.2e\n", e);
}

}  // namespace
}  // namespace sparsemla::cuda
