// A GGUF metadata value: one of the 13 GGUF value types, arrays possibly nested.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace sparsemla::gguf {

enum class ValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};
constexpr uint32_t kValueTypeCount = 13;
std::string_view value_type_name(ValueType t);  // "uint32", "string", "array", ...

class Value {
 public:
  struct Array {
    ValueType elem = ValueType::UINT8;
    std::vector<Value> items;
  };

  Value() = default;
  static Value u8(uint8_t v) { return Value(ValueType::UINT8, uint64_t(v)); }
  static Value i8(int8_t v) { return Value(ValueType::INT8, int64_t(v)); }
  static Value u16(uint16_t v) { return Value(ValueType::UINT16, uint64_t(v)); }
  static Value i16(int16_t v) { return Value(ValueType::INT16, int64_t(v)); }
  static Value u32(uint32_t v) { return Value(ValueType::UINT32, uint64_t(v)); }
  static Value i32(int32_t v) { return Value(ValueType::INT32, int64_t(v)); }
  static Value u64(uint64_t v) { return Value(ValueType::UINT64, v); }
  static Value i64(int64_t v) { return Value(ValueType::INT64, v); }
  static Value f32(float v) { return Value(ValueType::FLOAT32, double(v)); }
  static Value f64(double v) { return Value(ValueType::FLOAT64, v); }
  static Value boolean(bool v) { return Value(ValueType::BOOL, v); }
  static Value string(std::string v) { return Value(ValueType::STRING, std::move(v)); }
  static Value array(ValueType elem, std::vector<Value> items) {
    return Value(ValueType::ARRAY, Array{elem, std::move(items)});
  }
  static Value string_array(const std::vector<std::string>& v);
  static Value i32_array(const std::vector<int32_t>& v);
  static Value f32_array(const std::vector<float>& v);
  static Value bool_array(const std::vector<bool>& v);

  ValueType type() const { return type_; }
  bool is_integer() const;  // any of the 8 integer types
  bool is_float() const { return type_ == ValueType::FLOAT32 || type_ == ValueType::FLOAT64; }
  bool is_number() const { return is_integer() || is_float(); }

  // Accessors; calling one of the wrong kind throws sparsemla::Error.
  uint64_t as_u64() const;  // integers >= 0 and true/false
  int64_t as_i64() const;   // integers that fit in int64
  double as_f64() const;    // any number
  bool as_bool() const;
  const std::string& as_string() const;
  const Array& as_array() const;

  // Short printable form; arrays longer than `max_items` are elided.
  std::string to_string(size_t max_items = 8) const;

  bool operator==(const Value& o) const = default;

 private:
  using Storage = std::variant<uint64_t, int64_t, double, bool, std::string, Array>;
  Value(ValueType t, Storage s) : type_(t), v_(std::move(s)) {}
  ValueType type_ = ValueType::UINT8;
  Storage v_ = uint64_t(0);
  friend bool operator==(const Array& a, const Array& b) { return a.elem == b.elem && a.items == b.items; }
};

}  // namespace sparsemla::gguf
