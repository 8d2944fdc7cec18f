// A RoPE without scaling for the tests of the kernels that rotate (the GPU tests and the host
// emulation's): `dims` rotary dims, base theta.
#pragma once
#include <cstdint>

#include "model/hparams.h"
#include "ops/cpu/rope.h"

namespace sparsemla::test {

inline ops::Rope plain_rope(int dims, float theta) {
  model::HParams hp;
  hp.qk_rope = uint32_t(dims);
  hp.rope_theta = theta;
  return ops::Rope(hp);
}

}  // namespace sparsemla::test
