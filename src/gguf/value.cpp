#include "gguf/value.h"

#include <fmt/format.h>

#include <limits>

#include "util/error.h"

namespace sparsemla::gguf {

std::string_view value_type_name(ValueType t) {
  switch (t) {
    case ValueType::UINT8: return "uint8";
    case ValueType::INT8: return "int8";
    case ValueType::UINT16: return "uint16";
    case ValueType::INT16: return "int16";
    case ValueType::UINT32: return "uint32";
    case ValueType::INT32: return "int32";
    case ValueType::FLOAT32: return "float32";
    case ValueType::BOOL: return "bool";
    case ValueType::STRING: return "string";
    case ValueType::ARRAY: return "array";
    case ValueType::UINT64: return "uint64";
    case ValueType::INT64: return "int64";
    case ValueType::FLOAT64: return "float64";
  }
  return "unknown";
}

Value Value::string_array(const std::vector<std::string>& v) {
  std::vector<Value> items;
  items.reserve(v.size());
  for (const auto& s : v) items.push_back(string(s));
  return array(ValueType::STRING, std::move(items));
}

Value Value::i32_array(const std::vector<int32_t>& v) {
  std::vector<Value> items;
  items.reserve(v.size());
  for (int32_t x : v) items.push_back(i32(x));
  return array(ValueType::INT32, std::move(items));
}

Value Value::f32_array(const std::vector<float>& v) {
  std::vector<Value> items;
  items.reserve(v.size());
  for (float x : v) items.push_back(f32(x));
  return array(ValueType::FLOAT32, std::move(items));
}

Value Value::bool_array(const std::vector<bool>& v) {
  std::vector<Value> items;
  items.reserve(v.size());
  for (bool x : v) items.push_back(boolean(x));
  return array(ValueType::BOOL, std::move(items));
}

bool Value::is_integer() const {
  switch (type_) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::UINT16: case ValueType::INT16:
    case ValueType::UINT32: case ValueType::INT32: case ValueType::UINT64: case ValueType::INT64:
      return true;
    default:
      return false;
  }
}

uint64_t Value::as_u64() const {
  if (auto* u = std::get_if<uint64_t>(&v_)) return *u;
  if (auto* i = std::get_if<int64_t>(&v_)) {
    if (*i < 0) fail("expected a non-negative integer, found {}", *i);
    return uint64_t(*i);
  }
  if (auto* b = std::get_if<bool>(&v_)) return *b ? 1 : 0;
  fail("expected an integer, found {}", value_type_name(type_));
}

int64_t Value::as_i64() const {
  if (auto* i = std::get_if<int64_t>(&v_)) return *i;
  if (auto* u = std::get_if<uint64_t>(&v_)) {
    if (*u > uint64_t(std::numeric_limits<int64_t>::max())) fail("integer {} does not fit in int64", *u);
    return int64_t(*u);
  }
  if (auto* b = std::get_if<bool>(&v_)) return *b ? 1 : 0;
  fail("expected an integer, found {}", value_type_name(type_));
}

double Value::as_f64() const {
  if (auto* d = std::get_if<double>(&v_)) return *d;
  if (auto* u = std::get_if<uint64_t>(&v_)) return double(*u);
  if (auto* i = std::get_if<int64_t>(&v_)) return double(*i);
  fail("expected a number, found {}", value_type_name(type_));
}

bool Value::as_bool() const {
  if (auto* b = std::get_if<bool>(&v_)) return *b;
  fail("expected a bool, found {}", value_type_name(type_));
}

const std::string& Value::as_string() const {
  if (auto* s = std::get_if<std::string>(&v_)) return *s;
  fail("expected a string, found {}", value_type_name(type_));
}

const Value::Array& Value::as_array() const {
  if (auto* a = std::get_if<Array>(&v_)) return *a;
  fail("expected an array, found {}", value_type_name(type_));
}

std::string Value::to_string(size_t max_items) const {
  switch (type_) {
    case ValueType::STRING: {
      const std::string& s = as_string();
      std::string out = "\"";
      for (char c : s.substr(0, 200)) {
        if (c == '\n') out += "\\n";
        else if (c == '"') out += "\\\"";
        else out += c;
      }
      if (s.size() > 200) out += "...";
      return out + "\"";
    }
    case ValueType::BOOL: return as_bool() ? "true" : "false";
    case ValueType::FLOAT32: case ValueType::FLOAT64: return fmt::format("{}", as_f64());
    case ValueType::ARRAY: {
      const Array& a = as_array();
      std::string out = fmt::format("[{} x {}: ", a.items.size(), value_type_name(a.elem));
      for (size_t i = 0; i < a.items.size() && i < max_items; ++i)
        out += (i ? ", " : "") + a.items[i].to_string(max_items);
      if (a.items.size() > max_items) out += ", ...";
      return out + "]";
    }
    default:
      if (auto* i = std::get_if<int64_t>(&v_)) return fmt::format("{}", *i);
      return fmt::format("{}", std::get<uint64_t>(v_));
  }
}

}  // namespace sparsemla::gguf
