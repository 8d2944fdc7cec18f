// `sparsemla tokenize` and `sparsemla detokenize`: the model's tokenizer from the command line.
#include <charconv>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "commands.h"
#include "gguf/reader.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace sparsemla::app {
namespace {

struct TokenizeArgs {
  std::string model;
  std::string text;
  bool add_bos = false;
  bool no_special = false;
};

struct DetokenizeArgs {
  std::string model;
  std::string ids;
  bool skip_special = false;
};

std::unique_ptr<tokenizer::Tokenizer> load(const std::string& path) {
  auto f = gguf::File::open(path);
  return tokenizer::Tokenizer::from_gguf(*f);
}

std::string_view trim(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") + 1 - b);
}

// "1,2,3" or the JSON array "[1, 2, 3]".
std::vector<int32_t> parse_ids(const std::string& s) {
  std::string_view body = trim(s);
  if (!body.empty() && body.front() == '[') {
    if (body.back() != ']') fail("--ids '{}': a JSON array must end with ']'", s);
    body = trim(body.substr(1, body.size() - 2));
  }
  std::vector<int32_t> ids;
  for (size_t start = 0; !body.empty();) {
    const size_t comma = body.find(',', start);
    const std::string_view item = trim(body.substr(start, comma == std::string_view::npos ? comma : comma - start));
    int32_t id = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), id);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size())
      fail("--ids '{}': '{}' is not a token id", s, item);
    ids.push_back(id);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return ids;
}

int run_tokenize(const TokenizeArgs& a) {
  const auto tok = load(a.model);
  const std::vector<int32_t> ids = tok->encode(a.text, a.add_bos, !a.no_special);
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  out += "]\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

int run_detokenize(const DetokenizeArgs& a) {
  const auto tok = load(a.model);
  const std::string text = tok->decode(parse_ids(a.ids), a.skip_special);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace

Runner add_tokenize(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand("tokenize", "Print the token ids of a text as a JSON array");
  cmd->add_option("--model", args->model, "GGUF model file (any part of a split model)")->required();
  cmd->add_option("--text", args->text, "The text to tokenize")->required();
  cmd->add_flag("--add-bos", args->add_bos, "Put the BOS token first");
  cmd->add_flag("--no-special", args->no_special, "Tokenize control tokens written in the text as plain text");
  return [args] { return run_tokenize(*args); };
}

Runner add_detokenize(CLI::App& app) {
  auto args = std::make_shared<DetokenizeArgs>();
  CLI::App* cmd = app.add_subcommand("detokenize", "Print the text of token ids, exactly (no newline is added)");
  cmd->add_option("--model", args->model, "GGUF model file (any part of a split model)")->required();
  cmd->add_option("--ids", args->ids, "Token ids: \"1,2,3\" or a JSON array \"[1, 2, 3]\"")->required();
  cmd->add_flag("--skip-special", args->skip_special, "Leave out control tokens");
  return [args] { return run_detokenize(*args); };
}

}  // namespace sparsemla::app
