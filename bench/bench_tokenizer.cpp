// Tokenizer speed on English text, one thread: encoding (first pass with an empty word cache,
// then steady state), the pre-tokenizer alone, and decoding. Prints MB/s of input text.
//
//   bench_tokenizer [--model FILE.gguf] [--text FILE]... [--mb N]
// Defaults: the glm_pub fixture's tokenizer, and the license texts in /usr/share/common-licenses
// repeated up to 16 MB.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gguf/reader.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace {

using namespace sparsemla;
using Clock = std::chrono::steady_clock;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

template <class Fn>
void report(const char* what, size_t bytes, Fn&& fn) {
  const auto t0 = Clock::now();
  const size_t n = fn();
  const double s = seconds_since(t0);
  std::printf("%-34s %8.2f MB/s  (%.1f MB in %.3f s, %zu tokens)\n", what, double(bytes) / s / 1e6, double(bytes) / 1e6,
              s, n);
}

int run(int argc, char** argv) {
  std::string model = std::string(SPARSEMLA_FIXTURES) + "/glm_pub/model-f32.gguf";
  std::vector<std::string> text_files;
  double mb = 16;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) model = argv[++i];
    else if (a == "--text" && i + 1 < argc) text_files.push_back(argv[++i]);
    else if (a == "--mb" && i + 1 < argc) mb = std::stod(argv[++i]);
    else fail("usage: bench_tokenizer [--model FILE.gguf] [--text FILE]... [--mb N]");
  }
  if (text_files.empty())
    for (const auto& e : std::filesystem::directory_iterator("/usr/share/common-licenses"))
      if (e.is_regular_file()) text_files.push_back(e.path().string());
  std::string base;
  for (const auto& f : text_files) base += read_file(f);
  if (base.empty()) fail("no text to tokenize");
  std::string text;
  while (double(text.size()) < mb * 1e6) text += base;

  auto file = gguf::File::open(model);
  std::printf("model %s (pre-tokenizer %s), text %.1f MB from %zu file(s)\n", model.c_str(),
              tokenizer::Tokenizer::from_gguf(*file)->pre_name().c_str(), double(text.size()) / 1e6, text_files.size());

  const auto tok = tokenizer::Tokenizer::from_gguf(*file);
  std::vector<int32_t> ids;
  report("encode, first pass (cold cache)", text.size(), [&] { return (ids = tok->encode(text, false)).size(); });
  report("encode, steady state", text.size(), [&] { return (ids = tok->encode(text, false)).size(); });
  report("encode, 4 KB requests", text.size(), [&] {
    size_t n = 0;
    for (size_t i = 0; i < text.size(); i += 4096) n += tok->encode(std::string_view(text).substr(i, 4096), false).size();
    return n;
  });
  report("pre-tokenizer only", text.size(), [&] {
    tokenizer::CodepointText cps;
    tokenizer::PreTokenizer::Pieces pieces;
    cps.assign(text);
    tok->pre_tokenizer().split(cps, pieces);
    return pieces.size();
  });
  report("decode", text.size(), [&] { return tok->decode(ids).size() == text.size() ? ids.size() : 0; });
  report("stream decode", text.size(), [&] {
    tokenizer::StreamDecoder sd(*tok);
    size_t n = 0;
    for (int32_t id : ids) n += sd.push(id).size();
    return n + sd.flush().size() == text.size() ? ids.size() : 0;
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const sparsemla::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
