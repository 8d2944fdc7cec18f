// The bf16 copies of the cuBLAS prefill (src/ops/cuda/dequant_bf16.cuh) run by the host emulation
// (cuda/emu.h), so that CI checks them without a GPU: dequantize_bf16_kernel for every type the
// products take (its units, runs and row offsets) over rows inside a weight, against the CPU's
// dequantization rounded to nearest even (util/half.h) bit for bit; and round_bf16_kernel against the
// same rounding on lengths with and without a tail of fewer than 8 values, special values included.
// On a GPU: CudaMatmul.DequantizeBf16EqualsCpuRoundedBitForBit and CudaMatmul.CublasPrefillMatchesCpu.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../unit/quant_test_util.h"
#include "gguf/ggml_types.h"
#include "gguf/quants.h"
#include "host_tables.h"
#include "ops/cuda/dequant_bf16.cuh"
#include "util/half.h"

namespace sparsemla::cuda {
namespace {

using gguf::GgmlType;

template <GgmlType T>
void check_rows(uint32_t seed) {
  using D = dq::Dq<T>;
  const gguf::TypeTraits& tr = gguf::traits(T);
  SCOPED_TRACE(tr.name);
  const int64_t rows = 7, row0 = 2, n = 4;
  const int cols = tr.block_size == 256 ? 1280 : tr.block_size == 32 ? 480 : 200;  // (plain types: 8 | cols)
  const std::vector<uint8_t> w = test_q8::make_weight(T, rows, cols, seed);
  const uint64_t rb = gguf::row_bytes(T, uint64_t(cols));
  std::vector<uint16_t> out(size_t((n + 1) * cols), 0xdeadu);  // (a row past the end: must stay)
  // Far fewer threads than units (64 units a round): the grid-stride loop takes 2-5 rounds, the
  // last partial for most types.
  emu::launch(dequantize_bf16_kernel<D>, dim3(1), dim3(32), 0, emu::Order::kForward, w.data() + row0 * rb, rb, n, cols,
              test_q8::host_tables(), reinterpret_cast<__nv_bfloat16*>(out.data()));
  std::vector<float> want(static_cast<size_t>(cols));
  for (int64_t r = 0; r < n; ++r) {
    gguf::dequantize_row(T, w.data() + (row0 + r) * rb, want.data(), cols);
    for (int c = 0; c < cols; ++c)
      ASSERT_EQ(out[size_t(r * cols + c)], f32_to_bf16(want[size_t(c)]))
          << "row " << row0 + r << " col " << c << ": " << want[size_t(c)];
  }
  for (int c = 0; c < cols; ++c) ASSERT_EQ(out[size_t(n * cols + c)], 0xdeadu) << "written past the last row, col " << c;
}

TEST(DequantBf16OnTheHost, RowsEqualTheCpuRoundedBitForBit) {
  check_rows<GgmlType::F32>(1);
  check_rows<GgmlType::F16>(2);
  check_rows<GgmlType::BF16>(3);
  check_rows<GgmlType::Q8_0>(4);
  check_rows<GgmlType::Q4_0>(5);
  check_rows<GgmlType::IQ4_NL>(6);
  check_rows<GgmlType::MXFP4>(7);
  check_rows<GgmlType::Q2_K>(8);
  check_rows<GgmlType::Q3_K>(9);
  check_rows<GgmlType::Q4_K>(10);
  check_rows<GgmlType::Q5_K>(11);
  check_rows<GgmlType::Q6_K>(12);
  check_rows<GgmlType::IQ4_XS>(13);
  check_rows<GgmlType::IQ2_XXS>(14);
  check_rows<GgmlType::IQ2_XS>(15);
  check_rows<GgmlType::IQ2_S>(16);
  check_rows<GgmlType::IQ3_XXS>(17);
  check_rows<GgmlType::IQ3_S>(18);
  check_rows<GgmlType::IQ1_S>(19);
  check_rows<GgmlType::IQ1_M>(20);
}

TEST(DequantBf16OnTheHost, ActivationsRoundToNearestEven) {
  const float inf = std::numeric_limits<float>::infinity();
  // Ties to even (0x3f808000 down to 0x3f80, 0x3f818000 up to 0x3f82), a carry into the exponent,
  // signed zeros, infinities, the largest finite float (rounds to infinity), a subnormal.
  const std::vector<float> special = {bits_to_f32(0x3f808000u), bits_to_f32(0x3f818000u), bits_to_f32(0x3fffffffu),
                                      -0.0f, 0.0f, inf, -inf, std::numeric_limits<float>::max(), 1e-40f};
  for (int64_t n : {int64_t(8), int64_t(13), int64_t(200), int64_t(517)}) {
    std::vector<float> x = test::randn(size_t(n), uint32_t(n));
    for (size_t i = 0; i < special.size() && i < x.size(); ++i) x[x.size() - 1 - i] = special[i];  // (the tail too)
    std::vector<uint16_t> out(size_t(n), 0xdeadu);
    emu::launch(round_bf16_kernel<__nv_bfloat16>, dim3(2), dim3(32), 0, emu::Order::kForward, x.data(), n,
                reinterpret_cast<__nv_bfloat16*>(out.data()));
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(out[size_t(i)], f32_to_bf16(x[size_t(i)])) << "n " << n << ", value " << i << ": " << x[size_t(i)];
  }
}

}  // namespace
}  // namespace sparsemla::cuda
