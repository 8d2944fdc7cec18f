#include "chat/jinja_value.h"

#include <algorithm>

#include "chat/jinja_pystr.h"

namespace sparsemla::chat::jinja {

namespace {

thread_local RenderState* current_render = nullptr;  // the render running on this thread, if any

void check_depth(int depth) {
  if (depth > kMaxNesting) {
    raise("values nest more than {} levels deep (does a container contain itself?)", kMaxNesting);
  }
}

bool hashable(const Value& v) {
  if (v.is_dict()) return false;
  if (!v.is_list()) return true;
  const List& l = v.as_list();
  if (l.kind != SeqKind::Tuple) return l.kind == SeqKind::Generator;
  return std::all_of(l.items.begin(), l.items.end(), hashable);
}

void check_hashable(const Value& key) {
  if (!hashable(key)) raise("unhashable type: '{}'", type_name(key));
}

bool equals_at(const Value& a, const Value& b, int depth) {
  check_depth(depth);
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() == b.as_int();
    return a.as_float() == b.as_float();
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case Value::Type::Undefined:
    case Value::Type::None:
      return true;
    case Value::Type::String:
      return a.as_string() == b.as_string();
    case Value::Type::List: {
      const List& x = a.as_list();
      const List& y = b.as_list();
      if (&x == &y) return true;
      // Iterators and dict_values compare by identity in Python.
      if (x.kind != y.kind || x.kind == SeqKind::Generator || x.kind == SeqKind::DictValues) return false;
      if (x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i) {
        if (!equals_at(x.items[i], y.items[i], depth + 1)) return false;
      }
      return true;
    }
    case Value::Type::Dict: {
      const Dict& x = a.as_dict();
      const Dict& y = b.as_dict();
      if (&x == &y) return true;
      if (x.size() != y.size()) return false;
      for (const auto& [k, v] : x.items) {
        const Value* w = y.find(k);
        if (w == nullptr || !equals_at(v, *w, depth + 1)) return false;
      }
      return true;
    }
    default:
      return a.same_object(b);
  }
}

template <class T>
bool apply(CmpOp op, const T& a, const T& b) {
  switch (op) {
    case CmpOp::Lt:
      return a < b;
    case CmpOp::Le:
      return a <= b;
    case CmpOp::Gt:
      return a > b;
    case CmpOp::Ge:
      return a >= b;
  }
  return false;
}

const char* symbol(CmpOp op) {
  switch (op) {
    case CmpOp::Lt:
      return "<";
    case CmpOp::Le:
      return "<=";
    case CmpOp::Gt:
      return ">";
    case CmpOp::Ge:
      return ">=";
  }
  return "?";
}

bool compare_at(CmpOp op, const Value& a, const Value& b, int depth) {
  check_depth(depth);
  if (a.is_undefined()) raise_undefined(a);
  if (b.is_undefined()) raise_undefined(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return apply(op, a.as_int(), b.as_int());
    return apply(op, a.as_float(), b.as_float());
  }
  if (a.is_string() && b.is_string()) return apply(op, a.as_string(), b.as_string());  // bytes order = code points
  if (a.is_list() && b.is_list()) {
    const List& x = a.as_list();
    const List& y = b.as_list();
    if (x.kind == y.kind && (x.kind == SeqKind::List || x.kind == SeqKind::Tuple)) {
      const size_t n = std::min(x.items.size(), y.items.size());
      for (size_t i = 0; i < n; ++i) {
        if (!equals_at(x.items[i], y.items[i], depth + 1)) return compare_at(op, x.items[i], y.items[i], depth + 1);
      }
      return apply(op, x.items.size(), y.items.size());
    }
  }
  raise("'{}' not supported between instances of '{}' and '{}'", symbol(op), type_name(a), type_name(b));
}

void join_repr(std::string& out, const std::vector<Value>& items, int depth);

void repr_into(std::string& out, const Value& v, int depth) {
  check_depth(depth);
  switch (v.type()) {
    case Value::Type::Undefined:
      out += "Undefined";
      return;
    case Value::Type::None:
      out += "None";
      return;
    case Value::Type::Bool:
      out += v.as_bool() ? "True" : "False";
      return;
    case Value::Type::Int:
      out += std::to_string(v.as_int());
      return;
    case Value::Type::Float:
      out += py::float_repr(v.as_float());
      return;
    case Value::Type::String:
      out += py::repr(v.as_string());
      return;
    case Value::Type::List: {
      const List& l = v.as_list();
      switch (l.kind) {
        case SeqKind::List:
          out += '[';
          join_repr(out, l.items, depth);
          out += ']';
          return;
        case SeqKind::Tuple:
          out += '(';
          join_repr(out, l.items, depth);
          if (l.items.size() == 1) out += ',';
          out += ')';
          return;
        case SeqKind::Generator:
          out += "<generator object>";
          return;
        case SeqKind::DictKeys:
        case SeqKind::DictValues:
        case SeqKind::DictItems:
          out += type_name(v) + "([";
          join_repr(out, l.items, depth);
          out += "])";
          return;
      }
      return;
    }
    case Value::Type::Dict: {
      out += '{';
      bool first = true;
      for (const auto& [k, val] : v.as_dict().items) {
        if (!first) out += ", ";
        first = false;
        repr_into(out, k, depth + 1);
        out += ": ";
        repr_into(out, val, depth + 1);
      }
      out += '}';
      return;
    }
    case Value::Type::Namespace: {
      const Namespace& ns = v.as_namespace();
      if (ns.is_loop()) {
        out += fmt::format("<LoopContext {}/{}>", ns.loop->index + 1, ns.loop->items->size());
        return;
      }
      out += "<Namespace ";
      repr_into(out, Value::dict(ns.attrs), depth + 1);
      out += '>';
      return;
    }
    case Value::Type::Function:
      out += "<function " + v.as_function().name + ">";
      return;
  }
}

void join_repr(std::string& out, const std::vector<Value>& items, int depth) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ", ";
    repr_into(out, items[i], depth + 1);
  }
}

Value from_json_at(const nlohmann::ordered_json& j, int depth) {
  check_depth(depth);
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
    case nlohmann::ordered_json::value_t::discarded:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      if (u <= uint64_t(INT64_MAX)) return Value::integer(int64_t(u));
      return Value::number(double(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json_at(e, depth + 1));
      return Value::list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      d.items.reserve(j.size());
      for (const auto& [k, e] : j.items()) d.items.emplace_back(Value::string(k), from_json_at(e, depth + 1));
      return Value::dict(std::move(d));
    }
    case nlohmann::ordered_json::value_t::binary:
      break;
  }
  raise("binary JSON values cannot be passed to a template");
}

}  // namespace

Value::Value() {
  static const auto generic = std::make_shared<const Undefined>(Undefined{"value is undefined"});
  v_ = generic;
}

Value Value::undefined(std::string hint) {
  Value v;
  v.v_ = std::make_shared<const Undefined>(Undefined{std::move(hint)});
  return v;
}

Value Value::none() {
  Value v;
  v.v_ = nullptr;
  return v;
}

Value Value::boolean(bool b) {
  Value v;
  v.v_ = b;
  return v;
}

Value Value::integer(int64_t i) {
  Value v;
  v.v_ = i;
  return v;
}

Value Value::number(double d) {
  Value v;
  v.v_ = d;
  return v;
}

Value Value::string(std::string s) {
  Value v;
  v.v_ = std::move(s);
  return v;
}

Value Value::list(std::vector<Value> items, SeqKind kind) {
  Value v;
  std::shared_ptr<List> p(new List{std::move(items), kind});  // not make_shared: see RenderState::track
  if (current_render) RenderState::track(current_render->lists_, p);
  v.v_ = std::move(p);
  return v;
}

Value Value::dict(Dict d) {
  Value v;
  std::shared_ptr<Dict> p(new Dict(std::move(d)));
  if (current_render) RenderState::track(current_render->dicts_, p);
  v.v_ = std::move(p);
  return v;
}

Value Value::ns(Namespace n) {
  Value v;
  std::shared_ptr<Namespace> p(new Namespace(std::move(n)));
  if (current_render) RenderState::track(current_render->namespaces_, p);
  v.v_ = std::move(p);
  return v;
}

Value Value::function(std::string name, std::function<Value(Interpreter&, Args&)> call) {
  Value v;
  v.v_ = std::make_shared<const Function>(Function{std::move(name), std::move(call)});
  return v;
}

int64_t Value::as_int() const { return is_bool() ? int64_t(as_bool()) : std::get<int64_t>(v_); }

double Value::as_float() const { return is_float() ? std::get<double>(v_) : double(as_int()); }

const std::string& Value::undefined_hint() const { return std::get<std::shared_ptr<const Undefined>>(v_)->hint; }

bool Value::is_seq(SeqKind kind) const { return is_list() && as_list().kind == kind; }

bool Value::same_object(const Value& other) const {
  if (type() != other.type()) return false;
  switch (type()) {
    case Type::List:
      return &as_list() == &other.as_list();
    case Type::Dict:
      return &as_dict() == &other.as_dict();
    case Type::Namespace:
      return &as_namespace() == &other.as_namespace();
    case Type::Function:
      return &as_function() == &other.as_function();
    case Type::Undefined:
      return std::get<0>(v_) == std::get<0>(other.v_);
    default:
      return equals(*this, other);
  }
}

const Value* Dict::find(const Value& key) const {
  if (key.is_string()) return find(std::string_view(key.as_string()));
  check_hashable(key);
  for (const auto& [k, v] : items) {
    if (equals(k, key)) return &v;
  }
  return nullptr;
}

Value* Dict::find(const Value& key) { return const_cast<Value*>(std::as_const(*this).find(key)); }

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items) {
    if (k.is_string() && k.as_string() == key) return &v;
  }
  return nullptr;
}

void Dict::set(Value key, Value value) {
  if (Value* slot = find(key)) {
    *slot = std::move(value);
  } else {
    items.emplace_back(std::move(key), std::move(value));
  }
}

RenderState::RenderState(size_t work_units) : work_left_(work_units), previous_(current_render) {
  current_render = this;
}

RenderState::~RenderState() {
  current_render = previous_;
  // Emptying every container that is still alive breaks every cycle; emptying one may free others,
  // whose weak pointers then simply expire.
  for (auto& w : lists_) {
    if (auto p = w.lock()) p->items.clear();
  }
  for (auto& w : dicts_) {
    if (auto p = w.lock()) p->items.clear();
  }
  for (auto& w : namespaces_) {
    if (auto p = w.lock()) {
      p->attrs.items.clear();
      p->loop.reset();
    }
  }
}

template <class T>
void RenderState::track(std::vector<std::weak_ptr<T>>& made, const std::shared_ptr<T>& p) {
  // Dropping the expired entries whenever the list doubles keeps it proportional to the live containers.
  if (made.size() >= 1024 && (made.size() & (made.size() - 1)) == 0) {
    std::erase_if(made, [](const std::weak_ptr<T>& w) { return w.expired(); });
  }
  made.push_back(p);
}

void spend(size_t units) {
  RenderState* r = current_render;
  if (r == nullptr) return;
  if (units > r->work_left_) {
    r->work_left_ = 0;
    raise("the template does too much work (loops, calls and items walked); is it looping over huge ranges?");
  }
  r->work_left_ -= units;
}

void spend_walk(size_t items) { spend((items + 15) / 16); }

std::optional<Value> namespace_attribute(const Namespace& ns, std::string_view name) {
  if (!ns.is_loop()) {
    if (const Value* v = ns.attrs.find(name)) return *v;
    return std::nullopt;
  }
  const LoopState& l = *ns.loop;
  const auto n = int64_t(l.items->size());
  const auto i = int64_t(l.index);
  if (name == "index") return Value::integer(i + 1);
  if (name == "index0") return Value::integer(i);
  if (name == "revindex") return Value::integer(n - i);
  if (name == "revindex0") return Value::integer(n - i - 1);
  if (name == "first") return Value::boolean(i == 0);
  if (name == "last") return Value::boolean(i == n - 1);
  if (name == "length") return Value::integer(n);
  if (name == "depth") return Value::integer(1);
  if (name == "depth0") return Value::integer(0);
  if (name == "previtem") return i > 0 ? (*l.items)[l.index - 1] : Value::undefined("there is no previous item");
  if (name == "nextitem") return i + 1 < n ? (*l.items)[l.index + 1] : Value::undefined("there is no next item");
  if (name == "cycle") return l.cycle;
  if (name == "changed") return l.changed;
  return std::nullopt;
}

bool truthy(const Value& v) {
  switch (v.type()) {
    case Value::Type::Undefined:
    case Value::Type::None:
      return false;
    case Value::Type::Bool:
      return v.as_bool();
    case Value::Type::Int:
      return v.as_int() != 0;
    case Value::Type::Float:
      return v.as_float() != 0.0;
    case Value::Type::String:
      return !v.as_string().empty();
    case Value::Type::List:
      return v.as_list().kind == SeqKind::Generator || !v.as_list().items.empty();
    case Value::Type::Dict:
      return v.as_dict().size() != 0;
    default:
      return true;
  }
}

bool equals(const Value& a, const Value& b) { return equals_at(a, b, 0); }

bool compare(CmpOp op, const Value& a, const Value& b) { return compare_at(op, a, b, 0); }

std::string to_str(const Value& v) {
  if (v.is_string()) return v.as_string();
  if (v.is_undefined()) return "";
  std::string out;
  repr_into(out, v, 0);
  return out;
}

std::string to_repr(const Value& v) {
  std::string out;
  repr_into(out, v, 0);
  return out;
}

std::string type_name(const Value& v) {
  switch (v.type()) {
    case Value::Type::Undefined:
      return "Undefined";
    case Value::Type::None:
      return "NoneType";
    case Value::Type::Bool:
      return "bool";
    case Value::Type::Int:
      return "int";
    case Value::Type::Float:
      return "float";
    case Value::Type::String:
      return "str";
    case Value::Type::List:
      switch (v.as_list().kind) {
        case SeqKind::List:
          return "list";
        case SeqKind::Tuple:
          return "tuple";
        case SeqKind::Generator:
          return "generator";
        case SeqKind::DictKeys:
          return "dict_keys";
        case SeqKind::DictValues:
          return "dict_values";
        case SeqKind::DictItems:
          return "dict_items";
      }
      return "list";
    case Value::Type::Dict:
      return "dict";
    case Value::Type::Namespace:
      return v.as_namespace().is_loop() ? "LoopContext" : "Namespace";
    case Value::Type::Function:
      return "function";
  }
  return "object";
}

std::string object_type_repr(const Value& v) {
  switch (v.type()) {
    case Value::Type::None:
      return "None";
    case Value::Type::Undefined:
      return "jinja2.runtime.Undefined object";
    case Value::Type::Namespace:
      return v.as_namespace().is_loop() ? "jinja2.runtime.LoopContext object" : "jinja2.utils.Namespace object";
    default:
      return type_name(v) + " object";
  }
}

void raise_undefined(const Value& v) { throw RuntimeError(v.undefined_hint()); }

std::vector<Value> iterate(const Value& v) {
  switch (v.type()) {
    case Value::Type::Undefined:
      return {};
    case Value::Type::String: {
      std::vector<Value> out;
      const std::string& s = v.as_string();
      spend_walk(s.size());
      for (size_t i = 0; i < s.size();) {
        const size_t b = i;
        py::next_code_point(s, i);
        out.push_back(Value::string(s.substr(b, i - b)));
      }
      return out;
    }
    case Value::Type::List: {
      List& l = v.as_list();
      spend_walk(l.items.size());
      if (l.kind == SeqKind::Generator) return std::exchange(l.items, {});  // consumed, as in Python
      return l.items;
    }
    case Value::Type::Dict: {
      spend_walk(v.as_dict().size());
      std::vector<Value> keys;
      keys.reserve(v.as_dict().size());
      for (const auto& kv : v.as_dict().items) keys.push_back(kv.first);
      return keys;
    }
    default:
      raise("'{}' object is not iterable", type_name(v));
  }
}

size_t length(const Value& v) {
  switch (v.type()) {
    case Value::Type::Undefined:
      return 0;
    case Value::Type::String:
      return py::length(v.as_string());
    case Value::Type::List:
      if (v.as_list().kind == SeqKind::Generator) break;
      return v.as_list().items.size();
    case Value::Type::Dict:
      return v.as_dict().size();
    case Value::Type::Namespace:
      if (v.as_namespace().is_loop()) return v.as_namespace().loop->items->size();
      break;
    default:
      break;
  }
  raise("object of type '{}' has no len()", type_name(v));
}

Value from_json(const nlohmann::ordered_json& j) { return from_json_at(j, 0); }

}  // namespace sparsemla::chat::jinja
