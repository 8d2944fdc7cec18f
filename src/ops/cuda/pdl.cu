// Host side of pdl.cuh: whether the current device launches with programmatic dependencies.
#include "ops/cuda/pdl.cuh"

#include <atomic>

#include "util/env.h"

namespace sparsemla::cuda::pdl {

namespace {

constexpr int kMaxDevices = 64;

int current_device() {
  int d = 0;
  SPARSEMLA_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

}  // namespace

bool enabled() {
  static const int env = env_switch("SPARSEMLA_PDL");
  if (env == 0) return false;
  static std::atomic<int8_t> state[kMaxDevices];  // 0 unknown, 1 off, 2 on
  const int d = current_device();
  if (d < 0 || d >= kMaxDevices) return false;
  int8_t v = state[d].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0;
    SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d));
    v = major >= 9 ? 2 : 1;
    state[d].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

bool prefetch() {
  static const int env = env_switch("SPARSEMLA_GEMV_PREFETCH");
  return env == -1 ? enabled() : env == 1;
}

}  // namespace sparsemla::cuda::pdl
