#!/usr/bin/env python3
"""Make tests/data/tokenizer/cases.json: what Hugging Face `tokenizers` does with the fixture vocabularies.

tests/unit/test_tokenizer.cpp compares sparsemla's tokenizer with this file. For each fixture model
(tests/fixtures/{glm_pub,dsv32_pub}/model-f32.gguf) the script reads the vocabulary, merges and
token types with a small GGUF reader of its own (no project code), rebuilds the tokenizer in
Hugging Face `tokenizers` the way the original tokenizer.json describes it, and records:

  * pieces:    for every text and every supported pre-tokenizer, the pieces its Split steps cut
               the text into (pre_tokenize_str; no special-token handling);
  * encodings: token ids of every text (encode(text, add_special_tokens=False)), for each fixture
               with its own pre-tokenizer, and for glm_pub's vocabulary also with the others;
  * decodings: random id sequences (characters cut between tokens included) and their decode(),
               with and without skip_special_tokens.

The tokenizer is built as:
    models.BPE(vocab, merges, byte_fallback=False, ignore_merges=<True for llama3 only>)
    pre_tokenizer = Sequence([Split(Regex(r), behavior="isolated") for r in REGEXES[pre]]
                             + [ByteLevel(add_prefix_space=False, use_regex=False)])
    decoder = decoders.ByteLevel()
    added tokens: token_type 3 (control) as special, 4 (user-defined) as normal, normalized=False.
Token type 5 (unused padding) is left out of the vocabulary: those ids have no text.

The script checks itself: decode(encode(text)) must give the text back for every text.

Usage (needs only the `tokenizers` package; numpy is not used):
    python3 scripts/reference/make_tokenizer_cases.py [--fixtures tests/fixtures] \
        [--out tests/data/tokenizer/cases.json] [--seed 20250101]
"""
from __future__ import annotations

import argparse
import json
import random
import struct
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
import tokenizers

REPO = Path(__file__).resolve().parents[2]
FIXTURES = ("glm_pub", "dsv32_pub")

# ---------------------------------------------------------------------------------------------
# The pre-tokenizer regexes, as the original tokenizer.json files (and llama.cpp's
# src/llama-vocab.cpp) write them.

LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
DSV3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
# deepseek-llm's letter class, written out as code point ranges so that no tool can normalize
# its characters (U+1F7D, U+1FBE, U+2126, U+212A... have canonical equivalents).
LLM_LETTERS = [
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377), (0x37B, 0x37D), (0x37F, 0x37F),
    (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481),
    (0x48A, 0x52F), (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D),
    (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC),
    (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102),
    (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126),
    (0x2128, 0x2128), (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF3),
    (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF),
    (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3),
    (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
]


def char_class(ranges) -> str:
    return "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in ranges)


LLM = [
    "[\r\n]",
    "\\s?[" + char_class(LLM_LETTERS) + "]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
]
REGEXES = {"glm4": [LLAMA3], "llama3": [LLAMA3], "gpt-2": [GPT2], "deepseek-v3": DSV3, "deepseek-llm": LLM}
NATIVE = {"glm_pub": "glm4", "dsv32_pub": "deepseek-v3"}

# ---------------------------------------------------------------------------------------------
# A minimal GGUF metadata reader (little-endian, versions 2 and 3).

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path: Path) -> dict:
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        s = data[pos:pos + n].decode("utf-8")
        pos += n
        return s

    def value(t: int):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("<I"), take("<Q")
            return [value(et) for _ in range(n)]
        return take(SCALARS[t])

    if data[:4] != b"GGUF":
        sys.exit(f"{path}: not a GGUF file")
    pos = 4
    version = take("<I")
    if version not in (2, 3):
        sys.exit(f"{path}: GGUF version {version} not supported")
    take("<Q")  # tensor count
    n_kv = take("<Q")
    kv = {}
    for _ in range(n_kv):
        key = string()
        kv[key] = value(take("<I"))
    return kv


# ---------------------------------------------------------------------------------------------

def build_tokenizer(kv: dict, pre: str) -> Tokenizer:
    tokens = kv["tokenizer.ggml.tokens"]
    types = kv.get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty != 5}
    merges = []
    for m in kv["tokenizer.ggml.merges"]:
        sp = m.find(" ", 1)  # as llama.cpp splits them
        merges.append((m[:sp], m[sp + 1:]))
    bpe = models.BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=(pre == "llama3"))
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in REGEXES[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    return tk


def splitter(pre: str):
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in REGEXES[pre]])


FIXED_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks were striking thirteen.",
    "In 1969, 600 million people watched; 1234567 is a number, so is 3.14159 and 1,000,000 and 0x1F.",
    "I'M here, YOU'RE there, they'll go, She'S, we'VE, it'd, DON'T, don't, 'll, 'Ll, O'Neil's, rock'n'roll",
    "'ſt x'ſ 'ſ 'S 's 'T 're 'RE 'rE 'Ve 'M 'LL 'D",
    "a  b   c    d\te\t\tf \t g",
    "\n\n\n",
    "line one\nline two\r\nline three\n\n  indented\n\t\ttabbed\n",
    "trailing spaces   ",
    "  leading spaces",
    " ",
    "\t",
    "x \n y",
    "  \n  x",
    "\u3000full-width space\u3000x \u00a0nbsp\u00a0x a\u2028b a\u2029b \u0085nel \u000b\u000cvt-ff",
    "\u001c\u001d\u001e\u001f not spaces for Oniguruma",
    "你好，世界！这是一个测试。我们在2024年开始。",
    "こんにちは、世界。カタカナとひらがなと漢字。ｶﾀｶﾅ",
    "안녕하세요 세계, 반갑습니다.",
    "emoji 👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 heart ❤️ smile😀😀",
    "café naïve résumé Ångström e\u0301 o\u0308 n\u0303",
    "Z͑ͫ̓ͪ̂ͫ̽͏̴̙̤̞͉͚̯̞̠͍A̴̵̜̰͔ͫ͗͢L̠ͨͧͩ͘G̴̻͈͍͔̹̑͗̎̅͛́",
    "नमस्ते दुनिया, สวัสดีครับ, ሰላም",
    "مرحبا بالعالم ١٢٣٤٥ שלום עולם \u200frtl\u200e",
    "!!!???... --- ... «quoted» “smart quotes” ‘single’ a—b–c ¿qué? ¡sí!",
    "$100 €50 ¥30 £20 ©2024 ®™ +-*/=<>^~|`",
    "@#%^&*() [](){}<> C++ C# e.g. i.e. .com .NET",
    "def foo(x, y=2):\n    return x ** 2 + y  # comment\n\nclass Bar:\n    pass\n",
    "int main() {\n\tstd::vector<int> v{1, 2, 3};\n\treturn v.size() > 0 ? 0 : 1;\n}\n",
    '{"key": "value", "n": 12345, "list": [1, 2.5, -3e10], "nested": {"a": null}}',
    "x=1;y=22;z=333;w=4444;v=55555",
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
    "https://example.com/path/to/page?q=1&r=two#frag mailto:someone@example.org",
    "Ⅻ ½ ² ³ ⁴ ₅ ① ２０２４年 ١٢٣ ०१२ ௧௨",
    "ǅungla ǈ ǋ ʰʲ ˈstress ꜰ ꞵ ß ẞ ﬁ ﬂ K Ω Å",
    "Ὗ ώ ι ΐ Ί ᾼ Армения ա բ Ⴀ ᏸ",
    "\u200d\u200c\u2060\ufeffBOM\u00ad soft hyphen",
    "\u0000nul \u0001\u0002\u0007 \u007f del",
    "private \ue000\uf8ff plane16 \U00100000 max \U0010ffff tag \U000e0041",
    "near borders \u9fa5\u9fa6 \u3040\u309f\u30a0\u30ff \u07ff\u0800 \uac00\ud7ff\ud7a3",
    "<|user|>hello<|assistant|>hi there<|observation|>",
    "[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\nWhat is 2+2?<|assistant|>\n<think>\nsimple</think>\n4",
    "<|user| not closed <<|user|>> [MASK][gMASK][sMASK] <sop><eop>",
    "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi<｜Assistant｜><think>\n\n</think>Hello!<｜end▁of▁sentence｜>",
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "ab" * 300,
    "9" * 50,
    " " * 100 + "x",
    "\n" * 40,
    "a" + " " * 33 + "b" + "\t" * 7,
    "",
]

# Pools for random texts: every class the regexes tell apart, and code points at range borders.
POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " ", " ", "  ", "\t", "\n", "\r", "\r\n", "\u3000", "\u00a0", "\u0085", "\u2028", "\u000b",
    "'", "'s", "'S", "'ll", "'LL", "'re", "'Ve", "'d", "'m", "'t", "\u017f",
    "!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~",
    "«»“”‘’—–…·•¿¡§¶†‡",
    "€$¥£¢©®™°±×÷∑∞≠≤≥←→⇒♠♥",
    "\u0300\u0301\u0302\u0308\u0327\u0903\u093e\u20dd",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
    "\u9fa5\u9fa6\u4e00\u4dff\u3400",
    "ぁあいうえおかきくけこゟ゠アイウエオカキクケコヿ\u3040\u309f",
    "가나다라마바사아자차카타파하\uac00\ud7a3\ud7ff",
    "\u0800\u07ff\u0900\u0e01\u1000",
    "😀👍🏽❤️🇫🇷\u200d🎉🚀",
    "ÀÖØöøƺƼǄʓʕʯͰͶͻͿΆΈΌΎΣϷҊԱႠᎠᏸᲐᴀᵫᵹḀὟ\u1f7d\u1fbe\u1fd3\u1fdb\u2126\u212aⅎↃⰀꙀꚀꜢꭰﬀﬓＡａ",
    "աբգդեզ",
    "ǅǈǋʰˈ",
    "½²³①ⅫⅠ٣٤۵०१",
    "ابتثجحخ",
    "\u200c\u200e\u200f\ufeff\u00ad",
    "\U0001d400\U0001d7ce\U00010400\U0001e900",
]


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 25)):
        pool = rng.choice(POOLS)
        if len(pool) > 3 and rng.random() < 0.7:
            parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        else:
            parts.append(pool)
    return "".join(parts)


def dump(value, depth: int = 0) -> str:
    """JSON with one list item per line down to the per-text level, compact below it."""
    compact = lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    if depth >= 3 or not isinstance(value, (dict, list)) or not value:
        return compact(value)
    if isinstance(value, dict):
        items = [f"{compact(k)}:{dump(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n}" + ("\n" if depth == 0 else "")
    return "[\n" + ",\n".join(dump(v, depth + 1) for v in value) + "\n]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", type=Path, default=REPO / "tests/fixtures")
    ap.add_argument("--out", type=Path, default=REPO / "tests/data/tokenizer/cases.json")
    ap.add_argument("--seed", type=int, default=20250101)
    ap.add_argument("--random-texts", type=int, default=200)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    texts = FIXED_TEXTS + [random_text(rng) for _ in range(args.random_texts)]
    kvs = {f: read_gguf_metadata(args.fixtures / f / "model-f32.gguf") for f in FIXTURES}
    for f, kv in kvs.items():
        if kv.get("tokenizer.ggml.model") != "gpt2" or kv.get("tokenizer.ggml.pre") != NATIVE[f]:
            sys.exit(f"{f}: unexpected tokenizer {kv.get('tokenizer.ggml.model')}/{kv.get('tokenizer.ggml.pre')}")

    pieces = {}
    for pre in REGEXES:
        sp = splitter(pre)
        pieces[pre] = [[p for p, _ in sp.pre_tokenize_str(t)] for t in texts]
        for t, ps in zip(texts, pieces[pre]):
            if "".join(ps) != t:
                sys.exit(f"pieces of {t!r} under {pre} do not add up to the text")

    encodings = []
    runs = [("glm_pub", pre) for pre in REGEXES] + [("dsv32_pub", "deepseek-v3")]
    for fixture, pre in runs:
        tk = build_tokenizer(kvs[fixture], pre)
        ids = [tk.encode(t, add_special_tokens=False).ids for t in texts]
        for t, i in zip(texts, ids):
            back = tk.decode(i, skip_special_tokens=False)
            if back != t:
                sys.exit(f"{fixture}/{pre}: decode(encode({t!r})) = {back!r}")
        encodings.append({"fixture": fixture, "pre": pre, "ids": ids})

    decodings = []
    for fixture in FIXTURES:
        kv = kvs[fixture]
        tk = build_tokenizer(kv, NATIVE[fixture])
        usable = [i for i, ty in enumerate(kv["tokenizer.ggml.token_type"]) if ty in (1, 3)]
        for _ in range(100):
            ids = [rng.choice(usable) for _ in range(rng.randint(1, 12))]
            decodings.append({
                "fixture": fixture,
                "ids": ids,
                "text": tk.decode(ids, skip_special_tokens=False),
                "text_skip_special": tk.decode(ids, skip_special_tokens=True),
            })

    out = {
        "generator": "scripts/reference/make_tokenizer_cases.py",
        "tokenizers_version": tokenizers.__version__,
        "seed": args.seed,
        "regexes": REGEXES,
        "texts": texts,
        "pieces": pieces,
        "encodings": encodings,
        "decodings": decodings,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump(out), encoding="utf-8")
    print(f"{args.out}: {len(texts)} texts, {len(pieces)} pre-tokenizers, {len(encodings)} encodings, "
          f"{len(decodings)} decodings (tokenizers {tokenizers.__version__})")


if __name__ == "__main__":
    main()
