// Writing GGUF files (version 3): for test models, fixtures and tools. Every metadata type;
// tensors given as float32 and stored as F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K or Q6_K, or given
// already encoded in
// any ggml type; one file or NAME-0000k-of-0000n.gguf parts as llama.cpp's gguf-split makes them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/value.h"

namespace sparsemla::gguf {

class Writer {
 public:
  explicit Writer(uint32_t alignment = 32);

  // Sets a metadata key; a key set twice keeps its first position and takes the new value.
  void set(const std::string& key, Value v);
  // Stores `values` ([ne3][ne2][ne1][ne0], ne0 fastest) encoded as `type` (F32/F16/BF16/Q8_0/Q4_0/Q4_K/Q5_K/Q6_K).
  void add_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                  const std::vector<float>& values);
  // Stores already-encoded bytes of any ggml type; their size must match the shape.
  void add_tensor_bytes(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                        std::vector<uint8_t> bytes);
  // A tensor whose data is left as a hole in the file: it reads back as zero bytes and costs no disk
  // space on file systems with sparse files. For large test files.
  void add_tensor_zeros(const std::string& name, GgmlType type, const std::vector<int64_t>& ne);

  void write(const std::string& path) const;
  // Writes parts of at most `max_tensors` tensors each (and, if max_bytes > 0, at most max_bytes of
  // tensor data, but at least one tensor); metadata goes in the first part, split.* keys in all.
  // Returns the paths written.
  std::vector<std::string> write_split(const std::string& prefix, size_t max_tensors, uint64_t max_bytes = 0) const;

 private:
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> ne;
    std::vector<uint8_t> bytes;  // empty for a hole
    uint64_t nbytes;
  };
  void check_new_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& ne, uint64_t* nbytes) const;
  void write_file(const std::string& path, const std::vector<std::pair<std::string, Value>>& kv,
                  const std::vector<const Tensor*>& tensors) const;

  uint32_t alignment_;
  std::vector<std::pair<std::string, Value>> kv_;
  std::vector<Tensor> tensors_;
};

}  // namespace sparsemla::gguf
