#include "ops/cuda/buffer.h"

#include <algorithm>

#include "ops/cuda/check.cuh"

namespace sparsemla::cuda {

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  cudaError_t err = cudaMalloc(&ptr_, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();
    ptr_ = nullptr;
    fail("cannot allocate {:.1f} MiB on the GPU: {}", double(bytes) / (1 << 20), cudaGetErrorString(err));
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::upload(const void* host, size_t bytes, size_t offset) {
  if (offset + bytes > bytes_) fail("DeviceBuffer::upload: {} bytes at {} past the end ({} bytes)", bytes, offset, bytes_);
  SPARSEMLA_CUDA_CHECK(cudaMemcpy(static_cast<char*>(ptr_) + offset, host, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(void* host, size_t bytes, size_t offset) const {
  if (offset + bytes > bytes_) fail("DeviceBuffer::download: {} bytes at {} past the end ({} bytes)", bytes, offset, bytes_);
  SPARSEMLA_CUDA_CHECK(cudaMemcpy(host, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost));
}

void DeviceBuffer::zero() {
  if (bytes_) SPARSEMLA_CUDA_CHECK(cudaMemset(ptr_, 0, bytes_));
}

void synchronize() { SPARSEMLA_CUDA_CHECK(cudaDeviceSynchronize()); }

double time_ms(int reps, void (*fn)(void*), void* ctx, Stream s) {
  const auto st = static_cast<cudaStream_t>(s);
  cudaEvent_t a, b;
  SPARSEMLA_CUDA_CHECK(cudaEventCreate(&a));
  SPARSEMLA_CUDA_CHECK(cudaEventCreate(&b));
  fn(ctx);  // warm-up
  float best = 1e30f;
  for (int r = 0; r < reps; ++r) {
    SPARSEMLA_CUDA_CHECK(cudaEventRecord(a, st));
    fn(ctx);
    SPARSEMLA_CUDA_CHECK(cudaEventRecord(b, st));
    SPARSEMLA_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    SPARSEMLA_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return double(best);
}

}  // namespace sparsemla::cuda
