#include "gguf/reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <regex>

#include "util/error.h"
#include "util/mapped_file.h"

namespace sparsemla::gguf {

struct File::Mapping {
  explicit Mapping(const std::string& path) : file(path) {}
  MappedFile file;
};

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as little-endian uint32

// Buffered, bounds-checked sequential reads of a file's header. Every length field is checked
// against the bytes left in the file before anything is allocated from it.
class Cursor {
 public:
  explicit Cursor(MappedFile& f) : f_(f) {}
  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return f_.size() - pos_; }
  const std::string& path() const { return f_.path(); }

  void read(void* dst, uint64_t n) {
    auto* out = static_cast<uint8_t*>(dst);
    while (n > 0) {
      if (buf_pos_ == buf_.size()) refill(n);
      uint64_t take = std::min<uint64_t>(n, buf_.size() - buf_pos_);
      std::memcpy(out, buf_.data() + buf_pos_, take);
      buf_pos_ += take;
      pos_ += take;
      out += take;
      n -= take;
    }
  }
  template <class T>
  T get() {
    T v;
    read(&v, sizeof v);
    return v;
  }
  // A GGUF string: uint64 length, then the bytes (not NUL-terminated).
  std::string string(std::string_view what, uint64_t max_len) {
    const uint64_t at = pos_;
    const uint64_t n = get<uint64_t>();
    if (n > remaining())
      fail("{}: {}: string length {} at offset {} runs past the end of the file ({} bytes left)", path(), what, n, at,
           remaining());
    if (n > max_len) fail("{}: {}: string length {} at offset {} exceeds the limit of {}", path(), what, n, at, max_len);
    std::string s(n, '\0');
    read(s.data(), n);
    return s;
  }

 private:
  void refill(uint64_t want) {
    if (pos_ >= f_.size())
      fail("{}: truncated: needed {} more bytes at offset {}, but the file ends there", path(), want, pos_);
    const uint64_t n = std::min<uint64_t>(kChunk, f_.size() - pos_);
    buf_.resize(n);
    f_.read_at(pos_, buf_.data(), n);
    buf_pos_ = 0;
  }
  static constexpr uint64_t kChunk = 64 * 1024;
  MappedFile& f_;
  std::vector<uint8_t> buf_;
  uint64_t buf_pos_ = 0;
  uint64_t pos_ = 0;
};

// Smallest encoded size of one value of a type, used to bound array counts before reserving.
uint64_t min_value_size(ValueType t) {
  switch (t) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::BOOL: return 1;
    case ValueType::UINT16: case ValueType::INT16: return 2;
    case ValueType::UINT32: case ValueType::INT32: case ValueType::FLOAT32: return 4;
    case ValueType::UINT64: case ValueType::INT64: case ValueType::FLOAT64: case ValueType::STRING: return 8;
    case ValueType::ARRAY: return 12;
  }
  return 1;
}

struct ParsedFile {
  uint32_t version = 0;
  uint32_t alignment = kDefaultAlignment;
  std::vector<std::pair<std::string, Value>> kv;
  std::vector<TensorInfo> tensors;
  uint64_t data_start = 0;
};

class Parser {
 public:
  Parser(MappedFile& f, const FileLimits& limits) : c_(f), limits_(limits) {}

  ParsedFile parse() {
    ParsedFile out;
    const uint32_t magic = get<uint32_t>("magic");
    if (magic != kMagic) {
      char m[4];
      std::memcpy(m, &magic, 4);
      std::string shown;
      for (char ch : m) shown += (ch >= 32 && ch < 127) ? std::string(1, ch) : fmt::format("\\x{:02x}", uint8_t(ch));
      fail("{}: bad magic: expected \"GGUF\", found \"{}\" (not a GGUF file)", path(), shown);
    }
    out.version = get<uint32_t>("version");
    if (out.version != 2 && out.version != 3) {
      const uint32_t swapped = __builtin_bswap32(out.version);
      if (swapped == 2 || swapped == 3)
        fail("{}: big-endian GGUF (version {} byte-swapped) is not supported; convert it to little-endian",
             path(), swapped);
      fail("{}: unsupported GGUF version {}: expected 2 or 3", path(), out.version);
    }
    const uint64_t n_tensors = get<uint64_t>("tensor count");
    const uint64_t n_kv = get<uint64_t>("metadata count");
    // Each key-value pair takes at least 13 bytes and each tensor info at least 32.
    if (n_kv > limits_.max_kv || n_kv > c_.remaining() / 13)
      fail("{}: truncated or corrupt: metadata count {} needs at least {} bytes per key, but the file has {} bytes "
           "left", path(), n_kv, 13, c_.remaining());
    if (n_tensors > limits_.max_tensors || n_tensors > c_.remaining() / 32)
      fail("{}: truncated or corrupt: tensor count {} needs at least {} bytes per tensor, but the file has {} bytes "
           "left", path(), n_tensors, 32, c_.remaining());

    out.kv.reserve(n_kv);
    std::unordered_map<std::string, size_t> seen;
    for (uint64_t i = 0; i < n_kv; ++i) {
      std::string key = c_.string(fmt::format("metadata key #{}", i), 65536);
      if (seen.count(key)) fail("{}: duplicate metadata key '{}'", path(), key);
      const uint32_t type = get<uint32_t>(fmt::format("type of key '{}'", key));
      if (type >= kValueTypeCount) fail("{}: key '{}': unknown value type {} (expected 0..12)", path(), key, type);
      Value v = value(ValueType(type), key, 0);
      seen.emplace(key, out.kv.size());
      out.kv.emplace_back(std::move(key), std::move(v));
    }
    if (auto it = seen.find("general.alignment"); it != seen.end()) {
      const Value& a = out.kv[it->second].second;
      if (a.type() != ValueType::UINT32)
        fail("{}: key 'general.alignment': expected uint32, found {}", path(), value_type_name(a.type()));
      const uint64_t al = a.as_u64();
      if (al == 0 || (al & (al - 1)) != 0)
        fail("{}: key 'general.alignment': expected a power of two, found {}", path(), al);
      out.alignment = uint32_t(al);
    }

    out.tensors.reserve(n_tensors);
    for (uint64_t i = 0; i < n_tensors; ++i) out.tensors.push_back(tensor_info(i, out.alignment));

    const uint64_t header_end = c_.pos();
    out.data_start = (header_end + out.alignment - 1) / out.alignment * out.alignment;
    check_data(out);
    return out;
  }

 private:
  const std::string& path() const { return c_.path(); }

  template <class T>
  T get(std::string_view what) {
    if (c_.remaining() < sizeof(T))
      fail("{}: truncated: reading {} needs {} bytes at offset {}, but the file has {} bytes left", path(), what,
           sizeof(T), c_.pos(), c_.remaining());
    return c_.get<T>();
  }

  Value value(ValueType t, const std::string& key, uint32_t depth) {
    const std::string what = fmt::format("key '{}'", key);
    switch (t) {
      case ValueType::UINT8: return Value::u8(get<uint8_t>(what));
      case ValueType::INT8: return Value::i8(get<int8_t>(what));
      case ValueType::UINT16: return Value::u16(get<uint16_t>(what));
      case ValueType::INT16: return Value::i16(get<int16_t>(what));
      case ValueType::UINT32: return Value::u32(get<uint32_t>(what));
      case ValueType::INT32: return Value::i32(get<int32_t>(what));
      case ValueType::FLOAT32: return Value::f32(get<float>(what));
      case ValueType::UINT64: return Value::u64(get<uint64_t>(what));
      case ValueType::INT64: return Value::i64(get<int64_t>(what));
      case ValueType::FLOAT64: return Value::f64(get<double>(what));
      case ValueType::BOOL: {
        const uint8_t b = get<uint8_t>(what);
        if (b > 1) fail("{}: key '{}': bool value must be 0 or 1, found {}", path(), key, b);
        return Value::boolean(b != 0);
      }
      case ValueType::STRING: return Value::string(c_.string(what, limits_.max_string));
      case ValueType::ARRAY: {
        if (depth >= limits_.max_array_depth)
          fail("{}: key '{}': arrays nested deeper than {}", path(), key, limits_.max_array_depth);
        const uint32_t et = get<uint32_t>(what);
        if (et >= kValueTypeCount)
          fail("{}: key '{}': unknown array element type {} (expected 0..12)", path(), key, et);
        const uint64_t at = c_.pos();
        const uint64_t n = get<uint64_t>(what);
        if (n > c_.remaining() / min_value_size(ValueType(et)))
          fail("{}: key '{}': array of {} {} elements at offset {} runs past the end of the file ({} bytes left)",
               path(), key, n, value_type_name(ValueType(et)), at, c_.remaining());
        std::vector<Value> items;
        // n is bounded by the bytes left, but a Value is larger than its encoding: grow as read.
        items.reserve(std::min<uint64_t>(n, 65536));
        for (uint64_t i = 0; i < n; ++i) items.push_back(value(ValueType(et), key, depth + 1));
        return Value::array(ValueType(et), std::move(items));
      }
    }
    fail("{}: key '{}': unknown value type {}", path(), key, uint32_t(t));
  }

  TensorInfo tensor_info(uint64_t i, uint32_t alignment) {
    TensorInfo t;
    t.name = c_.string(fmt::format("name of tensor #{}", i), 65536);
    const std::string what = fmt::format("tensor '{}'", t.name);
    t.n_dims = get<uint32_t>(what);
    if (t.n_dims == 0 || t.n_dims > kMaxDims)
      fail("{}: tensor '{}': n_dims is {}, expected 1 to {}", path(), t.name, t.n_dims, kMaxDims);
    int64_t n_elements = 1;
    for (uint32_t d = 0; d < t.n_dims; ++d) {
      const int64_t ne = get<int64_t>(what);
      if (ne <= 0) fail("{}: tensor '{}': dimension {} is {}, expected > 0", path(), t.name, d, ne);
      if (__builtin_mul_overflow(n_elements, ne, &n_elements))
        fail("{}: tensor '{}': element count overflows int64 at dimension {}", path(), t.name, d);
      t.ne[d] = ne;
    }
    const uint32_t type = get<uint32_t>(what);
    const auto tr = type_traits(type);
    if (!tr) fail("{}: tensor '{}': unknown ggml type {}", path(), t.name, type);
    t.type = tr->type;
    if (t.ne[0] % tr->block_size != 0)
      fail("{}: tensor '{}': row length {} is not a multiple of the {} block size {}", path(), t.name, t.ne[0],
           tr->name, tr->block_size);
    const uint64_t blocks = uint64_t(n_elements) / tr->block_size;
    if (__builtin_mul_overflow(blocks, uint64_t(tr->type_size), &t.nbytes))
      fail("{}: tensor '{}': byte size overflows", path(), t.name);
    t.offset = get<uint64_t>(what);  // relative to the data section until check_data
    if (t.offset % alignment != 0)
      fail("{}: tensor '{}': data offset {} is not a multiple of the alignment {}", path(), t.name, t.offset,
           alignment);
    return t;
  }

  void check_data(ParsedFile& pf) {
    const uint64_t size = c_.pos() + c_.remaining();
    if (pf.data_start > size && !pf.tensors.empty())
      fail("{}: truncated: the data section would start at {} but the file has {} bytes", path(), pf.data_start,
           size);
    std::unordered_map<std::string_view, size_t> names;
    for (size_t i = 0; i < pf.tensors.size(); ++i) {
      TensorInfo& t = pf.tensors[i];
      if (!names.emplace(t.name, i).second) fail("{}: duplicate tensor name '{}'", path(), t.name);
      const uint64_t avail = size > pf.data_start ? size - pf.data_start : 0;
      if (t.offset > avail || t.nbytes > avail - t.offset)
        fail("{}: tensor '{}': data [{}, {}) of the data section lies outside the file (data section holds {} bytes)",
             path(), t.name, t.offset, t.offset + t.nbytes, avail);
      t.offset += pf.data_start;
    }
    std::vector<const TensorInfo*> order;
    for (const TensorInfo& t : pf.tensors) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < order.size(); ++i) {
      const TensorInfo& a = *order[i - 1];
      const TensorInfo& b = *order[i];
      if (a.offset + a.nbytes > b.offset)
        fail("{}: tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (bytes [{}, {}))", path(), b.name, b.offset,
             b.offset + b.nbytes, a.name, a.offset, a.offset + a.nbytes);
    }
  }

  Cursor c_;
  const FileLimits& limits_;
};

const Value* find_kv(const std::vector<std::pair<std::string, Value>>& kv, std::string_view key) {
  for (const auto& [k, v] : kv)
    if (k == key) return &v;
  return nullptr;
}

std::optional<uint64_t> split_key(const ParsedFile& pf, const std::string& path, std::string_view key) {
  const Value* v = find_kv(pf.kv, key);
  if (!v) return std::nullopt;
  if (!v->is_integer()) fail("{}: key '{}': expected an integer, found {}", path, key, value_type_name(v->type()));
  if (v->type() == ValueType::INT8 || v->type() == ValueType::INT16 || v->type() == ValueType::INT32 ||
      v->type() == ValueType::INT64) {
    if (v->as_i64() < 0) fail("{}: key '{}': expected >= 0, found {}", path, key, v->as_i64());
  }
  return v->as_u64();
}

}  // namespace

std::string TensorInfo::shape_string() const {
  std::string s = "{";
  for (uint32_t d = 0; d < n_dims; ++d) s += fmt::format("{}{}", d ? ", " : "", ne[d]);
  return s + "}";
}

std::optional<SplitName> parse_split_name(const std::string& path) {
  static const std::regex re(R"(^(.*)-([0-9]{5})-of-([0-9]{5})\.gguf$)");
  std::smatch m;
  if (!std::regex_match(path, m, re)) return std::nullopt;
  return SplitName{m[1].str(), uint32_t(std::stoul(m[2].str())), uint32_t(std::stoul(m[3].str()))};
}

std::string split_path(const std::string& prefix, uint32_t index, uint32_t count) {
  return fmt::format("{}-{:05d}-of-{:05d}.gguf", prefix, index, count);
}

// Opens one file or every part of a split, checks the split metadata and merges the tables.
class FileParser {
 public:
  static std::unique_ptr<File> open(const std::string& path, const FileLimits& limits) {
    std::unique_ptr<File> f(new File());
    const auto split = parse_split_name(path);
    std::vector<std::string> paths;
    if (split && split->count > 1) {
      if (split->index == 0 || split->index > split->count)
        fail("{}: split index {} is outside 1..{}", path, split->index, split->count);
      for (uint32_t i = 1; i <= split->count; ++i) {
        std::string p = split_path(split->prefix, i, split->count);
        if (!std::filesystem::exists(p))
          fail("{}: split file {} of {} is missing: {}", path, i, split->count, p);
        paths.push_back(std::move(p));
      }
      check_no_extra_parts(*split);
    } else {
      paths.push_back(path);
    }

    uint64_t total_tensors = 0;
    std::optional<uint64_t> declared_total;
    for (size_t i = 0; i < paths.size(); ++i) {
      auto m = std::make_unique<File::Mapping>(paths[i]);
      ParsedFile pf = Parser(m->file, limits).parse();
      const auto count = split_key(pf, paths[i], "split.count");
      const auto no = split_key(pf, paths[i], "split.no");
      const auto tcount = split_key(pf, paths[i], "split.tensors.count");
      if (paths.size() > 1) {
        if (!count) fail("{}: part of a {}-file split but has no 'split.count' key", paths[i], paths.size());
        if (*count != paths.size())
          fail("{}: key 'split.count': expected {} (from the file name), found {}", paths[i], paths.size(), *count);
        if (!no) fail("{}: part of a split but has no 'split.no' key", paths[i]);
        if (*no != i)
          fail("{}: key 'split.no': expected {} (file {} of {}), found {}", paths[i], i, i + 1, paths.size(), *no);
      } else if (count && *count > 1) {
        fail("{}: key 'split.count' is {}, but the file name does not follow NAME-0000k-of-{:05d}.gguf; "
             "open the parts by their split names",
             paths[i], *count, *count);
      }
      if (i == 0) {
        f->version_ = pf.version;
        f->alignment_ = pf.alignment;
        f->kv_ = std::move(pf.kv);
        declared_total = tcount;
      } else if (tcount && declared_total && *tcount != *declared_total) {
        fail("{}: key 'split.tensors.count': expected {} (as in {}), found {}", paths[i], *declared_total, paths[0],
             *tcount);
      }
      const uint8_t* base = m->file.map();
      for (TensorInfo& t : pf.tensors) {
        t.file_index = uint32_t(i);
        t.data = base ? base + t.offset : nullptr;
        if (f->tensor_index_.count(t.name))
          fail("{}: duplicate tensor name '{}' (already in {})", paths[i], t.name,
               paths[f->tensors_[f->tensor_index_[t.name]].file_index]);
        f->tensor_index_.emplace(t.name, f->tensors_.size());
        f->tensors_.push_back(std::move(t));
      }
      total_tensors += pf.tensors.size();
      f->file_sizes_.push_back(m->file.size());
      f->bytes_read_ += m->file.bytes_read();
      f->maps_.push_back(std::move(m));
    }
    if (declared_total && *declared_total != total_tensors)
      fail("{}: key 'split.tensors.count' says {} tensors, but the {} file(s) hold {}", paths[0], *declared_total,
           paths.size(), total_tensors);
    for (size_t i = 0; i < f->kv_.size(); ++i) f->kv_index_.emplace(f->kv_[i].first, i);
    f->paths_ = std::move(paths);
    return f;
  }

 private:
  // Another NAME-xxxxx-of-yyyyy.gguf beside the parts (a different count, or an index past it) means
  // a mixed-up download: refuse rather than silently load the wrong set.
  static void check_no_extra_parts(const SplitName& split) {
    namespace fs = std::filesystem;
    fs::path prefix(split.prefix);
    fs::path dir = prefix.parent_path().empty() ? fs::path(".") : prefix.parent_path();
    const std::string stem = prefix.filename().string();
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      auto other = parse_split_name(name);
      if (!other || other->prefix != stem) continue;
      if (other->count != split.count || other->index == 0 || other->index > split.count)
        fail("{}: extra split file {} does not belong to a {}-part split ({}-of-{:05d})",
             split_path(split.prefix, 1, split.count), entry.path().string(), split.count, other->index,
             other->count);
    }
  }
};

std::unique_ptr<File> File::open(const std::string& path, const FileLimits& limits) {
  return FileParser::open(path, limits);
}

File::~File() = default;

const Value* File::find(std::string_view key) const {
  auto it = kv_index_.find(std::string(key));
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

namespace {
[[noreturn]] void wrong_type(const std::string& path, std::string_view key, std::string_view expected,
                             const Value& v) {
  fail("{}: key '{}': expected {}, found {} {}", path, key, expected, value_type_name(v.type()), v.to_string());
}
}  // namespace

std::optional<std::string> File::get_string(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type() != ValueType::STRING) wrong_type(paths_[0], key, "a string", *v);
  return v->as_string();
}

std::optional<uint64_t> File::get_uint(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_integer() || (v->type() != ValueType::UINT64 && v->as_i64() < 0))
    wrong_type(paths_[0], key, "a non-negative integer", *v);
  return v->as_u64();
}

std::optional<int64_t> File::get_int(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_integer()) wrong_type(paths_[0], key, "an integer", *v);
  return v->as_i64();
}

std::optional<double> File::get_float(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(paths_[0], key, "a number", *v);
  return v->as_f64();
}

std::optional<bool> File::get_bool(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type() != ValueType::BOOL) wrong_type(paths_[0], key, "a bool", *v);
  return v->as_bool();
}

const Value::Array* File::get_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return nullptr;
  if (v->type() != ValueType::ARRAY) wrong_type(paths_[0], key, "an array", *v);
  return &v->as_array();
}

std::string File::architecture() const {
  auto a = get_string("general.architecture");
  if (!a) fail("{}: key 'general.architecture' is missing", paths_[0]);
  return *a;
}

const TensorInfo* File::tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace sparsemla::gguf
