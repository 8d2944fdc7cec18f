#include "gguf/ggml_types.h"

#include <algorithm>
#include <cctype>

namespace sparsemla::gguf {
namespace {

constexpr TypeTraits kTypes[] = {
    {GgmlType::F32, "f32", 1, 4, true},
    {GgmlType::F16, "f16", 1, 2, true},
    {GgmlType::Q4_0, "q4_0", 32, 18, true},
    {GgmlType::Q4_1, "q4_1", 32, 20, true},
    {GgmlType::Q5_0, "q5_0", 32, 22, true},
    {GgmlType::Q5_1, "q5_1", 32, 24, true},
    {GgmlType::Q8_0, "q8_0", 32, 34, true},
    {GgmlType::Q8_1, "q8_1", 32, 36, false},  // activation-only type, never in model files
    {GgmlType::Q2_K, "q2_K", 256, 84, true},
    {GgmlType::Q3_K, "q3_K", 256, 110, true},
    {GgmlType::Q4_K, "q4_K", 256, 144, true},
    {GgmlType::Q5_K, "q5_K", 256, 176, true},
    {GgmlType::Q6_K, "q6_K", 256, 210, true},
    {GgmlType::Q8_K, "q8_K", 256, 292, false},  // activation-only type
    {GgmlType::IQ2_XXS, "iq2_xxs", 256, 66, true},
    {GgmlType::IQ2_XS, "iq2_xs", 256, 74, true},
    {GgmlType::IQ3_XXS, "iq3_xxs", 256, 98, true},
    {GgmlType::IQ1_S, "iq1_s", 256, 50, true},
    {GgmlType::IQ4_NL, "iq4_nl", 32, 18, true},
    {GgmlType::IQ3_S, "iq3_s", 256, 110, true},
    {GgmlType::IQ2_S, "iq2_s", 256, 82, true},
    {GgmlType::IQ4_XS, "iq4_xs", 256, 136, true},
    {GgmlType::I8, "i8", 1, 1, false},
    {GgmlType::I16, "i16", 1, 2, false},
    {GgmlType::I32, "i32", 1, 4, false},
    {GgmlType::I64, "i64", 1, 8, false},
    {GgmlType::F64, "f64", 1, 8, false},
    {GgmlType::IQ1_M, "iq1_m", 256, 56, true},
    {GgmlType::BF16, "bf16", 1, 2, true},
    {GgmlType::TQ1_0, "tq1_0", 256, 54, true},
    {GgmlType::TQ2_0, "tq2_0", 256, 66, true},
    {GgmlType::MXFP4, "mxfp4", 32, 17, true},
};

}  // namespace

std::optional<TypeTraits> type_traits(uint32_t id) {
  for (const TypeTraits& t : kTypes)
    if (static_cast<uint32_t>(t.type) == id) return t;
  return std::nullopt;
}

const TypeTraits& traits(GgmlType type) {
  for (const TypeTraits& t : kTypes)
    if (t.type == type) return t;
  return kTypes[0];  // unreachable: every enumerator is in the table
}

std::string_view type_name(GgmlType t) { return traits(t).name; }

std::optional<GgmlType> type_from_name(std::string_view name) {
  auto lower_eq = [](std::string_view a, std::string_view b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
             return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
           });
  };
  for (const TypeTraits& t : kTypes)
    if (lower_eq(t.name, name)) return t.type;
  return std::nullopt;
}

const TypeTraits* all_types(size_t* count) {
  *count = std::size(kTypes);
  return kTypes;
}

}  // namespace sparsemla::gguf
