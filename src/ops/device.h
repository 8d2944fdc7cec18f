// The GPUs this process can use, as the kernel selector and `sparsemla devices` see them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace sparsemla::ops {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int cc_major = 0;  // compute capability: 8.0 A100, 8.6/8.9 RTX 30/40, 9.0 H100/H200, 10.0 B200, 12.0 RTX PRO 6000
  int cc_minor = 0;
  uint64_t memory_bytes = 0;
  int sm_count = 0;
  uint64_t smem_per_block_optin = 0;  // largest dynamic shared memory a kernel can request
  uint64_t smem_per_sm = 0;           // shared memory of one SM (its blocks share it)
};

// Whether this binary was built with CUDA, and the devices the driver reports (empty without a GPU
// or a driver). `why_none` receives the driver's reason when the list is empty.
bool built_with_cuda();
std::vector<DeviceInfo> list_devices(std::string* why_none = nullptr);

}  // namespace sparsemla::ops
