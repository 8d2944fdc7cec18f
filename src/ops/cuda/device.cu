#include <cuda_runtime.h>

#include "ops/device.h"

namespace sparsemla::ops {

bool built_with_cuda() { return true; }

std::vector<DeviceInfo> list_devices(std::string* why_none) {
  std::vector<DeviceInfo> out;
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (why_none) *why_none = cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return out;
  }
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    out.push_back({i, p.name, p.major, p.minor, uint64_t(p.totalGlobalMem), p.multiProcessorCount,
                   uint64_t(p.sharedMemPerBlockOptin), uint64_t(p.sharedMemPerMultiprocessor)});
  }
  if (out.empty() && why_none) *why_none = "no CUDA device found";
  return out;
}

}  // namespace sparsemla::ops
