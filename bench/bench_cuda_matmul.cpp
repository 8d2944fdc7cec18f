// Matrix products on quantized weights on the GPU: time per call, the weight bandwidth reached and
// its fraction of the measured device-to-device copy bandwidth, for Q8_0, Q4_K, Q5_K, Q6_K, Q2_K,
// Q3_K, the IQ types, Q4_0, IQ4_NL, MXFP4, F16 and BF16 weights of a 4096-square and the GLM-5
// widths (6144 -> 2048 and 2048 -> 6144) at 1 to 512 tokens; for the quantized types also
// 16384 -> 6144, 2048 -> 16384 and the output head (6144 -> 154880) at 1 to 64 tokens (32: a
// decode batch on the prefill kernel's 32-token tiles); and the routed experts of one MoE layer (matmul_experts, 8 pairs). Beside each decode line (T <= 8) of a type
// with an int8-activation kernel, a "q8:T" line times matmul_decode_q8 / matmul_experts_q8 on the
// same weights (activations quantized beforehand; the quantization's own time is printed at the
// end), a "q8x2:T" line the same on two-level activations, a "tc:T" line the tensor-core decode
// kernel (Q4_K, Q6_K; what matmul takes for them at T <= 8), "q8o:1" / "q8x2o:1" lines the
// one-token int8 tensor-core kernel (Q4_K, Q5_K; the fast mode's at one token; "q8x2o:8e" its
// expert pairs), "q8u:1" / "q8x2u:1" lines the dp4a kernel without its staged loads (the types of
// blocks not a multiple of 16 bytes:
// the "q8" lines take them where the rows allow) and a "pf:T" line the tensor-core prefill kernel
// at that T. The plain "T" lines at
// T <= 8 are the fp32 decode kernel (matmul_decode).
//
//   bench_cuda_matmul [--quick] [--decode] [--tokens T]   --decode: only T <= 8 and the experts;
//                                                          --tokens: only that T (and the experts)
//                                        [--type NAME]      only that type (e.g. q6_K)
//   bench_cuda_matmul --prefill [--type NAME] [--tokens T]   prefill sizes only (T = 64 .. 4096):
//                                                  matmul's choice, then "pf:T" the tile kernel and
//                                                  "blas:T" the cuBLAS form (matmul_prefill_blas);
//                                                  once per shape "dq": its dequantization alone,
//                                                  GB/s counting bytes read + bf16 written
//   bench_cuda_matmul --only TYPE:ROWSxCOLS:T     one product (fp32 decode path, then q8), e.g. for
//                                                  Nsight Compute: --only q4_K:2048x6144:1
//   bench_cuda_matmul --absorb     the MLA absorption products (Blas::per_head) of GLM-5 and
//                                  DeepSeek-V3.2 at 1 to 32 tokens: bf16 rows, and Q8_0 / Q4_K /
//                                  Q6_K rows read in place where they are whole blocks
// Weights are random bytes with small block scales (values do not change the work); each shape
// and type gets enough copies to exceed 256 MB, so that every call reads its weight from memory.
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gguf/ggml_types.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/buffer.h"
#include "ops/cuda/quant_matmul.h"
#include "ops/cuda/quant_matmul_q8.h"
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
    if (t == GgmlType::Q6_K) std::memcpy(&w[at + 208], &small, 2);
    if (t == GgmlType::Q2_K) {
      std::memcpy(&w[at + 80], &small, 2);
      std::memcpy(&w[at + 82], &small, 2);
    }
    if (t == GgmlType::Q3_K) std::memcpy(&w[at + 108], &small, 2);
    if (t == GgmlType::IQ4_XS || t == GgmlType::IQ2_XXS || t == GgmlType::IQ3_XXS || t == GgmlType::IQ3_S ||
        t == GgmlType::IQ2_XS || t == GgmlType::IQ2_S || t == GgmlType::IQ1_S || t == GgmlType::Q4_0 ||
        t == GgmlType::IQ4_NL)
      std::memcpy(&w[at], &small, 2);
    if (t == GgmlType::IQ1_M)  // fp16 d in the top nibbles of the four u16 scales at 48
      for (int k = 0; k < 4; ++k)
        w[at + 49 + 2 * k] = uint8_t((w[at + 49 + 2 * k] & 0x0F) | (((small >> (4 * k)) & 0xF) << 4));
    if (t == GgmlType::BF16) w[at + 1] = uint8_t(0x3C + (w[at + 1] & 1));  // |x| in [2^-7, 2^-5)
    if (t == GgmlType::F16) w[at + 1] = uint8_t(0x20 + (w[at + 1] & 3));   // |x| in [2^-7, 2^-6)
    if (t == GgmlType::MXFP4) w[at] = 120;                                  // scale 2^-8
  }
  return w;
}

// Device copies of one weight, enough of them to exceed 256 MB together.
struct Copies {
  std::vector<cuda::DeviceBuffer> bufs;
  std::vector<cuda::QuantMatrix> mats;
  Copies(GgmlType t, int64_t rows, int64_t cols) {
    const std::vector<uint8_t> bytes = random_weight(t, rows, cols);
    const int n = int(std::max<size_t>(1, (size_t(256) << 20) / bytes.size() + 1));
    for (int i = 0; i < n; ++i) {
      bufs.push_back(cuda::to_device(bytes));
      mats.push_back({t, cols, rows, gguf::row_bytes(t, uint64_t(cols)), bufs.back().get()});
    }
  }
};

struct Shape {
  int64_t rows, cols;
};

void print_line(GgmlType t, Shape sh, const char* what, const cuda::MatmulTiming& m, double copy) {
  std::printf("%-5s %6lldx%-6lld %5s %10.1f %9.0f %6.0f%% %8.1f\n", std::string(gguf::type_name(t)).c_str(),
              (long long)sh.rows, (long long)sh.cols, what, m.us_per_call, m.weight_gbs, 100.0 * m.weight_gbs / copy,
              m.tflops);
}

// --only TYPE:ROWSxCOLS:T: that one product's lines; 1 when the argument does not parse.
int run_only(const char* spec) {
  char type_name[16] = {};
  long long rows = 0, cols = 0, T = 0;
  std::optional<GgmlType> t;
  if (std::sscanf(spec, "%15[^:]:%lldx%lld:%lld", type_name, &rows, &cols, &T) == 4) t = gguf::type_from_name(type_name);
  if (!t || rows <= 0 || cols <= 0 || T <= 0 || T > cuda::kDecodeMaxTokens) {
    std::fprintf(stderr, "bench_cuda_matmul: --only wants TYPE:ROWSxCOLS:T with T in 1..%d, got '%s'\n",
                 int(cuda::kDecodeMaxTokens), spec);
    return 1;
  }
  const Copies c(*t, rows, cols);
  const double copy = cuda::bench_copy_gbs(size_t(1) << 30, 3);
  print_line(*t, {rows, cols}, std::to_string(T).c_str(),
             cuda::bench_matmul(c.mats.data(), int(c.mats.size()), T, 8, 2, cuda::BenchKernel::Fp32Decode), copy);
  if (cuda::mma_decode_supported(*t))
    print_line(*t, {rows, cols}, ("tc:" + std::to_string(T)).c_str(),
               cuda::bench_matmul(c.mats.data(), int(c.mats.size()), T, 8, 2, cuda::BenchKernel::TensorCoreDecode), copy);
  if (T == 1 && cuda::mma_one_token_supported(*t))
    print_line(*t, {rows, cols}, "one:1",
               cuda::bench_matmul(c.mats.data(), int(c.mats.size()), 1, 8, 2, cuda::BenchKernel::OneTokenTensorCore), copy);
  if (cuda::q8_supported(*t))
    for (int levels : {1, 2}) {
      print_line(*t, {rows, cols}, (std::string(levels == 2 ? "q8x2:" : "q8:") + std::to_string(T)).c_str(),
                 cuda::bench_matmul_q8(c.mats.data(), int(c.mats.size()), T, 8, 2, levels), copy);
      cuda::set_q8_staged_loads(false);  // "u": the dp4a kernel without staged loads (Q6_K, Q8_0)
      print_line(*t, {rows, cols}, (std::string(levels == 2 ? "q8x2u:" : "q8u:") + std::to_string(T)).c_str(),
                 cuda::bench_matmul_q8(c.mats.data(), int(c.mats.size()), T, 8, 2, levels), copy);
      cuda::set_q8_staged_loads(true);
    }
  if (T == 1 && cuda::q8_one_token_supported(*t))
    for (int levels : {1, 2})
      print_line(*t, {rows, cols}, levels == 2 ? "q8x2o:1" : "q8o:1",
                 cuda::bench_matmul_q8(c.mats.data(), int(c.mats.size()), 1, 8, 2, levels, true), copy);
  return 0;
}

// --absorb: W_UK and W_UV of GLM-5 (64 heads: 512 x 192, 256 x 512) and DeepSeek-V3.2 (128
// heads: 512 x 128, 128 x 512) through Blas::per_head, as the model runs them.
int run_absorb(double copy, int calls, int runs) {
  cuda::Blas blas;
  struct HeadShape {
    const char* name;
    int heads, rows, cols;
  };
  std::printf("%-11s %-5s %3s %9s %9s %7s   (T: head GEMV, Tt: tensor-core kernel, Tg: cuBLAS)\n", "product", "type", "T", "us/call", "GB/s",
              "% copy");
  for (const HeadShape& sh : {HeadShape{"glm5 W_UK", 64, 512, 192}, HeadShape{"glm5 W_UV", 64, 256, 512},
                              HeadShape{"dsv32 W_UK", 128, 512, 128}, HeadShape{"dsv32 W_UV", 128, 128, 512}})
    for (GgmlType t : {GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K}) {
      const bool quant = t != GgmlType::BF16;
      if (quant && !cuda::head_q8_supported(t, sh.rows, sh.cols, nullptr)) continue;
      const std::vector<uint8_t> bytes = random_weight(t, int64_t(sh.heads) * sh.rows, sh.cols);
      const int n = int((size_t(256) << 20) / bytes.size() + 1);
      std::vector<cuda::DeviceBuffer> bufs;
      std::vector<cuda::HeadBatchedGemm> gemms;
      for (int i = 0; i < n; ++i) {
        bufs.push_back(cuda::to_device(bytes));
        gemms.push_back({bufs.back().get(), sh.heads, sh.rows, sh.cols, false,
                         quant ? cuda::HeadWeights::Quant : cuda::HeadWeights::BF16, t});
      }
      for (int64_t T : {1, 2, 3, 4, 6, 8, 12, 16, 32})
        for (const auto& [path, tag] : {std::pair{cuda::Blas::Path::Kernel, " "}, std::pair{cuda::Blas::Path::TensorCore, "t"},
                                        std::pair{cuda::Blas::Path::Gemm, "g"}}) {
          // (past 16 tokens every path is cuBLAS's; the tensor-core kernel takes bf16 rows only)
          if ((T > 16 && path != cuda::Blas::Path::Kernel) || (quant && path == cuda::Blas::Path::TensorCore)) continue;
          blas.path = path;
          const cuda::MatmulTiming m = cuda::bench_per_head(blas, gemms.data(), n, T, calls, runs);
          std::printf("%-11s %-5s %3lld%s %9.2f %9.0f %6.0f%%\n", sh.name, std::string(gguf::type_name(t)).c_str(),
                      (long long)T, tag, m.us_per_call, m.weight_gbs, 100.0 * m.weight_gbs / copy);
        }
    }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, decode_only = false, absorb = false, prefill = false;
  const char* only = nullptr;
  int64_t only_t = 0;
  std::optional<GgmlType> only_type;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--type") == 0 && i + 1 < argc && !(only_type = gguf::type_from_name(argv[++i]))) {
      std::fprintf(stderr, "bench_cuda_matmul: unknown type '%s'\n", argv[i]);
      return 1;
    }
    if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) only_t = std::atoll(argv[++i]);
    quick |= std::strcmp(argv[i], "--quick") == 0;
    decode_only |= std::strcmp(argv[i], "--decode") == 0;
    absorb |= std::strcmp(argv[i], "--absorb") == 0;
    prefill |= std::strcmp(argv[i], "--prefill") == 0;
    if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
  }
  const auto devices = ops::list_devices();
  if (devices.empty()) {
    std::fprintf(stderr, "bench_cuda_matmul: no CUDA device\n");
    return 1;
  }
  if (only) return run_only(only);
  const double copy = cuda::bench_copy_gbs(size_t(1) << 30, quick ? 3 : 10);
  std::printf("%s: device-to-device copy %.0f GB/s (read + written)\n\n", devices[0].name.c_str(), copy);
  if (absorb) return run_absorb(copy, quick ? 8 : 20, quick ? 3 : 5);
  std::printf("%-5s %-13s %5s %10s %9s %7s %8s\n", "type", "rows x cols", "T", "us/call", "GB/s", "% copy", "TFLOP/s");
  const int calls = quick ? 8 : 20, runs = quick ? 3 : 5;
  for (GgmlType t : {GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q2_K, GgmlType::Q3_K,
                     GgmlType::IQ4_XS, GgmlType::IQ2_XXS, GgmlType::IQ3_XXS, GgmlType::IQ3_S, GgmlType::IQ2_XS,
                     GgmlType::IQ2_S, GgmlType::IQ1_S, GgmlType::IQ1_M, GgmlType::Q4_0, GgmlType::IQ4_NL,
                     GgmlType::MXFP4, GgmlType::F16, GgmlType::BF16}) {
    if (only_type && t != *only_type) continue;
    std::vector<Shape> shapes = {{4096, 4096}, {2048, 6144}, {6144, 2048}};
    if (t != GgmlType::BF16 && t != GgmlType::F16) shapes.insert(shapes.end(), {{6144, 16384}, {16384, 2048}, {154880, 6144}});
    for (Shape sh : shapes) {
      const Copies c(t, sh.rows, sh.cols);
      const bool large = sh.rows * sh.cols > 64 << 20, head = sh.rows * sh.cols > 256 << 20;
      const std::vector<int64_t> token_counts = prefill ? std::vector<int64_t>{64, 128, 256, 512, 1024, 4096}
                                                        : std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64, 512};
      for (int64_t T : token_counts) {
        const bool too_big = (prefill ? head : large) && T > 64;  // (prefill: all but the output head)
        if (too_big || (decode_only && T > cuda::kDecodeMaxTokens) || (only_t && T != only_t)) continue;
        const int n_calls = large ? 4 : calls;
        const bool few = T <= cuda::kDecodeMaxTokens;
        const cuda::MatmulTiming m = cuda::bench_matmul(c.mats.data(), int(c.mats.size()), T, n_calls, runs,
                                                        few ? cuda::BenchKernel::Fp32Decode : cuda::BenchKernel::Auto);
        print_line(t, sh, std::to_string(T).c_str(), m, copy);
        if (few && cuda::mma_decode_supported(t)) {  // the tensor-core decode kernel
          const cuda::MatmulTiming d = cuda::bench_matmul(c.mats.data(), int(c.mats.size()), T, n_calls, runs,
                                                          cuda::BenchKernel::TensorCoreDecode);
          print_line(t, sh, ("tc:" + std::to_string(T)).c_str(), d, copy);
        }
        if (T == 1 && cuda::mma_one_token_supported(t))  // its one-token form
          print_line(t, sh, "one:1",
                     cuda::bench_matmul(c.mats.data(), int(c.mats.size()), 1, n_calls, runs,
                                        cuda::BenchKernel::OneTokenTensorCore),
                     copy);
        if ((T > 1 && few) || prefill) {  // the tile kernel at decode sizes; both prefill forms
          const cuda::MatmulTiming p =
              cuda::bench_matmul(c.mats.data(), int(c.mats.size()), T, n_calls, runs, cuda::BenchKernel::Prefill);
          print_line(t, sh, ("pf:" + std::to_string(T)).c_str(), p, copy);
        }
        if (prefill && T == token_counts[0])  // the cuBLAS form's dequantization alone (GB/s: read + written)
          print_line(t, sh, "dq",
                     cuda::bench_matmul(c.mats.data(), int(c.mats.size()), T, n_calls, runs, cuda::BenchKernel::DequantBf16),
                     copy);
        if (prefill)
          print_line(t, sh, ("blas:" + std::to_string(T)).c_str(),
                     cuda::bench_matmul(c.mats.data(), int(c.mats.size()), T, n_calls, runs, cuda::BenchKernel::Blas),
                     copy);
        if (T <= cuda::kDecodeMaxTokens && cuda::q8_supported(t))
          for (int levels : {1, 2}) {
            const cuda::MatmulTiming q =
                cuda::bench_matmul_q8(c.mats.data(), int(c.mats.size()), T, n_calls, runs, levels);
            print_line(t, sh, (std::string(levels == 2 ? "q8x2:" : "q8:") + std::to_string(T)).c_str(), q, copy);
            if (T == 1 && gguf::traits(t).type_size % 16 != 0) {  // without staged loads
              cuda::set_q8_staged_loads(false);
              print_line(t, sh, levels == 2 ? "q8x2u:1" : "q8u:1",
                         cuda::bench_matmul_q8(c.mats.data(), int(c.mats.size()), 1, n_calls, runs, levels), copy);
              cuda::set_q8_staged_loads(true);
            }
            if (T == 1 && cuda::q8_one_token_supported(t))
              print_line(
                  t, sh, levels == 2 ? "q8x2o:1" : "q8o:1",
                  cuda::bench_matmul_q8(c.mats.data(), int(c.mats.size()), 1, n_calls, runs, levels, true), copy);
          }
      }
    }
  }
  if (prefill) return 0;
  // The routed experts of one MoE layer at batch 1: 8 (token, expert) pairs of one token, distinct
  // random experts of a 64-expert stack (GLM-5 widths: gate/up 2048 x 6144, down 6144 x 2048).
  for (auto [t, rows, cols] : {std::tuple{GgmlType::Q4_K, int64_t(2048), int64_t(6144)},
                               std::tuple{GgmlType::Q5_K, int64_t(2048), int64_t(6144)},
                               std::tuple{GgmlType::Q6_K, int64_t(6144), int64_t(2048)},
                               std::tuple{GgmlType::Q2_K, int64_t(2048), int64_t(6144)},
                               std::tuple{GgmlType::Q3_K, int64_t(2048), int64_t(6144)},
                               std::tuple{GgmlType::IQ4_XS, int64_t(2048), int64_t(6144)},
                               std::tuple{GgmlType::IQ2_XXS, int64_t(2048), int64_t(6144)},
                               std::tuple{GgmlType::IQ3_XXS, int64_t(2048), int64_t(6144)},
                               std::tuple{GgmlType::IQ3_S, int64_t(2048), int64_t(6144)},
                               std::tuple{GgmlType::IQ2_XS, int64_t(2048), int64_t(6144)},
                               std::tuple{GgmlType::IQ2_S, int64_t(2048), int64_t(6144)},
                               std::tuple{GgmlType::IQ1_S, int64_t(2048), int64_t(6144)},
                               std::tuple{GgmlType::IQ1_M, int64_t(2048), int64_t(6144)}}) {
    if (only_type && t != *only_type) continue;
    const std::vector<uint8_t> bytes = random_weight(t, 64 * rows, cols);
    const cuda::DeviceBuffer buf = cuda::to_device(bytes);
    const cuda::QuantMatrix w{t, cols, 64 * rows, gguf::row_bytes(t, uint64_t(cols)), buf.get()};
    print_line(t, {rows, cols}, "8exp", cuda::bench_matmul_experts(w, rows, 8, calls, runs), copy);
    if (cuda::mma_decode_supported(t))
      print_line(t, {rows, cols}, "tc:8e",
                 cuda::bench_matmul_experts(w, rows, 8, calls, runs, cuda::ExpertKernel::kTensorCores), copy);
    if (cuda::mma_one_token_supported(t))
      print_line(t, {rows, cols}, "one:8e",
                 cuda::bench_matmul_experts(w, rows, 8, calls, runs, cuda::ExpertKernel::kOneToken), copy);
    print_line(t, {rows, cols}, "q8:8e", cuda::bench_matmul_experts_q8(w, rows, 8, calls, runs), copy);
    print_line(t, {rows, cols}, "q8x2:8e", cuda::bench_matmul_experts_q8(w, rows, 8, calls, runs, 2), copy);
    cuda::set_q8_staged_loads(false);  // "u": without staged loads (Q6_K)
    print_line(t, {rows, cols}, "q8u:8e", cuda::bench_matmul_experts_q8(w, rows, 8, calls, runs), copy);
    print_line(t, {rows, cols}, "q8x2u:8e", cuda::bench_matmul_experts_q8(w, rows, 8, calls, runs, 2), copy);
    cuda::set_q8_staged_loads(true);
    if (cuda::q8_one_token_supported(t))
      print_line(t, {rows, cols}, "q8x2o:8e", cuda::bench_matmul_experts_q8(w, rows, 8, calls, runs, 2, true), copy);
  }
  for (int levels : {1, 2}) {
    std::printf("\nquantize_activations (%d level%s), us per call:", levels, levels == 2 ? "s" : "");
    for (int64_t cols : {2048, 6144})
      for (int64_t T : {1, 16})
        std::printf("  %lldx%lld %.2f", (long long)T, (long long)cols, cuda::bench_quantize_us(T, cols, calls, runs, levels));
  }
  std::printf("\n");
  return 0;
}
