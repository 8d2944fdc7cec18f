#include "chat/jinja_eval.h"

#include <memory>
#include <optional>

#include "chat/jinja.h"
#include "chat/jinja_builtins.h"
#include "chat/jinja_ops.h"

namespace sparsemla::chat::jinja {

namespace {

// Nested evaluation frames (expressions, statements, macro calls): bounds the C++ stack.
constexpr int kMaxEvalDepth = 500;
// Work units per render (see RenderState): a chat template over thousands of messages stays far
// below, a runaway one stops within seconds.
constexpr size_t kWorkBudget = 5'000'000;

class DepthGuard {
 public:
  explicit DepthGuard(int& depth) : depth_(depth) {
    if (++depth_ > kMaxEvalDepth) raise("the template recursed more than {} levels deep", kMaxEvalDepth);
  }
  ~DepthGuard() { --depth_; }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;

 private:
  int& depth_;
};

[[noreturn]] void rethrow_at(Pos p, const RuntimeError& e) { throw TemplateError(p.line, p.column, e.what()); }

}  // namespace

const Value* Scope::lookup(std::string_view name) const {
  for (const Scope* s = this; s != nullptr; s = s->parent) {
    for (const auto& [k, v] : s->vars) {
      if (k == name) return &v;
    }
  }
  return nullptr;
}

void Scope::set(std::string_view name, Value value) {
  for (auto& [k, v] : vars) {
    if (k == name) {
      v = std::move(value);
      return;
    }
  }
  vars.emplace_back(std::string(name), std::move(value));
}

std::string Interpreter::render(const nlohmann::ordered_json& context) {
  if (!context.is_object()) throw TemplateError(0, 0, "the render context must be a JSON object");
  RenderState state(kWorkBudget);
  Scope& globals = new_scope(nullptr);
  globals.vars = make_globals();
  Scope& vars = new_scope(&globals);
  try {
    for (const auto& [k, v] : context.items()) vars.set(k, from_json(v));
  } catch (const RuntimeError& e) {
    throw TemplateError(0, 0, std::string("in the render context: ") + e.what());
  }
  std::string out;
  out_ = &out;
  exec_body(program_.body, new_scope(&vars));
  return out;
}

Scope& Interpreter::new_scope(Scope* parent) {
  scopes_.emplace_back();
  scopes_.back().parent = parent;
  return scopes_.back();
}

void Interpreter::release_scopes(size_t mark, size_t macros_before) {
  if (macros_made_ == macros_before && scopes_.size() > mark) scopes_.resize(mark);
}

void Interpreter::emit(std::string_view text) {
  if (out_->size() + text.size() > kMaxStringBytes) raise("the output is larger than {} bytes", kMaxStringBytes);
  out_->append(text);
}

// ---- expressions ----

Value Interpreter::eval(const Expr& e, Scope& s) {
  try {
    DepthGuard guard(depth_);
    return eval_node(e, s);
  } catch (const RuntimeError& err) {
    rethrow_at(e.pos, err);
  }
}

Value Interpreter::eval_node(const Expr& e, Scope& s) {
  switch (e.kind) {
    case Expr::Kind::Literal:
      return static_cast<const LiteralExpr&>(e).value;
    case Expr::Kind::Name: {
      const std::string& name = static_cast<const NameExpr&>(e).name;
      if (const Value* v = s.lookup(name)) return *v;
      return Value::undefined("'" + name + "' is undefined");
    }
    case Expr::Kind::List:
    case Expr::Kind::Tuple: {
      std::vector<Value> items;
      for (const auto& item : static_cast<const SeqExpr&>(e).items) items.push_back(eval(*item, s));
      return Value::list(std::move(items), e.kind == Expr::Kind::Tuple ? SeqKind::Tuple : SeqKind::List);
    }
    case Expr::Kind::Dict: {
      Dict d;
      for (const auto& [k, v] : static_cast<const DictExpr&>(e).items) {
        Value key = eval(*k, s);
        d.set(std::move(key), eval(*v, s));
      }
      return Value::dict(std::move(d));
    }
    case Expr::Kind::Neg:
      return negate(eval(*static_cast<const UnaryExpr&>(e).operand, s));
    case Expr::Kind::Plus:
      return unary_plus(eval(*static_cast<const UnaryExpr&>(e).operand, s));
    case Expr::Kind::Not:
      return Value::boolean(!truthy(eval(*static_cast<const UnaryExpr&>(e).operand, s)));
    case Expr::Kind::And:
    case Expr::Kind::Or: {
      const auto& b = static_cast<const BinaryExpr&>(e);
      Value left = eval(*b.left, s);
      if (truthy(left) == (e.kind == Expr::Kind::Or)) return left;
      return eval(*b.right, s);
    }
    case Expr::Kind::Binary: {
      const auto& b = static_cast<const BinaryExpr&>(e);
      Value left = eval(*b.left, s);
      return binary_op(b.op, left, eval(*b.right, s));
    }
    case Expr::Kind::Concat: {
      std::string out;
      for (const auto& part : static_cast<const ConcatExpr&>(e).parts) {
        out += to_str(eval(*part, s));
        check_size(out);
      }
      return Value::string(std::move(out));
    }
    case Expr::Kind::Compare:
      return eval_compare(static_cast<const CompareExpr&>(e), s);
    case Expr::Kind::Cond: {
      const auto& c = static_cast<const CondExpr&>(e);
      if (truthy(eval(*c.test, s))) return eval(*c.then, s);
      if (c.otherwise) return eval(*c.otherwise, s);
      return Value::undefined(fmt::format(
          "the inline if-expression on line {} evaluated to false and no else section was defined.", e.pos.line));
    }
    case Expr::Kind::GetAttr: {
      const auto& g = static_cast<const GetAttrExpr&>(e);
      return get_attr(eval(*g.object, s), g.name);
    }
    case Expr::Kind::GetItem: {
      const auto& g = static_cast<const GetItemExpr&>(e);
      Value object = eval(*g.object, s);
      if (g.index->kind == Expr::Kind::Slice) {
        const auto& sl = static_cast<const SliceExpr&>(*g.index);
        const auto part = [&](const ExprPtr& p) { return p ? eval(*p, s) : Value::none(); };
        Value start = part(sl.start);
        Value stop = part(sl.stop);
        return get_slice(object, start, stop, part(sl.step));
      }
      return get_item(object, eval(*g.index, s));
    }
    case Expr::Kind::Slice:
      raise("a slice can only be used directly inside []");
    case Expr::Kind::Call:
      return eval_call(static_cast<const CallExpr&>(e), s);
    case Expr::Kind::Filter:
      return eval_filter(static_cast<const FilterExpr&>(e), s, nullptr);
    case Expr::Kind::Test: {
      const auto& t = static_cast<const TestExpr&>(e);
      if (t.fn == nullptr) raise("No test named '{}'.", t.name);
      Value v = eval(*t.operand, s);
      Args args = eval_args(t.args, s);
      return Value::boolean(t.fn(*this, v, args));
    }
  }
  raise("unknown expression");
}

Value Interpreter::eval_compare(const CompareExpr& e, Scope& s) {
  Value left = eval(*e.first, s);
  for (const auto& [op, expr] : e.rest) {
    Value right = eval(*expr, s);
    bool ok = false;
    switch (op) {
      case CmpKind::Eq:
        ok = equals(left, right);
        break;
      case CmpKind::Ne:
        ok = !equals(left, right);
        break;
      case CmpKind::Lt:
        ok = compare(CmpOp::Lt, left, right);
        break;
      case CmpKind::Le:
        ok = compare(CmpOp::Le, left, right);
        break;
      case CmpKind::Gt:
        ok = compare(CmpOp::Gt, left, right);
        break;
      case CmpKind::Ge:
        ok = compare(CmpOp::Ge, left, right);
        break;
      case CmpKind::In:
        ok = contains(right, left);
        break;
      case CmpKind::NotIn:
        ok = !contains(right, left);
        break;
    }
    if (!ok) return Value::boolean(false);
    left = std::move(right);
  }
  return Value::boolean(true);
}

Args Interpreter::eval_args(const CallArgs& a, Scope& s) {
  Args args;
  for (const auto& p : a.positional) args.positional.push_back(eval(*p, s));
  if (a.star_args) {
    for (Value& v : iterate(eval(*a.star_args, s))) args.positional.push_back(std::move(v));
  }
  for (const auto& [k, v] : a.keywords) args.keywords.emplace_back(k, eval(*v, s));
  if (a.star_kwargs) {
    const Value kw = eval(*a.star_kwargs, s);
    if (!kw.is_dict()) raise("argument after ** must be a mapping, not {}", type_name(kw));
    for (const auto& [k, v] : kw.as_dict().items) {
      if (!k.is_string()) raise("keywords must be strings");
      args.keywords.emplace_back(k.as_string(), v);
    }
  }
  return args;
}

Value Interpreter::eval_call(const CallExpr& e, Scope& s, std::vector<std::pair<std::string, Value>> extra_keywords) {
  Value callee = eval(*e.callee, s);
  Args args = eval_args(e.args, s);
  for (auto& kv : extra_keywords) args.keywords.push_back(std::move(kv));
  return call_value(*this, callee, args);
}

Value Interpreter::eval_filter(const FilterExpr& f, Scope& s, const Value* block_input) {
  Value input;
  if (!f.operand) {
    input = *block_input;
  } else if (block_input) {  // in {% filter a|b %} every operand of the chain is a filter
    input = eval_filter(static_cast<const FilterExpr&>(*f.operand), s, block_input);
  } else {
    input = eval(*f.operand, s);
  }
  if (f.fn == nullptr) raise("No filter named '{}'.", f.name);
  Args args = eval_args(f.args, s);
  return f.fn(*this, input, args);
}

Value Interpreter::apply_block_filter(const Expr& filter, Value input, Scope& s) {
  try {
    return eval_filter(static_cast<const FilterExpr&>(filter), s, &input);
  } catch (const RuntimeError& err) {
    rethrow_at(filter.pos, err);
  }
}

// ---- statements ----

Interpreter::Flow Interpreter::exec_body(const Body& body, Scope& s) {
  for (const auto& st : body) {
    const Flow f = exec(*st, s);
    if (f != Flow::Normal) return f;
  }
  return Flow::Normal;
}

Interpreter::Flow Interpreter::exec(const Stmt& st, Scope& s) {
  try {
    DepthGuard guard(depth_);
    return exec_node(st, s);
  } catch (const RuntimeError& err) {
    rethrow_at(st.pos, err);
  }
}

std::string Interpreter::capture(const Body& body, Scope& s) {
  std::string text;
  std::string* saved = std::exchange(out_, &text);
  try {
    exec_body(body, s);
  } catch (...) {
    out_ = saved;
    throw;
  }
  out_ = saved;
  return text;
}

Interpreter::Flow Interpreter::exec_node(const Stmt& st, Scope& s) {
  switch (st.kind) {
    case Stmt::Kind::Text:
      emit(static_cast<const TextStmt&>(st).text);
      return Flow::Normal;
    case Stmt::Kind::Output:
      emit(to_str(eval(*static_cast<const OutputStmt&>(st).expr, s)));
      return Flow::Normal;
    case Stmt::Kind::If: {
      const auto& i = static_cast<const IfStmt&>(st);
      for (const auto& [test, body] : i.branches) {
        if (truthy(eval(*test, s))) return exec_body(body, s);
      }
      return exec_body(i.otherwise, s);
    }
    case Stmt::Kind::For:
      return exec_for(static_cast<const ForStmt&>(st), s);
    case Stmt::Kind::Set: {
      const auto& set = static_cast<const SetStmt&>(st);
      assign(set.target, eval(*set.value, s), s);
      return Flow::Normal;
    }
    case Stmt::Kind::SetBlock: {
      const auto& set = static_cast<const SetBlockStmt&>(st);
      const size_t mark = scopes_.size();
      const size_t macros = macros_made_;
      Value v = Value::string(capture(set.body, new_scope(&s)));
      if (set.filter) v = apply_block_filter(*set.filter, std::move(v), s);
      release_scopes(mark, macros);
      assign(set.target, std::move(v), s);
      return Flow::Normal;
    }
    case Stmt::Kind::Macro: {
      const auto& m = static_cast<const MacroStmt&>(st);
      s.set(m.name, make_macro(m, s));
      return Flow::Normal;
    }
    case Stmt::Kind::CallBlock: {
      const auto& c = static_cast<const CallBlockStmt&>(st);
      Value caller = make_macro(*c.caller, s);
      emit(to_str(eval_call(static_cast<const CallExpr&>(*c.call), s, {{"caller", std::move(caller)}})));
      return Flow::Normal;
    }
    case Stmt::Kind::FilterBlock: {
      const auto& f = static_cast<const FilterBlockStmt&>(st);
      const size_t mark = scopes_.size();
      const size_t macros = macros_made_;
      Value text = Value::string(capture(f.body, new_scope(&s)));
      emit(to_str(apply_block_filter(*f.filter, std::move(text), s)));
      release_scopes(mark, macros);
      return Flow::Normal;
    }
    case Stmt::Kind::With: {
      const auto& w = static_cast<const WithStmt&>(st);
      const size_t mark = scopes_.size();
      const size_t macros = macros_made_;
      Scope& inner = new_scope(&s);
      for (const auto& [target, expr] : w.assignments) assign(target, eval(*expr, s), inner);
      const Flow f = exec_body(w.body, inner);
      release_scopes(mark, macros);
      return f;
    }
    case Stmt::Kind::Break:
      return Flow::Break;
    case Stmt::Kind::Continue:
      return Flow::Continue;
  }
  return Flow::Normal;
}

Interpreter::Flow Interpreter::exec_for(const ForStmt& st, Scope& s) {
  std::vector<Value> items = iterate(eval(*st.iter, s));
  if (st.filter) {
    std::vector<Value> kept;
    for (Value& item : items) {
      const size_t mark = scopes_.size();
      Scope& test_scope = new_scope(&s);
      assign(st.target, item, test_scope);
      const bool keep = truthy(eval(*st.filter, test_scope));
      release_scopes(mark, macros_made_);
      if (keep) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  const size_t mark = scopes_.size();
  const size_t macros = macros_made_;
  // loop.cycle and loop.changed, shared by the iterations; cycle reads the current index.
  auto index = std::make_shared<size_t>(0);
  LoopState state;
  state.cycle = Value::function("loop.cycle", [index](Interpreter&, Args& args) {
    if (!args.keywords.empty()) raise("cycle() takes no keyword arguments");
    if (args.positional.empty()) raise("no items for cycling given");
    return args.positional[*index % args.positional.size()];
  });
  auto last_changed = std::make_shared<std::optional<Value>>();
  state.changed = Value::function("loop.changed", [last_changed](Interpreter&, Args& args) {
    Value current = Value::list(args.positional);
    if (*last_changed && equals(**last_changed, current)) return Value::boolean(false);
    *last_changed = std::move(current);
    return Value::boolean(true);
  });
  state.items = std::make_shared<const std::vector<Value>>(std::move(items));
  bool completed = false;  // jinja2 renders the else block unless an iteration ran to its end
  for (size_t i = 0; i < state.items->size(); ++i) {
    spend(1);
    *index = i;
    state.index = i;
    const size_t iteration_mark = scopes_.size();
    const size_t iteration_macros = macros_made_;
    Scope& it = new_scope(&s);
    assign(st.target, (*state.items)[i], it);
    it.set("loop", Value::ns(Namespace{Dict{}, std::make_shared<const LoopState>(state)}));
    const Flow f = exec_body(st.body, it);
    release_scopes(iteration_mark, iteration_macros);
    if (f == Flow::Break) break;
    completed = completed || f == Flow::Normal;
  }
  if (completed) return Flow::Normal;
  const Flow f = exec_body(st.otherwise, new_scope(&s));
  release_scopes(mark, macros);
  return f == Flow::Break || f == Flow::Continue ? Flow::Normal : f;
}

void Interpreter::assign(const Target& t, Value v, Scope& s) {
  if (!t.attr.empty()) {
    const Value* ns = s.lookup(t.name);
    if (ns == nullptr || !ns->is_namespace() || ns->as_namespace().is_loop()) {
      raise("cannot assign attribute on non-namespace object");
    }
    ns->as_namespace().attrs.set(Value::string(t.attr), std::move(v));
    return;
  }
  if (!t.is_tuple) {
    s.set(t.name, std::move(v));
    return;
  }
  std::vector<Value> items = iterate(v);
  if (items.size() < t.items.size()) {
    raise("not enough values to unpack (expected {}, got {})", t.items.size(), items.size());
  }
  if (items.size() > t.items.size()) raise("too many values to unpack (expected {})", t.items.size());
  for (size_t i = 0; i < items.size(); ++i) assign(t.items[i], std::move(items[i]), s);
}

Value Interpreter::make_macro(const MacroStmt& m, Scope& closure) {
  ++macros_made_;
  const MacroStmt* macro = &m;
  Scope* scope = &closure;
  return Value::function(m.name, [macro, scope](Interpreter& in, Args& args) {
    return in.call_macro(*macro, *scope, args);
  });
}

Value Interpreter::call_macro(const MacroStmt& m, Scope& closure, Args& args) {
  spend(1);
  const size_t mark = scopes_.size();
  const size_t macros = macros_made_;
  Scope& s = new_scope(&closure);
  const size_t n = m.params.size();
  std::vector<bool> given(n, false);
  for (size_t i = 0; i < std::min(n, args.positional.size()); ++i) {
    s.set(m.params[i], args.positional[i]);
    given[i] = true;
  }
  if (args.positional.size() > n && !m.uses_varargs) {
    raise("macro '{}' takes not more than {} argument(s)", m.name, n);
  }
  std::vector<Value> varargs(args.positional.begin() + std::ptrdiff_t(std::min(n, args.positional.size())),
                             args.positional.end());
  Dict kwargs;
  std::optional<Value> caller;
  for (auto& [k, v] : args.keywords) {
    const auto p = std::find(m.params.begin(), m.params.end(), k);
    if (p != m.params.end()) {
      const auto i = size_t(p - m.params.begin());
      if (given[i]) raise("macro '{}' got multiple values for argument '{}'", m.name, k);
      s.set(k, v);
      given[i] = true;
    } else if (k == "caller" && m.uses_caller) {
      caller = v;
    } else if (m.uses_kwargs) {
      kwargs.set(Value::string(k), v);
    } else {
      raise("macro '{}' takes no keyword argument '{}'", m.name, k);
    }
  }
  const size_t first_default = n - m.defaults.size();
  for (size_t i = 0; i < n; ++i) {
    if (given[i]) continue;
    s.set(m.params[i], i >= first_default ? eval(*m.defaults[i - first_default], s)
                                          : Value::undefined("parameter '" + m.params[i] + "' was not provided"));
  }
  if (m.uses_varargs) s.set("varargs", Value::list(std::move(varargs), SeqKind::Tuple));
  if (m.uses_kwargs) s.set("kwargs", Value::dict(std::move(kwargs)));
  if (m.uses_caller) s.set("caller", caller ? *caller : Value::undefined("No caller defined"));
  Value result = Value::string(capture(m.body, s));
  release_scopes(mark, macros);
  return result;
}

}  // namespace sparsemla::chat::jinja
