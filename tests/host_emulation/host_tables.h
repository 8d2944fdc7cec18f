// The quantization grids the device decoders read (QuantTables), pointing at the CPU's tables: the
// host emulation's stand-in for device_quant_tables().
#pragma once
#include <cstdint>
#include <cstring>

#include "gguf/quant_tables.h"
#include "ops/cuda/dequant.cuh"

namespace sparsemla::cuda::test_q8 {

inline QuantTables host_tables() {
  namespace tb = gguf::tables;
  QuantTables t;
  t.iq2xxs = reinterpret_cast<const uint2*>(tb::kIq2xxsGrid);
  t.iq2xs = reinterpret_cast<const uint2*>(tb::kIq2xsGrid);
  t.iq2s = reinterpret_cast<const uint2*>(tb::kIq2sGrid);
  t.iq3xxs = reinterpret_cast<const uint32_t*>(tb::kIq3xxsGrid);
  t.iq3s = reinterpret_cast<const uint32_t*>(tb::kIq3sGrid);
  t.iq1s = reinterpret_cast<const uint2*>(tb::kIq1sGrid);
  std::memcpy(t.iq4nl, tb::kIq4nlValues, 16);
  std::memcpy(t.mxfp4, tb::kMxfp4Values, 16);
  t.iq1_delta = tb::kIq1Delta;
  return t;
}

}  // namespace sparsemla::cuda::test_q8
