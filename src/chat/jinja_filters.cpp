// jinja2's builtin filters, with transformers' tojson in place of jinja2's own.
#include <algorithm>
#include <cfenv>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "chat/jinja_builtins.h"
#include "chat/jinja_json.h"
#include "chat/jinja_ops.h"
#include "chat/jinja_pystr.h"

namespace sparsemla::chat::jinja {

namespace {

Value generator(std::vector<Value> items) { return Value::list(std::move(items), SeqKind::Generator); }

Value ignore_case(Value v) { return v.is_string() ? Value::string(py::lower(v.as_string())) : v; }

// The path of an attribute= argument: "a.b.0" looks up a, then b, then item 0.
std::vector<Value> attribute_path(const Value& attribute) {
  std::vector<Value> parts;
  if (attribute.is_none()) return parts;
  if (!attribute.is_string()) return {attribute};
  for (std::string& p : py::split(attribute.as_string(), std::string("."), -1)) {
    const bool digits = !p.empty() && std::all_of(p.begin(), p.end(), [](char c) { return c >= '0' && c <= '9'; });
    int64_t n = 0;
    if (digits && std::from_chars(p.data(), p.data() + p.size(), n).ec == std::errc()) {
      parts.push_back(Value::integer(n));
    } else {
      parts.push_back(Value::string(std::move(p)));
    }
  }
  return parts;
}

Value follow(Value item, const std::vector<Value>& path, const Value* default_value = nullptr) {
  for (const Value& part : path) {
    item = get_item(item, part);
    if (default_value && item.is_undefined()) item = *default_value;
  }
  return item;
}

Value call_filter_by_name(Interpreter& in, const Value& name, const Value& input, Args args) {
  if (!name.is_string()) raise("a filter name must be a string, not {}", type_name(name));
  const FilterFn fn = find_filter(name.as_string());
  if (fn == nullptr) raise("No filter named '{}'.", name.as_string());
  return fn(in, input, args);
}

bool call_test_by_name(Interpreter& in, const Value& name, const Value& input, Args args) {
  if (!name.is_string()) raise("a test name must be a string, not {}", type_name(name));
  const TestFn fn = find_test(name.as_string());
  if (fn == nullptr) raise("No test named '{}'.", name.as_string());
  return fn(in, input, args);
}

// Python's float() of a string: surrounding whitespace, a sign, inf/nan, digits with single
// underscores between them.
std::optional<double> parse_float(std::string_view text) {
  std::string s = py::strip(text, std::nullopt, true, true);
  std::string lowered = py::lower(s);
  std::string_view body = lowered;
  bool negative = false;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    negative = body[0] == '-';
    body.remove_prefix(1);
  }
  if (body == "inf" || body == "infinity") return negative ? -HUGE_VAL : HUGE_VAL;
  if (body == "nan") return std::nan("");
  std::string clean;
  bool digit_before = false;
  bool seen_digit = false;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    const bool digit = c >= '0' && c <= '9';
    if (c == '_') {
      if (!digit_before || i + 1 >= body.size() || !(body[i + 1] >= '0' && body[i + 1] <= '9')) return std::nullopt;
      digit_before = false;
      continue;
    }
    if (!digit && c != '.' && c != 'e' && c != '+' && c != '-') return std::nullopt;
    seen_digit = seen_digit || digit;
    digit_before = digit;
    clean += c;
  }
  if (!seen_digit) return std::nullopt;
  double v = 0;
  const auto res = std::from_chars(clean.data(), clean.data() + clean.size(), v);
  if (res.ptr != clean.data() + clean.size()) return std::nullopt;
  if (res.ec == std::errc::result_out_of_range) v = std::fabs(std::strtod(clean.c_str(), nullptr));
  return negative ? -v : v;
}

// Python's int(str, base).
std::optional<int64_t> parse_int(std::string_view text, int64_t base) {
  std::string s = py::strip(text, std::nullopt, true, true);
  std::string_view body = s;
  bool negative = false;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    negative = body[0] == '-';
    body.remove_prefix(1);
  }
  const auto prefix = [&](char p) {
    return body.size() >= 2 && body[0] == '0' && (body[1] == p || body[1] == char(p - 32));
  };
  if (base == 0) {
    base = prefix('x') ? 16 : prefix('o') ? 8 : prefix('b') ? 2 : 10;
    if (base == 10 && body.size() > 1 && body[0] == '0' && body.find_first_not_of("0_") != std::string_view::npos) {
      return std::nullopt;  // "010" is not an int literal
    }
  }
  if (base < 2 || base > 36) raise("int() base must be >= 2 and <= 36, or 0");
  if ((base == 16 && prefix('x')) || (base == 8 && prefix('o')) || (base == 2 && prefix('b'))) {
    body.remove_prefix(2);
    if (!body.empty() && body[0] == '_') body.remove_prefix(1);
  }
  if (body.empty()) return std::nullopt;
  __int128 value = 0;
  bool digit_before = false;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c == '_') {
      if (!digit_before || i + 1 >= body.size()) return std::nullopt;
      digit_before = false;
      continue;
    }
    int d = -1;
    if (c >= '0' && c <= '9') d = c - '0';
    if (c >= 'a' && c <= 'z') d = c - 'a' + 10;
    if (c >= 'A' && c <= 'Z') d = c - 'A' + 10;
    if (d < 0 || d >= base) return std::nullopt;
    value = value * base + d;
    if (value > __int128(INT64_MAX) + 1) raise("integer overflow: the value does not fit in 64 bits");
    digit_before = true;
  }
  if (negative) value = -value;
  if (value > INT64_MAX) raise("integer overflow: the value does not fit in 64 bits");
  return int64_t(value);
}

int64_t float_to_int(double d) {
  if (std::isinf(d)) raise("cannot convert float infinity to integer");
  if (d >= 9223372036854775808.0 || d < -9223372036854775808.0) raise("integer overflow: the value does not fit in 64 bits");
  return int64_t(d);
}

// ---- the filters ----

Value f_abs(Interpreter&, const Value& v, Args& args) {
  ArgReader("abs", args).finish();
  if (v.is_integral()) {
    if (v.as_int() == INT64_MIN) raise("integer overflow: the value does not fit in 64 bits");
    return Value::integer(std::llabs(v.as_int()));
  }
  if (v.is_float()) return Value::number(std::fabs(v.as_float()));
  raise("bad operand type for abs(): '{}'", type_name(v));
}

Value f_attr(Interpreter&, const Value& v, Args& args) {
  ArgReader r("attr", args);
  const Value name = r.required("name");
  r.finish();
  if (v.is_undefined()) raise_undefined(v);
  if (name.is_string()) {
    if (auto m = find_method(v, name.as_string())) return *m;
    if (v.is_namespace()) {
      if (auto a = namespace_attribute(v.as_namespace(), name.as_string())) return *a;
    }
  }
  return Value::undefined(py::repr(object_type_repr(v)) + " has no attribute " + to_repr(name));
}

Value f_batch(Interpreter&, const Value& v, Args& args) {
  ArgReader r("batch", args);
  const Value count = r.required("linecount");
  const Value fill = r.get("fill_with", Value::none());
  r.finish();
  if (!count.is_integral() || count.as_int() <= 0) raise("batch() needs a positive line count");
  const auto n = size_t(count.as_int());
  std::vector<Value> batches;
  std::vector<Value> current;
  for (Value& item : iterate(v)) {
    if (current.size() == n) batches.push_back(Value::list(std::exchange(current, {})));
    current.push_back(std::move(item));
  }
  if (!current.empty()) {
    if (!fill.is_none()) current.resize(std::max(current.size(), n), fill);
    batches.push_back(Value::list(std::move(current)));
  }
  return generator(std::move(batches));
}

template <std::string (*F)(std::string_view)>
Value f_text(Interpreter&, const Value& v, Args& args) {
  ArgReader("filter", args).finish();
  return Value::string(F(to_str(v)));
}

Value f_center(Interpreter& in, const Value& v, Args& args) {
  ArgReader r("center", args);
  const Value width = r.get("width", Value::integer(80));
  r.finish();
  Args call{{width}, {}};
  return call_value(in, *find_method(Value::string(to_str(v)), "center"), call);
}

Value f_length(Interpreter&, const Value& v, Args& args) {
  ArgReader("length", args).finish();
  return Value::integer(int64_t(length(v)));
}

Value f_default(Interpreter&, const Value& v, Args& args) {
  ArgReader r("default", args);
  const Value fallback = r.get("default_value", Value::string(""));
  const bool boolean = truthy(r.get("boolean", Value::boolean(false)));
  r.finish();
  return v.is_undefined() || (boolean && !truthy(v)) ? fallback : v;
}

Value f_dictsort(Interpreter&, const Value& v, Args& args) {
  ArgReader r("dictsort", args);
  const bool case_sensitive = truthy(r.get("case_sensitive", Value::boolean(false)));
  const Value by = r.get("by", Value::string("key"));
  const bool reverse = truthy(r.get("reverse", Value::boolean(false)));
  r.finish();
  size_t pos = 0;
  if (by.is_string() && by.as_string() == "value") {
    pos = 1;
  } else if (!by.is_string() || by.as_string() != "key") {
    raise("You can only sort by either \"key\" or \"value\"");
  }
  if (v.is_undefined()) raise_undefined(v);
  if (!v.is_dict()) raise("'{}' object has no attribute 'items'", type_name(v));
  std::vector<Value> items;
  std::vector<Value> keys;
  for (const auto& kv : v.as_dict().items) {
    const Value& k = pos == 0 ? kv.first : kv.second;
    keys.push_back(case_sensitive ? k : ignore_case(k));
    items.push_back(Value::list({kv.first, kv.second}, SeqKind::Tuple));
  }
  std::vector<size_t> idx(items.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    return reverse ? compare(CmpOp::Lt, keys[b], keys[a]) : compare(CmpOp::Lt, keys[a], keys[b]);
  });
  std::vector<Value> out;
  for (size_t i : idx) out.push_back(items[i]);
  return Value::list(std::move(out));
}

Value f_escape(Interpreter&, const Value& v, Args& args) {
  ArgReader("escape", args).finish();
  std::string out;
  for (char c : to_str(v)) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return Value::string(std::move(out));
}

Value f_first(Interpreter&, const Value& v, Args& args) {
  ArgReader("first", args).finish();
  std::vector<Value> items = iterate(v);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}

Value f_last(Interpreter&, const Value& v, Args& args) {
  ArgReader("last", args).finish();
  if (v.is_seq(SeqKind::Generator) || !(v.is_undefined() || v.is_string() || v.is_list() || v.is_dict())) {
    raise("'{}' object is not reversible", type_name(v));
  }
  std::vector<Value> items = iterate(v);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}

Value f_float(Interpreter&, const Value& v, Args& args) {
  ArgReader r("float", args);
  const Value fallback = r.get("default", Value::number(0.0));
  r.finish();
  if (v.is_undefined()) raise_undefined(v);
  if (v.is_number()) return Value::number(v.as_float());
  if (v.is_string()) {
    if (auto d = parse_float(v.as_string())) return Value::number(*d);
  }
  return fallback;
}

Value f_int(Interpreter&, const Value& v, Args& args) {
  ArgReader r("int", args);
  const Value fallback = r.get("default", Value::integer(0));
  const Value base = r.get("base", Value::integer(10));
  r.finish();
  if (v.is_undefined()) raise_undefined(v);
  if (v.is_integral()) return Value::integer(v.as_int());
  if (v.is_float()) return std::isnan(v.as_float()) ? fallback : Value::integer(float_to_int(v.as_float()));
  if (v.is_string()) {
    if (!base.is_integral()) raise("'{}' object cannot be interpreted as an integer", type_name(base));
    if (auto n = parse_int(v.as_string(), base.as_int())) return Value::integer(*n);
    // jinja2 retries through float() so that "42.23"|int gives 42
    if (auto d = parse_float(v.as_string())) return std::isnan(*d) ? fallback : Value::integer(float_to_int(*d));
  }
  return fallback;
}

Value f_format(Interpreter&, const Value& v, Args& args) {
  if (!args.positional.empty() && !args.keywords.empty()) {
    raise("can't handle positional and keyword arguments at the same time");
  }
  Value values;
  if (!args.keywords.empty()) {
    Dict d;
    for (auto& [k, val] : args.keywords) d.set(Value::string(k), val);
    values = Value::dict(std::move(d));
  } else {
    values = Value::list(args.positional, SeqKind::Tuple);
  }
  return Value::string(percent_format(to_str(v), values));
}

Value f_indent(Interpreter&, const Value& v, Args& args) {
  ArgReader r("indent", args);
  const Value width = r.get("width", Value::integer(4));
  const bool first = truthy(r.get("first", Value::boolean(false)));
  const bool blank = truthy(r.get("blank", Value::boolean(false)));
  r.finish();
  std::string indention;
  if (width.is_string()) {
    indention = width.as_string();
  } else if (width.is_integral()) {
    indention = std::string(size_t(std::clamp<int64_t>(width.as_int(), 0, 4096)), ' ');
  } else {
    raise("can't multiply sequence by non-int of type '{}'", type_name(width));
  }
  const std::vector<std::string> lines = py::splitlines(to_str(v) + "\n", false);
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) {
      out += "\n";
      if (blank || !lines[i].empty()) out += indention;
    }
    out += lines[i];
    check_size(out);
  }
  if (first) out = indention + out;
  return Value::string(std::move(out));
}

Value f_items(Interpreter&, const Value& v, Args& args) {
  ArgReader("items", args).finish();
  if (v.is_undefined()) return generator({});
  if (!v.is_dict()) raise("Can only get item pairs from a mapping.");
  std::vector<Value> items;
  for (const auto& kv : v.as_dict().items) items.push_back(Value::list({kv.first, kv.second}, SeqKind::Tuple));
  return generator(std::move(items));
}

Value f_join(Interpreter&, const Value& v, Args& args) {
  ArgReader r("join", args);
  const std::string sep = to_str(r.get("d", Value::string("")));
  const Value attribute = r.get("attribute", Value::none());
  r.finish();
  const std::vector<Value> path = attribute_path(attribute);
  std::string out;
  bool first = true;
  for (const Value& item : iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += to_str(follow(item, path));
    check_size(out);
  }
  return Value::string(std::move(out));
}

Value f_list(Interpreter&, const Value& v, Args& args) {
  ArgReader("list", args).finish();
  return Value::list(iterate(v));
}

Value f_map(Interpreter& in, const Value& v, Args& args) {
  if (!truthy(v)) return generator({});
  std::vector<Value> out;
  const auto attribute = std::find_if(args.keywords.begin(), args.keywords.end(), [](const auto& kv) { return kv.first == "attribute"; });
  if (args.positional.empty() && attribute != args.keywords.end()) {
    std::optional<Value> fallback;
    for (const auto& [k, val] : args.keywords) {
      if (k == "default") {
        fallback = val;
      } else if (k != "attribute") {
        raise("Unexpected keyword argument '{}'", k);
      }
    }
    if (fallback && fallback->is_none()) fallback.reset();
    const std::vector<Value> path = attribute_path(attribute->second);
    for (const Value& item : iterate(v)) out.push_back(follow(item, path, fallback ? &*fallback : nullptr));
    return generator(std::move(out));
  }
  if (args.positional.empty()) raise("map requires a filter argument");
  const Value name = args.positional[0];
  Args rest{{args.positional.begin() + 1, args.positional.end()}, args.keywords};
  for (const Value& item : iterate(v)) out.push_back(call_filter_by_name(in, name, item, rest));
  return generator(std::move(out));
}

template <bool Max>
Value f_extreme(Interpreter&, const Value& v, Args& args) {
  ArgReader r(Max ? "max" : "min", args);
  const bool case_sensitive = truthy(r.get("case_sensitive", Value::boolean(false)));
  const std::vector<Value> path = attribute_path(r.get("attribute", Value::none()));
  r.finish();
  const std::vector<Value> items = iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  const auto key = [&](const Value& item) {
    Value k = follow(item, path);
    return case_sensitive ? k : ignore_case(std::move(k));
  };
  size_t best = 0;
  Value best_key = key(items[0]);
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = key(items[i]);
    if (compare(Max ? CmpOp::Gt : CmpOp::Lt, k, best_key)) {
      best = i;
      best_key = std::move(k);
    }
  }
  return items[best];
}

// select, reject, selectattr, rejectattr.
template <bool Reject, bool ByAttribute>
Value f_select(Interpreter& in, const Value& v, Args& args) {
  if (!truthy(v)) return generator({});
  size_t off = 0;
  std::vector<Value> path;
  if (ByAttribute) {
    if (args.positional.empty()) raise("Missing parameter for attribute name");
    path = attribute_path(args.positional[0]);
    off = 1;
  }
  std::optional<Value> test;
  Args test_args;
  if (args.positional.size() > off) {
    test = args.positional[off];
    test_args.positional.assign(args.positional.begin() + std::ptrdiff_t(off) + 1, args.positional.end());
    test_args.keywords = args.keywords;
  }
  std::vector<Value> out;
  for (const Value& item : iterate(v)) {
    const Value subject = ByAttribute ? follow(item, path) : item;
    const bool ok = test ? call_test_by_name(in, *test, subject, test_args) : truthy(subject);
    if (ok != Reject) out.push_back(item);
  }
  return generator(std::move(out));
}

Value f_replace(Interpreter&, const Value& v, Args& args) {
  ArgReader r("replace", args);
  const std::string old = to_str(r.required("old"));
  const std::string repl = to_str(r.required("new"));
  const Value count = r.get("count", Value::none());
  r.finish();
  if (!count.is_none() && !count.is_integral()) raise("'{}' object cannot be interpreted as an integer", type_name(count));
  std::string out = py::replace(to_str(v), old, repl, count.is_none() ? -1 : count.as_int());
  check_size(out);
  return Value::string(std::move(out));
}

Value f_reverse(Interpreter&, const Value& v, Args& args) {
  ArgReader("reverse", args).finish();
  if (v.is_string()) {
    std::u32string cps = py::decode(v.as_string());
    std::reverse(cps.begin(), cps.end());
    return Value::string(py::encode(cps));
  }
  if (!(v.is_undefined() || v.is_list() || v.is_dict())) raise("argument must be iterable");
  std::vector<Value> items = iterate(v);
  std::reverse(items.begin(), items.end());
  // reversed() gives an iterator; a generator, not being reversible, becomes a reversed list.
  return v.is_seq(SeqKind::Generator) ? Value::list(std::move(items)) : generator(std::move(items));
}

// Python's round(): correctly rounded, ties to even.
Value round_value(const Value& v, int64_t digits) {
  if (v.is_integral()) {
    if (digits >= 0) return Value::integer(v.as_int());
    if (digits < -18) return Value::integer(0);
    int64_t scale = 1;
    for (int64_t i = 0; i < -digits; ++i) scale *= 10;
    const int64_t n = v.as_int();
    int64_t q = n / scale;
    int64_t rem = n % scale;
    if (rem < 0) rem += scale, --q;
    if (2 * rem > scale || (2 * rem == scale && q % 2 != 0)) ++q;
    return Value::integer(q * scale);
  }
  if (!v.is_float()) raise("type {} doesn't define __round__ method", type_name(v));
  const double x = v.as_float();
  if (!std::isfinite(x) || digits > 330) return v;
  if (digits >= 0) {
    std::vector<char> buf(size_t(digits) + 330);
    std::snprintf(buf.data(), buf.size(), "%.*f", int(digits), x);
    return Value::number(std::strtod(buf.data(), nullptr));
  }
  const double scale = std::pow(10.0, double(-digits));
  const int saved = std::fegetround();
  std::fesetround(FE_TONEAREST);
  const double r = std::nearbyint(x / scale) * scale;
  std::fesetround(saved);
  return Value::number(r);
}

Value f_round(Interpreter&, const Value& v, Args& args) {
  ArgReader r("round", args);
  const Value precision = r.get("precision", Value::integer(0));
  const Value method = r.get("method", Value::string("common"));
  r.finish();
  const std::string m = method.is_string() ? method.as_string() : "";
  if (m != "common" && m != "ceil" && m != "floor") raise("method must be common, ceil or floor");
  if (!precision.is_integral()) raise("'{}' object cannot be interpreted as an integer", type_name(precision));
  if (v.is_undefined()) raise_undefined(v);
  if (m == "common") return round_value(v, precision.as_int());
  if (!v.is_number()) raise("unsupported operand type(s) for *: '{}' and 'int'", type_name(v));
  const double scale = std::pow(10.0, double(precision.as_int()));
  const double scaled = v.as_float() * scale;
  return Value::number((m == "ceil" ? std::ceil(scaled) : std::floor(scaled)) / scale);
}

Value f_sort(Interpreter&, const Value& v, Args& args) {
  ArgReader r("sort", args);
  const bool reverse = truthy(r.get("reverse", Value::boolean(false)));
  const bool case_sensitive = truthy(r.get("case_sensitive", Value::boolean(false)));
  const Value attribute = r.get("attribute", Value::none());
  r.finish();
  // Sort keys as jinja2 builds them: a list of the attribute values ("age,name" gives two).
  std::vector<std::vector<Value>> paths;
  if (attribute.is_string()) {
    for (const std::string& part : py::split(attribute.as_string(), std::string(","), -1)) {
      paths.push_back(attribute_path(Value::string(part)));
    }
  } else {
    paths.push_back(attribute_path(attribute));
  }
  std::vector<Value> items = iterate(v);
  std::vector<Value> keys;
  for (const Value& item : items) {
    std::vector<Value> key;
    for (const auto& path : paths) {
      Value k = follow(item, path);
      key.push_back(case_sensitive ? k : ignore_case(std::move(k)));
    }
    keys.push_back(Value::list(std::move(key)));
  }
  std::vector<size_t> idx(items.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    return reverse ? compare(CmpOp::Lt, keys[b], keys[a]) : compare(CmpOp::Lt, keys[a], keys[b]);
  });
  std::vector<Value> out;
  for (size_t i : idx) out.push_back(items[i]);
  return Value::list(std::move(out));
}

Value f_string(Interpreter&, const Value& v, Args& args) {
  ArgReader("string", args).finish();
  return Value::string(to_str(v));
}

Value f_sum(Interpreter&, const Value& v, Args& args) {
  ArgReader r("sum", args);
  const std::vector<Value> path = attribute_path(r.get("attribute", Value::none()));
  Value total = r.get("start", Value::integer(0));
  r.finish();
  for (const Value& item : iterate(v)) total = binary_op(BinOp::Add, total, follow(item, path));
  return total;
}

// jinja2's title filter (not str.title): each word starts after -, whitespace, or an opening bracket.
std::string jinja_title(std::string_view s) {
  std::string out;
  bool word_start = true;
  for (size_t i = 0; i < s.size();) {
    const size_t b = i;
    const char32_t c = py::next_code_point(s, i);
    const std::string_view ch = s.substr(b, i - b);
    if (c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py::is_space(c)) {
      out += ch;
      word_start = true;
    } else {
      out += word_start ? py::upper(ch) : py::lower(ch);
      word_start = false;
    }
  }
  return out;
}

// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
Value f_tojson(Interpreter&, const Value& v, Args& args) {
  ArgReader r("tojson", args);
  JsonOptions o;
  o.ensure_ascii = truthy(r.get("ensure_ascii", Value::boolean(false)));
  const Value indent = r.get("indent", Value::none());
  const Value separators = r.get("separators", Value::none());
  o.sort_keys = truthy(r.get("sort_keys", Value::boolean(false)));
  r.finish();
  if (indent.is_string()) {
    o.indent = indent.as_string();
  } else if (indent.is_integral()) {
    o.indent = std::string(size_t(std::clamp<int64_t>(indent.as_int(), 0, 4096)), ' ');
  } else if (!indent.is_none()) {
    raise("can't multiply sequence by non-int of type '{}'", type_name(indent));
  }
  if (separators.is_none()) {
    o.item_separator = o.indent ? "," : ", ";
  } else {
    const std::vector<Value> parts = iterate(separators);
    if (parts.size() != 2 || !parts[0].is_string() || !parts[1].is_string()) {
      raise("separators must be a pair of strings (item_separator, key_separator)");
    }
    o.item_separator = parts[0].as_string();
    o.key_separator = parts[1].as_string();
  }
  std::string out = json_dumps(v, o);
  check_size(out);
  return Value::string(std::move(out));
}

Value f_trim(Interpreter&, const Value& v, Args& args) {
  ArgReader r("trim", args);
  const Value chars = r.get("chars", Value::none());
  r.finish();
  return Value::string(py::strip(to_str(v), chars.is_none() ? std::nullopt : std::optional(to_str(chars)), true, true));
}

Value f_unique(Interpreter&, const Value& v, Args& args) {
  ArgReader r("unique", args);
  const bool case_sensitive = truthy(r.get("case_sensitive", Value::boolean(false)));
  const std::vector<Value> path = attribute_path(r.get("attribute", Value::none()));
  r.finish();
  std::vector<Value> out;
  Dict seen;  // a dict for its Python key semantics (and unhashable-key errors)
  for (const Value& item : iterate(v)) {
    Value key = follow(item, path);
    if (!case_sensitive) key = ignore_case(std::move(key));
    if (seen.find(key) != nullptr) continue;
    seen.set(std::move(key), Value::none());
    out.push_back(item);
  }
  return generator(std::move(out));
}

Value f_wordcount(Interpreter&, const Value& v, Args& args) {
  ArgReader("wordcount", args).finish();
  const std::string s = to_str(v);
  int64_t words = 0;
  bool in_word = false;
  for (size_t i = 0; i < s.size();) {
    const bool w = py::is_word(py::next_code_point(s, i));
    if (w && !in_word) ++words;
    in_word = w;
  }
  return Value::integer(words);
}

struct NamedFilter {
  std::string_view name;
  FilterFn fn;
};

constexpr NamedFilter kFilters[] = {
    {"abs", f_abs},
    {"attr", f_attr},
    {"batch", f_batch},
    {"capitalize", f_text<py::capitalize>},
    {"center", f_center},
    {"count", f_length},
    {"d", f_default},
    {"default", f_default},
    {"dictsort", f_dictsort},
    {"e", f_escape},
    {"escape", f_escape},
    {"first", f_first},
    {"float", f_float},
    {"forceescape", f_escape},
    {"format", f_format},
    {"indent", f_indent},
    {"int", f_int},
    {"items", f_items},
    {"join", f_join},
    {"last", f_last},
    {"length", f_length},
    {"list", f_list},
    {"lower", f_text<py::lower>},
    {"map", f_map},
    {"max", f_extreme<true>},
    {"min", f_extreme<false>},
    {"reject", f_select<true, false>},
    {"rejectattr", f_select<true, true>},
    {"replace", f_replace},
    {"reverse", f_reverse},
    {"round", f_round},
    {"safe", f_string},
    {"select", f_select<false, false>},
    {"selectattr", f_select<false, true>},
    {"sort", f_sort},
    {"string", f_string},
    {"sum", f_sum},
    {"title", f_text<jinja_title>},
    {"tojson", f_tojson},
    {"trim", f_trim},
    {"unique", f_unique},
    {"upper", f_text<py::upper>},
    {"wordcount", f_wordcount},
};

constexpr std::string_view kUnimplementedFilters[] = {
    "filesizeformat", "groupby", "pprint", "random", "slice", "striptags",
    "truncate",       "urlencode", "urlize", "wordwrap", "xmlattr",
};

}  // namespace

FilterFn find_filter(std::string_view name) {
  for (const NamedFilter& f : kFilters) {
    if (f.name == name) return f.fn;
  }
  return nullptr;
}

bool is_unimplemented_filter(std::string_view name) {
  return std::find(std::begin(kUnimplementedFilters), std::end(kUnimplementedFilters), name) !=
         std::end(kUnimplementedFilters);
}

}  // namespace sparsemla::chat::jinja
