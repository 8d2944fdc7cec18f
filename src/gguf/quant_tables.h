// Codebooks of the ggml "IQ" and FP4 block formats. They are part of the file formats: a weight
// is an index into one of these tables, so the values must match ggml exactly.
// The definitions are generated (see quant_tables.cpp and scripts/reference/gen_quant_tables.py).
#pragma once
#include <cstdint>

namespace sparsemla::gguf::tables {

// Lattice points of the IQ2 formats: 8 magnitudes per entry, each one of {8, 25, 43}.
extern const uint8_t kIq2xxsGrid[256][8];
extern const uint8_t kIq2xsGrid[512][8];
extern const uint8_t kIq2sGrid[1024][8];

// Lattice points of the IQ3 formats: 4 magnitudes per entry.
// IQ3_XXS uses {4, 12, 20, 28, 36, 44, 52, 62}; IQ3_S uses the odd values 1..15.
extern const uint8_t kIq3xxsGrid[256][4];
extern const uint8_t kIq3sGrid[512][4];

// Ternary lattice of IQ1_S and IQ1_M: 8 values per entry, each one of {-1, 0, 1}.
extern const int8_t kIq1sGrid[2048][8];
// Shift added to every IQ1 grid value before scaling; its sign comes from a bit in the block.
extern const float kIq1Delta;

// Sign patterns of IQ2_XXS, IQ2_XS and IQ3_XXS: a 7-bit index gives 8 sign bits (bit j set means
// element j is negative); the eighth bit is implied by even parity.
extern const uint8_t kIq2Signs[128];

// Non-linear 4-bit levels of IQ4_NL and IQ4_XS.
extern const int8_t kIq4nlValues[16];

// FP4 E2M1 values, doubled so that they are integers; MXFP4's scale is halved to compensate.
extern const int8_t kMxfp4Values[16];

}  // namespace sparsemla::gguf::tables
