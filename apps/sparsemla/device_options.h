// --device, --kv-cache, --precise and --verbose: where `logits`, `run` and `bench` run the model.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#if SPARSEMLA_HAVE_CUDA
#include "model/cuda/gpu_model.h"
#endif

namespace sparsemla::app {

struct DeviceArgs {
  std::string device = "cpu";
  std::string kv_cache;  // "" (bf16 on the GPU), "bf16", "fp8" or "f32"
  bool precise = false;  // fp32 products and the FMA attention kernels on the GPU
  bool verbose = false;
  bool cuda() const { return device == "cuda"; }
};

void add_device_options(CLI::App* cmd, DeviceArgs& a);

// Refuses what cannot run: --device cuda in a build without CUDA or on a machine without a GPU,
// --kv-cache on the CPU, tensor parallelism on the GPU. Throws Error.
void check_device_args(const DeviceArgs& a, int tensor_parallel = 1);

#if SPARSEMLA_HAVE_CUDA
// Options of a GPU model that must hold a cache of `cache_tokens` and run forwards of up to
// `batch_tokens` tokens.
model::GpuModelOptions gpu_options(const DeviceArgs& a, int64_t cache_tokens, int64_t batch_tokens);
#endif

}  // namespace sparsemla::app
