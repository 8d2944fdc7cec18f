#!/usr/bin/env bash
# libFuzzer targets (clang, -fsanitize=fuzzer,address,undefined) for the GGUF parser.
#   scripts/fuzz.sh smoke        replay the committed corpus and fuzz for 30 s (part of the tests)
#   scripts/fuzz.sh run SECONDS  fuzz for SECONDS, keeping new inputs in build-fuzz/corpus
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-smoke}
secs=${2:-30}
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DSPARSEMLA_FUZZ=ON \
  -DSPARSEMLA_TESTS=ON -DSPARSEMLA_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target fuzz_gguf
mkdir -p build-fuzz/corpus build-fuzz/findings
cp -r tests/malformed/. build-fuzz/seed
find tests/fixtures -name '*.gguf' -exec cp {} build-fuzz/seed/ \;
if [ "$mode" = smoke ]; then secs=30; fi
build-fuzz/tests/fuzz/fuzz_gguf -max_total_time="$secs" -max_len=65536 -rss_limit_mb=2048 \
  -artifact_prefix=build-fuzz/findings/ -print_final_stats=1 build-fuzz/corpus build-fuzz/seed 2>&1 |
  grep -E "stat::|Done|ERROR|SUMMARY|crash" || true
if ls build-fuzz/findings/* >/dev/null 2>&1; then
  echo "fuzz: findings in build-fuzz/findings"
  exit 1
fi
echo "fuzz: no findings"
