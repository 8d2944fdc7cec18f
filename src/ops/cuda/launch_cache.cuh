// Host-side launch settings asked once and remembered, per kernel and device: the dynamic shared
// memory limit (cudaFuncSetAttribute), resident blocks per multiprocessor, the multiprocessor
// count and the compute capability. Each of those calls costs host time, which an eager decode
// step (no CUDA graph: prefill chunks, the first step at a size, --no-graphs) paid on every launch.
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "ops/cuda/check.cuh"

namespace sparsemla::cuda {

namespace launch_detail {
inline std::mutex& mu() {
  static std::mutex m;
  return m;
}
inline int current_device() {
  int d = 0;
  SPARSEMLA_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}
}  // namespace launch_detail

// Raises `kernel`'s dynamic shared memory limit to at least `bytes` on the current device.
template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  static std::map<std::pair<const void*, int>, size_t> set;  // (kernel, device) -> limit set so far
  const int dev = launch_detail::current_device();
  std::lock_guard<std::mutex> lock(launch_detail::mu());
  size_t& have = set[{reinterpret_cast<const void*>(kernel), dev}];
  if (have >= bytes) return;
  SPARSEMLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  have = bytes;
}

// Blocks of `threads` threads and `smem` bytes that fit on one multiprocessor (allow_smem first).
template <class Kernel>
int blocks_per_sm(Kernel kernel, int threads, size_t smem) {
  static std::map<std::tuple<const void*, int, int, size_t>, int> known;
  const int dev = launch_detail::current_device();
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), dev, threads, smem);
  std::lock_guard<std::mutex> lock(launch_detail::mu());
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  int n = 0;
  SPARSEMLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  known.emplace(key, n);
  return n;
}

// Multiprocessors of the current device.
inline int sm_count() {
  static std::map<int, int> known;
  const int dev = launch_detail::current_device();
  std::lock_guard<std::mutex> lock(launch_detail::mu());
  auto it = known.find(dev);
  if (it != known.end()) return it->second;
  int n = 0;
  SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return known[dev] = n;
}

// Compute capability (major, minor) of the current device.
inline std::pair<int, int> compute_capability() {
  static std::map<int, std::pair<int, int>> known;
  const int dev = launch_detail::current_device();
  std::lock_guard<std::mutex> lock(launch_detail::mu());
  auto it = known.find(dev);
  if (it != known.end()) return it->second;
  int major = 0, minor = 0;
  SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  SPARSEMLA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  return known[dev] = {major, minor};
}

}  // namespace sparsemla::cuda
