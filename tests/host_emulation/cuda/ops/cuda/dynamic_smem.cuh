// Host stand-in for src/ops/cuda/dynamic_smem.cuh: `name` is the runner's buffer (emu.h), filled
// with poison at the start of each block.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#define SPARSEMLA_DYNAMIC_SMEM(name) uint8_t* const name = ::emu::dynamic_smem()
