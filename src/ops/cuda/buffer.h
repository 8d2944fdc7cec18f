// Device memory owned by the host side, for the engine and the tests. Plain C++ (no CUDA headers),
// so that .cpp files can hold device buffers; built only when CUDA is (SPARSEMLA_HAVE_CUDA).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace sparsemla::cuda {

// Opaque CUDA stream (cudaStream_t); nullptr is the legacy default stream.
using Stream = void*;

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);  // uninitialized; throws sparsemla::Error when out of memory
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

  void upload(const void* host, size_t bytes, size_t offset = 0);
  void download(void* host, size_t bytes, size_t offset = 0) const;
  void zero();

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

template <class T>
DeviceBuffer to_device(const std::vector<T>& v) {
  DeviceBuffer b(v.size() * sizeof(T));
  if (!v.empty()) b.upload(v.data(), v.size() * sizeof(T));
  return b;
}
template <class T>
std::vector<T> to_host(const DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  if (n) b.download(v.data(), n * sizeof(T));
  return v;
}

// Waits for all work on the device and reports any asynchronous kernel error.
void synchronize();

// Elapsed milliseconds of `fn` (which launches on stream `s`; nullptr: the default stream) by CUDA
// events, best of `reps` after one warm-up call.
double time_ms(int reps, void (*fn)(void*), void* ctx, Stream s = nullptr);

}  // namespace sparsemla::cuda
