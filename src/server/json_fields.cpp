#include "server/json_fields.h"

#include <cmath>

#include "server/api_error.h"

namespace sparsemla::server {

const char* json_type(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "boolean";
    case Json::value_t::string: return "string";
    case Json::value_t::array: return "array";
    case Json::value_t::object: return "object";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "integer";
    case Json::value_t::number_float: return "number";
    default: return "unknown";
  }
}

namespace {

const Json* field(const Json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

}  // namespace

std::optional<bool> get_bool(const Json& obj, const char* key) {
  const Json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) invalid(key, "'{}' must be a boolean, got {}", key, json_type(*v));
  return v->get<bool>();
}

std::optional<std::string> get_string(const Json& obj, const char* key) {
  const Json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) invalid(key, "'{}' must be a string, got {}", key, json_type(*v));
  return v->get<std::string>();
}

std::optional<double> get_number(const Json& obj, const char* key, double lo, double hi) {
  const Json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) invalid(key, "'{}' must be a number, got {}", key, json_type(*v));
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi)) {
    if (std::isinf(hi)) invalid(key, "'{}' must be at least {}, got {}", key, lo, x);
    invalid(key, "'{}' must be between {} and {}, got {}", key, lo, hi, x);
  }
  return x;
}

std::optional<int64_t> get_int(const Json& obj, const char* key, int64_t lo, int64_t hi) {
  const Json* v = field(obj, key);
  if (!v) return std::nullopt;
  int64_t x = 0;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    x = u > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(u);
  } else if (v->is_number_integer()) {
    x = v->get<int64_t>();
  } else if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() &&
             std::fabs(v->get<double>()) < 9.2e18) {
    x = int64_t(v->get<double>());
  } else {
    invalid(key, "'{}' must be an integer, got {}", key, v->is_number() ? "a fraction" : json_type(*v));
  }
  if (x < lo || x > hi) invalid(key, "'{}' must be between {} and {}, got {}", key, lo, hi, x);
  return x;
}

const Json* get_object(const Json& obj, const char* key) {
  const Json* v = field(obj, key);
  if (v && !v->is_object()) invalid(key, "'{}' must be an object, got {}", key, json_type(*v));
  return v;
}

const Json* get_array(const Json& obj, const char* key) {
  const Json* v = field(obj, key);
  if (v && !v->is_array()) invalid(key, "'{}' must be an array, got {}", key, json_type(*v));
  return v;
}

}  // namespace sparsemla::server
