// `sparsemla devices`: the GPUs this build can use.
#include <cstdio>

#include "commands.h"
#include "ops/device.h"

namespace sparsemla::app {

Runner add_devices(CLI::App& app) {
  app.add_subcommand("devices", "List the CUDA devices this build can use");
  return [] {
    std::string why;
    const auto devs = ops::list_devices(&why);
    std::printf("CUDA support in this build: %s\n", ops::built_with_cuda() ? "yes" : "no");
    if (devs.empty()) std::printf("no GPU: %s; the CPU engine is used\n", why.c_str());
    for (const auto& d : devs)
      std::printf("[%d] %s  sm_%d%d  %.1f GiB  %d SMs  %llu KiB shared memory per block, %llu per SM\n", d.index,
                  d.name.c_str(), d.cc_major, d.cc_minor, double(d.memory_bytes) / (1u << 30), d.sm_count,
                  static_cast<unsigned long long>(d.smem_per_block_optin / 1024),
                  static_cast<unsigned long long>(d.smem_per_sm / 1024));
    return 0;
  };
}

}  // namespace sparsemla::app
