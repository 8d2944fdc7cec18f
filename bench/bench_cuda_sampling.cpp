// The GPU sampler (cuda::sample): time per call for GLM-5's vocabulary (154,880) at batch 1, 8 and
// 32 under the common settings (greedy; temperature alone; llama-server's defaults top-k 40, top-p
// 0.95, min-p 0.05; top-p alone; top-k alone), on logits drawn from N(0, 3^2) and on rows of equal
// logits (the worst case of the filters: every token ties). Best of 5 runs of 10 calls each, by
// CUDA events (cuda::time_ms).
//
//   bench_cuda_sampling [--vocab V]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ops/cuda/buffer.h"
#include "ops/cuda/sampling.h"
#include "ops/device.h"

namespace {

using namespace sparsemla;

struct Case {
  const char* name;
  cuda::RowSampling p;
};

cuda::RowSampling setting(float t, int32_t k, float top_p, float min_p) {
  cuda::RowSampling p;
  p.temperature = t;
  p.top_k = k;
  p.top_p = top_p;
  p.min_p = min_p;
  p.seed = 7;
  return p;
}

struct Call {
  const cuda::DeviceBuffer* logits;
  const cuda::DeviceBuffer* params;
  cuda::DeviceBuffer* ws;
  cuda::DeviceBuffer* ids;
  int64_t B, V;
};

void ten_calls(void* ctx) {
  const Call& c = *static_cast<const Call*>(ctx);
  for (int i = 0; i < 10; ++i)
    cuda::sample(c.logits->as<float>(), c.B, c.V, c.params->as<cuda::RowSampling>(), c.ws->get(),
                 c.ids->as<int32_t>(), nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t V = 154880;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--vocab") == 0) V = std::atoll(argv[++i]);
  const auto devices = ops::list_devices();
  if (devices.empty() || V <= 0) {
    std::fprintf(stderr, "bench_cuda_sampling: %s\n", devices.empty() ? "no CUDA device" : "--vocab must be > 0");
    return 1;
  }
  const std::vector<Case> cases = {{"greedy", setting(0.0f, 0, 1.0f, 0.0f)},
                                   {"temperature 1", setting(1.0f, 0, 1.0f, 0.0f)},
                                   {"t 0.8 top-k 40 top-p 0.95 min-p 0.05", setting(0.8f, 40, 0.95f, 0.05f)},
                                   {"t 0.8 top-k 40", setting(0.8f, 40, 1.0f, 0.0f)},
                                   {"t 1 top-p 0.95", setting(1.0f, 0, 0.95f, 0.0f)}};
  std::printf("%s, vocabulary %lld: us per call (per row)\n", devices[0].name.c_str(), (long long)V);
  std::printf("%-40s %-8s %12s %12s %12s\n", "setting", "logits", "batch 1", "batch 8", "batch 32");
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (const Case& c : cases)
    for (const bool equal : {false, true}) {
      std::printf("%-40s %-8s", c.name, equal ? "equal" : "N(0,9)");
      for (const int64_t B : {1, 8, 32}) {
        std::vector<float> logits(size_t(B * V), 0.25f);
        if (!equal)
          for (float& v : logits) v = normal(rng);
        const cuda::DeviceBuffer dl = cuda::to_device(logits);
        const cuda::DeviceBuffer dp = cuda::to_device(std::vector<cuda::RowSampling>(size_t(B), c.p));
        cuda::DeviceBuffer ws(cuda::sampling_workspace_bytes(B, V)), ids(size_t(B) * sizeof(int32_t));
        Call call{&dl, &dp, &ws, &ids, B, V};
        const double ms = cuda::time_ms(5, &ten_calls, &call);
        std::printf(" %12.1f", ms * 1e3 / 10);
      }
      std::printf("\n");
    }
  return 0;
}
