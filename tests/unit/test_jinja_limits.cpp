// What the jinja2 reference cases cannot cover: hostile templates fail with a TemplateError instead
// of exhausting the stack, memory or time; error positions and fields; the extensions to jinja2
// (list.append); time-dependent strftime_now; rendering one template from several threads.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <ctime>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "chat/jinja.h"

namespace sparsemla::chat {
namespace {

using nlohmann::ordered_json;
using testing::HasSubstr;

std::string render(const std::string& source, const ordered_json& context = ordered_json::object()) {
  return Template::parse(source).render(context);
}

// The error message of parsing and rendering `source`, or "" when it succeeds.
std::string error_of(const std::string& source, const ordered_json& context = ordered_json::object()) {
  try {
    render(source, context);
  } catch (const TemplateError& e) {
    return e.what();
  }
  return "";
}

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

TEST(JinjaLimits, DeepParenthesesAreRefused) {
  EXPECT_THAT(error_of("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}"),
              HasSubstr("nests more than"));
}

TEST(JinjaLimits, DeepBlocksAreRefused) {
  EXPECT_THAT(error_of(repeat("{% if true %}", 20000) + repeat("{% endif %}", 20000)), HasSubstr("nests more than"));
}

TEST(JinjaLimits, LongOperatorChainsAreRefused) {
  EXPECT_THAT(error_of("{{ 1" + repeat(" + 1", 100000) + " }}"), HasSubstr("nests more than"));
  EXPECT_THAT(error_of("{{ 'x'" + repeat("|string", 100000) + " }}"), HasSubstr("nests more than"));
  EXPECT_THAT(error_of("{{ x" + repeat(".a", 100000) + " }}"), HasSubstr("nests more than"));
  EXPECT_THAT(error_of("{{ " + repeat("not ", 100000) + "x }}"), HasSubstr("nests more than"));
  EXPECT_THAT(error_of("{{ " + repeat("-", 100000) + "1 }}"), HasSubstr("nests more than"));
}

TEST(JinjaLimits, ModerateNestingAndLongFlatTemplatesWork) {
  EXPECT_EQ(render("{{ " + std::string(50, '(') + "1" + std::string(50, ')') + " }}"), "1");
  EXPECT_EQ(render("{{ 1" + repeat(" + 1", 150) + " }}"), "151");
  EXPECT_EQ(render(repeat("{% if true %}", 100) + "in" + repeat("{% endif %}", 100)), "in");
  EXPECT_EQ(render(repeat("a{{ 1 }}", 100000)).size(), 200000u);
  // A ~ chain and a comparison chain are flat, whatever their length.
  EXPECT_EQ(render("{{ 'a'" + repeat(" ~ 'a'", 10000) + " }}").size(), 10001u);
}

TEST(JinjaLimits, RunawayLoopsStop) {
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(error_of("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"),
              HasSubstr("too much work"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(120));  // ~1 s optimized, more under sanitizers
  EXPECT_THAT(error_of("{{ range(100001) }}"), HasSubstr("Range too big"));
}

TEST(JinjaLimits, HugeStringsAreRefused) {
  EXPECT_THAT(error_of("{{ 'x' * 1000000000000 }}"), HasSubstr("larger than"));
  EXPECT_THAT(error_of("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"), HasSubstr("output is larger than"));
  EXPECT_THAT(error_of("{{ [1] * 100000000000 }}"), HasSubstr("more than"));
  EXPECT_THAT(error_of("{{ '%99999999999s' % 'x' }}"), HasSubstr("larger than"));
  EXPECT_THAT(error_of("{{ 'x'.center(100000000000) }}"), HasSubstr("larger than"));
}

TEST(JinjaLimits, InfiniteRecursionStops) {
  EXPECT_THAT(error_of("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}"), HasSubstr("recursed more than"));
  EXPECT_THAT(error_of("{% macro m() %}{{ m() ~ m() }}{% endmacro %}{{ m() }}"), HasSubstr("recursed more than"));
}

TEST(JinjaLimits, SelfContainingContainersDoNotRecurseForever) {
  EXPECT_THAT(error_of("{% set l = [] %}{% set _ = l.append(l) %}{{ l }}"), HasSubstr("levels"));
  EXPECT_THAT(error_of("{% set l = [] %}{% set _ = l.append(l) %}{{ l|tojson }}"), HasSubstr("levels"));
  EXPECT_THAT(error_of("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}"), HasSubstr("levels"));
  EXPECT_THAT(error_of("{% set a = [] %}{% set b = [] %}{% set _ = a.append(a) %}{% set _ = b.append(b) %}{{ a == b }}"),
              HasSubstr("levels"));
}

TEST(JinjaLimits, DeepJsonContextIsRefused) {
  ordered_json deep = 1;
  for (int i = 0; i < 1000; ++i) deep = ordered_json::array({deep});
  try {
    Template::parse("{{ x }}").render({{"x", deep}});
    FAIL() << "rendered a context nested 1000 deep";
  } catch (const TemplateError& e) {
    EXPECT_THAT(e.what(), HasSubstr("render context"));
  }
}

TEST(JinjaErrors, RaiseExceptionCarriesItsMessageAndPosition) {
  try {
    render("ok\n  {{ raise_exception('No system message allowed') }}");
    FAIL();
  } catch (const TemplateError& e) {
    EXPECT_EQ(e.line, 2);
    EXPECT_EQ(e.column, 6);
    EXPECT_EQ(e.message, "No system message allowed");
    EXPECT_STREQ(e.what(), "line 2, column 6: No system message allowed");
  }
}

TEST(JinjaErrors, PositionsCountCodePoints) {
  EXPECT_THAT(error_of("é世{{ x +* 1 }}"), HasSubstr("line 1, column 9: expected an expression, found '*'"));
}

TEST(JinjaErrors, RuntimeErrorsInMacrosNameTheLineInTheMacro) {
  EXPECT_THAT(error_of("{% macro m(x) %}\n\n  {{ x + 'a' }}{% endmacro %}\n{{ m(1) }}"), HasSubstr("line 3, column 8"));
}

TEST(JinjaErrors, ContextMustBeAnObject) {
  EXPECT_THAT(error_of("x", ordered_json::array()), HasSubstr("must be a JSON object"));
}

TEST(JinjaErrors, EveryErrorIsATemplateError) {
  // Random soups of template fragments: each either renders or throws TemplateError, nothing else.
  const std::vector<std::string> pieces = {
      "{{", "}}", "{%", "%}", "{#", "#}", "{%-", "-%}", " if ", " for ", " in ", " endfor ", " endif ", " else ",
      " set ", " = ", "x", "messages", "(", ")", "[", "]", "{", "}", ",", ":", "|", "tojson", " is ", "defined",
      " not ", "'s'", "\"q", "1", "2.5", "-", "+", "*", "**", "/", "//", "%", "~", ".", "items()", " macro ",
      " endmacro ", " call ", " endcall ", "caller()", " raw ", " endraw ", "\n", "  ", "loop.index", "range(3)",
      " and ", " or ", "none", "true", " filter ", "upper", " endfilter ", "\\", "é", "\xff", "\xe4\xb8", "namespace(a=1)",
      "ns.a", " with ", " endwith ", "break", "continue", "join", "map", "select", "selectattr", "'%s'", "format",
  };
  const ordered_json context = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"x", {1, 2}}};
  std::mt19937 rng(12345);
  int rendered = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string source;
    const int n = 1 + int(rng() % 24);
    for (int k = 0; k < n; ++k) source += pieces[rng() % pieces.size()];
    try {
      Template::parse(source).render(context);
      ++rendered;
    } catch (const TemplateError& e) {
      EXPECT_GT(std::string(e.what()).size(), 0u);
    }
  }
  EXPECT_GT(rendered, 100);
}

TEST(JinjaExtensions, ListAppendWorks) {
  // jinja2's sandbox refuses list.append; templates written for llama.cpp use it.
  EXPECT_EQ(render("{% set l = [] %}{% for x in 'ab' %}{% set _ = l.append(x) %}{% endfor %}{{ l }}"), "['a', 'b']");
  EXPECT_EQ(render("{% set ns = namespace(v=[]) %}{{ ns.v.append(1) }}{{ ns.v }}"), "None[1]");
}

TEST(JinjaGlobals, StrftimeNowUsesTheLocalClock) {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  const std::string year = std::to_string(local.tm_year + 1900);
  const std::string out = render("{{ strftime_now('%Y') }}|{{ strftime_now('%d %B %Y')|length > 8 }}|{{ strftime_now('') }}");
  EXPECT_THAT(out, testing::AnyOf(testing::StartsWith(year + "|True|"),
                                  testing::StartsWith(std::to_string(local.tm_year + 1901) + "|True|")));
}

TEST(JinjaTemplate, RendersRepeatedlyAndFromSeveralThreads) {
  const Template t = Template::parse(
      "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}{{ range(n)|sum }}");
  std::vector<std::string> results(8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      const ordered_json ctx = {{"messages", {{{"role", "user"}, {"content", std::to_string(i)}}}}, {"n", i}};
      for (int k = 0; k < 200; ++k) results[size_t(i)] = t.render(ctx);
    });
  }
  for (auto& th : threads) th.join();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(results[size_t(i)], "user:" + std::to_string(i) + ";" + std::to_string(i * (i - 1) / 2));
}

TEST(JinjaTemplate, InvalidUtf8PassesThroughUnchanged) {
  EXPECT_EQ(render("a\xff{{ '\xfe' ~ s }}", {{"s", "ok"}}), "a\xff\xfeok");
  EXPECT_EQ(render("{{ '\xe4\xb8'|length }} {{ '\xe4\xb8'|upper }}"), "2 \xe4\xb8");
}

}  // namespace
}  // namespace sparsemla::chat
