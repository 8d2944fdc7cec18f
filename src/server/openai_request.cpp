#include "server/openai_request.h"

#include <algorithm>
#include <limits>

#include "server/api_error.h"

namespace sparsemla::server {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Templates and JSON printers recurse over nesting; a limit keeps a hostile body from exhausting
// the stack anywhere downstream.
constexpr int kMaxDepth = 64;

int nesting_depth(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

GenerationOptions parse_generation(const Json& j) {
  GenerationOptions g;
  g.model = get_string(j, "model").value_or("");
  engine::SamplingParams& s = g.sampling;
  s.temperature = float(get_number(j, "temperature", 0, kInf).value_or(1.0));
  s.top_p = float(get_number(j, "top_p", 0, 1).value_or(1.0));
  if (s.top_p <= 0) invalid("top_p", "'top_p' must be greater than 0, got 0");
  const int64_t top_k = get_int(j, "top_k", -1, INT32_MAX).value_or(0);
  s.top_k = top_k < 0 ? 0 : int32_t(top_k);
  s.min_p = float(get_number(j, "min_p", 0, 1).value_or(0.0));
  s.presence_penalty = float(get_number(j, "presence_penalty", -2, 2).value_or(0.0));
  s.frequency_penalty = float(get_number(j, "frequency_penalty", -2, 2).value_or(0.0));
  s.repetition_penalty = float(get_number(j, "repetition_penalty", 0, kInf).value_or(1.0));
  if (s.repetition_penalty <= 0) invalid("repetition_penalty", "'repetition_penalty' must be greater than 0");
  if (auto seed = get_int(j, "seed", INT64_MIN, INT64_MAX)) g.seed = uint64_t(*seed);

  auto max_tokens = get_int(j, "max_tokens", INT64_MIN, INT64_MAX);
  const char* max_key = "max_tokens";
  if (auto m = get_int(j, "max_completion_tokens", INT64_MIN, INT64_MAX)) {
    max_tokens = m;
    max_key = "max_completion_tokens";
  }
  if (max_tokens) {
    if (*max_tokens <= 0) invalid(max_key, "'{}' must be at least 1, got {}", max_key, *max_tokens);
    g.max_tokens = int32_t(std::min<int64_t>(*max_tokens, INT32_MAX));
  }

  if (auto it = j.find("stop"); it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      g.stop.push_back(it->get<std::string>());
    } else if (it->is_array()) {
      if (it->size() > 16) invalid("stop", "'stop' may hold at most 16 strings, got {}", it->size());
      for (const auto& x : *it) {
        if (!x.is_string()) invalid("stop", "'stop' must be a string or an array of strings, got an {}", json_type(x));
        g.stop.push_back(x.get<std::string>());
      }
    } else {
      invalid("stop", "'stop' must be a string or an array of strings, got {}", json_type(*it));
    }
    std::erase_if(g.stop, [](const std::string& x) { return x.empty(); });
  }
  if (auto n = get_int(j, "n", INT64_MIN, INT64_MAX); n && *n != 1)
    invalid("n", "'n' must be 1 (one choice per request), got {}", *n);
  g.ignore_eos = get_bool(j, "ignore_eos").value_or(false);
  g.stream = get_bool(j, "stream").value_or(false);
  if (const Json* so = get_object(j, "stream_options"))
    g.include_usage = get_bool(*so, "include_usage").value_or(false);
  if (const Json* rf = get_object(j, "response_format")) {
    const std::string type = get_string(*rf, "type").value_or("text");
    if (type != "text") invalid("response_format", "response_format '{}' is not supported (only 'text')", type);
  }
  return g;
}

// Message content as one string: a string, or the text of an array of text parts.
std::string content_text(const Json& m, size_t index, bool may_be_null) {
  auto it = m.find("content");
  const std::string param = fmt::format("messages[{}].content", index);
  if (it == m.end() || it->is_null()) {
    if (may_be_null) return {};
    invalid(param, "'{}' is missing", param);
  }
  if (it->is_string()) return it->get<std::string>();
  if (!it->is_array()) invalid(param, "'{}' must be a string or an array of parts, got {}", param, json_type(*it));
  std::string text;
  for (const auto& part : *it) {
    if (!part.is_object()) invalid(param, "each part of '{}' must be an object", param);
    const std::string type = get_string(part, "type").value_or("");
    if (type != "text") invalid(param, "content parts of type '{}' are not supported (only 'text')", type);
    auto t = get_string(part, "text");
    if (!t) invalid(param, "a text part of '{}' has no 'text'", param);
    text += *t;
  }
  return text;
}

Json normalize_tool_calls(const Json& calls, size_t index) {
  const std::string param = fmt::format("messages[{}].tool_calls", index);
  if (!calls.is_array()) invalid(param, "'{}' must be an array", param);
  Json out = Json::array();
  for (const auto& c : calls) {
    if (!c.is_object()) invalid(param, "each entry of '{}' must be an object", param);
    const Json* fn = get_object(c, "function");
    if (!fn) invalid(param, "each entry of '{}' needs a 'function' object", param);
    auto name = get_string(*fn, "name");
    if (!name || name->empty()) invalid(param, "each function of '{}' needs a 'name'", param);
    Json args = Json::object();
    if (auto it = fn->find("arguments"); it != fn->end() && !it->is_null()) {
      if (it->is_object()) {
        args = *it;
      } else if (it->is_string()) {
        // Templates want an object to iterate; a string that is not one goes through as it is.
        const std::string text = it->get<std::string>();
        const Json parsed = nesting_depth(text) <= kMaxDepth ? Json::parse(text, nullptr, false) : Json();
        args = parsed.is_object() ? parsed : *it;
      } else {
        invalid(param, "function arguments in '{}' must be a JSON string or an object", param);
      }
    }
    Json call = {{"type", "function"}, {"function", {{"name", *name}, {"arguments", args}}}};
    if (auto id = get_string(c, "id")) call["id"] = *id;
    out.push_back(std::move(call));
  }
  return out;
}

Json normalize_messages(const Json& j) {
  const Json* msgs = get_array(j, "messages");
  if (!msgs) invalid("messages", "'messages' is required");
  if (msgs->empty()) invalid("messages", "'messages' must hold at least one message");
  Json out = Json::array();
  for (size_t i = 0; i < msgs->size(); ++i) {
    const Json& m = (*msgs)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!m.is_object()) invalid(param, "'{}' must be an object, got {}", param, json_type(m));
    auto role = get_string(m, "role");
    if (!role) invalid(param + ".role", "'{}.role' is required", param);
    if (*role == "developer") role = "system";
    if (*role != "system" && *role != "user" && *role != "assistant" && *role != "tool")
      invalid(param + ".role", "unknown role '{}' (system, developer, user, assistant or tool)", *role);
    const bool assistant = *role == "assistant";
    Json n = {{"role", *role}, {"content", content_text(m, i, assistant)}};
    if (auto name = get_string(m, "name")) n["name"] = *name;
    if (assistant) {
      if (auto it = m.find("tool_calls"); it != m.end() && !it->is_null())
        n["tool_calls"] = normalize_tool_calls(*it, i);
      if (auto r = get_string(m, "reasoning_content")) n["reasoning_content"] = *r;
    }
    if (*role == "tool")
      if (auto id = get_string(m, "tool_call_id")) n["tool_call_id"] = *id;
    out.push_back(std::move(n));
  }
  return out;
}

Json normalize_tools(const Json& j) {
  const Json* tools = get_array(j, "tools");
  if (!tools) return Json::array();
  std::vector<std::string> names;
  for (size_t i = 0; i < tools->size(); ++i) {
    const Json& t = (*tools)[i];
    const std::string param = fmt::format("tools[{}]", i);
    if (!t.is_object()) invalid(param, "'{}' must be an object", param);
    if (get_string(t, "type").value_or("function") != "function")
      invalid(param + ".type", "only tools of type 'function' are supported");
    const Json* fn = get_object(t, "function");
    if (!fn) invalid(param + ".function", "'{}.function' is required", param);
    auto name = get_string(*fn, "name");
    if (!name || name->empty()) invalid(param + ".function.name", "'{}.function.name' is required", param);
    get_string(*fn, "description");
    get_object(*fn, "parameters");
    names.push_back(*name);
  }
  auto it = j.find("tool_choice");
  if (it == j.end() || it->is_null()) return *tools;
  if (it->is_string()) {
    const std::string c = it->get<std::string>();
    if (c == "none") return Json::array();
    if (c != "auto" && c != "required")
      invalid("tool_choice", "'tool_choice' must be none, auto, required or a function");
    return *tools;
  }
  if (!it->is_object()) invalid("tool_choice", "'tool_choice' must be a string or an object, got {}", json_type(*it));
  const Json* fn = get_object(*it, "function");
  const auto name = fn ? get_string(*fn, "name") : std::nullopt;
  if (!name || std::find(names.begin(), names.end(), *name) == names.end())
    invalid("tool_choice", "'tool_choice' names a function that is not among the tools");
  return *tools;
}

}  // namespace

Json parse_body(const std::string& body) {
  if (nesting_depth(body) > kMaxDepth)
    throw ApiError(400, fmt::format("the JSON body is nested deeper than {} levels", kMaxDepth));
  Json j = Json::parse(body, nullptr, false);
  if (j.is_discarded()) throw ApiError(400, "the body is not valid JSON");
  if (!j.is_object()) throw ApiError(400, fmt::format("the body must be a JSON object, got {}", json_type(j)));
  return j;
}

ChatRequest parse_chat_request(const std::string& body) {
  const Json j = parse_body(body);
  ChatRequest r;
  r.gen = parse_generation(j);
  r.messages = normalize_messages(j);
  r.tools = normalize_tools(j);
  if (get_bool(j, "logprobs").value_or(false)) {
    r.gen.sampling.top_logprobs = int32_t(get_int(j, "top_logprobs", 0, 20).value_or(0));
  } else if (get_int(j, "top_logprobs", 0, 20).value_or(0) > 0) {
    invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  }
  if (const Json* kw = get_object(j, "chat_template_kwargs")) r.template_kwargs = *kw;
  return r;
}

CompletionRequest parse_completion_request(const std::string& body) {
  const Json j = parse_body(body);
  CompletionRequest r;
  r.gen = parse_generation(j);
  auto it = j.find("prompt");
  if (it == j.end() || it->is_null()) invalid("prompt", "'prompt' is required");
  const Json* p = &*it;
  // One prompt per request: a string, token ids, or a list holding one of those.
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array())) p = &(*p)[0];
  if (p->is_string()) {
    r.prompt_text = p->get<std::string>();
  } else if (p->is_array() && !p->empty() &&
             std::all_of(p->begin(), p->end(), [](const Json& x) { return x.is_number_integer(); })) {
    for (const auto& x : *p) {
      const int64_t id = x.get<int64_t>();
      if (id < 0 || id > INT32_MAX) invalid("prompt", "token id {} is out of range", id);
      r.prompt_tokens.push_back(int32_t(id));
    }
  } else if (p->is_array() && p->size() > 1 && ((*p)[0].is_string() || (*p)[0].is_array())) {
    invalid("prompt", "one prompt per request is supported, got {}", p->size());
  } else {
    invalid("prompt", "'prompt' must be a string or an array of token ids");
  }
  if (auto lp = get_int(j, "logprobs", 0, 20)) r.gen.sampling.top_logprobs = int32_t(*lp);
  r.echo = get_bool(j, "echo").value_or(false);
  return r;
}

}  // namespace sparsemla::server
