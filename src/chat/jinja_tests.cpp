// jinja2's builtin tests: `x is defined`, `x is divisibleby 3`, `x is not none`, ...
#include <string_view>

#include "chat/jinja_builtins.h"
#include "chat/jinja_ops.h"
#include "chat/jinja_pystr.h"

namespace sparsemla::chat::jinja {

namespace {

// A test without arguments.
template <bool (*F)(const Value&)>
bool unary(Interpreter&, const Value& v, Args& args) {
  ArgReader("test", args).finish();
  return F(v);
}

// A test comparing with one argument.
template <bool (*F)(const Value&, const Value&)>
bool binary(Interpreter&, const Value& v, Args& args) {
  ArgReader r("test", args);
  const Value other = r.required("other");
  r.finish();
  return F(v, other);
}

bool is_defined(const Value& v) { return !v.is_undefined(); }
bool is_undefined(const Value& v) { return v.is_undefined(); }
bool is_none(const Value& v) { return v.is_none(); }
bool is_boolean(const Value& v) { return v.is_bool(); }
bool is_true(const Value& v) { return v.is_bool() && v.as_bool(); }
bool is_false(const Value& v) { return v.is_bool() && !v.as_bool(); }
bool is_integer(const Value& v) { return v.is_int(); }
bool is_float(const Value& v) { return v.is_float(); }
bool is_number(const Value& v) { return v.is_number(); }
bool is_string(const Value& v) { return v.is_string(); }
bool is_mapping(const Value& v) { return v.is_dict(); }
bool is_lower(const Value& v) { return py::islower(to_str(v)); }
bool is_upper(const Value& v) { return py::isupper(to_str(v)); }
bool is_escaped(const Value&) { return false; }  // nothing is markup without autoescaping

// Anything Python can iterate, the undefined value included.
bool is_iterable(const Value& v) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict() ||
         (v.is_namespace() && v.as_namespace().is_loop());
}

// Python objects with len() and __getitem__: not iterators or dict views, but the undefined value.
bool is_sequence(const Value& v) {
  if (v.is_list()) return v.is_seq(SeqKind::List) || v.is_seq(SeqKind::Tuple);
  return v.is_undefined() || v.is_string() || v.is_dict();
}

// The undefined value and the loop object are callable in jinja2 too.
bool is_callable(const Value& v) {
  return v.is_function() || v.is_undefined() || (v.is_namespace() && v.as_namespace().is_loop());
}

bool modulo_is(const Value& v, const Value& divisor, int64_t expected) {
  return equals(binary_op(BinOp::Mod, v, divisor), Value::integer(expected));
}
bool is_odd(const Value& v) { return modulo_is(v, Value::integer(2), 1); }
bool is_even(const Value& v) { return modulo_is(v, Value::integer(2), 0); }
bool is_divisibleby(const Value& v, const Value& n) { return modulo_is(v, n, 0); }

bool is_eq(const Value& a, const Value& b) { return equals(a, b); }
bool is_ne(const Value& a, const Value& b) { return !equals(a, b); }
bool is_lt(const Value& a, const Value& b) { return compare(CmpOp::Lt, a, b); }
bool is_le(const Value& a, const Value& b) { return compare(CmpOp::Le, a, b); }
bool is_gt(const Value& a, const Value& b) { return compare(CmpOp::Gt, a, b); }
bool is_ge(const Value& a, const Value& b) { return compare(CmpOp::Ge, a, b); }
bool is_in(const Value& a, const Value& b) { return contains(b, a); }
bool is_sameas(const Value& a, const Value& b) { return a.same_object(b); }

bool is_filter_name(const Value& v) {
  return v.is_string() && (find_filter(v.as_string()) != nullptr || is_unimplemented_filter(v.as_string()));
}
bool is_test_name(const Value& v) { return v.is_string() && find_test(v.as_string()) != nullptr; }

struct NamedTest {
  std::string_view name;
  TestFn fn;
};

constexpr NamedTest kTests[] = {
    {"defined", unary<is_defined>},
    {"undefined", unary<is_undefined>},
    {"none", unary<is_none>},
    {"boolean", unary<is_boolean>},
    {"true", unary<is_true>},
    {"false", unary<is_false>},
    {"integer", unary<is_integer>},
    {"float", unary<is_float>},
    {"number", unary<is_number>},
    {"string", unary<is_string>},
    {"mapping", unary<is_mapping>},
    {"iterable", unary<is_iterable>},
    {"sequence", unary<is_sequence>},
    {"callable", unary<is_callable>},
    {"lower", unary<is_lower>},
    {"upper", unary<is_upper>},
    {"escaped", unary<is_escaped>},
    {"odd", unary<is_odd>},
    {"even", unary<is_even>},
    {"filter", unary<is_filter_name>},
    {"test", unary<is_test_name>},
    {"divisibleby", binary<is_divisibleby>},
    {"eq", binary<is_eq>},
    {"equalto", binary<is_eq>},
    {"==", binary<is_eq>},
    {"ne", binary<is_ne>},
    {"!=", binary<is_ne>},
    {"lt", binary<is_lt>},
    {"lessthan", binary<is_lt>},
    {"<", binary<is_lt>},
    {"le", binary<is_le>},
    {"<=", binary<is_le>},
    {"gt", binary<is_gt>},
    {"greaterthan", binary<is_gt>},
    {">", binary<is_gt>},
    {"ge", binary<is_ge>},
    {">=", binary<is_ge>},
    {"in", binary<is_in>},
    {"sameas", binary<is_sameas>},
};

}  // namespace

TestFn find_test(std::string_view name) {
  for (const NamedTest& t : kTests) {
    if (t.name == name) return t.fn;
  }
  return nullptr;
}

}  // namespace sparsemla::chat::jinja
