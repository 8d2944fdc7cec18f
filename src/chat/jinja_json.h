// Python's json.dumps over template values: the output of transformers' tojson filter, which is
// json.dumps(x, ensure_ascii=..., indent=..., separators=..., sort_keys=...).
#pragma once
#include <optional>
#include <string>

#include "chat/jinja_value.h"

namespace sparsemla::chat::jinja {

struct JsonOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // nullopt: all on one line
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};

// Raises TypeError for what json.dumps cannot serialize (undefined, functions, iterators, ...).
std::string json_dumps(const Value& v, const JsonOptions& options);

}  // namespace sparsemla::chat::jinja
