// The server's text handling without HTTP: GLM and DeepSeek tool-call strings, the streaming split
// into reasoning / content / tool calls (any cut of the text gives the same result), the built-in
// chat formats, and request validation.
#include <gtest/gtest.h>

#include "gguf/reader.h"
#include "server/api_error.h"
#include "server/chat_format.h"
#include "server/chat_output.h"
#include "server/openai_request.h"
#include "server/tool_calls.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace sparsemla::server {
namespace {

const Json kTools = Json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}, "opts": {"type": "object"}}}}},
  {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
])");

Json args_of(const ToolCall& c) { return Json::parse(c.arguments); }

TEST(ToolCalls, GlmKeyValuePairsFollowTheSchema) {
  const auto c = parse_glm_tool_call(
      "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
      "<arg_value>3</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n<arg_key>opts</arg_key>\n"
      "<arg_value>{\"units\": \"metric\"}</arg_value>\n",
      kTools);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->name, "get_weather");
  EXPECT_EQ(args_of(*c), Json::parse(R"({"city": "Paris", "days": 3, "zip": "75001", "opts": {"units": "metric"}})"));
  EXPECT_TRUE(c->id.starts_with("call_"));
}

TEST(ToolCalls, GlmWithoutNewlinesNoArgumentsAndTheJsonForm) {
  auto c = parse_glm_tool_call("get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>", kTools);
  ASSERT_TRUE(c);
  EXPECT_EQ(args_of(*c), Json::parse(R"({"city": "Oslo"})"));
  c = parse_glm_tool_call("ping\n", kTools);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->name, "ping");
  EXPECT_EQ(c->arguments, "{}");
  c = parse_glm_tool_call(R"({"name": "get_weather", "arguments": {"city": "Rome"}})", kTools);
  ASSERT_TRUE(c);
  EXPECT_EQ(args_of(*c), Json::parse(R"({"city": "Rome"})"));
  // Without a schema a value is read as JSON where it parses.
  c = parse_glm_tool_call(
      "unknown<arg_key>n</arg_key><arg_value>42</arg_value><arg_key>s</arg_key><arg_value>hi</arg_value>", kTools);
  ASSERT_TRUE(c);
  EXPECT_EQ(args_of(*c), Json::parse(R"({"n": 42, "s": "hi"})"));
  EXPECT_FALSE(parse_glm_tool_call("\n<arg_key>a</arg_key>", kTools));
}

TEST(ToolCalls, DeepSeekV31V3AndDsml) {
  auto c = parse_deepseek_tool_call("get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"days\": 2}");
  ASSERT_TRUE(c);
  EXPECT_EQ(c->name, "get_weather");
  EXPECT_EQ(args_of(*c), Json::parse(R"({"city": "Paris", "days": 2})"));
  c = parse_deepseek_tool_call("function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Lima\"}\n```");
  ASSERT_TRUE(c);
  EXPECT_EQ(c->name, "get_weather");
  EXPECT_EQ(args_of(*c), Json::parse(R"({"city": "Lima"})"));
  c = parse_deepseek_tool_call("ping<｜tool▁sep｜>not json");
  ASSERT_TRUE(c);
  EXPECT_EQ(c->arguments, "not json");  // as written: OpenAI's arguments need not be valid JSON
  EXPECT_FALSE(parse_deepseek_tool_call("no separator"));

  c = parse_dsml_invoke(
      "<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
      "string=\"true\">Paris</｜DSML｜parameter>\n"
      "<｜DSML｜parameter name=\"days\" string=\"false\">5</｜DSML｜parameter>\n<｜DSML｜parameter name=\"zip\" "
      "string=\"true\">007</｜DSML｜parameter>\n");
  ASSERT_TRUE(c);
  EXPECT_EQ(c->name, "get_weather");
  EXPECT_EQ(args_of(*c), Json::parse(R"({"city": "Paris", "days": 5, "zip": "007"})"));
}

ChatDelta parse_whole(ToolSyntax syntax, const Json& tools, bool in_reasoning, const std::string& text) {
  ChatOutputParser p(syntax, tools, in_reasoning);
  ChatDelta d = p.push(text);
  ChatDelta end = p.finish();
  d.reasoning += end.reasoning;
  d.content += end.content;
  for (auto& c : end.tool_calls) d.tool_calls.push_back(c);
  return d;
}

// The same text cut into pieces at every pair of places must give the same split.
void expect_cut_invariant(ToolSyntax syntax, const Json& tools, bool in_reasoning, const std::string& text) {
  const ChatDelta whole = parse_whole(syntax, tools, in_reasoning, text);
  for (size_t a = 0; a <= text.size(); a += 3)
    for (size_t b = a; b <= text.size(); b += 5) {
      ChatOutputParser p(syntax, tools, in_reasoning);
      ChatDelta d;
      for (auto piece : {text.substr(0, a), text.substr(a, b - a), text.substr(b)}) {
        ChatDelta x = p.push(piece);
        d.reasoning += x.reasoning;
        d.content += x.content;
        for (auto& c : x.tool_calls) d.tool_calls.push_back(c);
      }
      ChatDelta x = p.finish();
      d.reasoning += x.reasoning;
      d.content += x.content;
      for (auto& c : x.tool_calls) d.tool_calls.push_back(c);
      ASSERT_EQ(d.reasoning, whole.reasoning) << "cut at " << a << ", " << b;
      ASSERT_EQ(d.content, whole.content) << "cut at " << a << ", " << b;
      ASSERT_EQ(d.tool_calls.size(), whole.tool_calls.size()) << "cut at " << a << ", " << b;
      for (size_t i = 0; i < d.tool_calls.size(); ++i) {
        EXPECT_EQ(d.tool_calls[i].name, whole.tool_calls[i].name);
        EXPECT_EQ(d.tool_calls[i].arguments, whole.tool_calls[i].arguments);
      }
    }
}

TEST(ChatOutput, ReasoningIsSplitFromTheAnswer) {
  const std::string text = "<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.";
  const ChatDelta d = parse_whole(ToolSyntax::Glm, Json::array(), false, text);
  EXPECT_EQ(d.reasoning, "Let me see: 2 + 2.");
  EXPECT_EQ(d.content, "It is 4.");
  expect_cut_invariant(ToolSyntax::Glm, Json::array(), false, text);
  // A prompt that ends with <think> starts the reply inside it.
  const ChatDelta open = parse_whole(ToolSyntax::DeepSeek, Json::array(), true, "hmm</think>Yes.");
  EXPECT_EQ(open.reasoning, "hmm");
  EXPECT_EQ(open.content, "Yes.");
  // Cut off while thinking: all of it is reasoning.
  EXPECT_EQ(parse_whole(ToolSyntax::Glm, Json::array(), false, "<think>still going").reasoning, "still going");
}

TEST(ChatOutput, GlmToolCallsBecomeToolCalls) {
  const std::string text =
      "<think>need "
      "weather</think>Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
      "</tool_call>\n<tool_call>ping\n</tool_call>";
  const ChatDelta d = parse_whole(ToolSyntax::Glm, kTools, false, text);
  EXPECT_EQ(d.reasoning, "need weather");
  EXPECT_EQ(d.content, "Checking.");
  ASSERT_EQ(d.tool_calls.size(), 2u);
  EXPECT_EQ(d.tool_calls[0].name, "get_weather");
  EXPECT_EQ(args_of(d.tool_calls[0]), Json::parse(R"({"city": "Paris"})"));
  EXPECT_EQ(d.tool_calls[1].name, "ping");
  expect_cut_invariant(ToolSyntax::Glm, kTools, false, text);
  // Without tools in the request the markup is plain text.
  EXPECT_EQ(parse_whole(ToolSyntax::Glm, Json::array(), false, "<tool_call>ping\n</tool_call>").content,
            "<tool_call>ping\n</tool_call>");
  // A call cut off by max_tokens stays text.
  const ChatDelta cut = parse_whole(ToolSyntax::Glm, kTools, false, "Sure <tool_call>get_weather\n<arg_key>ci");
  EXPECT_TRUE(cut.tool_calls.empty());
  EXPECT_EQ(cut.content, "Sure <tool_call>get_weather\n<arg_key>ci");
}

TEST(ChatOutput, DeepSeekToolCallsBecomeToolCalls) {
  const std::string text =
      "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}"
      "<｜tool▁call▁end｜><｜tool▁call▁begin｜>ping<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
  const ChatDelta d = parse_whole(ToolSyntax::DeepSeek, kTools, false, text);
  EXPECT_EQ(d.content, "Let me look.");
  ASSERT_EQ(d.tool_calls.size(), 2u);
  EXPECT_EQ(d.tool_calls[0].name, "get_weather");
  EXPECT_EQ(args_of(d.tool_calls[0]), Json::parse(R"({"city": "Paris"})"));
  EXPECT_EQ(d.tool_calls[1].name, "ping");
  expect_cut_invariant(ToolSyntax::DeepSeek, kTools, false, text);

  const std::string dsml =
      "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
      "string=\"true\">Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
  const ChatDelta e = parse_whole(ToolSyntax::DeepSeek, kTools, false, dsml);
  ASSERT_EQ(e.tool_calls.size(), 1u);
  EXPECT_EQ(args_of(e.tool_calls[0]), Json::parse(R"({"city": "Oslo"})"));
  EXPECT_EQ(e.content, "");
}

TEST(ChatFormat, BuiltInFormatsRenderMessagesToolsAndThinking) {
  const Json messages = Json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny"}
  ])");
  auto glm_file = gguf::File::open(test::fixture_path("glm_pub/model-f32.gguf"));
  auto glm_tok = tokenizer::Tokenizer::from_gguf(*glm_file);
  const ChatFormat glm = ChatFormat::for_model(*glm_file, *glm_tok);
  EXPECT_TRUE(glm.builtin());
  EXPECT_EQ(glm.tool_syntax(), ToolSyntax::Glm);
  EXPECT_EQ(
      glm.render(messages, kTools, Json::object()),
      "[gMASK]<sop><|system|>\n# Tools\n\nYou may call the functions below. Their signatures, one JSON object per "
      "line:\n<tools>\n{\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\", \"properties\": "
      "{\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\"}, \"zip\": {\"type\": \"string\"}, "
      "\"opts\": {\"type\": \"object\"}}}}\n{\"name\": \"ping\", \"parameters\": {\"type\": \"object\", "
      "\"properties\": {}}}"
      "\n</tools>\n\nTo call a function, write its name and then each argument as a key and a value:\n"
      "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n"
      "</tool_call><|system|>\nBe brief.<|user|>\nWeather in Paris?<|assistant|>\n<think></think>\n<tool_call>"
      "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call><|observation|>\n"
      "<tool_response>\nsunny\n</tool_response><|assistant|>");
  const Json user = Json::parse(R"([{"role": "user", "content": "hi"}])");
  EXPECT_EQ(glm.render(user, Json::array(), {{"enable_thinking", false}}),
            "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think></think>");

  auto ds_file = gguf::File::open(test::fixture_path("dsv32_pub/model-f32.gguf"));
  auto ds_tok = tokenizer::Tokenizer::from_gguf(*ds_file);
  const ChatFormat ds = ChatFormat::for_model(*ds_file, *ds_tok);
  EXPECT_EQ(ds.tool_syntax(), ToolSyntax::DeepSeek);
  EXPECT_EQ(ds.render(user, Json::array(), Json::object()),
            "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>");
  const std::string thinking = ds.render(user, Json::array(), {{"enable_thinking", true}});
  EXPECT_TRUE(ChatFormat::opens_reasoning(thinking)) << thinking;
  EXPECT_FALSE(ChatFormat::opens_reasoning(ds.render(user, Json::array(), Json::object())));
  EXPECT_NE(
      ds.render(messages, kTools, Json::object()).find("<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\":"),
      std::string::npos);
  // The markers the parsers read are output text, not hidden specials.
  EXPECT_EQ(ChatFormat::marker_tokens(*glm_tok).size(), 8u);
  EXPECT_EQ(ChatFormat::marker_tokens(*ds_tok).size(), 7u);
}

int status_of(const std::function<void()>& fn, std::string* param = nullptr) {
  try {
    fn();
  } catch (const ApiError& e) {
    if (param) *param = e.param;
    return e.status;
  }
  return 200;
}

TEST(RequestValidation, FieldsAreCheckedAndUnknownOnesIgnored) {
  std::string param;
  auto chat = [](const std::string& body) { return [body] { parse_chat_request(body); }; };
  EXPECT_EQ(status_of(chat(R"({"messages": [{"role": "user", "content": "hi"}], "whatever": {"x": 1}})")), 200);
  EXPECT_EQ(status_of(chat("{not json"), &param), 400);
  EXPECT_EQ(status_of(chat("[1, 2]")), 400);
  EXPECT_EQ(status_of(chat(R"({"messages": []})"), &param), 400);
  EXPECT_EQ(param, "messages");
  EXPECT_EQ(status_of(chat(R"({"messages": "hi"})"), &param), 400);
  EXPECT_EQ(param, "messages");
  EXPECT_EQ(status_of(chat(R"({"messages": [{"content": "hi"}]})"), &param), 400);
  EXPECT_EQ(param, "messages[0].role");
  EXPECT_EQ(status_of(chat(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})"), &param), 400);
  EXPECT_EQ(param, "messages[0].content");
  const std::string ok = R"("messages": [{"role": "user", "content": "hi"}])";
  for (const auto& [field, value] :
       std::vector<std::pair<std::string, std::string>>{{"temperature", "-0.5"},
                                                        {"temperature", "\"hot\""},
                                                        {"max_tokens", "0"},
                                                        {"max_tokens", "-3"},
                                                        {"max_tokens", "2.5"},
                                                        {"max_completion_tokens", "0"},
                                                        {"top_p", "0"},
                                                        {"top_p", "1.5"},
                                                        {"top_k", "-2"},
                                                        {"min_p", "2"},
                                                        {"presence_penalty", "3"},
                                                        {"frequency_penalty", "\"x\""},
                                                        {"repetition_penalty", "0"},
                                                        {"seed", "1.5"},
                                                        {"stream", "\"yes\""},
                                                        {"stop", "5"},
                                                        {"n", "2"},
                                                        {"top_logprobs", "3"},
                                                        {"tools", "{}"},
                                                        {"response_format", "{\"type\": \"json_object\"}"}}) {
    EXPECT_EQ(status_of(chat("{" + ok + ", \"" + field + "\": " + value + "}"), &param), 400) << field << "=" << value;
    EXPECT_EQ(param, field) << field << "=" << value;
  }
  // nulls are absent values; a float with an integral value is an integer, as in Python
  EXPECT_EQ(status_of(chat("{" + ok + R"(, "temperature": null, "max_tokens": 5.0, "stop": null})")), 200);
  const ChatRequest r =
      parse_chat_request("{" + ok + R"(, "max_completion_tokens": 7, "max_tokens": 3, "stop": ["a", ""],
    "logprobs": true, "top_logprobs": 2, "seed": -1, "tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}}]})");
  EXPECT_EQ(r.gen.max_tokens, 7);
  EXPECT_EQ(r.gen.stop, std::vector<std::string>{"a"});
  EXPECT_EQ(r.gen.sampling.top_logprobs, 2);
  EXPECT_EQ(r.gen.seed, uint64_t(-1));
  EXPECT_TRUE(r.tools.empty());  // tool_choice none
  // Nesting deep enough to threaten a recursive printer is refused before parsing.
  EXPECT_EQ(status_of(chat(std::string(5000, '[') + std::string(5000, ']'))), 400);

  auto completion = [](const std::string& body) { return [body] { parse_completion_request(body); }; };
  EXPECT_EQ(status_of(completion(R"({"prompt": "hi"})")), 200);
  EXPECT_EQ(status_of(completion(R"({"prompt": [1, 2, 3]})")), 200);
  EXPECT_EQ(status_of(completion(R"({"prompt": ["a", "b"]})"), &param), 400);
  EXPECT_EQ(status_of(completion(R"({})"), &param), 400);
  EXPECT_EQ(param, "prompt");
  EXPECT_EQ(status_of(completion(R"({"prompt": [1, -2]})")), 400);
  EXPECT_EQ(status_of(completion(R"({"prompt": "x", "logprobs": 50})"), &param), 400);
  EXPECT_EQ(param, "logprobs");
}

}  // namespace
}  // namespace sparsemla::server
