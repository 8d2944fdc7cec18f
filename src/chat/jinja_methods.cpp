// Methods of str, dict and list that templates call ("x".startswith(...), d.items(), ...), with
// Python's semantics, and str.format as jinja2's sandboxed formatter runs it.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>

#include "chat/jinja_builtins.h"
#include "chat/jinja_ops.h"
#include "chat/jinja_pystr.h"

namespace sparsemla::chat::jinja {

namespace {

using Method = Value (*)(const Value& self, Args& args);

Value bind_method(const Value& self, std::string_view qualified_name, Method m) {
  return Value::function(std::string(qualified_name), [self, m](Interpreter&, Args& args) { return m(self, args); });
}

// The immutable sandbox refuses methods that modify a list or dict: the attribute reads as an
// undefined value that raises when used.
Value unsafe(const Value& self, std::string_view name) {
  return Value::undefined(fmt::format("access to attribute '{}' of '{}' object is unsafe.", name, type_name(self)));
}

std::optional<std::string> optional_str(const Value& v, std::string_view what) {
  if (v.is_none()) return std::nullopt;
  if (!v.is_string()) raise("{} arg must be None or str, not {}", what, type_name(v));
  return v.as_string();
}

const std::string& str_arg(const Value& v, std::string_view what) {
  if (!v.is_string()) raise("{}: must be str, not {}", what, type_name(v));
  return v.as_string();
}

int64_t int_arg(const Value& v, std::string_view what) {
  if (!v.is_integral()) raise("{}: '{}' object cannot be interpreted as an integer", what, type_name(v));
  return v.as_int();
}

std::optional<int64_t> optional_int(const std::optional<Value>& v, std::string_view what) {
  if (!v || v->is_none()) return std::nullopt;
  return int_arg(*v, what);
}

// s[start:end] in code points, for the methods that take optional start and end.
std::string window(const std::string& s, const std::optional<Value>& start, const std::optional<Value>& end) {
  if (!start && !end) return s;
  const Value none = Value::none();
  return get_slice(Value::string(s), start.value_or(none), end.value_or(none), none).as_string();
}

Value strings_to_list(std::vector<std::string> parts) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (auto& p : parts) items.push_back(Value::string(std::move(p)));
  return Value::list(std::move(items));
}

template <std::string (*F)(std::string_view)>
Value str_transform(const Value& self, Args& args) {
  ArgReader("str method", args).finish();
  return Value::string(F(self.as_string()));
}

template <bool Left, bool Right>
Value str_strip(const Value& self, Args& args) {
  ArgReader r("strip", args);
  const auto chars = optional_str(r.get("chars", Value::none()), "strip");
  r.finish();
  return Value::string(py::strip(self.as_string(), chars, Left, Right));
}

template <bool Reverse>
Value str_split(const Value& self, Args& args) {
  ArgReader r("split", args);
  const auto sep = optional_str(r.get("sep", Value::none()), "split");
  const int64_t maxsplit = int_arg(r.get("maxsplit", Value::integer(-1)), "split");
  r.finish();
  if (sep && sep->empty()) raise("empty separator");
  const std::string& s = self.as_string();
  return strings_to_list(Reverse ? py::rsplit(s, sep, maxsplit) : py::split(s, sep, maxsplit));
}

Value str_splitlines(const Value& self, Args& args) {
  ArgReader r("splitlines", args);
  const bool keepends = truthy(r.get("keepends", Value::boolean(false)));
  r.finish();
  return strings_to_list(py::splitlines(self.as_string(), keepends));
}

template <bool End>
Value str_affix(const Value& self, Args& args) {
  ArgReader r(End ? "endswith" : "startswith", args);
  const Value affix = r.required("prefix");
  const auto start = r.get("start");
  const auto end = r.get("end");
  r.finish();
  const std::string s = window(self.as_string(), start, end);
  std::vector<Value> options = affix.is_seq(SeqKind::Tuple) ? affix.as_list().items : std::vector<Value>{affix};
  for (const Value& o : options) {
    if (!o.is_string()) raise("{} first arg must be str or a tuple of str, not {}", End ? "endswith" : "startswith", type_name(o));
    const std::string& a = o.as_string();
    if (a.size() <= s.size() && (End ? s.compare(s.size() - a.size(), a.size(), a) : s.compare(0, a.size(), a)) == 0) {
      return Value::boolean(true);
    }
  }
  return Value::boolean(false);
}

template <bool Reverse, bool MustFind>
Value str_find(const Value& self, Args& args) {
  ArgReader r("find", args);
  const std::string sub = str_arg(r.required("sub"), "find");
  const auto start = optional_int(r.get("start"), "find");
  const auto end = optional_int(r.get("end"), "find");
  r.finish();
  const int64_t at = py::find(self.as_string(), sub, start, end, Reverse);
  if (MustFind && at < 0) raise("substring not found");
  return Value::integer(at);
}

Value str_count(const Value& self, Args& args) {
  ArgReader r("count", args);
  const std::string sub = str_arg(r.required("sub"), "count");
  const auto start = r.get("start");
  const auto end = r.get("end");
  r.finish();
  return Value::integer(int64_t(py::count(window(self.as_string(), start, end), sub)));
}

Value str_replace(const Value& self, Args& args) {
  ArgReader r("replace", args);
  const std::string old = str_arg(r.required("old"), "replace");
  const std::string repl = str_arg(r.required("new"), "replace");
  const int64_t count = int_arg(r.get("count", Value::integer(-1)), "replace");
  r.finish();
  std::string out = py::replace(self.as_string(), old, repl, count);
  check_size(out);
  return Value::string(std::move(out));
}

Value str_join(const Value& self, Args& args) {
  ArgReader r("join", args);
  const Value iterable = r.required("iterable");
  r.finish();
  std::string out;
  const std::vector<Value> items = iterate(iterable);
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].is_string()) raise("sequence item {}: expected str instance, {} found", i, type_name(items[i]));
    if (i) out += self.as_string();
    out += items[i].as_string();
    check_size(out);
  }
  return Value::string(std::move(out));
}

// center, ljust, rjust: pad to `width` code points with `fillchar`.
template <char Align>
Value str_justify(const Value& self, Args& args) {
  ArgReader r("justify", args);
  const int64_t width = int_arg(r.required("width"), "justify");
  const std::string fill = str_arg(r.get("fillchar", Value::string(" ")), "justify");
  r.finish();
  if (py::length(fill) != 1) raise("The fill character must be exactly one character long");
  const std::string& s = self.as_string();
  const auto len = int64_t(py::length(s));
  if (width <= len) return self;
  if (width > int64_t(kMaxStringBytes)) raise("string result is larger than {} bytes", kMaxStringBytes);
  const int64_t margin = width - len;
  // Python's str.center puts the odd space on the left only when both margin and width are odd.
  const int64_t left = Align == '<' ? 0 : Align == '>' ? margin : margin / 2 + (margin & width & 1);
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += s;
  for (int64_t i = 0; i < margin - left; ++i) out += fill;
  return Value::string(std::move(out));
}

Value str_zfill(const Value& self, Args& args) {
  ArgReader r("zfill", args);
  const int64_t width = int_arg(r.required("width"), "zfill");
  r.finish();
  const std::string& s = self.as_string();
  const auto len = int64_t(py::length(s));
  if (width <= len) return self;
  if (width > int64_t(kMaxStringBytes)) raise("string result is larger than {} bytes", kMaxStringBytes);
  const size_t sign = !s.empty() && (s[0] == '+' || s[0] == '-') ? 1 : 0;
  return Value::string(s.substr(0, sign) + std::string(size_t(width - len), '0') + s.substr(sign));
}

template <bool Reverse>
Value str_partition(const Value& self, Args& args) {
  ArgReader r("partition", args);
  const std::string sep = str_arg(r.required("sep"), "partition");
  r.finish();
  if (sep.empty()) raise("empty separator");
  const std::string& s = self.as_string();
  const size_t k = Reverse ? s.rfind(sep) : s.find(sep);
  std::vector<Value> parts;
  if (k == std::string::npos) {
    parts = Reverse ? std::vector<Value>{Value::string(""), Value::string(""), self}
                    : std::vector<Value>{self, Value::string(""), Value::string("")};
  } else {
    parts = {Value::string(s.substr(0, k)), Value::string(sep), Value::string(s.substr(k + sep.size()))};
  }
  return Value::list(std::move(parts), SeqKind::Tuple);
}

template <bool Suffix>
Value str_remove_affix(const Value& self, Args& args) {
  ArgReader r(Suffix ? "removesuffix" : "removeprefix", args);
  const std::string a = str_arg(r.required("affix"), "removeprefix");
  r.finish();
  const std::string& s = self.as_string();
  if (a.empty() || a.size() > s.size()) return self;
  if (Suffix) return s.compare(s.size() - a.size(), a.size(), a) == 0 ? Value::string(s.substr(0, s.size() - a.size())) : self;
  return s.compare(0, a.size(), a) == 0 ? Value::string(s.substr(a.size())) : self;
}

// isalpha, isdigit, ...: true for a non-empty string whose code points all pass.
template <bool (*F)(char32_t)>
Value str_all(const Value& self, Args& args) {
  ArgReader("str method", args).finish();
  const std::string& s = self.as_string();
  if (s.empty()) return Value::boolean(false);
  for (size_t i = 0; i < s.size();) {
    if (!F(py::next_code_point(s, i))) return Value::boolean(false);
  }
  return Value::boolean(true);
}

bool is_alnum(char32_t c) { return py::is_alpha(c) || py::is_digit(c); }

template <bool (*F)(std::string_view)>
Value str_predicate(const Value& self, Args& args) {
  ArgReader("str method", args).finish();
  return Value::boolean(F(self.as_string()));
}

// ---- str.format ----

struct FormatSpec {
  std::string fill = " ";
  char align = 0;
  char sign = '-';
  bool alternate = false;
  size_t width = 0;
  char grouping = 0;
  std::optional<size_t> precision;
  char type = 0;
};

FormatSpec parse_spec(const std::string& spec) {
  FormatSpec f;
  size_t i = 0;
  const auto is_align = [](char c) { return c == '<' || c == '>' || c == '=' || c == '^'; };
  size_t after_first = 0;
  if (!spec.empty()) py::next_code_point(spec, after_first);
  if (after_first < spec.size() && is_align(spec[after_first])) {
    f.fill = spec.substr(0, after_first);
    f.align = spec[after_first];
    i = after_first + 1;
  } else if (!spec.empty() && is_align(spec[0])) {
    f.align = spec[0];
    i = 1;
  }
  if (i < spec.size() && (spec[i] == '+' || spec[i] == '-' || spec[i] == ' ')) f.sign = spec[i++];
  if (i < spec.size() && spec[i] == '#') f.alternate = true, ++i;
  if (i < spec.size() && spec[i] == '0') {
    if (f.align == 0) f.fill = "0", f.align = '=';
    ++i;
  }
  for (; i < spec.size() && std::isdigit(static_cast<unsigned char>(spec[i])); ++i) {
    f.width = std::min<size_t>(f.width * 10 + size_t(spec[i] - '0'), kMaxStringBytes);
  }
  if (i < spec.size() && (spec[i] == ',' || spec[i] == '_')) f.grouping = spec[i++];
  if (i < spec.size() && spec[i] == '.') {
    size_t p = 0;
    const size_t digits_start = ++i;
    for (; i < spec.size() && std::isdigit(static_cast<unsigned char>(spec[i])); ++i) p = std::min<size_t>(p * 10 + size_t(spec[i] - '0'), 1000);
    if (i == digits_start) raise("Format specifier missing precision");
    f.precision = p;
  }
  if (i < spec.size()) f.type = spec[i++];
  if (i < spec.size()) raise("Invalid format specifier '{}'", spec);
  return f;
}

std::string group_digits(std::string digits, char sep) {
  // Group the integer part of a number's text (digits only, no sign) in threes from the right.
  const size_t dot = digits.find_first_not_of("0123456789");
  const std::string head = digits.substr(0, dot);
  const std::string tail = dot == std::string::npos ? "" : digits.substr(dot);
  std::string out;
  for (size_t i = 0; i < head.size(); ++i) {
    if (i > 0 && (head.size() - i) % 3 == 0) out += sep;
    out += head[i];
  }
  return out + tail;
}

std::string apply_width(const std::string& sign, const std::string& body, const FormatSpec& f, char default_align) {
  const size_t len = py::length(sign) + py::length(body);
  const char align = f.align ? f.align : default_align;
  if (len >= f.width) return sign + body;
  const size_t margin = f.width - len;
  const auto fill = [&](size_t n) {
    std::string s;
    for (size_t k = 0; k < n; ++k) s += f.fill;
    return s;
  };
  switch (align) {
    case '<':
      return sign + body + fill(margin);
    case '^':
      return fill(margin / 2) + sign + body + fill(margin - margin / 2);
    case '=':
      return sign + fill(margin) + body;
    default:
      return fill(margin) + sign + body;
  }
}

std::string format_number(const Value& v, const FormatSpec& f) {
  const char type = f.type;
  const bool integral = v.is_integral() && std::string_view("bcdoxXn").find(type) != std::string_view::npos;
  if (v.is_integral() && (type == 0 || integral)) {
    const int64_t n = v.as_int();
    if (f.precision) raise("Precision not allowed in integer format specifier");
    const uint64_t mag = n < 0 ? uint64_t(0) - uint64_t(n) : uint64_t(n);
    std::string digits;
    if (type == 'c') {
      py::append_code_point(digits, char32_t(mag));
    } else {
      const int base = type == 'b' ? 2 : type == 'o' ? 8 : (type == 'x' || type == 'X') ? 16 : 10;
      uint64_t m = mag;
      do {
        digits.insert(digits.begin(), "0123456789abcdef"[m % uint64_t(base)]);
        m /= uint64_t(base);
      } while (m);
      if (type == 'X') digits = py::upper(digits);
      if (f.grouping) digits = group_digits(digits, f.grouping);
      if (f.alternate && base != 10) digits = std::string("0") + (type == 'X' ? 'X' : type) + digits;
    }
    const std::string sign = n < 0 ? "-" : f.sign == '+' ? "+" : f.sign == ' ' ? " " : "";
    return apply_width(sign, digits, f, '>');
  }
  if (std::string_view("eEfFgGn%").find(type) == std::string_view::npos && type != 0) {
    raise("Unknown format code '{}' for object of type '{}'", type, type_name(v));
  }
  const double d = v.as_float();
  std::string body;
  if (type == 0 && !f.precision) {
    body = py::float_repr(std::fabs(d));
  } else {
    const char conv = type == 0 || type == 'n' ? 'g' : type == '%' ? 'f' : type;
    const double x = type == '%' ? std::fabs(d) * 100 : std::fabs(d);
    char buf[1400];  // precision is capped at 1000 digits
    const std::string cfmt = std::string("%") + (f.alternate ? "#" : "") + ".*" + conv;
    std::snprintf(buf, sizeof buf, cfmt.c_str(), int(f.precision.value_or(6)), x);
    body = buf;
    if (type == '%') body += '%';
  }
  if (f.grouping) body = group_digits(body, f.grouping);
  const std::string sign = std::signbit(d) && !std::isnan(d) ? "-" : f.sign == '+' ? "+" : f.sign == ' ' ? " " : "";
  return apply_width(sign, body, f, '>');
}

std::string format_field(const Value& v, const std::string& spec) {
  if (spec.empty()) return to_str(v);
  const FormatSpec f = parse_spec(spec);
  if (v.is_number() && !(v.is_bool() && f.type == 's')) return format_number(v, f);
  if (!v.is_string()) raise("unsupported format string passed to {}.__format__", type_name(v));
  if (f.type != 0 && f.type != 's') raise("Unknown format code '{}' for object of type 'str'", f.type);
  std::string s = v.as_string();
  if (f.precision) s = s.substr(0, py::byte_offset(s, *f.precision));
  if (f.align == '=') raise("'=' alignment not allowed in string format specifier");
  return apply_width("", s, f, '<');
}

class Formatter {
 public:
  Formatter(std::vector<Value> positional, std::vector<std::pair<std::string, Value>> keywords)
      : positional_(std::move(positional)), keywords_(std::move(keywords)) {}

  std::string format(const std::string& fmt, int depth) {
    if (depth > 2) raise("Max string recursion exceeded");
    std::string out;
    for (size_t i = 0; i < fmt.size(); ++i) {
      const char c = fmt[i];
      if (c == '}') {
        if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
          out += '}';
          ++i;
          continue;
        }
        raise("Single '}}' encountered in format string");
      }
      if (c != '{') {
        out += c;
        continue;
      }
      if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
        out += '{';
        ++i;
        continue;
      }
      size_t j = i + 1;
      int nesting = 1;
      for (; j < fmt.size(); ++j) {
        if (fmt[j] == '{') ++nesting;
        if (fmt[j] == '}' && --nesting == 0) break;
      }
      if (j >= fmt.size()) raise("expected '}}' before end of string");
      out += replacement(fmt.substr(i + 1, j - i - 1), depth);
      check_size(out);
      i = j;
    }
    return out;
  }

 private:
  std::string replacement(const std::string& field, int depth) {
    size_t name_end = 0;
    for (int brackets = 0; name_end < field.size(); ++name_end) {
      const char c = field[name_end];
      if (c == '[') ++brackets;
      if (c == ']') --brackets;
      if (brackets == 0 && (c == '!' || c == ':')) break;
    }
    Value v = lookup(field.substr(0, name_end));
    size_t i = name_end;
    char conversion = 0;
    if (i < field.size() && field[i] == '!') {
      if (i + 1 >= field.size()) raise("end of string while looking for conversion specifier");
      conversion = field[i + 1];
      i += 2;
      if (i < field.size() && field[i] != ':') raise("expected ':' after conversion specifier");
    }
    const std::string spec = i < field.size() ? format(field.substr(i + 1), depth + 1) : "";
    if (conversion == 'r' || conversion == 'a') {
      v = Value::string(to_repr(v));
    } else if (conversion == 's') {
      v = Value::string(to_str(v));
    } else if (conversion != 0) {
      raise("Unknown conversion specifier {}", conversion);
    }
    return format_field(v, spec);
  }

  Value lookup(const std::string& name) {
    size_t i = 0;
    while (i < name.size() && name[i] != '.' && name[i] != '[') ++i;
    const std::string first = name.substr(0, i);
    Value v;
    if (first.empty() || std::all_of(first.begin(), first.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
      size_t index = 0;
      if (first.empty()) {
        if (manual_) raise("cannot switch from manual field specification to automatic field numbering");
        automatic_ = true;
        index = next_++;
      } else {
        if (automatic_) raise("cannot switch from automatic field numbering to manual field specification");
        manual_ = true;
        index = size_t(std::min<unsigned long long>(std::stoull(first.substr(0, 18)), 1ull << 40));
      }
      if (index >= positional_.size()) raise("Replacement index {} out of range for positional args tuple", index);
      v = positional_[index];
    } else {
      const auto it = std::find_if(keywords_.begin(), keywords_.end(), [&](const auto& kv) { return kv.first == first; });
      if (it == keywords_.end()) raise("KeyError: {}", py::repr(first));
      v = it->second;
    }
    while (i < name.size()) {  // .attribute and [key] accessors
      if (name[i] == '.') {
        size_t j = ++i;
        while (j < name.size() && name[j] != '.' && name[j] != '[') ++j;
        v = get_attr(v, name.substr(i, j - i));
        i = j;
      } else {
        const size_t close = name.find(']', i);
        if (close == std::string::npos) raise("Missing ']' in format string");
        const std::string key = name.substr(i + 1, close - i - 1);
        const bool numeric = !key.empty() && std::all_of(key.begin(), key.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
        v = get_item(v, numeric ? Value::integer(std::stoll(key.substr(0, 18))) : Value::string(key));
        i = close + 1;
      }
    }
    return v;
  }

  std::vector<Value> positional_;
  std::vector<std::pair<std::string, Value>> keywords_;
  size_t next_ = 0;
  bool automatic_ = false;
  bool manual_ = false;
};

Value str_format(const Value& self, Args& args) {
  return Value::string(Formatter(args.positional, args.keywords).format(self.as_string(), 0));
}

struct NamedMethod {
  std::string_view name;
  Method fn;
};

constexpr NamedMethod kStrMethods[] = {
    {"upper", str_transform<py::upper>},
    {"lower", str_transform<py::lower>},
    {"casefold", str_transform<py::lower>},
    {"title", str_transform<py::title>},
    {"capitalize", str_transform<py::capitalize>},
    {"swapcase", str_transform<py::swapcase>},
    {"strip", str_strip<true, true>},
    {"lstrip", str_strip<true, false>},
    {"rstrip", str_strip<false, true>},
    {"split", str_split<false>},
    {"rsplit", str_split<true>},
    {"splitlines", str_splitlines},
    {"startswith", str_affix<false>},
    {"endswith", str_affix<true>},
    {"find", str_find<false, false>},
    {"rfind", str_find<true, false>},
    {"index", str_find<false, true>},
    {"rindex", str_find<true, true>},
    {"count", str_count},
    {"replace", str_replace},
    {"join", str_join},
    {"center", str_justify<'^'>},
    {"ljust", str_justify<'<'>},
    {"rjust", str_justify<'>'>},
    {"zfill", str_zfill},
    {"partition", str_partition<false>},
    {"rpartition", str_partition<true>},
    {"removeprefix", str_remove_affix<false>},
    {"removesuffix", str_remove_affix<true>},
    {"isalpha", str_all<py::is_alpha>},
    {"isalnum", str_all<is_alnum>},
    {"isdigit", str_all<py::is_digit>},
    {"isdecimal", str_all<py::is_digit>},
    {"isnumeric", str_all<py::is_digit>},
    {"isspace", str_all<py::is_space>},
    {"islower", str_predicate<py::islower>},
    {"isupper", str_predicate<py::isupper>},
    {"format", str_format},
};

Value dict_items(const Value& self, Args& args) {
  ArgReader("items", args).finish();
  std::vector<Value> items;
  for (const auto& [k, v] : self.as_dict().items) items.push_back(Value::list({k, v}, SeqKind::Tuple));
  return Value::list(std::move(items), SeqKind::DictItems);
}

Value dict_keys(const Value& self, Args& args) {
  ArgReader("keys", args).finish();
  std::vector<Value> keys;
  for (const auto& kv : self.as_dict().items) keys.push_back(kv.first);
  return Value::list(std::move(keys), SeqKind::DictKeys);
}

Value dict_values(const Value& self, Args& args) {
  ArgReader("values", args).finish();
  std::vector<Value> values;
  for (const auto& kv : self.as_dict().items) values.push_back(kv.second);
  return Value::list(std::move(values), SeqKind::DictValues);
}

Value dict_get(const Value& self, Args& args) {
  ArgReader r("get", args);
  const Value key = r.required("key");
  Value fallback = r.get("default", Value::none());
  r.finish();
  const Value* v = self.as_dict().find(key);
  return v ? *v : fallback;
}

Value dict_copy(const Value& self, Args& args) {
  ArgReader("copy", args).finish();
  return Value::dict(self.as_dict());
}

constexpr NamedMethod kDictMethods[] = {
    {"items", dict_items}, {"keys", dict_keys}, {"values", dict_values}, {"get", dict_get}, {"copy", dict_copy},
};
constexpr std::string_view kUnsafeDictMethods[] = {"clear", "pop", "popitem", "setdefault", "update"};

// Not in jinja2's immutable sandbox, which refuses it: templates written for llama.cpp's engine
// build lists with it, and allowing it changes nothing for templates that work in jinja2.
Value list_append(const Value& self, Args& args) {
  ArgReader r("append", args);
  Value item = r.required("object");
  r.finish();
  List& l = self.as_list();
  if (l.items.size() >= kMaxListItems) raise("list result has more than {} items", kMaxListItems);
  l.items.push_back(std::move(item));
  return Value::none();
}

Value list_count(const Value& self, Args& args) {
  ArgReader r("count", args);
  const Value needle = r.required("value");
  r.finish();
  int64_t n = 0;
  for (const Value& v : self.as_list().items) n += equals(v, needle) ? 1 : 0;
  return Value::integer(n);
}

Value list_index(const Value& self, Args& args) {
  ArgReader r("index", args);
  const Value needle = r.required("value");
  r.finish();
  const std::vector<Value>& items = self.as_list().items;
  for (size_t i = 0; i < items.size(); ++i) {
    if (equals(items[i], needle)) return Value::integer(int64_t(i));
  }
  raise("{} is not in {}", to_repr(needle), type_name(self));
}

Value list_copy(const Value& self, Args& args) {
  ArgReader("copy", args).finish();
  return Value::list(self.as_list().items);
}

Value list_pop(const Value& self, Args& args) {
  ArgReader r("pop", args);
  const int64_t index = int_arg(r.get("index", Value::integer(-1)), "pop");
  r.finish();
  std::vector<Value>& items = self.as_list().items;
  if (items.empty()) raise("pop from empty list");
  const int64_t i = index < 0 ? index + int64_t(items.size()) : index;
  if (i < 0 || i >= int64_t(items.size())) raise("pop index out of range");
  Value v = std::move(items[size_t(i)]);
  items.erase(items.begin() + std::ptrdiff_t(i));
  return v;
}

Value list_clear(const Value& self, Args& args) {
  ArgReader("clear", args).finish();
  self.as_list().items.clear();
  return Value::none();
}

// jinja2 3.1's immutable sandbox lets pop and clear through; these it refuses.
constexpr std::string_view kUnsafeListMethods[] = {"extend", "insert", "remove", "reverse", "sort"};

template <size_t N>
std::optional<Value> lookup(const Value& self, std::string_view type, std::string_view name, const NamedMethod (&table)[N]) {
  for (const NamedMethod& m : table) {
    if (m.name == name) return bind_method(self, fmt::format("{}.{}", type, name), m.fn);
  }
  return std::nullopt;
}

}  // namespace

std::optional<Value> find_method(const Value& obj, std::string_view name) {
  if (obj.is_string()) return lookup(obj, "str", name, kStrMethods);
  if (obj.is_dict()) {
    if (auto m = lookup(obj, "dict", name, kDictMethods)) return m;
    for (std::string_view u : kUnsafeDictMethods) {
      if (u == name) return unsafe(obj, name);
    }
    return std::nullopt;
  }
  if (obj.is_seq(SeqKind::List) || obj.is_seq(SeqKind::Tuple)) {
    const bool tuple = obj.is_seq(SeqKind::Tuple);
    if (name == "count") return bind_method(obj, "list.count", list_count);
    if (name == "index") return bind_method(obj, "list.index", list_index);
    if (tuple) return std::nullopt;
    if (name == "append") return bind_method(obj, "list.append", list_append);
    if (name == "copy") return bind_method(obj, "list.copy", list_copy);
    if (name == "pop") return bind_method(obj, "list.pop", list_pop);
    if (name == "clear") return bind_method(obj, "list.clear", list_clear);
    for (std::string_view u : kUnsafeListMethods) {
      if (u == name) return unsafe(obj, name);
    }
  }
  return std::nullopt;
}

}  // namespace sparsemla::chat::jinja
