// --device, --tensor-parallel, --kv-cache, --precise and --verbose: where `logits`, `run`, `bench`,
// `ppl` and `serve` run the model (engine::Backend).
#pragma once
#include <CLI/CLI.hpp>

#include <string>

#include "engine/backend.h"

namespace sparsemla::app {

struct DeviceArgs {
  std::string device = "cpu";
  int tensor_parallel = 1;
  std::string kv_cache;  // "" (bf16 on the GPU), "bf16", "fp8" or "f32"
  bool precise = false;  // fp32 products and the FMA attention kernels on the GPU
  bool int8_activations = false;  // decode products on int8-quantized activations (dp4a)
  bool verbose = false;
  std::string tp_master;             // rank 0 of a multi-process group listens here
  std::string tp_transport = "nccl";  // GPU collectives: nccl, or host (staged through host memory)
  double tp_timeout = 300;           // seconds: joining, and each exchange between processes
  bool cuda() const { return device == "cuda"; }
};

void add_device_options(CLI::App* cmd, DeviceArgs& a);
// --tp-master, --tp-transport and --tp-timeout alone (the worker command's share of the above).
void add_process_group_options(CLI::App* cmd, DeviceArgs& a);

// Refuses what cannot run: --device cuda in a build without CUDA or on a machine without a GPU,
// --kv-cache or --precise on the CPU. Throws Error.
void check_device_args(const DeviceArgs& a);

// The backend the arguments name, with `threads` CPU threads (0: all).
engine::BackendOptions backend_options(const DeviceArgs& a, int threads);

}  // namespace sparsemla::app
