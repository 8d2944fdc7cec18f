// The ggml tensor type table: ids as stored in GGUF files, block geometry and names.
// Ids and sizes follow ggml's `type_traits` (ggml.c); ids of removed types are refused.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace sparsemla::gguf {

enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3,
  Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
  IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
  TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39,
};

struct TypeTraits {
  GgmlType type;
  std::string_view name;   // as ggml prints it: "q4_K", "iq2_xxs", "bf16"
  uint32_t block_size;     // elements per block (1 for plain types)
  uint32_t type_size;      // bytes per block
  bool dequantizable;      // has a CPU dequantization to float32 (see quants.h)
};

// Traits of a known type id, or nullopt for ids that ggml never had or removed.
std::optional<TypeTraits> type_traits(uint32_t id);
// Same for a typed value; every enumerator is known.
const TypeTraits& traits(GgmlType t);
std::string_view type_name(GgmlType t);
// Case-insensitive lookup by ggml name ("Q4_K", "q8_0", "bf16").
std::optional<GgmlType> type_from_name(std::string_view name);
// Every known type, in id order.
const TypeTraits* all_types(size_t* count);

// Bytes taken by one row of `n` elements; n must be a multiple of the block size.
inline uint64_t row_bytes(GgmlType t, uint64_t n) {
  const TypeTraits& tr = traits(t);
  return n / tr.block_size * tr.type_size;
}

}  // namespace sparsemla::gguf
