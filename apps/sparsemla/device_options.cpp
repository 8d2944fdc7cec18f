#include "device_options.h"

#include "ops/device.h"
#include "util/error.h"

namespace sparsemla::app {

void add_device_options(CLI::App* cmd, DeviceArgs& a) {
  cmd->add_option("--device", a.device,
                  "cpu (default) or cuda: every layer on the GPU (the first one; with --tensor-parallel N, GPUs 0..N-1)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--tensor-parallel", a.tensor_parallel,
                  "split the model over N ranks: CPU threads with an in-process communicator, or with --device cuda "
                  "one GPU per rank (NCCL); heads, experts and vocabulary must divide by N")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--kv-cache", a.kv_cache,
                  "GPU KV cache format: bf16 (default), fp8 (e4m3, one scale per 128 values) or f32 (the reference "
                  "format: exact rows, FMA kernels); --device cuda only")
      ->check(CLI::IsMember({"bf16", "fp8", "f32"}));
  cmd->add_flag("--precise", a.precise,
                "GPU: fp32 matrix products at every batch size and the fp32 FMA attention/indexer kernels (slower; with "
                "--kv-cache f32 the GPU computes what the CPU does, to fp32 rounding)");
  cmd->add_flag("--int8-activations", a.int8_activations,
                "GPU decode steps: the products of every type with an int8 kernel (Q8_0, Q4_0, IQ4_NL, the K-quants, "
                "the IQ1-IQ4 types) on activations quantized to int8 blocks of 32 (dp4a, as llama.cpp does): 7-10% "
                "shorter decode steps at GLM-5 width (H200), ~1e-2 relative error per product");
  cmd->add_flag("--verbose", a.verbose, "print the GPU kernel selection and memory report");
  add_process_group_options(cmd, a);
}

void add_process_group_options(CLI::App* cmd, DeviceArgs& a) {
  cmd->add_option("--tp-master", a.tp_master,
                  "tensor parallelism over processes (hosts): this command is rank 0 and listens at HOST:PORT "
                  "(\":29500\": every interface) for ranks 1..N-1 started with `sparsemla worker`");
  cmd->add_option("--tp-transport", a.tp_transport,
                  "GPU collectives between ranks: nccl (default; one GPU per rank) or host (through host memory: "
                  "any GPUs, several ranks on one GPU; slow, for checks)")
      ->check(CLI::IsMember({"nccl", "host"}));
  cmd->add_option("--tp-timeout", a.tp_timeout, "seconds to wait for the other ranks to join, and for each exchange")
      ->check(CLI::PositiveNumber);
}

void check_device_args(const DeviceArgs& a) {
  if (!a.tp_master.empty() && a.tensor_parallel < 2)
    fail("--tp-master {}: tensor parallelism over processes needs --tensor-parallel N >= 2 (got {})", a.tp_master,
         a.tensor_parallel);
  if (!a.cuda()) {
    if (!a.kv_cache.empty()) fail("--kv-cache {}: only with --device cuda (the CPU cache is always fp32)", a.kv_cache);
    if (a.precise) fail("--precise: only with --device cuda (the CPU engine is the fp32 reference already)");
    if (a.int8_activations) fail("--int8-activations: only with --device cuda");
    return;
  }
  if (!ops::built_with_cuda())
    fail("--device cuda: this sparsemla was built without CUDA (nvcc was not found at configure time); rebuild "
         "with the CUDA toolkit or use --device cpu");
  std::string why;
  if (ops::list_devices(&why).empty()) fail("--device cuda: no CUDA device is usable here ({})", why);
}

engine::BackendOptions backend_options(const DeviceArgs& a, int threads) {
  engine::BackendOptions o;
  o.device = a.cuda() ? engine::Device::Cuda : engine::Device::Cpu;
  o.tensor_parallel = a.tensor_parallel;
  o.threads = threads;
  o.procs.master = a.tp_master;
  o.procs.host_staged = a.tp_transport == "host";
  o.procs.timeout = std::chrono::milliseconds(int64_t(a.tp_timeout * 1000));
#if SPARSEMLA_HAVE_CUDA
  o.gpu.kv_cache = a.kv_cache == "fp8"   ? cuda::KvDtype::FP8
                   : a.kv_cache == "f32" ? cuda::KvDtype::F32
                                         : cuda::KvDtype::BF16;
  o.gpu.verbose = a.verbose;
  o.gpu.precise = a.precise;
  o.gpu.int8_activations = a.int8_activations;
  o.tp_transport = a.tp_transport == "host" ? dist::TpTransport::HostStaged : dist::TpTransport::Nccl;
#endif
  return o;
}

}  // namespace sparsemla::app
