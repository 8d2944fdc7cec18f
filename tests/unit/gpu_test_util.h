// GPU tests: each compares a CUDA kernel with the CPU reference. Without a CUDA build or without a
// GPU they are reported as skipped (never passed without running).
#pragma once
#include <gtest/gtest.h>

#include <string>

#include "ops/device.h"

namespace sparsemla::test {

// Why GPU tests cannot run here, or "" when they can.
inline std::string gpu_unavailable() {
  if (!ops::built_with_cuda()) return "built without CUDA";
  std::string why;
  if (ops::list_devices(&why).empty()) return "no CUDA device: " + why;
  return "";
}

}  // namespace sparsemla::test

#define SPARSEMLA_REQUIRE_GPU()                                             \
  do {                                                                      \
    const std::string why_ = ::sparsemla::test::gpu_unavailable();          \
    if (!why_.empty()) GTEST_SKIP() << "GPU test skipped: " << why_;         \
  } while (0)
