// Prefill products through cuBLAS (quant_matmul.h: matmul_prefill_blas, and matmul_many's products
// of one input, which share the activations' rounding). The tile kernel of
// gemm.cuh decodes every weight tile once per 128-token tile, so at T tokens each weight is decoded
// T / 128 times, and that decode, not the tensor cores, sets its pace (~130-160 TFLOP/s on an H100
// or H200 whatever T). Here each weight is decoded once per call: its rows, in chunks of at most
// kChunkWeights values, are dequantized to bf16 (each value as the CPU's dequantization gives it,
// rounded to nearest even), the activations are rounded to bf16 once, and cuBLAS multiplies them
// (bf16 in, fp32 accumulation and output). BF16 weights are read in place.
// The same two bf16 roundings per term as the tile kernel, so the same accuracy; the summation
// order is cuBLAS's (deterministic for a given shape and device).
//
// Scratch (cuBLAS's 32 MiB workspace, the bf16 activations and one chunk of rows) is allocated
// stream-ordered per call (cudaMallocAsync, as the tile kernel's split sums are; inside a CUDA graph
// capture, as graph memory); where it cannot be had, the call returns false and the caller takes
// the tile kernel, as where cuBLAS cannot make its handle. One handle per device (calls on it
// serialized by a mutex: rank threads use their own devices), made outside any capture.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <map>
#include <memory>
#include <mutex>

#include "ops/cuda/check.cuh"
#include "ops/cuda/cublas_check.cuh"
#include "ops/cuda/dequant_bf16.cuh"
#include "ops/cuda/prefill_blas.cuh"

namespace sparsemla::cuda {

namespace {

constexpr int64_t kChunkWeights = int64_t(32) << 20;  // 64 MiB of bf16 rows per chunk
constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper
constexpr int kMaxBlasProducts = 8;                    // prefill_blas_many's products per call

std::atomic<int64_t> g_calls{0};

// One cuBLAS handle per device, never destroyed (it would outlive the CUDA context at exit); calls on
// it hold its mutex from cublasSetStream to the last GEMM.
struct DeviceBlas {
  std::mutex mu;
  cublasHandle_t handle = nullptr;
};

// The current device's handle with its lock held in `lock`; null where the handle cannot be made
// (then a later call tries again) or s is capturing before the handle exists (cublasCreate must not
// run inside a capture).
cublasHandle_t device_handle(cudaStream_t s, std::unique_lock<std::mutex>& lock) {
  static std::mutex mu;
  static auto* all = new std::map<int, std::unique_ptr<DeviceBlas>>();
  int device = 0;
  SPARSEMLA_CUDA_CHECK(cudaGetDevice(&device));
  DeviceBlas* d = nullptr;
  {
    std::lock_guard<std::mutex> guard(mu);
    std::unique_ptr<DeviceBlas>& e = (*all)[device];
    if (!e) e = std::make_unique<DeviceBlas>();
    d = e.get();
  }
  lock = std::unique_lock<std::mutex>(d->mu);
  if (!d->handle) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    SPARSEMLA_CUDA_CHECK(cudaStreamIsCapturing(s, &capture));
    if (capture != cudaStreamCaptureStatusNone || cublasCreate(&d->handle) != CUBLAS_STATUS_SUCCESS) {
      d->handle = nullptr;
      return nullptr;
    }
  }
  return d->handle;
}

size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

// Stream-ordered scratch for one call: cuBLAS's workspace first, then what the call asks for; freed
// (stream-ordered) when the call's scope ends, by an exception too.
class Scratch {
 public:
  Scratch(size_t bytes, cudaStream_t s) : s_(s) {
    // An error pending from earlier work is not ours to clear: decline, and let the caller's own
    // launch report it.
    if (cudaPeekAtLastError() != cudaSuccess) return;
    if (cudaMallocAsync(&p_, kWorkspaceBytes + bytes, s) != cudaSuccess) {
      p_ = nullptr;
      (void)cudaGetLastError();  // (the allocation failure just made; not sticky)
    }
  }
  ~Scratch() {
    if (p_) (void)cudaFreeAsync(p_, s_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  explicit operator bool() const { return p_ != nullptr; }
  void* workspace() const { return p_; }
  uint8_t* data() const { return static_cast<uint8_t*>(p_) + kWorkspaceBytes; }

 private:
  cudaStream_t s_;
  void* p_ = nullptr;
};

// h bound to stream s and to the call's workspace (cublasSetStream resets the workspace, so this order).
void bind(cublasHandle_t h, cudaStream_t s, const Scratch& scratch) {
  SPARSEMLA_CUBLAS_CHECK(cublasSetStream(h, s));
  SPARSEMLA_CUBLAS_CHECK(cublasSetWorkspace(h, scratch.workspace(), kWorkspaceBytes));
}

}  // namespace

int64_t prefill_blas_calls() { return g_calls.load(); }

bool prefill_blas_f32(const MatArgs& a, cudaStream_t s) {
  const int64_t T = a.n_tokens, rows = a.n_rows, cols = a.n_cols, lda = int64_t(a.row_bytes / 4);
  if (T <= 0 || rows <= 0) return true;
  if (T > INT_MAX || rows > INT_MAX || cols > INT_MAX || lda > INT_MAX || a.row_bytes % 4 != 0) return false;
  std::unique_lock<std::mutex> lock;
  const cublasHandle_t h = device_handle(s, lock);
  if (!h) return false;
  const Scratch scratch(0, s);
  if (!scratch) return false;
  bind(h, s, scratch);
  const float one = 1.0f, zero = 0.0f;
  SPARSEMLA_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(rows), int(T), int(cols), &one, a.w,
                                              CUDA_R_32F, int(lda), a.x, CUDA_R_32F, int(cols), &zero, a.y, CUDA_R_32F,
                                              int(rows), CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
  ++g_calls;
  return true;
}

bool prefill_blas_many(const BlasProduct* p, int n_products, cudaStream_t s, int64_t chunk_rows) {
  if (n_products <= 0) return true;
  const MatArgs& a0 = p[0].a;
  const int64_t T = a0.n_tokens, cols = a0.n_cols;
  if (T <= 0) return true;
  if (T > INT_MAX || cols > INT_MAX) return false;
  // Rows per chunk of each product: all when read in place, else whole 128-row tiles of at most
  // kChunkWeights values; the scratch holds the largest.
  int64_t chunk[kMaxBlasProducts] = {};
  if (n_products > kMaxBlasProducts) return false;
  size_t w_bytes = 0;
  for (int i = 0; i < n_products; ++i) {
    const MatArgs& a = p[i].a;
    if (a.x != a0.x || a.n_tokens != T || a.n_cols != cols) return false;  // (not one input: the caller's error)
    const int64_t rows = a.n_rows, lda_in_place = int64_t(a.row_bytes / 2);
    if (rows > INT_MAX || lda_in_place > INT_MAX) return false;
    int64_t c = p[i].bf16_in_place ? rows : std::min(rows, std::max<int64_t>(128, kChunkWeights / cols / 128 * 128));
    if (chunk_rows > 0) c = std::min(c, chunk_rows);
    chunk[i] = std::max<int64_t>(c, 1);
    if (!p[i].bf16_in_place) w_bytes = std::max(w_bytes, size_t(chunk[i] * cols) * 2);
  }
  std::unique_lock<std::mutex> lock;
  const cublasHandle_t h = device_handle(s, lock);
  if (!h) return false;
  const size_t x_bytes = round_up(size_t(T * cols) * 2, 256);
  const Scratch scratch(x_bytes + w_bytes, s);
  if (!scratch) return false;
  bind(h, s, scratch);
  auto* xb = reinterpret_cast<__nv_bfloat16*>(scratch.data());
  auto* wb = reinterpret_cast<__nv_bfloat16*>(scratch.data() + x_bytes);
  const int64_t n = T * cols;
  const unsigned grid = unsigned(std::min<int64_t>((n / 8 + 255) / 256 + 1, 65535));
  round_bf16_kernel<__nv_bfloat16><<<grid, 256, 0, s>>>(a0.x, n, xb);
  SPARSEMLA_CUDA_LAUNCH_CHECK();
  const float one = 1.0f, zero = 0.0f;
  for (int i = 0; i < n_products; ++i) {
    const MatArgs& a = p[i].a;
    const int64_t rows = a.n_rows;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk[i]) {
      const int64_t nr = std::min(chunk[i], rows - r0);
      const void* w = wb;
      int64_t lda = cols;
      if (p[i].bf16_in_place) {
        w = a.w + uint64_t(r0) * a.row_bytes;
        lda = int64_t(a.row_bytes / 2);
      } else {
        p[i].to_bf16(a, r0, nr, wb, s);
      }
      // Column-major: y^T (rows x T, ld n_rows) = op(W) x^T with W row-major [rows][lda] read as
      // column-major lda x rows (op = transpose) and x^T column-major cols x T.
      SPARSEMLA_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(nr), int(T), int(cols), &one, w,
                                          CUDA_R_16BF, int(lda), xb, CUDA_R_16BF, int(cols), &zero, a.y + r0,
                                          CUDA_R_32F, int(rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    ++g_calls;
  }
  return true;
}

void warm_up_blas(cudaStream_t s) {
  constexpr int n = 128;
  constexpr size_t kBytes = size_t(n * n) * (2 * 2 + 4 * 3);  // bf16 a, b; fp32 a, b, c (zeros)
  std::unique_lock<std::mutex> lock;
  const cublasHandle_t h = device_handle(s, lock);
  if (!h) return;
  const Scratch scratch(kBytes, s);
  if (!scratch) return;
  bind(h, s, scratch);
  uint8_t* p = scratch.data();
  SPARSEMLA_CUDA_CHECK(cudaMemsetAsync(p, 0, kBytes, s));
  const float one = 1.0f, zero = 0.0f;
  float* c = reinterpret_cast<float*>(p + size_t(n * n) * (2 * 2 + 4 * 2));
  SPARSEMLA_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, p, CUDA_R_16BF, n, p + n * n * 2,
                                     CUDA_R_16BF, n, &zero, c, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  const auto* f = reinterpret_cast<const float*>(p + size_t(n * n) * 4);
  SPARSEMLA_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, f, CUDA_R_32F, n, f + n * n,
                                     CUDA_R_32F, n, &zero, c, CUDA_R_32F, n, CUBLAS_COMPUTE_32F_PEDANTIC,
                                     CUBLAS_GEMM_DEFAULT));
  SPARSEMLA_CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace sparsemla::cuda
