// Typed reads of optional request fields: absent or null gives nothing, a value of the wrong type
// or out of range is a 400 that names the field.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace sparsemla::server {

using Json = nlohmann::ordered_json;

// JSON's name for the type of `v`, for messages: "string", "number", ...
const char* json_type(const Json& v);

std::optional<bool> get_bool(const Json& obj, const char* key);
std::optional<std::string> get_string(const Json& obj, const char* key);
// A number in [lo, hi].
std::optional<double> get_number(const Json& obj, const char* key, double lo, double hi);
// An integer in [lo, hi] (a float with an integral value counts, as in Python).
std::optional<int64_t> get_int(const Json& obj, const char* key, int64_t lo, int64_t hi);
// An object or an array (nothing when absent or null).
const Json* get_object(const Json& obj, const char* key);
const Json* get_array(const Json& obj, const char* key);

}  // namespace sparsemla::server
