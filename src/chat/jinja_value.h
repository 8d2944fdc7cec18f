// The values a template computes with, modelled on the Python objects jinja2 works on: None, bool,
// int, float, str, list/tuple (and the iterator and dict-view kinds that print and behave differently),
// dict (insertion ordered), jinja2's Namespace and Undefined, and callables. Lists and dicts are shared
// by reference as in Python.
#pragma once
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace sparsemla::chat::jinja {

class Interpreter;
class Value;
struct List;
class Dict;
struct Namespace;
struct Function;
struct Undefined;
struct Args;

// What Python would raise (TypeError, UndefinedError, ...). The interpreter adds the position of the
// node being evaluated and turns it into a TemplateError.
struct RuntimeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <class... Ts>
[[noreturn]] void raise(fmt::format_string<Ts...> f, Ts&&... args) {
  throw RuntimeError(fmt::format(f, std::forward<Ts>(args)...));
}

// Containers nest at most this deep: it bounds the recursion of printing, comparing and converting
// values, including a list that was appended to itself.
constexpr int kMaxNesting = 256;
// No string (the output included) grows past this, nor a list past kMaxListItems: a template cannot
// exhaust memory with "x" * 10**12 or nested loops.
constexpr size_t kMaxStringBytes = size_t(64) << 20;
constexpr size_t kMaxListItems = size_t(1) << 24;

enum class SeqKind : uint8_t {
  List,
  Tuple,
  Generator,  // what map/select/items/... return: one pass, always true, no len() and no indexing
  DictKeys,   // dict.keys(), dict.values(), dict.items(): sized and iterable, not indexable
  DictValues,
  DictItems,
};

class Value {
 public:
  enum class Type : uint8_t { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Function };

  Value();  // undefined
  static Value undefined(std::string hint);
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double d);
  static Value string(std::string s);
  static Value list(std::vector<Value> items, SeqKind kind = SeqKind::List);
  static Value dict(Dict d);
  static Value ns(Namespace n);
  static Value function(std::string name, std::function<Value(Interpreter&, Args&)> call);

  Type type() const { return static_cast<Type>(v_.index()); }
  bool is_undefined() const { return type() == Type::Undefined; }
  bool is_none() const { return type() == Type::None; }
  bool is_bool() const { return type() == Type::Bool; }
  bool is_int() const { return type() == Type::Int; }
  bool is_float() const { return type() == Type::Float; }
  bool is_string() const { return type() == Type::String; }
  bool is_list() const { return type() == Type::List; }
  bool is_dict() const { return type() == Type::Dict; }
  bool is_namespace() const { return type() == Type::Namespace; }
  bool is_function() const { return type() == Type::Function; }
  bool is_integral() const { return is_bool() || is_int(); }  // a Python int: bool is one
  bool is_number() const { return is_integral() || is_float(); }

  bool as_bool() const { return std::get<bool>(v_); }
  int64_t as_int() const;   // bool or int
  double as_float() const;  // bool, int or float
  const std::string& as_string() const { return std::get<std::string>(v_); }
  List& as_list() const { return *std::get<std::shared_ptr<List>>(v_); }
  Dict& as_dict() const { return *std::get<std::shared_ptr<Dict>>(v_); }
  Namespace& as_namespace() const { return *std::get<std::shared_ptr<Namespace>>(v_); }
  const Function& as_function() const { return *std::get<std::shared_ptr<const Function>>(v_); }
  const std::string& undefined_hint() const;
  bool is_seq(SeqKind kind) const;  // a list value of this kind

  bool same_object(const Value& other) const;  // Python `is`

 private:
  std::variant<std::shared_ptr<const Undefined>, std::nullptr_t, bool, int64_t, double, std::string,
               std::shared_ptr<List>, std::shared_ptr<Dict>, std::shared_ptr<Namespace>,
               std::shared_ptr<const Function>>
      v_;
};

struct List {
  std::vector<Value> items;
  SeqKind kind = SeqKind::List;
};

// A Python dict: insertion ordered, keys compared with Python's == (1, 1.0 and True are one key).
class Dict {
 public:
  const Value* find(const Value& key) const;
  Value* find(const Value& key);
  const Value* find(std::string_view key) const;
  void set(Value key, Value value);
  size_t size() const { return items.size(); }

  std::vector<std::pair<Value, Value>> items;
};

// What a for loop's `loop` variable reads: its attributes are computed from the position.
struct LoopState {
  std::shared_ptr<const std::vector<Value>> items;
  size_t index = 0;
  Value cycle;    // loop.cycle(...) and loop.changed(...), shared by the iterations
  Value changed;
};

// jinja2's namespace(), and the `loop` variable, which reads like one but cannot be assigned to.
struct Namespace {
  Dict attrs;
  std::shared_ptr<const LoopState> loop;
  bool is_loop() const { return loop != nullptr; }
};

// ns.name: the attribute, or nullopt when there is none.
std::optional<Value> namespace_attribute(const Namespace& ns, std::string_view name);

// A call's arguments once evaluated.
struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keywords;
};

struct Function {
  std::string name;
  std::function<Value(Interpreter&, Args&)> call;
};

struct Undefined {
  std::string hint;  // the UndefinedError message raised when the value is used
};

// Bookkeeping for one render on the calling thread, installed by the evaluator for its duration:
// - a budget of work: loop iterations and macro calls spend from it (and walks over sequences, one
//   unit per 16 items), so that nested range() loops or a recursive macro fail with a clear error
//   instead of running for hours;
// - the containers made, which are emptied when the render ends: a namespace holding itself or a
//   list appended to itself would otherwise leak through its shared_ptr cycle.
class RenderState {
 public:
  explicit RenderState(size_t work_units);
  ~RenderState();
  RenderState(const RenderState&) = delete;
  RenderState& operator=(const RenderState&) = delete;

 private:
  friend void spend(size_t units);
  friend class Value;
  template <class T>
  static void track(std::vector<std::weak_ptr<T>>& made, const std::shared_ptr<T>& p);

  size_t work_left_;
  std::vector<std::weak_ptr<List>> lists_;
  std::vector<std::weak_ptr<Dict>> dicts_;
  std::vector<std::weak_ptr<Namespace>> namespaces_;
  RenderState* previous_;
};
void spend(size_t units);  // raises once the render's budget is used up; free outside a render
void spend_walk(size_t items);  // walking a sequence: one unit per 16 items

bool truthy(const Value& v);
bool equals(const Value& a, const Value& b);
enum class CmpOp : uint8_t { Lt, Le, Gt, Ge };
bool compare(CmpOp op, const Value& a, const Value& b);  // raises TypeError for unorderable operands
std::string to_str(const Value& v);                      // str(v); an undefined value prints as ""
std::string to_repr(const Value& v);                     // repr(v)
std::string type_name(const Value& v);                   // type(v).__name__: 'int', 'str', 'NoneType', ...
std::string object_type_repr(const Value& v);            // jinja2's wording: 'dict object', 'None', ...
[[noreturn]] void raise_undefined(const Value& v);       // the UndefinedError an undefined value raises
std::vector<Value> iterate(const Value& v);              // iter(v) drained; undefined iterates as empty
size_t length(const Value& v);                           // len(v)
Value from_json(const nlohmann::ordered_json& j);

}  // namespace sparsemla::chat::jinja
