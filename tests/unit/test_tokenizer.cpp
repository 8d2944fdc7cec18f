// The byte-level BPE tokenizer: Unicode classes, UTF-8 handling, the pre-tokenizers, BPE, special
// tokens, BOS, errors, streaming decoding and the CLI.
//
// The reference is Hugging Face `tokenizers`: tests/data/tokenizer/cases.json, made by
// scripts/reference/make_tokenizer_cases.py, holds what it does with the fixture vocabularies, and
// TokReference compares everything with it. The hand-written expectations below were worked out
// from the regexes and cross-checked against a Python re-implementation (the `regex` module with
// Hugging Face's Split semantics, and a plain BPE); where they and cases.json disagree, cases.json
// wins.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "gguf/reader.h"
#include "gguf/writer.h"
#include "test_util.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

namespace sparsemla::tokenizer {
namespace {

using test::TempDir;
using Ids = std::vector<int32_t>;
using Strings = std::vector<std::string>;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

struct Fixture {
  std::unique_ptr<gguf::File> file;
  std::unique_ptr<Tokenizer> tok;
};

const Fixture& fixture(const std::string& name) {
  static std::map<std::string, Fixture> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    Fixture f;
    f.file = gguf::File::open(test::fixture_path(name + "/model-f32.gguf"));
    f.tok = Tokenizer::from_gguf(*f.file);
    it = cache.emplace(name, std::move(f)).first;
  }
  return it->second;
}
const Tokenizer& glm() { return *fixture("glm_pub").tok; }
const Tokenizer& dsv32() { return *fixture("dsv32_pub").tok; }

std::string lossy(std::string_view bytes) {
  std::string out;
  utf8::append_lossy(out, bytes);
  return out;
}

// ---------------------------------------------------------------------------------------------

TEST(TokUnicode, ClassesFollowTheUnicodeDatabase) {
  using namespace unicode;
  EXPECT_STREQ(kUnicodeVersion, "15.0.0");
  for (size_t i = 0; i < kRangeCount; ++i) {
    ASSERT_LE(kRanges[i].first, kRanges[i].last);
    if (i) ASSERT_LT(kRanges[i - 1].last, kRanges[i].first);
  }
  const std::pair<uint32_t, uint8_t> cases[] = {
      {'A', kLetter},   {'z', kLetter},    {0x4E00, kLetter}, {0x1C5, kLetter},  {0x2B0, kLetter},   // Lt, Lm
      {'5', kNumber},   {0x2162, kNumber}, {0xBD, kNumber},   {0x661, kNumber},                      // Nl, No
      {'!', kPunct},    {'_', kPunct},     {0xAB, kPunct},    {0x3001, kPunct},                      // Pc, Pi
      {'$', kSymbol},   {'^', kSymbol},    {'+', kSymbol},    {0x1F600, kSymbol}, {0x20AC, kSymbol}, // Sk, Sm, So
      {0x301, kMark},   {0x903, kMark},    {0x20DD, kMark},                                          // Mn, Mc, Me
      {' ', kSpace},    {'\t', kSpace},    {'\r', kSpace},    {0x0B, kSpace},    {0x85, kSpace},
      {0xA0, kSpace},   {0x2028, kSpace},  {0x2029, kSpace},  {0x3000, kSpace},  {0x1680, kSpace},
      {0x1C, 0},        {0x1F, 0},         {0x00, 0},         {0x200D, 0},       {0xFEFF, 0},        // not \s
      {0x180E, 0},      {0xE000, 0},       {0xD800, 0},       {0x378, 0},        {0x10FFFF, 0},      // Cf, Co, Cs, Cn
      {0x110000, 0},    {0xFFFFFFFF, 0},
  };
  for (auto [cp, want] : cases) EXPECT_EQ(flags(cp), want) << std::hex << "U+" << cp;
}

TEST(TokUtf8, IllFormedSubpartsBecomeOneReplacementEach) {
  const std::string R(utf8::kReplacement);
  EXPECT_EQ(lossy("plain \xE2\x82\xAC ok"), "plain \xE2\x82\xAC ok");
  EXPECT_EQ(lossy("a\x80" "b"), "a" + R + "b");
  EXPECT_EQ(lossy("\xF0\x80\x80"), R + R + R);  // F0 needs 90..BF next: three subparts
  EXPECT_EQ(lossy("\xED\xA0\x80"), R + R + R);  // a surrogate
  EXPECT_EQ(lossy("\xC0\xAF"), R + R);          // overlong
  EXPECT_EQ(lossy("\xF4\x90\x80\x80"), R + R + R + R);
  EXPECT_EQ(lossy("\xE2\x82" "A"), R + "A");    // one maximal subpart
  EXPECT_EQ(lossy("x\xF0\x9F\x98"), "x" + R);   // truncated at the end
  EXPECT_EQ(lossy("\xFF\xFE"), R + R);

  std::string out;
  EXPECT_EQ(utf8::append_complete(out, "a\xE2\x82"), 1u);
  EXPECT_EQ(out, "a");
  out.clear();
  EXPECT_EQ(utf8::append_complete(out, "\x80\xE2"), 1u);
  EXPECT_EQ(out, R);
  EXPECT_TRUE(utf8::is_valid("\xF0\x9F\x98\x80"));
  EXPECT_FALSE(utf8::is_valid("\xF0\x9F\x98"));
}

TEST(TokByteLevel, Gpt2Alphabet) {
  auto enc = [](std::string_view b) {
    std::string s;
    byte_level::encode(b, s);
    return s;
  };
  EXPECT_EQ(enc("A"), "A");
  EXPECT_EQ(enc(" "), "\xC4\xA0");              // Ġ U+0120
  EXPECT_EQ(enc("\n"), "\xC4\x8A");             // Ċ U+010A
  EXPECT_EQ(enc(std::string(1, '\0')), "\xC4\x80");  // Ā U+0100
  EXPECT_EQ(enc("\xAD"), "\xC5\x83");           // Ń U+0143, the last moved byte
  EXPECT_EQ(enc("\xE9"), "\xC3\xA9");           // é stands for itself
  std::string all;
  for (int b = 0; b < 256; ++b) all += char(b);
  std::string back;
  ASSERT_TRUE(byte_level::decode(enc(all), back));
  EXPECT_EQ(back, all);
  EXPECT_FALSE(byte_level::decode("\xEF\xBD\x9C", back));  // U+FF5C is not in the alphabet
}

// ---------------------------------------------------------------------------------------------

Strings pieces(std::string_view pre, std::string_view text) { return PreTokenizer::from_name(pre).split(text); }

TEST(TokPreTokenizer, Glm4) {
  EXPECT_EQ(pieces("glm4", "Hello world"), (Strings{"Hello", " world"}));
  EXPECT_EQ(pieces("glm4", "I'M here, YOU'RE there"), (Strings{"I", "'M", " here", ",", " YOU", "'RE", " there"}));
  EXPECT_EQ(pieces("glm4", "it's 'sup"), (Strings{"it", "'s", " '", "sup"}));  // " '" takes the apostrophe
  EXPECT_EQ(pieces("glm4", "'\u017Ft"), (Strings{"'\u017F", "t"}));  // (?i) folds long s to s
  EXPECT_EQ(pieces("glm4", "1234567"), (Strings{"123", "456", "7"}));
  EXPECT_EQ(pieces("glm4", "a   b"), (Strings{"a", "  ", " b"}));
  EXPECT_EQ(pieces("glm4", "x\n\n\ny"), (Strings{"x", "\n\n\n", "y"}));
  EXPECT_EQ(pieces("glm4", "  \n  x"), (Strings{"  \n", " ", " x"}));
  EXPECT_EQ(pieces("glm4", "end  "), (Strings{"end", "  "}));
  EXPECT_EQ(pieces("glm4", "hi!!!\n\nyo"), (Strings{"hi", "!!!\n\n", "yo"}));
  EXPECT_EQ(pieces("glm4", "\tfoo (bar)"), (Strings{"\tfoo", " (", "bar", ")"}));
  EXPECT_EQ(pieces("glm4", "\xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C"), (Strings{"\xE4\xBD\xA0\xE5\xA5\xBD", "\xEF\xBC\x8C"}));
  EXPECT_EQ(pieces("glm4", ""), Strings{});
  // Ill-formed bytes are pieces of "other" characters and keep their bytes.
  EXPECT_EQ(pieces("glm4", "a\xFF\xFE" "b"), (Strings{"a", "\xFF\xFE", "b"}));
}

TEST(TokPreTokenizer, Llama3IsGlm4) {
  for (const char* t : {"I'M here, YOU'RE there", "a   b\n\n c", "x=1234;"})
    EXPECT_EQ(pieces("llama3", t), pieces("glm4", t)) << t;
}

TEST(TokPreTokenizer, DeepseekV3) {
  EXPECT_EQ(pieces("deepseek-v3", "1234567"), (Strings{"123", "456", "7"}));
  EXPECT_EQ(pieces("deepseek-v3", "x=1;y=22"), (Strings{"x", "=", "1", ";y", "=", "22"}));
  EXPECT_EQ(pieces("deepseek-v3", ".com I'M (Hello"), (Strings{".com", " I", "'M", " (", "Hello"}));
  EXPECT_EQ(pieces("deepseek-v3", "'\xC3\xA9lan"), (Strings{"'", "\xC3\xA9lan"}));
  EXPECT_EQ(pieces("deepseek-v3", "e\xCC\x81t\xC3\xA9"), (Strings{"e\xCC\x81t\xC3\xA9"}));  // marks join letters
  // Kanji and kana runs are pieces of their own; Chinese punctuation is not in that class.
  EXPECT_EQ(pieces("deepseek-v3", "\xE4\xBD\xA0\xE5\xA5\xBD\xEF\xBC\x8C\xE4\xB8\x96\xE7\x95\x8C"),
            (Strings{"\xE4\xBD\xA0\xE5\xA5\xBD", "\xEF\xBC\x8C", "\xE4\xB8\x96\xE7\x95\x8C"}));
  EXPECT_EQ(pieces("deepseek-v3", "a\xE3\x81\x82" "b"), (Strings{"a", "\xE3\x81\x82", "b"}));
  // The zero-width joiner matches nothing: it is a piece of its own between the emoji.
  EXPECT_EQ(pieces("deepseek-v3", "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9"),
            (Strings{"\xF0\x9F\x91\xA8", "\xE2\x80\x8D", "\xF0\x9F\x91\xA9"}));
  EXPECT_EQ(pieces("deepseek-v3", "a  \n\n b "), (Strings{"a", "  \n\n", " b", " "}));
}

TEST(TokPreTokenizer, Gpt2) {
  EXPECT_EQ(pieces("gpt-2", "I'M here"), (Strings{"I", "'", "M", " here"}));  // contractions are lowercase only
  EXPECT_EQ(pieces("gpt-2", "they'll"), (Strings{"they", "'ll"}));
  EXPECT_EQ(pieces("gpt-2", "1234567 x"), (Strings{"1234567", " x"}));
  EXPECT_EQ(pieces("gpt-2", "a   b"), (Strings{"a", "  ", " b"}));
  EXPECT_EQ(pieces("gpt-2", "a\n\nb"), (Strings{"a", "\n", "\n", "b"}));
  EXPECT_EQ(pieces("gpt2", "x  "), (Strings{"x", "  "}));
}

TEST(TokPreTokenizer, DeepseekLlm) {
  EXPECT_EQ(pieces("deepseek-llm", "Hello world"), (Strings{"Hello", " world"}));
  // The punctuation step's :-~ range holds the ASCII letters but not \xC3\xAF, which it cuts out.
  EXPECT_EQ(pieces("deepseek-llm", "na\xC3\xAFve"), (Strings{"na", "\xC3\xAF", "ve"}));
  EXPECT_EQ(pieces("deepseek-llm", "abc  \n"), (Strings{"abc", "  ", "\n"}));
  EXPECT_EQ(pieces("deepseek-llm", "12345"), (Strings{"12345"}));
  EXPECT_EQ(pieces("deepseek-llm", "\xE4\xB8\xAD\xE6\x96\x87" "abc"), (Strings{"\xE4\xB8\xAD\xE6\x96\x87", "abc"}));
  EXPECT_EQ(pieces("deepseek-llm", "a\r\nb"), (Strings{"a", "\r", "\n", "b"}));
}

TEST(TokPreTokenizer, UnknownNameIsAClearError) {
  const std::string e = error_of([] { PreTokenizer::from_name("qwen9"); });
  EXPECT_NE(e.find("unknown pre-tokenizer 'qwen9'"), std::string::npos) << e;
  EXPECT_NE(e.find("glm4"), std::string::npos) << e;
  EXPECT_NE(e.find("deepseek-v3"), std::string::npos) << e;
}

// Pieces always add up to the text, whatever it holds.
TEST(TokPreTokenizer, PiecesCoverAnyBytes) {
  std::mt19937 rng(11);
  for (std::string_view pre : PreTokenizer::names()) {
    for (int n = 0; n < 200; ++n) {
      std::string s(rng() % 40, '\0');
      for (char& c : s) c = char(rng() % 4 ? " a1\n'.\xE4\xBD\xA0"[rng() % 10] : rng());
      std::string joined;
      for (const auto& p : pieces(pre, s)) {
        EXPECT_FALSE(p.empty());
        joined += p;
      }
      ASSERT_EQ(joined, s) << pre;
    }
  }
}

// ---------------------------------------------------------------------------------------------

TEST(TokTokenizer, ReadsTheFixtureVocabularies) {
  EXPECT_EQ(glm().n_vocab(), 1024);
  EXPECT_EQ(glm().pre_name(), "glm4");
  EXPECT_EQ(glm().bos(), 1002);
  EXPECT_EQ(glm().token_text(1002), "[gMASK]");
  EXPECT_EQ(glm().eos(), 1000);
  EXPECT_EQ(glm().eot(), 1007);
  EXPECT_EQ(glm().eom(), 1009);
  EXPECT_EQ(glm().eog_ids(), (Ids{1000, 1007, 1009}));
  EXPECT_TRUE(glm().is_eog(1009));
  EXPECT_FALSE(glm().is_eog(1002));
  EXPECT_FALSE(glm().add_bos_default());  // the key is absent and glm4 does not add one
  EXPECT_EQ(glm().token_type(1007), TokenType::kControl);
  EXPECT_EQ(glm().token_type(1020), TokenType::kUnused);

  EXPECT_EQ(dsv32().pre_name(), "deepseek-v3");
  EXPECT_EQ(dsv32().bos(), 1000);
  EXPECT_EQ(dsv32().eos(), 1001);
  EXPECT_EQ(dsv32().eot(), -1);
  EXPECT_EQ(dsv32().eog_ids(), (Ids{1001}));
  EXPECT_TRUE(dsv32().add_bos_default());  // tokenizer.ggml.add_bos_token = true

  EXPECT_EQ(glm().find_token("<|user|>"), 1007);
  EXPECT_EQ(glm().find_token("\xC4\xA0the"), 298);  // "Ġthe"
  EXPECT_EQ(glm().find_token("no such token"), std::nullopt);
}

TEST(TokTokenizer, EncodesWithMergesByRank) {
  // Cross-checked with a plain Python BPE over the same merges; cases.json is the reference.
  EXPECT_EQ(glm().encode("Hello world", false), (Ids{39, 469, 333, 317, 268, 75, 67}));
  EXPECT_EQ(glm().encode("1234567", false), (Ids{744, 18, 19, 20, 21, 22}));
  EXPECT_EQ(glm().encode("", false), Ids{});
  EXPECT_EQ(glm().decode(glm().encode("Hello world", false)), "Hello world");
}

TEST(TokTokenizer, SpecialTokensAreMatchedBeforeBpe) {
  const Ids ids = glm().encode("<|user|>hi<|assistant|>", false);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 1007);
  EXPECT_EQ(ids.back(), 1008);
  EXPECT_EQ(glm().decode(ids), "<|user|>hi<|assistant|>");
  EXPECT_EQ(glm().decode(ids, /*skip_special=*/true), "hi");
  // Not parsed: the markers are plain text.
  const Ids plain = glm().encode("<|user|>hi", false, /*parse_special=*/false);
  for (int32_t id : plain) EXPECT_LT(id, 1000);
  EXPECT_EQ(glm().decode(plain), "<|user|>hi");
  // Around a special token the pre-tokenizer starts afresh: " <|user|>" is " " then the token.
  EXPECT_EQ(glm().encode(" <|user|>", false), (Ids{220, 1007}));
  const Ids ds = dsv32().encode("<\xEF\xBD\x9CUser\xEF\xBD\x9C>hi", false);
  EXPECT_EQ(ds.front(), 1002);
}

TEST(TokTokenizer, Bos) {
  EXPECT_EQ(glm().encode("hi", true).front(), 1002);
  EXPECT_NE(glm().encode("hi", false).front(), 1002);
  const Ids ds = dsv32().encode("hi", true);
  EXPECT_EQ(ds.front(), 1000);
  EXPECT_EQ(Ids(ds.begin() + 1, ds.end()), dsv32().encode("hi", false));
}

TEST(TokTokenizer, OutOfRangeIdsAreErrors) {
  const std::string e = error_of([] { glm().decode(Ids{5, 1024}); });
  EXPECT_NE(e.find("token id 1024"), std::string::npos) << e;
  EXPECT_NE(e.find("1024 tokens"), std::string::npos) << e;
  EXPECT_NE(error_of([] { glm().token_text(-1); }).find("token id -1"), std::string::npos);
  StreamDecoder sd(glm());
  EXPECT_NE(error_of([&] { sd.push(4096); }).find("token id 4096"), std::string::npos);
}

TEST(TokTokenizer, UnusedTokensDecodeToNothing) {
  EXPECT_EQ(glm().token_bytes(1020), "");
  EXPECT_EQ(glm().decode(Ids{39, 1020, 72}), "Hi");
}

std::string random_utf8(std::mt19937& rng, size_t n_chars) {
  static const uint32_t pools[][2] = {{0x20, 0x7E}, {0x20, 0x20}, {'\n', '\n'}, {0x30, 0x39}, {0xA0, 0x24F},
                                      {0x300, 0x36F}, {0x370, 0x3FF}, {0x4E00, 0x9FA5}, {0x3040, 0x30FF},
                                      {0xAC00, 0xD7A3}, {0x600, 0x6FF}, {0x1F300, 0x1F6FF}, {0x0, 0x10FFFF}};
  std::string s;
  for (size_t i = 0; i < n_chars; ++i) {
    const auto& p = pools[rng() % std::size(pools)];
    uint32_t cp = p[0] + rng() % (p[1] - p[0] + 1);
    if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';
    utf8::append_codepoint(s, cp);
  }
  return s;
}

TEST(TokTokenizer, RandomTextRoundTrips) {
  std::mt19937 rng(3);
  for (const Tokenizer* t : {&glm(), &dsv32()}) {
    for (int n = 0; n < 300; ++n) {
      const std::string s = random_utf8(rng, rng() % 60);
      ASSERT_EQ(t->decode(t->encode(s, false)), s) << t->pre_name();
    }
  }
}

TEST(TokTokenizer, ArbitraryBytesKeepTheirBytes) {
  std::mt19937 rng(4);
  for (int n = 0; n < 300; ++n) {
    std::string s(rng() % 50, '\0');
    for (char& c : s) c = char(rng());
    std::string bytes;
    for (int32_t id : glm().encode(s, false)) bytes += glm().token_bytes(id);
    ASSERT_EQ(bytes, s);
    ASSERT_EQ(glm().decode(glm().encode(s, false)), lossy(s));
  }
}

// ---------------------------------------------------------------------------------------------

// Feeds ids one at a time: every chunk must be valid UTF-8 and all of them add up to decode().
void check_stream(const Tokenizer& t, const Ids& ids, bool skip_special) {
  StreamDecoder sd(t, skip_special);
  std::string all;
  for (int32_t id : ids) {
    const std::string chunk = sd.push(id);
    ASSERT_TRUE(utf8::is_valid(chunk)) << "id " << id;
    all += chunk;
  }
  const std::string tail = sd.flush();
  ASSERT_TRUE(utf8::is_valid(tail));
  all += tail;
  ASSERT_EQ(all, t.decode(ids, skip_special));
}

TEST(TokStream, NeverEmitsHalfACharacter) {
  std::mt19937 rng(5);
  for (const Tokenizer* t : {&glm(), &dsv32()}) {
    for (int n = 0; n < 200; ++n) {
      const std::string s = random_utf8(rng, rng() % 40);
      const Ids ids = t->encode(s, false);
      check_stream(*t, ids, false);
      StreamDecoder sd(*t);
      std::string all;
      for (int32_t id : ids) all += sd.push(id);
      EXPECT_EQ(sd.flush(), "");  // a whole text leaves nothing behind
      EXPECT_EQ(all, s);
    }
    // Random ids: cut characters, stray continuation bytes, special tokens in between.
    for (int n = 0; n < 300; ++n) {
      Ids ids(1 + rng() % 12);
      for (int32_t& id : ids) id = int32_t(rng() % uint32_t(t->n_vocab()));
      check_stream(*t, ids, false);
      check_stream(*t, ids, true);
    }
  }
}

TEST(TokStream, HoldsBackAnIncompleteCharacter) {
  // "€" is E2 82 AC; the glm vocabulary has a token per byte.
  const auto byte_id = [](unsigned char b) {
    std::string s;
    byte_level::encode(std::string_view(reinterpret_cast<const char*>(&b), 1), s);
    return *glm().find_token(s);
  };
  StreamDecoder sd(glm());
  EXPECT_EQ(sd.push(byte_id(0xE2)), "");
  EXPECT_EQ(sd.push(byte_id(0x82)), "");
  EXPECT_EQ(sd.push(byte_id(0xAC)), "\xE2\x82\xAC");
  EXPECT_EQ(sd.push(byte_id(0xE2)), "");
  EXPECT_EQ(sd.push(byte_id('a')), std::string(utf8::kReplacement) + "a");
  EXPECT_EQ(sd.push(byte_id(0xF0)), "");
  EXPECT_EQ(sd.flush(), std::string(utf8::kReplacement));
  EXPECT_EQ(sd.flush(), "");
}

// ---------------------------------------------------------------------------------------------
// Small hand-made vocabularies, for the rules the fixtures cannot show and for load errors.

struct VocabFile {
  std::map<std::string, gguf::Value> kv;

  // The 256 byte tokens, then `extra` (type 1 unless given), with `merges`.
  VocabFile(const std::vector<std::pair<std::string, int32_t>>& extra, const Strings& merges, std::string pre = "glm4") {
    Strings tokens;
    std::vector<int32_t> types;
    for (int b = 0; b < 256; ++b) {
      std::string s;
      byte_level::encode(std::string(1, char(b)), s);
      tokens.push_back(s);
      types.push_back(1);
    }
    for (const auto& [t, ty] : extra) {
      tokens.push_back(t);
      types.push_back(ty);
    }
    kv["tokenizer.ggml.model"] = gguf::Value::string("gpt2");
    kv["tokenizer.ggml.pre"] = gguf::Value::string(pre);
    kv["tokenizer.ggml.tokens"] = gguf::Value::string_array(tokens);
    kv["tokenizer.ggml.token_type"] = gguf::Value::i32_array(types);
    kv["tokenizer.ggml.merges"] = gguf::Value::string_array(merges);
  }

  std::unique_ptr<Tokenizer> load(const std::string& pre_override = "") const {
    TempDir dir("tok");
    gguf::Writer w;
    w.set("general.architecture", gguf::Value::string("test"));
    for (const auto& [k, v] : kv) w.set(k, v);
    w.write(dir.file("v.gguf"));
    auto f = gguf::File::open(dir.file("v.gguf"));
    return Tokenizer::from_gguf(*f, pre_override);
  }
  std::string load_error() const {
    return error_of([&] { load(); });
  }
};

TEST(TokTokenizer, LongestSpecialTokenWinsAndUserDefinedAreAlwaysMatched) {
  VocabFile v({{"<s>", 3}, {"<s>x", 3}, {"<tool>", 4}}, {});
  auto t = v.load();
  EXPECT_EQ(t->encode("<s>x", false), (Ids{257}));
  EXPECT_EQ(t->encode("<s>y", false), (Ids{256, 'y'}));  // ids of single bytes are the bytes
  EXPECT_EQ(t->encode("a<tool>", false, /*parse_special=*/false), (Ids{'a', 258}));
  EXPECT_EQ(t->encode("<s>", false, /*parse_special=*/false).size(), 3u);
  EXPECT_EQ(t->decode(Ids{258, 256}, /*skip_special=*/true), "<tool>");
}

TEST(TokTokenizer, MergesApplyByRankAndLlama3IgnoresThemForWholeTokens) {
  // byte_level form: a..z stand for themselves. Merge "b c" outranks "a b".
  VocabFile v({{"ab", 1}, {"bc", 1}, {"abc", 1}, {"abcd", 1}}, {"b c", "a b", "a bc"});
  auto t = v.load();
  const int32_t ab = 256, bc = 257, abc = 258, abcd = 259;
  EXPECT_EQ(t->encode("abc", false), (Ids{abc}));        // b c first, then a bc
  EXPECT_EQ(t->encode("ab", false), (Ids{ab}));
  EXPECT_EQ(t->encode("abcd", false), (Ids{abc, 'd'}));
  EXPECT_EQ(t->encode("bcbc", false), (Ids{bc, bc}));
  // With llama3 a piece that is a token is taken whole, without merges.
  auto l3 = v.load("llama3");
  EXPECT_EQ(l3->encode("abcd", false), (Ids{abcd}));
  EXPECT_FALSE(l3->add_bos_default());  // llama3 adds BOS by default, when there is one
  v.kv["tokenizer.ggml.bos_token_id"] = gguf::Value::u32(0);
  EXPECT_TRUE(v.load("llama3")->add_bos_default());
  EXPECT_FALSE(v.load()->add_bos_default());
}

TEST(TokTokenizer, LoadErrorsNameTheKey) {
  auto without = [](const std::string& key) {
    VocabFile v({}, {});
    v.kv.erase(key);
    return v.load_error();
  };
  EXPECT_NE(without("tokenizer.ggml.model").find("'tokenizer.ggml.model' is missing"), std::string::npos);
  EXPECT_NE(without("tokenizer.ggml.pre").find("'tokenizer.ggml.pre' is missing"), std::string::npos);
  EXPECT_NE(without("tokenizer.ggml.tokens").find("'tokenizer.ggml.tokens' is missing"), std::string::npos);
  EXPECT_NE(without("tokenizer.ggml.merges").find("'tokenizer.ggml.merges' is missing"), std::string::npos);
  EXPECT_EQ(without("tokenizer.ggml.token_type"), "(no error)");  // optional: all normal

  auto with = [](const std::string& key, gguf::Value value, std::vector<std::pair<std::string, int32_t>> extra = {},
                 Strings merges = {}) {
    VocabFile v(extra, merges);
    v.kv[key] = std::move(value);
    return v.load_error();
  };
  std::string e = with("tokenizer.ggml.model", gguf::Value::string("llama"));
  EXPECT_NE(e.find("tokenizer.ggml.model is 'llama'"), std::string::npos) << e;
  e = with("tokenizer.ggml.pre", gguf::Value::string("nonsense"));
  EXPECT_NE(e.find("unknown pre-tokenizer 'nonsense'"), std::string::npos) << e;
  e = with("tokenizer.ggml.merges", gguf::Value::string_array({"a b"}));
  EXPECT_NE(e.find("tokenizer.ggml.merges[0] = 'a b' needs token 'ab'"), std::string::npos) << e;
  e = with("tokenizer.ggml.merges", gguf::Value::string_array({"ab"}));
  EXPECT_NE(e.find("tokenizer.ggml.merges[0] = 'ab' is not two tokens"), std::string::npos) << e;
  e = with("tokenizer.ggml.token_type", gguf::Value::i32_array({1, 1}));
  EXPECT_NE(e.find("tokenizer.ggml.token_type has 2 entries but tokenizer.ggml.tokens has 256"), std::string::npos) << e;
  e = with("tokenizer.ggml.tokens", gguf::Value::i32_array({1, 2}));
  EXPECT_NE(e.find("'tokenizer.ggml.tokens' must be an array of string"), std::string::npos) << e;
  e = with("tokenizer.ggml.bos_token_id", gguf::Value::u32(300));
  EXPECT_NE(e.find("tokenizer.ggml.bos_token_id = 300 is outside the vocabulary of 256 tokens"), std::string::npos) << e;
  e = with("tokenizer.ggml.add_bos_token", gguf::Value::boolean(true));
  EXPECT_NE(e.find("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing"),
            std::string::npos) << e;
  e = with("tokenizer.ggml.eos_token_id", gguf::Value::u32(1), {{"A", 1}});
  EXPECT_NE(e.find("has 'A' twice, as ids 65 and 256"), std::string::npos) << e;
}

TEST(TokTokenizer, EncodeWithBosNeedsABosToken) {
  VocabFile v({}, {});
  auto t = v.load();
  EXPECT_NE(error_of([&] { t->encode("x", true); }).find("no tokenizer.ggml.bos_token_id"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------

// The reference: what Hugging Face tokenizers does. cases.json must exist; see the header.
TEST(TokReference, MatchesHuggingFaceTokenizers) {
  const std::string path = test::data_path("tokenizer/cases.json");
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << path << " is missing. Make it where Hugging Face tokenizers is installed:\n"
                         << "  python3 scripts/reference/make_tokenizer_cases.py --out tests/data/tokenizer/cases.json";
  const nlohmann::json j = nlohmann::json::parse(in);
  const auto texts = j.at("texts").get<Strings>();
  ASSERT_GT(texts.size(), 100u);

  for (const auto& [pre, per_text] : j.at("pieces").items()) {
    const PreTokenizer p = PreTokenizer::from_name(pre);
    ASSERT_EQ(per_text.size(), texts.size());
    int bad = 0;
    for (size_t i = 0; i < texts.size() && bad < 5; ++i)
      if (p.split(texts[i]) != per_text[i].get<Strings>()) {
        ++bad;
        ADD_FAILURE() << pre << " pieces of text " << i << ": " << nlohmann::json(texts[i]).dump()
                      << "\n  want " << per_text[i].dump() << "\n  got  " << nlohmann::json(p.split(texts[i])).dump();
      }
  }

  int n_encodings = 0;
  for (const auto& e : j.at("encodings")) {
    const std::string fx = e.at("fixture"), pre = e.at("pre");
    const auto tok = Tokenizer::from_gguf(*fixture(fx).file, pre);
    const auto& ids = e.at("ids");
    ASSERT_EQ(ids.size(), texts.size());
    int bad = 0;
    for (size_t i = 0; i < texts.size() && bad < 5; ++i) {
      const Ids got = tok->encode(texts[i], false), want = ids[i].get<Ids>();
      if (got != want) {
        ++bad;
        ADD_FAILURE() << fx << "/" << pre << " ids of text " << i << ": " << nlohmann::json(texts[i]).dump()
                      << "\n  want " << nlohmann::json(want).dump() << "\n  got  " << nlohmann::json(got).dump();
      }
      EXPECT_EQ(tok->decode(want), texts[i]);
    }
    ++n_encodings;
  }
  EXPECT_GE(n_encodings, 2);

  int n_decodings = 0;
  for (const auto& d : j.at("decodings")) {
    const Tokenizer& tok = *fixture(d.at("fixture").get<std::string>()).tok;
    const Ids ids = d.at("ids").get<Ids>();
    EXPECT_EQ(tok.decode(ids), d.at("text").get<std::string>()) << d.dump();
    EXPECT_EQ(tok.decode(ids, true), d.at("text_skip_special").get<std::string>()) << d.dump();
    check_stream(tok, ids, false);
    ++n_decodings;
  }
  EXPECT_GE(n_decodings, 100);
}

// ---------------------------------------------------------------------------------------------

std::string run_cli(const std::string& args) {
  const std::string cmd = std::string(SPARSEMLA_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  pclose(p);
  return out;
}

TEST(TokCli, TokenizeAndDetokenize) {
  const std::string model = "--model " + test::fixture_path("glm_pub/model-f32.gguf");
  EXPECT_EQ(run_cli("tokenize " + model + " --text 'Hello world'"), "[39, 469, 333, 317, 268, 75, 67]\n");
  EXPECT_EQ(run_cli("tokenize " + model + " --text 'Hello world' --add-bos"), "[1002, 39, 469, 333, 317, 268, 75, 67]\n");
  EXPECT_EQ(run_cli("detokenize " + model + " --ids '1007,71,72'"), "<|user|>hi");
  EXPECT_EQ(run_cli("detokenize " + model + " --ids '[1007, 71, 72]'"), "<|user|>hi");
  EXPECT_EQ(run_cli("detokenize " + model + " --ids '[]'"), "");
  EXPECT_NE(run_cli("detokenize " + model + " --ids '1,x'").find("'x' is not a token id"), std::string::npos);
  EXPECT_NE(run_cli("detokenize " + model + " --ids '5000'").find("token id 5000 is out of range"), std::string::npos);
}

}  // namespace
}  // namespace sparsemla::tokenizer
