// Argument binding for builtins, and the global functions templates can call.
#include <ctime>
#include <memory>

#include "chat/jinja_builtins.h"
#include "chat/jinja_ops.h"
#include "chat/jinja_pystr.h"

namespace sparsemla::chat::jinja {

std::optional<Value> ArgReader::get(std::string_view name) {
  used_keywords_.resize(args_.keywords.size(), false);
  std::optional<Value> found;
  if (next_ < args_.positional.size()) found = args_.positional[next_++];
  for (size_t i = 0; i < args_.keywords.size(); ++i) {
    if (args_.keywords[i].first != name || used_keywords_[i]) continue;
    if (found) raise("{}() got multiple values for argument '{}'", function_, name);
    used_keywords_[i] = true;
    found = args_.keywords[i].second;
  }
  return found;
}

Value ArgReader::get(std::string_view name, Value default_value) {
  std::optional<Value> v = get(name);
  return v ? std::move(*v) : std::move(default_value);
}

Value ArgReader::required(std::string_view name) {
  std::optional<Value> v = get(name);
  if (!v) raise("{}() missing required argument '{}'", function_, name);
  return std::move(*v);
}

void ArgReader::finish() {
  if (next_ < args_.positional.size()) {
    raise("{}() takes at most {} positional argument(s) ({} given)", function_, next_, args_.positional.size());
  }
  used_keywords_.resize(args_.keywords.size(), false);
  for (size_t i = 0; i < args_.keywords.size(); ++i) {
    if (!used_keywords_[i]) raise("{}() got an unexpected keyword argument '{}'", function_, args_.keywords[i].first);
  }
}

namespace {

int64_t int_arg(const Value& v, std::string_view function) {
  if (!v.is_integral()) raise("'{}' object cannot be interpreted as an integer (in {}())", type_name(v), function);
  return v.as_int();
}

// jinja2's sandbox caps range() at this many items.
constexpr int64_t kMaxRange = 100000;

Value range(Interpreter&, Args& args) {
  if (!args.keywords.empty()) raise("range() takes no keyword arguments");
  const auto& p = args.positional;
  if (p.empty() || p.size() > 3) raise("range expected 1 to 3 arguments, got {}", p.size());
  int64_t start = 0;
  int64_t stop = 0;
  int64_t step = 1;
  if (p.size() == 1) {
    stop = int_arg(p[0], "range");
  } else {
    start = int_arg(p[0], "range");
    stop = int_arg(p[1], "range");
    if (p.size() == 3) step = int_arg(p[2], "range");
  }
  if (step == 0) raise("range() arg 3 must not be zero");
  // In 128 bits: the difference of two int64 can overflow.
  const __int128 span = step > 0 ? __int128(stop) - start : __int128(start) - stop;
  const __int128 magnitude = step > 0 ? __int128(step) : -__int128(step);
  const __int128 count = span <= 0 ? 0 : (span + magnitude - 1) / magnitude;
  if (count > kMaxRange) {
    raise("Range too big. The sandbox blocks ranges larger than MAX_RANGE ({}).", kMaxRange);
  }
  std::vector<Value> items;
  for (int64_t i = 0, v = start; i < int64_t(count); ++i, v += step) items.push_back(Value::integer(v));
  return Value::list(std::move(items));
}

// Python's dict(*args, **kwargs): from a mapping or an iterable of pairs, then the keywords.
Dict make_dict(Args& args, std::string_view function) {
  if (args.positional.size() > 1) raise("{} expected at most 1 positional argument, got {}", function, args.positional.size());
  Dict d;
  if (!args.positional.empty()) {
    const Value& src = args.positional[0];
    if (src.is_dict()) {
      d = src.as_dict();
    } else {
      for (const Value& item : iterate(src)) {
        std::vector<Value> pair = iterate(item);
        if (pair.size() != 2) raise("dictionary update sequence element has length {}; 2 is required", pair.size());
        d.set(std::move(pair[0]), std::move(pair[1]));
      }
    }
  }
  for (auto& [k, v] : args.keywords) d.set(Value::string(k), v);
  return d;
}

Value raise_exception(Interpreter&, Args& args) {
  ArgReader r("raise_exception", args);
  const Value message = r.required("message");
  r.finish();
  throw RuntimeError(to_str(message));
}

Value strftime_now(Interpreter&, Args& args) {
  ArgReader r("strftime_now", args);
  const Value format = r.required("format");
  r.finish();
  if (!format.is_string()) raise("strftime() argument 1 must be str, not {}", type_name(format));
  const std::string& f = format.as_string();
  if (f.empty()) return Value::string("");
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  // strftime returns 0 both for "too small" and for an empty result; give up past a generous size.
  for (size_t size = 256; size <= (size_t(1) << 20); size *= 4) {
    std::string buf(size, '\0');
    const size_t n = std::strftime(buf.data(), buf.size(), f.c_str(), &local);
    if (n > 0) {
      buf.resize(n);
      return Value::string(std::move(buf));
    }
  }
  return Value::string("");
}

Value joiner(Interpreter&, Args& args) {
  ArgReader r("joiner", args);
  const std::string sep = to_str(r.get("sep", Value::string(", ")));
  r.finish();
  auto used = std::make_shared<bool>(false);
  return Value::function("joiner", [sep, used](Interpreter&, Args& call_args) {
    ArgReader("joiner", call_args).finish();
    if (!*used) {
      *used = true;
      return Value::string("");
    }
    return Value::string(sep);
  });
}

}  // namespace

std::vector<std::pair<std::string, Value>> make_globals() {
  std::vector<std::pair<std::string, Value>> g;
  g.emplace_back("range", Value::function("range", range));
  g.emplace_back("dict", Value::function("dict", [](Interpreter&, Args& args) {
                   return Value::dict(make_dict(args, "dict"));
                 }));
  g.emplace_back("namespace", Value::function("namespace", [](Interpreter&, Args& args) {
                   return Value::ns(Namespace{make_dict(args, "namespace"), nullptr});
                 }));
  g.emplace_back("joiner", Value::function("joiner", joiner));
  g.emplace_back("raise_exception", Value::function("raise_exception", raise_exception));
  g.emplace_back("strftime_now", Value::function("strftime_now", strftime_now));
  return g;
}

}  // namespace sparsemla::chat::jinja
