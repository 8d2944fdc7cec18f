#include "chat/jinja_ops.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <optional>

#include "chat/jinja_builtins.h"
#include "chat/jinja_pystr.h"

namespace sparsemla::chat::jinja {

namespace {

const char* op_symbol(BinOp op) {
  switch (op) {
    case BinOp::Add:
      return "+";
    case BinOp::Sub:
      return "-";
    case BinOp::Mul:
      return "*";
    case BinOp::Div:
      return "/";
    case BinOp::FloorDiv:
      return "//";
    case BinOp::Mod:
      return "%";
    case BinOp::Pow:
      return "** or pow()";
  }
  return "?";
}

[[noreturn]] void unsupported(BinOp op, const Value& a, const Value& b) {
  raise("unsupported operand type(s) for {}: '{}' and '{}'", op_symbol(op), type_name(a), type_name(b));
}

[[noreturn]] void overflow() { raise("integer overflow: the result does not fit in 64 bits"); }

bool is_plain_seq(const Value& v) { return v.is_seq(SeqKind::List) || v.is_seq(SeqKind::Tuple); }

Value repeat(const Value& seq, int64_t times) {
  if (seq.is_string()) {
    const std::string& s = seq.as_string();
    if (times <= 0 || s.empty()) return Value::string("");
    if (s.size() > kMaxStringBytes / size_t(times)) raise("string result is larger than {} bytes", kMaxStringBytes);
    std::string out;
    out.reserve(s.size() * size_t(times));
    for (int64_t i = 0; i < times; ++i) out += s;
    return Value::string(std::move(out));
  }
  const List& l = seq.as_list();
  if (times <= 0 || l.items.empty()) return Value::list({}, l.kind);
  if (l.items.size() > kMaxListItems / size_t(times)) raise("list result has more than {} items", kMaxListItems);
  std::vector<Value> out;
  out.reserve(l.items.size() * size_t(times));
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), l.items.begin(), l.items.end());
  return Value::list(std::move(out), l.kind);
}

double float_floordiv(double a, double b) {
  if (b == 0) raise("float floor division by zero");
  double mod = std::fmod(a, b);
  double div = (a - mod) / b;
  if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1.0;
  if (div == 0) return std::copysign(0.0, a / b);
  double floordiv = std::floor(div);
  if (div - floordiv > 0.5) floordiv += 1.0;
  return floordiv;
}

double float_mod(double a, double b) {
  if (b == 0) raise("float modulo");
  double mod = std::fmod(a, b);
  if (mod != 0) {
    if ((b < 0) != (mod < 0)) mod += b;
  } else {
    mod = std::copysign(0.0, b);
  }
  return mod;
}

Value int_pow(int64_t base, int64_t exp) {
  if (exp < 0) {
    if (base == 0) raise("0.0 cannot be raised to a negative power");
    return Value::number(std::pow(double(base), double(exp)));
  }
  int64_t result = 1;
  while (exp > 0) {
    if (exp & 1) {
      if (__builtin_mul_overflow(result, base, &result)) overflow();
    }
    exp >>= 1;
    if (exp > 0 && __builtin_mul_overflow(base, base, &base)) {
      if (result == 0) break;
      overflow();
    }
  }
  return Value::integer(result);
}

Value float_pow(double a, double b) {
  if (a == 0 && b < 0) raise("0.0 cannot be raised to a negative power");
  if (a < 0 && std::isfinite(b) && b != std::floor(b)) raise("a negative number to a fractional power is complex");
  const double r = std::pow(a, b);
  if (std::isinf(r) && std::isfinite(a) && std::isfinite(b)) raise("numerical result out of range");
  return Value::number(r);
}

Value arithmetic(BinOp op, const Value& a, const Value& b) {
  if (a.is_integral() && b.is_integral()) {
    const int64_t x = a.as_int();
    const int64_t y = b.as_int();
    int64_t r = 0;
    switch (op) {
      case BinOp::Add:
        if (__builtin_add_overflow(x, y, &r)) overflow();
        return Value::integer(r);
      case BinOp::Sub:
        if (__builtin_sub_overflow(x, y, &r)) overflow();
        return Value::integer(r);
      case BinOp::Mul:
        if (__builtin_mul_overflow(x, y, &r)) overflow();
        return Value::integer(r);
      case BinOp::Div:
        if (y == 0) raise("division by zero");
        return Value::number(double(x) / double(y));
      case BinOp::FloorDiv: {
        if (y == 0) raise("integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) overflow();
        int64_t q = x / y;
        if (x % y != 0 && ((x < 0) != (y < 0))) --q;
        return Value::integer(q);
      }
      case BinOp::Mod: {
        if (y == 0) raise("integer division or modulo by zero");
        if (y == -1) return Value::integer(0);
        int64_t m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) m += y;
        return Value::integer(m);
      }
      case BinOp::Pow:
        return int_pow(x, y);
    }
  }
  const double x = a.as_float();
  const double y = b.as_float();
  switch (op) {
    case BinOp::Add:
      return Value::number(x + y);
    case BinOp::Sub:
      return Value::number(x - y);
    case BinOp::Mul:
      return Value::number(x * y);
    case BinOp::Div:
      if (y == 0) raise("float division by zero");
      return Value::number(x / y);
    case BinOp::FloorDiv:
      return Value::number(float_floordiv(x, y));
    case BinOp::Mod:
      return Value::number(float_mod(x, y));
    case BinOp::Pow:
      return float_pow(x, y);
  }
  return Value::none();
}

std::string undefined_attr_hint(const Value& obj, std::string_view name) {
  return py::repr(object_type_repr(obj)) + " has no attribute " + py::repr(name);
}

// Python-slice bounds of a sequence of length n.
std::vector<size_t> slice_indices(size_t n, const Value& start, const Value& stop, const Value& step) {
  for (const Value* v : {&start, &stop, &step}) {
    if (!v->is_none() && !v->is_integral()) raise("slice indices must be integers or None");
  }
  const int64_t st = step.is_none() ? 1 : step.as_int();
  if (st == 0) raise("slice step cannot be zero");
  const auto len = int64_t(n);
  const int64_t lower = st > 0 ? 0 : -1;
  const int64_t upper = st > 0 ? len : len - 1;
  const auto bound = [&](const Value& v, int64_t dflt) {
    if (v.is_none()) return dflt;
    int64_t x = v.as_int();
    if (x < 0) x = x < -len ? lower : x + len;  // -len guards the addition, then the clamp below
    return std::clamp(x, lower, upper);
  };
  const int64_t b = bound(start, st > 0 ? lower : upper);
  const int64_t e = bound(stop, st > 0 ? upper : lower);
  std::vector<size_t> out;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) {
    out.push_back(size_t(i));
    if (st > 0 ? e - i <= st : i - e <= -st) break;  // the next step would leave the range (or overflow)
  }
  return out;
}

std::string pad(std::string body, size_t width, bool left_align, char fill) {
  const size_t len = py::length(body);
  if (len >= width) return body;
  const std::string padding(width - len, fill);
  return left_align ? body + padding : padding + body;
}

std::string format_int(int64_t v, int base, bool upper, bool alt, bool plus, bool space, bool left, bool zero,
                       size_t width, std::optional<size_t> precision) {
  uint64_t mag = v < 0 ? uint64_t(0) - uint64_t(v) : uint64_t(v);
  std::string digits;
  do {
    digits.insert(digits.begin(), "0123456789abcdef"[mag % uint64_t(base)]);
    mag /= uint64_t(base);
  } while (mag);
  if (upper) digits = py::upper(digits);
  if (precision && digits.size() < *precision) digits.insert(0, *precision - digits.size(), '0');
  std::string prefix = v < 0 ? "-" : plus ? "+" : space ? " " : "";
  if (alt && base == 8) prefix += "0o";
  if (alt && base == 16) prefix += upper ? "0X" : "0x";
  if (zero && !left && prefix.size() + digits.size() < width) {
    digits.insert(0, width - prefix.size() - digits.size(), '0');
  }
  return pad(prefix + digits, width, left, ' ');
}

}  // namespace

void check_size(const std::string& s) {
  if (s.size() > kMaxStringBytes) raise("string result is larger than {} bytes", kMaxStringBytes);
}

Value binary_op(BinOp op, const Value& a, const Value& b) {
  if (a.is_undefined()) raise_undefined(a);
  if (b.is_undefined()) raise_undefined(b);
  if (a.is_number() && b.is_number()) return arithmetic(op, a, b);
  switch (op) {
    case BinOp::Add:
      if (a.is_string()) {
        if (!b.is_string()) raise("can only concatenate str (not \"{}\") to str", type_name(b));
        std::string sum = a.as_string() + b.as_string();
        check_size(sum);
        return Value::string(std::move(sum));
      }
      if (is_plain_seq(a)) {
        if (!b.is_list() || b.as_list().kind != a.as_list().kind) {
          raise("can only concatenate {} (not \"{}\") to {}", type_name(a), type_name(b), type_name(a));
        }
        std::vector<Value> items = a.as_list().items;
        const std::vector<Value>& more = b.as_list().items;
        if (items.size() + more.size() > kMaxListItems) raise("list result has more than {} items", kMaxListItems);
        items.insert(items.end(), more.begin(), more.end());
        return Value::list(std::move(items), a.as_list().kind);
      }
      break;
    case BinOp::Mul:
      if ((a.is_string() || is_plain_seq(a)) && b.is_integral()) return repeat(a, b.as_int());
      if ((b.is_string() || is_plain_seq(b)) && a.is_integral()) return repeat(b, a.as_int());
      if (a.is_string() || is_plain_seq(a)) raise("can't multiply sequence by non-int of type '{}'", type_name(b));
      break;
    case BinOp::Mod:
      if (a.is_string()) return Value::string(percent_format(a.as_string(), b));
      break;
    default:
      break;
  }
  unsupported(op, a, b);
}

Value negate(const Value& v) {
  if (v.is_undefined()) raise_undefined(v);
  if (v.is_integral()) {
    if (v.as_int() == INT64_MIN) overflow();
    return Value::integer(-v.as_int());
  }
  if (v.is_float()) return Value::number(-v.as_float());
  raise("bad operand type for unary -: '{}'", type_name(v));
}

Value unary_plus(const Value& v) {
  if (v.is_undefined()) raise_undefined(v);
  if (v.is_integral()) return Value::integer(v.as_int());
  if (v.is_float()) return v;
  raise("bad operand type for unary +: '{}'", type_name(v));
}

bool contains(const Value& container, const Value& item) {
  switch (container.type()) {
    case Value::Type::Undefined:
      return false;
    case Value::Type::String:
      if (!item.is_string()) raise("'in <string>' requires string as left operand, not {}", type_name(item));
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Value::Type::List:
      spend_walk(container.as_list().items.size());
      for (const Value& v : container.as_list().items) {
        if (equals(v, item)) return true;
      }
      return false;
    case Value::Type::Dict:
      return container.as_dict().find(item) != nullptr;
    default:
      raise("argument of type '{}' is not iterable", type_name(container));
  }
}

Value get_attr(const Value& obj, std::string_view name) {
  if (obj.is_undefined()) raise_undefined(obj);
  if (auto method = find_method(obj, name)) return *method;
  if (obj.is_dict()) {
    if (const Value* v = obj.as_dict().find(name)) return *v;
  } else if (obj.is_namespace()) {
    if (auto v = namespace_attribute(obj.as_namespace(), name)) return *v;
  }
  return Value::undefined(undefined_attr_hint(obj, name));
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) raise_undefined(obj);
  if (obj.is_dict()) {
    // An unhashable key is a TypeError, which the sandbox turns into an undefined value.
    const bool hashable_key = !key.is_dict() && !(key.is_list() && !key.is_seq(SeqKind::Tuple));
    if (hashable_key) {
      if (const Value* v = obj.as_dict().find(key)) return *v;
    }
  } else if ((is_plain_seq(obj) || obj.is_string()) && key.is_integral()) {
    int64_t i = key.as_int();
    if (obj.is_string()) {
      const std::string& s = obj.as_string();
      const auto n = int64_t(py::length(s));
      if (i < 0) i += n;
      if (i >= 0 && i < n) {
        const size_t b = py::byte_offset(s, size_t(i));
        size_t e = b;
        py::next_code_point(s, e);
        return Value::string(s.substr(b, e - b));
      }
    } else {
      const std::vector<Value>& items = obj.as_list().items;
      const auto n = int64_t(items.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return items[size_t(i)];
    }
  }
  if (key.is_string()) {
    if (auto method = find_method(obj, key.as_string())) return *method;
    if (obj.is_namespace()) {
      if (auto v = namespace_attribute(obj.as_namespace(), key.as_string())) return *v;
    }
    return Value::undefined(undefined_attr_hint(obj, key.as_string()));
  }
  return Value::undefined(object_type_repr(obj) + " has no element " + to_repr(key));
}

Value get_slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) raise_undefined(obj);
  if (obj.is_string()) {
    const std::string& s = obj.as_string();
    if (py::is_ascii(s)) {
      std::string out;
      for (size_t i : slice_indices(s.size(), start, stop, step)) out += s[i];
      return Value::string(std::move(out));
    }
    const std::u32string cps = py::decode(s);
    std::u32string out;
    for (size_t i : slice_indices(cps.size(), start, stop, step)) out += cps[i];
    return Value::string(py::encode(out));
  }
  if (is_plain_seq(obj)) {
    const List& l = obj.as_list();
    std::vector<Value> out;
    for (size_t i : slice_indices(l.items.size(), start, stop, step)) out.push_back(l.items[i]);
    return Value::list(std::move(out), l.kind);
  }
  return Value::undefined(object_type_repr(obj) + " has no element slice(" + to_repr(start) + ", " +
                          to_repr(stop) + ", " + to_repr(step) + ")");
}

Value call_value(Interpreter& in, const Value& callee, Args& args) {
  if (callee.is_function()) return callee.as_function().call(in, args);
  if (callee.is_undefined()) raise_undefined(callee);
  raise("'{}' object is not callable", type_name(callee));
}

std::string percent_format(const std::string& fmt, const Value& args) {
  std::vector<Value> positional;
  const Dict* mapping = nullptr;
  if (args.is_seq(SeqKind::Tuple)) {
    positional = args.as_list().items;
  } else {
    positional.push_back(args);
    if (args.is_dict()) mapping = &args.as_dict();
  }
  size_t next = 0;
  const auto take = [&]() -> const Value& {
    if (next >= positional.size()) raise("not enough arguments for format string");
    return positional[next++];
  };
  const auto take_int = [&] {
    const Value& v = take();
    if (!v.is_integral()) raise("* wants int");
    return v.as_int();
  };
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (++i >= fmt.size()) raise("incomplete format");
    const Value* value = nullptr;
    if (fmt[i] == '(') {
      if (mapping == nullptr) raise("format requires a mapping");
      const size_t close = fmt.find(')', i);
      if (close == std::string::npos) raise("incomplete format key");
      const std::string key = fmt.substr(i + 1, close - i - 1);
      value = mapping->find(std::string_view(key));
      if (value == nullptr) raise("KeyError: {}", py::repr(key));
      i = close + 1;
    }
    bool left = false, plus = false, space = false, alt = false, zero = false;
    for (; i < fmt.size() && std::string_view("-+ #0").find(fmt[i]) != std::string_view::npos; ++i) {
      left |= fmt[i] == '-';
      plus |= fmt[i] == '+';
      space |= fmt[i] == ' ';
      alt |= fmt[i] == '#';
      zero |= fmt[i] == '0';
    }
    int64_t width = 0;
    if (i < fmt.size() && fmt[i] == '*') {
      width = take_int();
      if (width < 0) left = true, width = -width;
      ++i;
    } else {
      for (; i < fmt.size() && std::isdigit(static_cast<unsigned char>(fmt[i])); ++i) {
        width = std::min<int64_t>(width * 10 + (fmt[i] - '0'), int64_t(kMaxStringBytes) + 1);
      }
    }
    if (width > int64_t(kMaxStringBytes)) raise("string result is larger than {} bytes", kMaxStringBytes);
    std::optional<size_t> precision;
    if (i < fmt.size() && fmt[i] == '.') {
      ++i;
      int64_t p = 0;
      if (i < fmt.size() && fmt[i] == '*') {
        p = std::max<int64_t>(take_int(), 0);
        ++i;
      } else {
        for (; i < fmt.size() && std::isdigit(static_cast<unsigned char>(fmt[i])); ++i) p = std::min<int64_t>(p * 10 + (fmt[i] - '0'), 1 << 20);
      }
      precision = size_t(p);
    }
    while (i < fmt.size() && (fmt[i] == 'h' || fmt[i] == 'l' || fmt[i] == 'L')) ++i;
    if (i >= fmt.size()) raise("incomplete format");
    const char conv = fmt[i];
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (value == nullptr) value = &take();
    const Value& v = *value;
    const auto w = size_t(width);
    switch (conv) {
      case 's':
      case 'r':
      case 'a': {
        std::string s = conv == 's' ? to_str(v) : to_repr(v);
        if (precision) s = s.substr(0, py::byte_offset(s, *precision));
        out += pad(std::move(s), w, left, ' ');
        break;
      }
      case 'd':
      case 'i':
      case 'u':
      case 'o':
      case 'x':
      case 'X': {
        const bool decimal = conv == 'd' || conv == 'i' || conv == 'u';
        if (!v.is_number() || (!decimal && v.is_float())) {
          raise("%{} format: {} is required, not {}", conv, decimal ? "a real number" : "an integer", type_name(v));
        }
        int64_t n = 0;
        if (v.is_float()) {
          const double d = std::trunc(v.as_float());
          if (!std::isfinite(d) || std::fabs(d) >= 9.2e18) overflow();
          n = int64_t(d);
        } else {
          n = v.as_int();
        }
        const int base = decimal ? 10 : conv == 'o' ? 8 : 16;
        out += format_int(n, base, conv == 'X', alt, plus, space, left, zero, w, precision);
        break;
      }
      case 'e':
      case 'E':
      case 'f':
      case 'F':
      case 'g':
      case 'G': {
        if (!v.is_number()) raise("must be real number, not {}", type_name(v));
        std::string spec = "%";
        if (left) spec += '-';
        if (plus) spec += '+';
        if (space) spec += ' ';
        if (alt) spec += '#';
        if (zero) spec += '0';
        spec += std::to_string(w) + "." + std::to_string(std::min<size_t>(precision.value_or(6), 400)) + conv;
        char buf[512];
        const int n = std::snprintf(buf, sizeof buf, spec.c_str(), v.as_float());
        if (n < 0 || size_t(n) >= sizeof buf) {
          std::vector<char> big(size_t(std::max(n, 0)) + 1);
          std::snprintf(big.data(), big.size(), spec.c_str(), v.as_float());
          out += big.data();
        } else {
          out += buf;
        }
        break;
      }
      case 'c': {
        std::string ch;
        if (v.is_integral() && v.as_int() >= 0 && v.as_int() <= 0x10FFFF) {
          py::append_code_point(ch, char32_t(v.as_int()));
        } else if (v.is_string() && py::length(v.as_string()) == 1) {
          ch = v.as_string();
        } else {
          raise("%c requires an int or a unicode character");
        }
        out += pad(std::move(ch), w, left, ' ');
        break;
      }
      default:
        raise("unsupported format character '{}' at index {}", conv, i);
    }
    check_size(out);
  }
  if (mapping == nullptr && next < positional.size()) raise("not all arguments converted during string formatting");
  return out;
}

}  // namespace sparsemla::chat::jinja
