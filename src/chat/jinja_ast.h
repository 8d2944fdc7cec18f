// The syntax tree of a parsed template: expressions and statements as jinja2's parser builds them.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat/jinja_lexer.h"
#include "chat/jinja_value.h"

namespace sparsemla::chat::jinja {

// Builtin filters and tests, resolved by name when the template is parsed.
using FilterFn = Value (*)(Interpreter&, const Value& input, Args& args);
using TestFn = bool (*)(Interpreter&, const Value& input, Args& args);

struct Expr {
  enum class Kind : uint8_t {
    Literal, Name, List, Tuple, Dict, Neg, Plus, Not, And, Or, Binary, Concat, Compare, Cond,
    GetAttr, GetItem, Slice, Call, Filter, Test,
  };
  Expr(Kind k, Pos p) : kind(k), pos(p) {}
  virtual ~Expr() = default;

  Kind kind;
  Pos pos;
  int height = 1;  // of the subtree: the parser refuses trees deep enough to exhaust the stack
};
using ExprPtr = std::unique_ptr<Expr>;

struct LiteralExpr : Expr {
  using Expr::Expr;
  Value value;
};

struct NameExpr : Expr {
  using Expr::Expr;
  std::string name;
};

struct SeqExpr : Expr {  // List and Tuple
  using Expr::Expr;
  std::vector<ExprPtr> items;
};

struct DictExpr : Expr {
  using Expr::Expr;
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
};

struct UnaryExpr : Expr {  // Neg, Plus, Not
  using Expr::Expr;
  ExprPtr operand;
};

enum class BinOp : uint8_t { Add, Sub, Mul, Div, FloorDiv, Mod, Pow };

struct BinaryExpr : Expr {  // Binary (with op), And, Or
  using Expr::Expr;
  BinOp op = BinOp::Add;
  ExprPtr left;
  ExprPtr right;
};

struct ConcatExpr : Expr {  // a ~ b ~ c
  using Expr::Expr;
  std::vector<ExprPtr> parts;
};

enum class CmpKind : uint8_t { Eq, Ne, Lt, Le, Gt, Ge, In, NotIn };

struct CompareExpr : Expr {  // a < b <= c: chained as in Python
  using Expr::Expr;
  ExprPtr first;
  std::vector<std::pair<CmpKind, ExprPtr>> rest;
};

struct CondExpr : Expr {  // then if test else otherwise; no else gives undefined
  using Expr::Expr;
  ExprPtr test;
  ExprPtr then;
  ExprPtr otherwise;
};

struct GetAttrExpr : Expr {  // object.name
  using Expr::Expr;
  ExprPtr object;
  std::string name;
};

struct GetItemExpr : Expr {  // object[index]
  using Expr::Expr;
  ExprPtr object;
  ExprPtr index;
};

struct SliceExpr : Expr {  // start:stop:step inside [], each part optional
  using Expr::Expr;
  ExprPtr start;
  ExprPtr stop;
  ExprPtr step;
};

struct CallArgs {
  std::vector<ExprPtr> positional;
  std::vector<std::pair<std::string, ExprPtr>> keywords;
  ExprPtr star_args;    // *args
  ExprPtr star_kwargs;  // **kwargs
};

struct CallExpr : Expr {
  using Expr::Expr;
  ExprPtr callee;
  CallArgs args;
};

struct FilterExpr : Expr {  // operand|name(args); in {% filter %} and {% set x | f %} the innermost operand is null
  using Expr::Expr;
  ExprPtr operand;
  std::string name;
  CallArgs args;
  FilterFn fn = nullptr;  // null: unknown filter in an if branch, an error only if evaluated
};

struct TestExpr : Expr {  // operand is name(args); "is not" wraps it in Not
  using Expr::Expr;
  ExprPtr operand;
  std::string name;
  CallArgs args;
  TestFn fn = nullptr;
};

struct Stmt {
  enum class Kind : uint8_t {
    Text, Output, If, For, Set, SetBlock, Macro, CallBlock, FilterBlock, With, Break, Continue,
  };
  Stmt(Kind k, Pos p) : kind(k), pos(p) {}
  virtual ~Stmt() = default;

  Kind kind;
  Pos pos;
};
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

// What set, for and with assign to: a name, namespace.attribute, or a tuple to unpack.
struct Target {
  Pos pos;
  std::string name;
  std::string attr;  // non-empty: name.attr on a namespace
  bool is_tuple = false;
  std::vector<Target> items;
};

struct TextStmt : Stmt {
  using Stmt::Stmt;
  std::string text;
};

struct OutputStmt : Stmt {
  using Stmt::Stmt;
  ExprPtr expr;
};

struct IfStmt : Stmt {
  using Stmt::Stmt;
  std::vector<std::pair<ExprPtr, Body>> branches;  // if and each elif
  Body otherwise;
};

struct ForStmt : Stmt {
  using Stmt::Stmt;
  Target target;
  ExprPtr iter;
  ExprPtr filter;  // for x in xs if filter
  Body body;
  Body otherwise;  // rendered when no item was iterated
};

struct SetStmt : Stmt {
  using Stmt::Stmt;
  Target target;
  ExprPtr value;
};

struct SetBlockStmt : Stmt {  // {% set x | filter %}body{% endset %}
  using Stmt::Stmt;
  Target target;
  ExprPtr filter;  // a FilterExpr chain or null
  Body body;
};

struct MacroStmt : Stmt {
  using Stmt::Stmt;
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // for the last defaults.size() params
  Body body;
  // Whether the body reads these names: jinja2 only accepts extra positional arguments, extra
  // keyword arguments and a caller when it does.
  bool uses_caller = false;
  bool uses_varargs = false;
  bool uses_kwargs = false;
};

struct CallBlockStmt : Stmt {  // {% call(params) macro(args) %}body{% endcall %}
  using Stmt::Stmt;
  std::unique_ptr<MacroStmt> caller;
  ExprPtr call;  // a CallExpr
};

struct FilterBlockStmt : Stmt {
  using Stmt::Stmt;
  ExprPtr filter;
  Body body;
};

struct WithStmt : Stmt {  // also {% generation %}, which only scopes its body
  using Stmt::Stmt;
  std::vector<std::pair<Target, ExprPtr>> assignments;
  Body body;
};

struct Program {
  Body body;
};

}  // namespace sparsemla::chat::jinja
