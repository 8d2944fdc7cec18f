#include "gguf/writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "gguf/quants.h"
#include "gguf/reader.h"
#include "util/error.h"

namespace sparsemla::gguf {
namespace {

// Appends little-endian bytes; the writer builds each header in memory, then writes it once.
class Bytes {
 public:
  template <class T>
  void put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf.insert(buf.end(), p, p + sizeof v);
  }
  void str(const std::string& s) {
    put<uint64_t>(s.size());
    buf.insert(buf.end(), s.begin(), s.end());
  }
  void value(const Value& v) {
    switch (v.type()) {
      case ValueType::UINT8: put<uint8_t>(uint8_t(v.as_u64())); break;
      case ValueType::INT8: put<int8_t>(int8_t(v.as_i64())); break;
      case ValueType::UINT16: put<uint16_t>(uint16_t(v.as_u64())); break;
      case ValueType::INT16: put<int16_t>(int16_t(v.as_i64())); break;
      case ValueType::UINT32: put<uint32_t>(uint32_t(v.as_u64())); break;
      case ValueType::INT32: put<int32_t>(int32_t(v.as_i64())); break;
      case ValueType::UINT64: put<uint64_t>(v.as_u64()); break;
      case ValueType::INT64: put<int64_t>(v.as_i64()); break;
      case ValueType::FLOAT32: put<float>(float(v.as_f64())); break;
      case ValueType::FLOAT64: put<double>(v.as_f64()); break;
      case ValueType::BOOL: put<uint8_t>(v.as_bool() ? 1 : 0); break;
      case ValueType::STRING: str(v.as_string()); break;
      case ValueType::ARRAY: {
        const Value::Array& a = v.as_array();
        put<uint32_t>(uint32_t(a.elem));
        put<uint64_t>(a.items.size());
        for (const Value& item : a.items) {
          if (item.type() != a.elem)
            fail("GGUF writer: array of {} holds a {}", value_type_name(a.elem), value_type_name(item.type()));
          value(item);
        }
        break;
      }
    }
  }
  std::vector<uint8_t> buf;
};

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

void write_all(int fd, const std::string& path, const uint8_t* p, uint64_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("{}: write failed: {}", path, std::strerror(errno));
    }
    p += w;
    n -= uint64_t(w);
  }
}

}  // namespace

Writer::Writer(uint32_t alignment) : alignment_(alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    fail("GGUF writer: alignment must be a power of two, got {}", alignment);
  if (alignment != kDefaultAlignment) set("general.alignment", Value::u32(alignment));
}

void Writer::set(const std::string& key, Value v) {
  for (auto& [k, old] : kv_)
    if (k == key) {
      old = std::move(v);
      return;
    }
  kv_.emplace_back(key, std::move(v));
}

void Writer::check_new_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                              uint64_t* nbytes) const {
  if (ne.empty() || ne.size() > kMaxDims) fail("GGUF writer: tensor '{}': {} dimensions", name, ne.size());
  for (const Tensor& t : tensors_)
    if (t.name == name) fail("GGUF writer: duplicate tensor '{}'", name);
  const TypeTraits& tr = traits(type);
  if (ne[0] % tr.block_size != 0)
    fail("GGUF writer: tensor '{}': row length {} is not a multiple of the {} block size {}", name, ne[0], tr.name,
         tr.block_size);
  uint64_t n = 1;
  for (int64_t d : ne) {
    if (d <= 0) fail("GGUF writer: tensor '{}': dimension {}", name, d);
    n *= uint64_t(d);
  }
  *nbytes = n / tr.block_size * tr.type_size;
}

void Writer::add_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                        const std::vector<float>& values) {
  uint64_t nbytes = 0;
  check_new_tensor(name, type, ne, &nbytes);
  const uint64_t n = values.size();
  if (n != uint64_t(ne[0]) * (ne.size() > 1 ? ne[1] : 1) * (ne.size() > 2 ? ne[2] : 1) * (ne.size() > 3 ? ne[3] : 1))
    fail("GGUF writer: tensor '{}': {} values for its shape", name, n);
  std::vector<uint8_t> bytes(nbytes);
  const uint64_t rows = n / uint64_t(ne[0]);
  const uint64_t rb = row_bytes(type, uint64_t(ne[0]));
  for (uint64_t r = 0; r < rows; ++r) quantize_row(type, values.data() + r * ne[0], bytes.data() + r * rb, ne[0]);
  tensors_.push_back({name, type, ne, std::move(bytes), nbytes});
}

void Writer::add_tensor_bytes(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                              std::vector<uint8_t> bytes) {
  uint64_t nbytes = 0;
  check_new_tensor(name, type, ne, &nbytes);
  if (bytes.size() != nbytes)
    fail("GGUF writer: tensor '{}': {} bytes given, its shape needs {}", name, bytes.size(), nbytes);
  tensors_.push_back({name, type, ne, std::move(bytes), nbytes});
}

void Writer::add_tensor_zeros(const std::string& name, GgmlType type, const std::vector<int64_t>& ne) {
  uint64_t nbytes = 0;
  check_new_tensor(name, type, ne, &nbytes);
  tensors_.push_back({name, type, ne, {}, nbytes});
}

void Writer::write_file(const std::string& path, const std::vector<std::pair<std::string, Value>>& kv,
                        const std::vector<const Tensor*>& tensors) const {
  Bytes h;
  h.put<uint32_t>(0x46554747);  // "GGUF"
  h.put<uint32_t>(3);
  h.put<uint64_t>(tensors.size());
  h.put<uint64_t>(kv.size());
  for (const auto& [k, v] : kv) {
    h.str(k);
    h.put<uint32_t>(uint32_t(v.type()));
    h.value(v);
  }
  uint64_t offset = 0;
  std::vector<uint64_t> offsets;
  for (const Tensor* t : tensors) {
    h.str(t->name);
    h.put<uint32_t>(uint32_t(t->ne.size()));
    for (int64_t d : t->ne) h.put<int64_t>(d);
    h.put<uint32_t>(uint32_t(t->type));
    h.put<uint64_t>(offset);
    offsets.push_back(offset);
    offset = align_up(offset + t->nbytes, alignment_);
  }
  h.buf.resize(align_up(h.buf.size(), alignment_), 0);
  const uint64_t data_start = h.buf.size();

  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("{}: cannot create: {}", path, std::strerror(errno));
  try {
    write_all(fd, path, h.buf.data(), h.buf.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const Tensor* t = tensors[i];
      if (!t->bytes.empty()) {
        if (::lseek(fd, off_t(data_start + offsets[i]), SEEK_SET) < 0)
          fail("{}: seek failed: {}", path, std::strerror(errno));
        write_all(fd, path, t->bytes.data(), t->bytes.size());
      }
    }
    // The file ends at the end of the last tensor's data padded to the alignment, as ggml writes it;
    // ftruncate also materializes trailing holes.
    if (::ftruncate(fd, off_t(data_start + offset)) != 0) fail("{}: truncate failed: {}", path, std::strerror(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) fail("{}: close failed: {}", path, std::strerror(errno));
}

void Writer::write(const std::string& path) const {
  std::vector<const Tensor*> all;
  for (const Tensor& t : tensors_) all.push_back(&t);
  write_file(path, kv_, all);
}

std::vector<std::string> Writer::write_split(const std::string& prefix, size_t max_tensors, uint64_t max_bytes) const {
  if (max_tensors == 0) fail("GGUF writer: max_tensors must be > 0");
  std::vector<std::vector<const Tensor*>> parts(1);
  uint64_t bytes = 0;
  for (const Tensor& t : tensors_) {
    auto& cur = parts.back();
    if (!cur.empty() && (cur.size() >= max_tensors || (max_bytes > 0 && bytes + t.nbytes > max_bytes))) {
      parts.emplace_back();
      bytes = 0;
    }
    parts.back().push_back(&t);
    bytes += t.nbytes;
  }
  if (parts.size() > 99999) fail("GGUF writer: {} parts is more than a split name can number", parts.size());
  std::vector<std::string> paths;
  for (size_t i = 0; i < parts.size(); ++i) {
    std::vector<std::pair<std::string, Value>> kv;
    if (i == 0) kv = kv_;
    kv.emplace_back("split.no", Value::u16(uint16_t(i)));
    kv.emplace_back("split.count", Value::u16(uint16_t(parts.size())));
    kv.emplace_back("split.tensors.count", Value::i32(int32_t(tensors_.size())));
    paths.push_back(split_path(prefix, uint32_t(i + 1), uint32_t(parts.size())));
    write_file(paths.back(), kv, parts[i]);
  }
  return paths;
}

}  // namespace sparsemla::gguf
