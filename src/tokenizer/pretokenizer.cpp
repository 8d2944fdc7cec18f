#include "tokenizer/pretokenizer.h"

#include <algorithm>

#include "tokenizer/unicode.h"
#include "tokenizer/utf8.h"
#include "util/error.h"

namespace sparsemla::tokenizer {

using unicode::kLetter;
using unicode::kMark;
using unicode::kNumber;
using unicode::kPunct;
using unicode::kSpace;
using unicode::kSymbol;

// One regex of a pre-tokenizer (or, for kTrailingSpace, a split that is simpler to do directly).
enum class PreTokenizer::Stage : uint8_t {
  kLlama3,         // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
                   //   ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  kGpt2,           // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kDigits3,        // \p{N}{1,3}
  kKanjiKana,      // [一-龥぀-ゟ゠-ヿ]+
  kDeepseekV3,     // [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|
                   //   ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  kNewline,        // [\r\n]
  kLlmLetters,     // \s?[A-Za-zµÀ-ÖØ-öø-ƺ...𞤀-𞥃]+  (the cased-letter list of kLlmLetterRanges)
  kLlmPunct,       // \s?[!-/:-~！-／：-～‘-‟　-。]+
  kTrailingSpace,  // \s+$
  kLlmCjk,         // [一-龥ࠀ-一가-퟿]+
  kNumbers,        // \p{N}+
};

namespace {

using Stage = PreTokenizer::Stage;

struct CpRange {
  uint32_t first, last;
};

// The letter class of deepseek-llm's second regex, as written in its tokenizer.json (it is
// \p{Lu}|\p{Ll}|\p{Lt} of an older Unicode, minus lowercase Armenian and a few others).
constexpr CpRange kLlmLetterRanges[] = {
    {0x41, 0x5A},       {0x61, 0x7A},       {0xB5, 0xB5},       {0xC0, 0xD6},       {0xD8, 0xF6},
    {0xF8, 0x1BA},      {0x1BC, 0x1BF},     {0x1C4, 0x293},     {0x295, 0x2AF},     {0x370, 0x373},
    {0x376, 0x377},     {0x37B, 0x37D},     {0x37F, 0x37F},     {0x386, 0x386},     {0x388, 0x38A},
    {0x38C, 0x38C},     {0x38E, 0x3A1},     {0x3A3, 0x3F5},     {0x3F7, 0x481},     {0x48A, 0x52F},
    {0x531, 0x556},     {0x10A0, 0x10C5},   {0x13A0, 0x13F5},   {0x13F8, 0x13FD},   {0x1C90, 0x1CBA},
    {0x1CBD, 0x1CBF},   {0x1D00, 0x1D2B},   {0x1D6B, 0x1D77},   {0x1D79, 0x1D9A},   {0x1E00, 0x1F15},
    {0x1F18, 0x1F1D},   {0x1F20, 0x1F45},   {0x1F48, 0x1F4D},   {0x1F50, 0x1F57},   {0x1F59, 0x1F59},
    {0x1F5B, 0x1F5B},   {0x1F5D, 0x1F5D},   {0x1F5F, 0x1F7D},   {0x1F80, 0x1FB4},   {0x1FB6, 0x1FBC},
    {0x1FBE, 0x1FBE},   {0x1FC2, 0x1FC4},   {0x1FC6, 0x1FCC},   {0x1FD0, 0x1FD3},   {0x1FD6, 0x1FDB},
    {0x1FE0, 0x1FEC},   {0x1FF2, 0x1FF4},   {0x1FF6, 0x1FFC},   {0x2102, 0x2102},   {0x2107, 0x2107},
    {0x210A, 0x2113},   {0x2115, 0x2115},   {0x2119, 0x211D},   {0x2124, 0x2124},   {0x2126, 0x2126},
    {0x2128, 0x2128},   {0x212A, 0x212D},   {0x212F, 0x2134},   {0x2139, 0x2139},   {0x213C, 0x213F},
    {0x2145, 0x2149},   {0x214E, 0x214E},   {0x2183, 0x2184},   {0x2C00, 0x2C7B},   {0x2C7E, 0x2CE4},
    {0x2CEB, 0x2CEE},   {0x2CF2, 0x2CF3},   {0xA640, 0xA66D},   {0xA680, 0xA69B},   {0xA722, 0xA76F},
    {0xA771, 0xA787},   {0xA78B, 0xA78E},   {0xAB70, 0xABBF},   {0xFB00, 0xFB06},   {0xFB13, 0xFB17},
    {0xFF21, 0xFF3A},   {0xFF41, 0xFF5A},   {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB},
    {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943},
};

// The punctuation class of deepseek-llm's third regex: !-/ :-~ ！-／ ：-～ ‘-‟ 　-。 (note that
// :-~ takes in the ASCII letters, and U+3000 is also \s).
constexpr CpRange kLlmPunctRanges[] = {
    {0x21, 0x2F}, {0x3A, 0x7E}, {0x2018, 0x201F}, {0x3000, 0x3002}, {0xFF01, 0xFF0F}, {0xFF1A, 0xFF5E},
};

template <size_t N>
bool in_ranges(uint32_t cp, const CpRange (&ranges)[N]) {
  const CpRange* it = std::upper_bound(std::begin(ranges), std::end(ranges), cp,
                                       [](uint32_t c, const CpRange& r) { return c < r.first; });
  return it != std::begin(ranges) && cp <= (it - 1)->last;
}

bool is_newline(uint32_t c) { return c == '\r' || c == '\n'; }
// [^\s\p{L}\p{N}]
bool is_other(uint8_t f) { return !(f & (kSpace | kLetter | kNumber)); }
bool is_ascii_alpha(uint32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_ascii_punct(uint32_t c) {
  return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) || (c >= 0x7B && c <= 0x7E);
}
bool is_kanji_kana(uint32_t c) { return (c >= 0x4E00 && c <= 0x9FA5) || (c >= 0x3040 && c <= 0x30FF); }
bool is_llm_cjk(uint32_t c) { return (c >= 0x0800 && c <= 0x9FA5) || (c >= 0xAC00 && c <= 0xD7FF); }

// A matcher tries its regex at position i of [.., e) and returns the end of the match, or i when
// the regex does not match there (none of these regexes can match the empty string).
using Matcher = size_t (*)(const CodepointText&, size_t i, size_t e);

size_t run_flags(const CodepointText& t, size_t i, size_t e, uint8_t mask) {
  while (i < e && (t.flags[i] & mask)) ++i;
  return i;
}

template <class Pred>
size_t run_cps(const CodepointText& t, size_t i, size_t e, Pred pred) {
  while (i < e && pred(t.cps[i])) ++i;
  return i;
}

size_t run_other(const CodepointText& t, size_t i, size_t e) {
  while (i < e && is_other(t.flags[i])) ++i;
  return i;
}

// The contraction after an apostrophe at i - 1: 's 't 're 've 'm 'll 'd. Returns its length after
// the apostrophe, 0 if none. With `fold`, letters match as Oniguruma's (?i) does: either case,
// and U+017F LATIN SMALL LETTER LONG S, whose case folding is 's'.
size_t contraction(const CodepointText& t, size_t i, size_t e, bool fold) {
  auto letter = [&](size_t k) -> uint32_t {
    const uint32_t c = t.cps[k];
    if (!fold) return c;
    if (c >= 'A' && c <= 'Z') return c + ('a' - 'A');
    return c == 0x17F ? 's' : c;
  };
  if (i >= e) return 0;
  const uint32_t a = letter(i);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 1;
  if (i + 1 >= e) return 0;
  const uint32_t b = letter(i + 1);
  return ((a == 'r' || a == 'v') && b == 'e') || (a == 'l' && b == 'l') ? 2 : 0;
}

// \s+(?!\S)|\s+ at a whitespace code point: a run followed by a non-space gives its last space
// back (so that " word" stays together) unless the run is that single space.
size_t match_space_run(const CodepointText& t, size_t i, size_t e) {
  const size_t j = run_flags(t, i, e, kSpace);
  return (j == e || j - i == 1) ? j : j - 1;
}

// \s*[\r\n]+|\s+(?!\S)|\s+ at a whitespace code point. \s*[\r\n]+ backtracks from the end of the
// run to its last \r or \n, so it ends right after that one.
size_t match_space_newline(const CodepointText& t, size_t i, size_t e) {
  const size_t j = run_flags(t, i, e, kSpace);
  for (size_t k = j; k > i; --k)
    if (is_newline(t.cps[k - 1])) return k;
  return (j == e || j - i == 1) ? j : j - 1;
}

size_t match_llama3(const CodepointText& t, size_t i, size_t e) {
  const uint32_t c = t.cps[i];
  const uint8_t f = t.flags[i];
  if (c == '\'')
    if (size_t n = contraction(t, i + 1, e, true)) return i + 1 + n;
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (f & kLetter) return run_flags(t, i + 1, e, kLetter);
  if (!is_newline(c) && !(f & kNumber) && i + 1 < e && (t.flags[i + 1] & kLetter))
    return run_flags(t, i + 2, e, kLetter);
  // \p{N}{1,3}
  if (f & kNumber) return run_flags(t, i + 1, std::min(e, i + 3), kNumber);
  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
  const size_t k = c == ' ' ? i + 1 : i;
  if (k < e && is_other(t.flags[k])) return run_cps(t, run_other(t, k + 1, e), e, is_newline);
  if (f & kSpace) return match_space_newline(t, i, e);
  return i;
}

size_t match_gpt2(const CodepointText& t, size_t i, size_t e) {
  const uint32_t c = t.cps[i];
  if (c == '\'')
    if (size_t n = contraction(t, i + 1, e, false)) return i + 1 + n;
  // ' ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+': the optional space only helps when a class follows.
  const size_t k = c == ' ' ? i + 1 : i;
  if (k < e) {
    const uint8_t g = t.flags[k];
    if (g & kLetter) return run_flags(t, k + 1, e, kLetter);
    if (g & kNumber) return run_flags(t, k + 1, e, kNumber);
    if (is_other(g)) return run_other(t, k + 1, e);
  }
  if (t.flags[i] & kSpace) return match_space_run(t, i, e);
  return i;
}

size_t match_digits3(const CodepointText& t, size_t i, size_t e) {
  return run_flags(t, i, std::min(e, i + 3), kNumber);
}

size_t match_kanji_kana(const CodepointText& t, size_t i, size_t e) { return run_cps(t, i, e, is_kanji_kana); }

size_t match_deepseek_v3(const CodepointText& t, size_t i, size_t e) {
  const uint32_t c = t.cps[i];
  const uint8_t f = t.flags[i];
  // [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+
  if (is_ascii_punct(c) && i + 1 < e && is_ascii_alpha(t.cps[i + 1])) return run_cps(t, i + 2, e, is_ascii_alpha);
  // [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
  constexpr uint8_t kLetterMark = kLetter | kMark;
  if (!is_newline(c) && !(f & (kLetter | kPunct | kSymbol)) && i + 1 < e && (t.flags[i + 1] & kLetterMark))
    return run_flags(t, i + 2, e, kLetterMark);
  if (f & kLetterMark) return run_flags(t, i + 1, e, kLetterMark);
  // ' ?[\p{P}\p{S}]+[\r\n]*'
  const size_t k = c == ' ' ? i + 1 : i;
  if (k < e && (t.flags[k] & (kPunct | kSymbol)))
    return run_cps(t, run_flags(t, k + 1, e, kPunct | kSymbol), e, is_newline);
  if (f & kSpace) return match_space_newline(t, i, e);
  return i;
}

size_t match_newline(const CodepointText& t, size_t i, size_t) { return is_newline(t.cps[i]) ? i + 1 : i; }

// \s?[class]+ : the optional space is taken when a class member follows it.
template <bool (*InClass)(uint32_t)>
size_t match_space_then_class(const CodepointText& t, size_t i, size_t e) {
  if ((t.flags[i] & kSpace) && i + 1 < e && InClass(t.cps[i + 1])) return run_cps(t, i + 2, e, InClass);
  return InClass(t.cps[i]) ? run_cps(t, i + 1, e, InClass) : i;
}
bool is_llm_letter(uint32_t c) { return in_ranges(c, kLlmLetterRanges); }
bool is_llm_punct(uint32_t c) { return in_ranges(c, kLlmPunctRanges); }

size_t match_llm_cjk(const CodepointText& t, size_t i, size_t e) { return run_cps(t, i, e, is_llm_cjk); }
size_t match_numbers(const CodepointText& t, size_t i, size_t e) { return run_flags(t, i, e, kNumber); }

Matcher matcher(Stage s) {
  switch (s) {
    case Stage::kLlama3: return match_llama3;
    case Stage::kGpt2: return match_gpt2;
    case Stage::kDigits3: return match_digits3;
    case Stage::kKanjiKana: return match_kanji_kana;
    case Stage::kDeepseekV3: return match_deepseek_v3;
    case Stage::kNewline: return match_newline;
    case Stage::kLlmLetters: return match_space_then_class<is_llm_letter>;
    case Stage::kLlmPunct: return match_space_then_class<is_llm_punct>;
    case Stage::kLlmCjk: return match_llm_cjk;
    case Stage::kNumbers: return match_numbers;
    case Stage::kTrailingSpace: break;
  }
  return nullptr;
}

// Hugging Face's Split with behavior "isolated": the leftmost match is found again and again (as
// Oniguruma's search does); every match is a piece, and so is every run of text between matches.
template <class Next>
void find_matches(const CodepointText& t, size_t begin, size_t end, Matcher m, Next&& next) {
  size_t gap = begin;
  for (size_t i = begin; i < end;) {
    const size_t j = m(t, i, end);
    if (j == i) {
      ++i;
      continue;
    }
    if (gap < i) next(gap, i);
    next(i, j);
    i = gap = j;
  }
  if (gap < end) next(gap, end);
}

struct NamedStages {
  std::string_view name;
  std::vector<Stage> stages;
};

const std::vector<NamedStages>& known() {
  static const std::vector<NamedStages> k = {
      {"glm4", {Stage::kLlama3}},
      {"chatglm-bpe", {Stage::kLlama3}},
      {"llama3", {Stage::kLlama3}},
      {"llama-v3", {Stage::kLlama3}},
      {"llama-bpe", {Stage::kLlama3}},
      {"deepseek-v3", {Stage::kDigits3, Stage::kKanjiKana, Stage::kDeepseekV3}},
      {"deepseek-llm",
       {Stage::kNewline, Stage::kLlmLetters, Stage::kLlmPunct, Stage::kTrailingSpace, Stage::kLlmCjk, Stage::kNumbers}},
      {"gpt-2", {Stage::kGpt2}},
      {"gpt2", {Stage::kGpt2}},
  };
  return k;
}

}  // namespace

void CodepointText::assign(std::string_view text) {
  if (text.size() >= (uint64_t(1) << 32)) fail("text of {} bytes is too long to tokenize (4 GiB at most)", text.size());
  cps.clear();
  flags.clear();
  offsets.clear();
  cps.reserve(text.size());
  flags.reserve(text.size());
  offsets.reserve(text.size() + 1);
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = 0; i < text.size();) {
    const utf8::Step s = utf8::next(p + i, text.size() - i);
    const bool ok = s.status == utf8::Status::kValid;
    const uint32_t cp = ok ? s.cp : kInvalidByte + p[i];
    cps.push_back(cp);
    flags.push_back(ok ? unicode::flags(cp) : 0);
    offsets.push_back(uint32_t(i));
    i += ok ? s.len : 1;
  }
  offsets.push_back(uint32_t(text.size()));
}

PreTokenizer PreTokenizer::from_name(std::string_view name) {
  for (const auto& k : known())
    if (k.name == name) return PreTokenizer(k.stages);
  std::string list;
  for (std::string_view n : names()) list += (list.empty() ? "" : ", ") + std::string(n);
  fail("unknown pre-tokenizer '{}' (tokenizer.ggml.pre); supported: {}", name, list);
}

std::span<const std::string_view> PreTokenizer::names() {
  static const auto n = [] {
    std::vector<std::string_view> v;
    for (const auto& k : known()) v.push_back(k.name);
    return v;
  }();
  return n;
}

void PreTokenizer::split_range(const CodepointText& t, size_t stage, size_t begin, size_t end, Pieces& out) const {
  if (stage == stages_.size()) {
    out.emplace_back(uint32_t(begin), uint32_t(end));
    return;
  }
  auto next = [&](size_t b, size_t e) { split_range(t, stage + 1, b, e, out); };
  if (stages_[stage] == Stage::kTrailingSpace) {
    // \s+$ matches only where a whitespace run reaches the end of the piece. ($ also matches
    // before a \n, but deepseek-llm's first step has already isolated every \n.)
    size_t s = end;
    while (s > begin && (t.flags[s - 1] & kSpace)) --s;
    if (begin < s) next(begin, s);
    if (s < end) next(s, end);
    return;
  }
  find_matches(t, begin, end, matcher(stages_[stage]), next);
}

void PreTokenizer::split(const CodepointText& text, Pieces& pieces) const {
  const size_t first = pieces.size();
  if (text.size() > 0) split_range(text, 0, 0, text.size(), pieces);
  for (size_t i = first; i < pieces.size(); ++i)
    pieces[i] = {text.offsets[pieces[i].first], text.offsets[pieces[i].second]};
}

std::vector<std::string> PreTokenizer::split(std::string_view text) const {
  CodepointText t;
  t.assign(text);
  Pieces pieces;
  split(t, pieces);
  std::vector<std::string> out;
  out.reserve(pieces.size());
  for (auto [b, e] : pieces) out.emplace_back(text.substr(b, e - b));
  return out;
}

}  // namespace sparsemla::tokenizer
