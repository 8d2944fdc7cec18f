#include "chat/jinja_json.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "chat/jinja_pystr.h"

namespace sparsemla::chat::jinja {

namespace {

void append_u16_escape(std::string& out, unsigned unit) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "\\u%04x", unit);
  out += buf;
}

void dump_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    const char32_t c = py::next_code_point(s, i);
    switch (c) {
      case '"':
        out += "\\\"";
        continue;
      case '\\':
        out += "\\\\";
        continue;
      case '\n':
        out += "\\n";
        continue;
      case '\r':
        out += "\\r";
        continue;
      case '\t':
        out += "\\t";
        continue;
      case '\b':
        out += "\\b";
        continue;
      case '\f':
        out += "\\f";
        continue;
      default:
        break;
    }
    if (c < 0x20 || (ensure_ascii && c > 0x7E)) {
      if (c >= 0x10000) {
        const char32_t v = c - 0x10000;
        append_u16_escape(out, unsigned(0xD800 + (v >> 10)));
        append_u16_escape(out, unsigned(0xDC00 + (v & 0x3FF)));
      } else {
        append_u16_escape(out, unsigned(c));
      }
    } else {
      out.append(s, start, i - start);
    }
  }
  out += '"';
}

std::string float_text(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return py::float_repr(d);
}

class Dumper {
 public:
  Dumper(std::string& out, const JsonOptions& o) : out_(out), o_(o) {}

  void dump(const Value& v, int level) {
    if (level > kMaxNesting) raise("Circular reference detected, or values nest more than {} levels", kMaxNesting);
    switch (v.type()) {
      case Value::Type::None:
        out_ += "null";
        return;
      case Value::Type::Bool:
        out_ += v.as_bool() ? "true" : "false";
        return;
      case Value::Type::Int:
        out_ += std::to_string(v.as_int());
        return;
      case Value::Type::Float:
        out_ += float_text(v.as_float());
        return;
      case Value::Type::String:
        dump_string(out_, v.as_string(), o_.ensure_ascii);
        return;
      case Value::Type::List: {
        const List& l = v.as_list();
        if (l.kind != SeqKind::List && l.kind != SeqKind::Tuple) break;
        if (l.items.empty()) {
          out_ += "[]";
          return;
        }
        out_ += '[';
        const std::string sep = open(level);
        for (size_t i = 0; i < l.items.size(); ++i) {
          if (i) out_ += sep;
          dump(l.items[i], level + 1);
        }
        close(level);
        out_ += ']';
        return;
      }
      case Value::Type::Dict:
        dump_dict(v.as_dict(), level);
        return;
      default:
        break;
    }
    raise("Object of type {} is not JSON serializable", type_name(v));
  }

 private:
  // Starts the items of a container one level down; returns what goes between two items.
  std::string open(int level) {
    if (!o_.indent) return o_.item_separator;
    std::string newline_indent = "\n";
    for (int i = 0; i <= level; ++i) newline_indent += *o_.indent;
    out_ += newline_indent;
    return o_.item_separator + newline_indent;
  }

  void close(int level) {
    if (!o_.indent) return;
    out_ += '\n';
    for (int i = 0; i < level; ++i) out_ += *o_.indent;
  }

  std::string key_text(const Value& k) {
    switch (k.type()) {
      case Value::Type::String:
        return k.as_string();
      case Value::Type::Int:
        return std::to_string(k.as_int());
      case Value::Type::Float:
        return float_text(k.as_float());
      case Value::Type::Bool:
        return k.as_bool() ? "true" : "false";
      case Value::Type::None:
        return "null";
      default:
        raise("keys must be str, int, float, bool or None, not {}", type_name(k));
    }
  }

  void dump_dict(const Dict& d, int level) {
    if (d.size() == 0) {
      out_ += "{}";
      return;
    }
    std::vector<const std::pair<Value, Value>*> items;
    for (const auto& kv : d.items) items.push_back(&kv);
    if (o_.sort_keys) {
      std::stable_sort(items.begin(), items.end(),
                       [](const auto* a, const auto* b) { return compare(CmpOp::Lt, a->first, b->first); });
    }
    out_ += '{';
    const std::string sep = open(level);
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out_ += sep;
      dump_string(out_, key_text(items[i]->first), o_.ensure_ascii);
      out_ += o_.key_separator;
      dump(items[i]->second, level + 1);
    }
    close(level);
    out_ += '}';
  }

  std::string& out_;
  const JsonOptions& o_;
};

}  // namespace

std::string json_dumps(const Value& v, const JsonOptions& options) {
  std::string out;
  Dumper(out, options).dump(v, 0);
  return out;
}

}  // namespace sparsemla::chat::jinja
