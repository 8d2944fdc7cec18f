// Python's str semantics over UTF-8 byte strings: templates index, slice, split and case-map strings
// by code point exactly as Python does, and print numbers and strings with Python's repr().
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace sparsemla::chat::jinja::py {

// Decodes the code point at `i` and advances past it. A byte that does not start a valid UTF-8
// sequence decodes to U+DC80+byte (Python's surrogateescape) so that encoding gives the byte back.
char32_t next_code_point(std::string_view s, size_t& i);
void append_code_point(std::string& out, char32_t c);
std::u32string decode(std::string_view s);
std::string encode(std::u32string_view s);
size_t length(std::string_view s);  // in code points
bool is_ascii(std::string_view s);
size_t byte_offset(std::string_view s, size_t code_points);  // clamped to s.size()

bool is_space(char32_t c);      // str.isspace
bool is_printable(char32_t c);  // str.isprintable, without the table of unassigned code points
bool is_alpha(char32_t c);      // letters of the scripts the case tables cover, plus any other non-ASCII letter-ish
bool is_digit(char32_t c);
bool is_word(char32_t c);       // regex \w

// Case mapping covers ASCII, Latin-1, Latin Extended-A and Additional, Greek, Cyrillic, Armenian and
// the fullwidth Latin letters; other scripts have no case.
std::string upper(std::string_view s);
std::string lower(std::string_view s);
std::string capitalize(std::string_view s);
std::string title(std::string_view s);  // str.title(): a letter after a cased letter is lowered
std::string swapcase(std::string_view s);
bool islower(std::string_view s);
bool isupper(std::string_view s);

// strip/lstrip/rstrip; chars == nullopt strips whitespace.
std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right);
// str.split / str.rsplit; sep == nullopt splits on runs of whitespace. maxsplit < 0 means no limit.
std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit);
std::vector<std::string> rsplit(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit);
std::vector<std::string> splitlines(std::string_view s, bool keepends);
std::string replace(std::string_view s, std::string_view old, std::string_view repl, int64_t count);
size_t count(std::string_view s, std::string_view sub);  // non-overlapping, like str.count
// str.find / str.rfind in code points over s[start:end] (Python slice bounds); -1 when absent.
int64_t find(std::string_view s, std::string_view sub, std::optional<int64_t> start, std::optional<int64_t> end,
             bool reverse);

std::string repr(std::string_view s);  // repr() of a str: quotes and escapes as Python 3 does
std::string float_repr(double x);      // repr() of a float: shortest round-trip digits
}  // namespace sparsemla::chat::jinja::py
