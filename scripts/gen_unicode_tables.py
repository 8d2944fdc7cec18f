#!/usr/bin/env python3
"""Generate src/tokenizer/unicode_tables.cpp from the Unicode Character Database.

The pre-tokenizer regexes of byte-level BPE tokenizers use the classes \\p{L}, \\p{N}, \\p{P},
\\p{S}, \\p{M} and \\s. Hugging Face tokenizers evaluates them with Oniguruma, where
  \\p{X}  is General_Category X (all its subcategories), and
  \\s     is U+0009..U+000D, U+0085 and the categories Zs, Zl, Zp (Oniguruma's doc/RE).
This script reads UnicodeData.txt (Debian: package unicode-data) and writes one sorted table of
code point ranges, each with the set of those classes it belongs to; runs of neighbouring code
points with the same set are merged, code points in none of the classes are left out.

Usage:
    python3 scripts/gen_unicode_tables.py [--ucd /usr/share/unicode] [--out src/tokenizer/unicode_tables.cpp]
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# General category (first letter) -> flag name in src/tokenizer/unicode.h.
CATEGORY_FLAGS = {"L": "kLetter", "N": "kNumber", "P": "kPunct", "S": "kSymbol", "M": "kMark"}
SPACE_FLAG = "kSpace"
SPACE_CATEGORIES = {"Zs", "Zl", "Zp"}
SPACE_CODEPOINTS = set(range(0x09, 0x0E)) | {0x85}


def read_categories(path: Path) -> dict[int, str]:
    """Code point -> two-letter general category; <..., First>/<..., Last> pairs are expanded."""
    cats: dict[int, str] = {}
    first: int | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        fields = line.split(";")
        cp, name, cat = int(fields[0], 16), fields[1], fields[2]
        if name.endswith(", First>"):
            first = cp
            continue
        if name.endswith(", Last>"):
            if first is None:
                sys.exit(f"{path}: {name} without its First line")
            for c in range(first, cp + 1):
                cats[c] = cat
            first = None
            continue
        cats[cp] = cat
    return cats


def read_version(ucd: Path) -> str:
    text = (ucd / "ReadMe.txt").read_text(encoding="utf-8")
    m = re.search(r"Version (\d+\.\d+\.\d+) of the Unicode Standard", text)
    if not m:
        sys.exit(f"{ucd / 'ReadMe.txt'}: no 'Version X.Y.Z of the Unicode Standard' line")
    return m.group(1)


def flags_of(cp: int, cat: str | None) -> tuple[str, ...]:
    flags = []
    if cat is not None and cat[0] in CATEGORY_FLAGS:
        flags.append(CATEGORY_FLAGS[cat[0]])
    if cp in SPACE_CODEPOINTS or cat in SPACE_CATEGORIES:
        flags.append(SPACE_FLAG)
    return tuple(flags)


def build_ranges(cats: dict[int, str]) -> list[tuple[int, int, tuple[str, ...]]]:
    ranges: list[tuple[int, int, tuple[str, ...]]] = []
    for cp in range(0x110000):
        f = flags_of(cp, cats.get(cp))
        if not f:
            continue
        if ranges and ranges[-1][1] == cp - 1 and ranges[-1][2] == f:
            ranges[-1] = (ranges[-1][0], cp, f)
        else:
            ranges.append((cp, cp, f))
    return ranges


def render(ranges, version: str) -> str:
    out = [
        "// GENERATED FILE, do not edit. Made by scripts/gen_unicode_tables.py from UnicodeData.txt of",
        f"// Unicode {version} (Debian package unicode-data). Regenerate with:",
        "//   python3 scripts/gen_unicode_tables.py",
        "// Code point ranges and the regex classes they belong to (\\p{L}, \\p{N}, \\p{P}, \\p{S},",
        "// \\p{M} as general categories; \\s as Oniguruma defines it: U+0009..U+000D, U+0085, Zs, Zl, Zp).",
        '#include "tokenizer/unicode.h"',
        "",
        "namespace sparsemla::tokenizer::unicode {",
        "",
        f'const char* const kUnicodeVersion = "{version}";',
        "",
        "const Range kRanges[] = {",
    ]
    for first, last, flags in ranges:
        out.append(f"    {{0x{first:X}, 0x{last:X}, {' | '.join(flags)}}},")
    out += [
        "};",
        "const size_t kRangeCount = sizeof(kRanges) / sizeof(kRanges[0]);",
        "",
        "}  // namespace sparsemla::tokenizer::unicode",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ucd", type=Path, default=Path("/usr/share/unicode"),
                    help="folder with UnicodeData.txt and ReadMe.txt")
    ap.add_argument("--out", type=Path, default=REPO / "src/tokenizer/unicode_tables.cpp")
    args = ap.parse_args()
    data = args.ucd / "UnicodeData.txt"
    if not data.exists():
        sys.exit(f"{data} not found: install Debian's unicode-data package (apt-get install unicode-data)")
    ranges = build_ranges(read_categories(data))
    args.out.write_text(render(ranges, read_version(args.ucd)), encoding="utf-8")
    print(f"{args.out}: {len(ranges)} ranges")


if __name__ == "__main__":
    main()
