#include "chat/jinja_parser.h"

#include <algorithm>
#include <functional>

#include "chat/jinja.h"
#include "chat/jinja_builtins.h"
#include "chat/jinja_pystr.h"

namespace sparsemla::chat::jinja {

namespace {

// Deeper templates are refused: parsing, evaluating and destroying the tree all recurse.
constexpr int kMaxDepth = 200;

[[noreturn]] void fail(Pos p, const std::string& message) { throw TemplateError(p.line, p.column, message); }

std::string describe(const Token& t) {
  switch (t.type) {
    case Tok::Text:
      return "template text";
    case Tok::VarBegin:
      return "'{{'";
    case Tok::VarEnd:
      return "'}}'";
    case Tok::BlockBegin:
      return "'{%'";
    case Tok::BlockEnd:
      return "'%}'";
    case Tok::Name:
    case Tok::Operator:
      return "'" + t.text + "'";
    case Tok::String:
      return "string " + py::repr(t.text.size() > 40 ? t.text.substr(0, py::byte_offset(t.text, 40)) + "..." : t.text);
    case Tok::Integer:
      return "number " + std::to_string(t.int_value);
    case Tok::Float:
      return "number " + py::float_repr(t.float_value);
    case Tok::End:
      return "end of template";
  }
  return "?";
}

std::string quoted_list(const std::vector<std::string_view>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out += i + 1 == names.size() ? " or " : ", ";
    out += "'" + std::string(names[i]) + "'";
  }
  return out;
}

template <class T>
std::unique_ptr<T> make_expr(Expr::Kind k, Pos p) {
  return std::make_unique<T>(k, p);
}

template <class T>
std::unique_ptr<T> make_stmt(Stmt::Kind k, Pos p) {
  return std::make_unique<T>(k, p);
}

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : toks_(std::move(toks)) {}

  std::unique_ptr<Program> run() {
    auto program = std::make_unique<Program>();
    program->body = subparse({});
    return program;
  }

 private:
  struct Open {  // a block being parsed, for "expected 'endfor'" messages
    std::string tag;
    std::vector<std::string_view> ends;
    int line;
  };

  class DepthGuard {
   public:
    explicit DepthGuard(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxDepth) fail(p_.cur().pos, fmt::format("the template nests more than {} levels deep", kMaxDepth));
    }
    ~DepthGuard() { --p_.depth_; }
    DepthGuard(const DepthGuard&) = delete;
    DepthGuard& operator=(const DepthGuard&) = delete;

   private:
    Parser& p_;
  };

  class OpenGuard {
   public:
    OpenGuard(Parser& p, const Token& tag, std::vector<std::string_view> ends) : p_(p) {
      p_.open_.push_back(Open{tag.text, std::move(ends), tag.pos.line});
    }
    ~OpenGuard() { p_.open_.pop_back(); }
    OpenGuard(const OpenGuard&) = delete;
    OpenGuard& operator=(const OpenGuard&) = delete;

   private:
    Parser& p_;
  };

  const Token& cur() const { return toks_[i_]; }
  const Token& peek() const { return toks_[std::min(i_ + 1, toks_.size() - 1)]; }
  const Token& take() {
    const Token& t = toks_[i_];
    if (i_ + 1 < toks_.size()) ++i_;
    return t;
  }
  bool is_op(std::string_view op) const { return cur().type == Tok::Operator && cur().text == op; }
  bool is_name(std::string_view n) const { return cur().type == Tok::Name && cur().text == n; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    take();
    return true;
  }
  bool skip_name(std::string_view n) {
    if (!is_name(n)) return false;
    take();
    return true;
  }
  [[noreturn]] void fail_expected(const std::string& what) const {
    fail(cur().pos, "expected " + what + ", found " + describe(cur()));
  }
  const Token& expect_op(std::string_view op) {
    if (!is_op(op)) fail_expected("'" + std::string(op) + "'");
    return take();
  }
  const Token& expect_identifier() {
    if (cur().type != Tok::Name) fail_expected("a name");
    return take();
  }
  void expect(Tok type, const char* what) {
    if (cur().type != type) fail_expected(what);
    take();
  }

  // Keeps every expression tree shallow enough to evaluate and destroy recursively.
  void grow(Expr& parent, const ExprPtr& child) {
    if (!child) return;
    parent.height = std::max(parent.height, child->height + 1);
    if (parent.height > kMaxDepth) fail(parent.pos, fmt::format("the expression nests more than {} levels deep", kMaxDepth));
  }
  void grow(Expr& parent, const CallArgs& args) {
    for (const auto& a : args.positional) grow(parent, a);
    for (const auto& kv : args.keywords) grow(parent, kv.second);
    grow(parent, args.star_args);
    grow(parent, args.star_kwargs);
  }

  // ---- statements ----

  Body subparse(const std::vector<std::string_view>& ends) {
    Body body;
    while (true) {
      const Token& t = cur();
      switch (t.type) {
        case Tok::Text: {
          auto s = make_stmt<TextStmt>(Stmt::Kind::Text, t.pos);
          s->text = t.text;
          take();
          body.push_back(std::move(s));
          break;
        }
        case Tok::VarBegin: {
          take();
          auto s = make_stmt<OutputStmt>(Stmt::Kind::Output, cur().pos);
          s->expr = parse_tuple(false, true, {}, false);
          expect(Tok::VarEnd, "'}}'");
          body.push_back(std::move(s));
          break;
        }
        case Tok::BlockBegin:
          take();
          if (cur().type == Tok::Name && std::find(ends.begin(), ends.end(), cur().text) != ends.end()) return body;
          parse_statement(body);
          expect(Tok::BlockEnd, "'%}'");
          break;
        case Tok::End:
          if (!ends.empty()) fail_unclosed();
          return body;
        default:
          fail_expected("template text or a tag");
      }
    }
  }

  [[noreturn]] void fail_unclosed() const {
    const Open& o = open_.back();
    fail_expected(quoted_list(o.ends) + " (to close the '" + o.tag + "' on line " + std::to_string(o.line) + ")");
  }

  // The body of a block statement: from the end of its opening tag to one of `ends`, which is
  // consumed when drop_end is set.
  Body parse_statements(const std::vector<std::string_view>& ends, bool drop_end) {
    skip_op(":");
    expect(Tok::BlockEnd, "'%}'");
    Body b = subparse(ends);
    if (drop_end) take();
    return b;
  }

  void parse_statement(Body& out) {
    DepthGuard guard(*this);
    const Token& t = cur();
    if (t.type != Tok::Name) fail_expected("a tag name");
    const std::string& tag = t.text;
    if (tag == "for") {
      out.push_back(parse_for());
    } else if (tag == "if") {
      out.push_back(parse_if());
    } else if (tag == "set") {
      out.push_back(parse_set());
    } else if (tag == "macro") {
      out.push_back(parse_macro());
    } else if (tag == "call") {
      out.push_back(parse_call_block());
    } else if (tag == "filter") {
      out.push_back(parse_filter_block());
    } else if (tag == "with" || tag == "generation") {
      out.push_back(parse_with());
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail(t.pos, "'" + tag + "' outside of a for loop");
      out.push_back(make_stmt<Stmt>(tag == "break" ? Stmt::Kind::Break : Stmt::Kind::Continue, take().pos));
    } else if (tag == "print") {
      take();
      for (bool first = true; cur().type != Tok::BlockEnd; first = false) {
        if (!first) expect_op(",");
        auto s = make_stmt<OutputStmt>(Stmt::Kind::Output, cur().pos);
        s->expr = parse_expression(true);
        out.push_back(std::move(s));
      }
    } else if (tag == "block" || tag == "extends" || tag == "include" || tag == "import" || tag == "from" ||
               tag == "autoescape") {
      fail(t.pos, "the '" + tag + "' tag is not supported in chat templates");
    } else if (!open_.empty()) {
      fail_unclosed();
    } else {
      fail(t.pos, "unknown tag '" + tag + "'");
    }
  }

  StmtPtr parse_for() {
    const Token& tag = take();
    auto s = make_stmt<ForStmt>(Stmt::Kind::For, tag.pos);
    s->target = parse_assign_target({"in"}, false, false);
    if (!skip_name("in")) fail_expected("'in'");
    s->iter = parse_tuple(false, false, {"recursive"}, false);
    if (skip_name("if")) s->filter = parse_expression(true);
    if (is_name("recursive")) fail(cur().pos, "recursive for loops are not supported");
    OpenGuard open(*this, tag, {"endfor", "else"});
    ++loop_depth_;
    s->body = parse_statements({"endfor", "else"}, false);
    --loop_depth_;
    if (take().text == "else") s->otherwise = parse_statements({"endfor"}, true);
    return s;
  }

  StmtPtr parse_if() {
    const Token& tag = take();
    auto s = make_stmt<IfStmt>(Stmt::Kind::If, tag.pos);
    OpenGuard open(*this, tag, {"elif", "else", "endif"});
    while (true) {
      ExprPtr test = parse_tuple(false, false, {}, false);
      Body body = parse_statements({"elif", "else", "endif"}, false);
      s->branches.emplace_back(std::move(test), std::move(body));
      const std::string& next = take().text;
      if (next == "else") {
        open_.back().ends = {"endif"};
        s->otherwise = parse_statements({"endif"}, true);
        break;
      }
      if (next == "endif") break;
    }
    return s;
  }

  StmtPtr parse_set() {
    const Token& tag = take();
    Target target = parse_assign_target({}, true, false);
    if (skip_op("=")) {
      auto s = make_stmt<SetStmt>(Stmt::Kind::Set, tag.pos);
      s->target = std::move(target);
      s->value = parse_tuple(false, true, {}, false);
      return s;
    }
    auto s = make_stmt<SetBlockStmt>(Stmt::Kind::SetBlock, tag.pos);
    s->target = std::move(target);
    if (is_op("|")) s->filter = parse_filter(nullptr, false);
    OpenGuard open(*this, tag, {"endset"});
    s->body = parse_statements({"endset"}, true);
    return s;
  }

  void parse_signature(MacroStmt& m) {
    expect_op("(");
    while (!is_op(")")) {
      if (!m.params.empty()) expect_op(",");
      m.params.push_back(expect_identifier().text);
      if (skip_op("=")) {
        m.defaults.push_back(parse_expression(true));
      } else if (!m.defaults.empty()) {
        fail(cur().pos, "a parameter without a default follows one with a default");
      }
    }
    expect_op(")");
  }

  // A macro body is a function of its own: a break there cannot leave an enclosing loop.
  Body parse_function_body(const Token& tag, std::string_view end) {
    OpenGuard open(*this, tag, {end});
    const int saved = std::exchange(loop_depth_, 0);
    Body b = parse_statements({end}, true);
    loop_depth_ = saved;
    return b;
  }

  StmtPtr parse_macro() {
    const Token& tag = take();
    auto s = make_stmt<MacroStmt>(Stmt::Kind::Macro, tag.pos);
    s->name = expect_identifier().text;
    parse_signature(*s);
    s->body = parse_function_body(tag, "endmacro");
    return s;
  }

  StmtPtr parse_call_block() {
    const Token& tag = take();
    auto s = make_stmt<CallBlockStmt>(Stmt::Kind::CallBlock, tag.pos);
    s->caller = make_stmt<MacroStmt>(Stmt::Kind::Macro, tag.pos);
    s->caller->name = "caller";
    if (is_op("(")) parse_signature(*s->caller);
    const Pos call_pos = cur().pos;
    s->call = parse_expression(true);
    if (s->call->kind != Expr::Kind::Call) fail(call_pos, "expected a macro call after 'call'");
    s->caller->body = parse_function_body(tag, "endcall");
    return s;
  }

  StmtPtr parse_filter_block() {
    const Token& tag = take();
    auto s = make_stmt<FilterBlockStmt>(Stmt::Kind::FilterBlock, tag.pos);
    s->filter = parse_filter(nullptr, true);
    OpenGuard open(*this, tag, {"endfilter"});
    s->body = parse_statements({"endfilter"}, true);
    return s;
  }

  StmtPtr parse_with() {
    const Token& tag = take();
    const std::string end = "end" + tag.text;
    auto s = make_stmt<WithStmt>(Stmt::Kind::With, tag.pos);
    if (tag.text == "with") {
      while (cur().type != Tok::BlockEnd) {
        if (!s->assignments.empty()) expect_op(",");
        Target target = parse_assign_target({}, false, false);
        expect_op("=");
        s->assignments.emplace_back(std::move(target), parse_expression(true));
      }
    }
    OpenGuard open(*this, tag, {end});
    s->body = parse_statements({end}, true);
    return s;
  }

  Target parse_assign_target(const std::vector<std::string_view>& extra_end, bool with_namespace, bool name_only) {
    Target t;
    t.pos = cur().pos;
    if (with_namespace && cur().type == Tok::Name && peek().type == Tok::Operator && peek().text == ".") {
      t.name = take().text;
      take();
      t.attr = expect_identifier().text;
      return t;
    }
    if (name_only) {
      t.name = expect_identifier().text;
      return t;
    }
    return to_target(*parse_tuple(true, true, extra_end, false));
  }

  Target to_target(const Expr& e) {
    Target t;
    t.pos = e.pos;
    if (e.kind == Expr::Kind::Name) {
      t.name = static_cast<const NameExpr&>(e).name;
      return t;
    }
    if (e.kind == Expr::Kind::Tuple) {
      t.is_tuple = true;
      for (const auto& item : static_cast<const SeqExpr&>(e).items) t.items.push_back(to_target(*item));
      return t;
    }
    fail(e.pos, "can only assign to a name, a tuple of names or namespace.attribute");
  }

  // ---- expressions, in jinja2's order of precedence ----

  bool is_tuple_end(const std::vector<std::string_view>& extra_end) const {
    if (cur().type == Tok::VarEnd || cur().type == Tok::BlockEnd || is_op(")")) return true;
    return cur().type == Tok::Name && std::find(extra_end.begin(), extra_end.end(), cur().text) != extra_end.end();
  }

  // Expressions separated by commas make a tuple ("a, b" or "(a, b)"); one without a comma is itself.
  ExprPtr parse_tuple(bool simplified, bool with_condexpr, const std::vector<std::string_view>& extra_end,
                      bool explicit_parentheses) {
    const Pos p = cur().pos;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(simplified ? parse_primary() : parse_expression(with_condexpr));
      if (!is_op(",")) break;
      is_tuple = true;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parentheses) fail_expected("an expression");
    }
    auto t = make_expr<SeqExpr>(Expr::Kind::Tuple, p);
    for (const auto& item : items) grow(*t, item);
    t->items = std::move(items);
    return t;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(*this);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    ExprPtr e = parse_or();
    while (is_name("if")) {
      auto c = make_expr<CondExpr>(Expr::Kind::Cond, take().pos);
      c->test = parse_or();
      if (skip_name("else")) {
        DepthGuard guard(*this);
        c->otherwise = parse_condexpr();
      }
      c->then = std::move(e);
      grow(*c, c->test);
      grow(*c, c->then);
      grow(*c, c->otherwise);
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(Expr::Kind kind, BinOp op, Pos p, ExprPtr left, ExprPtr right) {
    auto b = make_expr<BinaryExpr>(kind, p);
    b->op = op;
    grow(*b, left);
    grow(*b, right);
    b->left = std::move(left);
    b->right = std::move(right);
    return b;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      const Pos p = take().pos;
      left = binary(Expr::Kind::Or, BinOp::Add, p, std::move(left), parse_and());
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      const Pos p = take().pos;
      left = binary(Expr::Kind::And, BinOp::Add, p, std::move(left), parse_not());
    }
    return left;
  }

  ExprPtr parse_not() {
    if (!is_name("not")) return parse_compare();
    DepthGuard guard(*this);
    auto n = make_expr<UnaryExpr>(Expr::Kind::Not, take().pos);
    n->operand = parse_not();
    grow(*n, n->operand);
    return n;
  }

  ExprPtr parse_compare() {
    ExprPtr first = parse_math1();
    std::unique_ptr<CompareExpr> c;
    while (true) {
      static const std::pair<std::string_view, CmpKind> kOps[] = {
          {"==", CmpKind::Eq}, {"!=", CmpKind::Ne}, {"<", CmpKind::Lt},
          {"<=", CmpKind::Le}, {">", CmpKind::Gt},  {">=", CmpKind::Ge},
      };
      std::optional<CmpKind> kind;
      for (const auto& [text, k] : kOps) {
        if (is_op(text)) kind = k;
      }
      const Pos p = cur().pos;
      if (kind) {
        take();
      } else if (is_name("in")) {
        take();
        kind = CmpKind::In;
      } else if (is_name("not") && peek().type == Tok::Name && peek().text == "in") {
        take();
        take();
        kind = CmpKind::NotIn;
      } else {
        break;
      }
      if (!c) {
        c = make_expr<CompareExpr>(Expr::Kind::Compare, p);
        grow(*c, first);
        c->first = std::move(first);
      }
      ExprPtr operand = parse_math1();
      grow(*c, operand);
      c->rest.emplace_back(*kind, std::move(operand));
    }
    if (!c) return first;
    return c;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const BinOp op = cur().text == "+" ? BinOp::Add : BinOp::Sub;
      const Pos p = take().pos;
      left = binary(Expr::Kind::Binary, op, p, std::move(left), parse_concat());
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr first = parse_math2();
    if (!is_op("~")) return first;
    auto c = make_expr<ConcatExpr>(Expr::Kind::Concat, cur().pos);
    grow(*c, first);
    c->parts.push_back(std::move(first));
    while (skip_op("~")) {
      ExprPtr part = parse_math2();
      grow(*c, part);
      c->parts.push_back(std::move(part));
    }
    return c;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string& t = cur().text;
      const BinOp op = t == "*" ? BinOp::Mul : t == "/" ? BinOp::Div : t == "//" ? BinOp::FloorDiv : BinOp::Mod;
      const Pos p = take().pos;
      left = binary(Expr::Kind::Binary, op, p, std::move(left), parse_pow());
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const Pos p = take().pos;
      left = binary(Expr::Kind::Binary, BinOp::Pow, p, std::move(left), parse_unary(true));
    }
    return left;
  }

  // A sign binds tighter than filters and tests: "-x|abs" is "(-x)|abs".
  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      auto u = make_expr<UnaryExpr>(is_op("-") ? Expr::Kind::Neg : Expr::Kind::Plus, cur().pos);
      take();
      u->operand = parse_unary(false);
      grow(*u, u->operand);
      node = std::move(u);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    switch (t.type) {
      case Tok::Name: {
        take();
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          auto l = make_expr<LiteralExpr>(Expr::Kind::Literal, t.pos);
          l->value = Value::boolean(t.text == "true" || t.text == "True");
          return l;
        }
        if (t.text == "none" || t.text == "None") {
          auto l = make_expr<LiteralExpr>(Expr::Kind::Literal, t.pos);
          l->value = Value::none();
          return l;
        }
        auto n = make_expr<NameExpr>(Expr::Kind::Name, t.pos);
        n->name = t.text;
        return n;
      }
      case Tok::String: {
        auto l = make_expr<LiteralExpr>(Expr::Kind::Literal, t.pos);
        std::string s = take().text;
        while (cur().type == Tok::String) s += take().text;  // adjacent literals concatenate
        l->value = Value::string(std::move(s));
        return l;
      }
      case Tok::Integer:
      case Tok::Float: {
        auto l = make_expr<LiteralExpr>(Expr::Kind::Literal, t.pos);
        l->value = t.type == Tok::Integer ? Value::integer(t.int_value) : Value::number(t.float_value);
        take();
        return l;
      }
      case Tok::Operator:
        if (t.text == "(") {
          take();
          ExprPtr e = parse_tuple(false, true, {}, true);
          expect_op(")");
          return e;
        }
        if (t.text == "[") return parse_list();
        if (t.text == "{") return parse_dict();
        break;
      default:
        break;
    }
    fail_expected("an expression");
  }

  ExprPtr parse_list() {
    auto l = make_expr<SeqExpr>(Expr::Kind::List, take().pos);
    while (!is_op("]")) {
      if (!l->items.empty()) expect_op(",");
      if (is_op("]")) break;
      ExprPtr item = parse_expression(true);
      grow(*l, item);
      l->items.push_back(std::move(item));
    }
    expect_op("]");
    return l;
  }

  ExprPtr parse_dict() {
    auto d = make_expr<DictExpr>(Expr::Kind::Dict, take().pos);
    while (!is_op("}")) {
      if (!d->items.empty()) expect_op(",");
      if (is_op("}")) break;
      ExprPtr key = parse_expression(true);
      expect_op(":");
      ExprPtr value = parse_expression(true);
      grow(*d, key);
      grow(*d, value);
      d->items.emplace_back(std::move(key), std::move(value));
    }
    expect_op("}");
    return d;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filter(std::move(node), false);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr object) {
    const Token& t = take();
    if (t.text == ".") {
      if (cur().type == Tok::Name) {
        auto g = make_expr<GetAttrExpr>(Expr::Kind::GetAttr, t.pos);
        g->name = take().text;
        grow(*g, object);
        g->object = std::move(object);
        return g;
      }
      if (cur().type != Tok::Integer) fail_expected("a name or a number after '.'");
      auto index = make_expr<LiteralExpr>(Expr::Kind::Literal, cur().pos);
      index->value = Value::integer(take().int_value);
      auto g = make_expr<GetItemExpr>(Expr::Kind::GetItem, t.pos);
      grow(*g, object);
      g->object = std::move(object);
      g->index = std::move(index);
      return g;
    }
    std::vector<ExprPtr> args;
    while (!is_op("]")) {
      if (!args.empty()) expect_op(",");
      args.push_back(parse_subscribed());
    }
    expect_op("]");
    auto g = make_expr<GetItemExpr>(Expr::Kind::GetItem, t.pos);
    if (args.size() == 1) {
      g->index = std::move(args[0]);
    } else {
      auto tuple = make_expr<SeqExpr>(Expr::Kind::Tuple, t.pos);
      for (const auto& a : args) grow(*tuple, a);
      tuple->items = std::move(args);
      g->index = std::move(tuple);
    }
    grow(*g, object);
    grow(*g, g->index);
    g->object = std::move(object);
    return g;
  }

  ExprPtr parse_subscribed() {
    const Pos p = cur().pos;
    ExprPtr start;
    if (!skip_op(":")) {
      start = parse_expression(true);
      if (!skip_op(":")) return start;
    }
    auto s = make_expr<SliceExpr>(Expr::Kind::Slice, p);
    s->start = std::move(start);
    if (!is_op(":") && !is_op("]") && !is_op(",")) s->stop = parse_expression(true);
    if (skip_op(":") && !is_op("]") && !is_op(",")) s->step = parse_expression(true);
    grow(*s, s->start);
    grow(*s, s->stop);
    grow(*s, s->step);
    return s;
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto c = make_expr<CallExpr>(Expr::Kind::Call, callee->pos);  // errors point at what is called
    c->args = parse_call_args();
    grow(*c, callee);
    grow(*c, c->args);
    c->callee = std::move(callee);
    return c;
  }

  CallArgs parse_call_args() {
    const Pos open = expect_op("(").pos;
    CallArgs a;
    const auto ensure = [&](bool ok) {
      if (!ok) fail(open, "invalid argument order in call: positional arguments, then keyword arguments, then *args and **kwargs");
    };
    bool require_comma = false;
    while (!is_op(")")) {
      if (require_comma) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (skip_op("*")) {
        ensure(!a.star_args && !a.star_kwargs);
        a.star_args = parse_expression(true);
      } else if (skip_op("**")) {
        ensure(!a.star_kwargs);
        a.star_kwargs = parse_expression(true);
      } else if (cur().type == Tok::Name && peek().type == Tok::Operator && peek().text == "=") {
        ensure(!a.star_kwargs);
        std::string key = take().text;
        take();
        a.keywords.emplace_back(std::move(key), parse_expression(true));
      } else {
        ensure(!a.star_args && !a.star_kwargs && a.keywords.empty());
        a.positional.push_back(parse_expression(true));
      }
      require_comma = true;
    }
    expect_op(")");
    return a;
  }

  std::string dotted_name() {
    std::string name = expect_identifier().text;
    while (skip_op(".")) name += "." + expect_identifier().text;
    return name;
  }

  ExprPtr parse_filter(ExprPtr node, bool start_inline) {
    while (is_op("|") || start_inline) {
      if (!start_inline) take();
      start_inline = false;
      auto f = make_expr<FilterExpr>(Expr::Kind::Filter, cur().pos);
      f->name = dotted_name();
      if (is_op("(")) f->args = parse_call_args();
      grow(*f, node);
      grow(*f, f->args);
      f->operand = std::move(node);
      node = std::move(f);
    }
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    const Pos p = take().pos;
    const bool negated = skip_name("not");
    auto t = make_expr<TestExpr>(Expr::Kind::Test, p);
    t->name = dotted_name();
    const Token& c = cur();
    const bool starts_argument =
        c.type == Tok::Name || c.type == Tok::String || c.type == Tok::Integer || c.type == Tok::Float ||
        (c.type == Tok::Operator && (c.text == "[" || c.text == "{"));
    if (is_op("(")) {
      t->args = parse_call_args();
    } else if (starts_argument && !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail(c.pos, "tests cannot be chained with 'is'");
      t->args.positional.push_back(parse_postfix(parse_primary()));
    }
    grow(*t, node);
    grow(*t, t->args);
    t->operand = std::move(node);
    if (!negated) return t;
    auto n = make_expr<UnaryExpr>(Expr::Kind::Not, p);
    n->operand = std::move(t);
    grow(*n, n->operand);
    return n;
  }

  std::vector<Token> toks_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
  std::vector<Open> open_;
};

// Calls f on each direct child expression.
void for_each_child(Expr& e, const std::function<void(Expr&)>& f) {
  const auto visit = [&](ExprPtr& c) {
    if (c) f(*c);
  };
  const auto visit_args = [&](CallArgs& a) {
    for (auto& x : a.positional) visit(x);
    for (auto& kv : a.keywords) visit(kv.second);
    visit(a.star_args);
    visit(a.star_kwargs);
  };
  switch (e.kind) {
    case Expr::Kind::Literal:
    case Expr::Kind::Name:
      return;
    case Expr::Kind::List:
    case Expr::Kind::Tuple:
      for (auto& x : static_cast<SeqExpr&>(e).items) visit(x);
      return;
    case Expr::Kind::Dict:
      for (auto& [k, v] : static_cast<DictExpr&>(e).items) {
        visit(k);
        visit(v);
      }
      return;
    case Expr::Kind::Neg:
    case Expr::Kind::Plus:
    case Expr::Kind::Not:
      visit(static_cast<UnaryExpr&>(e).operand);
      return;
    case Expr::Kind::And:
    case Expr::Kind::Or:
    case Expr::Kind::Binary:
      visit(static_cast<BinaryExpr&>(e).left);
      visit(static_cast<BinaryExpr&>(e).right);
      return;
    case Expr::Kind::Concat:
      for (auto& x : static_cast<ConcatExpr&>(e).parts) visit(x);
      return;
    case Expr::Kind::Compare:
      visit(static_cast<CompareExpr&>(e).first);
      for (auto& kv : static_cast<CompareExpr&>(e).rest) visit(kv.second);
      return;
    case Expr::Kind::Cond: {
      auto& c = static_cast<CondExpr&>(e);
      visit(c.test);
      visit(c.then);
      visit(c.otherwise);
      return;
    }
    case Expr::Kind::GetAttr:
      visit(static_cast<GetAttrExpr&>(e).object);
      return;
    case Expr::Kind::GetItem:
      visit(static_cast<GetItemExpr&>(e).object);
      visit(static_cast<GetItemExpr&>(e).index);
      return;
    case Expr::Kind::Slice: {
      auto& s = static_cast<SliceExpr&>(e);
      visit(s.start);
      visit(s.stop);
      visit(s.step);
      return;
    }
    case Expr::Kind::Call:
      visit(static_cast<CallExpr&>(e).callee);
      visit_args(static_cast<CallExpr&>(e).args);
      return;
    case Expr::Kind::Filter:
      visit(static_cast<FilterExpr&>(e).operand);
      visit_args(static_cast<FilterExpr&>(e).args);
      return;
    case Expr::Kind::Test:
      visit(static_cast<TestExpr&>(e).operand);
      visit_args(static_cast<TestExpr&>(e).args);
      return;
  }
}

// Calls on_expr on each expression a statement holds directly and on_body on each of its bodies,
// with the "soft" flag jinja2's compiler would have there: true directly inside an if statement.
void for_each_part(Stmt& s, bool soft, const std::function<void(Expr&, bool)>& on_expr,
                   const std::function<void(Body&, bool)>& on_body) {
  const auto expr = [&](ExprPtr& e, bool sft) {
    if (e) on_expr(*e, sft);
  };
  switch (s.kind) {
    case Stmt::Kind::Output:
      expr(static_cast<OutputStmt&>(s).expr, soft);
      return;
    case Stmt::Kind::If: {
      auto& i = static_cast<IfStmt&>(s);
      for (auto& [test, body] : i.branches) {
        expr(test, true);
        on_body(body, true);
      }
      on_body(i.otherwise, true);
      return;
    }
    case Stmt::Kind::For: {
      auto& f = static_cast<ForStmt&>(s);
      expr(f.iter, soft);
      expr(f.filter, false);
      on_body(f.body, false);
      on_body(f.otherwise, false);
      return;
    }
    case Stmt::Kind::Set:
      expr(static_cast<SetStmt&>(s).value, soft);
      return;
    case Stmt::Kind::SetBlock:
      expr(static_cast<SetBlockStmt&>(s).filter, false);
      on_body(static_cast<SetBlockStmt&>(s).body, false);
      return;
    case Stmt::Kind::Macro: {
      auto& m = static_cast<MacroStmt&>(s);
      for (auto& d : m.defaults) expr(d, false);
      on_body(m.body, false);
      return;
    }
    case Stmt::Kind::CallBlock: {
      auto& c = static_cast<CallBlockStmt&>(s);
      for (auto& d : c.caller->defaults) expr(d, false);
      on_body(c.caller->body, false);
      expr(c.call, soft);
      return;
    }
    case Stmt::Kind::FilterBlock:
      expr(static_cast<FilterBlockStmt&>(s).filter, false);
      on_body(static_cast<FilterBlockStmt&>(s).body, false);
      return;
    case Stmt::Kind::With:
      for (auto& kv : static_cast<WithStmt&>(s).assignments) expr(kv.second, soft);
      on_body(static_cast<WithStmt&>(s).body, false);
      return;
    case Stmt::Kind::Text:
    case Stmt::Kind::Break:
    case Stmt::Kind::Continue:
      return;
  }
}

// Whether a body reads `name` anywhere, nested macros included (as jinja2's find_undeclared).
bool reads_name(Body& body, std::string_view name) {
  std::function<bool(Expr&)> in_expr = [&](Expr& e) {
    if (e.kind == Expr::Kind::Name && static_cast<NameExpr&>(e).name == name) return true;
    bool found = false;
    for_each_child(e, [&](Expr& c) { found = found || in_expr(c); });
    return found;
  };
  std::function<bool(Body&)> in_body = [&](Body& b) {
    bool found = false;
    for (auto& s : b) {
      for_each_part(
          *s, false, [&](Expr& e, bool) { found = found || in_expr(e); },
          [&](Body& inner, bool) { found = found || in_body(inner); });
    }
    return found;
  };
  return in_body(body);
}

// Binds filter and test names to their implementations and records what macros read.
class Resolver {
 public:
  void body(Body& b, bool soft) {
    for (auto& s : b) stmt(*s, soft);
  }

 private:
  void stmt(Stmt& s, bool soft) {
    if (s.kind == Stmt::Kind::Macro) macro(static_cast<MacroStmt&>(s));
    if (s.kind == Stmt::Kind::CallBlock) macro(*static_cast<CallBlockStmt&>(s).caller);
    for_each_part(
        s, soft, [&](Expr& e, bool sft) { expr(e, sft); }, [&](Body& b, bool sft) { body(b, sft); });
  }

  static void macro(MacroStmt& m) {
    m.uses_caller = reads_name(m.body, "caller");
    m.uses_varargs = reads_name(m.body, "varargs");
    m.uses_kwargs = reads_name(m.body, "kwargs");
  }

  void expr(Expr& e, bool soft) {
    if (e.kind == Expr::Kind::Cond) soft = true;
    if (e.kind == Expr::Kind::Filter) {
      auto& f = static_cast<FilterExpr&>(e);
      f.fn = find_filter(f.name);
      if (!f.fn && !soft) {
        fail(f.pos, is_unimplemented_filter(f.name) ? "the filter '" + f.name + "' is not supported"
                                                    : "no filter named '" + f.name + "'");
      }
    } else if (e.kind == Expr::Kind::Test) {
      auto& t = static_cast<TestExpr&>(e);
      t.fn = find_test(t.name);
      if (!t.fn && !soft) fail(t.pos, "no test named '" + t.name + "'");
    }
    for_each_child(e, [&](Expr& c) { expr(c, soft); });
  }
};

}  // namespace

std::unique_ptr<Program> parse_program(std::string_view source, const LexOptions& options) {
  std::unique_ptr<Program> program = Parser(tokenize(source, options)).run();
  Resolver().body(program->body, false);
  return program;
}

}  // namespace sparsemla::chat::jinja
