// Python's operators on template values, and attribute and item access the way jinja2's sandbox
// does them (obj.x tries the attribute then the item, obj[x] the item then the attribute; a miss is
// an undefined value, not an error).
#pragma once
#include <string>
#include <string_view>

#include "chat/jinja_ast.h"
#include "chat/jinja_value.h"

namespace sparsemla::chat::jinja {

Value binary_op(BinOp op, const Value& a, const Value& b);
Value negate(const Value& v);    // -v
Value unary_plus(const Value& v);  // +v
bool contains(const Value& container, const Value& item);  // item in container

Value get_attr(const Value& obj, std::string_view name);  // obj.name
Value get_item(const Value& obj, const Value& key);       // obj[key]
// obj[start:stop:step]; an absent part is passed as None.
Value get_slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

Value call_value(Interpreter& in, const Value& callee, Args& args);

// printf-style formatting: fmt % args, as Python's str.__mod__ (the format filter uses it too).
std::string percent_format(const std::string& fmt, const Value& args);

// Raises unless s is within kMaxStringBytes.
void check_size(const std::string& s);

}  // namespace sparsemla::chat::jinja
