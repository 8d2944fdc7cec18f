// CPU dequantization of every ggml block format used by model files, and quantization for the
// formats the writer produces. Layouts follow ggml (ggml-common.h / ggml-quants.c).
#pragma once
#include <cstdint>

#include "gguf/ggml_types.h"

namespace sparsemla::gguf {

// Dequantizes `n` elements (a multiple of the type's block size) from `src` into `dst`.
// Throws sparsemla::Error for a type without dequantization (traits(t).dequantizable == false).
void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n);

// Quantizes `n` floats into `dst` (the writer's formats): F32, F16, BF16 and Q8_0 with ggml's
// rounding, byte for byte; Q4_0, Q4_K, Q5_K and Q6_K with the algorithms of ggml's reference
// quantizers (quantize_row_*_ref, no importance matrix) in ggml's block layouts, close to but not
// guaranteed byte-equal to ggml's output. Error for other types, for input holding NaN or inf in
// a quantized format (ggml leaves that undefined), and for Q4_0/Q4_K/Q5_K/Q6_K input so large that
// a block scale overflows fp16 (ggml would store inf).
void quantize_row(GgmlType t, const float* src, void* dst, int64_t n);

// Whether quantize_row writes type t.
bool can_quantize(GgmlType t);

}  // namespace sparsemla::gguf
