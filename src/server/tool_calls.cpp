#include "server/tool_calls.h"

#include <algorithm>
#include <mutex>
#include <random>

namespace sparsemla::server {
namespace {

std::string_view trim(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// Valid JSON as compact text; anything else as it was written.
std::string json_text(std::string_view raw) {
  const std::string_view t = trim(raw);
  if (t.empty()) return "{}";
  const Json j = Json::parse(t, nullptr, false);
  return j.is_discarded() ? std::string(t) : j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// An argument's value: the text itself when the schema calls it a string, else its JSON reading.
Json argument_value(const std::string& text, bool is_string) {
  if (is_string) return text;
  Json j = Json::parse(text, nullptr, false);
  return j.is_discarded() ? Json(text) : j;
}

// Whether the request's tool `name` declares `key` a string ("string" or a list holding it).
std::optional<bool> schema_says_string(const Json& tools, const std::string& name, const std::string& key) {
  for (const auto& t : tools) {
    const Json& fn = t.contains("function") ? t["function"] : t;
    if (!fn.is_object() || fn.value("name", Json()) != name) continue;
    const Json* props =
        fn.contains("parameters") && fn["parameters"].is_object() && fn["parameters"].contains("properties")
            ? &fn["parameters"]["properties"]
            : nullptr;
    if (!props || !props->is_object() || !props->contains(key) || !(*props)[key].is_object()) return std::nullopt;
    const Json& type = (*props)[key].value("type", Json());
    if (type.is_string()) return type == "string";
    if (type.is_array()) return std::find(type.begin(), type.end(), Json("string")) != type.end();
    return std::nullopt;
  }
  return std::nullopt;
}

// The text between `open` and `close` starting the search at `pos`; `pos` moves past `close`.
std::optional<std::string_view> between(std::string_view s, std::string_view open, std::string_view close,
                                        size_t& pos) {
  const size_t a = s.find(open, pos);
  if (a == std::string_view::npos) return std::nullopt;
  const size_t b = s.find(close, a + open.size());
  if (b == std::string_view::npos) return std::nullopt;
  pos = b + close.size();
  return s.substr(a + open.size(), b - a - open.size());
}

// The value of attribute `attr="..."` in a tag.
std::string attribute(std::string_view tag, std::string_view attr) {
  const std::string key = std::string(attr) + "=\"";
  const size_t a = tag.find(key);
  if (a == std::string_view::npos) return {};
  const size_t b = tag.find('"', a + key.size());
  return std::string(
      tag.substr(a + key.size(), b == std::string_view::npos ? std::string_view::npos : b - a - key.size()));
}

}  // namespace

std::string new_tool_call_id() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  static const char alphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::lock_guard lk(mu);
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += alphabet[rng() % (sizeof(alphabet) - 1)];
  return id;
}

std::optional<ToolCall> parse_glm_tool_call(std::string_view body, const Json& tools) {
  body = trim(body);
  ToolCall call;
  call.id = new_tool_call_id();
  if (body.starts_with("{")) {  // the older JSON form
    const Json j = Json::parse(body, nullptr, false);
    if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return std::nullopt;
    call.name = j["name"];
    const Json args = j.contains("arguments") ? j["arguments"] : j.value("parameters", Json::object());
    call.arguments = args.is_string() ? json_text(args.get<std::string>()) : args.dump();
    return call;
  }
  const size_t name_end = std::min(body.find("<arg_key>"), body.find('\n'));
  call.name = std::string(trim(body.substr(0, name_end)));
  if (call.name.empty()) return std::nullopt;
  Json args = Json::object();
  size_t pos = name_end == std::string_view::npos ? body.size() : name_end;
  while (auto key = between(body, "<arg_key>", "</arg_key>", pos)) {
    auto value = between(body, "<arg_value>", "</arg_value>", pos);
    if (!value) break;
    const std::string k(trim(*key));
    const auto is_string = schema_says_string(tools, call.name, k);
    args[k] = argument_value(std::string(*value), is_string.value_or(false));
  }
  call.arguments = args.dump(-1, ' ', false, Json::error_handler_t::replace);
  return call;
}

std::optional<ToolCall> parse_deepseek_tool_call(std::string_view body) {
  static constexpr std::string_view kSep = "<｜tool▁sep｜>";
  const size_t sep = body.find(kSep);
  if (sep == std::string_view::npos) return std::nullopt;
  const std::string_view left = trim(body.substr(0, sep));
  std::string_view right = body.substr(sep + kSep.size());
  ToolCall call;
  call.id = new_tool_call_id();
  if (left == "function") {  // V3: the name on the first line, then a ```json block
    const size_t nl = right.find('\n');
    call.name = std::string(trim(right.substr(0, nl)));
    std::string_view rest = nl == std::string_view::npos ? std::string_view() : right.substr(nl);
    size_t pos = 0;
    if (auto fenced = between(rest, "```json", "```", pos)) rest = *fenced;
    call.arguments = json_text(rest);
  } else {
    call.name = std::string(left);
    call.arguments = json_text(right);
  }
  if (call.name.empty()) return std::nullopt;
  return call;
}

std::optional<ToolCall> parse_dsml_invoke(std::string_view invoke) {
  const size_t tag_end = invoke.find('>');
  if (tag_end == std::string_view::npos) return std::nullopt;
  ToolCall call;
  call.id = new_tool_call_id();
  call.name = attribute(invoke.substr(0, tag_end), "name");
  if (call.name.empty()) return std::nullopt;
  Json args = Json::object();
  static constexpr std::string_view kOpen = "<｜DSML｜parameter", kClose = "</｜DSML｜parameter>";
  size_t pos = tag_end;
  for (;;) {
    const size_t a = invoke.find(kOpen, pos);
    if (a == std::string_view::npos) break;
    const size_t gt = invoke.find('>', a);
    const size_t b = gt == std::string_view::npos ? gt : invoke.find(kClose, gt);
    if (b == std::string_view::npos) break;
    const std::string_view tag = invoke.substr(a, gt - a);
    args[attribute(tag, "name")] =
        argument_value(std::string(invoke.substr(gt + 1, b - gt - 1)), attribute(tag, "string") == "true");
    pos = b + kClose.size();
  }
  call.arguments = args.dump(-1, ' ', false, Json::error_handler_t::replace);
  return call;
}

}  // namespace sparsemla::server
