#include "device_options.h"

#include "ops/device.h"
#include "util/error.h"

namespace sparsemla::app {

void add_device_options(CLI::App* cmd, DeviceArgs& a) {
  cmd->add_option("--device", a.device, "cpu (default) or cuda: every layer on the first GPU")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--kv-cache", a.kv_cache,
                  "GPU KV cache format: bf16 (default), fp8 (e4m3, one scale per 128 values) or f32 (the reference "
                  "format: exact rows, FMA kernels); --device cuda only")
      ->check(CLI::IsMember({"bf16", "fp8", "f32"}));
  cmd->add_flag("--precise", a.precise,
                "GPU: fp32 matrix products at every batch size and the fp32 FMA attention/indexer kernels (slower; with "
                "--kv-cache f32 the GPU computes what the CPU does, to fp32 rounding)");
  cmd->add_flag("--verbose", a.verbose, "print the GPU kernel selection and memory report");
}

void check_device_args(const DeviceArgs& a, int tensor_parallel) {
  if (!a.cuda()) {
    if (!a.kv_cache.empty()) fail("--kv-cache {}: only with --device cuda (the CPU cache is always fp32)", a.kv_cache);
    if (a.precise) fail("--precise: only with --device cuda (the CPU engine is the fp32 reference already)");
    return;
  }
  if (!ops::built_with_cuda())
    fail("--device cuda: this sparsemla was built without CUDA (nvcc was not found at configure time); rebuild "
         "with the CUDA toolkit or use --device cpu");
  std::string why;
  if (ops::list_devices(&why).empty()) fail("--device cuda: no CUDA device is usable here ({})", why);
  if (tensor_parallel > 1) fail("--tensor-parallel {} with --device cuda: the GPU model runs on one GPU for now", tensor_parallel);
}

#if SPARSEMLA_HAVE_CUDA
model::GpuModelOptions gpu_options(const DeviceArgs& a, int64_t cache_tokens, int64_t batch_tokens) {
  model::GpuModelOptions o;
  o.kv_cache = a.kv_cache == "fp8" ? cuda::KvDtype::FP8 : a.kv_cache == "f32" ? cuda::KvDtype::F32 : cuda::KvDtype::BF16;
  o.verbose = a.verbose;
  o.precise = a.precise;
  o.min_cache_tokens = cache_tokens;
  o.max_batch_tokens = batch_tokens;
  return o;
}
#endif

}  // namespace sparsemla::app
