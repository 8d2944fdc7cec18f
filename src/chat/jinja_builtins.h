// jinja2's builtin filters, tests and globals, transformers' additions (tojson, raise_exception,
// strftime_now), and the methods of str, dict and list that the sandbox lets templates call.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chat/jinja_ast.h"
#include "chat/jinja_value.h"

namespace sparsemla::chat::jinja {

FilterFn find_filter(std::string_view name);  // null when there is none
TestFn find_test(std::string_view name);
// A jinja2 filter this interpreter does not implement (every jinja2 test is implemented): errors
// say so rather than "unknown".
bool is_unimplemented_filter(std::string_view name);

// obj.name when obj is a str, dict or list and name is one of its methods: the method bound to obj.
// The ones the immutable sandbox forbids (list.sort, dict.update, ...) come back as an undefined value
// that raises when called, as in jinja2.
std::optional<Value> find_method(const Value& obj, std::string_view name);

// The global functions: jinja2's range (capped as its sandbox caps it), dict, namespace and joiner, and
// transformers' raise_exception and strftime_now.
std::vector<std::pair<std::string, Value>> make_globals();

// Reads a call's arguments against a Python signature: each get() takes the next positional argument
// or else the keyword of that name; finish() rejects what is left.
class ArgReader {
 public:
  ArgReader(std::string_view function, Args& args) : function_(function), args_(args) {}
  std::optional<Value> get(std::string_view name);
  Value get(std::string_view name, Value default_value);
  Value required(std::string_view name);
  void finish();

 private:
  std::string_view function_;
  Args& args_;
  size_t next_ = 0;
  std::vector<bool> used_keywords_;
};

}  // namespace sparsemla::chat::jinja
