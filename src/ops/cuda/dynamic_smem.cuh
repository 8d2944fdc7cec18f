// A kernel's dynamic shared memory (the launch's smem bytes), declared by
// SPARSEMLA_DYNAMIC_SMEM(name) as a 16-byte aligned uint8_t array `name`: one spelling for the
// kernels that the host emulation (tests/host_emulation) builds, which stands in for this header
// with its own buffer. (A macro, not a function returning the address: the compiler then keeps
// the array's 32-bit shared-window arithmetic; through a returned pointer it computes 64-bit
// generic addresses.)
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#define SPARSEMLA_DYNAMIC_SMEM(name) extern __shared__ __align__(16) uint8_t name[]
