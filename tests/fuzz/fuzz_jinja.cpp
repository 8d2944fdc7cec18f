// libFuzzer target for the Jinja2 interpreter (src/chat): any bytes are a template, parsed and then
// rendered with a small chat context. Template::parse and Template::render may throw TemplateError and
// nothing else; a crash, a sanitizer report or any other exception is a bug.
//
// Build and run from the repository root (not wired into CMake):
//   clang++ -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -Isrc src/chat/*.cpp \
//       tests/fuzz/fuzz_jinja.cpp -lfmt -o /tmp/fuzz_jinja
//   mkdir -p /tmp/jinja_corpus && cp tests/data/jinja/*.jinja /tmp/jinja_corpus/
//   /tmp/fuzz_jinja -max_len=4096 -timeout=30 /tmp/jinja_corpus
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "chat/jinja.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
      {"role": "assistant", "reasoning_content": "Call the tool.", "content": null,
       "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
      {"role": "tool", "content": "{\"temp\": 18}"}
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "enable_thinking": false, "bos_token": "<s>", "n": 3, "x": [1, 2.5, "s"]
  })");
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  try {
    const sparsemla::chat::Template t = sparsemla::chat::Template::parse(source);
    (void)t.render(context);
  } catch (const sparsemla::chat::TemplateError&) {
  }
  return 0;
}
