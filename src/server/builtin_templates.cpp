#include "server/builtin_templates.h"

namespace sparsemla::server {

// Whitespace is written out in the strings ({{- ... -}} everywhere) so that the output does not
// depend on how the template text is indented.
const std::string_view kGlmTemplate = R"jinja(
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
  {{- '<|system|>\n# Tools\n\nYou may call the functions below. Their signatures, one JSON object per line:\n<tools>\n' -}}
  {%- for t in tools -%}
    {{- (t.function if t.function is defined else t) | tojson -}}
    {{- '\n' -}}
  {%- endfor -%}
  {{- '</tools>\n\nTo call a function, write its name and then each argument as a key and a value:\n' -}}
  {{- '<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}
    {{- '<|system|>\n' ~ m.content -}}
  {%- elif m.role == 'user' -%}
    {{- '<|user|>\n' ~ m.content -}}
  {%- elif m.role == 'assistant' -%}
    {{- '<|assistant|>\n<think></think>' -}}
    {%- if m.content -%}
      {{- '\n' ~ m.content -}}
    {%- endif -%}
    {%- for call in m.tool_calls or [] -%}
      {{- '\n<tool_call>' ~ call.function.name -}}
      {%- if call.function.arguments is mapping -%}
        {%- for key, value in call.function.arguments.items() -%}
          {{- '\n<arg_key>' ~ key ~ '</arg_key>\n<arg_value>' -}}
          {{- value if value is string else value | tojson -}}
          {{- '</arg_value>' -}}
        {%- endfor -%}
      {%- endif -%}
      {{- '\n</tool_call>' -}}
    {%- endfor -%}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
      {{- '<|observation|>' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' ~ m.content ~ '\n</tool_response>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|assistant|>' -}}
  {{- '\n<think></think>' if enable_thinking is defined and not enable_thinking else '' -}}
{%- endif -%}
)jinja";

const std::string_view kDeepSeekTemplate = R"jinja(
{%- set ns = namespace(system='') -%}
{%- for m in messages if m.role == 'system' -%}
  {%- set ns.system = ns.system ~ ('\n\n' if ns.system else '') ~ m.content -%}
{%- endfor -%}
{%- if tools -%}
  {%- set ns.system = ns.system ~ ('\n\n' if ns.system else '') ~ '## Tools\nYou can use the following tools:\n' -%}
  {%- for t in tools -%}
    {%- set f = t.function if t.function is defined else t -%}
    {%- set ns.system = ns.system ~ '\n### ' ~ f.name ~ '\nDescription: ' ~ (f.description or '') ~ '\n\nParameters: ' ~ (f.parameters | tojson) ~ '\n' -%}
  {%- endfor -%}
  {%- set ns.system = ns.system ~ '\nTo use tools, write exactly:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_name<｜tool▁sep｜>arguments as JSON<｜tool▁call▁end｜><｜tool▁calls▁end｜>' -%}
{%- endif -%}
{{- (bos_token or '') ~ ns.system -}}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}
    {{- '<｜User｜>' ~ m.content -}}
  {%- elif m.role == 'assistant' -%}
    {{- '<｜Assistant｜></think>' ~ (m.content or '') -}}
    {%- if m.tool_calls -%}
      {{- '<｜tool▁calls▁begin｜>' -}}
      {%- for call in m.tool_calls -%}
        {%- set args = call.function.arguments -%}
        {{- '<｜tool▁call▁begin｜>' ~ call.function.name ~ '<｜tool▁sep｜>' -}}
        {{- args if args is string else args | tojson -}}
        {{- '<｜tool▁call▁end｜>' -}}
      {%- endfor -%}
      {{- '<｜tool▁calls▁end｜>' -}}
    {%- endif -%}
    {{- '<｜end▁of▁sentence｜>' -}}
  {%- elif m.role == 'tool' -%}
    {{- '<｜tool▁output▁begin｜>' ~ m.content ~ '<｜tool▁output▁end｜>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<｜Assistant｜>' ~ ('<think>' if enable_thinking is defined and enable_thinking else '</think>') -}}
{%- endif -%}
)jinja";

}  // namespace sparsemla::server
