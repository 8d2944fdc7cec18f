#!/usr/bin/python3
"""Writes tests/data/jinja/cases.json: Jinja2 templates with the output Python's jinja2 gives them.

Each case is rendered the way Hugging Face transformers renders chat templates: an
ImmutableSandboxedEnvironment with trim_blocks=True, lstrip_blocks=True and the loopcontrols
extension, transformers' tojson filter (json.dumps, ensure_ascii=False by default, no HTML escaping)
and its raise_exception / strftime_now globals, plus a {% generation %} block like transformers'
AssistantTracker. tests/unit/test_jinja.cpp renders the same cases with src/chat and compares byte
for byte; for cases that must fail it checks that jinja2 failed too and that the C++ error names a
line and column.

Run with Debian's Python, which has jinja2 (apt-get install python3-jinja2):
    /usr/bin/python3 scripts/reference/make_jinja_cases.py
"""
import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "tests", "data", "jinja")
OUT = os.path.join(DATA, "cases.json")

# Chat templates in the style of the model families sparsemla serves, written for these tests; cases
# name them by file (tests/data/jinja/<name>.jinja) in "template_file".
CHAT_TEMPLATES = {}
for _name in ("glm", "deepseek_v31", "deepseek_v32"):
    with open(os.path.join(DATA, _name + ".jinja"), encoding="utf-8") as _f:
        CHAT_TEMPLATES[_name] = _f.read()


class GenerationBlock(Extension):
    """{% generation %}...{% endgeneration %}: renders its body, as transformers' AssistantTracker does
    when no assistant mask is asked for."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def make_env(trim_blocks=True, lstrip_blocks=True):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=trim_blocks, lstrip_blocks=lstrip_blocks, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# A context most feature cases share.
BASE = {
    "s": "Hello World",
    "n": 5,
    "neg": -7,
    "f": 2.5,
    "t": True,
    "nothing": None,
    "lst": [3, 1, 2],
    "words": ["banana", "Apple", "cherry", "apple"],
    "d": {"b": 1, "a": 2, "c": 3},
    "nested": {"x": {"y": {"z": "deep"}}, "list": [{"k": 1}, {"k": 2}]},
    "users": [
        {"name": "Ann", "age": 30, "admin": False},
        {"name": "bob", "age": 25},
        {"name": "Cid", "age": 35, "admin": True},
    ],
    "empty": [],
    "emptyd": {},
    "uni": "Grüße, 世界 😀",
    "multi": "line one\nline two\n\nline four",
    "schema": {"type": "object", "properties": {"city": {"type": "string", "description": "Name, e.g. \"Paris\""}}},
}

CASES = []


def case(name, template, context=None, **options):
    CASES.append({"name": name, "template": template, "context": BASE if context is None else context, **options})


def fails(name, template, context=None, contains=None, **options):
    """A template jinja2 refuses (at parse or render time). `contains`: text the C++ error must hold."""
    CASES.append(
        {"name": name, "template": template, "context": BASE if context is None else context, "must_fail": True,
         "error_contains": contains, **options}
    )


# ---------------------------------------------------------------- output and literals
case("text_only", "plain text, no tags")
case("print_string", "{{ s }}")
case("print_int_float", "{{ n }} {{ f }} {{ 1.0 }} {{ 10 / 4 }} {{ 10 / 5 }}")
case("print_none_bool", "{{ nothing }} {{ none }} {{ None }} {{ t }} {{ true }} {{ False }}")
case("print_list_dict", "{{ lst }} {{ d }} {{ users[0] }} {{ [1, 'a', none, true, 2.5, [], {}] }}")
case("print_tuple", "{{ (1,) }} {{ (1, 2) }} {{ () }} {{ 1, 'x' }}")
case("print_undefined", "[{{ missing }}][{{ d.missing }}][{{ lst[10] }}][{{ nothing.attr }}]")
case("repr_string_quotes", """{{ ["it's", 'say "hi"', "both ' and \\"", "back\\\\slash", "tab\\tnl\\n"] }}""")
case("repr_unicode", "{{ [uni, '\\x00\\x7f\\xa0\\u2028é'] }}")
case("float_repr", "{{ [1e16, 1e15, 0.0001, 0.00001, 1/3, 2**-1, 1.5e300, -0.0, 123456789.123456789, 0.1 + 0.2] }}")
case("float_literals", "{{ 1_000 }} {{ 1_000.5 }} {{ 1e3 }} {{ 2.5E-3 }} {{ 0x1F }} {{ 0o17 }} {{ 0b101 }}")
case("string_escapes", r"""{{ 'a\nb' }}|{{ "q\"q" }}|{{ 'x\'y' }}|{{ '\u00e9\x41\101' }}|{{ '\d' }}""")
case("adjacent_strings", "{{ 'a' 'b' \"c\" }}")
case("list_dict_literals", "{{ [1, [2, 3], {'k': [4]}] }} {{ {'a': 1, 'b': {'c': 2},} }} {{ [1, 2,] }}")
case("dict_int_keys", "{{ {1: 'a', 2.5: 'b', none: 'c', true: 'd'} }}")
case("dict_duplicate_keys", "{{ {'a': 1, 'b': 2, 'a': 3} }}")
case("print_tag", "{% print s, n %}|{% print 'x' ~ 1 %}")

# ---------------------------------------------------------------- whitespace control
case("ws_dash_all", "a  {{- s -}}  b  {%- if t -%}  c  {%- endif -%}  d")
case("ws_dash_newlines", "a\n\n  {{- 'x' }}\n\n{{ 'y' -}}\n\n  z")
case("ws_trim_blocks", "{% if t %}\nyes\n{% endif %}\nafter\n")
case("ws_lstrip_blocks", "x\n    {% if t %}\n    indented\n    {% endif %}\ny")
case("ws_lstrip_not_vars", "x\n    {{ s }}\n    {% if t %}in{% endif %}")
case("ws_lstrip_mid_line", "x  {% if t %}a{% endif %}  y\n  {% if t %}b{% endif %}")
case("ws_plus_disables", "x\n    {%+ if t %}\na{%+ endif +%}\nb")
case("ws_comment_trim", "a\n  {# comment #}\nb{# c -#}   \n  c\n{#- d #}e")
case("ws_tabs", "\t{% if t %}\n\tx\n\t{% endif %}\n")
case("ws_trailing_newline_dropped", "line\n")
case("ws_only_one_trailing_newline_dropped", "line\n\n")
case("ws_crlf", "a\r\n{% if t %}\r\nb\r\n{% endif %}\r\nc\rd")
case("ws_unicode_space_strip", "a\u3000\u00a0 {{- 'b' -}} \u2003c")
case("ws_no_trim", "{% if t %}\nyes\n    {% endif %}\n", trim_blocks=False, lstrip_blocks=False)
case("ws_trim_only", "x\n  {% if t %}\n  a\n  {% endif %}\n", trim_blocks=True, lstrip_blocks=False)
case("ws_lstrip_only", "x\n  {% if t %}\n  a\n  {% endif %}\n", trim_blocks=False, lstrip_blocks=True)
case("ws_var_end_no_trim", "{{ s }}\nnext")
case("ws_dash_inside_expression", "{{ n -1 }} {{ n - 1 }} {{ n-1 }}")
case("raw_block", "{% raw %}{{ not evaluated }} {% if %}{% endraw %}")
case("raw_block_ws", "a\n  {% raw -%}  \n{{ x }}  {%- endraw %}\nb")
case("comment_with_tags", "{# {{ s }} {% if %} #}ok")
case("brace_in_dict_literal", "{{ {'a': {'b': 1}} }}|{{ {'a': 1}['a'] }}")

# ---------------------------------------------------------------- if / for
case("if_elif_else", "{% for v in [0, 1, 2, 3] %}{% if v == 0 %}zero{% elif v == 1 %}one{% elif v == 2 %}two{% else %}many{% endif %},{% endfor %}")
case("if_truthiness", "{% for v in [0, 1, '', 'x', [], [0], {}, {'a': 1}, none, 0.0, 0.1] %}{{ 'T' if v else 'F' }}{% endfor %}")
case("if_undefined_false", "{% if missing %}yes{% else %}no{% endif %}{% if d.x is defined %}{% endif %}")
case("if_tuple_test", "{% if 1, 2 %}tuple is true{% endif %}")
case("for_basic", "{% for x in lst %}{{ x }},{% endfor %}")
case("for_loop_vars", "{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}|{% endfor %}")
case("for_loop_prev_next", "{% for x in lst %}[{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }}]{% endfor %}")
case("for_loop_cycle", "{% for x in range(5) %}{{ loop.cycle('odd', 'even') }} {% endfor %}")
case("for_loop_changed", "{% for x in [1, 1, 2, 2, 1] %}{% if loop.changed(x) %}{{ x }}{% endif %}{% endfor %}")
case("for_loop_depth", "{% for x in [1] %}{{ loop.depth }}{{ loop.depth0 }}{% endfor %}")
case("for_loop_object_printed", "{% for x in [1, 2, 3] %}{{ loop|length }}{{ loop }}{% endfor %}|{{ namespace(a=1) }}|{{ '%s %r' % (none, 'x') }}|{{ (1, 2)|first }}")
case("for_else", "{% for x in empty %}{{ x }}{% else %}empty!{% endfor %}|{% for x in [1] %}{{ x }}{% else %}no{% endfor %}")
case("for_filter", "{% for u in users if u.age > 26 %}{{ loop.index }}:{{ u.name }}/{{ loop.length }}{% if not loop.last %},{% endif %}{% endfor %}")
case("for_filter_all_out_else", "{% for u in users if u.age > 100 %}{{ u }}{% else %}none matched{% endfor %}")
case("for_unpack_items", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}")
case("for_unpack_paren", "{% for (a, b) in [[1, 2], [3, 4]] %}{{ a + b }} {% endfor %}")
case("for_unpack_nested", "{% for a, (b, c) in [[1, [2, 3]]] %}{{ a }}{{ b }}{{ c }}{% endfor %}")
case("for_dict_iterates_keys", "{% for k in d %}{{ k }}{% endfor %}")
case("for_string", "{% for ch in uni %}[{{ ch }}]{% endfor %}")
case("for_undefined_is_empty", "{% for x in missing %}{{ x }}{% else %}nothing{% endfor %}")
case("for_nested_loop_vars", "{% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.index }}{{ b }}{% endfor %}-{{ loop.index }}{% endfor %}")
case("for_break_continue", "{% for x in range(10) %}{% if x is odd %}{% continue %}{% endif %}{% if x > 6 %}{% break %}{% endif %}{{ x }}{% endfor %}")
# jinja2 renders a for loop's else unless an iteration ran to its end (not cut by break or continue).
case("for_break_first_runs_else", "{% for x in [1, 2] %}{% break %}{% else %}else{% endfor %}done")
case("for_break_later_skips_else", "{% for x in [1, 2] %}{{ x }}{% if x == 2 %}{% break %}{% endif %}{% else %}else{% endfor %}")
case("for_continue_always_runs_else", "{% for x in [1, 2] %}{{ x }}{% continue %}{% else %}else{% endfor %}")
case("for_break_in_if_in_with", "{% for x in range(5) %}{% with y = x %}{% if y == 2 %}{% break %}{% endif %}{{ y }}{% endwith %}{% endfor %}")
case("for_scope_does_not_leak", "{% set x = 0 %}{% for i in range(3) %}{% set x = x + i %}{{ x }}{% endfor %}|{{ x }}")
case("for_scope_fresh_each_iteration", "{% for i in range(3) %}{% if i > 0 %}[{{ y }}]{% endif %}{% set y = i %}{% endfor %}")
case("for_over_range_args", "{{ range(3)|list }} {{ range(2, 5)|list }} {{ range(10, 0, -3)|list }} {{ range(0)|list }} {{ range(5, 1)|list }}")
case("for_over_dict_items_tuple", "{% for item in d.items() %}{{ item }}{{ item[0] }}{% endfor %}")
case("for_loop_in_filter_test", "{% for x in lst if x != 1 %}{{ x }}{% endfor %}")
case("if_set_leaks", "{% if true %}{% set z = 3 %}{% endif %}{{ z }}")

# ---------------------------------------------------------------- set / namespace / with
case("set_basic", "{% set a = 1 %}{% set b = a + 1 %}{{ a }}{{ b }}")
case("set_tuple", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c = 3, 4 %}{{ c }}")
case("set_unpack_list", "{% set a, b, c = 'xyz' %}{{ c }}{{ b }}{{ a }}")
case("set_block", "{% set block %}Hello {{ s }}!{% endset %}[{{ block }}]")
case("set_block_filter", "{% set block | upper | trim %}  hi {{ n }}  {% endset %}[{{ block }}]")
case("set_shadows_context", "{{ s }}|{% set s = 'changed' %}{{ s }}")
case("set_read_before_shadow", "{{ n }}{% set n = 9 %}{{ n }}")
case("namespace_basic", "{% set ns = namespace(count=0, names=[]) %}{% for u in users %}{% set ns.count = ns.count + 1 %}{% set ns.names = ns.names + [u.name] %}{% endfor %}{{ ns.count }} {{ ns.names }}")
case("namespace_from_dict", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}{{ ns.c }}")
case("namespace_set_block", "{% set ns = namespace(v='') %}{% set ns.v %}in block{% endset %}{{ ns.v }}")
case("namespace_item_access", "{% set ns = namespace(a=1) %}{{ ns['a'] }}")
case("with_block", "{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}]")
case("with_sees_outer", "{% set a = 5 %}{% with b = a * 2 %}{{ b }}{% set a = 0 %}{{ a }}{% endwith %}{{ a }}")
case("generation_block", "{% for m in ['x', 'y'] %}{% generation %}<{{ m }}>{% endgeneration %}{% endfor %}")
case("dict_global", "{{ dict(a=1, b='x') }} {{ dict([('k', 'v')]) }} {{ dict({'m': 1}, n=2) }}")
case("joiner_global", "{% set pipe = joiner(' | ') %}{% for x in lst %}{{ pipe() }}{{ x }}{% endfor %}")

# ---------------------------------------------------------------- macros and call blocks
case("macro_basic", "{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', 'Hi') }} {{ greet(greeting='Yo', name='Cy') }}")
case("macro_default_uses_param", "{% macro m(a, b=a * 2) %}{{ a }}/{{ b }}{% endmacro %}{{ m(3) }} {{ m(3, 1) }}")
case("macro_missing_arg_undefined", "{% macro m(a, b) %}[{{ a }}][{{ b }}][{{ b is defined }}]{% endmacro %}{{ m(1) }}")
case("macro_varargs_kwargs", "{% macro m(a) %}{{ a }} {{ varargs }} {{ kwargs }}{% endmacro %}{{ m(1, 2, 3, x=4) }}|{{ m(0) }}")
case("macro_caller", "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') %}bold {{ s }}{% endcall %}")
case("macro_caller_args", "{% macro each(items) %}{% for i in items %}{{ caller(i, loop.index) }}{% endfor %}{% endmacro %}{% call(item, idx) each(['a', 'b']) %}{{ idx }}={{ item }};{% endcall %}")
case("macro_returns_string", "{% macro m() %} x {% endmacro %}{% set r = m() %}[{{ r }}][{{ r|length }}][{{ r.strip() }}]")
case("macro_recursion", "{% macro fact(k) %}{% if k <= 1 %}1{% else %}{{ k * fact(k - 1)|int }}{% endif %}{% endmacro %}{{ fact(6) }}")
case("macro_sees_globals_at_call", "{% macro m() %}{{ y }}{% endmacro %}{% set y = 1 %}{{ m() }}{% set y = 2 %}{{ m() }}")
case("macro_lexical_scope", "{% set y = 1 %}{% macro m() %}{{ y }}{% endmacro %}{% for i in range(2) %}{% set y = 5 %}{{ m() }}{% endfor %}")
case("macro_in_loop_closure", "{% for i in range(2) %}{% macro show() %}<{{ i }}>{% endmacro %}{{ show() }}{% endfor %}")
case("macro_render_json_schema", """{%- macro render(p, depth) -%}
{%- for name, spec in p.items() -%}
{{ '  ' * depth }}- {{ name }} ({{ spec.type }}){% if spec.description %}: {{ spec.description }}{% endif %}
{% if spec.properties is defined %}{{ render(spec.properties, depth + 1) }}{% endif -%}
{%- endfor -%}
{%- endmacro -%}
{{ render({'loc': {'type': 'object', 'properties': {'lat': {'type': 'number', 'description': 'latitude'}, 'lon': {'type': 'number'}}}, 'unit': {'type': 'string'}}, 0) }}""")
case("filter_block", "{% filter upper %}hello {{ s }}{% endfilter %}|{% filter replace('l', 'L')|trim %}  hello  {% endfilter %}")

# ---------------------------------------------------------------- expressions
case("arith_int", "{{ 7 + 3 }} {{ 7 - 10 }} {{ 7 * 3 }} {{ 7 / 2 }} {{ 7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }}")
case("arith_float", "{{ 7.5 + 1 }} {{ 1.5 * 2 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 2 ** 0.5 }} {{ 0.1 * 3 }} {{ 1e308 * 10 }}")
case("arith_bool", "{{ true + true }} {{ true * 3 }} {{ false - 1 }} {{ -true }}")
case("arith_precedence", "{{ 2 + 3 * 4 }} {{ (2 + 3) * 4 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }} {{ 10 - 2 - 3 }} {{ 2 * 3 % 4 }}")
case("unary_binds_tighter_than_filter", "{{ -3|abs }} {{ - n|string }} {{ +n }}")
case("string_concat_ops", "{{ 'a' + 'b' }} {{ 'ab' * 3 }} {{ 3 * 'x' }} {{ 'n=' ~ n ~ ', f=' ~ f ~ ', none=' ~ nothing ~ ', u=' ~ missing }}")
case("list_ops", "{{ [1] + [2, 3] }} {{ [0] * 3 }} {{ (1,) + (2,) }} {{ lst * 0 }}")
case("string_percent", "{{ 'x=%s y=%d z=%.2f %%' % ('a', 3, 2.345) }} {{ '%s' % 'one' }} {{ '%(a)s-%(b)05d' % {'a': 'k', 'b': 42} }} {{ '%5s|%-5s|%x|%#o|%+d|%c' % ('r', 'l', 255, 8, 3, 65) }}")
case("compare_ops", "{{ 1 < 2 }} {{ 2 <= 2 }} {{ 3 > 4 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 1 == 1.0 }} {{ 1 == true }} {{ 'a' != 'a' }} {{ none == none }} {{ (1, 2) == [1, 2] }}")
case("compare_chain", "{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 3 > 2 == 2 }}")
case("compare_dicts", "{{ {'a': 1, 'b': 2} == {'b': 2, 'a': 1} }} {{ {'a': 1} == {'a': 1.0} }} {{ [{'x': [1]}] == [{'x': [1]}] }}")
case("in_operator", "{{ 'lo' in s }} {{ 2 in lst }} {{ 9 not in lst }} {{ 'a' in d }} {{ 'z' in d }} {{ 'x' in missing }} {{ none in [none] }}")
case("and_or_values", "{{ 0 or 'default' }} {{ 'x' and 'y' }} {{ '' and 'y' }} {{ nothing or empty or 'last' }} {{ missing or 'fallback' }}")
case("not_precedence", "{{ not true and false }} {{ not (true and false) }} {{ not 1 == 2 }} {{ not missing is defined }}")
case("conditional_expr", "{{ 'yes' if t else 'no' }} {{ 'yes' if nothing else 'no' }} [{{ 'only if' if false }}] {{ 1 if false else 2 if false else 3 }}")
case("attribute_vs_item", "{{ d.a }} {{ d['a'] }} {{ nested.x.y.z }} {{ nested['x']['y'].z }} {{ nested.list[1].k }} {{ nested.list.0.k }} {{ users[-1].name }}")
case("dict_method_wins_over_key", "{% set m = {'items': 'key value', 'other': 1} %}{{ m['items'] }} {{ m.items()|list }}")
case("slicing", "{{ lst[1:] }} {{ lst[:2] }} {{ lst[::-1] }} {{ lst[-2:] }} {{ lst[::2] }} {{ s[:5] }} {{ s[::-1] }} {{ uni[1:4] }} {{ lst[5:] }} {{ lst[1:-1] }} {{ (1, 2, 3)[1:] }}")
case("string_index", "{{ s[0] }}{{ s[-1] }}{{ uni[6] }}[{{ s[100] }}]")
case("call_with_star_args", "{% macro m(a, b, c) %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ m(*[1, 2], **{'c': 3}) }}")
case("literal_none_variants", "{{ none is none }} {{ None is none }} {{ True is true }}")

# ---------------------------------------------------------------- tests
case("test_defined_undefined", "{{ s is defined }} {{ missing is defined }} {{ missing is undefined }} {{ d.zz is undefined }} {{ nothing is defined }}")
case("test_types", "{{ s is string }} {{ n is string }} {{ d is mapping }} {{ lst is mapping }} {{ n is number }} {{ f is number }} {{ t is number }} {{ n is integer }} {{ t is integer }} {{ f is float }} {{ t is boolean }} {{ n is boolean }}")
case("test_iterable_sequence", "{{ lst is iterable }} {{ s is iterable }} {{ d is iterable }} {{ n is iterable }} {{ missing is iterable }} {{ lst is sequence }} {{ d is sequence }} {{ n is sequence }} {{ nothing is iterable }}")
case("test_none_true_false", "{{ nothing is none }} {{ 0 is none }} {{ t is true }} {{ 1 is true }} {{ false is false }} {{ 0 is false }}")
case("test_odd_even_divisible", "{{ 3 is odd }} {{ 3 is even }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 10 is divisibleby(3) }}")
case("test_eq_family", "{{ 2 is eq 2 }} {{ 2 is equalto 3 }} {{ 2 is ne 3 }} {{ 3 is gt 2 }} {{ 3 is ge 3 }} {{ 1 is lt 2 }} {{ 2 is le 1 }} {{ 1 is greaterthan 0 }} {{ 1 is lessthan 0 }}")
case("test_in", "{{ 2 is in lst }} {{ 'x' is in 'xyz' }} {{ 'q' is in d }}")
case("test_lower_upper", "{{ 'abc' is lower }} {{ 'aBc' is lower }} {{ 'ABC' is upper }} {{ '123' is upper }}")
case("test_not", "{{ s is not string }} {{ missing is not defined }} {{ nothing is not none }}")
case("test_callable_sameas", "{{ range is callable }} {{ s is callable }} {{ nothing is sameas none }} {{ t is sameas true }}")
case("test_filter_test_names", "{{ 'upper' is filter }} {{ 'nosuch' is filter }} {{ 'odd' is test }}")
case("test_in_condition_and_or", "{% if s is string and n is number or false %}ok{% endif %}")

# ---------------------------------------------------------------- filters
case("f_length_count", "{{ lst|length }} {{ s|length }} {{ uni|length }} {{ d|count }} {{ missing|length }} {{ empty|length }}")
case("f_list", "{{ 'abc'|list }} {{ d|list }} {{ missing|list }} {{ (1, 2)|list }}")
case("f_string", "{{ n|string ~ 'x' }} {{ lst|string }} {{ nothing|string }} {{ missing|string }}|")
case("f_upper_lower", "{{ s|upper }} {{ s|lower }} {{ uni|upper }} {{ 'ÀÉÎ'|lower }} {{ 'straße'|upper }} {{ n|upper }}")
case("f_capitalize_title", "{{ 'hELLO wORLD'|capitalize }} {{ 'hello world-wide (web) [x] <y>'|title }} {{ \"they're bill's\"|title }}")
case("f_replace", "{{ s|replace('o', '0') }} {{ 'aaaa'|replace('a', 'b', 2) }} {{ 'abc'|replace('', '-') }} {{ n|replace('5', 'five') }}")
case("f_trim", "[{{ '  x  '|trim }}] [{{ 'xxhixx'|trim('x') }}] [{{ '\\n\\t y \\u3000'|trim }}]")
case("f_join", "{{ lst|join }} {{ lst|join(', ') }} {{ users|join(', ', attribute='name') }} {{ [1, none, 'a']|join('-') }}")
case("f_default", "{{ missing|default('dflt') }} {{ missing|d('short') }} {{ ''|default('empty', true) }} {{ ''|default('empty') }} {{ nothing|default('n') }} {{ nothing|default('n', boolean=true) }} {{ 0|d(5, true) }}")
case("f_default_chain", "{{ missing|default(other_missing)|default('last') }}")
case("f_first_last", "{{ lst|first }} {{ lst|last }} {{ s|first }} {{ s|last }} [{{ empty|first }}] {{ d|first }} {{ d|last }}")
case("f_int", "{{ '42'|int }} {{ '4.7'|int }} {{ 'x'|int }} {{ 'x'|int(-1) }} {{ ' 12 '|int }} {{ '0x1A'|int(0, 16) }} {{ '0b11'|int(base=0) }} {{ true|int }} {{ nothing|int }} {{ 3.9|int }} {{ -3.9|int }} {{ '1_0'|int }} {{ '-8'|int }}")
case("f_float", "{{ '2.5'|float }} {{ 'x'|float }} {{ 'x'|float(1.5) }} {{ 3|float }} {{ '1e3'|float }} {{ ' -0.5 '|float }} {{ nothing|float }}")
case("f_abs_round", "{{ -3|abs }} {{ -2.5|abs }} {{ 2.5|round }} {{ 3.5|round }} {{ -2.5|round }} {{ 3|round }} {{ 3.14159|round(2) }} {{ 2.675|round(2) }} {{ 2.1|round(0, 'ceil') }} {{ 2.9|round(method='floor') }} {{ 1234|round(-2) }}")
case("f_items", "{{ d|items|list }} {% for k, v in d|items %}{{ k }}{{ v }}{% endfor %} {{ missing|items|list }}")
case("f_dictsort", "{{ d|dictsort }} {{ {'B': 1, 'a': 2}|dictsort }} {{ {'B': 1, 'a': 2}|dictsort(true) }} {{ d|dictsort(by='value', reverse=true) }}")
case("f_sort", "{{ lst|sort }} {{ words|sort }} {{ words|sort(case_sensitive=true) }} {{ lst|sort(reverse=true) }} {{ users|sort(attribute='age')|map(attribute='name')|list }} {{ users|sort(attribute='name')|map(attribute='name')|join(',') }}")
case("f_sort_multi_attribute", "{{ [{'a': 1, 'b': 'y'}, {'a': 0, 'b': 'z'}, {'a': 1, 'b': 'x'}]|sort(attribute='a,b') }}")
case("f_unique", "{{ ['a', 'A', 'b', 'a']|unique|list }} {{ ['a', 'A', 'b']|unique(case_sensitive=true)|list }} {{ users|unique(attribute='admin')|map(attribute='name')|list }}")
case("f_reverse", "{{ lst|reverse|list }} {{ s|reverse }} {{ d|reverse|list }} {% for x in lst|reverse %}{{ x }}{% endfor %}")
case("f_map", "{{ users|map(attribute='name')|list }} {{ users|map(attribute='admin', default='?')|list }} {{ words|map('upper')|list }} {{ lst|map('string')|join('+') }} {{ [' a ', 'b ']|map('trim')|list }} {{ ['x', 'y']|map('replace', 'x', 'z')|list }}")
case("f_map_nested_attribute", "{{ [{'p': {'q': 1}}, {'p': {'q': 2}}]|map(attribute='p.q')|list }} {{ [[1, 2], [3, 4]]|map(attribute='1')|list }}")
case("f_select_reject", "{{ range(10)|select('odd')|list }} {{ range(10)|reject('odd')|list }} {{ [0, 1, '', 'a', none]|select|list }} {{ lst|select('gt', 1)|list }} {{ lst|select('in', [1, 3])|list }}")
case("f_selectattr", "{{ users|selectattr('admin')|map(attribute='name')|list }} {{ users|rejectattr('admin')|map(attribute='name')|list }} {{ users|selectattr('age', 'gt', 26)|map(attribute='name')|list }} {{ users|selectattr('name', 'equalto', 'bob')|list }} {{ users|selectattr('admin', 'defined')|list|length }} {{ users|selectattr('name', '==', 'Ann')|first }}")
case("f_selectattr_truthy_generator", "{% if users|selectattr('name', 'equalto', 'nobody') %}generator is always true{% endif %}|{{ (users|selectattr('name', 'equalto', 'nobody')|list)|length }}")
case("f_tojson_basic", "{{ d|tojson }} {{ users|tojson }} {{ s|tojson }} {{ nothing|tojson }} {{ t|tojson }} {{ f|tojson }} {{ [1.0, 1e16, 0.1]|tojson }}")
case("f_tojson_unicode", "{{ uni|tojson }} {{ uni|tojson(ensure_ascii=true) }} {{ 'a\\u0001\\n\\t\"\\\\/\\x7f'|tojson }} {{ '\\x7f'|tojson(true) }}")
case("f_tojson_indent", "{{ schema|tojson(indent=2) }}\n{{ {'a': [], 'b': {}, 'c': [1]}|tojson(indent=4) }}\n{{ [1, [2]]|tojson(indent=0) }}\n{{ {'k': 'v'}|tojson(indent='\\t') }}")
case("f_tojson_options", "{{ d|tojson(sort_keys=true) }} {{ d|tojson(separators=(',', ':')) }} {{ d|tojson(indent=1, separators=(', ', ' = ')) }}")
case("f_tojson_positional_is_ensure_ascii", "{{ 'é'|tojson(2) }}")
case("f_tojson_tuple_keys", "{{ {1: 'int key', 2.5: 'float', true: 'bool', none: 'null'}|tojson }} {{ (1, 'two')|tojson }}")
case("f_tojson_schema_in_prompt", "<tools>\n{% for tool in [schema] %}{{ tool|tojson(ensure_ascii=False) }}\n{% endfor %}</tools>")
case("f_indent", "{{ multi|indent }}|{{ multi|indent(2, true) }}|{{ multi|indent(2, blank=true) }}|{{ multi|indent('> ', first=true) }}|{{ 'one'|indent }}")
case("f_wordcount", "{{ s|wordcount }} {{ 'one, two... three_four 5'|wordcount }} {{ ''|wordcount }}")
case("f_center", "[{{ 'ab'|center(7) }}][{{ 'abc'|center(6) }}][{{ 'x'|center(1) }}]")
case("f_format", "{{ '%s has %d items'|format('list', 3) }} {{ '%(a)s!'|format(a='kw') }} {{ '%.3f'|format(3.14159) }} {{ '%5.1f|%-6s|'|format(2.25, 'ab') }}")
case("f_escape_safe", "{{ '<a href=\"x\">&\\'</a>'|escape }} {{ '<b>'|e }} {{ '<i>'|safe }}")
case("f_sum_min_max", "{{ lst|sum }} {{ users|sum(attribute='age') }} {{ [[1], [2]]|sum(start=[]) }} {{ lst|min }} {{ lst|max }} {{ words|min }} {{ words|max }} {{ words|max(case_sensitive=true) }} {{ users|max(attribute='age') }} [{{ empty|max }}]")
case("f_batch", "{{ range(7)|batch(3)|list }} {{ range(5)|batch(2, 'x')|list }}")
case("f_attr", "{{ d|attr('items') is callable }} [{{ d|attr('a') }}] {{ s|attr('upper')() }}")
case("f_chain", "{{ users|map(attribute='name')|map('lower')|sort|join(', ')|upper }}")

# ---------------------------------------------------------------- str / dict / list methods
case("m_startswith_endswith", "{{ s.startswith('Hell') }} {{ s.startswith(('x', 'He')) }} {{ s.endswith('World') }} {{ s.endswith('o', 0, 5) }} {{ s.startswith('World', 6) }}")
case("m_split", "{{ s.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a,b,c'.split(',', 1) }} {{ '  a  b  '.split() }} {{ '  a  b  '.split(none, 1) }} {{ 'a,b,c'.rsplit(',', 1) }} {{ ' a b '.rsplit(none, 1) }} {{ ''.split() }} {{ ''.split(',') }}")
case("m_strip", "[{{ '  x  '.strip() }}][{{ '  x  '.lstrip() }}][{{ '  x  '.rstrip() }}][{{ '--x--'.strip('-') }}][{{ 'abcxcba'.strip('ab') }}][{{ '\\n\\nx\\n'.rstrip('\\n') }}]")
case("m_replace", "{{ s.replace('l', 'L') }} {{ s.replace('l', 'L', 1) }} {{ 'aaa'.replace('a', '') }}")
case("m_case", "{{ s.upper() }} {{ s.lower() }} {{ 'hello wORLD'.title() }} {{ \"they're 3rd\".title() }} {{ 'hELLO'.capitalize() }} {{ 'AbC'.swapcase() }}")
case("m_find_count", "{{ s.find('o') }} {{ s.rfind('o') }} {{ s.find('z') }} {{ s.find('o', 5) }} {{ uni.find('世') }} {{ s.count('l') }} {{ s.index('W') }} {{ 'aaa'.count('aa') }}")
case("m_join_format", "{{ ', '.join(['a', 'b']) }} {{ '-'.join('xyz') }} {{ '{} and {}'.format('x', 1) }} {{ '{1}{0}{1}'.format('a', 'b') }} {{ '{name}: {v!r}'.format(name='k', v='s') }} {{ '{:>5}|{:<4}|{:^7}|{:05d}|{:.2f}|{:,}'.format('r', 'l', 'c', 42, 3.14159, 1234567) }} {{ '{0[k]} {1.a}'.format({'k': 'item'}, d) }}")
case("m_misc_str", "{{ 'ab'.center(6, '*') }} {{ 'x'.ljust(3, '.') }} {{ 'x'.rjust(3) }} {{ '42'.zfill(5) }} {{ '-7'.zfill(4) }} {{ 'a=b=c'.partition('=') }} {{ 'a=b=c'.rpartition('=') }} {{ 'prefix_x'.removeprefix('prefix_') }} {{ 'x.txt'.removesuffix('.txt') }}")
case("m_is_predicates", "{{ '123'.isdigit() }} {{ '12a'.isdigit() }} {{ 'abc'.isalpha() }} {{ 'ab1'.isalnum() }} {{ ' \\t'.isspace() }} {{ ''.isspace() }} {{ 'abc'.islower() }} {{ 'ABC'.isupper() }}")
case("m_splitlines", "{{ multi.splitlines() }} {{ 'a\\r\\nb\\rc'.splitlines() }} {{ 'a\\nb\\n'.splitlines(true) }}")
case("m_dict", "{{ d.keys() }} {{ d.values() }} {{ d.items() }} {{ d.keys()|list }} {{ d.get('a') }} {{ d.get('zz') }} {{ d.get('zz', 'dflt') }} {{ d.copy() }}")
case("m_dict_views_truthy_len", "{{ d.items()|length }} {% if emptyd.items() %}x{% else %}empty view{% endif %} {{ 'a' in d.keys() }} {{ 1 in d.values() }}")
case("m_list", "{{ lst.index(1) }} {{ [1, 2, 1].count(1) }} {{ lst.copy() }}")
case("m_list_pop_clear", "{% set l = [1, 2, 3, 4] %}{{ l.pop() }} {{ l.pop(0) }} {{ l }} {{ l.clear() }} {{ l }}")
case("m_on_tuple", "{{ (1, 2, 2).count(2) }} {{ (1, 2).index(2) }}")

# ---------------------------------------------------------------- globals
case("raise_exception_unused", "{% if false %}{{ raise_exception('never') }}{% endif %}fine")
case("strftime_escape_only", "{{ strftime_now('%%') }}")
case("range_negative_step", "{% for i in range(3, -1, -1) %}{{ i }}{% endfor %}")

# ---------------------------------------------------------------- chat-template idioms
MSGS = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "image"}, {"type": "text", "text": "Part two."}]},
]
case("idiom_last_user_index", """{%- set ns = namespace(last=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}
last user at {{ ns.last }}; {{ messages|selectattr('role', 'equalto', 'user')|list|length }} user turns""", {"messages": MSGS})
case("idiom_content_parts", """{%- for m in messages -%}
{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content if p.type == 'text' %}{{ p.text }}{% endfor %}{% endif %}
{% endfor -%}""", {"messages": MSGS})
case("idiom_system_split", """{%- if messages[0].role == 'system' -%}
{%- set system = messages[0].content -%}{%- set rest = messages[1:] -%}
{%- else -%}{%- set system = 'default' -%}{%- set rest = messages -%}{%- endif -%}
[{{ system }}] {{ rest|length }} {{ rest|map(attribute='role')|join(',') }}""", {"messages": MSGS})
case("idiom_think_split", """{%- set c = content -%}
{%- if '</think>' in c -%}
{%- set reasoning = c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
[{{ reasoning }}][{{ c }}]""", {"content": "<think>\nstep 1\nstep 2\n</think>\n\nThe answer."})
case("idiom_tool_args_string_or_object", """{%- for call in calls -%}
{%- set args = call.function.arguments -%}
{{ call.function.name }}({% if args is string %}{{ args }}{% else %}{{ args|tojson }}{% endif %})
{% endfor -%}""", {"calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}, {"function": {"name": "g", "arguments": {"y": [1, 2], "z": "é"}}}]})
case("idiom_undefined_kwargs", "{{ add_generation_prompt is defined }} {{ enable_thinking|default(true) }} {{ (tools or [])|length }}", {})
case("idiom_bos_eos", "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}", {"bos_token": "<s>", "eos_token": "</s>", "messages": MSGS[:2]})

case("idiom_reverse_scan_for_last_query", """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) -%}
{%- for message in messages[::-1] -%}
{%- set index = (messages|length - 1) - loop.index0 -%}
{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) -%}
{%- set ns.multi_step_tool = false -%}
{%- set ns.last_query_index = index -%}
{%- endif -%}
{%- endfor -%}
last query at {{ ns.last_query_index }}""", {"messages": [
    {"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "second"}, {"role": "assistant", "content": "calling"},
    {"role": "user", "content": "<tool_response>42</tool_response>"}]})
case("idiom_alternation_check", """{%- for message in messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
{{- '[' ~ message['role']|upper ~ '] ' ~ message['content']|trim ~ '\n' -}}
{%- endfor -%}""", {"messages": [{"role": "user", "content": " a "}, {"role": "assistant", "content": "b\n"}]})
fails("err_alternation_check", """{%- for message in messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
{%- endfor -%}""", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
      contains="line 3, column 5: Conversation roles must alternate")
case("idiom_date_header_and_tools_indent", """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- for t in tools %}
    {{- t | tojson(indent=4) }}
    {{- "\n\n" }}
{%- endfor %}
{{- builtin_tools | reject('equalto', 'code_interpreter') | join(', ') }}""",
     {"bos_token": "<|begin_of_text|>", "date_string": "26 Jul 2024", "builtin_tools": ["brave_search", "code_interpreter", "wolfram_alpha"],
      "tools": [{"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}]})
case("idiom_tojson_safe_and_items_sort", "{{ d|tojson|safe }} {{ d.items()|sort }} {{ d|dictsort(false, 'value') }} {{ users|map(attribute='name')|select('equalto', 'Ann')|list }}")
case("idiom_unicode_title", "{{ 'élan vital'|title }} {{ 'ÉCOLE'|lower }} {{ 'ñandú'|capitalize }} {{ 'straße'|title }}")
case("idiom_tool_call_shadowing", """{%- for tool_call in calls -%}
{%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
{{ tool_call.name }}{{ tool_call.arguments|tojson }};
{%- endfor -%}""", {"calls": [{"function": {"name": "a", "arguments": {"x": 1}}}, {"name": "b", "arguments": {}}]})

# ---------------------------------------------------------------- errors jinja2 raises
fails("err_unclosed_for", "{% for x in lst %}\n{{ x }}\n", contains="line 2, column 6: expected 'endfor' or 'else'")
fails("err_unclosed_for_trailing_lines", "{% for x in lst %}\n{{ x }}\n\n\n")
fails("err_unclosed_variable_trailing_lines", "{{ x\n\n")
fails("err_unclosed_if", "{% if t %}\nyes", contains="expected 'elif', 'else' or 'endif'")
fails("err_unknown_tag", "a\n{% frobnicate %}", contains="line 2, column 4: unknown tag 'frobnicate'")
fails("err_wrong_end_tag", "{% for x in lst %}{% endif %}", contains="expected 'endfor' or 'else'")
fails("err_stray_end_tag", "text {% endfor %}", contains="unknown tag 'endfor'")
fails("err_missing_expression", "{{ }}", contains="line 1, column 4: expected an expression, found '}}'")
fails("err_unclosed_variable", "{{ s ", contains="expected '}}', found end of template")
fails("err_unclosed_block", "{% if s ", contains="expected '%}', found end of template")
fails("err_bad_operator_sequence", "{{ 1 + * 2 }}", contains="line 1, column 8: expected an expression, found '*'")
fails("err_unbalanced_paren", "{{ (1 + 2 }}", contains="line 1")
fails("err_unexpected_close_paren", "{{ 1 + 2) }}", contains="line 1, column 9: unexpected ')'")
fails("err_bad_char", "{{ 1 ! 2 }}", contains="line 1, column 6: unexpected character '!'")
fails("err_unterminated_string", "{{ 'abc }}", contains="line 1, column 4: unterminated string literal")
fails("err_unclosed_comment", "a {# never closed", contains="line 1, column 3")
fails("err_error_position_multiline", "line one\nline two {{ s }}\n  {{ s +* 1 }}", contains="line 3, column 9")
fails("err_unknown_filter", "{{ s|nosuchfilter }}", contains="line 1, column 6: no filter named 'nosuchfilter'")
fails("err_unknown_filter_in_for", "{% for x in lst %}{{ x|nosuch }}{% endfor %}", contains="no filter named 'nosuch'")
fails("err_unknown_filter_in_if_at_runtime", "{% if t %}{{ s|nosuch }}{% endif %}", contains="line 1, column 16")
fails("err_unknown_test", "{{ s is nosuchtest }}", contains="no test named 'nosuchtest'")
fails("err_break_outside_loop", "{% break %}", contains="outside of a for loop")
fails("err_break_in_macro_in_loop", "{% for x in lst %}{% macro m() %}{% break %}{% endmacro %}{% endfor %}", contains="outside of a for loop")
fails("err_raise_exception", "{% if messages|length == 0 %}{{ raise_exception('No messages given!') }}{% endif %}", {"messages": []}, contains="No messages given!")
fails("err_raise_exception_position", "ok\n  {{- raise_exception('Bad role: ' ~ role) }}", {"role": "robot"}, contains="line 2, column 7: Bad role: robot")
fails("err_undefined_attribute_of_undefined", "{{ missing.attr }}", contains="'missing' is undefined")
fails("err_undefined_nested_attribute", "{{ d.missing.attr }}", contains="'dict object' has no attribute 'missing'")
fails("err_call_undefined", "{{ missing() }}", contains="'missing' is undefined")
fails("err_undefined_arithmetic", "{{ missing + 1 }}", contains="is undefined")
fails("err_undefined_compare", "{{ missing < 1 }}", contains="is undefined")
fails("err_undefined_tojson", "{{ missing|tojson }}", contains="not JSON serializable")
fails("err_type_concat", "{{ 'a' + 1 }}", contains="can only concatenate str")
fails("err_type_compare", "{{ 1 < 'a' }}", contains="'<' not supported between instances of 'int' and 'str'")
fails("err_division_by_zero", "{{ 1 / 0 }}", contains="division by zero")
fails("err_modulo_by_zero", "{{ 1 % 0 }}", contains="modulo by zero")
fails("err_not_iterable", "{% for x in n %}{% endfor %}", contains="'int' object is not iterable")
fails("err_none_not_iterable", "{% for x in nothing %}{% endfor %}", contains="'NoneType' object is not iterable")
fails("err_unpack_count", "{% for a, b in [[1, 2, 3]] %}{% endfor %}", contains="too many values to unpack")
fails("err_unpack_count_few", "{% set a, b = [1] %}", contains="not enough values to unpack")
fails("err_macro_too_many_args", "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", contains="takes not more than 1 argument")
fails("err_macro_unknown_kwarg", "{% macro m(a) %}{% endmacro %}{{ m(b=2) }}", contains="no keyword argument 'b'")
fails("err_namespace_assign_non_namespace", "{% set x = {} %}{% set x.a = 1 %}", contains="non-namespace")
fails("err_list_sort_unsafe", "{{ lst.sort() }}", contains="access to attribute 'sort' of 'list' object is unsafe")
fails("err_dict_update_unsafe", "{{ d.update({'z': 1}) }}", contains="unsafe")
fails("err_range_too_big", "{{ range(100001)|length }}", contains="Range too big")
fails("err_not_callable", "{{ s() }}", contains="'str' object is not callable")
fails("err_str_join_non_str", "{{ ', '.join([1, 2]) }}", contains="expected str instance")
fails("err_items_not_mapping", "{{ lst|items|list }}", contains="Can only get item pairs from a mapping.")
fails("err_last_of_generator", "{{ lst|select('odd')|last }}", contains="not reversible")
fails("err_len_of_generator", "{{ lst|map('string')|length }}", contains="has no len()")
fails("err_cannot_assign_literal", "{% set 1 = 2 %}", contains="line 1, column 8")
fails("err_default_before_nondefault", "{% macro m(a=1, b) %}{% endmacro %}", contains="without a default")
fails("err_chained_is", "{{ 1 is number is number }}", contains="cannot be chained")
fails("err_dict_unhashable_key", "{{ {[1]: 2} }}", contains="unhashable type: 'list'")
fails("err_in_string_requires_string", "{{ 1 in 'abc' }}", contains="requires string as left operand")
fails("err_tojson_generator", "{{ lst|map('string')|tojson }}", contains="not JSON serializable")
fails("err_percent_arguments", "{{ '%s %s' % ('a',) }}", contains="not enough arguments")
fails("err_int_overflow_float", "{{ (1e308 * 10)|int }}", contains="infinity")
fails("err_bad_escape", r"{{ '\x4' }}", contains="line 1, column 5")
# jinja2 fails when rendering (it has no template loader), src/chat already when parsing.
fails("err_extends_unsupported", "{% extends 'base.html' %}", contains="not supported", any_stage=True)

# ---------------------------------------------------------------- full chat templates
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — in °C.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Zürich\""},
                "days": {"type": "integer", "minimum": 1},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}},
    },
}
CONVERSATIONS = {
    "single_turn": {"messages": [{"role": "user", "content": "What is 2+2?"}]},
    "system_multi_turn": {"messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke /nothink"},
    ]},
    "content_parts": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "this picture."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat on a mat."}]},
        {"role": "user", "content": "Thanks — 谢谢"},
    ]},
    "reasoning_history": {"messages": [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "reasoning_content": "91 = 7 * 13.", "content": "No: 91 = 7 × 13."},
        {"role": "user", "content": "And 97?"},
        {"role": "assistant", "reasoning_content": "\nCheck divisors up to 9.\n", "content": "Yes, 97 is prime."},
    ]},
    "think_inside_content": {"messages": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "<think>\nThe user wants a greeting.\n</think>\n\nHi there!"},
    ]},
    "tool_round_trip": {"tools": [WEATHER_TOOL, SEARCH_TOOL], "messages": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Zürich and Paris for 2 days?"},
        {"role": "assistant", "reasoning_content": "Two cities, two calls.", "content": "",
         "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
             {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
         ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 18, \"sky\": \"clear\"}"},
        {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp\": 21, \"sky\": \"rain\"}"},
        {"role": "assistant", "reasoning_content": "Summarize both.", "content": "Zürich: 18 °C, clear. Paris: 21 °C, rain."},
        {"role": "user", "content": "Now search for umbrellas."},
    ]},
    "tool_call_pending": {"tools": [SEARCH_TOOL], "messages": [
        {"role": "user", "content": "Find news about GLM-5."},
        {"role": "assistant", "content": "Let me search.",
         "tool_calls": [{"type": "function", "function": {"name": "search",
                                                          "arguments": {"query": "GLM-5 news", "filters": {"recent": True, "n": 3.5}}}}]},
        {"role": "tool", "content": "[{\"title\": \"GLM-5 released\"}]"},
    ]},
}
# Arguments as a JSON string, as OpenAI clients send them: GLM and DeepSeek-V3.1 styles pass them
# through, the DSML style refuses them with raise_exception.
STRING_ARGS = {"tools": [SEARCH_TOOL], "messages": [
    {"role": "user", "content": "Search cats"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": "{\"query\": \"cats\"}"}}]},
    {"role": "tool", "content": "no results"},
]}
FLAGS = {
    "gen": {"add_generation_prompt": True},
    "nogen": {"add_generation_prompt": False},
    "gen_think": {"add_generation_prompt": True, "enable_thinking": True},
    "gen_nothink": {"add_generation_prompt": True, "enable_thinking": False},
}
SPECIAL_TOKENS = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}

for tname in CHAT_TEMPLATES:
    for cname, conv in CONVERSATIONS.items():
        for fname, flags in FLAGS.items():
            CASES.append({"name": f"chat_{tname}_{cname}_{fname}", "template_file": tname,
                          "context": {**SPECIAL_TOKENS, **conv, **flags}})
    args_case = {"name": f"chat_{tname}_string_arguments", "template_file": tname,
                 "context": {**SPECIAL_TOKENS, **STRING_ARGS, "add_generation_prompt": True}}
    if tname == "deepseek_v32":
        args_case.update(must_fail=True, error_contains="DSML tool calls need their arguments as a JSON object")
    CASES.append(args_case)
CASES.append({"name": "chat_glm_unknown_role", "template_file": "glm", "must_fail": True,
              "error_contains": "Unexpected message role: robot",
              "context": {"messages": [{"role": "robot", "content": "beep"}]}})


def render(c):
    env = make_env(c.get("trim_blocks", True), c.get("lstrip_blocks", True))
    source = CHAT_TEMPLATES[c["template_file"]] if "template_file" in c else c["template"]
    try:
        tmpl = env.from_string(source)
    except jinja2.TemplateError as e:
        return None, {"stage": "parse", "type": type(e).__name__, "message": str(e), "line": getattr(e, "lineno", None)}
    except SyntaxError as e:  # jinja2 lets Python's compiler reject e.g. 'break' outside a loop
        return None, {"stage": "parse", "type": type(e).__name__, "message": str(e), "line": None}
    try:
        return tmpl.render(**c["context"]), None
    except Exception as e:  # jinja2 lets Python's TypeError, ZeroDivisionError, ... through
        return None, {"stage": "render", "type": type(e).__name__, "message": str(e), "line": None}


def main():
    names = set()
    out_cases = []
    contexts = {}  # cases share their contexts by reference: "context_ref" names one of these
    for c in CASES:
        if c["name"] in names:
            sys.exit(f"duplicate case name {c['name']}")
        names.add(c["name"])
        output, error = render(c)
        rec = {k: v for k, v in c.items() if k not in ("must_fail", "error_contains", "context") and v is not None}
        key = json.dumps(c["context"], sort_keys=True)
        if key not in contexts:
            contexts[key] = (f"ctx{len(contexts)}", c["context"])
        rec["context_ref"] = contexts[key][0]
        if c.get("must_fail"):
            if error is None:
                sys.exit(f"{c['name']}: expected jinja2 to fail, it rendered {output!r}")
            rec["error"] = error
            if c.get("error_contains"):
                rec["error_contains"] = c["error_contains"]
        else:
            if error is not None:
                sys.exit(f"{c['name']}: jinja2 failed: {error}")
            rec["expected"] = output
        out_cases.append(rec)
    data = {
        "generator": "scripts/reference/make_jinja_cases.py",
        "jinja2_version": jinja2.__version__,
        "environment": "ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]) "
                       "with transformers' tojson, raise_exception and strftime_now",
        "contexts": {name: ctx for name, ctx in contexts.values()},
        "cases": out_cases,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
        f.write("\n")
    failing = sum(1 for c in out_cases if "error" in c)
    print(f"wrote {len(out_cases)} cases ({failing} that must fail) to {os.path.relpath(OUT, ROOT)}")


if __name__ == "__main__":
    main()
