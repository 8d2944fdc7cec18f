// CPU (de)quantization against reference vectors made by gguf-py, ggml's own Python package
// (tests/data/quants/, scripts/reference/make_quant_vectors.py): every dequantizable type, the
// quantizers the writer uses, refusals of the other types, and the type table's sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "gguf/quants.h"
#include "test_util.h"
#include "util/error.h"
#include "util/half.h"

namespace sparsemla::gguf {
namespace {

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

// The types quantize_row writes; each has quant_<name>.{f32,bin}.
constexpr GgmlType kQuantTypes[] = {GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0};

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

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
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
        t == GgmlType::F32)
      continue;
    const std::string msg = error_of([&] { quantize_row(t, src.data(), dst.data(), all[i].block_size); });
    EXPECT_NE(msg.find(std::string(all[i].name)), std::string::npos) << all[i].name << ": " << msg;
  }
  EXPECT_NE(error_of([&] { quantize_row(GgmlType::Q8_0, src.data(), dst.data(), 48); }), "(no error)");
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
