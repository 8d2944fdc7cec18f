// CPU dequantization of every ggml block format used by model files, and quantization for the
// formats the writer produces. Layouts follow ggml (ggml-common.h / ggml-quants.c).
#pragma once
#include <cstdint>

#include "gguf/ggml_types.h"

namespace sparsemla::gguf {

// Dequantizes `n` elements (a multiple of the type's block size) from `src` into `dst`.
// Throws sparsemla::Error for a type without dequantization (traits(t).dequantizable == false).
void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n);

// Quantizes `n` floats into `dst` for F32, F16, BF16 and Q8_0 (the writer's formats), with
// ggml's rounding; Error for other types, and for Q8_0 input holding NaN or inf (ggml leaves
// that undefined).
void quantize_row(GgmlType t, const float* src, void* dst, int64_t n);

}  // namespace sparsemla::gguf
