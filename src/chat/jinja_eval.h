// The tree-walking evaluator: renders a Program with jinja2's scoping (a for loop's body and a
// macro get their own scope, if does not), loop variables, macros with caller(), and the limits that
// keep any template from crashing or running away.
#pragma once
#include <nlohmann/json.hpp>

#include <deque>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chat/jinja_ast.h"
#include "chat/jinja_value.h"

namespace sparsemla::chat::jinja {

// Name lookup walks from the innermost scope out to the render context and the globals.
struct Scope {
  Scope* parent = nullptr;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* lookup(std::string_view name) const;
  void set(std::string_view name, Value value);
};

class Interpreter {
 public:
  explicit Interpreter(const Program& program) : program_(program) {}
  std::string render(const nlohmann::ordered_json& context);

 private:
  enum class Flow { Normal, Break, Continue };

  Value eval(const Expr& e, Scope& s);
  Value eval_node(const Expr& e, Scope& s);
  Value eval_compare(const CompareExpr& e, Scope& s);
  Value eval_call(const CallExpr& e, Scope& s, std::vector<std::pair<std::string, Value>> extra_keywords = {});
  Value eval_filter(const FilterExpr& e, Scope& s, const Value* block_input);
  Args eval_args(const CallArgs& a, Scope& s);

  Flow exec_body(const Body& body, Scope& s);
  Flow exec(const Stmt& st, Scope& s);
  Flow exec_node(const Stmt& st, Scope& s);
  Flow exec_for(const ForStmt& st, Scope& s);
  std::string capture(const Body& body, Scope& s);
  Value apply_block_filter(const Expr& filter, Value input, Scope& s);

  void assign(const Target& t, Value v, Scope& s);
  Value make_macro(const MacroStmt& m, Scope& closure);
  Value call_macro(const MacroStmt& m, Scope& closure, Args& args);
  Scope& new_scope(Scope* parent);
  void release_scopes(size_t mark, size_t macros_before);
  void emit(std::string_view text);

  const Program& program_;
  // The scopes alive in this render. Macros keep a pointer to the scope they were defined in, so a
  // scope is dropped after its loop iteration or call only when no macro was made meanwhile.
  std::deque<Scope> scopes_;
  size_t macros_made_ = 0;
  std::string* out_ = nullptr;
  int depth_ = 0;
};

}  // namespace sparsemla::chat::jinja
