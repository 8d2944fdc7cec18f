// Reading GGUF model files: versions 2 and 3, little-endian, whole or split into
// NAME-0000k-of-0000n.gguf parts. Headers are read with bounded, checked reads; tensor data is
// memory-mapped and never copied. Every malformed input is refused with an Error that names the
// file and the key or tensor, what was expected and what was found.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gguf/ggml_types.h"
#include "gguf/value.h"

namespace sparsemla::gguf {

constexpr uint32_t kMaxDims = 4;
constexpr uint32_t kDefaultAlignment = 32;

struct TensorInfo {
  std::string name;
  GgmlType type = GgmlType::F32;
  uint32_t n_dims = 0;
  int64_t ne[kMaxDims] = {1, 1, 1, 1};  // ne[0] varies fastest; dims past n_dims are 1
  uint32_t file_index = 0;              // which file of the split holds the data
  uint64_t offset = 0;                  // absolute byte offset of the data in that file
  uint64_t nbytes = 0;
  const uint8_t* data = nullptr;        // into the file's read-only mapping

  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  int64_t n_rows() const { return ne[1] * ne[2] * ne[3]; }
  uint64_t row_bytes() const { return gguf::row_bytes(type, uint64_t(ne[0])); }
  std::string shape_string() const;  // "{6144, 2048}"
};

struct FileLimits {
  // Guards against files crafted to exhaust memory; real files are far below these.
  uint64_t max_kv = 1u << 20;
  uint64_t max_tensors = 1u << 20;
  uint64_t max_string = 1ull << 30;
  uint32_t max_array_depth = 8;
};

class File {
 public:
  // Opens `path`; when its name is NAME-0000k-of-0000n.gguf, opens all n parts and presents
  // one tensor table. Throws sparsemla::Error on any malformed or inconsistent input.
  static std::unique_ptr<File> open(const std::string& path, const FileLimits& limits = {});
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  const std::vector<std::string>& paths() const { return paths_; }
  // Bytes of each file (same order as paths()).
  const std::vector<uint64_t>& file_sizes() const { return file_sizes_; }

  // Metadata of the first file (where split tools keep it), in file order.
  const std::vector<std::pair<std::string, Value>>& metadata() const { return kv_; }
  const Value* find(std::string_view key) const;

  // Typed getters: nullopt when absent; Error naming the key when present with the wrong type.
  std::optional<std::string> get_string(std::string_view key) const;
  std::optional<uint64_t> get_uint(std::string_view key) const;  // any non-negative integer
  std::optional<int64_t> get_int(std::string_view key) const;
  std::optional<double> get_float(std::string_view key) const;   // any number
  std::optional<bool> get_bool(std::string_view key) const;
  const Value::Array* get_array(std::string_view key) const;
  // The architecture ("glm-dsa"); Error when general.architecture is missing.
  std::string architecture() const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* tensor(std::string_view name) const;

  // Bytes read from disk while parsing (headers only; tensor data is mapped, not read).
  uint64_t header_bytes_read() const { return bytes_read_; }

 private:
  File() = default;
  struct Mapping;
  uint32_t version_ = 0;
  uint32_t alignment_ = kDefaultAlignment;
  std::vector<std::string> paths_;
  std::vector<uint64_t> file_sizes_;
  std::vector<std::pair<std::string, Value>> kv_;
  std::unordered_map<std::string, size_t> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
  std::vector<std::unique_ptr<Mapping>> maps_;
  uint64_t bytes_read_ = 0;
  friend class FileParser;
};

// "NAME-00002-of-00007.gguf" -> {"NAME", 2, 7}; nullopt for other names.
struct SplitName {
  std::string prefix;  // path without the -0000k-of-0000n.gguf tail
  uint32_t index;      // 1-based, as in the file name
  uint32_t count;
};
std::optional<SplitName> parse_split_name(const std::string& path);
std::string split_path(const std::string& prefix, uint32_t index, uint32_t count);

}  // namespace sparsemla::gguf
