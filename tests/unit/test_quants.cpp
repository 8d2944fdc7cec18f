// CPU (de)quantization against reference vectors made by gguf-py, ggml's own Python package
// (tests/data/quants/, scripts/reference/make_quant_vectors.py): every dequantizable type, the
// quantizers the writer uses (the fitted Q4_0/Q4_K/Q5_K/Q6_K by round-trip error instead),
// refusals of the other types, and the type table's sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "gguf/quants.h"
#include "test_util.h"
#include "util/error.h"
#include "util/half.h"

namespace sparsemla::gguf {
namespace {

using test::error_of;

// Every type with a CPU dequantization; each has dequant_<name>.{bin,f32} in tests/data/quants.
constexpr GgmlType kDequantTypes[] = {
    GgmlType::F32,    GgmlType::F16,     GgmlType::BF16,   GgmlType::Q4_0,    GgmlType::Q4_1,
    GgmlType::Q5_0,   GgmlType::Q5_1,    GgmlType::Q8_0,   GgmlType::Q2_K,    GgmlType::Q3_K,
    GgmlType::Q4_K,   GgmlType::Q5_K,    GgmlType::Q6_K,   GgmlType::IQ1_S,   GgmlType::IQ1_M,
    GgmlType::IQ2_XXS, GgmlType::IQ2_XS, GgmlType::IQ2_S,  GgmlType::IQ3_XXS, GgmlType::IQ3_S,
    GgmlType::IQ4_NL, GgmlType::IQ4_XS,  GgmlType::TQ1_0,  GgmlType::TQ2_0,   GgmlType::MXFP4,
};

// Plain conversions and Q8_0 (one product of an int8 and the fp16 scale) must match gguf-py bit
// for bit. The other formats evaluate longer float expressions (scale products, d * q - m), which
// a compiler allowed to contract or reorder may round differently: they may be one ulp off.
bool exact_type(GgmlType t) {
  return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16 || t == GgmlType::Q8_0;
}

// The types quantize_row writes exactly as gguf-py does; each has quant_<name>.{f32,bin}.
constexpr GgmlType kQuantTypes[] = {GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0};

// The types quantize_row fits with ggml's reference algorithms; no reference bytes, checked by
// round trip (QuantizeFitted below).
constexpr GgmlType kFittedTypes[] = {GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K};

// A file of tests/data/quants/, or a test failure naming it when it is missing.
std::vector<uint8_t> read_vector_file(const std::string& name) {
  const std::string path = test::data_path("quants/" + name);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    ADD_FAILURE() << "missing reference file " << path
                  << " (generate it with scripts/reference/make_quant_vectors.py)";
    return {};
  }
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<float> as_floats(const std::vector<uint8_t>& bytes) {
  std::vector<float> v(bytes.size() / sizeof(float));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
  return v;
}

// Position of a float on a line where neighbouring floats are 1 apart (+0 and -0 coincide).
int64_t ordinal(float f) {
  const uint32_t u = f32_to_bits(f);
  const int64_t magnitude = u & 0x7fffffffu;
  return u >> 31 ? -magnitude : magnitude;
}

std::string bits_hex(float f) {
  std::ostringstream s;
  s << "0x" << std::hex << f32_to_bits(f);
  return s.str();
}

std::string param_name(const testing::TestParamInfo<GgmlType>& info) {
  return std::string(type_name(info.param));
}

// ---- dequantization ----

class DequantizeReference : public testing::TestWithParam<GgmlType> {
 protected:
  void SetUp() override {
    const TypeTraits& tr = traits(GetParam());
    blocks_ = read_vector_file("dequant_" + std::string(tr.name) + ".bin");
    expected_ = as_floats(read_vector_file("dequant_" + std::string(tr.name) + ".f32"));
    ASSERT_FALSE(blocks_.empty());
    ASSERT_EQ(blocks_.size() % tr.type_size, 0u) << "not a whole number of blocks";
    n_blocks_ = static_cast<int64_t>(blocks_.size() / tr.type_size);
    ASSERT_GE(n_blocks_, 8);
    ASSERT_EQ(expected_.size(), static_cast<size_t>(n_blocks_) * tr.block_size);
  }

  std::vector<uint8_t> blocks_;
  std::vector<float> expected_;
  int64_t n_blocks_ = 0;
};

TEST_P(DequantizeReference, MatchesGgufPy) {
  const GgmlType t = GetParam();
  std::vector<float> got(expected_.size());
  dequantize_row(t, blocks_.data(), got.data(), static_cast<int64_t>(got.size()));

  int64_t max_ulp = 0;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float want = expected_[i];
    const float have = got[i];
    if (exact_type(t)) {
      if (f32_to_bits(want) != f32_to_bits(have) && reported++ < 5)
        ADD_FAILURE() << "element " << i << ": want " << bits_hex(want) << " (" << want << "), got "
                      << bits_hex(have) << " (" << have << ")";
      continue;
    }
    // NaN and infinity positions first: ulp distances are meaningless there.
    if (std::isnan(want) || std::isnan(have) || std::isinf(want) || std::isinf(have)) {
      const bool same = (std::isnan(want) && std::isnan(have)) || want == have;
      if (!same && reported++ < 5) ADD_FAILURE() << "element " << i << ": want " << want << ", got " << have;
      continue;
    }
    const int64_t ulp = std::llabs(ordinal(want) - ordinal(have));
    max_ulp = std::max(max_ulp, ulp);
    if (ulp > 1 && reported++ < 5)
      ADD_FAILURE() << "element " << i << ": want " << want << " (" << bits_hex(want) << "), got " << have
                    << " (" << bits_hex(have) << "), " << ulp << " ulp apart";
  }
  EXPECT_EQ(reported, 0) << "mismatching elements of " << type_name(t);
  RecordProperty("max_ulp", static_cast<int>(max_ulp));
}

// A row is a run of independent blocks: decoding them one at a time gives the same floats.
TEST_P(DequantizeReference, BlocksDecodeIndependently) {
  const TypeTraits& tr = traits(GetParam());
  std::vector<float> whole(expected_.size());
  dequantize_row(GetParam(), blocks_.data(), whole.data(), static_cast<int64_t>(whole.size()));
  std::vector<float> one(tr.block_size);
  for (int64_t b = 0; b < n_blocks_; ++b) {
    dequantize_row(GetParam(), blocks_.data() + b * tr.type_size, one.data(), tr.block_size);
    ASSERT_EQ(std::memcmp(one.data(), whole.data() + b * tr.block_size, one.size() * sizeof(float)), 0)
        << "block " << b;
  }
}

// Tensor data in a file is not aligned for the block structs (and blocks of 17 or 18 bytes follow
// each other), so decoding must not depend on the source address.
TEST_P(DequantizeReference, UnalignedSourceDecodesTheSame) {
  std::vector<uint8_t> shifted(blocks_.size() + 1);
  std::memcpy(shifted.data() + 1, blocks_.data(), blocks_.size());
  std::vector<float> aligned(expected_.size()), unaligned(expected_.size());
  dequantize_row(GetParam(), blocks_.data(), aligned.data(), static_cast<int64_t>(aligned.size()));
  dequantize_row(GetParam(), shifted.data() + 1, unaligned.data(), static_cast<int64_t>(unaligned.size()));
  EXPECT_EQ(std::memcmp(aligned.data(), unaligned.data(), aligned.size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(AllFormats, DequantizeReference, testing::ValuesIn(kDequantTypes), param_name);

// The tested list is exactly the set the type table marks dequantizable.
TEST(Dequantize, TestedTypesAreTheDequantizableOnes) {
  size_t count = 0;
  const TypeTraits* all = all_types(&count);
  for (size_t i = 0; i < count; ++i) {
    const bool listed = std::find(std::begin(kDequantTypes), std::end(kDequantTypes), all[i].type) !=
                        std::end(kDequantTypes);
    EXPECT_EQ(listed, all[i].dequantizable) << all[i].name;
  }
}

TEST(Dequantize, UnsupportedTypesThrowNamingTheType) {
  size_t count = 0;
  const TypeTraits* all = all_types(&count);
  std::vector<uint8_t> src(4096);
  std::vector<float> dst(4096);
  for (size_t i = 0; i < count; ++i) {
    if (all[i].dequantizable) continue;
    const TypeTraits& tr = all[i];
    const std::string msg = error_of([&] { dequantize_row(tr.type, src.data(), dst.data(), tr.block_size); });
    EXPECT_NE(msg.find(std::string(tr.name)), std::string::npos) << tr.name << ": " << msg;
  }
}

TEST(Dequantize, RejectsPartialBlocks) {
  std::vector<uint8_t> src(2 * 210);
  std::vector<float> dst(512);
  EXPECT_NE(error_of([&] { dequantize_row(GgmlType::Q4_0, src.data(), dst.data(), 31); }).find("q4_0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dequantize_row(GgmlType::Q6_K, src.data(), dst.data(), 300); }).find("q6_K"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dequantize_row(GgmlType::F32, src.data(), dst.data(), -1); }), "(no error)");
}

// ---- quantization ----

class QuantizeReference : public testing::TestWithParam<GgmlType> {};

TEST_P(QuantizeReference, MatchesGgufPyBytes) {
  const GgmlType t = GetParam();
  const TypeTraits& tr = traits(t);
  const std::vector<float> input = as_floats(read_vector_file("quant_" + std::string(tr.name) + ".f32"));
  const std::vector<uint8_t> want = read_vector_file("quant_" + std::string(tr.name) + ".bin");
  ASSERT_FALSE(input.empty());
  ASSERT_EQ(input.size() % tr.block_size, 0u);
  ASSERT_EQ(want.size(), row_bytes(t, input.size()));

  std::vector<uint8_t> got(want.size());
  quantize_row(t, input.data(), got.data(), static_cast<int64_t>(input.size()));
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && reported++ < 5) {
      const size_t elem = i / tr.type_size * tr.block_size;
      ADD_FAILURE() << "byte " << i << " (block starting at element " << elem << ", input "
                    << bits_hex(input[elem]) << "): want " << int(want[i]) << ", got " << int(got[i]);
    }
  }
  EXPECT_EQ(reported, 0);
}

INSTANTIATE_TEST_SUITE_P(WriterFormats, QuantizeReference, testing::ValuesIn(kQuantTypes), param_name);

TEST(Quantize, F32CopiesEveryBitPattern) {
  const std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,
                                      0x7fc00000u, 0x7f800001u, 0xffbfffffu, 0x00000001u,
                                      0x3f800000u, 0xc2f6e979u, 0x7f7fffffu, 0x807fffffu};
  std::vector<float> in(bits.size());
  std::memcpy(in.data(), bits.data(), bits.size() * 4);
  std::vector<uint32_t> out(bits.size());
  quantize_row(GgmlType::F32, in.data(), out.data(), static_cast<int64_t>(in.size()));
  EXPECT_EQ(out, bits);
}

TEST(Quantize, Q8_0RefusesNonFiniteInput) {
  std::vector<float> in(64, 1.0f);
  in[40] = std::numeric_limits<float>::infinity();
  std::vector<uint8_t> out(68);
  const std::string msg = error_of([&] { quantize_row(GgmlType::Q8_0, in.data(), out.data(), 64); });
  EXPECT_NE(msg.find("q8_0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("inf"), std::string::npos) << msg;
}

TEST(Quantize, OtherTypesThrowNamingTheType) {
  size_t count = 0;
  const TypeTraits* all = all_types(&count);
  std::vector<float> src(4096, 0.5f);
  std::vector<uint8_t> dst(8192);
  for (size_t i = 0; i < count; ++i) {
    const GgmlType t = all[i].type;
    if (std::find(std::begin(kQuantTypes), std::end(kQuantTypes), t) != std::end(kQuantTypes) ||
        std::find(std::begin(kFittedTypes), std::end(kFittedTypes), t) != std::end(kFittedTypes) ||
        t == GgmlType::F32)
      continue;
    const std::string msg = error_of([&] { quantize_row(t, src.data(), dst.data(), all[i].block_size); });
    EXPECT_NE(msg.find(std::string(all[i].name)), std::string::npos) << all[i].name << ": " << msg;
  }
  EXPECT_NE(error_of([&] { quantize_row(GgmlType::Q8_0, src.data(), dst.data(), 48); }), "(no error)");
}

// ---- fitted quantizers: Q4_0, Q4_K, Q5_K, Q6_K ----
// No reference bytes exist for these (gguf-py cannot quantize to K-quants, make_quant_vectors.py
// does not write Q4_0, and ggml's own K-quant output moves with its build's FMA contraction), so
// they are checked by what they must guarantee: round trips through dequantize_row within an
// error budget, exact zeros, and refusals.

// Seeded N(0, 1) samples by Box-Muller over mt19937_64, whose output the standard fixes (the
// std:: distributions are implementation-defined), so every platform sees the same data.
class Gaussian {
 public:
  explicit Gaussian(uint64_t seed) : rng_(seed) {}
  double uniform() { return (static_cast<double>(rng_() >> 11) + 0.5) * 0x1.0p-53; }  // in (0, 1)
  double next() {
    const double r = std::sqrt(-2.0 * std::log(uniform()));
    return r * std::cos(2.0 * 3.14159265358979323846 * uniform());
  }

 private:
  std::mt19937_64 rng_;
};

constexpr int64_t kRowLen = 256 * 64;  // 64 super-blocks, 512 Q4_0 blocks

std::vector<float> gaussian_row(uint64_t seed, double sigma) {
  Gaussian g(seed);
  std::vector<float> v(kRowLen);
  for (float& f : v) f = static_cast<float>(sigma * g.next());
  return v;
}

// N(0, 1) with 1% of the elements multiplied by 10..30 (a heavy-tailed weight matrix).
std::vector<float> outlier_row(uint64_t seed) {
  Gaussian g(seed);
  std::vector<float> v = gaussian_row(seed + 1, 1.0);
  for (float& f : v)
    if (g.uniform() < 0.01) f *= static_cast<float>(10.0 + 20.0 * g.uniform());
  return v;
}

// N(0, s^2) with s drawn per 32 elements log-uniformly from [1e-3, 1]: sub-block scales far apart,
// which the K-quants must code as 6-bit fractions of the largest.
std::vector<float> mixed_scale_row(uint64_t seed) {
  Gaussian g(seed);
  std::vector<float> v(kRowLen);
  for (size_t i = 0; i < v.size(); i += 32) {
    const double s = std::pow(10.0, -3.0 * g.uniform());
    for (size_t j = i; j < i + 32; ++j) v[j] = static_cast<float>(s * g.next());
  }
  return v;
}

struct RoundTrip {
  std::vector<uint8_t> bytes;
  std::vector<float> out;
};

RoundTrip round_trip(GgmlType t, const std::vector<float>& in) {
  RoundTrip r;
  r.bytes.assign(row_bytes(t, in.size()), 0xAB);
  quantize_row(t, in.data(), r.bytes.data(), static_cast<int64_t>(in.size()));
  r.out.resize(in.size());
  dequantize_row(t, r.bytes.data(), r.out.data(), static_cast<int64_t>(in.size()));
  return r;
}

// RMS of the error over RMS of the data.
double relative_rms_error(const std::vector<float>& in, const std::vector<float>& out) {
  double err = 0.0, sig = 0.0;
  for (size_t i = 0; i < in.size(); ++i) {
    err += (double(out[i]) - in[i]) * (double(out[i]) - in[i]);
    sig += double(in[i]) * in[i];
  }
  return std::sqrt(err / sig);
}

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The quantization step of each element's block, read back from the block bytes independently of
// quants.cpp: |d| for Q4_0; for the K-quants the largest sub-block step d * scale of the 256-element
// super-block (a sub-block whose 6- or 8-bit scale rounds coarsely, or to 0, is held to its
// super-block's resolution).
std::vector<float> block_steps(GgmlType t, const std::vector<uint8_t>& bytes, size_t n) {
  const TypeTraits& tr = traits(t);
  std::vector<float> steps(n);
  for (size_t b = 0; b < n / tr.block_size; ++b) {
    const uint8_t* p = bytes.data() + b * tr.type_size;
    float step = 0.0f;
    if (t == GgmlType::Q4_0) {
      step = std::fabs(fp16_to_f32(load_u16(p)));
    } else if (t == GgmlType::Q4_K || t == GgmlType::Q5_K) {
      const float d = fp16_to_f32(load_u16(p));
      const uint8_t* s = p + 4;
      for (int g = 0; g < 8; ++g) {
        const int sc = g < 4 ? s[g] & 63 : (s[g + 4] & 0x0F) | ((s[g - 4] >> 6) << 4);
        step = std::max(step, d * static_cast<float>(sc));
      }
    } else if (t == GgmlType::Q6_K) {
      const float d = fp16_to_f32(load_u16(p + 208));
      for (int g = 0; g < 16; ++g)
        step = std::max(step, std::fabs(d * static_cast<float>(static_cast<int8_t>(p[192 + g]))));
    }
    std::fill(steps.begin() + b * tr.block_size, steps.begin() + (b + 1) * tr.block_size, step);
  }
  return steps;
}

struct ErrorBudget {
  GgmlType type;
  double gaussian;   // relative RMS error bound for N(0, 1) and N(0, 0.02^2)
  double outliers;   // ... for outlier_row
  double mixed;      // ... for mixed_scale_row
  double max_steps;  // max |error| per element, in block steps (see block_steps)
};

// Relative RMS error measured on the rows below, and the range over 199 other seeds per row kind:
//           N(0,1)  N(0,.02)  N(0,1e3)  outliers        mixed           max error / block step
//   q4_0    0.0868  0.0870    0.0864    0.143 [.125,.155]  0.0864 [.082,.091]  1.00 (1.003 at most)
//   q4_K    0.0715  0.0724    0.0714    0.098 [.090,.102]  0.0713 [.069,.075]  0.81 (0.87)
//   q5_K    0.0363  0.0364    0.0359    0.050 [.048,.053]  0.0368 [.035,.039]  0.74 (1.02)
//   q6_K    0.0178  0.0180    0.0179    0.032 [.030,.034]  0.0178 [.017,.019]  0.50 (0.60)
// (Gaussian rows over the other seeds: q4_0 [.084,.088], q4_K [.070,.073], q5_K [.035,.037],
// q6_K [.017,.018].) That is what the formats allow: a uniform quantizer with step D errs by
// D / sqrt(12) RMS; Q4_0's step is max|x| / 8 over 32 samples (max about 2.1 sigma for a
// Gaussian), about 0.075 sigma, plus the clipped far end (+8 steps is stored as +7). Each extra
// bit halves the error (Q5_K ~0.036, Q6_K ~0.018) and Q4_K's fitted scale and offset per 32
// elements beat Q4_0's symmetric one. Outliers widen the blocks they sit in. The bounds are the
// worst over all seeds plus about 10%.
// Max error: Q4_0's rounding is within half a step except the clipped end, exactly one step, plus
// 8 times the fp16 rounding of d (2^-11 relative): 1.004 steps. A K-quant sub-block's grid (scale
// and min coded in 6 bits as multiples of d and dmin, or 8 bits for Q6_K) can miss its fitted range
// by up to about nmax / 2 * d + dmin / 2, so elements at its ends may be clipped by a fraction of
// the super-block's largest step on top of the fit's own clipping; Q6_K's finer scales keep it under
// one step.
constexpr ErrorBudget kBudgets[] = {
    {GgmlType::Q4_0, 0.10, 0.17, 0.10, 1.01},
    {GgmlType::Q4_K, 0.08, 0.112, 0.083, 1.5},
    {GgmlType::Q5_K, 0.041, 0.058, 0.043, 1.5},
    {GgmlType::Q6_K, 0.020, 0.037, 0.021, 1.0},
};

const ErrorBudget& budget_of(GgmlType t) {
  for (const ErrorBudget& b : kBudgets)
    if (b.type == t) return b;
  throw std::logic_error("no error budget");
}

class QuantizeFitted : public testing::TestWithParam<GgmlType> {
 protected:
  // Checks relative RMS error against `bound` and max error against the block steps.
  void check(const char* what, const std::vector<float>& in, double bound) {
    const GgmlType t = GetParam();
    const RoundTrip r = round_trip(t, in);
    const double rel = relative_rms_error(in, r.out);
    EXPECT_LT(rel, bound) << what;
    RecordProperty(std::string("rel_rms_") + what, std::to_string(rel));

    const std::vector<float> steps = block_steps(t, r.bytes, in.size());
    double worst = 0.0;
    size_t worst_at = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      ASSERT_TRUE(std::isfinite(r.out[i])) << what << ": element " << i;
      const double ratio = std::fabs(double(r.out[i]) - in[i]) / steps[i];
      if (ratio > worst) {
        worst = ratio;
        worst_at = i;
      }
    }
    EXPECT_LE(worst, budget_of(t).max_steps)
        << what << ": element " << worst_at << " in " << in[worst_at] << " out " << r.out[worst_at]
        << " step " << steps[worst_at];
    RecordProperty(std::string("max_err_steps_") + what, std::to_string(worst));
  }
};

TEST_P(QuantizeFitted, GaussianRowsStayWithinTheErrorBudget) {
  check("normal_1", gaussian_row(101, 1.0), budget_of(GetParam()).gaussian);
  check("normal_0.02", gaussian_row(202, 0.02), budget_of(GetParam()).gaussian);
  check("normal_1000", gaussian_row(303, 1000.0), budget_of(GetParam()).gaussian);
}

TEST_P(QuantizeFitted, OutliersStayWithinTheErrorBudget) {
  check("outliers", outlier_row(404), budget_of(GetParam()).outliers);
}

TEST_P(QuantizeFitted, MixedSubBlockScalesStayWithinTheErrorBudget) {
  check("mixed", mixed_scale_row(505), budget_of(GetParam()).mixed);
}

// Zero blocks, and zero runs as long as a sub-block (32 elements for Q4_0/Q4_K/Q5_K, 16 for
// Q6_K) inside otherwise non-zero blocks, decode to exactly 0.
TEST_P(QuantizeFitted, ZerosComeBackExactly) {
  const GgmlType t = GetParam();
  const RoundTrip zeros = round_trip(t, std::vector<float>(kRowLen, 0.0f));
  for (size_t i = 0; i < zeros.out.size(); ++i) ASSERT_EQ(zeros.out[i], 0.0f) << "element " << i;

  const int run = t == GgmlType::Q6_K ? 16 : 32;
  std::vector<float> in = gaussian_row(606, 1.0);
  for (size_t i = 0; i < in.size(); i += 3 * run) std::fill(in.begin() + i, in.begin() + i + run, 0.0f);
  const RoundTrip r = round_trip(t, in);
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == 0.0f) {
      ASSERT_EQ(r.out[i], 0.0f) << "element " << i;
    }
  }
}

// A constant row is representable up to the fp16 rounding of the block scale (relative 2^-11)
// while that scale is a normal fp16 number, at least 2^-14: the smallest is Q6_K's |c| / 4096, so
// |c| >= 0.25 here. (Smaller rows get fp16's subnormal spacing of 2^-24, as in ggml.)
TEST_P(QuantizeFitted, ConstantRowsComeBackToFp16Precision) {
  for (float c : {1.0f, -1.0f, 0.3f, -0.37f, 3000.0f, -3000.0f}) {
    const RoundTrip r = round_trip(GetParam(), std::vector<float>(kRowLen, c));
    for (size_t i = 0; i < r.out.size(); ++i)
      ASSERT_NEAR(r.out[i], c, std::fabs(c) * 0x1.0p-10f) << "constant " << c << ", element " << i;
  }
}

// Quantization is per block: a row is the concatenation of its blocks quantized alone, and
// repeated calls give the same bytes.
TEST_P(QuantizeFitted, BlocksQuantizeIndependently) {
  const GgmlType t = GetParam();
  const TypeTraits& tr = traits(t);
  const std::vector<float> in = outlier_row(707);
  const RoundTrip whole = round_trip(t, in);
  EXPECT_EQ(round_trip(t, in).bytes, whole.bytes);
  std::vector<uint8_t> one(tr.type_size);
  for (size_t b = 0; b < in.size() / tr.block_size; ++b) {
    quantize_row(t, in.data() + b * tr.block_size, one.data(), tr.block_size);
    ASSERT_EQ(std::memcmp(one.data(), whole.bytes.data() + b * tr.type_size, tr.type_size), 0)
        << "block " << b;
  }
}

TEST_P(QuantizeFitted, RefusesNonFiniteInput) {
  const GgmlType t = GetParam();
  const std::string name(type_name(t));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {nan, inf, -inf}) {
    std::vector<float> in = gaussian_row(808, 1.0);
    in[300] = bad;  // in the second block of every type
    std::vector<uint8_t> out(row_bytes(t, in.size()));
    const std::string msg = error_of([&] { quantize_row(t, in.data(), out.data(), kRowLen); });
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::isnan(bad) ? "nan" : "inf"), std::string::npos) << msg;
  }
}

// Finite values whose block scale exceeds fp16 would decode to inf/NaN: refused, not stored.
TEST_P(QuantizeFitted, RefusesScalesBeyondFp16) {
  const GgmlType t = GetParam();
  std::vector<float> in = gaussian_row(909, 1.0);
  in[5] = 1e9f;
  std::vector<uint8_t> out(row_bytes(t, in.size()));
  const std::string msg = error_of([&] { quantize_row(t, in.data(), out.data(), kRowLen); });
  EXPECT_NE(msg.find(std::string(type_name(t))), std::string::npos) << msg;
  EXPECT_NE(msg.find("fp16"), std::string::npos) << msg;
  // Large values whose scale still fits are fine.
  in[5] = 2e5f;
  EXPECT_EQ(error_of([&] { quantize_row(t, in.data(), out.data(), kRowLen); }), "(no error)");
}

TEST_P(QuantizeFitted, RejectsPartialBlocks) {
  const GgmlType t = GetParam();
  std::vector<float> in(512, 1.0f);
  std::vector<uint8_t> out(1024);
  const int64_t n = static_cast<int64_t>(traits(t).block_size) + 16;
  EXPECT_NE(error_of([&] { quantize_row(t, in.data(), out.data(), n); }).find(std::string(type_name(t))),
            std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(WriterFormats, QuantizeFitted, testing::ValuesIn(kFittedTypes), param_name);

// Q4_0 follows ggml's quantize_row_q4_0_ref, whose rounding is simple enough to pin down by hand:
// d = -max / 8 for the element of largest magnitude (which gets code 0), code = floor(x / d + 8.5)
// clipped to 15.
TEST(Quantize, Q4_0MatchesGgmlsReferenceRule) {
  std::vector<float> in(32);
  for (int j = 0; j < 32; ++j) in[j] = static_cast<float>(j - 12) * 0.25f;  // -3 .. 4.75
  in[7] = -8.0f;                                                            // largest magnitude
  std::vector<uint8_t> out(18);
  quantize_row(GgmlType::Q4_0, in.data(), out.data(), 32);
  EXPECT_EQ(load_u16(out.data()), f32_to_fp16(1.0f));  // d = -(-8) / 8
  for (int j = 0; j < 32; ++j) {
    const int want = std::min(15, static_cast<int>(std::floor(in[j] / 1.0f + 8.5f)));
    const int got = j < 16 ? out[2 + j] & 0x0F : out[2 + j - 16] >> 4;
    EXPECT_EQ(got, want) << "element " << j << " = " << in[j];
  }
}

// ---- the type table against gguf-py's GGML_QUANT_SIZES ----

TEST(TypeTable, SizesAgreeWithGgufPy) {
  const std::vector<uint8_t> raw = read_vector_file("ggml_quant_sizes.txt");
  ASSERT_FALSE(raw.empty());
  std::istringstream lines(std::string(raw.begin(), raw.end()));
  struct Row {
    std::string name;
    uint32_t block_size, type_size;
  };
  std::vector<std::pair<uint32_t, Row>> gguf_py;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    uint32_t id;
    Row row;
    ASSERT_TRUE(fields >> id >> row.name >> row.block_size >> row.type_size) << line;
    gguf_py.emplace_back(id, row);
  }

  size_t count = 0;
  const TypeTraits* all = all_types(&count);
  for (size_t i = 0; i < count; ++i) {
    const TypeTraits& tr = all[i];
    const uint32_t id = static_cast<uint32_t>(tr.type);
    auto it = std::find_if(gguf_py.begin(), gguf_py.end(), [&](const auto& r) { return r.first == id; });
    ASSERT_NE(it, gguf_py.end()) << tr.name << " (id " << id << ") is not in gguf-py";
    const Row& theirs = it->second;
    EXPECT_EQ(type_from_name(theirs.name), tr.type) << "id " << id << ": gguf-py calls it " << theirs.name;
    EXPECT_EQ(theirs.block_size, tr.block_size) << tr.name;
    if (tr.type == GgmlType::Q8_1) {
      // gguf-py still has the old Q8_1 with float32 d and s (40 bytes); ggml's block_q8_1 holds two
      // fp16 (36 bytes). Q8_1 is activation-only and never stored in model files.
      EXPECT_EQ(theirs.type_size, 40u);
      EXPECT_EQ(tr.type_size, 36u);
      continue;
    }
    EXPECT_EQ(theirs.type_size, tr.type_size) << tr.name;
  }
}

}  // namespace
}  // namespace sparsemla::gguf
