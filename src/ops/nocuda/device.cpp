// Built when nvcc was not found: the engine runs on the CPU only.
#include "ops/device.h"

namespace sparsemla::ops {

bool built_with_cuda() { return false; }

std::vector<DeviceInfo> list_devices(std::string* why_none) {
  if (why_none) *why_none = "this build has no CUDA support (nvcc was not found at configure time)";
  return {};
}

}  // namespace sparsemla::ops
