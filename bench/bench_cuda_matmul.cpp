// Matrix products on quantized weights on the GPU: time per call, the weight bandwidth reached and
// its fraction of the measured device-to-device copy bandwidth, for Q8_0, Q4_K and BF16 weights of
// a 4096-square and the GLM-5 widths (6144 -> 2048 and 2048 -> 6144) at 1 to 512 tokens.
//
//   bench_cuda_matmul [--quick]
// Weights are random bytes with small block scales (values do not change the work); each shape
// and type gets enough copies to exceed 256 MB, so that every call reads its weight from memory.
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/quant_matmul.h"
#include "ops/cuda/quant_matmul_bench.h"
#include "ops/device.h"
#include "util/half.h"

namespace {

using namespace sparsemla;
using gguf::GgmlType;

std::vector<uint8_t> random_weight(GgmlType t, int64_t n_rows, int64_t n_cols) {
  const auto& tr = gguf::traits(t);
  std::vector<uint8_t> w(size_t(gguf::row_bytes(t, uint64_t(n_cols)) * n_rows));
  std::mt19937 rng(1);
  for (size_t i = 0; i + 4 <= w.size(); i += 4) {
    const uint32_t v = rng();
    std::memcpy(&w[i], &v, 4);
  }
  const uint16_t small = f32_to_fp16(0.01f);
  for (size_t at = 0; at < w.size(); at += tr.type_size) {
    if (t == GgmlType::Q8_0) std::memcpy(&w[at], &small, 2);
    if (t == GgmlType::Q4_K) {
      std::memcpy(&w[at], &small, 2);
      std::memcpy(&w[at + 2], &small, 2);
    }
    if (t == GgmlType::BF16) w[at + 1] = uint8_t(0x3C + (w[at + 1] & 1));  // |x| in [2^-7, 2^-5)
  }
  return w;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const auto devices = ops::list_devices();
  if (devices.empty()) {
    std::fprintf(stderr, "bench_cuda_matmul: no CUDA device\n");
    return 1;
  }
  const double copy = cuda::bench_copy_gbs(size_t(1) << 30, quick ? 3 : 10);
  std::printf("%s: device-to-device copy %.0f GB/s (read + written)\n\n", devices[0].name.c_str(), copy);
  std::printf("%-5s %-11s %5s %10s %9s %7s %8s\n", "type", "rows x cols", "T", "us/call", "GB/s", "% copy", "TFLOP/s");
  struct Shape {
    int64_t rows, cols;
  };
  for (GgmlType t : {GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::BF16}) {
    for (Shape sh : {Shape{4096, 4096}, Shape{2048, 6144}, Shape{6144, 2048}}) {
      const std::vector<uint8_t> bytes = random_weight(t, sh.rows, sh.cols);
      const int n_copies = int(std::max<size_t>(1, (size_t(256) << 20) / bytes.size() + 1));
      std::vector<cuda::DeviceBuffer> bufs;
      std::vector<cuda::QuantMatrix> copies;
      for (int i = 0; i < n_copies; ++i) {
        bufs.push_back(cuda::to_device(bytes));
        copies.push_back({t, sh.cols, sh.rows, gguf::row_bytes(t, uint64_t(sh.cols)), bufs.back().get()});
      }
      for (int64_t T : {1, 8, 16, 64, 512}) {
        const cuda::MatmulTiming m = cuda::bench_matmul(copies.data(), n_copies, T, quick ? 4 : 20, quick ? 2 : 5);
        std::printf("%-5s %4lldx%-6lld %5lld %10.1f %9.0f %6.0f%% %8.1f\n", std::string(gguf::type_name(t)).c_str(),
                    (long long)sh.rows, (long long)sh.cols, (long long)T, m.us_per_call, m.weight_gbs,
                    100.0 * m.weight_gbs / copy, m.tflops);
      }
    }
  }
  return 0;
}
